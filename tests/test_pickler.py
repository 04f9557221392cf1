"""ZeroCopyPickler / ZeroCopyUnpickler used directly, as pickle.Pickler / Unpickler-shaped classes."""

from __future__ import annotations

import gc
import io
import os
import pickle
import pickletools
import threading
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

import zerocopy_pickle as zp


def opcodes(stream: bytes) -> list[str]:
    return [op.name for op, _, _ in pickletools.genops(stream)]


def test_storages_go_out_of_band_through_buffer_callback() -> None:
    weight = torch.randn(256, 256)
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = zp.ZeroCopyPickler(out, buffer_callback=lambda b: buffers.append(b) and False)
    pickler.dump({"w": weight, "view": weight[3:], "again": weight})
    stream = out.getvalue()
    assert len(buffers) == 1  # one storage, referenced three times, stored once
    assert len(stream) < 1000  # no tensor bytes in the stream
    assert "NEXT_BUFFER" in opcodes(stream)
    assert [(s.nbytes, s.location, s.dtype) for s in pickler.buffer_specs] == [(weight.nbytes, "cpu", "float32")]
    loaded = zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=[b.raw() for b in buffers]).load()
    assert torch.equal(loaded["w"], weight)
    assert loaded["again"] is loaded["w"]
    assert loaded["view"].data_ptr() == loaded["w"].data_ptr() + 3 * 256 * 4


def test_plain_pickle_loads_the_stream() -> None:
    """rebuild functions work without this library's unpickler (trusted, saved devices)."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    zp.ZeroCopyPickler(out, buffer_callback=lambda b: buffers.append(b) and False).dump([torch.arange(5)])
    loaded = pickle.loads(out.getvalue(), buffers=[bytearray(b.raw()) for b in buffers])
    assert loaded[0].tolist() == [0, 1, 2, 3, 4]


def test_without_buffer_callback_buffers_are_in_band() -> None:
    out = io.BytesIO()
    zp.ZeroCopyPickler(out).dump({"t": torch.arange(5)})
    stream = out.getvalue()
    assert "NEXT_BUFFER" not in opcodes(stream)
    assert zp.ZeroCopyUnpickler(io.BytesIO(stream)).load()["t"].tolist() == [0, 1, 2, 3, 4]


def test_callback_may_keep_a_buffer_in_band() -> None:
    out = io.BytesIO()
    pickler = zp.ZeroCopyPickler(out, buffer_callback=lambda b: b.raw().nbytes < 100)
    pickler.dump([torch.ones(2), torch.ones(1000)])
    assert [s.nbytes for s in pickler.buffer_specs] == [4000]


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_protocol_below_5_is_refused(protocol: int) -> None:
    with pytest.raises(zp.ArgumentError, match="protocol >= 5"):
        zp.ZeroCopyPickler(io.BytesIO(), protocol=protocol)


def test_highest_protocol_alias() -> None:
    out = io.BytesIO()
    zp.ZeroCopyPickler(out, protocol=-1).dump(1)
    assert out.getvalue()[:2] == b"\x80\x05"


def test_unpicklable_object_is_a_dump_error() -> None:
    with pytest.raises(zp.DumpError, match=r"cannot pickle memoryview at obj\['view'\]") as info:
        zp.dumps({"ok": torch.ones(1), "view": io.BytesIO(b"x").getbuffer()}, backend="pickle")
    assert isinstance(info.value, pickle.PicklingError)
    assert info.value.__cause__ is not None
    assert info.value.path == "obj['view']"


def test_unpickler_restricted_by_default() -> None:
    stream = pickle.dumps(print, protocol=5)
    with pytest.raises(zp.RestrictedLoadError):
        zp.ZeroCopyUnpickler(io.BytesIO(stream)).load()
    assert zp.ZeroCopyUnpickler(io.BytesIO(stream), trusted=True).load() is print


def test_device_storages_are_reduced_with_their_location() -> None:
    meta = torch.empty(10, device="meta")
    out = io.BytesIO()
    pickler = zp.ZeroCopyPickler(out, buffer_callback=lambda b: False)
    pickler.dump(meta)
    assert pickler.buffer_specs == []  # meta storages hold no bytes


class RefusesRuntime:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("Cowardly refusing to serialize this")


def test_runtime_errors_from_reducers_propagate_as_themselves() -> None:
    # as from pickle.dumps: the object's own code raised it (tests/test_fidelity.py covers the kinds and backends)
    with pytest.raises(RuntimeError, match="Cowardly refusing") as info:
        zp.dumps({"x": RefusesRuntime()})
    assert not isinstance(info.value, zp.DumpError)


class _RecordsGC:
    """Records, when unpickled, whether the cyclic GC was enabled (and may wait for an event first)."""

    seen: ClassVar[list[bool]] = []
    gate: ClassVar[threading.Event | None] = None
    inside: ClassVar[threading.Event | None] = None

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_RecordsGC._rebuild, ())

    @staticmethod
    def _rebuild() -> _RecordsGC:
        _RecordsGC.seen.append(gc.isenabled())
        if _RecordsGC.inside is not None:
            _RecordsGC.inside.set()
        if _RecordsGC.gate is not None:
            _RecordsGC.gate.wait(30)
        return _RecordsGC()


@pytest.fixture
def records_gc() -> Iterator[type[_RecordsGC]]:
    assert gc.isenabled()
    _RecordsGC.seen, _RecordsGC.gate, _RecordsGC.inside = [], None, None
    yield _RecordsGC
    _RecordsGC.gate, _RecordsGC.inside = None, None
    assert gc.isenabled()


def test_loads_pause_the_gc_and_restore_it(records_gc: type[_RecordsGC]) -> None:
    data = zp.dumps({"x": records_gc(), "t": torch.ones(3)})
    zp.loads(data, trusted=True)
    assert records_gc.seen == [False]
    assert gc.isenabled()
    gc.disable()
    try:
        zp.loads(data, trusted=True)
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()


def test_a_failed_load_restores_the_gc(records_gc: type[_RecordsGC]) -> None:
    data = zp.dumps([records_gc(), torch.ones(2)])
    with pytest.raises(zp.ZeroCopyPickleError):
        zp.loads(data[:-1])  # truncated: rejected
    with pytest.raises(pickle.UnpicklingError):
        zp.loads(data)  # restricted: refused while unpickling, inside the pause
    assert gc.isenabled()


def test_concurrent_loads_reenable_the_gc_when_the_last_ends(records_gc: type[_RecordsGC]) -> None:
    data = zp.dumps(records_gc())
    records_gc.gate, records_gc.inside = threading.Event(), threading.Event()
    thread = threading.Thread(target=zp.loads, args=(data,), kwargs={"trusted": True})
    thread.start()
    assert records_gc.inside.wait(30)
    records_gc.inside = None
    assert not gc.isenabled()
    zp.loads(zp.dumps(torch.ones(2)))  # a second load ends while the first is still running
    assert not gc.isenabled()
    records_gc.gate.set()
    thread.join(30)
    assert gc.isenabled()


def test_a_fork_during_another_threads_load_leaves_the_child_sane(records_gc: type[_RecordsGC]) -> None:
    data = zp.dumps(records_gc())
    records_gc.gate, records_gc.inside = threading.Event(), threading.Event()
    thread = threading.Thread(target=zp.loads, args=(data,), kwargs={"trusted": True})
    thread.start()
    try:
        assert records_gc.inside.wait(30)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            pid = os.fork()
        if pid == 0:  # the child: the other thread's load never ends here
            code = 0
            try:
                code |= 1 if not gc.isenabled() else 0
                zp.loads(zp.dumps(torch.ones(2)))  # would deadlock on a lock held at fork
                code |= 2 if not gc.isenabled() else 0
            except BaseException:
                code |= 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        records_gc.gate.set()
        thread.join(30)


def test_a_fork_outside_loads_keeps_the_callers_gc_setting() -> None:
    zp.loads(zp.dumps(torch.ones(2)))  # a finished load, with collection enabled at the time
    gc.disable()
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        gc.enable()


def _two_buffers() -> tuple[bytes, list[memoryview]]:
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    zp.ZeroCopyPickler(out, buffer_callback=lambda b: buffers.append(b) and False).dump([torch.ones(2), torch.zeros(3)])
    return out.getvalue(), [b.raw() for b in buffers]


def test_a_direct_restricted_load_checks_the_buffer_count() -> None:
    """The public unpickler goes through the load core: a list or tuple of buffers must be as many as the stream
    consumes (pickle itself ignores extra ones), as a snapshot's header rows must."""
    stream, raw = _two_buffers()
    with pytest.raises(zp.SnapshotError, match=r"consumes 2 out-of-band buffer\(s\), buffers= declares 1"):
        zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=raw[:1]).load()
    with pytest.raises(zp.SnapshotError, match=r"consumes 2 out-of-band buffer\(s\), buffers= declares 3"):
        zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=(*raw, raw[0])).load()
    # Other iterables are consumed as pickle consumes them, unchecked; a trusted unpickler is pickle's own.
    assert [t.tolist() for t in zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=iter(raw)).load()] == [
        [1.0, 1.0],
        [0.0, 0.0, 0.0],
    ]
    assert len(zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=[*raw, raw[0]], trusted=True).load()) == 2
    with pytest.raises(zp.SnapshotError, match="no \\*buffers\\* argument"):
        zp.ZeroCopyUnpickler(io.BytesIO(stream)).load()


def test_a_restricted_unpickler_reads_its_one_stream_and_a_trusted_one_streams() -> None:
    stream, raw = _two_buffers()
    unpickler = zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=raw)
    assert len(unpickler.load()) == 2
    with pytest.raises(zp.SnapshotError, match="ends without STOP"):  # the file was read to its end
        unpickler.load()
    both = io.BytesIO(pickle.dumps(1, protocol=5) + pickle.dumps([2], protocol=5))
    trusted = zp.ZeroCopyUnpickler(both, trusted=True)
    assert (trusted.load(), trusted.load()) == (1, [2])
    with pytest.raises(pickle.UnpicklingError, match="truncated"):  # a trusted direct load maps no error
        zp.ZeroCopyUnpickler(io.BytesIO(stream[:-1]), buffers=raw, trusted=True).load()


class Victim:
    """A class a restricted load may instantiate (with ``allow=``), never modify."""


# GLOBAL Victim, then BUILD on the class itself with slot state {"pwned": 1}: setattr(Victim, "pwned", 1).
_SETS_ON_THE_CLASS = b"\x80\x05ctests.test_pickler\nVictim\n(N}Vpwned\nK\x01stb."


def _benign_uses() -> Any:
    from tests.internals import semantics

    victim = Victim()
    victim.x = 1  # type: ignore[attr-defined]
    return semantics.uses(pickle.dumps(victim, protocol=5))  # names Victim, builds an instance of it


def test_stream_uses_of_another_stream_admit_nothing() -> None:
    """Attack: the analysis of a harmless stream, passed as stream_uses= with a stream that sets attributes on an
    allowed class. The analysis is the stream's own, worked out again (remembered by digest), not the caller's."""
    benign = _benign_uses()
    with pytest.raises(zp.RestrictedLoadError, match="BUILD sets state on the global"):
        zp.ZeroCopyUnpickler(io.BytesIO(_SETS_ON_THE_CLASS), allow=[Victim], stream_uses=benign).load()
    unpickler = zp.ZeroCopyUnpickler(io.BytesIO(_SETS_ON_THE_CLASS), allow=[Victim], stream_uses=benign)
    with pytest.raises(zp.RestrictedLoadError):
        unpickler.admit()
    with pytest.raises((EOFError, zp.RestrictedLoadError)):
        pickle.Unpickler.load(unpickler)  # the C load, past the class's own: this object unpickles nothing
    assert not hasattr(Victim, "pwned")
    # A stream that is admissible, with another's analysis: refused as the caller's mistake.
    plain = pickle.dumps(Victim(), protocol=5)
    with pytest.raises(zp.ArgumentError, match="stream_uses= is not the analysis"):
        zp.ZeroCopyUnpickler(io.BytesIO(plain), allow=[Victim], stream_uses=benign).load()
    # Its own analysis is accepted, also when it is no longer remembered (worked out again, equal).
    from tests.internals import semantics

    own = semantics.uses(plain)
    semantics.forget()
    assert type(zp.ZeroCopyUnpickler(io.BytesIO(plain), allow=[Victim], stream_uses=own).load()) is Victim


def test_a_restricted_unpickler_resolves_nothing_outside_the_core() -> None:
    """Attacks on the public object: its find_class before load, the C load after admit (which would skip the
    load's budget and checks), a subclass's find_class, a replaced allow_list: none resolves a global."""
    from tests.internals import AllowList

    data = pickle.dumps(Victim(), protocol=5)  # needs allow=[Victim]
    unpickler = zp.ZeroCopyUnpickler(io.BytesIO(data))
    with pytest.raises(zp.RestrictedLoadError, match="only inside load"):
        unpickler.find_class("builtins", "print")
    admitted = zp.ZeroCopyUnpickler(io.BytesIO(pickle.dumps([1, Victim()], protocol=5)), allow=[Victim])
    admitted.admit()
    with pytest.raises(EOFError):  # admitted, but the unpickling is the core's, under its budget
        pickle.Unpickler.load(admitted)
    assert admitted.load()[0] == 1

    class Widening(zp.ZeroCopyUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            return pickle.Unpickler.find_class(self, module, name)

    with pytest.raises(zp.RestrictedLoadError, match="allow-list"):
        Widening(io.BytesIO(data)).load()
    replaced = zp.ZeroCopyUnpickler(io.BytesIO(data))
    replaced.allow_list = AllowList([Victim])  # informational: the core builds the load's own
    with pytest.raises(zp.RestrictedLoadError, match="allow-list"):
        replaced.load()
