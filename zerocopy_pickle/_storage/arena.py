"""Internal: where snapshot bytes live once written: sealed memfds, and private mappings of files or memfds.

A memfd is sealed (:func:`seal`) before it is handed to anyone, so that nobody can shrink it under a mapping or
change the bytes a reader validated. Readers map a snapshot with :func:`map_private` (``MAP_PRIVATE``): pages are
shared with the page cache (and with every other process that maps the same file or memfd) until a page is
written, and a write to a loaded tensor stays private to that one load. The writers are in ``writes``, the
atomic files in ``atomic``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
from typing import BinaryIO

from . import writes

_libc = ctypes.CDLL(None, use_errno=True)

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def create_memfd(name: str) -> int:
    """Create an anonymous, sealable memory file (``memfd_create``) and return its fd (close-on-exec)."""
    return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def seal(fd: int) -> None:
    """Seal a memfd against any change of size or contents, and against further sealing changes.

    Sealing is what makes a memfd safe to hand to other processes: nobody can shrink it under their mappings
    (which would raise SIGBUS on access) or change the bytes they validated.
    """
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def is_sealed(fd: int) -> bool:
    """Whether ``fd`` is a memfd carrying every seal :func:`seal` adds."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return seals & SEALS == SEALS


IMMUTABLE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
"""The seals that freeze a memfd's size and bytes. Seals can only ever be added, so a memfd that carries these
stays unchanged for as long as anyone holds it (``F_SEAL_SEAL``, which :func:`seal` adds too, only stops more
seals from being added)."""


def is_immutable(fd: int) -> bool:
    """Whether nobody can change ``fd``'s size or bytes any more: a memfd carrying :data:`IMMUTABLE_SEALS`.

    A regular file never is: whoever can write to it can rewrite or truncate it under a mapping.
    """
    seals = seals_of(fd)
    return seals is not None and seals & IMMUTABLE_SEALS == IMMUTABLE_SEALS


def seals_of(fd: int) -> int | None:
    """The seals ``fd`` carries (``F_GET_SEALS``); None where it cannot carry any (a regular file, a pipe)."""
    try:
        return int(fcntl.fcntl(fd, fcntl.F_GET_SEALS))
    except OSError:
        return None


SEAL_NAMES = {
    fcntl.F_SEAL_SHRINK: "F_SEAL_SHRINK",
    fcntl.F_SEAL_GROW: "F_SEAL_GROW",
    fcntl.F_SEAL_WRITE: "F_SEAL_WRITE",
    fcntl.F_SEAL_SEAL: "F_SEAL_SEAL",
}


def copy_to_sealed_memfd(source: int, nbytes: int, name: str) -> int:
    """Copy the first ``nbytes`` of ``source`` into a new memfd, seal it (:func:`seal`) and return its fd.

    The copy is made with ``sendfile`` (in the kernel, no user-space buffer) where the kernel allows it, else
    with ``pread``/``write``. Reading never faults on pages the source has lost: a source that shrinks meanwhile
    just ends early.

    Raises:
        EOFError: ``source`` held fewer than ``nbytes`` bytes (the new memfd is closed).
        OSError: from the kernel (out of memory for the memfd, say).
    """
    fd = create_memfd(name)
    try:
        copied = 0
        use_sendfile = True
        while copied < nbytes:
            count = min(nbytes - copied, writes._MAX_WRITE)
            if use_sendfile:
                try:
                    n = os.sendfile(fd, source, copied, count)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    use_sendfile = False
                    continue
            else:
                chunk = os.pread(source, min(count, 4 << 20), copied)
                n = len(chunk)
                if n:
                    writes.write_pieces(fd, [chunk])
            if not n:
                raise EOFError(f"the source ended after {copied} of {nbytes} bytes")
            copied += n
        seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def buffer_address(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte; None for a read-only one (ctypes cannot point into it)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:
        return None


def map_private(fd: int, nbytes: int) -> mmap.mmap:
    """Map the first ``nbytes`` of ``fd`` copy-on-write (``MAP_PRIVATE``, readable and writable).

    Raises:
        OSError: the file cannot be mapped (for instance it is not a regular file or memfd).
    """
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


_MADV_POPULATE_READ = 22  # Linux 5.14
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
PREFAULT_CHUNK = 4 << 20


def prefault(memory: mmap.mmap) -> bool:
    """Map every page of a private mapping into this process's page tables, readable, without copying any
    (``MADV_POPULATE_READ``: writes still copy on write). Returns False where the kernel does not support it.

    The ctypes call releases the GIL; it works in chunks so that another thread faulting pages of the same
    mapping is never blocked behind one long call.
    """
    nbytes = len(memory)
    if not nbytes:
        return True
    anchor = ctypes.c_char.from_buffer(memory)  # holds a buffer export: the mapping stays while we work
    start = ctypes.addressof(anchor)
    for offset in range(0, nbytes, PREFAULT_CHUNK):
        if _madvise(start + offset, min(PREFAULT_CHUNK, nbytes - offset), _MADV_POPULATE_READ) != 0:
            return False
    return True


def anonymous(nbytes: int) -> mmap.mmap:
    """Private anonymous memory, page-aligned and zero-filled on first touch (for copying reads)."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def read_exact_into(f: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``f``; return how many bytes were read (fewer only at end of file).

    Raises:
        BlockingIOError: ``f`` is non-blocking and has nothing to deliver now.
    """
    got = 0
    readinto = getattr(f, "readinto", None)
    while got < view.nbytes:
        if readinto is not None:
            n = readinto(view[got:])
        else:
            chunk = f.read(view.nbytes - got)
            n = None if chunk is None else len(chunk)
            if n:
                view[got : got + n] = chunk
        if n is None:
            raise BlockingIOError(errno.EAGAIN, "the input stream is non-blocking and has no data now")
        if not n:
            break
        got += n
    return got


def regular_file_size(fd: int) -> int | None:
    """The size of ``fd`` if it is a regular file or memfd (mappable), else None."""
    st = os.fstat(fd)
    return st.st_size if stat.S_ISREG(st.st_mode) else None
