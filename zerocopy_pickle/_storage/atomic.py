"""Internal: the one atomic writer of a file in a directory held open: written under a private temporary name
beside it, flushed if asked, then renamed over its name (or linked to it), the temporary removed on any failure,
so a failed write leaves the previous file as it was.

Everything is relative to the directory's fd and nothing follows a link: the cache's persistence directory and
the download directory of URL loads are checked once, when opened, and their names are never resolved again. A
snapshot written to a path the caller names is :func:`zerocopy_pickle._storage.arena.atomic_output`'s (it
writes through links and keeps the file's mode, like ``open(path, "wb")``, and it is made for large files).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def replacing(directory: int, name: str, *, fsync: bool = False, replace: bool = True) -> Iterator[int]:
    """Yield a writable fd of a new file, mode 0600, that becomes ``name`` in the directory ``directory`` (an fd)
    whole if the block completes, or not at all.

    The file is written under a fresh temporary name in the same directory (``O_EXCL | O_NOFOLLOW``), then
    renamed over ``name`` (one atomic step for readers; a link or anything else at ``name`` is replaced, never
    followed) or, without ``replace``, linked to it. On any failure, in the block or after it, the temporary is
    removed and ``name`` stays what it was.

    Args:
        directory: an fd of the directory.
        name: the file's name in it.
        fsync: flush the data to stable storage before the file gets its name.
        replace: rename over an existing ``name``; if False, ``FileExistsError`` when ``name`` exists.
    """
    temporary = f".{name}.{secrets.token_hex(6)}.tmp"
    out = os.open(temporary, _CREATE, 0o600, dir_fd=directory)
    try:
        try:
            yield out
            if fsync:
                os.fsync(out)
        finally:
            os.close(out)
        if replace:
            os.rename(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
        else:
            os.link(temporary, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=directory)


def write(directory: int, name: str, data: bytes, *, fsync: bool = False, replace: bool = True) -> None:
    """Write ``data`` as ``name`` in the directory ``directory`` (an fd) whole or not at all (:func:`replacing`)."""
    with replacing(directory, name, fsync=fsync, replace=replace) as out:
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
