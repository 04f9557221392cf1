"""Internal: a file's identity as :func:`os.stat` sees it, the package's one definition of "the same file, not
changed": :class:`FileIdentity` (size, modification and change times in nanoseconds, inode, device).

Two identities are equal when nothing about the file that a reader could notice changed: a rewrite in place
changes its size, mtime or ctime, a replaced file (renamed over, re-pointed link) its inode or device. The change
time is there because a write always sets it and nobody can set it back: a rewrite in place that puts the
modification time back (``rsync --inplace -t``, ``cp -p``, ``os.utime``) still changes the identity.
:meth:`FileIdentity.same_file` asks the weaker question, whether two are the same file (device and inode),
whatever it holds now: a directory checked, then opened; a mapping's file opened again.

The model cache's file checks and key fingerprints hold these, and its file segments; the URL cache's directory
check and Ray's store mapping ask :meth:`~FileIdentity.same_file`. Standard library only: the cache server uses it.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class FileIdentity(NamedTuple):
    """A file as :func:`os.stat` saw it: its size, mtime and ctime (ns), inode and device (see the module doc:
    ctime because a write changes it, and unlike mtime nobody can set it back). Its fields, in this order, are the
    rows the cache sends and keys with (``[size, mtime_ns, ctime_ns, ino, dev]``)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, info: os.stat_result) -> FileIdentity:
        """The identity in a stat result (:func:`os.stat`, :func:`os.fstat`, ``DirEntry.stat``)."""
        return cls(info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)

    @classmethod
    def of_fd(cls, fd: int) -> FileIdentity:
        """The identity of the open file ``fd``.

        Raises:
            OSError: it cannot be examined.
        """
        return cls.of(os.fstat(fd))

    @classmethod
    def of_path(cls, path: str | os.PathLike[str]) -> FileIdentity:
        """The identity of the file ``path`` names, through symlinks (the file a reader opening it gets).

        Raises:
            OSError: there is no such file, or it cannot be examined.
        """
        return cls.of(os.stat(path))

    @property
    def file(self) -> tuple[int, int]:
        """``(device, inode)``: which file this is, whatever it holds now (what :meth:`same_file` compares)."""
        return (self.dev, self.ino)

    def same_file(self, other: FileIdentity | os.stat_result) -> bool:
        """Whether ``other`` (an identity or a stat result) is the same file: the same device and inode, however
        its contents or times changed since."""
        if isinstance(other, FileIdentity):
            return self.file == other.file
        return self.file == (other.st_dev, other.st_ino)
