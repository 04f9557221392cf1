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
import logging
import mmap
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Union

from .._devices.device import MapLocation
from .._registry.registry import Registry
from .._storage import arena, atomic, format, progress, readahead, remote, sources, writes
from .._trust.entries import AllowSpec
from .._trust.restricted import scan_stream
from ..errors import ArgumentError, SnapshotError, ZeroCopyPickleError
from . import opening
from .dumping import Prepared, warn_if_trusted_only
from .opening import Prefetching

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
            prepared = Prepared(obj, backend, checksums, key, registry, for_file=True, offloaded=offloaded)
            warn_if_trusted_only(obj, prepared, registry)
            with atomic.atomic_output(path) as fd:
                prepared.write_file(fd, f"dump {url:.60}")

        remote.upload(url, write, storage_options)
        return
    if isinstance(f, str) and f.startswith("file://"):
        f = f.removeprefix("file://")
    start = time.perf_counter()
    if isinstance(f, (str, os.PathLike)):
        _check_folder(f)  # before pickling, and naming the user's path, not the temporary file's
        prepared = Prepared(obj, backend, checksums, key, registry, for_file=True, offloaded=offloaded)
        warn_if_trusted_only(obj, prepared, registry)
        with atomic.atomic_output(f, fsync=fsync) as fd:
            prepared.write_file(fd, f"dump {os.path.basename(os.fsdecode(f))}")
    elif hasattr(f, "write"):
        prepared = Prepared(obj, backend, checksums, key, registry, offloaded=offloaded)
        warn_if_trusted_only(obj, prepared, registry)
        with progress.bar(prepared.layout.total_nbytes, "dump") as report:
            writes.write_pieces_to_file(f, prepared.pieces, progress=report)  # type: ignore[arg-type]
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
    prepared = Prepared(obj, backend, checksums, key, registry, offloaded=offloaded)
    warn_if_trusted_only(obj, prepared, registry)
    return b"".join(prepared.pieces)


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
    prepared = Prepared(obj, backend, checksums, key, registry, offloaded=offloaded)
    fd = arena.create_memfd(name)
    try:
        with progress.bar(prepared.layout.total_nbytes, f"freeze {name}") as report:
            writes.write_pieces(fd, prepared.pieces, progress=report)
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
    mode = opening.prefetch_mode(prefetch)
    source = _name(f)
    if remote.is_url(f):
        # the verified download, opened by fd under its lock: what is mapped is what was checked
        with remote.open_fetched(str(f), storage_options) as fetched:
            opened = sources.open_source(fetched, sources.LOAD, what="load", copy=copy, keep_file=True)
    else:
        if isinstance(f, str) and f.startswith("file://"):
            f = source = f.removeprefix("file://")
        opened = sources.open_source(f, sources.LOAD, what="load", copy=copy, keep_file=True)
    return opening.load_opened(
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
    return opening.load_view(
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
        mode = opening.prefetch_mode(prefetch)
        opened = sources.open_source(fd, sources.FD, what="Snapshot.load", keep_file=True)
        if trusted is None and self._trusted:
            trusted = True
        return opening.load_opened(
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
