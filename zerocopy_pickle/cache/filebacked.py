"""Internal: finding the storages a loader left as untouched views of a file, so that the cache can reference the file
instead of copying its bytes.

safetensors (and so ``from_pretrained`` of diffusers and transformers) maps a checkpoint ``MAP_PRIVATE`` and
hands out tensors that are views of the mapping. Copying those bytes into a memfd would cost the first load of
an SD1.5 pipeline more than a second; referencing the file costs nothing, and every process then shares the
checkpoint's page cache pages, as plain safetensors loads do. A view qualifies when:

* it lies entirely inside one mapping of a regular file (``/proc/self/maps``), still on disk under the path
  the mapping names, with the same device and inode;
* none of its pages was written since it was mapped: ``/proc/self/pagemap`` marks a page that copy-on-write
  replaced as anonymous (bit 61 clear while present, or swapped). Pages not yet faulted in are the file's.

Anything else (a storage the loader computed, converted or wrote) is copied into a memfd as before.
"""

from __future__ import annotations

import bisect
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from .._storage import arena
from .._storage.fileid import FileIdentity

PAGE = mmap.PAGESIZE
_PRESENT = 1 << 63
_SWAPPED = 1 << 62
_FILE_OR_SHARED = 1 << 61


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    dev: int
    inode: int
    path: str

    @property
    def file(self) -> tuple[int, int]:
        """``(device, inode)`` of the mapped file, as :attr:`FileIdentity.file` gives a stat result's."""
        return (self.dev, self.inode)


@dataclass(frozen=True)
class FileRange:
    """Where a view's bytes are in a file: ``file`` indexes the list of files :func:`file_ranges` returns."""

    file: int
    offset: int


def read_maps(text: str | None = None, addresses: Sequence[int] | None = None) -> list[Mapping]:
    """The file mappings of this process (``/proc/self/maps``), sorted by address; with ``addresses`` (sorted),
    only those holding one of them.

    The filter is what keeps this cheap: a process that imported torch and transformers has hundreds of mappings
    (its libraries), and splitting each line cost a capture 2-8 ms; the filter reads only each line's address
    range."""
    if text is None:
        with open("/proc/self/maps") as f:
            text = f.read()
    mappings = []
    for line in text.splitlines():
        if not line:
            continue
        span, _, rest = line.partition(" ")
        first, _, last = span.partition("-")
        start, end = int(first, 16), int(last, 16)
        if addresses is not None:
            i = bisect.bisect_left(addresses, start)
            if i == len(addresses) or addresses[i] >= end:
                continue
        parts = rest.split(maxsplit=4)
        if len(parts) < 5 or not parts[4].startswith("/") or parts[4].endswith(" (deleted)"):
            continue
        _perms, offset, device, inode, path = parts
        major, minor = (int(d, 16) for d in device.split(":"))
        if int(inode):
            mappings.append(Mapping(start, end, int(offset, 16), os.makedev(major, minor), int(inode), path))
    mappings.sort(key=lambda m: m.start)
    return mappings


def _written_flags() -> bytes:
    """A ``bytes.translate`` table from the top byte of a pagemap entry (bits 56-63) to 1 if copy-on-write replaced
    the page (present and not file-backed, or swapped: only anonymous pages swap), else 0."""
    present, swapped, file_page = _PRESENT >> 56, _SWAPPED >> 56, _FILE_OR_SHARED >> 56
    return bytes(int(bool(b & swapped) or (bool(b & present) and not b & file_page)) for b in range(256))


_WRITTEN = _written_flags()


def _written_pages(pagemap: int, start: int, end: int) -> bytes:
    """A byte per page of ``[start, end)``: 1 where copy-on-write replaced it (its bytes may differ from the file's).

    Plain bytes operations (no torch, no threads): this runs in forked children too."""
    first, count = start // PAGE, (end + PAGE - 1) // PAGE - start // PAGE
    raw = os.pread(pagemap, 8 * count, 8 * first)
    if len(raw) != 8 * count:
        raise OSError("short read of /proc/self/pagemap")
    return raw[7::8].translate(_WRITTEN)  # entries are little-endian: byte 7 holds bits 56-63


def file_ranges(views: Sequence[memoryview]) -> tuple[list[FileRange | None], list[int]]:
    """For each view, where its bytes lie in a file, if it is an untouched view of one (see the module doc).

    Returns the per-view ranges and the files they refer to, as fds opened read-only (the caller closes them).
    """
    where = [arena.buffer_address(view) if view.nbytes else None for view in views]
    maps = read_maps(addresses=sorted(a for a in where if a is not None))
    starts = [m.start for m in maps]
    found: list[tuple[int, Mapping] | None] = []
    for view, address in zip(views, where, strict=True):
        mapping = None
        if address is not None:
            i = bisect.bisect_right(starts, address) - 1
            if i >= 0 and address + view.nbytes <= maps[i].end:
                mapping = maps[i]
        found.append((address, mapping) if address is not None and mapping is not None else None)
    if not any(found):
        return [None] * len(views), []

    written: dict[Mapping, bytes] = {}
    fds: list[int] = []
    file_index: dict[tuple[int, int], int | None] = {}
    ranges: list[FileRange | None] = []
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for view, hit in zip(views, found, strict=True):
            if hit is None:
                ranges.append(None)
                continue
            address, mapping = hit
            if mapping.file not in file_index:
                file_index[mapping.file] = _open_file(mapping, fds)
            index = file_index[mapping.file]
            if index is None:
                ranges.append(None)
                continue
            if mapping not in written:
                written[mapping] = _written_pages(pagemap, mapping.start, mapping.end)
            first = (address - mapping.start) // PAGE
            last = (address + view.nbytes - 1 - mapping.start) // PAGE
            if written[mapping].find(1, first, last + 1) != -1:
                ranges.append(None)  # the loader wrote to it: copy the bytes it holds now
                continue
            ranges.append(FileRange(index, mapping.offset + address - mapping.start))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        os.close(pagemap)
    return ranges, fds


def _open_file(mapping: Mapping, fds: list[int]) -> int | None:
    """Open the mapped file if the path still names it (same device and inode); its index in ``fds``."""
    try:
        fd = os.open(mapping.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or FileIdentity.of(info).file != mapping.file:
        os.close(fd)
        return None
    fds.append(fd)
    return len(fds) - 1
