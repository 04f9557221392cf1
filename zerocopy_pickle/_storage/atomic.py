"""Internal: files that appear whole or not at all, so that a failed or killed write leaves the previous file as
it was.

:func:`replacing` is the one atomic writer of a file in a directory held open: written under a private temporary
name beside it, flushed if asked, then renamed over its name (or linked to it), the temporary removed on any
failure. Everything is relative to the directory's fd and nothing follows a link: the cache's persistence
directory and the download directory of URL loads are checked once, when opened, and their names are never
resolved again.

:func:`atomic_output` writes a snapshot to a path the caller names: through links, keeping the file's mode, like
``open(path, "wb")``, and made for large files (an unnamed ``O_TMPFILE`` inode, named only at the end, and the
replaced file's pages freed in the background).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
import threading
from collections.abc import Iterator

_libc = ctypes.CDLL(None, use_errno=True)
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


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, fsync: bool = False) -> Iterator[int]:
    """Yield a writable fd whose contents replace ``path`` only if the block completes.

    The data is written into an unnamed ``O_TMPFILE`` inode in the target directory, which the kernel frees
    by itself if the process dies, and is given a name only at the end: linked under a temporary name and
    renamed over ``path`` (one atomic step for readers). A snapshot is therefore never truncated or rewritten
    in place while someone maps it, and a failed or killed dump leaves the previous file untouched. Where
    ``O_TMPFILE`` is unsupported, a named temporary file is used and removed on any exception.

    Like ``open(path, "wb")``, this writes through a symbolic link to its target, and a file that is
    replaced keeps its permission bits (a private 0600 snapshot stays private).

    Args:
        path: the destination.
        fsync: flush the data (and the directory entry) to stable storage before returning.
    """
    # Not replacing, the writer of files in a directory held open: a dump's path is the caller's, written
    # through a link and keeping the replaced file's mode as open(path, "wb") would, and a snapshot is large: an
    # unnamed O_TMPFILE inode leaves nothing behind even when the process is killed mid-write, and an exchange
    # instead of a rename (then freeing the old file's pages in the background) keeps writeback out of the dump.
    path = os.path.realpath(os.fspath(path))
    directory, base = os.path.split(path)
    # Keep the temporary name within NAME_MAX (255 bytes) whatever the length of the target's name.
    stem = os.fsdecode(os.fsencode(base)[:200])
    tmp_name = os.path.join(directory, f".{stem}.{secrets.token_hex(6)}.zcp-tmp")
    try:
        existing = os.stat(path)
    except FileNotFoundError:
        existing = None
    mode = stat.S_IMODE(existing.st_mode) if existing is not None else None
    replaces_file = existing is not None and stat.S_ISREG(existing.st_mode)
    fd = -1
    named = False
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o666)
    except (OSError, AttributeError):
        fd = os.open(tmp_name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o666)
        named = True
    try:
        yield fd
        if mode is not None:
            os.fchmod(fd, mode)
        if fsync:
            os.fsync(fd)
        if not named:
            try:
                _link_unnamed(fd, tmp_name, directory)
            except OSError as e:
                if e.errno not in _NO_PROC_LINK:
                    raise
                # /proc is missing or refuses the link: copy the unnamed file into a named one (rare; a copy).
                _copy_fd_to_new_file(fd, tmp_name, mode)
            named = True
        if not (replaces_file and _exchange(tmp_name, path)):
            os.replace(tmp_name, path)
            named = False
        if fsync:
            dfd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    finally:
        os.close(fd)
        if named:  # the temporary file after a failure, or the previous snapshot after an exchange
            _unlink_and_release(tmp_name)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(new: str, old: str) -> bool:
    """Atomically swap two names (``renameat2(RENAME_EXCHANGE)``); False where the kernel or file system
    cannot, and the caller renames instead.

    Why not just rename over the old file: ext4 (``auto_da_alloc``) then forces writeback of the new file's
    data inside ``rename()``, and the old file's pages are freed there too; for a snapshot of a few hundred
    MiB that is a few hundred milliseconds of the dump. After an exchange, the old snapshot sits under the
    temporary name and is unlinked by :func:`_unlink_and_release`.
    """
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOENT, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), old)


def _unlink_and_release(name: str) -> None:
    """Unlink ``name`` now; free its pages in the background.

    Unlinking a large file frees its page cache synchronously, which is as slow as writing it. Holding an fd
    across the unlink moves that work to the final ``close``, done by a short-lived thread (``os.close``
    releases the GIL). If the process dies first, the kernel closes the fd and frees the inode: no file is
    ever left behind by this.
    """
    try:
        held = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        held = -1
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
    finally:
        if held >= 0:
            threading.Thread(target=os.close, args=(held,), name="zerocopy_pickle-release", daemon=True).start()


# Errors of linkat through /proc/self/fd that mean "this route is unavailable here", not "the target is bad".
_NO_PROC_LINK = frozenset({errno.ENOENT, errno.EXDEV, errno.EPERM, errno.EACCES, errno.EOPNOTSUPP, errno.ENOTSUP})


def _link_unnamed(fd: int, name: str, directory: str) -> None:
    # linkat(AT_SYMLINK_FOLLOW) on the /proc magic link gives an O_TMPFILE inode a name without privileges.
    # os.link only calls linkat (rather than link, which does not follow the magic link) when a dir fd is
    # passed, hence src_dir_fd (ignored for the absolute path otherwise).
    dfd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", name, src_dir_fd=dfd, follow_symlinks=True)
    finally:
        os.close(dfd)


def _copy_fd_to_new_file(src_fd: int, name: str, mode: int | None) -> None:
    size = os.fstat(src_fd).st_size
    out = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    try:
        if mode is not None:
            os.fchmod(out, mode)
        offset = 0
        while offset < size:
            sent = os.copy_file_range(src_fd, out, size - offset, offset, offset)
            if sent == 0:
                raise OSError(errno.EIO, f"short copy while naming {name}")
            offset += sent
    finally:
        os.close(out)
