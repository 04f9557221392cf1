"""Fidelity to ``torch.load`` and ``pickle``: what they accept or do, a snapshot accepts or does too."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import pathlib
import sys
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp

# -- file objects that cannot be mapped ----------------------------------------------------------------------


def _sample() -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "n": 3}


def _check(obj: dict[str, Any]) -> None:
    assert torch.equal(obj["w"], torch.arange(4096, dtype=torch.float32).reshape(64, 64))
    assert obj["n"] == 3


@pytest.mark.parametrize("opener", [gzip.open, bz2.open, lzma.open], ids=["gzip", "bz2", "lzma"])
def test_compressed_file_objects_are_read_not_mapped(tmp_path: pathlib.Path, opener: Any) -> None:
    path = tmp_path / "snap.zcp.z"
    with opener(path, "wb") as f:
        zp.dump(_sample(), f)
    with opener(path, "rb") as f:
        assert f.fileno() >= 0  # the compressed file's fd: mapping it would read compressed bytes
        _check(zp.load(f))
    with opener(path, "rb") as f:  # header and scan read through the stream too
        assert zp.read_header(f).buffers
    # torch.load reads the same kind of object
    buf = io.BytesIO()
    torch.save(_sample(), buf)
    with opener(tmp_path / "t.pt.z", "wb") as f:
        f.write(buf.getvalue())
    with opener(tmp_path / "t.pt.z", "rb") as f:
        _check(torch.load(f))


class _Xor(io.RawIOBase):
    """A raw stream over a real file whose ``fileno()`` is that file's, but whose bytes are transformed: the fd
    does not describe what ``read`` returns."""

    def __init__(self, path: pathlib.Path) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - closed in close()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        b[: len(data)] = bytes(x ^ 0x5A for x in data)
        return len(data)

    def fileno(self) -> int:
        return self._f.fileno()

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()
        super().close()


def test_file_objects_whose_fileno_lies_are_read(tmp_path: pathlib.Path) -> None:
    blob = zp.dumps(_sample())
    path = tmp_path / "xored"
    path.write_bytes(bytes(x ^ 0x5A for x in blob))
    with _Xor(path) as raw:
        _check(zp.load(raw))
    with io.BufferedReader(_Xor(path)) as buffered:  # exactly BufferedReader, but not over a FileIO
        _check(zp.load(buffered))

    class Subclass(io.BufferedReader):
        def read(self, size: int | None = -1) -> bytes:
            return super().read(size)

    plain = tmp_path / "plain"
    plain.write_bytes(blob)
    with Subclass(io.FileIO(plain)) as sub:  # a subclass may transform what it reads: read, not mapped
        _check(zp.load(sub))


def test_bytesio_and_pipes_are_read(tmp_path: pathlib.Path) -> None:
    blob = zp.dumps(_sample())
    _check(zp.load(io.BytesIO(blob)))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child writes and exits
        os.close(r)
        with os.fdopen(w, "wb") as out:
            out.write(blob)
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            _check(zp.load(f))
    finally:
        os.waitpid(pid, 0)


def test_plain_files_are_still_mapped(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "snap.zcp"
    zp.dump(_sample(), path)
    for mode, buffering in (("rb", -1), ("rb", 0), ("r+b", -1)):
        with open(path, mode, buffering=buffering) as f:
            obj = zp.load(f)
        _check(obj)
        obj["w"][0, 0] = -1.0  # copy-on-write: the file is unchanged
        # a mapping of the file: the storage lies inside a file-backed mapping of this process
        address = obj["w"].untyped_storage().data_ptr()
        maps = pathlib.Path("/proc/self/maps").read_text().splitlines()
        backing = [line for line in maps if _contains(line, address)]
        assert backing and backing[0].endswith(str(path)), backing
    _check(zp.load(path))


def _contains(line: str, address: int) -> bool:
    start, stop = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
    return start <= address < stop


# -- sparse tensors: validated and released as torch.load does -----------------------------------------------


def _sparse_cases(valid: bool) -> list[torch.Tensor]:
    bad = 0 if valid else 7  # an index past the size
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 2 + bad]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=False)
    csr = torch.sparse_csr_tensor(
        torch.tensor([0, 1, 2]), torch.tensor([0, 1 + bad]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    )
    csc = torch.sparse_csc_tensor(
        torch.tensor([0, 1, 2]), torch.tensor([1, 0 + bad]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    )
    return [coo, csr, csc]


def test_trusted_sparse_loads_release_torchs_pending_list() -> None:
    pending = torch._utils._sparse_tensors_to_validate
    assert not pending
    for sparse in _sparse_cases(valid=True):
        blob = zp.dumps({"s": sparse})
        for checking in (False, True):
            with torch.sparse.check_sparse_tensor_invariants(enable=checking):
                loaded = zp.loads(blob, trusted=True)["s"]
            assert not pending, "a trusted load left its sparse tensors in torch._utils._sparse_tensors_to_validate"
            assert torch.equal(loaded.to_dense(), sparse.to_dense())
        restricted = zp.loads(blob)["s"]  # restricted: the checked rebuild, which adds nothing
        assert not pending
        assert torch.equal(restricted.to_dense(), sparse.to_dense())


@pytest.mark.parametrize("index", [0, 1, 2], ids=["coo", "csr", "csc"])
def test_trusted_sparse_loads_validate_under_check_sparse_tensor_invariants(index: int) -> None:
    pending = torch._utils._sparse_tensors_to_validate
    blob = zp.dumps({"s": _sparse_cases(valid=False)[index]})
    with torch.sparse.check_sparse_tensor_invariants(), pytest.raises(zp.SnapshotError, match="invariants"):
        zp.loads(blob, trusted=True)
    assert not pending  # released on failure too
    # as torch.load: without the check, out-of-bounds indices load (the caller asked for no validation)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        zp.loads(blob, trusted=True)
    assert not pending
    with pytest.raises(zp.SnapshotError):  # a restricted load always checks
        zp.loads(blob)
    assert not pending


def test_a_failed_trusted_load_releases_its_sparse_tensors() -> None:
    pending = torch._utils._sparse_tensors_to_validate
    blob = zp.dumps([_sparse_cases(valid=True)[0], _Boom()])
    with pytest.raises(ValueError, match="boom at load"):
        zp.loads(blob, trusted=True)
    assert not pending


def _boom() -> None:
    raise ValueError("boom at load")


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return _boom, ()


def test_other_loads_pending_sparse_tensors_are_left_alone() -> None:
    pending = torch._utils._sparse_tensors_to_validate
    theirs = _sparse_cases(valid=True)[0]
    pending.append(theirs)  # as a torch.load in flight in another thread would have it
    try:
        zp.loads(zp.dumps(_sparse_cases(valid=True)[0]), trusted=True)
        assert len(pending) == 1 and pending[0] is theirs
    finally:
        pending.clear()


# -- ZeroTensors: refused, as torch.save refuses them ----------------------------------------------------------


def test_zero_tensors_are_refused_with_a_dump_error_naming_them() -> None:
    zero = torch._efficientzerotensor((3, 4))
    with pytest.raises(RuntimeError, match="ZeroTensor"):  # torch.save refuses it too
        torch.save(zero, io.BytesIO())
    for backend in ("auto", "pickle", "cloudpickle", "dill"):
        with pytest.raises(zp.DumpError, match="ZeroTensor") as info:
            zp.dumps({"a": [zero]}, backend=backend)
        assert info.value.path == "obj['a'][0]"
    param = torch.nn.Parameter(torch._efficientzerotensor((2,)), requires_grad=False)
    with pytest.raises(zp.DumpError, match="ZeroTensor"):
        zp.dumps(param)
    # its materialized value pickles
    assert torch.equal(zp.loads(zp.dumps(torch.zeros_like(zero))), torch.zeros(3, 4))


# -- exceptions from the graph's own code reach the caller as themselves -----------------------------------------


class _ReduceRaises:
    def __reduce__(self) -> tuple[Any, ...]:
        raise ValueError("reduce says no")


class _ReduceExRaises:
    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        raise KeyError("reduce_ex says no")


class _GetstateRaises:
    def __getstate__(self) -> Any:
        raise TypeError("getstate says no")  # a TypeError of the user's, not pickle's "cannot pickle"


class _AttributeRaises:
    def __getstate__(self) -> Any:
        return self.missing  # AttributeError from user code


class _ViaRegisteredReducer:
    pass


def _reducer_raises(obj: _ViaRegisteredReducer) -> Any:
    raise RuntimeError("registered reducer says no")


BACKENDS = ["auto", "pickle", "cloudpickle", "dill"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("make", "kind", "match"),
    [
        (_ReduceRaises, ValueError, "reduce says no"),
        (_ReduceExRaises, KeyError, "reduce_ex says no"),
        (_GetstateRaises, TypeError, "getstate says no"),
        (_AttributeRaises, AttributeError, "missing"),
    ],
    ids=["reduce-ValueError", "reduce_ex-KeyError", "getstate-TypeError", "getstate-AttributeError"],
)
def test_exceptions_from_reducers_propagate_as_themselves(backend: str, make: Any, kind: Any, match: str) -> None:
    graph = {"model": [torch.ones(2), make()]}
    with pytest.raises(kind, match=match) as expected:
        __import__("pickle").dumps(graph, protocol=5)
    with pytest.raises(kind, match=match) as info:
        zp.dumps(graph, backend=backend)
    assert not isinstance(info.value, zp.DumpError)
    assert type(info.value) is type(expected.value)
    notes = getattr(info.value, "__notes__", None)
    if hasattr(info.value, "add_note"):  # Python 3.11+: the note says where in the graph
        assert notes and any("obj['model'][1]" in note for note in notes), notes


def test_exceptions_from_a_registered_reducer_propagate(tmp_path: pathlib.Path) -> None:
    zp.register_reducer(_ViaRegisteredReducer, _reducer_raises)
    try:
        path = tmp_path / "snap.zcp"
        zp.dump({"a": torch.ones(2)}, path)
        before = path.read_bytes()
        for backend in BACKENDS:
            with pytest.raises(RuntimeError, match="registered reducer says no") as info:
                zp.dump({"x": _ViaRegisteredReducer()}, path, backend=backend)
            assert not isinstance(info.value, zp.DumpError)
        assert path.read_bytes() == before  # a failed dump leaves the previous snapshot intact
    finally:
        zp.unregister_reducer(_ViaRegisteredReducer)


def test_library_reducers_raising_propagate_as_pickle_lets_them() -> None:
    """The standard library's and torch's own ``__getstate__``/``__reduce__`` are an object's code too: pickle lets
    what they raise propagate (cloudpickle's suite checks a multiprocessing lock's RuntimeError)."""
    import multiprocessing
    import pickle

    from zerocopy_pickle.plugin import Registry

    # No plugins: the built-in parametrize quirk takes parametrized modules (tests/test_quirk_parametrize.py).
    no_plugins = Registry(discover=False)
    for obj in (multiprocessing.Lock(), _parametrized()):
        with pytest.raises(RuntimeError) as expected:
            pickle.dumps(obj, protocol=5)
        for backend in BACKENDS:
            with pytest.raises(RuntimeError) as info:
                zp.dumps({"k": obj}, backend=backend, registry=no_plugins)
            assert not isinstance(info.value, zp.DumpError)
            assert str(info.value) == str(expected.value)


def test_what_pickle_itself_refuses_stays_a_dump_error() -> None:
    cases: list[tuple[object, str]] = [
        (lambda: 0, "pickle"),  # PicklingError from the C pickler
        (io.BytesIO(b"x").getbuffer(), "pickle"),  # TypeError: cannot pickle 'memoryview' object
        (_local_instance(), "pickle"),  # AttributeError "Can't pickle local object", raised by the C pickler
        (sys._getframe(), "pickle"),  # TypeError "cannot pickle 'frame' object"
    ]
    for obj, backend in cases:
        with pytest.raises(zp.DumpError) as info:
            zp.dumps({"k": obj}, backend=backend)
        assert info.value.path == "obj['k']", (obj, str(info.value))
    # a RecursionError is pickle's refusal too (cloudpickle raises a PicklingError that says "deep recursion")
    with pytest.raises(zp.DumpError, match="deep recursion"):
        zp.dumps(_deep())


class _Symmetric(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).T


def _parametrized() -> torch.nn.Module:
    from torch.nn.utils import parametrize

    module = torch.nn.Linear(3, 3)
    parametrize.register_parametrization(module, "weight", _Symmetric())
    return module


def _local_instance() -> object:
    class Local:
        pass

    return Local()


# -- a global that cannot be imported: an ImportError that is also a library error -------------------------------


@pytest.mark.parametrize("missing", ["module", "attribute"])
def test_an_unimportable_global_is_an_import_error_kind(missing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    module = types.ModuleType("zcp_fidelity_vanishing")

    class Vanishing:
        pass

    Vanishing.__module__, Vanishing.__qualname__ = module.__name__, "Vanishing"
    module.Vanishing = Vanishing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    blob = zp.dumps([Vanishing()], backend="pickle")
    if missing == "module":
        del sys.modules[module.__name__]
    else:
        del module.Vanishing  # type: ignore[attr-defined]
    with pytest.raises(ImportError) as info:  # pickle.loads raises an ImportError kind too (or AttributeError)
        zp.loads(blob, trusted=True)
    error = info.value
    assert isinstance(error, zp.MissingGlobalError)
    assert isinstance(error, zp.SnapshotError) and isinstance(error, zp.ZeroCopyPickleError)
    assert (error.module, error.qualname, error.name) == (module.__name__, "Vanishing", module.__name__)
    assert isinstance(error.__cause__, ModuleNotFoundError if missing == "module" else AttributeError)
    assert f"{module.__name__}:Vanishing" in str(error)
    # a restricted load that allows it by name fails the same way
    with pytest.raises(zp.MissingGlobalError):
        zp.loads(blob, allow=[f"{module.__name__}:Vanishing"])


# -- restricted loads accept what torch.load(weights_only=True) accepts ------------------------------------------


class WrapperTensor(torch.Tensor):
    """A wrapper tensor subclass (no storage of its own; the data is an attribute), as torch's tests write them."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> WrapperTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        wrapper.elem = elem
        return wrapper  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_map

        def unwrap(e: Any) -> Any:
            return e.elem if isinstance(e, WrapperTensor) else e

        def wrap(e: Any) -> Any:
            return WrapperTensor(e) if isinstance(e, torch.Tensor) else e

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def test_wrapper_subclasses_load_restricted_when_allowed() -> None:
    wrapper = WrapperTensor(torch.arange(6.0).reshape(2, 3))
    assert wrapper.data_ptr() == 0  # what makes torch pickle it with _rebuild_wrapper_subclass
    # torch.load(weights_only=True) accepts it once the class is allowed
    saved = io.BytesIO()
    torch.save({"w": wrapper}, saved)
    saved.seek(0)
    with torch.serialization.safe_globals([WrapperTensor]):
        assert torch.equal(torch.load(saved, weights_only=True)["w"].elem, wrapper.elem)
    blob = zp.dumps({"w": wrapper})
    assert ("torch._utils", "_rebuild_wrapper_subclass") in zp.scan(blob)
    with pytest.raises(zp.RestrictedLoadError):  # not allowed: refused, as torch refuses it
        zp.loads(blob)
    loaded = zp.loads(blob, allow=[WrapperTensor])["w"]
    assert type(loaded) is WrapperTensor
    assert loaded.shape == (2, 3) and loaded.dtype == torch.float32
    assert torch.equal(loaded.elem, wrapper.elem)
    assert torch.equal((loaded + 1).elem, wrapper.elem + 1)  # its __torch_dispatch__ works


def test_wrapper_subclass_rebuild_refuses_what_is_not_a_wrapper_class() -> None:
    from tests.internals import safe_rebuild_wrapper_subclass

    args = (torch.float32, (2,), (1,), 0, torch.strided, torch.device("cpu"), False)
    assert type(safe_rebuild_wrapper_subclass(WrapperTensor, *args)) is WrapperTensor
    for cls in (torch.Tensor, torch.nn.Parameter, _PlainSubclass, int, "tests.test_fidelity:WrapperTensor"):
        with pytest.raises(zp.UnsafeArgumentError):
            safe_rebuild_wrapper_subclass(cls, *args)
    with pytest.raises(zp.UnsafeArgumentError):
        safe_rebuild_wrapper_subclass(WrapperTensor, torch.float32, (2,), (1,), 0, torch.sparse_coo, args[5], False)


class _PlainSubclass(torch.Tensor):
    pass


@pytest.mark.parametrize("name", ["contiguous_format", "channels_last", "channels_last_3d", "preserve_format"])
def test_memory_formats_load_restricted(name: str) -> None:
    import pickle

    fmt = getattr(torch, name)
    blob = zp.dumps({"fmt": fmt, "t": torch.ones(1, 2, 2, 2)})
    assert ("zerocopy_pickle.rebuild", "rebuild_memory_format") in zp.scan(blob)
    assert zp.loads(blob)["fmt"] is fmt
    assert zp.loads(blob, trusted=True)["fmt"] is fmt
    # what plain pickle writes in a process that imported torch first (torch.save's files): torch._utils
    stream = b"\x80\x05\x8c\x0ctorch._utils\x94\x8c" + bytes([len(name) + 6])
    stream += f"torch.{name}".encode() + b"\x94\x93\x94."
    assert pickle.loads(stream) is fmt
    from .hostile_streams import as_snapshot

    assert zp.loads(as_snapshot(stream)) is fmt


def test_memory_format_rebuild_refuses_other_names() -> None:
    from tests.internals import safe_rebuild_memory_format
    from zerocopy_pickle.rebuild import rebuild_memory_format

    for rebuild in (rebuild_memory_format, safe_rebuild_memory_format):
        assert rebuild("channels_last") is torch.channels_last
        for name in ("strided", "torch.channels_last", "__class__", b"channels_last", None, 7):
            with pytest.raises(zp.UnsafeArgumentError):
                rebuild(name)


# -- a Snapshot alive at interpreter exit closes quietly --------------------------------------------------------


@pytest.mark.slow
def test_snapshots_alive_at_interpreter_exit_close_quietly(tmp_path: pathlib.Path) -> None:
    from .conftest import run_python

    path = tmp_path / "kept.zcp"
    zp.dump({"w": torch.ones(3)}, path)
    proc = run_python(
        """
        import os, sys
        import torch
        import zerocopy_pickle as zp

        frozen = zp.freeze({"w": torch.arange(4.0)})
        loaded = frozen.load()
        opened = zp.Snapshot.open(sys.argv[1])
        adopted = zp.Snapshot.from_fd(frozen.fd)

        class Holder:
            pass

        holder = Holder()
        holder.snap = zp.freeze([torch.zeros(2)])
        holder.me = holder  # a cycle: collected late in the shutdown
        torch.kept = opened  # reachable from another module's globals
        print("ok")
        """,
        str(path),
    )
    assert proc.stdout.strip() == "ok"
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == "", proc.stderr


def _deep() -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(100_000):
        node.append([])
        node = node[0]
    return root


# -- the library's errors pickle, attributes included (a worker process sends them back) ------------------------


def test_every_library_error_pickles_with_its_attributes() -> None:
    import pickle

    from zerocopy_pickle import errors

    cases: list[BaseException] = [
        zp.ZeroCopyPickleError("base"),
        zp.SnapshotError("bad"),
        zp.IntegrityError("sum"),
        zp.UnsafeArgumentError("arg"),
        zp.DumpError("cannot", path="obj.x"),
        zp.Unpicklable("no"),
        zp.RestrictedLoadError("refused", refused=("m", "q"), needed=(("m", "q"),), blocked=(("os", "system"),)),
        zp.RestrictedLoadError(
            "advice", refused=("m", "q"), needed=(("m", "f"),), allow=("m:q", zp.allow_function("m:f"))
        ),
        zp.RestrictedLoadError("trusted only", refused=("m", "q"), trusted_only=("code pickled by value",)),
        zp.DeviceError("dev"),
        zp.ArgumentError("argument"),
        zp.PluginError("plugin", plugin="p", package="pkg"),
        zp.MissingGlobalError("missing", module="a.b", qualname="C.D"),
    ]
    classes = {getattr(errors, name) for name in errors.__all__}
    assert {type(e) for e in cases} >= {c for c in classes if issubclass(c, zp.ZeroCopyPickleError)}
    assert classes - {type(e) for e in cases} == {zp.TrustedOnlyWarning}  # a warning, pickled as any warning is
    for error in cases:
        if hasattr(error, "add_note"):
            error.add_note("a note")
        clone = pickle.loads(pickle.dumps(error))
        assert type(clone) is type(error)
        assert str(clone) == str(error) and clone.args == error.args
        assert vars(clone) == vars(error)
        if isinstance(error, ImportError):
            assert clone.name == error.name
    # through a worker process, as multiprocessing and cloudpickle's suite send them
    missing = zp.MissingGlobalError("missing", module="a.b", qualname="C")
    again = zp.loads(zp.dumps(missing), trusted=True)
    assert (type(again), again.module, again.qualname, again.name) == (zp.MissingGlobalError, "a.b", "C", "a.b")
