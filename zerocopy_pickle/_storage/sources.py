"""Internal: where a snapshot's bytes come from. :func:`open_source` turns any source a load or an inspection is
given (a path, a binary file object, a bytes-like object or ``mmap``, a file descriptor) into an :class:`Opened`
snapshot: a view of every byte of it, whether those bytes can still change, and its decoded header.
:func:`read_header` is the one reader of a header, given a way to read bytes at an offset (:func:`at_view`,
:func:`at_fd`); :func:`claimed_nbytes` is its first half, for a reader that must learn the snapshot's length from
its fixed header before it has the rest.

How each source is opened (``docs/design.md``, Load):

* a path: a regular file is mapped ``MAP_PRIVATE``; anything else (a FIFO, a character device), or any file with
  ``copy=True``, is read into private anonymous memory, and bytes after the snapshot are an error;
* a file object: mapped only when it is exactly ``io.BufferedReader``, ``io.BufferedRandom`` or ``io.FileIO`` over a
  regular file, at a position aligned to the allocation granularity; anything else is read through its ``read``
  into private memory that grows with what arrives, never beyond it;
* a bytes-like object (for a load): zero-copy when it is writable and 16-byte aligned, else copied once into
  private memory; for an inspection it is only looked at;
* a file descriptor: mapped ``MAP_PRIVATE`` at its current size.

``stable`` says that nobody can change the bytes behind the view any more (private memory, a sealed memfd): a
verified load then checks buffers in place instead of copying them.
"""

from __future__ import annotations

import io
import mmap
import os
import shlex
import stat
import zipfile
from collections.abc import Callable
from typing import BinaryIO, Literal, NamedTuple, Union

from ..errors import ArgumentError, SnapshotError
from . import arena, decoding, format

PathLike = Union[str, "os.PathLike[str]"]

ReadAt = Callable[[int, int], bytes | memoryview]
"""``read(offset, nbytes)``: up to ``nbytes`` of the snapshot's bytes from ``offset`` (fewer only at its end)."""


def at_view(view: bytes | memoryview) -> ReadAt:
    """Read from a view of the snapshot (slices: nothing is copied)."""
    return lambda offset, nbytes: view[offset : offset + nbytes]


def at_fd(fd: int, start: int = 0) -> ReadAt:
    """Read from ``fd`` with ``pread``, the snapshot beginning at ``start`` (the fd's position is not used)."""
    return lambda offset, nbytes: os.pread(fd, nbytes, start + offset)


def claimed_nbytes(read: ReadAt) -> int:
    """The snapshot's total length as its fixed header claims it, the fixed header validated (magic, version,
    flags, header length); nothing says yet that the bytes are there.

    Raises:
        SnapshotError: fewer than 32 bytes, or a malformed fixed header.
    """
    _, total, _ = decoding.decode_fixed(read(0, format.FIXED_NBYTES), None)
    return total


def read_header(read: ReadAt, nbytes: int | None) -> format.Header:
    """Read and validate a snapshot's header: the fixed header first (its header length is checked before that
    many bytes are read), then the JSON header; ``nbytes`` is the snapshot's real length when known.

    Raises:
        SnapshotError: the header is malformed, or disagrees with ``nbytes``.
    """
    fixed = read(0, format.FIXED_NBYTES)
    header_nbytes, _, _ = decoding.decode_fixed(fixed, nbytes)
    return decoding.decode_header(fixed, read(format.FIXED_NBYTES, header_nbytes), nbytes)


class Opened(NamedTuple):
    """An opened snapshot."""

    view: memoryview
    """Every byte of the snapshot, one-dimensional; it holds the memory (a mapping, private memory, the caller's
    buffer) alive."""
    stable: bool
    """Nobody can change the bytes behind :attr:`view` any more (private memory, a sealed memfd)."""
    header: format.Header
    """The header, decoded from :attr:`view`."""
    file: tuple[int, int] | None = None
    """With ``keep_file=True``, where a mapped view's bytes live: ``(fd, offset)``, an fd of the mapped file that
    the caller owns and must close, and the file offset of the snapshot's first byte. None for a snapshot read
    into private memory or given as a buffer."""


Kind = Literal["path", "file", "buffer", "bytes", "fd"]


class Accepts(NamedTuple):
    """The kinds of source a caller takes, in the order they are tried, and how its refusal names them."""

    kinds: tuple[Kind, ...]
    needs: str


LOAD = Accepts(("path", "file"), "a path or a binary file object")
LOADS = Accepts(("buffer",), "a bytes-like object or an mmap")
INSPECT = Accepts(("path", "bytes", "file"), "a path, a file object or bytes")
FD = Accepts(("fd",), "a file descriptor")


def open_source(
    source: object, accepts: Accepts, *, what: str, copy: bool | None = False, keep_file: bool = False
) -> Opened:
    """Open ``source`` as the kinds ``accepts`` names allow, and decode its header.

    Args:
        source: a path (``"path"``), a binary file object (``"file"``: anything with ``read``), any buffer
            (``"buffer"``: a load's bytes-like object or ``mmap``), exactly ``bytes``, ``bytearray``,
            ``memoryview`` or ``mmap`` (``"bytes"``: looked at as they are, never copied), an fd (``"fd"``).
        accepts: the kinds the caller takes (``LOAD``, ``LOADS``, ``INSPECT``, ``FD``).
        what: the public function's name, for error messages.
        copy: paths and files: True reads them into private memory instead of mapping them. Buffers: True always
            copies; False never does (and refuses read-only or unaligned data); None copies only when zero-copy
            is impossible.
        keep_file: for a mapped path, file object or fd, also return an fd of the file (:attr:`Opened.file`), for
            reading ahead of the load's touches or straight into device staging buffers.

    Raises:
        ArgumentError: ``source`` is none of the kinds, or a buffer it cannot use.
        SnapshotError: the snapshot is malformed or truncated.
    """
    for kind in accepts.kinds:
        file: tuple[int, int] | None = None
        if kind == "path" and isinstance(source, (str, os.PathLike)):
            try:
                memory, stable, file = _open_path(source, bool(copy), keep_file)
            except SnapshotError:  # read into memory (copy=True, not a regular file): its header was checked first
                found = _identified_path(source)
                if found is not None:
                    raise SnapshotError(found) from None
                raise
            view = memoryview(memory)
        elif kind == "file" and hasattr(source, "read"):
            at = _file_start(source)  # type: ignore[arg-type]
            try:
                memory, stable, file = _open_file(source, bool(copy), keep_file)  # type: ignore[arg-type]
            except SnapshotError:
                found = None if at is None else _identified_fd(*at, _source_name(source, kind))
                if found is not None:
                    raise SnapshotError(found) from None
                raise
            view = memoryview(memory)
        elif kind == "bytes" and isinstance(source, (bytes, bytearray, memoryview, mmap.mmap)):
            view, stable = memoryview(source).cast("B"), False
        elif kind == "buffer":
            view, stable = _open_buffer(source, copy, what, accepts.needs)
        elif kind == "fd" and isinstance(source, int):
            memory, stable = _open_fd(source)
            view = memoryview(memory)
            if keep_file:
                file = (os.dup(source), 0)
        else:
            continue
        try:
            if bytes(view[: len(format.MAGIC_PREFIX)]) != format.MAGIC_PREFIX:
                # A torch or safetensors file given to a load: say so, and what reads it.
                found = _identified(view, _source_name(source, kind))
                if found is not None:
                    raise SnapshotError(found)
            return Opened(view, stable, read_header(at_view(view), view.nbytes), file)
        except BaseException:
            if file is not None:
                os.close(file[0])
            raise
    raise ArgumentError(f"{what}() needs {accepts.needs}, not {type(source).__name__}")


# -- what a file that is not a snapshot is -------------------------------------------------------------------------

# pickle protocol 2, then torch.serialization's MAGIC_NUMBER (0x1950a86a20f9469cfc6c) as a LONG1 of 10 bytes:
# how every legacy (pre-1.6, or _use_new_zipfile_serialization=False) torch.save file begins.
_TORCH_LEGACY = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"
_ZIP = b"PK\x03\x04"
_MAX_NAMES = 1 << 16  # zip entries looked at to tell TorchScript from torch.save
_MAX_ZIP_READ = 16 << 20  # bytes of a zip's directory read to tell them apart (a hostile one may claim gigabytes)

Kind_ = Literal["snapshot", "safetensors", "torchscript", "torch.save", "torch.save (legacy)"]


class _ReaderAt(io.RawIOBase):
    """A seekable read-only file over a :data:`ReadAt` of ``nbytes`` bytes (for ``zipfile``, which reads only the
    central directory at the end: a few KiB, never the members); reading more than ``_MAX_ZIP_READ`` in all
    raises ``OSError``."""

    def __init__(self, read: ReadAt, nbytes: int) -> None:
        self._read, self._nbytes, self._pos, self._budget = read, nbytes, 0, _MAX_ZIP_READ

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        nbytes = min(len(b), max(0, self._nbytes - self._pos))
        self._budget -= nbytes
        if self._budget < 0:
            raise OSError("the zip directory is larger than a torch file's")
        data = self._read(self._pos, nbytes)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def sniff(read: ReadAt, nbytes: int) -> Kind_ | None:
    """What the ``nbytes`` bytes ``read`` reads are, from their first bytes (and a zip archive's list of names):
    a ``"snapshot"``, a ``"safetensors"`` file, a ``"torchscript"`` archive (``torch.jit.save``), a
    ``"torch.save"`` zip archive, a ``"torch.save (legacy)"`` file; None when none of those."""
    head = bytes(read(0, 16))
    if head.startswith(format.MAGIC_PREFIX):
        return "snapshot"
    if head.startswith(_TORCH_LEGACY):
        return "torch.save (legacy)"
    if head.startswith(_ZIP):
        try:
            with zipfile.ZipFile(_ReaderAt(read, nbytes)) as archive:
                infos = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            return None
        names = [info.filename for info in infos[:_MAX_NAMES]]
        # torch.jit.save writes <name>/constants.pkl and <name>/code/; torch.save writes neither.
        if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
            return "torchscript"
        return "torch.save" if any(n.endswith("/data.pkl") for n in names) else None
    if len(head) >= 9 and head[8:9] == b"{":
        header_nbytes = int.from_bytes(head[:8], "little")
        if 2 <= header_nbytes <= nbytes - 8:
            return "safetensors"
    return None


def not_a_snapshot(kind: Kind_, name: str | None) -> str | None:
    """One sentence for a load given a torch or safetensors file instead of a snapshot: what it is, how to read
    it, and the command that makes a snapshot of it (``name``: its path, or None for bytes in memory)."""
    shown = repr(name) if name is not None else "io.BytesIO(data)"
    first = f"{name!r} is" if name is not None else "these bytes are"
    written = "" if name is not None else " (written to a file first)"
    plain = name is not None and name.isprintable()
    path = shlex.quote(name) if plain and name is not None else "model.pt"
    out = shlex.quote(os.path.splitext(name)[0] + ".zcp") if plain and name is not None else "model.zcp"
    if kind in ("torch.save", "torch.save (legacy)"):
        what = "a zip archive" if kind == "torch.save" else "the legacy format"
        return (
            f"{first} a torch.save file ({what}), not a zerocopy_pickle snapshot: read it with "
            f"torch.load({shown}, weights_only=True), or make a snapshot of it{written} with "
            f"`zerocopy-pickle convert {path} {out}`"
        )
    if kind == "torchscript":
        return (
            f"{first} a TorchScript archive (torch.jit.save), not a zerocopy_pickle snapshot: read it with "
            f"torch.jit.load({shown}) (only from a source you trust: it runs the archive's code), or make a snapshot "
            f"of it{written} with `zerocopy-pickle convert {path} {out} --trusted`"
        )
    if kind == "safetensors":
        return (
            f"{first} a safetensors file, not a zerocopy_pickle snapshot: read it with "
            f"safetensors.torch.load_file({shown if name is not None else 'path'}), or make a snapshot of it"
            f"{written} with `zerocopy-pickle convert {path} {out}`"
        )
    return None


def _source_name(source: object, kind: Kind) -> str | None:
    """A path's name, or a file object's ``name`` when it is a path; None for bytes."""
    if kind == "path" and isinstance(source, (str, os.PathLike)):
        return os.fsdecode(source)
    name = getattr(source, "name", None) if kind == "file" else None
    return name if isinstance(name, str) else None


def _file_start(f: BinaryIO) -> tuple[int, int] | None:
    """``(fd, position)`` of a file object whose bytes are its fd's (:func:`_mappable_fd`), before it is read."""
    fd = _mappable_fd(f)
    try:
        return None if fd is None else (fd, f.tell())
    except (OSError, io.UnsupportedOperation):
        return None


def _identified_fd(fd: int, start: int, name: str | None) -> str | None:
    """:func:`_identified` for the regular file ``fd`` from ``start`` (None for anything else, or on a read error)."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        kind = sniff(at_fd(fd, start), max(st.st_size - start, 0))
    except OSError:
        return None
    return None if kind is None or kind == "snapshot" else not_a_snapshot(kind, name)


def _identified_path(path: PathLike) -> str | None:
    """:func:`_identified` for the regular file at ``path`` (None for anything else, or when it cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _identified_fd(fd, 0, os.fsdecode(path))
    finally:
        os.close(fd)


def _identified(view: memoryview, name: str | None) -> str | None:
    """When ``view`` (not a snapshot: its magic is not ours) holds a torch or safetensors file, what
    :func:`not_a_snapshot` says about it (``name``: its path, None for bytes); else None."""
    kind = sniff(at_view(view), view.nbytes)
    return None if kind is None or kind == "snapshot" else not_a_snapshot(kind, name)


def _open_buffer(data: object, copy: bool | None, what: str, needs: str) -> tuple[memoryview, bool]:
    """A load's view of a bytes-like object: the object itself when zero-copy is possible (writable, 16-byte
    aligned) and not refused, else a private copy (``stable``)."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError as e:
        raise ArgumentError(f"{what}() needs {needs}, not {type(data).__name__}") from e
    if not view.c_contiguous:
        raise ArgumentError(f"{what}() needs a contiguous buffer")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    zero_copy_possible = not view.readonly and view.nbytes > 0 and _is_aligned(view, 16)
    if copy is False and not zero_copy_possible:
        raise ArgumentError(
            f"{what}(copy=False) needs a writable, 16-byte-aligned buffer; "
            + ("data is read-only" if view.readonly else "data is not aligned")
            + " (pass copy=None to copy it)"
        )
    copied = bool(copy or not zero_copy_possible)
    if copied:
        if view.nbytes < format.FIXED_NBYTES:
            decoding.decode_fixed(view, view.nbytes)  # raises the truncation error
        memory = arena.anonymous(view.nbytes)
        memory[:] = view
        view = memoryview(memory)
    return view, copied


def _is_aligned(view: memoryview, alignment: int) -> bool:
    address = arena.buffer_address(view)
    return address is not None and address % alignment == 0


def _open_fd(fd: int) -> tuple[mmap.mmap, bool]:
    """``fd`` mapped at its current size, and whether it is immutable (a sealed memfd)."""
    size = arena.regular_file_size(fd)
    if size is None:
        raise SnapshotError("the fd is not a regular file or memfd: a snapshot must be mappable")
    return _map_fd(fd, size), arena.is_immutable(fd)


def _map_fd(fd: int, nbytes: int, offset: int = 0) -> mmap.mmap:
    if nbytes < format.FIXED_NBYTES:
        raise SnapshotError(
            f"truncated snapshot: {nbytes} bytes, but the fixed header alone is {format.FIXED_NBYTES} bytes"
        )
    if offset:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    return arena.map_private(fd, nbytes)


_FIRST_READ = 1 << 20
"""How much private memory a copying read reserves before the input has delivered anything beyond the header."""


def _read_copy(f: BinaryIO, available: int | None = None) -> mmap.mmap:
    """Read one snapshot from the current position of ``f`` into private anonymous memory.

    The fixed header's total length is only a claim: memory grows with what the input delivers (doubling from
    1 MiB, up to the claim), so a header that declares a terabyte and then ends costs what arrived, and is a
    truncation error. ``available``, when known (a regular file's size past the position), is checked against
    the claim before anything is reserved.
    """
    try:
        return _read_growing(f, available)
    except BlockingIOError as e:
        raise SnapshotError(f"{e.strerror}: pass a blocking file object (or read the snapshot first)") from None


def _read_growing(f: BinaryIO, available: int | None) -> mmap.mmap:
    head = bytearray(format.FIXED_NBYTES)
    got = arena.read_exact_into(f, memoryview(head))  # a pipe may deliver the 32 bytes in pieces
    total = claimed_nbytes(at_view(bytes(head[:got])))
    if available is not None and total > available:
        raise SnapshotError(f"truncated snapshot: the header says {total} bytes, the file holds {available}")
    capacity = min(total, _FIRST_READ)  # even a file's size is only what it claims to hold (it may be sparse)
    memory = arena.anonymous(capacity)
    memory[:got] = head
    while True:
        view = memoryview(memory)
        try:
            n = arena.read_exact_into(f, view[got:capacity])
        finally:
            view.release()  # no export may outlive this pass: resize needs none
        got += n
        if got < capacity or capacity == total:
            break
        capacity = min(total, 2 * capacity)
        memory.resize(capacity)  # mremap: the pages move, nothing is copied
    if got != total:
        memory.close()
        raise SnapshotError(f"truncated snapshot: the header says {total} bytes, the input ended after {got}")
    return memory


def _open_path(path: PathLike, copy: bool, keep: bool = False) -> tuple[mmap.mmap, bool, tuple[int, int] | None]:
    """The snapshot at ``path``, mapped or read, and whether its bytes can no longer change (read into private
    memory, or a sealed memfd) rather than a mapping of a file someone could rewrite; with ``keep``, the fd of a
    mapped file (the caller's to close) and offset 0."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    kept = False
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise SnapshotError(f"{os.fspath(path)!r} is a directory, not a snapshot")
        size = st.st_size if stat.S_ISREG(st.st_mode) else None
        if size is None or copy:
            with os.fdopen(os.dup(fd), "rb", buffering=0) as raw:
                memory = _read_copy(raw, size)
                if raw.read(1):
                    raise SnapshotError(f"trailing bytes after the {len(memory)}-byte snapshot in {path!r}")
                return memory, True, None
        memory = _map_fd(fd, size)
        kept = keep
        return memory, arena.is_immutable(fd), (fd, 0) if keep else None
    finally:
        if not kept:
            os.close(fd)


_MAPPABLE_BUFFERED = (io.BufferedReader, io.BufferedRandom)


def _mappable_fd(f: BinaryIO) -> int | None:
    """The fd behind ``f`` when the bytes ``f`` returns are exactly that fd's bytes from ``f.tell()`` on: a plain
    ``open(path, "rb")`` (or ``"r+b"``, or unbuffered) file object, of exactly the standard classes. Anything
    else (``gzip``/``bz2``/``lzma`` files, whose ``fileno()`` is the compressed file's; ``BytesIO``; wrappers and
    subclasses that may transform what they read) is read through its ``read``, never mapped."""
    cls = type(f)
    if cls in _MAPPABLE_BUFFERED:
        if type(getattr(f, "raw", None)) is not io.FileIO:
            return None
    elif cls is not io.FileIO:
        return None
    try:
        return f.fileno()
    except (OSError, ValueError):
        return None


def _open_file(f: BinaryIO, copy: bool, keep: bool = False) -> tuple[mmap.mmap, bool, tuple[int, int] | None]:
    """Map a snapshot at the current position of an open file, or read it when that is not possible; whether
    its bytes can no longer change, and with ``keep`` where a mapped one lives (as for :func:`_open_path`)."""
    fd = _mappable_fd(f)
    try:
        size = None if fd is None else arena.regular_file_size(fd)
        start = f.tell() if size is not None else 0
    except (OSError, io.UnsupportedOperation):
        size = None
    if size is None or fd is None:
        return _read_copy(f, None), True, None
    if copy or start % mmap.ALLOCATIONGRANULARITY:
        return _read_copy(f, max(size - start, 0)), True, None
    total = claimed_nbytes(at_fd(fd, start))
    if start + total > size:
        raise SnapshotError(
            f"truncated snapshot: the header says {total} bytes from offset {start}, the file has {size - start}"
        )
    memory = _map_fd(fd, total, start)
    f.seek(start + total)
    return memory, arena.is_immutable(fd), (os.dup(fd), start) if keep else None
