"""Internal: the public API's implementation (re-exported by ``zerocopy_pickle``): ``dump``/``load`` on paths
and files, ``dumps``/``loads`` on bytes, ``freeze`` and :class:`Snapshot` on memfds, and ``scan``.

Dump: the object graph goes through :class:`~zerocopy_pickle._core.pickler.ZeroCopyPickler`, whose buffer
callback only *collects* each storage's memory; then :func:`~zerocopy_pickle._storage.format.encode` lays the
snapshot out, and the pieces are written in one pass (``writev``): each tensor byte is copied once, straight
from the tensor into the file or memfd.

Load: :func:`~zerocopy_pickle._storage.sources.open_source` maps the snapshot ``MAP_PRIVATE`` once (or reads it into
private memory) and validates its header; each buffer is sliced from the mapping, and the C unpickler rebuilds
every storage as a view into it. Load time grows with the number of objects, not of bytes; pages are read when
a tensor first touches them.
"""

from __future__ import annotations

import errno
import functools
import importlib.util
import io
import logging
import mmap
import os
import pickle
import platform
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Union

import torch

from .._devices.device import MapLocation, is_cpu, static_target
from .._registry.preparation import check_offloaded, dump_reductions, refuse_offloaded_modules
from .._registry.registry import Registry, default_registry
from .._storage import arena, format, integrity, progress, readahead, remote, sources
from .._trust.restricted import AllowSpec, scan_stream
from .._version import __version__
from ..errors import ArgumentError, DumpError, SnapshotError, TrustedOnlyWarning, Unpicklable, ZeroCopyPickleError
from . import loadcore, locate
from .pickler import ZeroCopyPickler, dill_pickler

PathLike = Union[str, "os.PathLike[str]"]

log = logging.getLogger(__name__)


def _name(f: object) -> str:
    """How a log record names a dump's target or a load's source."""
    if isinstance(f, (str, os.PathLike)):
        return os.fsdecode(f)
    name = getattr(f, "name", None)
    return repr(name) if isinstance(name, (str, int)) else f"a {type(f).__name__}"


# ---------------------------------------------------------------------------------------------------------
# Dump
# ---------------------------------------------------------------------------------------------------------


BACKENDS = ("auto", "pickle", "cloudpickle", "dill")
_PICKLE_ERRORS = (
    pickle.PicklingError,
    TypeError,
    AttributeError,
    ValueError,
    BufferError,
    RuntimeError,
    RecursionError,
)
# RuntimeError: torch's C reducers refuse some objects that way; RecursionError: graphs nested too deeply.


def _refused_by_pickle(error: BaseException) -> bool:
    """Whether ``error`` is pickle (or a backend, or a builtin type's C reducer) refusing an object, rather than code of
    the object graph failing: a ``__reduce__``, ``__reduce_ex__``, ``__getstate__`` or a registered reducer that
    raised. Only the first becomes a :class:`DumpError`; the second reaches the caller as itself, as it does
    from ``pickle.dumps`` (``except ValueError`` keeps matching).

    Told apart by where it was raised: pickle's refusals (``PicklingError``, ``cannot pickle 'X' object``,
    ``Can't pickle local object``) are raised in C (the pickler, or a builtin type's ``__reduce_ex__``) or by
    pickle, copyreg, the backends or this library; an error whose traceback passes through any other module's code
    (the object's own ``__getstate__``, a registered reducer, the standard library's and torch's reducers alike)
    came from the graph's code, and pickle would let it propagate.
    """
    if isinstance(error, (pickle.PicklingError, RecursionError)):
        return True
    if not isinstance(error, _PICKLE_ERRORS):
        return False
    if isinstance(error, TypeError) and str(error).startswith("cannot pickle"):  # object.__reduce_ex__'s refusal
        return True
    tb = error.__traceback__
    while tb is not None:
        if not _is_machinery(tb.tb_frame.f_globals.get("__name__")):
            return False
        tb = tb.tb_next
    return True


_MACHINERY = frozenset({"pickle", "_pickle", "copyreg", "_compat_pickle", "cloudpickle", "dill", "zerocopy_pickle"})


def _is_machinery(module: object) -> bool:
    return isinstance(module, str) and module.partition(".")[0] in _MACHINERY


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _make_pickler(
    backend: str,
    file: IO[bytes],
    callback: Callable[[pickle.PickleBuffer], Any],
    registry: Registry | None = None,
    offloaded: str = "copy",
) -> Any:
    if backend == "dill":
        pickler: Any = dill_pickler(file, buffer_callback=callback, registry=registry)
    else:
        by_value = backend == "cloudpickle" or (backend == "auto" and _importable("cloudpickle"))
        pickler = ZeroCopyPickler(file, buffer_callback=callback, by_value=by_value, registry=registry)
    # accelerate's offloaded weights, copied in or refused (the table is the one the pickler read at __init__).
    pickler.dispatch_table.update(dump_reductions(offloaded))
    return pickler


class _Prepared:
    """A pickled object graph, laid out and ready to write: the pieces reference the storages' memory."""

    __slots__ = ("_encode", "_pending", "backend", "body", "by_value", "layout", "pieces", "views")

    def __init__(
        self,
        obj: object,
        backend: str,
        checksums: bool,
        key: bytes | str | None,
        registry: Registry | None = None,
        *,
        for_file: bool = False,
        offloaded: str = "copy",
    ) -> None:
        if backend not in BACKENDS:
            raise ArgumentError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")
        if check_offloaded(offloaded) == "refuse":
            refuse_offloaded_modules(obj)  # names the submodule (model.layers.3.mlp) before anything is pickled
        # auto: the C pickler (with cloudpickle's by-value reductions for functions and classes that need
        # them, object by object); if that fails, the whole graph again with dill.
        attempts = [backend] if backend != "auto" else ["auto", *(["dill"] if _importable("dill") else [])]
        first_error: BaseException | None = None
        for attempt in attempts:
            stream = io.BytesIO()
            views: list[memoryview] = []

            def collect(buffer: pickle.PickleBuffer, views: list[memoryview] = views) -> bool:
                views.append(buffer.raw())
                return False  # out of band

            pickler = _make_pickler(attempt, stream, collect, registry, offloaded)
            try:
                pickler.dump(obj)
            except Unpicklable as e:  # a reducer refused for good: no other backend is worth a try
                raise _dump_error(obj, attempt, e, registry, offloaded) from e
            except Exception as e:
                if not _refused_by_pickle(e):  # the graph's own code failed: the caller gets its exception
                    _note_path(obj, attempt, e, registry, offloaded)
                    raise
                first_error = first_error or e
                continue
            finally:
                pickler.clear_memo()  # release what the memo holds now, not whenever a cycle is collected
            self.backend = attempt
            self.by_value: tuple[list[object], int] | None = None if attempt == "dill" else pickler.pickled_by_value
            break
        else:
            assert first_error is not None
            raise _dump_error(obj, backend, first_error, registry, offloaded) from first_error
        body = stream.getbuffer()
        stream_sum = integrity.checksum(body) if checksums or key is not None else None
        signer = None if key is None else functools.partial(integrity.sign, key, stream=body)
        producer = {
            "zerocopy_pickle": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "backend": "dill" if attempt == "dill" else "pickle" + ("+cloudpickle" if pickler._by_value else ""),
        }

        def encode(buffer_sums: tuple[str, ...]) -> format.Layout:
            sums = None if stream_sum is None else format.Checksums(format.CHECKSUM_ALGORITHM, stream_sum, buffer_sums)
            specs, plugins = pickler.buffer_specs, pickler.plugins_used
            return format.encode(body.nbytes, specs, plugins=plugins, checksums=sums, sign=signer, producer=producer)

        self._encode, self.body, self.views = encode, body, views
        # for_file: the buffers' checksums are computed as they are written (write_file); until then, stand-ins.
        self._pending = pending = for_file and stream_sum is not None
        self.layout = encode((integrity.PENDING,) * len(views) if pending else tuple(map(integrity.checksum, views)))
        if for_file:
            self.pieces = []
            return
        layout = self.layout
        pieces: list[arena.Piece] = [layout.prefix, body]
        pieces += format.padded_pieces(
            views,
            [layout.data_offset + offset for offset in layout.buffer_offsets],
            cursor=layout.stream_offset + body.nbytes,
            end=layout.total_nbytes,
        )
        self.pieces = pieces

    def write_file(self, fd: int, desc: str) -> None:
        """Write the snapshot into an empty regular file (made with ``for_file=True``): its final size first,
        then the buffers, checksummed on the way (one pass over their memory), then the header that records
        those checksums, and the stream. Gaps are left to read as zeros. A progress bar (``desc``) counts every
        byte but the gaps', where :func:`progress.bar` shows one."""
        layout = self.layout
        arena.preallocate(fd, layout.total_nbytes)
        offsets = [layout.data_offset + offset for offset in layout.buffer_offsets]
        placed = list(zip(offsets, self.views, strict=True))
        nbytes = len(layout.prefix) + self.body.nbytes + sum(view.nbytes for view in self.views)
        with progress.bar(nbytes, desc) as report:
            if not self._pending:  # no checksums to record
                integrity.write_buffers(fd, placed, progress=report)
            else:
                layout = self._encode(integrity.write_checksummed(fd, placed, progress=report))
                if (layout.data_offset, layout.buffer_offsets) != (
                    self.layout.data_offset,
                    self.layout.buffer_offsets,
                ):
                    raise AssertionError("the header changed length once its checksums were filled in")
            arena.write_placed(fd, [(0, layout.prefix), (layout.stream_offset, self.body)], progress=report)


def _note_path(
    obj: object, backend: str, error: BaseException, registry: Registry | None, offloaded: str = "copy"
) -> None:
    """Add where in the graph ``error`` was raised to its notes (Python 3.11+), when it can be found."""
    add_note = getattr(error, "add_note", None)
    if add_note is None or isinstance(error, MemoryError):  # no second pass over the graph without memory
        return

    def try_dump(candidate: object) -> BaseException | None:
        try:
            _make_pickler(backend, io.BytesIO(), lambda buffer: False, registry, offloaded).dump(candidate)
        except Exception as e:
            return e
        return None

    try:
        failure = locate.locate_failure(obj, try_dump, reduce=_reducer_as_pickler(registry))
    except Exception:  # the search itself failed: the error stands without a path
        return
    if failure is not None:
        what = getattr(failure.obj, "__qualname__", None) or type(failure.obj).__qualname__
        add_note(f"(raised by zerocopy_pickle.dump while pickling {what} at {failure.path})")


def _reducer_as_pickler(registry: Registry | None) -> Callable[[Any], Any]:
    """A function that reduces an object as the pickler would: a reducer ``registry`` has first."""
    table = registry if registry is not None else default_registry()

    def reduce(candidate: Any) -> Any:
        reducer = table.lookup(type(candidate))
        reduced = reducer.reduce(candidate) if reducer is not None else NotImplemented
        return candidate.__reduce_ex__(5) if reduced is NotImplemented else reduced

    return reduce


def _dump_error(
    obj: object, backend: str, error: BaseException, registry: Registry | None = None, offloaded: str = "copy"
) -> DumpError:
    """A DumpError that names the object that cannot be pickled, its path in the graph, and what to do."""
    if isinstance(error, RecursionError):
        return DumpError(
            f"cannot pickle {type(obj).__name__}: the object graph is nested too deeply for pickle (deep recursion: "
            f"{error}); raise sys.setrecursionlimit or flatten the structure"
        )
    pickler_backend = backend

    def try_dump(candidate: object) -> BaseException | None:
        try:
            _make_pickler(pickler_backend, io.BytesIO(), lambda buffer: False, registry, offloaded).dump(candidate)
        except _PICKLE_ERRORS as e:
            return e
        return None

    failure = locate.locate_failure(obj, try_dump, reduce=_reducer_as_pickler(registry))
    if failure is None:  # pickles piecewise but not as a whole: report the whole
        return DumpError(f"cannot pickle {type(obj).__name__} (backend {backend!r}): {error}", path="obj")
    culprit = failure.obj
    what = getattr(culprit, "__qualname__", None) or type(culprit).__qualname__
    if isinstance(failure.error, Unpicklable):
        return DumpError(f"cannot pickle {what} at {failure.path}: {failure.error}", path=failure.path)
    if callable(culprit) and backend == "pickle":
        hint = "pass backend='auto' (or 'cloudpickle') to pickle functions and classes by value"
    elif backend == "auto":
        tried = "pickle and cloudpickle" + (", then dill" if _importable("dill") else " (dill is not installed)")
        hint = (
            f"no backend could pickle it ({tried}); drop it from the object, or register a reducer for "
            f"{type(culprit).__module__}:{type(culprit).__qualname__} with zerocopy_pickle.register_reducer"
        )
    else:
        hint = "try backend='auto', or register a reducer for its type with zerocopy_pickle.register_reducer"
    return DumpError(
        f"cannot pickle {what} at {failure.path} (backend {backend!r}): {failure.error}. {hint}",
        path=failure.path,
    )


def dump(
    obj: object,
    f: PathLike | IO[bytes],
    *,
    backend: str = "auto",
    checksums: bool = True,
    key: bytes | str | None = None,
    fsync: bool = False,
    registry: Registry | None = None,
    storage_options: Mapping[str, Any] | None = None,
    offloaded: str = "copy",
) -> None:
    """Write ``obj`` as a snapshot to a path, a URL or a binary file object.

    Every tensor storage goes into the snapshot's data region (aligned, out of band); the pickle stream holds
    only the object graph. Writing to a path is atomic: the snapshot is written to an unnamed temporary file
    in the same directory and renamed over ``f`` only when complete, so a failed or killed dump leaves any
    previous snapshot at ``f`` intact and no temporary file behind.

    Args:
        obj: any picklable object graph: a tensor, a state dict, an ``nn.Module``, nested containers.
        f: a path (``str`` or ``os.PathLike``), a URL fsspec can write (``s3://bucket/model.zcp``, ``memory://...``:
            written to a local temporary file, then uploaded whole), or a binary file object opened for writing.
        backend: ``"auto"`` (default): the C pickler, with functions and classes that cannot be imported by
            reference (lambdas, local and ``__main__`` definitions) pickled by value through cloudpickle, one
            object at a time; if that fails, the whole graph again with dill. ``"pickle"``: the C pickler
            alone. ``"cloudpickle"``: by value through cloudpickle (required). ``"dill"``: dill. Every
            backend keeps storages out of band and applies registered reducers; snapshots always load with
            the C unpickler. By-value functions and classes run code when loaded: only trusted loads accept
            them.
        checksums: record an XXH3-64 checksum of the stream and of every buffer (about 25 GB/s; a load checks
            the stream's always and the buffers' with ``verify=True``).
        key: sign the snapshot (HMAC-SHA256 over the header, the checksums included, and the stream) with this
            secret; ``load(..., key=key)`` then verifies it and may load trusted. Implies ``checksums``.
        fsync: with a path, flush the file and its directory entry to stable storage before returning.
        registry: the reducers (and plugins) to apply; default: the process's, ``default_registry()``.
        storage_options: for a URL, the fsspec filesystem's options (credentials, ``endpoint_url``...).
        offloaded: weights that accelerate offloaded to files (``disk_offload``, an ``offload_folder``, an
            ``OffloadedWeightsLoader`` behind an ``AlignDevicesHook``): ``"copy"`` (default) reads them into the
            snapshot, which then loads and runs without those files (the hooks stay, serving the weights from the
            snapshot); ``"refuse"`` fails the dump instead, naming the submodule and the files.

    On a terminal, a dump of 256 MiB or more shows a progress bar on stderr (docs/usage.md, "Progress bars":
    ``ZEROCOPY_PICKLE_PROGRESS=0`` turns it off); never when stderr is not a terminal.

    Raises:
        DumpError: part of the graph cannot be pickled; nothing was written. Its message and ``path`` name
            the object that fails and where it sits (``obj.encoder.layers[3]._forward_hooks[7]``).
        ArgumentError: an unknown backend, or one whose package is not installed; a malformed
            ``ZEROCOPY_PICKLE_PROGRESS`` or ``ZEROCOPY_PICKLE_PROGRESS_MIN``.
        OSError: writing failed (a full disk, say); a path keeps its previous contents. ``FileNotFoundError``
            (naming ``f``) before anything is pickled when the folder ``f`` goes into does not exist.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> zp.dump({"weight": torch.ones(2, 3), "step": 10}, "weights.zcp")
        >>> zp.load("weights.zcp")["weight"].shape
        torch.Size([2, 3])

        Signed, for loads that should trust it (``load(..., key=key)``):

        >>> zp.dump(torch.nn.Linear(4, 2), "signed.zcp", key=b"secret")
    """
    if remote.is_url(f):
        url = str(f)

        def write(path: Path) -> None:
            prepared = _Prepared(obj, backend, checksums, key, registry, for_file=True, offloaded=offloaded)
            _warn_if_trusted_only(obj, prepared, registry)
            with arena.atomic_output(path) as fd:
                prepared.write_file(fd, f"dump {url:.60}")

        remote.upload(url, write, storage_options)
        return
    if isinstance(f, str) and f.startswith("file://"):
        f = f.removeprefix("file://")
    start = time.perf_counter()
    if isinstance(f, (str, os.PathLike)):
        _check_folder(f)  # before pickling, and naming the user's path, not the temporary file's
        prepared = _Prepared(obj, backend, checksums, key, registry, for_file=True, offloaded=offloaded)
        _warn_if_trusted_only(obj, prepared, registry)
        with arena.atomic_output(f, fsync=fsync) as fd:
            prepared.write_file(fd, f"dump {os.path.basename(os.fsdecode(f))}")
    elif hasattr(f, "write"):
        prepared = _Prepared(obj, backend, checksums, key, registry, offloaded=offloaded)
        _warn_if_trusted_only(obj, prepared, registry)
        with progress.bar(prepared.layout.total_nbytes, "dump") as report:
            arena.write_pieces_to_file(f, prepared.pieces, progress=report)  # type: ignore[arg-type]
    else:
        raise ArgumentError(f"dump() needs a path or a binary file object, not {type(f).__name__}")
    log.info("dumped %s: %d bytes, %d buffers, %.3f s", _name(f), prepared.layout.total_nbytes, len(prepared.views),
             time.perf_counter() - start)  # fmt: skip


def _check_folder(f: PathLike) -> None:
    """Raise ``FileNotFoundError`` (``NotADirectoryError``) naming ``f`` when the folder it goes into does not
    exist (is not a folder)."""
    name = os.fsdecode(f)
    folder = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(folder):
        return
    if os.path.lexists(folder):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot dump to {name!r}: {folder!r} is not a folder", name)
    raise FileNotFoundError(errno.ENOENT, f"cannot dump to {name!r}: the folder {folder!r} does not exist", name)


def dumps(
    obj: object,
    *,
    backend: str = "auto",
    checksums: bool = True,
    key: bytes | str | None = None,
    registry: Registry | None = None,
    offloaded: str = "copy",
) -> bytes:
    """Return ``obj`` as a snapshot in one ``bytes`` object (the same bytes :func:`dump` writes).

    Args:
        obj, backend, checksums, key, registry, offloaded: as for :func:`dump`.

    Raises:
        DumpError: part of the graph cannot be pickled (see :func:`dump`).

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> data = zp.dumps([torch.arange(3), "text"])
        >>> zp.loads(data)
        [tensor([0, 1, 2]), 'text']
    """
    prepared = _Prepared(obj, backend, checksums, key, registry, offloaded=offloaded)
    _warn_if_trusted_only(obj, prepared, registry)
    return b"".join(prepared.pieces)


def _warn_if_trusted_only(obj: object, prepared: _Prepared, registry: Registry | None) -> None:
    """Warn (:class:`TrustedOnlyWarning`, once per dump) when only a trusted load can load what was just
    pickled, naming where each object pickled by value sits in the graph and what would make the snapshot
    restricted-loadable. :func:`freeze` does not warn: its snapshots load trusted."""
    if prepared.by_value is None:  # dill: what it pickled by value shows only in the stream
        if any(module.partition(".")[0] == "dill" for module, _ in scan_stream(prepared.body)):
            warnings.warn(
                "this snapshot was pickled with the dill backend, and its stream calls dill's own functions (code "
                "or objects pickled by value): only zerocopy_pickle.load(..., trusted=True) loads it; dump with the "
                "default backend to find out which objects need it",
                TrustedOnlyWarning,
                stacklevel=3,
            )
        return
    objects, count = prepared.by_value
    if not count:
        return
    from .._console import printable  # here, not at import: importing the library imports no console code

    paths = locate.paths_to(obj, objects, reduce=_reducer_as_pickler(registry))
    shown = "; ".join(
        f"{printable(paths.get(id(o), 'somewhere in the graph'))} = {_describe_by_value(o)}" for o in objects
    )
    more = f" (and {count - len(objects)} more)" if count > len(objects) else ""
    warnings.warn(
        f"this snapshot holds {count} function(s) or class(es) pickled by value: {shown}{more}. A restricted load "
        f"refuses them (loading them runs their code): only zerocopy_pickle.load(..., trusted=True) loads this "
        f"snapshot. To make it restricted-loadable, define them at module level (importable by name) or remove "
        f"them before dumping (hooks: the module's _forward_hooks / _forward_pre_hooks)",
        TrustedOnlyWarning,
        stacklevel=3,
    )


def _describe_by_value(obj: object) -> str:
    kind = "class" if isinstance(obj, type) else "function"
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
    from .._console import printable

    return f"{kind} {printable(name)[:120]}"


def freeze(
    obj: object,
    *,
    backend: str = "auto",
    checksums: bool = True,
    key: bytes | str | None = None,
    name: str = "zerocopy_pickle",
    registry: Registry | None = None,
    offloaded: str = "copy",
) -> Snapshot:
    """Write ``obj`` as a snapshot into a sealed memfd.

    The memfd lives in memory (shmem), outside any file system. Once written it is sealed: nobody, this
    process included, can change its size or bytes, so it can be handed to other processes (by fd over a
    Unix socket, or inherited) and loaded by all of them zero-copy, sharing the same physical pages.

    Args:
        obj: the object graph.
        backend, checksums, key, registry, offloaded: as for :func:`dump`.
        name: the memfd's name, shown in ``/proc/<pid>/fd`` and ``/proc/<pid>/maps``.

    Returns:
        A :class:`Snapshot` that owns the memfd. Its :meth:`Snapshot.load` defaults to ``trusted=True``:
        this process wrote the stream.

    Raises:
        DumpError: part of the graph cannot be pickled.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> snap = zp.freeze(torch.nn.Linear(4, 2))
        >>> a, b = snap.load(), snap.load()  # two independent modules over the same physical pages
        >>> torch.equal(a.weight, b.weight), a is b
        (True, False)
        >>> snap.close()  # a and b stay valid
    """
    start = time.perf_counter()
    prepared = _Prepared(obj, backend, checksums, key, registry, offloaded=offloaded)
    fd = arena.create_memfd(name)
    try:
        with progress.bar(prepared.layout.total_nbytes, f"freeze {name}") as report:
            arena.write_pieces(fd, prepared.pieces, progress=report)
        arena.seal(fd)
        log.debug("froze %d bytes, %d buffers into memfd %r, %.3f s", prepared.layout.total_nbytes,
                  len(prepared.views), name, time.perf_counter() - start)  # fmt: skip
        return Snapshot._adopt(fd, trusted=True)
    except BaseException:
        os.close(fd)
        raise


# ---------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------


def _load_view(
    view: memoryview,
    *,
    map_location: MapLocation,
    trusted: bool | None,
    allow: AllowSpec,
    verify: bool = False,
    key: bytes | str | None = None,
    stable: bool = False,
    registry: Registry | None = None,
    header: format.Header | None = None,
    source: str = "a buffer",
    level: int = logging.DEBUG,
    before_buffers: Callable[[], object] | None = None,
    file: tuple[int, int] | None = None,
) -> Any:
    """Unpickle the snapshot that fills ``view`` (writable, aligned); storages become views into it.

    Everything that can be checked is checked before the unpickler runs: the header, the signature (with a
    key), the stream's checksum, bounds and buffer count, the buffers' checksums (with ``verify``), that every
    device exists, that every plugin is loaded. ``trusted=None`` means trusted only if a key verified the
    signature.

    What is checked is what is used: the header and the stream are parsed, checked and unpickled from private
    copies (``bytes``). ``stable`` says that nobody can change the bytes behind ``view`` (private memory, a
    sealed memfd); otherwise ``verify`` copies every buffer into private memory as it checks it, and the
    storages are views into that copy. ``header``: the header already decoded from ``view`` (by
    :func:`~zerocopy_pickle._storage.sources.open_source`), else it is decoded here. ``source`` and ``level``: how the
    log record of the load names the snapshot, and at which level it is logged. ``before_buffers``: called once
    every check passed, just before the buffers are sliced (a prefetch starts there, so that a refused load reads
    nothing and the checks' own reads, such as plugins' imports, do not queue behind it). ``file``: ``(fd, offset)``
    of the file ``view`` maps (offset: of the snapshot's first byte), for a bulk transfer to a device that reads
    the file itself where its pages are not cached; it is not used when ``verify`` copied the buffers.
    """
    start = time.perf_counter()
    if header is None:
        header = sources.read_header(sources.at_view(view), view.nbytes)
    stream = bytes(view[header.stream_offset : header.stream_offset + header.stream_nbytes])
    if key is not None:
        integrity.verify_signature(header, stream, key)
    if trusted is None:
        trusted = key is not None
    integrity.verify_stream(header, stream)

    def checked_buffers() -> list[memoryview]:
        if before_buffers is not None:
            before_buffers()
        if verify and not stable:
            return integrity.copy_verified(header, view)  # later writes to the file cannot reach these
        buffers = [view[start:stop] for start, stop in map(header.buffer_range, range(len(header.buffers)))]
        if verify:
            integrity.verify_buffers(header, buffers)
        return buffers

    result = loadcore.load_stream(
        stream,
        checked_buffers,
        declared=len(header.buffers),
        trusted=trusted,
        plugins=header.plugins,
        allow=allow,
        map_location=map_location,
        locations=[entry.location for entry in header.buffers],
        tensor_buffers=[entry.dtype is not None for entry in header.buffers],
        where=f"the pickle stream (offset {header.stream_offset})",
        registry=registry,
        source_file=None if file is None or (verify and not stable) else _buffer_offsets(header, *file),
    )
    log.log(level, "loaded %s: %d bytes, %d buffers, %s%s, %.3f s", source, header.total_nbytes,
            len(header.buffers), "trusted" if trusted else "restricted", ", verified" if verify else "",
            time.perf_counter() - start)  # fmt: skip
    return result


def _buffer_offsets(header: format.Header, fd: int, offset: int) -> tuple[int, list[int]]:
    """``(fd, the absolute file offset of each buffer)``, as :func:`loadcore.load_stream`'s ``source_file``."""
    return fd, [offset + header.buffer_range(index)[0] for index in range(len(header.buffers))]


def load(
    f: PathLike | IO[bytes],
    *,
    map_location: MapLocation = None,
    trusted: bool | None = None,
    allow: AllowSpec = (),
    copy: bool = False,
    verify: bool = False,
    key: bytes | str | None = None,
    registry: Registry | None = None,
    storage_options: Mapping[str, Any] | None = None,
    prefetch: Prefetching = None,
) -> Any:
    """Load a snapshot from a path, a URL or a binary file object.

    The file is mapped ``MAP_PRIVATE`` and every storage is a view into that mapping: nothing is copied and
    pages are read when first touched. Writing to a loaded tensor copies only the touched page, privately:
    the file and every other load of it are unchanged. The mapping lives as long as any storage in it.
    Where the file's pages are not in the page cache yet, background threads read them in while the load and
    the caller go on (``prefetch``); the tensors stay views of the shared page cache either way.

    Args:
        f: a path, or a binary file object positioned at the start of a snapshot. A plain file object
            (``open(path, "rb")``, exactly ``io.BufferedReader``, ``io.BufferedRandom`` or ``io.FileIO``) over a
            regular file, at a page-aligned position, is mapped; anything else (a ``gzip``/``bz2``/``lzma``
            file, ``io.BytesIO``, a pipe, a socket, a wrapper or subclass, an unaligned position) is read
            through its ``read`` into private memory once.
        map_location: where storages go, as for ``torch.load`` (a device string, ``torch.device``, a dict
            from saved to new locations, or a callable ``f(storage, location)``). Storages placed on the CPU
            stay zero-copy.
        trusted: True unpickles without restrictions (only for snapshots you trust: pickle runs code); False
            restricts; None (default) restricts unless ``key`` verified the snapshot's signature.
        allow: globals this call may resolve beyond the built-in safe set: classes or functions, or
            ``"module:qualname"`` strings (for example ``allow=[MyModel, "collections:Counter"]``).
        copy: read the snapshot into private memory instead of mapping it (for file systems where mapping
            is unsafe or slow, or files another program may truncate in place). Memory grows with what the
            input delivers, never beyond it.
        verify: check every buffer against its recorded checksum before unpickling (reads every byte). The
            tensors then hold exactly the bytes that matched: a mapped file's buffers are copied into private
            memory and hashed from the copy, in one pass (the cost of a memory copy, and the data is no longer
            shared with the page cache), so rewriting the file afterwards changes nothing. With ``copy=True``
            or a sealed memfd there is nothing to protect against, and the check hashes in place.
        key: the secret the snapshot was signed with; its signature must verify, and then the load is
            trusted unless ``trusted=False``. The signature covers the header and the stream (checked and
            unpickled from private copies) and, through the checksums it signs, the buffers: add
            ``verify=True`` to check those too.
        registry: whose plugins the snapshot may need and whose safe globals a restricted load allows; default:
            the process's, ``default_registry()``.
        storage_options: for a URL, the fsspec filesystem's options (credentials, ``endpoint_url``...).
        prefetch: read the snapshot's data into the page cache ahead of the first touches, from a few background
            threads, each reading its part of the file sequentially (see :func:`prefetch`). None (default): yes,
            unless ``ZEROCOPY_PICKLE_PREFETCH=0``; it is skipped where it does not pay (data under 32 MiB, pages
            already cached, tmpfs, a load to a GPU, which reads the file itself). True: the same, whatever the
            environment says. ``"wait"``: the same, and return only once the data is in the page cache. False:
            no prefetch (pages are read as they are first touched). The running prefetches are in
            :func:`prefetches`; a load that fails cancels its own.

    Returns:
        The object graph.

    Raises:
        SnapshotError: the snapshot is malformed or truncated (nothing was built).
        IntegrityError: a checksum or the signature does not match (nothing was built).
        RestrictedLoadError: the stream names a global this call does not allow; the message lists every
            such global and the ``allow=`` that would accept them.
        DeviceError: a storage's target device does not exist here (nothing was built).
        FileNotFoundError: nothing at the URL.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> zp.dump({"step": 3, "weight": torch.zeros(4)}, "state.zcp")
        >>> state = zp.load("state.zcp")  # restricted (the default): tensors, containers, primitives
        >>> state["step"], state["weight"].shape
        (3, torch.Size([4]))
        >>> state = zp.load("state.zcp", verify=True)  # every buffer checked against its checksum too

        Onto a GPU, in one bulk transfer (``map_location`` as for ``torch.load``):

        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> zp.load("state.zcp", map_location=device)["weight"].device.type == device
        True
    """
    mode = _prefetch_mode(prefetch)
    source = _name(f)
    if remote.is_url(f):
        # the verified download, opened by fd under its lock: what is mapped is what was checked
        with remote.open_fetched(str(f), storage_options) as fetched:
            opened = sources.open_source(fetched, sources.LOAD, what="load", copy=copy, keep_file=True)
    else:
        if isinstance(f, str) and f.startswith("file://"):
            f = source = f.removeprefix("file://")
        opened = sources.open_source(f, sources.LOAD, what="load", copy=copy, keep_file=True)
    return _load_opened(
        opened,
        mode,
        map_location=map_location,
        trusted=trusted,
        allow=allow,
        verify=verify,
        key=key,
        registry=registry,
        source=source,
        level=logging.INFO,
    )


Prefetching = bool | str | None
"""``prefetch=`` of :func:`load` and :meth:`Snapshot.load`: None (the default), True, False or ``"wait"``."""


def _prefetch_mode(prefetch: Prefetching) -> str | None:
    """``"start"``, ``"wait"`` or None (no prefetch) for a ``prefetch=`` argument."""
    if prefetch is None:
        return {"off": None, "wait": "wait", "on": "start"}[readahead.switch()]
    if prefetch is True:
        return "start"
    if prefetch is False:
        return None
    if prefetch == "wait":
        return "wait"
    raise ArgumentError(f"prefetch must be None, True, False or 'wait', not {prefetch!r:.40}")


def _stays_on_cpu(map_location: MapLocation, header: format.Header) -> bool:
    """Whether a load's storages are built over the mapping (else a bulk transfer reads the file for the device,
    and reading it into the page cache as well would compete with it). A callable decides storage by storage on
    the CPU storages: ``static_target`` is None for it."""
    targets = {static_target(map_location, entry.location) for entry in header.buffers if entry.dtype is not None}
    return all(target is None or is_cpu(target) for target in targets)


def _load_opened(opened: sources.Opened, mode: str | None, *, map_location: MapLocation, source: str,
                 **kwargs: Any) -> Any:  # fmt: skip
    """:func:`_load_view` of an opened snapshot, with its prefetch (``mode``), closing its kept fd."""
    job = None

    def start_prefetch() -> None:
        nonlocal job
        if mode is not None and opened.file is not None and _stays_on_cpu(map_location, opened.header):
            fd, offset = opened.file
            start = offset + opened.header.data_offset
            job = readahead.start(fd, start, start + opened.header.data_nbytes, name=source)

    try:
        result = _load_view(
            opened.view,
            map_location=map_location,
            stable=opened.stable,
            header=opened.header,
            source=source,
            before_buffers=start_prefetch,
            file=opened.file,
            **kwargs,
        )
    except BaseException:
        if job is not None:
            job.cancel()  # a failed load leaves nothing running
        raise
    finally:
        if opened.file is not None:
            os.close(opened.file[0])
    if job is not None and mode == "wait":
        job.wait()
    return result


def prefetch(f: PathLike | int, *, wait: bool = False, streams: int | None = None) -> readahead.Prefetch | None:
    """Read a file (a snapshot, or any other: a checkpoint a library will read) into the page cache from a few
    background threads, each reading its part sequentially, and return at once.

    Later loads of the file map pages that are already there: a cold start reaches the disk's parallel read rate
    instead of the one read-ahead window a faulting thread keeps in flight, and nothing is copied into private
    memory. The reads are sequential per thread, so the page cache keeps the large folios that make every later
    mapped load fast (scattered reads would leave small pages, and many more page faults, behind). A load of a
    snapshot does this by itself (:func:`load`'s ``prefetch``); this is for files the program will need soon.

    Args:
        f: a path or the fd of a regular file (the fd may be closed once this returns).
        wait: block until the file is read.
        streams: threads reading at once (default 4, or ``ZEROCOPY_PICKLE_PREFETCH_STREAMS``).

    Returns:
        The running :class:`Prefetch` (``wait()``, ``cancel()``, ``read``, ``done``), or None where it does not
        pay: a file under 32 MiB, one whose pages are already cached, tmpfs.

    Raises:
        OSError: the file cannot be opened.

    Example::

        job = zp.prefetch("model.zcp")  # the disk works while the program starts up
        ...
        model = zp.load("model.zcp", trusted=True)
    """
    if isinstance(f, int):
        job = _prefetch_fd(f, f"fd {f}", streams)
    else:
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        try:
            job = _prefetch_fd(fd, os.fspath(f), streams)
        finally:
            os.close(fd)
    if job is not None and wait:
        job.wait()
    return job


def _prefetch_fd(fd: int, name: str, streams: int | None) -> readahead.Prefetch | None:
    if arena.regular_file_size(fd) is None:
        raise ArgumentError(f"prefetch() needs a regular file, not {name}")
    return readahead.start_file(fd, name=name, streams=streams)


def prefetches() -> list[readahead.Prefetch]:
    """The prefetches of this process still running: loads' own and :func:`prefetch`'s (to wait for or cancel)."""
    return readahead.running()


def loads(
    data: bytes | bytearray | memoryview | mmap.mmap,
    *,
    map_location: MapLocation = None,
    trusted: bool | None = None,
    allow: AllowSpec = (),
    copy: bool | None = None,
    verify: bool = False,
    key: bytes | str | None = None,
    registry: Registry | None = None,
) -> Any:
    """Load a snapshot from a bytes-like object or an ``mmap``.

    When it copies and when it is zero-copy:

    * ``data`` read-only (``bytes``, a read-only ``mmap`` or ``memoryview``): the snapshot is copied once
      into private memory and the tensors are views into that copy. No tensor ever aliases immutable memory.
    * ``data`` writable and 16-byte aligned (``bytearray``, a writable ``mmap``): zero-copy. The tensors are
      views into ``data`` and keep it alive; writing to a tensor writes into ``data``, and every load of the
      same buffer sees it. Pass ``copy=True`` for private tensors. With ``verify=True`` and without
      ``copy=True``, each buffer is copied into private memory as it is checked (``data`` could change after
      the check), so those tensors are not views into ``data``.

    Args:
        data: one complete snapshot, as :func:`dumps` returns it.
        map_location, trusted, allow, verify, key, registry: as for :func:`load`.
        copy: True always copies; False never does (and raises if ``data`` is read-only); None (default)
            copies only when zero-copy is impossible.

    Raises:
        SnapshotError, RestrictedLoadError, DeviceError: as for :func:`load`.
        ArgumentError: ``data`` is not a contiguous buffer, or ``copy=False`` with read-only data.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> zp.loads(zp.dumps({"bias": torch.zeros(2)}))
        {'bias': tensor([0., 0.])}
    """
    opened = sources.open_source(data, sources.LOADS, what="loads", copy=copy)
    return _load_view(
        opened.view,
        map_location=map_location,
        trusted=trusted,
        allow=allow,
        verify=verify,
        key=key,
        stable=opened.stable,
        registry=registry,
        header=opened.header,
    )


def read_header(f: PathLike | IO[bytes] | bytes | bytearray | memoryview) -> format.Header:
    """Validate a snapshot's header and return it, without unpickling anything.

    Args:
        f: a snapshot path, binary file object, or bytes-like object.

    Raises:
        SnapshotError: the snapshot is malformed.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> zp.dump({"w": torch.ones(2)}, "w.zcp", key=b"secret")
        >>> header = zp.read_header("w.zcp")
        >>> header.version, len(header.buffers), header.buffers[0].dtype, bool(header.signature)
        (2, 1, 'float32', True)
    """
    return sources.open_source(f, sources.INSPECT, what="read_header").header


def scan(f: PathLike | IO[bytes] | bytes | bytearray | memoryview) -> tuple[tuple[str, str], ...]:
    """List the globals a snapshot's stream references, without unpickling it.

    Args:
        f: a snapshot path, binary file object, or bytes-like object.

    Returns:
        ``(module, qualname)`` pairs in order of first appearance; ``format_global`` of each is the string
        ``allow=`` takes.

    Raises:
        SnapshotError: the snapshot is malformed.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> zp.dump(torch.nn.Linear(2, 2), "linear.zcp")
        >>> ("torch.nn.modules.linear", "Linear") in zp.scan("linear.zcp")
        True
    """
    view, _, header, _ = sources.open_source(f, sources.INSPECT, what="scan")
    return scan_stream(view[header.stream_offset : header.stream_offset + header.stream_nbytes])


def _unsealed_message(fd: int, own: int) -> str:
    seals = arena.seals_of(own)
    if seals is None:
        what = "a regular file, which cannot be sealed"
    else:
        missing = [name for bit, name in arena.SEAL_NAMES.items() if bit & arena.IMMUTABLE_SEALS & ~seals]
        what = f"a memfd without the seal(s) {', '.join(missing)}"
    return (
        f"fd {fd} is {what}: its sender can still shrink it under this process's mappings (SIGBUS) or change "
        f"its bytes after they were checked. Have the sender seal it (F_SEAL_SHRINK, F_SEAL_GROW and "
        f"F_SEAL_WRITE, as zerocopy_pickle.freeze does), pass copy=True to load a private sealed copy of it, "
        f"or trusted=True if you trust the sender"
    )


# ---------------------------------------------------------------------------------------------------------
# Snapshot: a snapshot behind a file descriptor
# ---------------------------------------------------------------------------------------------------------


class Snapshot:
    """A snapshot held by a file descriptor: a sealed memfd from :func:`freeze`, a file from
    :meth:`open`, or an fd received from another process (:meth:`from_fd`).

    Each :meth:`load` maps the fd ``MAP_PRIVATE`` and builds a new, independent object graph whose storages
    are views into that mapping; any number of loads, in any number of processes, share the physical pages.
    :meth:`close` releases the fd only: objects already loaded keep their mappings and stay valid.

    Use :func:`freeze`, :meth:`open` or :meth:`from_fd` to create one.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> with zp.freeze({"w": torch.ones(2)}) as snap:
        ...     snap.sealed, snap.load()["w"]
        (True, tensor([1., 1.]))

        Any number of processes can load the same memfd: send ``snap.fd`` (over a Unix socket, or inherited)
        and rebuild it there with ``zp.Snapshot.from_fd(fd)``.
    """

    __slots__ = ("_fd", "_trusted", "header", "nbytes")
    header: format.Header
    """The validated header."""
    nbytes: int
    """Size of the snapshot in bytes."""
    _fd: int
    _trusted: bool

    def __init__(self) -> None:
        raise TypeError("use zerocopy_pickle.freeze(), Snapshot.open() or Snapshot.from_fd()")

    @classmethod
    def _adopt(cls, fd: int, *, trusted: bool) -> Snapshot:
        """Take ownership of ``fd`` (closed on failure by the caller) after validating its header."""
        self = object.__new__(cls)
        size = arena.regular_file_size(fd)
        if size is None:
            raise SnapshotError("the fd is not a regular file or memfd: a snapshot must be mappable")
        self.header = sources.read_header(sources.at_fd(fd), size)
        self.nbytes = size
        self._fd = fd
        self._trusted = trusted
        return self

    @classmethod
    def open(cls, path: PathLike) -> Snapshot:
        """Open a snapshot file. Its loads default to restricted (``trusted=False``).

        Raises:
            SnapshotError: the file is not a valid snapshot.
            OSError: the file cannot be opened.
        """
        # O_NONBLOCK: a FIFO is refused as unmappable at once instead of blocking until a writer appears (it
        # changes nothing for regular files).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            return cls._adopt(fd, trusted=False)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_fd(cls, fd: int, *, trusted: bool = False, copy: bool = False) -> Snapshot:
        """Wrap a snapshot behind ``fd`` (a memfd or file received from elsewhere).

        The fd is duplicated: the caller keeps, and must close, its own.

        An fd from a sender you do not trust must be a memfd sealed against any change of size or contents
        (``F_SEAL_SHRINK``, ``F_SEAL_GROW`` and ``F_SEAL_WRITE``; :func:`freeze` adds them). Otherwise the sender
        could shrink it under this process's mappings, and the next access to a lost page would kill the
        process with SIGBUS, or rewrite bytes after a load checked them. An unsealed memfd or a regular file is
        refused, unless ``copy=True`` or ``trusted=True``.

        Args:
            fd: an open file descriptor of a snapshot.
            trusted: the default ``trusted`` of this snapshot's loads (say True only when you know who wrote
                it, for example an fd from your own model cache). It also trusts the sender not to shrink or
                rewrite the fd: it is then used as it is, sealed or not.
            copy: when the fd is not sealed, copy the snapshot into a new memfd of this process's own and seal
                that (one copy of the snapshot, in memory; a sealed fd is never copied). Later changes by the
                sender cannot reach the copy, and the snapshot's loads are zero-copy views of it.

        Raises:
            SnapshotError: the fd is not a regular file or memfd; it is not sealed, and neither ``copy`` nor
                ``trusted`` was given (the message says what is missing); the snapshot is malformed; or it
                shrank while it was copied.
        """
        own = os.dup(fd)
        try:
            if (trusted and not copy) or arena.is_immutable(own):
                return cls._adopt(own, trusted=trusted)
            if arena.regular_file_size(own) is None:
                raise SnapshotError("the fd is not a regular file or memfd: a snapshot must be mappable")
            if not copy:
                raise SnapshotError(_unsealed_message(fd, own))
            checked = cls._adopt(own, trusted=trusted)  # validates the header before anything is copied
        except BaseException:
            os.close(own)
            raise
        try:
            private = arena.copy_to_sealed_memfd(own, checked.nbytes, "zerocopy_pickle")
        except EOFError as e:
            raise SnapshotError(f"the snapshot behind fd {fd} shrank while it was copied: {e}") from None
        finally:
            checked.close()
        try:
            return cls._adopt(private, trusted=trusted)  # the copy's header is the one that counts
        except BaseException:
            os.close(private)
            raise

    @property
    def fd(self) -> int:
        """The file descriptor (owned by this object; duplicate it to keep it past :meth:`close`)."""
        if self._fd < 0:
            raise ZeroCopyPickleError("the snapshot is closed")
        return self._fd

    def fileno(self) -> int:
        """Same as :attr:`fd`, so a Snapshot can be passed where a file-like fd owner is expected."""
        return self.fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    @property
    def sealed(self) -> bool:
        """Whether the fd is a memfd sealed against any change (as :func:`freeze` makes them)."""
        return arena.is_sealed(self.fd)

    def load(
        self,
        *,
        map_location: MapLocation = None,
        trusted: bool | None = None,
        allow: AllowSpec = (),
        verify: bool = False,
        key: bytes | str | None = None,
        registry: Registry | None = None,
        prefetch: Prefetching = None,
    ) -> Any:
        """Load a new, independent copy-on-write object graph from this snapshot.

        Args:
            map_location, allow, key, registry, prefetch: as for :func:`load` (a memfd is memory already and is
                never prefetched; a snapshot file is, where its pages are not cached).
            verify: as for :func:`load`: a sealed memfd is checked in place (zero-copy); a file's buffers
                are copied into private memory as they are checked.
            trusted: None uses this snapshot's default (True for :func:`freeze`; else False unless ``key``
                verified the signature).

        Raises:
            SnapshotError: the file changed size since it was opened, or is malformed.
            RestrictedLoadError, DeviceError: as for :func:`load`.
        """
        fd = self.fd
        size = arena.regular_file_size(fd)
        if size != self.nbytes:
            raise SnapshotError(
                f"the snapshot file changed size since it was opened ({self.nbytes} -> {size} bytes); "
                f"somebody rewrote it in place - reopen it"
            )
        mode = _prefetch_mode(prefetch)
        opened = sources.open_source(fd, sources.FD, what="Snapshot.load", keep_file=True)
        if trusted is None and self._trusted:
            trusted = True
        return _load_opened(
            opened,
            mode,
            map_location=map_location,
            trusted=trusted,
            allow=allow,
            verify=verify,
            key=key,
            registry=registry,
            source=f"snapshot fd {fd}",
        )

    def close(self) -> None:
        """Close the fd. Objects already loaded stay valid (they hold their own mappings)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # At interpreter exit this may run after the module's globals were cleared (os is None by then): use only
        # what the function itself holds.
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1
            _close(fd)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"<Snapshot {state} nbytes={self.nbytes} buffers={len(self.header.buffers)}>"
