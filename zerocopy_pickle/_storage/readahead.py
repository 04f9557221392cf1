"""Internal: reading a snapshot's pages into the page cache ahead of a load's first touches.

A load maps its snapshot and returns at once; the pages are read when something first touches them. From a cold
page cache one faulting thread keeps about one read-ahead window of the file in flight (``read_ahead_kb``, 128 KiB
to 8 MiB), which on a virtio or NVMe disk reaches 0.5-0.8 of what the device delivers to several readers at
once. A :class:`Prefetch` brings the pages in from a few threads while the load and the caller go on, and the
result stays what it was: views of the shared, evictable page cache, no private copy, no extra memory.

How the pages are read decides how every later load of the file touches them, so each choice here is deliberate
(docs/benchmark.md, "Cold loads", has the measurements):

* **Each stream is read sequentially, through its own open file description.** The kernel's read-ahead state
  lives in the file description; sequential reads through one let the page cache build *large folios* (ext4,
  XFS, btrfs on Linux 6.x), and a later mapped load maps each folio with one fault. Scattered reads (out of
  order, or several threads sharing one description) fill the cache with 4 KiB pages, and every later load of
  the file then pays many times the page faults (on the development VM, Linux 6.18, ext4: touching 128 MiB took
  2,048 faults after scattered reads, 468 after one sequential read, about 530 after ``readahead(2)``,
  ``fadvise(WILLNEED)`` or ``MADV_WILLNEED``, which bring pages in no faster than one faulting thread).
* **``pread`` into one reused 1 MiB buffer per stream**, which reads through the page cache like any ``read``
  and also *touches* every page on the way (the copy). That touch is the point on a virtual machine: the first
  access by a guest CPU to memory the virtual disk has just filled is slow (the hypervisor maps the page in for
  the guest), and it costs whoever touches first. ``pread`` pays it in the prefetch's threads, on the core the
  load leaves idle; ``sendfile`` to ``/dev/null`` (no copy) left it to the load's own touches. Measured on the
  development VM (3.4 GB, 291 tensors, page cache dropped, load then one byte per page): touch after a ``pread``
  prefetch 0.04-0.11 s of user time against 0.5-1.3 s after a ``sendfile`` one; totals 1.7-2.1 s against
  2.4-2.9 s (and 4.4-5.2 s without a prefetch). The request size matters for the folios, not for the rate (the
  kernel keeps its read-ahead window in flight either way): touching the file later took 2,544 faults after
  128 KiB reads, 3,114 after 1 MiB and about 4,000 after 8 MiB ones, and ``fadvise(SEQUENTIAL)`` made them
  smaller still; 1 MiB had the best totals (1.70-1.72 s against 1.95-3.13 s for 128 KiB).
* **A few streams over contiguous parts of the range, front first**: part 0 is what the load touches first. At
  most :data:`STREAMS` streams per prefetch and :data:`MAX_IN_FLIGHT` reads at a time in the process, so
  concurrent loads share the disk instead of multiplying the threads.
* **Skipped where it does not pay**: a range under :data:`MIN_NBYTES`, pages already in the page cache
  (``cachestat(2)``, Linux 6.5, or ``mincore`` samples), files on tmpfs or memfds (their pages are memory already),
  and more than half of the memory available (read-ahead would evict its own pages before the load reads them:
  only the front part that fits is read). Within a prefetch nothing is checked piece by piece: reading cached
  pages again costs a memory copy, and skipping parts would stall the kernel's read-ahead pipeline, which
  advances with the reads.

A prefetch is only a hint: it never raises into the load that started it (an I/O error ends it and is kept in
:attr:`Prefetch.error`; the load's own touch then reports the failure as reading a mapping does), it can be
cancelled at any time, its threads are daemons that stop between two reads, and a fork child sees every prefetch
of its parent as cancelled.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import itertools
import logging
import mmap
import os
import stat
import threading
import time
import weakref
from collections.abc import Sequence

log = logging.getLogger(__name__)

MIN_NBYTES = 32 << 20
"""A range smaller than this is not prefetched: one faulting thread reads it nearly as fast, and threads cost more
than they save."""

STREAMS = 4
"""Sequential streams (threads) per prefetch; ``ZEROCOPY_PICKLE_PREFETCH_STREAMS`` overrides it."""

STREAM_MIN_NBYTES = 64 << 20
"""A stream reads at least this much: a smaller range is cut into fewer streams."""

READ_NBYTES = 1 << 20
"""Bytes per ``pread`` call (each stream's buffer): the kernel's read-ahead keeps its own window in flight
(``read_ahead_kb``) whatever the request size, and smaller requests leave larger folios behind (see above)."""

MAX_IN_FLIGHT = 8
"""Chunk reads in flight in the whole process, across every prefetch."""

_MEMORY_SHARE = 0.5  # at most this share of MemAvailable is read ahead by one prefetch


class _Process:
    """What every prefetch of this process shares (made anew in a fork child)."""

    def __init__(self) -> None:
        self.in_flight = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self.running: weakref.WeakSet[Prefetch] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.cachestat_works = True


_process = _Process()


class Prefetch:
    """A read of a file's pages into the page cache, running in background threads (or finished).

    Returned by :func:`zerocopy_pickle.prefetch`; a load's own prefetch is in :func:`zerocopy_pickle.prefetches`
    while it runs. Every attribute may be read from any thread.

    Attributes:
        name: what is being read (a path, or ``fd N``).
        nbytes: the bytes the prefetch covers.
        read: bytes passed through the page cache so far (read from the disk where they were not cached).
        cached: bytes of the range that were in the page cache already when it started (None: unknown).
        error: the ``OSError`` that ended the prefetch early, if any (the load's own reads then hit the same
            failure, as reading a mapping does).
    """

    def __init__(self, name: str, nbytes: int, streams: int, cached: int | None = None) -> None:
        self.name = name
        self.nbytes = nbytes
        self.streams = streams
        self.read = 0
        self.cached = cached
        self.error: OSError | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._pending = streams

    @property
    def done(self) -> bool:
        """Whether every stream has stopped (finished, failed or cancelled)."""
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def seconds(self) -> float:
        """Seconds from the start to the end (or to now, while it runs)."""
        end = self.finished if self.finished is not None else time.perf_counter()
        return end - self.started

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the prefetch has stopped (or ``timeout`` seconds passed); True if it has."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop reading: every stream ends after the read it is in (at most :data:`READ_NBYTES` bytes). Pages
        already read stay in the page cache."""
        self._cancelled.set()

    def _add(self, read: int) -> None:
        with self._lock:
            self.read += read

    def _stream_ended(self, error: OSError | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self.finished = time.perf_counter()
        self._done.set()
        with _process.lock:
            _process.running.discard(self)
        log.debug("prefetch of %s %s: %d bytes read (%s cached before), %.3f s%s", self.name,
                  "cancelled" if self.cancelled else "done", self.read, self.cached, self.seconds,
                  f", stopped by {self.error}" if self.error else "")  # fmt: skip

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled else "done" if self.done else "running"
        return (
            f"<Prefetch {self.name} {state}: {self.read} of {self.nbytes} bytes read, {self.cached} cached before,"
            f" {self.streams} stream(s), {self.seconds:.3f} s>"
        )


SWITCH_ENV = "ZEROCOPY_PICKLE_PREFETCH"
"""``0``/``off``/``false``/``no``: loads and cache hits read nothing ahead; ``wait``: loads wait for their
prefetch; anything else (or unset): prefetch where it pays."""


def switch() -> str:
    """:data:`SWITCH_ENV` as ``"off"``, ``"wait"`` or ``"on"``."""
    value = os.environ.get(SWITCH_ENV, "").strip().lower()
    return "off" if value in ("0", "off", "false", "no") else "wait" if value == "wait" else "on"


def start_file(fd: int, *, name: str, streams: int | None = None) -> Prefetch | None:
    """:func:`start` over the whole of the file ``fd`` (its size now)."""
    return start(fd, 0, os.fstat(fd).st_size, name=name, streams=streams)


def running() -> list[Prefetch]:
    """The prefetches of this process that are still reading."""
    with _process.lock:
        return [p for p in _process.running if not p.done]


def cancel_all() -> None:
    """Cancel every running prefetch (at exit, and for tests)."""
    for p in running():
        p.cancel()


def start(
    fd: int,
    start_offset: int,
    stop_offset: int,
    *,
    name: str,
    streams: int | None = None,
    min_nbytes: int = MIN_NBYTES,
) -> Prefetch | None:
    """Start reading bytes ``[start_offset, stop_offset)`` of the regular file ``fd`` into the page cache; None
    where it would not pay (see the module's docstring). ``fd`` may be closed as soon as this returns: every
    stream has its own open file description of the same file.

    ``streams``: sequential readers (default :data:`STREAMS` or ``ZEROCOPY_PICKLE_PREFETCH_STREAMS``);
    ``min_nbytes``: skip a range smaller than this.
    """
    nbytes = stop_offset - start_offset
    if nbytes < max(min_nbytes, 1) or not _regular(fd) or _on_memory_file_system(fd):
        return None
    stop_offset = start_offset + min(nbytes, _memory_budget())
    nbytes = stop_offset - start_offset
    if nbytes < max(min_nbytes, 1):
        return None
    cached = cached_bytes(fd, start_offset, stop_offset)
    if cached is not None and nbytes - cached < max(min_nbytes, 1):
        return None
    count = max(1, min(streams if streams is not None else _streams(), nbytes // STREAM_MIN_NBYTES))
    parts = _split(start_offset, stop_offset, count)
    fds: list[int] = []
    try:
        for _ in parts:
            fds.append(_reopen(fd))
    except OSError as e:
        for opened in fds:
            os.close(opened)
        log.debug("no prefetch of %s: %s", name, e)
        return None
    job = Prefetch(name, nbytes, len(parts), cached)
    with _process.lock:
        _process.running.add(job)
    for number, (part, own) in enumerate(zip(parts, fds, strict=True)):
        thread = threading.Thread(
            target=_read_stream, args=(job, own, part), name=f"zerocopy_pickle-prefetch-{number}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as e:  # cannot start a thread (at interpreter exit, or a thread limit)
            os.close(own)
            job._stream_ended(OSError(errno.EAGAIN, str(e)))
    log.debug("prefetch of %s: %d bytes in %d stream(s)", name, nbytes, len(parts))
    return job


def _regular(fd: int) -> bool:
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False


def _streams() -> int:
    value = os.environ.get("ZEROCOPY_PICKLE_PREFETCH_STREAMS", "")
    try:
        return max(1, min(64, int(value))) if value else STREAMS
    except ValueError:
        return STREAMS


def _split(start: int, stop: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous parts of ``[start, stop)``, cut at 2 MiB boundaries of the file (folio-sized)."""
    align = 2 << 20
    step = -(-(stop - start) // count)
    cuts = [start] + [min(stop, (start + i * step) // align * align) for i in range(1, count)] + [stop]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _reopen(fd: int) -> int:
    """A new open file description of the file behind ``fd`` (its own read-ahead state); a duplicate where
    ``/proc`` is not mounted."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM):
            raise
        return os.dup(fd)


def _read_stream(job: Prefetch, fd: int, part: tuple[int, int]) -> None:
    error: OSError | None = None
    try:
        scratch = memoryview(bytearray(READ_NBYTES))
        at, stop = part
        while at < stop and not job._cancelled.is_set():
            with _process.in_flight:
                got = os.preadv(fd, [scratch[: min(READ_NBYTES, stop - at)]], at)
            if got <= 0:
                break  # the file is shorter than it was: nothing more to read
            job._add(got)
            at += got
    except OSError as e:
        error = e
    finally:
        os.close(fd)
        job._stream_ended(error)


# --- what is in the page cache ----------------------------------------------------------------------------------

_CACHESTAT = 451  # the same number on x86_64, arm64 and the generic table (Linux 6.5)
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cached_bytes(fd: int, start: int, stop: int) -> int | None:
    """About how many bytes of ``[start, stop)`` of ``fd`` are in the page cache: exact with ``cachestat(2)``,
    estimated from 64 ``mincore`` samples on older kernels; None where neither can tell."""
    if stop <= start:
        return 0
    if _process.cachestat_works:
        first = start - start % _PAGE
        span = _Range(first, stop - first)
        result = _Stat()
        if _libc.syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(result), 0) == 0:
            return min(stop - start, int(result.cache) * _PAGE)
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _process.cachestat_works = False  # an older kernel, or a seccomp filter that forbids it
        else:
            return None
    return _sampled(fd, start, stop)


def _sampled(fd: int, start: int, stop: int, samples: int = 64) -> int | None:
    first = start - start % mmap.ALLOCATIONGRANULARITY
    length = stop - first
    address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = -(-(stop - start) // _PAGE)
        step = max(1, pages // samples)
        vector = ctypes.c_ubyte()
        hits = count = 0
        base = (start - first) // _PAGE * _PAGE
        for page in range(0, pages, step):
            if _libc.mincore(address + base + page * _PAGE, _PAGE, ctypes.byref(vector)) != 0:
                return None
            hits += vector.value & 1
            count += 1
        return (stop - start) * hits // count
    finally:
        _libc.munmap(address, length)


_TMPFS_MAGIC = 0x01021994
_RAMFS_MAGIC = 0x858458F6


def _on_memory_file_system(fd: int) -> bool:
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if _libc.fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in (_TMPFS_MAGIC, _RAMFS_MAGIC)


def _memory_budget() -> int:
    """The most one prefetch reads ahead: a share of ``MemAvailable``, so that it cannot evict its own pages."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * _MEMORY_SHARE)
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def ranges_cached(fd: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether all of ``ranges`` of ``fd`` are (nearly: 99 %) in the page cache."""
    total = cached = 0
    for a, b in ranges:
        got = cached_bytes(fd, a, b)
        if got is None:
            return False
        total += b - a
        cached += got
    return cached >= total * 0.99


atexit.register(cancel_all)


def _after_fork_in_child() -> None:
    # The parent's threads do not exist in the child, so its prefetches can never finish there; and a lock a
    # parent's thread held at the fork would stay held forever.
    parent = list(_process.running)
    _process.__init__()  # type: ignore[misc]
    for p in parent:
        p._lock = threading.Lock()
        p._cancelled.set()
        p.finished = time.perf_counter()
        p._done.set()


os.register_at_fork(after_in_child=_after_fork_in_child)
