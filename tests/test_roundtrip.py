"""Everything torch can put in a tensor comes back equal, with the same sharing, through every entry point."""

from __future__ import annotations

import collections
import io
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp

from .conftest import TIED_NET_ALLOW, TiedNet

ALL_DTYPES = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)},
    key=str,
)
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def roundtrip_path(obj: Any, tmp_path: Path, **load_kwargs: Any) -> Any:
    path = tmp_path / "obj.zcp"
    zp.dump(obj, path)
    return zp.load(path, **load_kwargs)


def roundtrip_bytes(obj: Any, tmp_path: Path, **load_kwargs: Any) -> Any:
    return zp.loads(zp.dumps(obj), **load_kwargs)


def roundtrip_file(obj: Any, tmp_path: Path, **load_kwargs: Any) -> Any:
    path = tmp_path / "obj.zcp"
    with open(path, "wb") as f:
        zp.dump(obj, f)
    with open(path, "rb") as f:
        return zp.load(f, **load_kwargs)


def roundtrip_memfd(obj: Any, tmp_path: Path, **load_kwargs: Any) -> Any:
    with zp.freeze(obj) as snap:
        return snap.load(**load_kwargs)


ROUNDTRIPS = [roundtrip_path, roundtrip_bytes, roundtrip_file, roundtrip_memfd]


@pytest.fixture(params=ROUNDTRIPS, ids=lambda f: f.__name__.removeprefix("roundtrip_"))
def roundtrip(request: pytest.FixtureRequest) -> Callable[..., Any]:
    return request.param  # type: ignore[no-any-return]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """A tensor of ``dtype`` with non-trivial bytes (built through uint8, which every dtype can view)."""
    if dtype in QUANTIZED:
        base = torch.linspace(-2, 2, 15).reshape(3, 5)
        if dtype in (torch.quint4x2, torch.quint2x4):
            return torch.quantize_per_tensor(base.abs(), 0.25, 0, dtype)
        return torch.quantize_per_tensor(base, 0.1, 3 if dtype is not torch.qint8 else 0, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = (torch.arange(n * itemsize, dtype=torch.int64) * 37 % 251).to(torch.uint8)
    if dtype is torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, including dtype, shape, strides, offset; NaNs compare equal."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_quantized:
        return bool(torch.equal(a.int_repr(), b.int_repr())) and a.qscheme() == b.qscheme()
    if a.layout != torch.strided:
        return same(a.to_dense(), b.to_dense())
    if a.stride() != b.stride() or a.storage_offset() != b.storage_offset():
        return False
    return bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(-1).view(torch.uint8).numpy()
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype(dtype: torch.dtype, roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized creation functions warn that they are deprecated
        tensor = make_tensor(dtype)
    loaded = roundtrip({"t": tensor, "scalar": make_tensor(dtype, ())}, tmp_path)
    assert same(loaded["t"], tensor)
    assert loaded["scalar"].dim() == 0 or dtype in QUANTIZED


def test_all_dtypes_covered() -> None:
    names = {str(d) for d in ALL_DTYPES}
    for expected in ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int64", "float16", "bfloat16",
                     "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"):  # fmt: skip
        assert f"torch.{expected}" in names


def test_zero_dim_empty_and_views(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    obj = {
        "zero_dim": torch.tensor(3.5),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 7, dtype=torch.int16),
        "base": base,
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "offset": base[4:],
        "expanded": torch.ones(1, 3).expand(4, 3),
    }
    loaded = roundtrip(obj, tmp_path)
    for key, tensor in obj.items():
        assert same(loaded[key], tensor), key
    # The views still share the base's storage after loading, at the same offsets.
    ptr = loaded["base"].untyped_storage().data_ptr()
    for key in ("transposed", "strided", "offset"):
        assert loaded[key].untyped_storage().data_ptr() == ptr, key
    loaded["base"][5, 0] = -1.0
    assert loaded["offset"][1, 0] == -1.0


def test_tied_weights_stay_tied(roundtrip: Callable[..., Any], tmp_path: Path, tied_net: TiedNet) -> None:
    loaded = roundtrip(tied_net, tmp_path, allow=TIED_NET_ALLOW)
    assert loaded.head.weight is loaded.embed.weight
    state = roundtrip(tied_net.state_dict(), tmp_path)
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    with torch.no_grad():
        state["head.weight"][0, 0] = 42.0
    assert state["embed.weight"][0, 0] == 42.0


def test_module_parameters_buffers_and_outputs(
    roundtrip: Callable[..., Any], tmp_path: Path, tied_net: TiedNet
) -> None:
    loaded = roundtrip(tied_net, tmp_path, allow=TIED_NET_ALLOW)
    assert isinstance(loaded, TiedNet)
    assert not loaded.training
    for (name, p), (name2, q) in zip(
        tied_net.named_parameters(remove_duplicate=False), loaded.named_parameters(remove_duplicate=False), strict=True
    ):
        assert name == name2
        assert type(q) is torch.nn.Parameter
        assert q.requires_grad == p.requires_grad, name
        assert same(p.detach(), q.detach()), name
    assert loaded.body[0].bias.requires_grad is False
    assert same(loaded.scale, tied_net.scale)
    assert "scale" in dict(loaded.named_buffers())
    tokens = torch.tensor([[1, 2, 3, 15]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), tied_net(tokens))
    # Gradients flow into the loaded parameters.
    loaded(tokens).sum().backward()
    assert loaded.embed.weight.grad is not None


def test_nested_containers(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    t = torch.randn(4)
    obj = {
        "list": [t, (t, {"deep": [t[1:]]})],
        "ordered": collections.OrderedDict(a=t, b=None),
        "set": {1, 2, 3},
        "frozen": frozenset({"x"}),
        "bytes": b"\x00\x01",
        "bytearray": bytearray(b"ab"),
        "complex": 1 + 2j,
        "slice": slice(1, 5, 2),
        "range": range(3),
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "dtype": torch.bfloat16,
        "counter": collections.Counter("aab"),
        "defaultdict": collections.defaultdict(list, {"k": [1]}),
        "deque": collections.deque([1, 2]),
    }
    loaded = roundtrip(obj, tmp_path, allow=["builtins:range"])  # range amplifies: never allowed by default
    assert same(loaded["list"][0], t)
    assert loaded["list"][1][0] is loaded["list"][0]  # memo: the same tensor object stays one object
    assert loaded["list"][1][1]["deep"][0].data_ptr() == loaded["list"][0].data_ptr() + 4
    for key in ("set", "frozen", "bytes", "bytearray", "complex", "slice", "range", "size", "device", "dtype"):
        assert loaded[key] == obj[key], key
    assert loaded["counter"] == obj["counter"]
    assert loaded["defaultdict"]["missing"] == []
    assert isinstance(loaded["ordered"], collections.OrderedDict)


def test_meta_tensors(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    with torch.device("meta"):
        module = torch.nn.Linear(1000, 1000)
    obj = {"meta": torch.empty(2, 3, dtype=torch.float16, device="meta"), "module": module}
    loaded = roundtrip(obj, tmp_path, allow=[torch.nn.Linear])
    assert loaded["meta"].is_meta and loaded["meta"].shape == (2, 3) and loaded["meta"].dtype == torch.float16
    assert loaded["module"].weight.is_meta and loaded["module"].weight.shape == (1000, 1000)


def test_meta_storage_takes_no_space(tmp_path: Path) -> None:
    with torch.device("meta"):
        module = torch.nn.Linear(4096, 4096)
    assert len(zp.dumps(module)) < 16_384


def test_untyped_and_typed_storages_directly(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    t = torch.arange(8, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, but still reachable
        typed = t.storage()
    obj = {"untyped": t.untyped_storage(), "typed": typed, "tensor": t}
    loaded = roundtrip(obj, tmp_path)
    assert isinstance(loaded["untyped"], torch.UntypedStorage)
    assert isinstance(loaded["typed"], torch.storage.TypedStorage)
    assert loaded["typed"].dtype == torch.int32
    assert loaded["untyped"].data_ptr() == loaded["tensor"].data_ptr() == loaded["typed"].data_ptr()
    assert bytes(loaded["untyped"]) == bytes(t.untyped_storage())


def test_legacy_storage_class(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = torch.FloatStorage(4).fill_(2.5)
        loaded = roundtrip({"s": legacy}, tmp_path)["s"]
        assert loaded.dtype == torch.float32
        assert list(loaded) == [2.5] * 4


def test_sparse_tensors(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    dense = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    obj = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc()}
    loaded = roundtrip(obj, tmp_path)
    for key, tensor in obj.items():
        assert loaded[key].layout == tensor.layout, key
        assert torch.equal(loaded[key].to_dense(), dense), key


def test_quantized_per_channel(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(
            torch.randn(4, 3), torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 1, 2, 3]), 0, torch.qint8
        )
    loaded = roundtrip({"q": q}, tmp_path)["q"]
    assert same(loaded, q)
    assert torch.equal(loaded.q_per_channel_scales(), q.q_per_channel_scales())


def test_conj_and_neg_views(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j])
    loaded = roundtrip({"conj": c.conj(), "c": c}, tmp_path)
    assert torch.equal(loaded["conj"], c.conj())
    assert torch.equal(loaded["c"], c)


def test_nested_tensor(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    loaded = roundtrip({"nt": nt}, tmp_path)["nt"]
    assert loaded.is_nested
    assert [x.tolist() for x in loaded.unbind()] == [x.tolist() for x in nt.unbind()]


class TaggedTensor(torch.Tensor):
    """A tensor subclass (pickles through torch's _rebuild_from_type_v2)."""


def test_tensor_subclass_and_python_state(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    sub = torch.arange(4.0).as_subclass(TaggedTensor)
    plain = torch.arange(3.0)
    plain.note = "hello"  # type: ignore[attr-defined]
    param = torch.nn.Parameter(torch.ones(2))
    param.tag = "p"  # type: ignore[attr-defined]
    loaded = roundtrip({"sub": sub, "plain": plain, "param": param}, tmp_path, allow=[TaggedTensor])
    assert type(loaded["sub"]) is TaggedTensor and torch.equal(loaded["sub"], sub)
    assert loaded["plain"].note == "hello"
    assert loaded["param"].tag == "p" and isinstance(loaded["param"], torch.nn.Parameter)


def test_requires_grad_on_plain_tensors(roundtrip: Callable[..., Any], tmp_path: Path) -> None:
    leaf = torch.ones(3, requires_grad=True)
    loaded = roundtrip({"leaf": leaf, "detached": leaf.detach()}, tmp_path)
    assert loaded["leaf"].requires_grad and loaded["leaf"].is_leaf
    assert not loaded["detached"].requires_grad


def test_one_stream_loads_many_times_independently(tmp_path: Path) -> None:
    path = tmp_path / "x.zcp"
    zp.dump({"t": torch.zeros(1000)}, path)
    loads = [zp.load(path) for _ in range(50)]
    for i, obj in enumerate(loads):
        obj["t"][0] = i
    assert [int(obj["t"][0]) for obj in loads] == list(range(50))
    assert len({obj["t"].data_ptr() for obj in loads}) == 50


def test_numpy_arrays_travel_out_of_band(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    array = np.arange(100_000, dtype=np.float32)
    data = zp.dumps({"np": array, "t": torch.ones(2)})
    assert len(data) > array.nbytes  # in the data region
    for loaded in (zp.loads(data), zp.loads(data, trusted=True)):  # numeric arrays load restricted
        assert (loaded["np"] == array).all() and loaded["np"].dtype == array.dtype


def test_dump_to_bytesio_matches_dumps() -> None:
    obj = {"t": torch.arange(10), "x": [1, 2]}
    buf = io.BytesIO()
    zp.dump(obj, buf)
    assert buf.getvalue() == zp.dumps(obj)


def test_dumps_is_deterministic() -> None:
    torch.manual_seed(0)
    obj = {"a": torch.randn(100), "b": [torch.ones(3, dtype=torch.int8)]}
    assert zp.dumps(obj) == zp.dumps(obj)


TENSORS = st.builds(
    lambda dtype, shape, seed: make_tensor(dtype, shape),
    st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8, torch.complex64]),
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    st.integers(0, 10),
)
LEAVES = st.one_of(TENSORS, st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False))
GRAPHS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
        st.tuples(children, children),
    ),
    max_leaves=12,
)


def assert_same_graph(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and same(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_graph(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_graph(x, y)
    else:
        assert a == b


@settings(max_examples=60, deadline=None)
@given(graph=GRAPHS)
def test_random_graphs_round_trip(graph: Any) -> None:
    assert_same_graph(zp.loads(zp.dumps(graph)), graph)
    with zp.freeze(graph) as snap:
        assert_same_graph(snap.load(), graph)


def test_assert_same_compares_enum_members_and_classes_and_stops_at_cycles() -> None:
    import enum

    from zerocopy_pickle.testing import assert_same

    class Mode(enum.Enum):
        A = 1
        B = 2

    ring: list[object] = [Mode.A, Mode]
    ring.append(ring)  # a cycle: walked once
    assert_same(ring, ring)
    with pytest.raises(AssertionError, match=r"obj\[0\]"):
        assert_same([Mode.A], [Mode.B])
    with pytest.raises(AssertionError, match="class"):
        assert_same([Mode], [int])
