"""Internal: the store's persistence directory: the per-user key, each segment's file and the authenticated index,
each written whole, and the warm start that restores and verifies them.

With a persistence directory, each segment is also written to a file and the entries to an index, so a
restarted server starts warm. The directory must be private (:func:`protocol.open_private_directory`), its
files are opened relative to it without following links (and written through
:func:`zerocopy_pickle._storage.atomic.replacing`), and the index is authenticated: an HMAC-SHA256, with a
per-user key kept in the private runtime directory, over the index, which lists every segment's SHA-256. A
restart verifies the code, then copies each segment into a new sealed memfd and checks its digest there, so what
clients map is exactly what was persisted and can no longer change; a segment that is missing or not what was
persisted drops only the entries using it (and those that took them as arguments); anything else amiss and the
server starts cold, having unpickled nothing (nothing in the directory is ever unpickled by the server: entries'
streams are bytes it hands to the user's own clients). This module needs only the standard library (and
``zerocopy_pickle._storage``'s ``arena``, ``atomic``, ``fileid``, ``readahead`` and ``writes``, which need nothing
else): the server never imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._storage import arena, atomic, readahead, writes
from .._storage.fileid import FileIdentity
from .lru import Entries, Entry
from .protocol import CacheError, open_private_directory, runtime_dir
from .segments import Segment, Segments

_INDEX = "index.json"
_INDEX_VERSION = 4  # 3: typed buffer rows and the plugins entries need; 4: the files each key was computed from
# (an older index is dropped: cold start)
KEY_FILE = "persist.key"
"""The persistence key's name in the runtime directory: 32 random bytes, mode 0600, one per user."""
_KEY_BYTES = 32
_READ_QUIETLY = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO planted in a row's place cannot block the open


class _ColdStart(Exception):
    """The persistence directory cannot be trusted or read: start cold (the reason is logged)."""


class Persistence:
    """A persistence directory, opened and checked, with this user's key."""

    def __init__(self, directory: Path, key_dir: Path | None, *, log: logging.Logger) -> None:
        """
        Args:
            directory: private (see :func:`protocol.open_private_directory`; created 0700).
            key_dir: where the persistence key lives (default: :func:`protocol.runtime_dir`).
            log: where to say what could not be written or read back (the store's logger,
                ``zerocopy_pickle.cache.store``, which docs/usage.md names).

        Raises:
            CacheError: the persistence directory, the runtime directory or the key in it is not private.
        """
        self._key, self._key_is_new = persistence_key(key_dir)
        self._dir_fd = open_private_directory(directory, what="persistence directory")
        self._directory = directory
        self._log = log

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def write_segment(self, segment: Segment) -> None:
        """Persist a new memfd segment (its file and digest); a failure is logged, and the entry is served, just
        not persisted (the index on disk stays valid)."""
        if self._dir_fd < 0:
            return
        name = f"segment-{segment.id}.bin"
        try:
            segment.sha256 = _digest(segment.fd, segment.nbytes)
            with atomic.replacing(self._dir_fd, name) as out:
                _send_all(out, segment.fd, segment.nbytes)
            segment.path = name
        except OSError as e:
            segment.sha256 = None
            self._log.warning("could not persist segment %d (%s)", segment.id, e)

    def remove_segment(self, segment: Segment) -> None:
        """Remove a freed segment's persisted copy."""
        if segment.path is not None and self._dir_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path, dir_fd=self._dir_fd)

    def save_index(self, segments: Iterable[Segment], entries: Iterable[Entry]) -> None:
        """Write the index (authenticated) of the entries whose segments are all persisted. A failed write
        leaves the previous index as it was, and the server goes on serving from memory."""
        if self._dir_fd < 0:
            return
        saved = {
            s.id: {
                "id": s.id,
                "nbytes": s.nbytes,
                "kind": s.kind,
                "source": s.source,
                "identity": identity_row(s.identity) if s.identity is not None else None,
                "sha256": s.sha256,
            }
            for s in segments
            if s.kind == "file" or s.sha256 is not None
        }
        body = json.dumps(
            {
                "segments": list(saved.values()),
                "entries": [e.encode() for e in entries if all(i in saved for i in e.segment_ids)],
            }
        )
        mac = hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()
        blob = json.dumps({"version": _INDEX_VERSION, "body": body, "hmac_sha256": mac}).encode()
        try:
            with atomic.replacing(self._dir_fd, _INDEX) as out:
                writes.write_pieces(out, [blob])
        except OSError as e:
            self._log.warning("could not write the persistence index (%s); the previous one stays", e)

    # -- the warm start --------------------------------------------------------------------------------------------

    def restore(self, segments: Segments, entries: Entries) -> str | None:
        """Start warm from the directory into the empty ``segments`` and ``entries``, or cold (emptied again; the
        reason logged and returned) if anything in it is not exactly what this user's server wrote with this
        user's key."""
        try:
            fd = _open_private_file(self._dir_fd, _INDEX)
        except FileNotFoundError:
            return None
        except (OSError, _ColdStart) as e:
            return self._start_cold(segments, entries, str(e))
        try:
            self._restore_index(fd, segments, entries)
        except _ColdStart as e:
            return self._start_cold(segments, entries, str(e))
        return None

    def _restore_index(self, fd: int, segments: Segments, entries: Entries) -> None:
        reading: dict[str, readahead.Prefetch] = {}
        try:
            with os.fdopen(fd, "rb") as file:
                raw = file.read()
            if self._key_is_new:
                raise _ColdStart(f"the persistence key ({KEY_FILE}) was missing: the index cannot be verified")
            index = _verified_index(raw, self._key)
            rows = index["segments"]
            if not isinstance(rows, list):
                raise _ColdStart("the index's segment list is malformed")
            reading = self._prefetch_persisted(rows)
            self._restore_segments(rows, segments)
            self._restore_entries(index["entries"], segments, entries)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, CacheError) as e:
            raise _ColdStart(f"the index or a segment is damaged ({type(e).__name__}: {e})") from e
        finally:
            for job in reading.values():  # the copied segments are read; adopted files go on reading
                job.cancel()

    def _restore_segments(self, rows: list[Any], segments: Segments) -> None:
        for row in rows:
            segment_id = row["id"]
            if type(segment_id) is not int or segment_id <= 0 or segment_id in segments:
                raise _ColdStart(f"the index has a malformed segment id {segment_id!r}")
            segments.reserve(segment_id)
            if row["kind"] == "file":  # the user's file: usable if it is still the same file
                reopened = _reopen_file(row)
                if reopened is not None:
                    segments.restore(reopened)
                continue
            restored = self._restore_segment(row)
            if restored is not None:
                segments.restore(restored)

    def _restore_entries(self, rows: Any, segments: Segments, entries: Entries) -> None:
        """The listed entries whose segments were restored, and whatever they reference; the index is rewritten
        without the others."""
        listed = [Entry.decode(row) for row in rows]
        kept = {e.key: e for e in listed if all(segment in segments for segment in e.segment_ids)}
        while True:  # and whatever references a dropped entry (its arguments), transitively
            orphans = [key for key, e in kept.items() if not all(ref in kept for ref in e.refs)]
            if not orphans:
                break
            for key in orphans:
                del kept[key]
        for entry in kept.values():
            entries.put(entry)
            segments.hold(entry.segment_ids)
        segments.collect_unused()
        if len(kept) < len(listed):
            self._log.warning("%d persisted entries dropped (a segment missing or changed)", len(listed) - len(kept))
            self.save_index(segments.values(), entries.values())

    def _prefetch_persisted(self, rows: list[Any]) -> dict[str, readahead.Prefetch]:
        """Start reading every persisted segment file and every adopted checkpoint file of the index into the page
        cache, a few sequential streams each (:mod:`zerocopy_pickle._storage.readahead`): the restore's copies and the
        first hits' touches then read at the disk's parallel rate. Returns the prefetches of the segment files, by name
        (the restore has read them once it is done); the checkpoint files' go on in the background. A row that does
        not name a regular file here is left to the checks of the restore."""
        started: dict[str, readahead.Prefetch] = {}
        for row in rows:
            try:
                if row["kind"] == "file":
                    name, fd = str(row["source"]), os.open(row["source"], _READ_QUIETLY)
                else:
                    name = f"segment-{int(row['id'])}.bin"
                    fd = os.open(name, _READ_QUIETLY | os.O_NOFOLLOW, dir_fd=self._dir_fd)
            except (OSError, KeyError, TypeError, ValueError):
                continue
            try:
                job = readahead.start_file(fd, name=name)
            except OSError:
                continue
            finally:
                os.close(fd)
            if job is not None and row["kind"] != "file":
                started[name] = job
        return started

    def _restore_segment(self, row: dict[str, Any]) -> Segment | None:
        """A persisted segment copied into a new sealed memfd and checked against its digest there (what clients
        will map); None if its file is gone, or is not what was persisted (another size, other bytes: the file is
        removed): the entries using it are dropped, nothing else.

        Raises:
            _ColdStart: the file is not a private regular file of this user.
        """
        name = f"segment-{row['id']}.bin"
        nbytes, expected = row["nbytes"], row["sha256"]
        if type(nbytes) is not int or nbytes < 0 or not isinstance(expected, str):
            raise _ColdStart(f"the index describes segment {row['id']} wrongly")
        try:
            fd = _open_private_file(self._dir_fd, name)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != nbytes:
                self._drop_persisted(name, "has the wrong size")
                return None
            memfd = arena.create_memfd(f"zerocopy_pickle-cache-{row['id']}")
            try:
                _send_all(memfd, fd, nbytes)
                arena.seal(memfd)
                matches = hmac.compare_digest(_digest(memfd, nbytes), expected)
            except BaseException:
                os.close(memfd)
                raise
            if not matches:
                os.close(memfd)
                self._drop_persisted(name, "does not match its digest in the index")
                return None
        finally:
            os.close(fd)
        return Segment(row["id"], memfd, nbytes, path=name, sha256=expected)

    def _drop_persisted(self, name: str, why: str) -> None:
        self._log.warning("persisted segment %s %s: the entries using it are dropped", name, why)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self._dir_fd)

    def _start_cold(self, segments: Segments, entries: Entries, reason: str) -> str:
        segments.forget_all(restart_ids=True)
        entries.clear()
        self._log.warning("starting cold, not from %s: %s", self._directory, reason)
        return reason


def persistence_key(directory: Path | None = None) -> tuple[bytes, bool]:
    """This user's persistence key and whether it was just created: :data:`KEY_FILE` in the private
    ``directory`` (default: :func:`protocol.runtime_dir`), created with 32 random bytes, mode 0600, without
    following links, published whole (linked into place) or not at all.

    Raises:
        CacheError: the directory is not private, or the key file is not a private regular file of 32 bytes.
    """
    dir_fd = open_private_directory(directory) if directory is not None else None
    if dir_fd is None:
        directory = runtime_dir()
        dir_fd = open_private_directory(directory)
    try:
        for _ in range(3):
            try:
                fd = _open_private_file(dir_fd, KEY_FILE)
            except FileNotFoundError:
                pass
            except _ColdStart as e:
                raise CacheError(f"{e}; remove it ({directory}/{KEY_FILE}): a new key is then made") from e
            else:
                with os.fdopen(fd, "rb") as file:
                    key = file.read(_KEY_BYTES + 1)
                if len(key) != _KEY_BYTES:
                    raise CacheError(
                        f"the persistence key {directory}/{KEY_FILE} is not {_KEY_BYTES} bytes long; remove it: a "
                        "new key is then made (persisted entries are then not used)"
                    )
                return key, False
            key = secrets.token_bytes(_KEY_BYTES)
            try:
                # Flushed: losing the key after a crash would cost every persisted entry (an index or segment
                # lost that way only means a cold start). Linked, not renamed: another server's key is kept.
                with atomic.replacing(dir_fd, KEY_FILE, fsync=True, replace=False) as out:
                    writes.write_pieces(out, [key])
            except FileExistsError:
                continue  # another server made one meanwhile: use that
            return key, True
        raise CacheError(f"cannot create the persistence key in {directory}")
    finally:
        os.close(dir_fd)


def _verified_index(raw: bytes, key: bytes) -> dict[str, Any]:
    outer = json.loads(raw)
    if not isinstance(outer, dict) or outer.get("version") != _INDEX_VERSION:
        raise _ColdStart("the index is not of this version's format")
    body, mac = outer.get("body"), outer.get("hmac_sha256")
    if not isinstance(body, str) or not isinstance(mac, str):
        raise _ColdStart("the index is malformed")
    if not hmac.compare_digest(hmac.new(key, body.encode(), hashlib.sha256).hexdigest(), mac):
        raise _ColdStart("the index's authentication code does not match (it was changed, or written with another key)")
    index = json.loads(body)
    if not isinstance(index, dict):
        raise _ColdStart("the index is malformed")
    return index


def _open_private_file(dir_fd: int, name: str) -> int:
    """``name`` in the directory ``dir_fd``, opened read-only without following a link, if it is a regular
    file of this user that nobody else may access.

    Raises:
        FileNotFoundError: there is no such file.
        _ColdStart: it is something else.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _ColdStart(f"{name} cannot be opened as a plain file ({e.strerror})") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise _ColdStart(f"{name} is not a private regular file of yours (mode {info.st_mode:o}, uid {info.st_uid})")
    return fd


def _send_all(out: int, fd: int, nbytes: int) -> None:
    offset = 0
    while offset < nbytes:
        sent = os.sendfile(out, fd, offset, nbytes - offset)
        if sent == 0:
            raise OSError(f"short copy: {nbytes - offset} bytes missing")
        offset += sent


def _digest(fd: int, nbytes: int) -> str:
    """SHA-256 of the first ``nbytes`` of ``fd`` (a sealed memfd: the bytes cannot change meanwhile)."""
    if not nbytes:
        return hashlib.sha256().hexdigest()
    with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as memory:
        return hashlib.sha256(memory).hexdigest()


def _reopen_file(row: dict[str, Any]) -> Segment | None:
    try:
        fd = os.open(row["source"], os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    found = FileIdentity.of_fd(fd)
    if found != identity_of_row(row["identity"]):
        os.close(fd)
        return None
    return Segment(row["id"], fd, row["nbytes"], kind="file", source=row["source"], identity=found)


def identity_row(identity: FileIdentity) -> list[int]:
    """A file segment's identity as the index holds it: ``[dev, ino, size, mtime_ns, ctime_ns]``, the order of
    the indexes written before :class:`FileIdentity` was one type (kept: those still load). The one conversion
    to that order; :func:`identity_of_row` is the one back."""
    return [identity.dev, identity.ino, identity.size, identity.mtime_ns, identity.ctime_ns]


def identity_of_row(row: Any) -> FileIdentity | None:
    """The identity an index row holds (:func:`identity_row`'s order); None if it is not five integers (no file
    has it: the segment is not restored).

    Raises:
        TypeError: it is not even a sequence (the index is damaged: a cold start).
    """
    values = list(row)
    if len(values) != 5 or not all(type(v) is int for v in values):
        return None
    dev, ino, size, mtime_ns, ctime_ns = values
    return FileIdentity(size, mtime_ns, ctime_ns, ino, dev)
