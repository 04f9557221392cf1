"""Restricted loading: the default allow-list, per-call allow=, the error that says what to allow."""

from __future__ import annotations

import collections
import pickle
import threading
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import AllowList, safe_globals, scan_stream

from . import refusal_models as rm
from .conftest import TIED_NET_ALLOW, TiedNet


class Opaque:
    """An importable class that is not on the built-in safe set."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_tensors_and_containers_load_without_allow(tmp_path: Path) -> None:
    path = tmp_path / "sd.zcp"
    zp.dump({"w": torch.ones(2), "meta": {"epoch": 3, "names": ["a"], "od": collections.OrderedDict()}}, path)
    assert zp.load(path)["meta"]["epoch"] == 3


def test_refusal_names_every_needed_global_and_the_exact_allow(tmp_path: Path, tied_net: TiedNet) -> None:
    path = tmp_path / "model.zcp"
    zp.dump({"model": tied_net, "extra": Opaque(1)}, path)
    with pytest.raises(zp.RestrictedLoadError) as info:
        zp.load(path)
    error = info.value
    assert isinstance(error, pickle.UnpicklingError)
    assert isinstance(error, zp.ZeroCopyPickleError)
    message = str(error)
    expected = [f"{cls.__module__}:{cls.__qualname__}" for cls in [*TIED_NET_ALLOW, Opaque]]
    for name in expected:
        assert repr(name) in message, name
    assert "allow=[" in message and "trusted=True" in message
    assert error.refused == (TiedNet.__module__, "TiedNet")
    assert set(error.needed) == {tuple(name.split(":")) for name in expected}
    # Exactly what the message says is enough.
    loaded = zp.load(path, allow=expected)
    assert isinstance(loaded["extra"], Opaque)


@pytest.mark.parametrize(
    "allow",
    [
        [Opaque],
        [f"{__name__}:Opaque"],
        [(__name__, "Opaque")],
    ],
    ids=["class", "string", "tuple"],
)
def test_allow_forms(allow: list[object]) -> None:
    data = zp.dumps([Opaque(5)])
    assert zp.loads(data, allow=allow)[0].value == 5


def test_trusted_loads_everything() -> None:
    data = zp.dumps([Opaque(5)])
    assert zp.loads(data, trusted=True)[0].value == 5


def test_allow_is_per_call_not_global() -> None:
    data = zp.dumps(Opaque(1))
    zp.loads(data, allow=[Opaque])
    with pytest.raises(zp.RestrictedLoadError):
        zp.loads(data)
    assert (__name__, "Opaque") not in safe_globals()


def test_safe_set_is_read_only() -> None:
    with pytest.raises(TypeError):
        safe_globals()["os", "system"] = object()  # type: ignore[index]


def test_dotted_qualname_is_not_walked() -> None:
    # ("pathlib", "os.system") would reach os.system through pathlib's module globals.
    allow_list = AllowList([("pathlib", "Path")])
    with pytest.raises(zp.RestrictedLoadError, match="pathlib:os.system"):
        allow_list.find_class("pathlib", "os.system")
    hostile = b"\x80\x05\x8c\x07pathlib\x94\x8c\tos.system\x94\x93\x94\x8c\x04true\x94\x85\x94R\x94."
    with pytest.raises(zp.RestrictedLoadError, match="pathlib:os.system"):
        zp.ZeroCopyUnpickler(__import__("io").BytesIO(hostile), allow=["pathlib:Path"]).load()


def test_filling_what_a_custom_new_returned_is_refused_in_one_readable_sentence() -> None:
    # Interned() then BUILD: the state would land on the process-wide shared instance.
    stream = b"\x80\x05ctests.refusal_models\nInterned\n)R}\x8c\x05value\x94K\x07sb."
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.ZeroCopyUnpickler(__import__("io").BytesIO(stream), allow=[rm.Interned]).load()
    assert str(refused.value).startswith(
        "refusing to load: the stream applies BUILD to an object made by tests.refusal_models:Interned, which a "
        "restricted load does not fill: it fills only objects that a safe constructor or an allowed class with an "
        "ordinary __new__ created in this load. Only trusted=True"
    ), str(refused.value)
    assert getattr(rm.Interned.shared, "value", None) != 7


def test_allow_string_must_name_an_exact_pair() -> None:
    data = zp.dumps(Opaque(1))
    with pytest.raises(zp.RestrictedLoadError):
        zp.loads(data, allow=[__name__ + ":Opaque.__init__"])


@pytest.mark.parametrize(
    ("allow", "match"),
    [
        ("collections:OrderedDict", "must be a list"),
        (["collections.OrderedDict"], "form 'module:qualname'"),
        (["collections:"], "form 'module:qualname'"),
        ([("collections",)], "must be \\(module, qualname\\)"),
        ([3], "no __module__/__qualname__"),
    ],
)
def test_malformed_allow_entries(allow: object, match: str) -> None:
    with pytest.raises(zp.ArgumentError, match=match):
        zp.loads(zp.dumps(1), allow=allow)  # type: ignore[arg-type]


def test_unimportable_allowed_name_is_a_snapshot_error() -> None:
    data = zp.dumps(Opaque(1))
    data = data.replace(__name__.encode(), b"no_such_mod" + b"x" * (len(__name__) - 11))
    with pytest.raises((zp.SnapshotError, zp.RestrictedLoadError)):
        zp.loads(data, trusted=True)


def test_scan_lists_globals_without_running(tmp_path: Path, tied_net: TiedNet) -> None:
    path = tmp_path / "m.zcp"
    zp.dump(tied_net, path)
    found = zp.scan(path)
    assert (TiedNet.__module__, "TiedNet") in found
    assert ("zerocopy_pickle.rebuild", "rebuild_storage") in found
    assert zp.scan(path.read_bytes()) == found
    with open(path, "rb") as f:
        assert zp.scan(f) == found


def test_scan_follows_memo_and_protocols() -> None:
    for protocol in range(6):
        stream = pickle.dumps([collections.OrderedDict(), collections.OrderedDict()], protocol=protocol)
        assert ("collections", "OrderedDict") in scan_stream(stream), protocol


def test_scan_rejects_garbage() -> None:
    with pytest.raises(zp.SnapshotError, match="malformed"):
        scan_stream(b"\x80\x05\xff\xff")


def test_concurrent_loads_with_different_allow_lists(tmp_path: Path) -> None:
    """32 loads on 8 threads, each with its own allow=, half refused: no leakage, no spurious refusal."""
    path = tmp_path / "o.zcp"
    zp.dump({"o": Opaque(7), "t": torch.ones(3)}, path)
    results: list[tuple[int, str]] = []
    barrier = threading.Barrier(8)
    lock = threading.Lock()

    def worker(worker_id: int) -> None:
        barrier.wait()
        for i in range(4):
            job = worker_id * 4 + i
            allowed = job % 2 == 0
            try:
                obj = zp.load(path, allow=[Opaque] if allowed else [])
                outcome = "loaded" if obj["o"].value == 7 else "wrong"
            except zp.RestrictedLoadError:
                outcome = "refused"
            with lock:
                results.append((job, outcome))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 32
    for job, outcome in results:
        assert outcome == ("loaded" if job % 2 == 0 else "refused"), (job, outcome)


def test_snapshot_open_is_restricted_but_freeze_is_trusted(tmp_path: Path) -> None:
    obj = Opaque(3)
    with zp.freeze(obj) as snap:
        assert snap.load().value == 3
        with pytest.raises(zp.RestrictedLoadError):
            snap.load(trusted=False)
    path = tmp_path / "o.zcp"
    zp.dump(obj, path)
    with zp.Snapshot.open(path) as snap:
        with pytest.raises(zp.RestrictedLoadError):
            snap.load()
        assert snap.load(allow=[Opaque]).value == 3


def test_restricted_refusal_runs_nothing(tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, ...]:
            return (open, (str(sentinel), "w"))

    data = zp.dumps({"t": torch.ones(1), "p": Payload()})
    with pytest.raises(zp.RestrictedLoadError, match="io:open"):
        zp.loads(data)
    assert not sentinel.exists()


def test_torch_nn_builtins_load_as_values_and_are_never_called() -> None:
    """transformers' GELUActivation holds F.gelu, which pickles as torch._C._nn:gelu: a safe value (no allow=),
    while a stream calling it is refused, and every other torch._C name stays blocked."""
    import torch.nn.functional as F

    from tests.hostile_streams import as_snapshot

    assert zp.loads(zp.dumps({"act": F.gelu, "soft": F.softplus}))["act"] is F.gelu
    with pytest.raises(zp.RestrictedLoadError, match="a value of the safe set"):
        zp.loads(as_snapshot(b"\x80\x05\x8c\x0ctorch._C._nn\x8c\x04gelu\x93)R."))
    for name in ("_parse_to", "thnn_conv2d", "mkldnn_reorder_conv2d_weight"):
        with pytest.raises(zp.RestrictedLoadError, match="blocklist"):
            zp.loads(as_snapshot(b"\x80\x05\x8c\x0ctorch._C._nn\x8c" + bytes([len(name)]) + name.encode() + b"\x93."))
