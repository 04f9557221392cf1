"""The switch between the optional native helpers (``csrc/``) and their pure-Python equivalents (public:
:func:`backend`, :func:`status`, :func:`build`, :func:`use`, :func:`cache_dir` and the errors; the rest serves the
library).

Every function here has a Python implementation that gives the same results; a native one replaces it only
where it measurably pays (``benchmarks/native.py``):

* :func:`storage_builder`: the storage over a writable buffer, for :mod:`zerocopy_pickle.rebuild`. Native, it
  holds a buffer export for the storage's life and takes 0.17 µs against 0.8 to 1.7 µs for
  ``torch.frombuffer(...).untyped_storage()``: a whole load of many small tensors is about 10% faster.
* :func:`jit_load_from_buffer`: a TorchScript archive imported in place from the arena; the Python path
  copies the archive four times (``BytesIO``, ``bytes``, ``std::string``, ``std::istringstream``) before
  importing it: for a 128 MiB archive, peak RSS +645 MiB against +133 MiB and 5 to 8 times the time.
* :func:`stream_analyzer`: the bounds check and semantic analysis of a pickle stream that every restricted
  load runs before unpickling (:func:`zerocopy_pickle._trust.semantics.uses`), in one native pass. See
  :func:`zerocopy_pickle._trust.semantics.uses` for the figures.

:func:`backend` says which implementation is active, :func:`status` also why (``zerocopy-pickle native`` prints
it). ``ZEROCOPY_PICKLE_NATIVE`` chooses, read once when this
module is imported (by the first use of the snapshot API: ``import zerocopy_pickle`` alone does not import it):

* ``0`` or ``python``: always Python.
* ``1`` or ``native``: always native. The helpers are built (or loaded from the cache) at import; if that
  fails, :class:`NativeBuildError` is raised, at import and on every later use.
* unset or ``auto`` (the default): native if this exact build (source, torch, Python) is already in the cache,
  Python otherwise. **Auto never starts a compiler.** A build takes 30 to 60 seconds of CPU and saves under
  a microsecond per storage on each load, so compiling on a first load would stall exactly the cold starts
  this library exists to make fast (a fresh container has an empty cache), for a gain that takes tens of
  thousands of loads to pay back. Build once, explicitly, where it pays: ``build()`` (or any use with
  ``ZEROCOPY_PICKLE_NATIVE=1``), for instance in an image's build step after ``pip install``. If a cached
  build exists but cannot be loaded, auto warns once (:class:`NativeWarning`) and uses Python.

Building happens at run time only, through ``torch.utils.cpp_extension`` (a C++ compiler and ninja on the
machine; pybind11 comes with torch's headers): ``pip install`` never compiles anything and never needs torch
in an isolated build environment. Builds are kept under ``native/`` in the library's files
(``$ZEROCOPY_PICKLE_HOME``, else its earlier name ``$ZEROCOPY_PICKLE_CACHE``, else
``$XDG_CACHE_HOME/zerocopy_pickle``, else ``~/.cache/zerocopy_pickle``), in a folder keyed by the torch version,
the Python version and a hash of the source and flags; a thread lock and a file lock make concurrent builds
(threads or processes) build once, and a finished extension appears in the cache atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import io
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch

from ._home import HOME_ENV, home_dir
from .errors import ArgumentError, ZeroCopyPickleError

__all__ = [
    "CACHE_ENV",
    "ENV",
    "BackendStatus",
    "NativeBuildError",
    "NativeWarning",
    "backend",
    "build",
    "cache_dir",
    "extension_path",
    "jit_load_from_buffer",
    "status",
    "storage_builder",
    "stream_analyzer",
    "use",
]

ENV = "ZEROCOPY_PICKLE_NATIVE"
CACHE_ENV = HOME_ENV
"""Where builds are kept (``ZEROCOPY_PICKLE_HOME``; its earlier name ``ZEROCOPY_PICKLE_CACHE`` is still read)."""
EXTRA_CFLAGS = ("-O3",)

_HERE = Path(__file__).resolve().parent
# The C++ source: an installed wheel carries it as package data (zerocopy_pickle/_csrc/), a source checkout or
# an editable install has it at the top of the repository (csrc/). Module-level so that tests can point it
# elsewhere.
_SOURCE_CANDIDATES = (_HERE / "_csrc" / "zerocopy_native.cpp", _HERE.parent / "csrc" / "zerocopy_native.cpp")
_SOURCE = next((p for p in _SOURCE_CANDIDATES if p.is_file()), _SOURCE_CANDIDATES[-1])

StorageFromBuffer = Callable[[Any], torch.UntypedStorage]
StreamAnalyzer = Callable[[bytes], tuple[int, int, Any]]


class NativeBuildError(ZeroCopyPickleError, ImportError):
    """The native helpers were required (``ZEROCOPY_PICKLE_NATIVE=1``, :func:`build`) but could not be built
    or loaded. The message says why (no compiler, the compiler's own errors, a broken cached build)."""


class NativeWarning(UserWarning):
    """A cached native build exists but could not be loaded; the Python implementations are used instead."""


_MODES = {"": "auto", "auto": "auto", "0": "python", "python": "python", "1": "native", "native": "native"}


def _mode_from_env() -> str:
    value = os.environ.get(ENV, "")
    try:
        return _MODES[value.strip().lower()]
    except KeyError:
        raise ArgumentError(
            f"{ENV}={value!r}: expected 0 or python (Python helpers), 1 or native (native helpers, built if "
            f"needed), or unset / auto (native helpers only if already built)"
        ) from None


class _State:
    """This process's choice of backend (one instance; every change happens under ``_lock``)."""

    __slots__ = ("active", "failure", "imported", "load_error", "mode", "override", "resolved", "setting")

    def __init__(self) -> None:
        self.setting = os.environ.get(ENV)  # as read at import, for status()
        self.mode = _mode_from_env()
        self.resolved = False  # whether `active` reflects `mode` yet (resolution happens on first use)
        self.active: ModuleType | None = None  # the loaded extension while the native backend is active
        self.failure: NativeBuildError | None = None  # a forced build that failed: raised again, not retried
        self.imported: dict[Path, ModuleType] = {}  # extensions loaded in this process, by path (once each)
        self.load_error: str | None = None  # auto: why the cached build could not be loaded, for status()
        self.override: str | None = None  # the backend use() chose, inside its block


_lock = threading.RLock()
_state = _State()
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------------------------


def backend() -> str:
    """``"native"`` or ``"python"``: which implementation the functions of this module use.

    ``zerocopy-pickle native`` prints it, and why.

    Examples:
        >>> from zerocopy_pickle import native
        >>> native.backend() in ("native", "python")
        True
    """
    return "python" if _extension() is None else "native"


def storage_builder() -> StorageFromBuffer | None:
    """The native builder of a CPU ``UntypedStorage`` over a writable, C-contiguous, non-empty buffer, or
    ``None`` when the Python backend is active (``torch.frombuffer`` then does the same job).

    The native storage holds a buffer export of its argument while it lives (released, GIL taken, when the
    storage is freed), so an ``mmap`` under it refuses ``close()``. It refuses read-only buffers
    (``BufferError``): callers copy those. :mod:`zerocopy_pickle.rebuild` asks once per load.
    """
    module = _extension()
    return None if module is None else cast(StorageFromBuffer, module.storage_from_buffer)


def stream_analyzer() -> StreamAnalyzer | None:
    """The native twin of :func:`zerocopy_pickle._trust.streamcheck.check_stream` followed by
    :func:`zerocopy_pickle._trust.semantics.analyze`, in one pass over the stream, or ``None`` when the Python backend
    is active. :func:`zerocopy_pickle._trust.semantics.uses` calls it and wraps its result.

    It returns ``(code, offset, payload)``. Code 0: the stream passes both checks, and ``payload`` is
    ``(globals, called, instantiated, mutated, next_buffers)``, with ``mutated`` a list of ``(pair, bits)``
    (1 build, 2 setitem, 4 append, 8 add) in order of first mutation. Any other code: the Python checks would
    raise (1 malformed, 3 nested too deep: SnapshotError; 2 refused: RestrictedLoadError), or (4) the stream
    holds something the native code leaves to Python (a text memo index that is not plain digits, a stream
    over 2 GiB); the caller then runs the Python checks, which raise the precise error or decide.
    """
    module = _extension()
    return None if module is None else cast(StreamAnalyzer, module.analyze_stream)


def jit_load_from_buffer(buffer: Any, map_location: Any = None) -> Any:
    """Load a TorchScript archive (``torch.jit.save`` output) from a bytes-like object: what ``torch.jit.load``
    returns, with the same ``map_location`` (``None``, a device string or a ``torch.device``).

    Native, the archive is read in place (nothing in the returned module points into ``buffer``: every record
    is copied out by the import, as ``torch.jit.load`` does). The Python implementation wraps the bytes in a
    ``BytesIO``, which ``torch.jit.load`` copies into ``bytes`` and torch again into a ``std::string`` and a
    ``std::istringstream``.
    """
    view = memoryview(buffer).cast("B")
    module = _extension()
    if module is None:
        return torch.jit.load(io.BytesIO(view), map_location=map_location)
    from torch.jit._recursive import wrap_cpp_module
    from torch.jit._serialization import validate_map_location

    return wrap_cpp_module(module.jit_load_from_buffer(view, validate_map_location(map_location)))


def _extension() -> ModuleType | None:
    """The loaded extension if the native backend is active, else None; resolves the mode on first use."""
    state = _state
    if state.resolved:
        return state.active
    with _lock:
        if not state.resolved:
            if state.mode == "python":
                state.active = None
            elif state.mode == "native":
                state.active = _load_or_build()  # or NativeBuildError: stays unresolved, the failure is kept
            else:
                state.active = _load_cached_quietly()
            state.resolved = True
            if log.isEnabledFor(logging.INFO):  # once per process; status() hashes the source
                log.info("%s backend active (%s)", "python" if state.active is None else "native", status().reason)
        return state.active


def _load_cached_quietly() -> ModuleType | None:
    """Auto: the cached extension if there is one, else None. Never builds; warns once if loading fails."""
    if not _SOURCE.is_file():  # installed without the source: nothing can have been built for it
        return None
    try:
        path = extension_path()
        if not path.is_file():
            return None
        return _import_extension(path)
    except Exception as e:
        _state.load_error = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"zerocopy_pickle: the cached native helpers could not be loaded ({type(e).__name__}: {e}); "
            f"using the Python implementations. Rebuild with zerocopy_pickle.native.build(force=True) or "
            f"set {ENV}=0 to silence this.",
            NativeWarning,
            stacklevel=4,
        )
        return None


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """For tests and benchmarks: make ``name`` (``"python"`` or ``"native"``) the active backend inside the
    block, whatever the environment says; ``"native"`` builds if needed (:class:`NativeBuildError`).
    Loads started inside the block use it (a load resolves its storage builder when it starts)."""
    if name not in ("python", "native"):
        raise ArgumentError(f"backend must be 'python' or 'native', not {name!r}")
    module = None if name == "python" else _load_or_build()
    with _lock:
        saved = _state.resolved, _state.active, _state.override
        _state.resolved, _state.active, _state.override = True, module, name
    try:
        yield
    finally:
        with _lock:
            _state.resolved, _state.active, _state.override = saved


@dataclass(frozen=True)
class BackendStatus:
    """What :func:`status` returns.

    Attributes:
        backend: ``"native"`` or ``"python"``, as :func:`backend` says.
        mode: what ``ZEROCOPY_PICKLE_NATIVE`` asked for: ``"auto"``, ``"native"`` or ``"python"``.
        reason: one line saying why this backend is active (``"auto: no cached build for torch 2.5.1,
            Python 3.11"``, ``"ZEROCOPY_PICKLE_NATIVE=0"``, ``"auto: cached build at /.../x.so"``). Auto mode's
            own reasons start with ``"auto:"``; inside a :func:`use` block it names that instead.
        extension_path: where the build for this source, torch and Python lives in the cache, or would once
            built (:func:`extension_path`); None when the package was installed without the C++ source.
        built: whether that file exists.
    """

    backend: str
    mode: str
    reason: str
    extension_path: Path | None
    built: bool


def status() -> BackendStatus:
    """Which backend is active and why, and where its build lives in the cache.

    It resolves the backend as a first use would: in auto mode that imports a cached build if there is one
    (never compiles), so the answer is what loads in this process use.

    Examples:
        ```python
        from zerocopy_pickle import native

        state = native.status()
        print(f"{state.backend} ({state.reason})")
        # python (auto: no cached build for torch 2.5.1, Python 3.11)
        ```

    Raises:
        NativeBuildError: ``ZEROCOPY_PICKLE_NATIVE=1`` and the helpers cannot be built or loaded.
    """
    module = _extension()
    path: Path | None = None
    if _SOURCE.is_file():
        with contextlib.suppress(OSError):
            path = extension_path()
    built = path is not None and path.is_file()
    active = "python" if module is None else "native"
    setting = f"{ENV}={_state.setting}"
    if _state.override is not None:
        reason = f"chosen by zerocopy_pickle.native.use({_state.override!r}) in this process"
    elif _state.mode == "python":
        reason = setting
    elif _state.mode == "native":
        reason = f"{setting}: built or loaded from the cache at {path}"
    elif module is not None:
        reason = f"auto: cached build at {path}"
    elif path is None:
        reason = "auto: installed without the C++ source, so there is nothing to build"
    elif not built:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        reason = f"auto: no cached build for torch {torch.__version__}, Python {version}"
    else:
        reason = f"auto: the cached build at {path} could not be loaded ({_state.load_error or 'unknown error'})"
    return BackendStatus(active, _state.mode, reason, path, built)


# ---------------------------------------------------------------------------------------------------------
# Building and caching
# ---------------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The root of this library's files, native builds under ``native/``: ``$ZEROCOPY_PICKLE_HOME``, else
    ``$ZEROCOPY_PICKLE_CACHE`` (its earlier name), else ``$XDG_CACHE_HOME/zerocopy_pickle``, else
    ``~/.cache/zerocopy_pickle``. (The name is kept for callers; it is not the model cache's directory.)"""
    return home_dir()


def _build_key() -> tuple[str, str]:
    """(folder name, module name) for the current source, flags, torch and Python."""
    digest = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        repr(EXTRA_CFLAGS).encode(),
        torch.__version__.encode(),
        str(getattr(torch.version, "git_version", "")).encode(),
        sys.version.encode(),
        sys.abiflags.encode(),
        platform.machine().encode(),
    ):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    short = digest.hexdigest()[:16]
    folder = f"torch-{torch.__version__}-{sys.implementation.cache_tag}-{short}"
    # The module name carries the hash too: torch's extension versioner renames a module whose sources change
    # under the same name within one process, and a unique name keeps PyInit_<name> and the file in step.
    return folder, f"_zerocopy_pickle_native_{short}"


def extension_path() -> Path:
    """Where the built extension for this source, torch and Python lives in the cache (it may not exist)."""
    folder, name = _build_key()
    return cache_dir() / "native" / folder / f"{name}.so"


def build(force: bool = False) -> Path:
    """Build the native helpers into the cache now (or find them there) and make them active unless
    ``ZEROCOPY_PICKLE_NATIVE=0``; returns the extension's path. ``force`` rebuilds even if cached.

    Raises :class:`NativeBuildError` if there is no C++ compiler or ninja, or the build fails.

    Examples:
        Once per machine or image (``zerocopy-pickle native --build`` does the same), for instance after
        ``pip install 'zerocopy-pickle[native]'``:

        ```python
        from zerocopy_pickle import native

        native.backend()  # "python": nothing built yet (the default, auto, never starts a compiler)
        native.build()    # 30 to 60 s of CPU, once: later processes find the build in the cache
        native.backend()  # "native"
        ```
    """
    with _lock:
        module = _load_or_build(force=force)
        _state.failure = None
        if _state.mode != "python":
            _state.resolved, _state.active = True, module
        return extension_path()


def _load_or_build(force: bool = False) -> ModuleType:
    with _lock:
        if _state.failure is not None and not force:
            raise _state.failure
        try:
            return _load_or_build_locked(force)
        except NativeBuildError as e:
            _state.failure = e
            raise


def _load_or_build_locked(force: bool) -> ModuleType:
    try:
        path = extension_path()
    except OSError as e:
        raise NativeBuildError(f"cannot read the native helpers' source {_SOURCE}: {e}") from e
    if path.is_file() and not force:
        try:
            return _import_extension(path)
        except Exception:  # a broken cached build: build it again below
            pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(path.parent / "lock", "a")  # noqa: SIM115 (held for the whole block below)
    except OSError as e:
        raise NativeBuildError(f"cannot create the native build cache {path.parent}: {e}") from e
    with lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process building the same key: wait for it
        if path.is_file() and not force:
            with contextlib.suppress(Exception):
                return _import_extension(path)
        with contextlib.suppress(OSError):  # what a killed build left behind (nobody else builds here now)
            for stale in path.parent.iterdir():
                if stale.name.startswith("build-"):
                    shutil.rmtree(stale, ignore_errors=True)
                elif stale.name.startswith(".") and stale.name.endswith(".tmp"):
                    stale.unlink(missing_ok=True)
        module = _compile(path)
    return module


def _compile(path: Path) -> ModuleType:
    """Compile the extension in a private folder next to ``path``, then move it to ``path`` atomically."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"cannot build the native helpers: no C++ compiler ({compiler!r} is not on PATH)")
    saved_path = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        # The ninja wheel's binary sits in the environment's bin/, which is not on PATH unless it is activated.
        try:
            import ninja  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise NativeBuildError(
                "cannot build the native helpers: ninja is not installed (pip install ninja)"
            ) from None
        os.environ["PATH"] = os.pathsep.join([str(ninja.BIN_DIR), *([saved_path] if saved_path else [])])
    workdir = Path(tempfile.mkdtemp(prefix="build-", dir=path.parent))
    try:
        from torch.utils import cpp_extension

        # torch remembers, per process, which sources it built under a name and skips a build it thinks it
        # has done; this build has its own folder, so make it forget.
        with contextlib.suppress(AttributeError):
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(path.stem, None)
        log.info("building the native helpers from %s into %s", _SOURCE, path)
        module: ModuleType = cpp_extension.load(
            name=path.stem,
            sources=[str(_SOURCE)],
            build_directory=str(workdir),
            extra_cflags=list(EXTRA_CFLAGS),
            verbose=False,
        )
        _check(module)
        # Not _storage/atomic.py's writer: native.py is in _storage's layer and may not import it (lint-imports),
        # and this cache folder is the user's, named by path (a killed build's temporary is removed under the lock).
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            shutil.copyfile(workdir / f"{path.stem}.so", staged)
            os.replace(staged, path)  # other processes see the whole file or none
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
            raise
        _state.imported[path] = module
        return module
    except NativeBuildError:
        raise
    except Exception as e:
        message = str(e)
        if len(message) > 6000:
            message = "...\n" + message[-6000:]
        raise NativeBuildError(f"building the native helpers from {_SOURCE} failed: {message}") from e
    finally:
        if saved_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved_path
        shutil.rmtree(workdir, ignore_errors=True)


def _import_extension(path: Path) -> ModuleType:
    module = _state.imported.get(path)
    if module is not None:
        return module
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _check(module)
    _state.imported[path] = module
    return module


_HELPERS = ("storage_from_buffer", "jit_load_from_buffer", "analyze_stream")


def _check(module: ModuleType) -> None:
    missing = [name for name in _HELPERS if not hasattr(module, name)]
    if missing:
        raise ImportError(f"{module.__file__} lacks {', '.join(missing)}")


if _state.mode == "native":
    _extension()  # forced: build or load now, and fail at import rather than in the middle of a load
