"""NumPy arrays, scalars and dtypes in restricted loads (Note [NumPy values] in zerocopy_pickle/safeglobals.py).

The pickler writes numeric NumPy values with this library's own validating rebuilds; restricted loads admit them
without ``allow=``, bit for bit and zero-copy, and refuse everything else NumPy pickles (object, string,
structured dtypes, NumPy's own pickle machinery) with a library error that names trusted=True."""

from __future__ import annotations

import io
import mmap
import pickle
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import safe_set, semantics
from zerocopy_pickle import native, safeglobals, validate
from zerocopy_pickle.errors import RestrictedLoadError, UnsafeArgumentError

from .hostile_streams import NEXT_BUFFER, G, Op, as_snapshot, call, newobj, program
from .test_native import _toolchain_missing
from .test_native_semantics import OK, assert_agree, zerocopy_stream

NUMERIC = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
BOTH_ORDERS = list({d.str: d for d in (np.dtype(n).newbyteorder(o) for n in NUMERIC for o in "<>")}.values())


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zp.TrustedOnlyWarning)
        yield


def sample(dtype: np.dtype[Any], shape: tuple[int, ...] = (3, 4)) -> np.ndarray[Any, Any]:
    raw = np.random.default_rng(0).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_array(a: Any, b: Any) -> None:
    assert type(b) is np.ndarray
    assert b.dtype == a.dtype and b.dtype.str == a.dtype.str
    assert b.shape == a.shape
    assert b.tobytes(order="A") == a.tobytes(order="A")
    if a.size and (a.flags.c_contiguous or a.flags.f_contiguous):  # an empty array's strides carry nothing
        assert b.strides == a.strides


def roundtrip(obj: Any, **kwargs: Any) -> Any:
    return zp.loads(zp.dumps(obj), **kwargs)


# -- round trips -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", BOTH_ORDERS, ids=lambda d: d.str)
def test_every_numeric_dtype_round_trips_restricted(dtype: np.dtype[Any]) -> None:
    c = sample(dtype)
    f = np.asfortranarray(c)
    zero_d = c[1:2, 2:3].reshape(())
    out = roundtrip({"c": c, "f": f, "zero_d": zero_d, "empty": c[:0], "dt": dtype})
    same_array(c, out["c"])
    same_array(f, out["f"])
    assert out["f"].flags.f_contiguous and not out["f"].flags.c_contiguous
    same_array(zero_d, out["zero_d"])
    same_array(c[:0], out["empty"])
    assert out["dt"] == dtype and out["dt"].str == dtype.str


@pytest.mark.parametrize("name", NUMERIC)
def test_numpy_scalars_round_trip_with_their_type(name: str) -> None:
    value = sample(np.dtype(name), (1,))[0]
    out = roundtrip([value, np.float64(0.91), np.int32(-7), np.bool_(True)])
    assert type(out[0]) is type(value) and out[0].tobytes() == value.tobytes()
    assert type(out[1]) is np.float64 and out[1] == 0.91
    assert type(out[2]) is np.int32 and out[2] == -7
    assert type(out[3]) is np.bool_ and bool(out[3]) is True


def test_the_issue_dict_loads_restricted() -> None:
    out = roundtrip({"a": np.float64(0.91), "b": np.arange(6).reshape(2, 3)})
    assert type(out["a"]) is np.float64 and out["a"] == 0.91
    same_array(np.arange(6).reshape(2, 3), out["b"])


def test_non_contiguous_and_negative_strides_keep_their_values() -> None:
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    for view in (base[::2, 1::3], base[::-1], base.T[::2]):
        out = roundtrip(view)
        assert np.array_equal(out, view) and out.dtype == view.dtype
        assert out.flags.c_contiguous  # written as a C-ordered copy, as NumPy's own pickle does


def test_datetime_and_timedelta_of_a_plain_unit_load_restricted() -> None:
    d = np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[ns]")
    t = np.timedelta64(5, "ms")
    out = roundtrip({"d": d, "t": t, "s": d[0]})
    same_array(d, out["d"])
    assert out["t"] == t and out["t"].dtype == t.dtype
    assert out["s"] == d[0]


def test_fixed_width_strings_load_restricted() -> None:
    values = {
        "u": np.array(["ab", "c"]),
        "big_endian": np.array(["xyz", "é"], dtype=">U3"),
        "s": np.array([b"ab", b""]),
        "f": np.asfortranarray(np.array([["a", "bb"], ["ccc", "d"]])),
        "empty": np.array([], dtype="U1"),
    }
    out = roundtrip(
        {**values, "str_": np.str_("text"), "bytes_": np.bytes_(b"hi"), "e": np.str_(""), "dt": np.dtype("<U7")}
    )
    for key, value in values.items():
        same_array(value, out[key])
    assert type(out["str_"]) is np.str_ and out["str_"] == "text"
    assert type(out["bytes_"]) is np.bytes_ and out["bytes_"] == b"hi"
    assert type(out["e"]) is np.str_ and out["e"] == ""
    assert out["dt"] == np.dtype("<U7")


def test_arrays_are_writable_private_views_of_the_mapping(tmp_path: Path) -> None:
    big = np.arange(1 << 18, dtype=np.float64)
    path = tmp_path / "a.zcp"
    zp.dump({"big": big, "t": torch.ones(3)}, path)
    out = zp.load(path)["big"]
    assert not out.flags.owndata
    assert type(out.base) is mmap.mmap  # a view of the snapshot's mapping, not a copy
    assert np.shares_memory(out, np.frombuffer(out.base, dtype=np.uint8))
    assert out.flags.writeable  # copy-on-write, as for tensors
    out[0] = -1.0
    assert zp.load(path)["big"][0] == 0.0  # the file and other loads are unchanged


def test_inside_a_training_checkpoint() -> None:
    model = torch.nn.Linear(3, 2)
    state = {
        "model": model.state_dict(),
        "epoch": 3,
        "best_metric": np.float64(0.91),
        "rng": {"numpy": np.random.default_rng(1).integers(0, 9, size=(624,), dtype=np.uint32), "seed": np.int64(7)},
        "history": [np.float32(1.5), np.float32(1.25)],
    }
    out = roundtrip(state)
    assert torch.equal(out["model"]["weight"], model.weight.detach())
    assert type(out["best_metric"]) is np.float64 and out["best_metric"] == 0.91
    same_array(state["rng"]["numpy"], out["rng"]["numpy"])
    assert type(out["rng"]["seed"]) is np.int64 and out["history"] == [np.float32(1.5), np.float32(1.25)]


# -- refusals --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        np.array([1, "a"], dtype=object),
        np.zeros(2, dtype=[("x", "f4"), ("y", "i2")]),
        np.longdouble(1.5),
        np.array(["2020"], dtype="datetime64[10s]"),
        np.datetime64("NaT"),
    ],
    ids=["object", "structured", "longdouble", "datetime_multiplier", "datetime_generic"],
)
def test_other_dtypes_need_trusted(value: Any) -> None:
    data = zp.dumps({"x": value})
    with pytest.raises(RestrictedLoadError, match="trusted=True"):
        zp.loads(data)
    out = zp.loads(data, trusted=True)["x"]
    assert out.dtype == value.dtype and repr(out) == repr(value)


def test_numpy_own_machinery_is_refused_naming_trusted() -> None:
    # What plain pickle (and an older version of this library) writes for NumPy values.
    for value in (np.arange(6), np.float64(0.91), np.dtype("float32")):
        for protocol in (2, 5):
            stream = pickle.dumps({"x": value}, protocol=protocol)
            unpickler = zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=[])
            with pytest.raises(RestrictedLoadError, match="numpy") as e:
                unpickler.load()
            assert "trusted=True" in str(e.value)


def test_torch_style_allow_names_neither_error_nor_widen() -> None:
    allow = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.Float64DType]
    out = zp.loads(zp.dumps({"a": np.float64(0.91), "b": np.arange(3.0)}), allow=allow)
    assert out["a"] == 0.91
    with pytest.raises(RestrictedLoadError):  # an object array still needs trusted=True
        zp.loads(zp.dumps({"x": np.array([1, None], dtype=object)}), allow=allow)
    stream = pickle.dumps(np.arange(3), protocol=2)  # NumPy's own _reconstruct + BUILD: still refused
    with pytest.raises(RestrictedLoadError, match="NumPy's own pickle machinery"):
        zp.ZeroCopyUnpickler(io.BytesIO(stream), allow=allow).load()


@pytest.mark.parametrize(
    "attack",
    [
        call(G("numpy", "ndarray"), (1 << 40,)),  # memory from a size alone
        newobj(G("numpy", "ndarray"), (1 << 40,)),
        call(G("numpy._core.multiarray", "_reconstruct"), G("numpy", "ndarray"), (0,), b"b"),
        call(G("numpy", "dtype"), "O"),
        call(G("numpy.dtypes", "ObjectDType")),
        call(G("numpy._core.numeric", "_frombuffer"), b"\0" * 8, G("numpy", "float64"), (1,), "C"),
    ],
    ids=["ndarray", "ndarray_newobj", "reconstruct", "dtype_object", "dtype_class", "frombuffer"],
)
@pytest.mark.parametrize("names", ["objects", "strings"])
def test_numpy_machinery_in_allow_admits_nothing(attack: Op, names: str) -> None:
    allow: list[Any] = [np._core.multiarray._reconstruct, np._core.numeric._frombuffer, np.ndarray, np.dtype]
    allow += [np.dtypes.ObjectDType, np.dtypes.Float64DType, np._core.multiarray.scalar]
    if names == "strings":
        allow = [f"{a.__module__}:{a.__qualname__}" for a in allow]
    with pytest.raises(RestrictedLoadError, match="trusted=True") as e:
        zp.loads(as_snapshot(program(attack)), allow=allow)
    assert e.value.allow is None  # no allow= to suggest: it would be a dead end
    assert "NumPy's own pickle machinery" in str(e.value) and "dumped again" in str(e.value)


def test_torch_weights_only_admits_the_same_values(tmp_path: Path) -> None:
    numeric = {
        "a": np.float64(0.91),
        "b": np.arange(6, dtype=np.int32).reshape(2, 3),
        "c": np.ones(3, dtype=">f4"),
        "s": np.array(["ab", "c"]),
    }
    path = tmp_path / "t.pt"
    torch.save(numeric, path)
    dtypes = {type(v.dtype) for v in numeric.values()}
    with torch.serialization.safe_globals(
        [np._core.multiarray._reconstruct, np._core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]
    ):
        theirs = torch.load(path, weights_only=True)
    ours = roundtrip(numeric)
    assert theirs.keys() == ours.keys()
    for key, value in theirs.items():
        assert type(ours[key]) is type(value) and np.array_equal(ours[key], value)
        # torch's loader drops a big-endian array's byte order (its dtype comes back native); ours keeps it
        assert ours[key].dtype.str == numeric[key].dtype.str
    # An object array: torch refuses it without its dtype class allowed, and so does a restricted load here
    # (with np.dtypes.ObjectDType allowed torch loads it; here only trusted=True does, documented in security.md).
    torch.save({"x": np.array([1, "a"], dtype=object)}, path)
    with (
        torch.serialization.safe_globals([np._core.multiarray._reconstruct, np.ndarray, np.dtype]),
        pytest.raises(pickle.UnpicklingError),
    ):
        torch.load(path, weights_only=True)
    with pytest.raises(RestrictedLoadError):
        zp.loads(zp.dumps({"x": np.array([1, "a"], dtype=object)}))


# -- hostile streams -------------------------------------------------------------------------------------------

ND = ("zerocopy_pickle.safeglobals", "rebuild_ndarray")
SCALAR = ("zerocopy_pickle.safeglobals", "rebuild_numpy_scalar")
DTYPE = ("zerocopy_pickle.safeglobals", "rebuild_numpy_dtype")


def load_hostile(stream: bytes, buffers: list[bytes] | None = None) -> Any:
    return zp.loads(as_snapshot(stream, buffers or []))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("|O", b"\0" * 8), "not one a restricted load"),
        (("<U0", b""), "not one a restricted load"),
        (("V8", b"\0" * 8), "not one a restricted load"),
        (("float64", b"\0" * 8), "not one a restricted load"),
        (("<f8" * 10, b"\0" * 8), "characters long"),
        (("<f8", b"\0" * 7), "7 bytes, but a <f8 scalar is 8"),
        (("<f8", b"\0" * 9), "9 bytes"),
        (("<U2", b"\0" * 4), "4 bytes, but a <U2 scalar is 8"),
        ((8, b"\0" * 8), "dtype must be str"),
    ],
)
def test_hostile_scalars(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(UnsafeArgumentError, match=message):
        load_hostile(program(call(G(*SCALAR), *args)))


def test_scalar_data_must_be_exact_bytes() -> None:
    with pytest.raises(UnsafeArgumentError, match="data must be bytes"):
        safeglobals.rebuild_numpy_scalar("<f8", bytearray(8))
    with pytest.raises(UnsafeArgumentError, match="data must be bytes"):
        safeglobals.rebuild_numpy_scalar("<f8", memoryview(b"\0" * 8))


def array_call(dtype: Any, shape: Any, order: Any = "C") -> Op:
    return call(G(*ND), NEXT_BUFFER, dtype, shape, order)


@pytest.mark.parametrize(
    ("dtype", "shape", "order", "nbytes", "message"),
    [
        ("|O", (2,), "C", 16, "not one a restricted load"),
        ("<f8", (3,), "C", 16, "needs 24 bytes, but the buffer holds 16"),
        ("<f8", (1,), "C", 16, "needs 8 bytes, but the buffer holds 16"),
        ("<f8", (1 << 40, 1 << 40), "C", 16, "bytes, but the buffer holds 16"),
        ("<f8", (0, 1 << 62, 1 << 62), "C", 0, "numpy refused"),
        ("<f8", (-1,), "C", 8, "out of range"),
        ("<f8", (1,) * 65, "C", 8, "at most 64"),
        ("<f8", [2], "C", 16, "shape must be a tuple"),
        ("<f8", (2,), "K", 16, "order must be 'C' or 'F'"),
        ("<f8", (True,), "C", 8, "must be int"),
        ("<U3", (2,), "C", 12, "needs 24 bytes, but the buffer holds 12"),
    ],
)
def test_hostile_arrays(dtype: Any, shape: Any, order: Any, nbytes: int, message: str) -> None:
    with pytest.raises(UnsafeArgumentError, match=message):
        load_hostile(program(array_call(dtype, shape, order)), [b"\0" * nbytes])


def test_hostile_array_buffers_of_other_types() -> None:
    with pytest.raises(UnsafeArgumentError, match="buffer must be"):
        load_hostile(program(call(G(*ND), (1, 2), "<f8", (2,), "C")))
    with pytest.raises(UnsafeArgumentError, match="buffer must be"):
        safeglobals.rebuild_ndarray(np.zeros(2), "<f8", (2,), "C")
    strided = memoryview(bytearray(32))[::2]
    with pytest.raises(UnsafeArgumentError, match="not a contiguous byte buffer"):
        safeglobals.rebuild_ndarray(strided, "<f8", (2,), "C")


def test_hostile_dtypes() -> None:
    for name in ("|O", "|V8", "<f16", "<M8", "<M8[10s]", "i4", "f8,i4", "<U0", "<U01", "<U2000000", "|U5", "<S5"):
        with pytest.raises(UnsafeArgumentError, match="trusted=True"):
            load_hostile(program(call(G(*DTYPE), name)))
    for name in ("<U\u0663", "<U-1", "<U+1", "<U 1", "<U1_0"):  # digits only ASCII, no sign, no separator
        with pytest.raises(UnsafeArgumentError, match="trusted=True"):
            safeglobals.rebuild_numpy_dtype(name)
    assert load_hostile(program(call(G(*DTYPE), ">c16"))) == np.dtype(">c16")
    assert load_hostile(program(call(G(*DTYPE), ">U1048576"))) == np.dtype(">U1048576")


def test_a_valid_hostile_stream_is_exact_and_read_only_over_bytes() -> None:
    stream = program(call(G(*ND), b"\x01\x00\x00\x00\x02\x00\x00\x00", "<i4", (2,), "C"))
    out = load_hostile(stream)
    assert out.tolist() == [1, 2] and not out.flags.writeable


def test_rebuilds_charge_the_load_budget() -> None:
    with validate.budget(validate.BUDGET_FLOOR):
        before = validate.remaining()
        safeglobals.rebuild_numpy_scalar("<f8", b"\0" * 8)
        after = validate.remaining()
    assert before is not None and after is not None and before - after == len("<f8") + 8
    with validate.budget(validate.BUDGET_FLOOR):
        before = validate.remaining()
        safeglobals.rebuild_ndarray(bytearray(48), "<f8", (2, 3), "C")
        after = validate.remaining()
    assert before is not None and after is not None and before - after == len("<f8") + 3
    with validate.budget(0):
        for _ in range(validate.BUDGET_FLOOR // 3):  # each costs len("<f8")
            safeglobals.rebuild_numpy_dtype("<f8")
        assert validate.remaining() == validate.BUDGET_FLOOR % 3
        with pytest.raises(UnsafeArgumentError, match="amplification"):
            safeglobals.rebuild_numpy_dtype("<f8")


def test_the_rebuilds_are_in_the_safe_set_and_callable() -> None:
    table = safe_set.safe_table()
    for pair in (ND, SCALAR, DTYPE):
        assert table[pair].callable and not table[pair].result_ops


# -- the stream analysis ---------------------------------------------------------------------------------------


def numpy_values() -> dict[str, Any]:
    return {
        "a": np.float64(0.91),
        "b": np.arange(6).reshape(2, 3),
        "f": np.asfortranarray(np.ones((2, 3), dtype=">f2")),
        "dt": np.dtype("<c8"),
        "keys": {np.int64(i): np.float32(i) for i in range(20)},  # scalars as dict keys: hashed call results
        "t": torch.arange(4.0),
    }


def test_streams_name_only_the_library_rebuilds() -> None:
    stream = zerocopy_stream(numpy_values())
    uses = semantics.analyze(stream)
    named = {module for module, _ in uses.globals}
    assert not any(module.startswith("numpy") for module in named), named
    assert set(uses.called) >= {ND, SCALAR, DTYPE}
    assert not any(pair in uses.mutated for pair in (ND, SCALAR, DTYPE))


@pytest.fixture(scope="module")
def analyzer() -> Any:
    """The native stream analysis (as tests/test_native_semantics.py builds it; skips only without a toolchain)."""
    missing = _toolchain_missing()
    if missing is not None:
        pytest.skip(f"native helpers cannot be built here: {missing}")
    native.build()
    with native.use("native"):
        found = native.stream_analyzer()
    assert found is not None
    return found


def test_both_analyses_agree_on_numpy_streams(analyzer: Any) -> None:
    assert assert_agree(analyzer, zerocopy_stream(numpy_values())) == OK
    for value in (np.arange(3), np.float64(0.5), np.dtype("float32")):
        for protocol in (2, 5):  # NumPy's own reductions
            assert_agree(analyzer, pickle.dumps({"x": value}, protocol=protocol))


def test_scalar_keys_count_as_keys_of_chosen_hash() -> None:
    # np.uint64 hashes as the int it holds: 1, 1 + (2**61 - 1), ... all hash to 1. The analysis counts a call
    # result used as a key as one whose hash the stream chooses, and refuses a dict of many before it is built.
    step = (1 << 61) - 1
    keys = {call(G(*SCALAR), "<u8", struct.pack("<Q", 1 + (i % 8) * step + i // 8)): 0 for i in range(20_000)}
    assert hash(np.uint64(1)) == hash(np.uint64(1 + step))
    with pytest.raises(zp.SnapshotError, match="hashes it can choose"):
        load_hostile(program(keys))


def test_the_dill_backend_writes_the_same_rebuilds() -> None:
    # dill's pickler reduces arrays with its own dill._dill:_create_array (blocked) unless the library's
    # reducers come first.
    pytest.importorskip("dill")
    values = {"a": np.float64(0.91), "f": np.asfortranarray(sample(np.dtype(">i4"))), "s": np.array(["xy"])}
    out = zp.loads(zp.dumps(values, backend="dill"))
    assert type(out["a"]) is np.float64 and out["a"] == 0.91
    same_array(values["f"], out["f"])
    same_array(values["s"], out["s"])
