"""The native helpers (csrc/) against their Python twins, the backend switch, and building and caching.

The native backend is built once per machine (cached under the user's cache directory). Its tests skip only
where no C++ compiler or ninja exists; with both present, a build that fails is a test failure, so CI (which
has gcc) always runs them.
"""

from __future__ import annotations

import array
import gc
import io
import json
import mmap
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle import native
from zerocopy_pickle.rebuild import StorageBuilder, storage_from_buffer

from .conftest import REPO, TiedNet, run_python

BACKENDS = ["python", "native"]


def _toolchain_missing() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler})"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            return "no ninja"
    return None


@pytest.fixture(scope="session")
def native_built() -> Path:
    """The native extension, built into the cache if needed (skips only without a toolchain)."""
    missing = _toolchain_missing()
    if missing is not None:
        pytest.skip(f"native helpers cannot be built here: {missing}")
    try:
        return native.build()
    except native.NativeBuildError as e:
        pytest.fail(f"a C++ toolchain is present but the native helpers do not build: {e}")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    if name == "native":
        request.getfixturevalue("native_built")
    with native.use(name):
        assert native.backend() == name
        yield name


@pytest.fixture
def native_storage(native_built: Path) -> native.StorageFromBuffer:
    with native.use("native"):
        build = native.storage_builder()
    assert build is not None
    return build


def _anonymous(nbytes: int, fill: bytes = b"") -> mmap.mmap:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    m[: len(fill)] = fill
    return m


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr() if view.nbytes else 0


# ---------------------------------------------------------------------------------------------------------
# Both backends give the same results
# ---------------------------------------------------------------------------------------------------------


def test_switch_reports_the_active_backend(backend: str) -> None:
    assert native.backend() == backend
    assert (native.storage_builder() is None) == (backend == "python")
    assert (StorageBuilder(None)._native is None) == (backend == "python")


@pytest.mark.parametrize("kind", ["mmap-slice", "bytearray", "float-array", "2d-memoryview", "int8-memoryview"])
def test_storage_from_a_writable_buffer_is_a_view(backend: str, kind: str) -> None:
    payload = bytes(range(256)) * 4
    m = _anonymous(8192, payload)
    owner: object
    if kind == "mmap-slice":
        owner = memoryview(m)[: len(payload)]
    elif kind == "bytearray":
        owner = bytearray(payload)
    elif kind == "float-array":
        owner = array.array("f", payload)
    elif kind == "2d-memoryview":
        owner = memoryview(bytearray(payload)).cast("B", (32, 32))
    else:
        owner = memoryview(bytearray(payload)).cast("b")
    storage = storage_from_buffer(owner)
    view = memoryview(owner).cast("B")
    assert type(storage) is torch.UntypedStorage
    assert storage.device == torch.device("cpu")
    assert storage.nbytes() == len(payload)
    assert not storage.resizable()
    assert bytes(storage) == payload
    assert storage.data_ptr() == _address(view)  # aliased, not copied
    torch.empty(0, dtype=torch.uint8).set_(storage)[3] = 99
    assert view[3] == 99


def test_read_only_buffers_are_copied_by_both_backends(backend: str) -> None:
    payload = b"\x01\x02\x03" * 1000
    storage = storage_from_buffer(payload)
    assert bytes(storage) == payload
    torch.empty(0, dtype=torch.uint8).set_(storage)[0] = 42  # its own memory: bytes stay immutable
    assert payload[0] == 1
    builder = StorageBuilder(None)
    assert bytes(builder(memoryview(payload), "cpu")) == payload


def test_native_builder_refuses_read_only_and_non_contiguous(native_storage: native.StorageFromBuffer) -> None:
    with pytest.raises(BufferError):
        native_storage(b"immutable")
    with pytest.raises(BufferError):
        native_storage(memoryview(b"immutable"))
    with pytest.raises(BufferError):
        native_storage(memoryview(bytearray(16))[::2])
    with pytest.raises(TypeError):
        native_storage(12345)


@pytest.mark.parametrize("make", [bytearray, lambda: memoryview(_anonymous(4096))[100:100], lambda: b""])
def test_zero_length_buffers(backend: str, make: Callable[[], Any]) -> None:
    storage = storage_from_buffer(make())
    assert storage.nbytes() == 0
    assert storage.device == torch.device("cpu")
    reference = torch.UntypedStorage(0)
    assert storage.resizable() == reference.resizable()


def test_native_builder_zero_length_matches_untyped_storage(native_storage: native.StorageFromBuffer) -> None:
    m = _anonymous(4096)
    storage = native_storage(memoryview(m)[10:10])
    assert storage.nbytes() == 0 and storage.resizable()
    m.close()  # an empty storage holds no export: nothing to protect


def _sample_objects() -> dict[str, object]:
    torch.manual_seed(0)
    base = torch.arange(64, dtype=torch.float64)
    return {
        "model": TiedNet().eval(),
        "dtypes": [torch.ones(3, dtype=dtype) for dtype in (torch.float16, torch.bfloat16, torch.int8, torch.bool)],
        "views": (base, base[10:20], base.view(8, 8).t()),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "complex": torch.randn(4, dtype=torch.complex64),
    }


def _flatten(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return [*obj.state_dict(keep_vars=True).values()]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _flatten(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _flatten(value)]
    return []


@pytest.mark.parametrize("source", ["loads", "load-path", "freeze", "plain-pickle"])
def test_loads_agree_between_backends(native_built: Path, tmp_path: Path, source: str) -> None:
    obj = _sample_objects()
    blob = zp.dumps(obj)
    path = tmp_path / "s.zcp"
    zp.dump(obj, path)
    snap = zp.freeze(obj)
    raw: list[memoryview] = []
    file = io.BytesIO()
    zp.ZeroCopyPickler(file, buffer_callback=lambda b: raw.append(b.raw())).dump(obj)
    stream = file.getvalue()

    def load() -> object:
        if source == "loads":
            return zp.loads(blob, trusted=True)
        if source == "load-path":
            return zp.load(path, trusted=True)
        if source == "freeze":
            return snap.load()
        # Without this library's unpickler: rebuild_storage -> storage_from_buffer on each buffer.
        return pickle.loads(stream, buffers=[bytearray(b) for b in raw])

    results: dict[str, Any] = {}
    for name in BACKENDS:
        with native.use(name):
            results[name] = load()
    py, nat = (_flatten(results[name]) for name in BACKENDS)
    assert len(py) == len(nat) == len(_flatten(obj)) > 10
    for a, b in zip(py, nat, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
        assert torch.equal(a.detach(), b.detach())
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()

    # The same storage sharing (tied weights, views of one base) either way.
    def sharing(tensors: list[torch.Tensor]) -> list[int]:
        firsts: dict[int, int] = {}
        return [firsts.setdefault(t.untyped_storage().data_ptr(), i) for i, t in enumerate(tensors)]

    assert sharing(py) == sharing(nat)
    for name in BACKENDS:
        model = results[name]["model"]
        assert model.head.weight is model.embed.weight
    snap.close()


# ---------------------------------------------------------------------------------------------------------
# The native storage holds the buffer export
# ---------------------------------------------------------------------------------------------------------


def test_native_storage_holds_the_export(native_storage: native.StorageFromBuffer) -> None:
    m = _anonymous(8192, b"\x07" * 8192)
    piece = memoryview(m)[4096:]
    storage = native_storage(piece)
    with pytest.raises(BufferError):
        piece.release()  # the storage's export of the slice pins it
    del piece
    gc.collect()
    with pytest.raises(BufferError):
        m.close()
    assert bytes(storage)[:2] == b"\x07\x07"
    del storage
    gc.collect()
    m.close()  # the last storage released the export


def test_native_storage_over_the_mmap_itself_holds_it(native_storage: native.StorageFromBuffer) -> None:
    m = _anonymous(4096, b"abc")
    tensor = torch.empty(0, dtype=torch.uint8).set_(native_storage(m))
    with pytest.raises(BufferError):
        m.close()
    assert bytes(tensor[:3].tolist()) == b"abc"
    del tensor
    gc.collect()
    m.close()


def test_native_storage_freed_on_another_thread(native_storage: native.StorageFromBuffer) -> None:
    m = _anonymous(4096)
    box = [native_storage(m)]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    gc.collect()
    m.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend_env", BACKENDS)
def test_no_crash_after_dropping_every_other_reference(
    request: pytest.FixtureRequest, tmp_path: Path, backend_env: str
) -> None:
    if backend_env == "native":
        request.getfixturevalue("native_built")
    code = """
    import gc, mmap, sys, torch, zerocopy_pickle as zp
    from zerocopy_pickle import native
    from zerocopy_pickle.rebuild import storage_from_buffer
    assert native.backend() == sys.argv[2], native.backend()
    zp.dump({"t": torch.arange(1 << 20, dtype=torch.int64)}, sys.argv[1])
    view = zp.load(sys.argv[1])["t"][1000:]
    m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)
    m[:8] = (7).to_bytes(8, "little")
    t = torch.empty(0, dtype=torch.int64).set_(storage_from_buffer(memoryview(m)), 0, (1 << 17,), (1,))
    try:
        m.close()
    except BufferError:
        print("refused")
    del m
    gc.collect()
    t += 1
    print(int(t[0]), int(view[0]), int(view.sum()))
    del t, view
    gc.collect()
    print("done")
    """
    env = {native.ENV: backend_env}
    out = run_python(code, str(tmp_path / "a.zcp"), backend_env, env=env).stdout.split()
    assert out == ["refused", "8", "1000", str(sum(range(1000, 1 << 20))), "done"]


@pytest.mark.slow
def test_native_storages_alive_at_interpreter_exit(native_built: Path, tmp_path: Path) -> None:
    """Storages still alive when the interpreter shuts down (globals, a reference cycle, a daemon thread's
    frame) release or leak their exports quietly: no crash, no hang, no error output. The daemon thread says when
    it holds its load (an Event), then blocks for good: the interpreter exits under it, never a race with it."""
    code = """
    import mmap, sys, threading, torch, zerocopy_pickle as zp
    from zerocopy_pickle import native
    assert native.backend() == "native"
    zp.dump({"t": torch.arange(1000)}, sys.argv[1])
    kept = zp.load(sys.argv[1])
    m = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE)
    cycle = {"storage": native.storage_builder()(m)}
    cycle["self"] = cycle
    holding, never = threading.Event(), threading.Event()
    def hold():
        local = zp.load(sys.argv[1])
        holding.set()
        never.wait()  # alive, with the load in its frame, when the interpreter shuts down
    threading.Thread(target=hold, daemon=True).start()
    assert holding.wait(timeout=60), "the daemon thread never loaded"  # a bound on a hang, not a delay
    print("exiting", int(kept["t"].sum()), int(sum(t.is_alive() for t in threading.enumerate())))
    """
    proc = run_python(code, str(tmp_path / "x.zcp"), env={native.ENV: "native"}, timeout=120)
    assert proc.stdout.split() == ["exiting", str(sum(range(1000))), "2"]  # the main thread and the holder
    assert not any(word in proc.stderr for word in ("Traceback", "Fatal", "Error", "exception")), proc.stderr


# ---------------------------------------------------------------------------------------------------------
# TorchScript archives from a buffer
# ---------------------------------------------------------------------------------------------------------


class Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.register_buffer("offset", torch.arange(4, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) + self.offset
        if bool(y.sum() > 0):
            return y.relu()
        return y.tanh()


class Traced(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3), torch.nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).mean(-1)


def _archives() -> dict[str, tuple[bytes, torch.Tensor]]:
    torch.manual_seed(0)
    scripted = torch.jit.script(Scripted().eval())
    traced = torch.jit.trace(Traced().eval(), torch.randn(2, 2, 10))
    out = {}
    for name, module, x in (("script", scripted, torch.randn(3, 8)), ("trace", traced, torch.randn(5, 2, 10))):
        f = io.BytesIO()
        torch.jit.save(module, f)
        out[name] = (f.getvalue(), x)
    return out


@pytest.fixture(scope="module")
def archives() -> dict[str, tuple[bytes, torch.Tensor]]:
    return _archives()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kind", ["script", "trace"])
@pytest.mark.parametrize("holder", ["bytes", "bytearray", "mmap", "mmap-slice", "numpy"])
@pytest.mark.parametrize("map_location", [None, "cpu", torch.device("cpu")])
def test_jit_load_from_buffer_equals_torch_jit_load(
    backend: str, archives: dict[str, tuple[bytes, torch.Tensor]], kind: str, holder: str, map_location: object
) -> None:
    data, x = archives[kind]
    expected = torch.jit.load(io.BytesIO(data))
    m: mmap.mmap | None = None
    buffer: object
    if holder == "bytes":
        buffer = data
    elif holder == "bytearray":
        buffer = bytearray(data)
    elif holder == "mmap":
        buffer = m = _anonymous(len(data), data)
    elif holder == "numpy":  # what the TorchScript quirk passes: the archive tensor's .numpy()
        pytest.importorskip("numpy")
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()
    else:  # an arena-like slice in the middle of a mapping
        m = _anonymous(len(data) + 8192)
        m[4096 : 4096 + len(data)] = data
        buffer = memoryview(m)[4096 : 4096 + len(data)]
    loaded = native.jit_load_from_buffer(buffer, map_location)
    assert isinstance(loaded, torch.jit.RecursiveScriptModule)
    assert loaded.code == expected.code
    assert loaded.state_dict().keys() == expected.state_dict().keys()
    for key, value in expected.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
        assert loaded.state_dict()[key].device == torch.device("cpu")
    assert torch.equal(loaded(x), expected(x))
    # Nothing in the module points into the buffer: scribbling over it changes nothing.
    if m is not None:
        m[:] = bytes(len(m))
        assert torch.equal(loaded(x), expected(x))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_jit_load_errors_agree(native_built: Path, archives: dict[str, tuple[bytes, torch.Tensor]]) -> None:
    data, _ = archives["script"]
    cases = [(b"", None), (b"not a zip archive" * 10, None), (data[: len(data) // 2], None), (data, 3.5)]
    for buffer, location in cases:
        errors: list[type[BaseException] | None] = []
        for name in BACKENDS:
            with native.use(name):
                try:
                    native.jit_load_from_buffer(buffer, location)
                    errors.append(None)
                except Exception as e:
                    errors.append(type(e))
        assert errors[0] is not None and errors[0] is errors[1], (buffer[:20], location, errors)


# ---------------------------------------------------------------------------------------------------------
# Choosing the backend: the environment variable, the cache, failures
# ---------------------------------------------------------------------------------------------------------

PRINT_BACKEND = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from zerocopy_pickle import native
    print(native.backend())
print(sum(issubclass(w.category, native.NativeWarning) for w in caught))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", "python"), ("python", "python"), ("1", "native"), ("native", "native"), ("", "native"), ("auto", "native")],
)
def test_environment_variable_forces_the_backend(native_built: Path, value: str, expected: str) -> None:
    out = run_python(PRINT_BACKEND, env={native.ENV: value}).stdout.split()
    assert out == [expected, "0"]


@pytest.mark.slow
def test_invalid_environment_value_fails_at_import() -> None:
    # The backend is chosen when the snapshot machinery is first imported (`import zerocopy_pickle` alone
    # imports no torch): `from zerocopy_pickle import load` is that moment.
    proc = run_python("from zerocopy_pickle import load", env={native.ENV: "sometimes"}, check=False)
    assert proc.returncode != 0
    assert "ArgumentError" in proc.stderr and native.ENV in proc.stderr


@pytest.mark.slow
def test_auto_uses_only_a_cached_build_and_never_compiles(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code = """
    import json, warnings
    import torch, zerocopy_pickle as zp
    from zerocopy_pickle import native
    native._compile = None  # auto must never get there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = zp.loads(zp.dumps({"t": torch.arange(5)}))["t"].tolist()
    ours = sum(issubclass(w.category, native.NativeWarning) for w in caught)
    print(json.dumps([native.backend(), out, str(native.cache_dir()), ours]))
    """
    stdout = run_python(code, env={native.ENV: "", native.CACHE_ENV: str(cache)}).stdout
    assert json.loads(stdout) == ["python", [0, 1, 2, 3, 4], str(cache), 0]
    assert not cache.exists()  # not even a folder


def test_cache_directory_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    monkeypatch.delenv("ZEROCOPY_PICKLE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "zerocopy_pickle"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.cache_dir() == tmp_path / "home" / ".cache" / "zerocopy_pickle"
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "explicit"))
    assert native.cache_dir() == tmp_path / "explicit"
    path = native.extension_path()
    assert path.parent.parent == tmp_path / "explicit" / "native"
    assert torch.__version__ in path.parent.name and path.suffix == ".so"


def test_the_library_files_earlier_variable_is_still_read_and_the_new_one_wins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.internals import remote

    assert native.CACHE_ENV == "ZEROCOPY_PICKLE_HOME"
    monkeypatch.delenv("ZEROCOPY_PICKLE_HOME", raising=False)
    monkeypatch.delenv(remote.DIR_ENV, raising=False)
    monkeypatch.setenv("ZEROCOPY_PICKLE_CACHE", str(tmp_path / "old"))
    assert native.cache_dir() == tmp_path / "old"
    assert remote.remote_dir() == tmp_path / "old" / "remote"
    monkeypatch.setenv("ZEROCOPY_PICKLE_HOME", str(tmp_path / "new"))
    assert native.cache_dir() == tmp_path / "new"
    assert native.extension_path().parent.parent == tmp_path / "new" / "native"
    assert remote.remote_dir() == tmp_path / "new" / "remote"


def test_the_source_ships_where_the_package_finds_it() -> None:
    assert native._SOURCE.is_file()
    assert native._SOURCE.name == "zerocopy_native.cpp"
    assert "PYBIND11_MODULE" in native._SOURCE.read_text()


@pytest.mark.slow
def test_a_broken_cached_build_falls_back_with_one_warning(tmp_path: Path) -> None:
    code = """
    import json, warnings
    import torch, zerocopy_pickle as zp
    from zerocopy_pickle import native
    path = native.extension_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not a shared object")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backends = [native.backend(), native.backend()]
        blob = zp.dumps({"t": torch.arange(4)})
        values = [zp.loads(blob)["t"].tolist() for _ in range(3)]
        native.storage_builder()
    ours = [w for w in caught if issubclass(w.category, native.NativeWarning)]
    print(json.dumps([backends, values, len(ours), str(ours[0].message) if ours else ""]))
    """
    stdout = run_python(code, env={native.ENV: "", native.CACHE_ENV: str(tmp_path / "cache")}).stdout
    backends, values, count, message = json.loads(stdout)
    assert backends == ["python", "python"]
    assert values == [[0, 1, 2, 3]] * 3
    assert count == 1
    assert "could not be loaded" in message and "Python implementations" in message


@pytest.mark.slow
def test_forced_native_without_a_compiler_fails_at_import_with_our_error(tmp_path: Path) -> None:
    code = """
    try:
        from zerocopy_pickle import load
    except Exception as e:
        from zerocopy_pickle.errors import ZeroCopyPickleError
        print(type(e).__name__, isinstance(e, ZeroCopyPickleError), isinstance(e, ImportError))
        print(e)
    """
    env = {native.ENV: "1", native.CACHE_ENV: str(tmp_path / "cache"), "CXX": "/nonexistent/c++"}
    out = run_python(code, env=env).stdout.splitlines()
    assert out[0] == "NativeBuildError True True"
    assert "no C++ compiler" in out[1]


@pytest.mark.slow
def test_a_build_that_fails_raises_and_auto_stays_python(tmp_path: Path) -> None:
    if _toolchain_missing():
        pytest.skip("no C++ toolchain")
    broken = tmp_path / "broken.cpp"
    broken.write_text("#include <pybind11/pybind11.h>\nthis is not C++;\n")
    code = """
    import json, sys, warnings
    from pathlib import Path
    import torch, zerocopy_pickle as zp
    from zerocopy_pickle import native
    native._SOURCE = Path(sys.argv[1])
    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["auto"] = native.backend()  # auto: nothing cached for this source, and no build attempt
        for attempt in ("build", "again", "use"):
            try:
                if attempt == "use":
                    with native.use("native"):
                        pass
                else:
                    native.build()
            except native.NativeBuildError as e:
                result[attempt] = [type(e).__name__, "this is not C++" in str(e)]
        result["after"] = native.backend()
        result["load"] = zp.loads(zp.dumps({"t": torch.ones(2)}))["t"].tolist()
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, native.NativeWarning)]
    print(json.dumps(result))
    """
    cache = tmp_path / "cache"
    result = json.loads(run_python(code, str(broken), env={native.ENV: "", native.CACHE_ENV: str(cache)}).stdout)
    assert result["auto"] == "python" and result["after"] == "python"
    assert result["build"] == result["again"] == result["use"] == ["NativeBuildError", True]
    assert result["load"] == [1.0, 1.0]
    assert result["warnings"] == []
    leftovers = [p.name for p in cache.rglob("*") if p.name.startswith(("build-", "."))]
    assert leftovers == []  # no half-built folder or staged file left behind


TINY_EXTENSION = """
#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("storage_from_buffer", [](pybind11::object o) { return o; });
  m.def("jit_load_from_buffer", [](pybind11::object o, pybind11::object) { return o; });
  m.def("analyze_stream", [](pybind11::object) { return pybind11::make_tuple(4, 0, pybind11::none()); });
}
"""


@pytest.mark.slow
def test_concurrent_builds_build_once(tmp_path: Path) -> None:
    """Two processes, each with two threads, build the same (tiny) extension at once: one compiles."""
    if _toolchain_missing():
        pytest.skip("no C++ toolchain")
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_EXTENSION)
    code = """
    import sys, threading
    from pathlib import Path
    from zerocopy_pickle import native
    native._SOURCE = Path(sys.argv[1])
    compile_ = native._compile
    def counting(path):
        print("compiled", flush=True)
        return compile_(path)
    native._compile = counting
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(native.build())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and paths[0].is_file(), paths
    print(native.backend(), native.storage_builder()(b"x") == b"x")
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{native.ENV: "", native.CACHE_ENV: str(tmp_path / "cache")})
    running = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(source)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in running]
    for p, (_, err) in zip(running, outputs, strict=True):
        assert p.returncode == 0, err
    lines = [line for out, _ in outputs for line in out.splitlines()]
    assert lines.count("compiled") == 1
    assert lines.count("native True") == 2
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 1
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.startswith(("build-", "."))]
