"""``FileIdentity`` (zerocopy_pickle/_storage/fileid.py), the one definition of a file's identity as ``os.stat``
sees it, and the forms the cache sends and persists it in."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.internals import FileIdentity
from zerocopy_pickle.cache.fields import FileCheck, decode_file_checks
from zerocopy_pickle.cache.persistence import identity_of_row, identity_row


def test_of_fd_of_path_and_of_agree(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"one")
    info = path.stat()
    identity = FileIdentity.of_path(path)
    assert identity == FileIdentity.of(info) == (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino,
                                                 info.st_dev)  # fmt: skip
    fd = os.open(path, os.O_RDONLY)
    try:
        assert FileIdentity.of_fd(fd) == identity
    finally:
        os.close(fd)
    assert identity.file == (info.st_dev, info.st_ino)


def test_a_rewrite_in_place_changes_it_even_with_the_mtime_put_back(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"one")
    before = path.stat()
    identity = FileIdentity.of(before)
    time.sleep(0.05)  # past the coarse clock's tick, so the rewrite's ctime is another
    with open(path, "r+b") as f:  # in place, same size
        f.write(b"two")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the modification time set back
    after = FileIdentity.of_path(path)
    assert after.mtime_ns == identity.mtime_ns and after.size == identity.size
    assert after != identity  # the ctime: a write changed it, and nobody can set it back
    assert after.same_file(identity) and identity.same_file(path.stat())  # still the same file


def test_same_file_across_a_rename_and_not_for_a_replacement(tmp_path: Path) -> None:
    path, moved = tmp_path / "a.bin", tmp_path / "b.bin"
    path.write_bytes(b"one")
    identity = FileIdentity.of_path(path)
    path.rename(moved)
    assert identity.same_file(moved.stat()) and identity.same_file(FileIdentity.of_path(moved))
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"one")
    replacement.rename(moved)  # renamed over it: another file at the same name
    assert not identity.same_file(moved.stat()) and FileIdentity.of_path(moved) != identity


def test_a_file_check_is_its_path_and_identity_on_the_wire_as_one_flat_row(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"one")
    info = path.stat()
    check = FileCheck.of(str(path), info)
    assert check == FileCheck(str(path), FileIdentity.of(info))
    row = [str(path), info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]
    assert check.encode() == row  # the wire form and the persisted entries' form, unchanged
    assert decode_file_checks([row], "a test") == [check]


def test_the_index_keeps_a_file_segments_identity_in_its_first_order(tmp_path: Path) -> None:
    """A file segment's identity is persisted as ``[dev, ino, size, mtime_ns, ctime_ns]`` (the order indexes were
    written in before there was one type): a row in that order reads back as the identity, and round-trips."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"one")
    info = path.stat()
    old_order = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    identity = FileIdentity.of(info)
    assert identity_row(identity) == old_order
    assert identity_of_row(old_order) == identity
    assert identity_of_row(identity_row(identity)) == identity
    assert identity_of_row(old_order[:4]) is None and identity_of_row([*old_order[:4], "x"]) is None
