"""Internal: integrity: checksums of the stream and every buffer (xxHash XXH3-64), and HMAC signatures.

Checksums detect accidental damage: a bit flipped on disk, a truncated copy. The stream's checksum is checked
on every load (the stream is small); the buffers' only with ``verify=True``, because checking them reads every
byte and a load is otherwise lazy.

A signature authenticates a snapshot: ``dump(..., key=K)`` records ``HMAC-SHA256(K, header || stream)``, where
the header (in its canonical JSON form, without the signature) includes every buffer's checksum. So a valid
signature proves the stream (the code a load runs) and the checksums came from a holder of ``K``; together with
``verify=True`` it proves every byte did. Only a snapshot whose signature verifies may load trusted without the
caller saying ``trusted=True``.

A check proves something only about bytes that cannot change afterwards. The loader checks the header and the
stream on private copies; buffers that could still change (a mapped file) are checked by
:func:`copy_verified`, which hashes a private copy as it makes it; :func:`verify_buffers` hashes in place, for
memory nobody else can change (a sealed memfd, a private copy).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import ArgumentError, IntegrityError
from . import arena, writes
from .format import CHECKSUM_ALGORITHM, Checksums, Header

_DOMAIN = b"zerocopy_pickle snapshot signature v2\0"


def _xxh3() -> Any:
    try:
        import xxhash
    except ImportError as e:  # a declared dependency; only a broken install lacks it
        raise ArgumentError("checksums need the xxhash package: pip install xxhash") from e
    return xxhash


def checksum(data: Any) -> str:
    """XXH3-64 of a bytes-like object, as 16 lowercase hex digits."""
    return str(_xxh3().xxh3_64_hexdigest(data))


def checksums(stream: Any, buffers: Iterable[Any]) -> Checksums:
    """The checksums a header records for a stream and its buffers."""
    return Checksums(CHECKSUM_ALGORITHM, checksum(stream), tuple(checksum(b) for b in buffers))


PENDING = "0" * 16
"""A stand-in for a checksum not computed yet: every XXH3-64 digest is 16 hex digits, so a header encoded with
these has the length it will have with the real ones (see :func:`write_checksummed`)."""


PARALLEL_HASH_MIN_NBYTES = 32 << 20
"""From this many buffer bytes on, :func:`write_checksummed` and :func:`write_buffers` use a second thread
(where the process may run on two or more CPUs): both write, or one writes while the other hashes."""

MAX_WRITERS = 2
"""The most threads that write one dump: one per usable CPU up to this (measured on 2 CPUs only)."""

PARALLEL_WRITE_MAX_NBYTES = 1 << 30
"""Above this many buffer bytes, ``auto`` writes with one thread (a second one hashing beside it). Measured on
the development VM (docs/benchmark.md, "Two writing threads"), interleaved in the same runs: two writers dump a
274 MiB model state dict in 0.67-0.72 of ``save_file``'s time against 0.85-0.93 for one, but a 2000 MiB state
dict in 1.90-3.02 against 1.08-1.16 (most of its samples hit the VM's slow fresh pages; one writer fewer)."""

WRITERS_ENV = "ZEROCOPY_PICKLE_DUMP_WRITERS"
"""The environment variable that caps the writing threads of a dump to a path: unset or ``auto``, one per usable
CPU (at most :data:`MAX_WRITERS`); ``1``, one writing thread, with a second one hashing beside it for large
dumps (the writer before both wrote); any other number, at most that many."""

_HASH_SLICE = 8 << 20  # bytes per update in the hashing thread; it checks for a failed write between slices


def writers(nbytes: int = 0) -> int:
    """How many threads a dump to a path of ``nbytes`` buffer bytes writes with (:data:`WRITERS_ENV`, the usable
    CPUs; ``auto`` writes with one above :data:`PARALLEL_WRITE_MAX_NBYTES`).

    Raises:
        ArgumentError: :data:`WRITERS_ENV` is neither ``auto`` nor a positive integer.
    """
    value = os.environ.get(WRITERS_ENV, "").strip().lower()
    cap = MAX_WRITERS if nbytes <= PARALLEL_WRITE_MAX_NBYTES else 1
    if value not in ("", "auto"):
        try:
            cap = int(value)
        except ValueError:
            cap = 0
        if cap < 1:
            raise ArgumentError(f"{WRITERS_ENV} must be 'auto' or a positive integer, not {value!r}")
    return max(1, min(cap, MAX_WRITERS, _usable_cpus()))


def write_checksummed(
    fd: int, placed: Sequence[tuple[int, Any]], *, progress: Callable[[int], object] | None = None
) -> tuple[str, ...]:
    """Write each ``(offset, buffer)`` at its offset of ``fd`` (the calls :func:`writes.write_placed` makes, which
    tell ``progress`` what they wrote) and return the buffers' checksums (as :func:`checksum` gives them).

    Each chunk is hashed just before it is written, while it is in the CPU cache. Where the process may run on
    two or more CPUs and the buffers hold at least :data:`PARALLEL_HASH_MIN_NBYTES`, two threads share the work
    (:func:`writes.split_placed`: the file cut at a window boundary between buffers, balancing bytes, each
    buffer hashed whole by one thread); where the buffers cannot be divided so (one huge buffer), or
    :data:`WRITERS_ENV` is ``1``, one thread writes while a second one hashes (xxhash releases the GIL). Either
    way an error from any thread propagates once every thread stopped, and the buffers are only read.
    """
    xxhash = _xxh3()
    hashers = [xxhash.xxh3_64() for _ in placed]
    nbytes = sum(memoryview(b).nbytes for _, b in placed)

    def observe(i: int, chunk: memoryview) -> None:
        hashers[i].update(chunk)

    if nbytes < PARALLEL_HASH_MIN_NBYTES or _usable_cpus() < 2:
        writes.write_placed(fd, placed, observe=observe, progress=progress)
        return tuple(h.hexdigest() for h in hashers)
    count = writers(nbytes)
    shares = writes.split_placed(placed, count) if count > 1 else None
    if shares is not None:
        writes.write_shares(fd, shares, observe=observe, progress=progress)
        return tuple(h.hexdigest() for h in hashers)

    stop = threading.Event()
    failure: list[BaseException] = []

    def hash_all() -> None:
        try:
            for hasher, (_, buffer) in zip(hashers, placed, strict=True):
                view = memoryview(buffer).cast("B")
                for at in range(0, view.nbytes, _HASH_SLICE):
                    if stop.is_set():
                        return
                    hasher.update(view[at : at + _HASH_SLICE])
        except BaseException as e:  # re-raised in the calling thread
            failure.append(e)

    worker = threading.Thread(target=hash_all, name="zerocopy_pickle-checksums", daemon=True)
    worker.start()
    try:
        writes.write_placed(fd, placed, progress=progress)
    except BaseException:
        stop.set()
        raise
    finally:
        worker.join()
    if failure:
        raise failure[0]
    return tuple(h.hexdigest() for h in hashers)


def write_buffers(
    fd: int, placed: Sequence[tuple[int, Any]], *, progress: Callable[[int], object] | None = None
) -> None:
    """:func:`write_checksummed` without the checksums: in two threads where it would use two."""
    nbytes = sum(memoryview(b).nbytes for _, b in placed)
    if nbytes >= PARALLEL_HASH_MIN_NBYTES and _usable_cpus() >= 2:
        count = writers(nbytes)
        shares = writes.split_placed(placed, count) if count > 1 else None
        if shares is not None:
            writes.write_shares(fd, shares, progress=progress)
            return
    writes.write_placed(fd, placed, progress=progress)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _key_bytes(key: bytes | str) -> bytes:
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise ArgumentError("key must be non-empty bytes (or a str, encoded as UTF-8)")
    return bytes(key)


def sign(key: bytes | str, signed_header: bytes, stream: Any) -> str:
    """The signature of a canonical header (without its signature) and the stream that follows it."""
    mac = hmac.new(_key_bytes(key), _DOMAIN, hashlib.sha256)
    mac.update(len(signed_header).to_bytes(8, "little"))
    mac.update(signed_header)
    mac.update(stream)
    return mac.hexdigest()


def verify_signature(header: Header, stream: Any, key: bytes | str) -> None:
    """Raise unless ``header`` carries a signature made with ``key`` over itself and ``stream``.

    Raises:
        IntegrityError: the snapshot is not signed, or the signature does not match.
    """
    if not header.signature:
        raise IntegrityError("the snapshot is not signed, but a key was given: refusing to treat it as authentic")
    expected = sign(key, header.signed_header, stream)
    if not hmac.compare_digest(expected, header.signature):
        raise IntegrityError(
            "the snapshot's signature does not match: it was changed after signing, or signed with another key"
        )


def verify_stream(header: Header, stream: Any) -> None:
    """Check the stream against its recorded checksum, when the snapshot has one.

    Raises:
        IntegrityError: the stream does not match.
    """
    if header.checksums is not None and checksum(stream) != header.checksums.stream:
        raise IntegrityError(
            f"the pickle stream (offset {header.stream_offset}, {header.stream_nbytes} bytes) does not match its "
            f"checksum: the snapshot is damaged"
        )


COPY_CHUNK = 1 << 20
"""Buffers are copied and hashed in pieces of this size, each hashed while it is still in the CPU cache."""


def copy_verified(header: Header, snapshot: memoryview) -> list[memoryview]:
    """Copy every buffer of ``snapshot`` into new private memory, checking it against its recorded checksum
    as it is copied, and return the copies (slices of one anonymous mapping of the data region's size).

    For a snapshot whose bytes may change after they are checked (a mapping of a file that somebody else can
    write): what is hashed is the private copy, piece by piece right after each piece is copied, so the
    buffers returned are exactly the bytes that matched, and no later write to the file can reach them. One
    pass: the cost of a memory copy (the hash runs on data already in cache), and the loaded tensors then
    live in this process's own memory instead of sharing the file's page cache.

    Raises:
        IntegrityError: the snapshot records no checksums, or a buffer does not match (named with its offset);
            nothing is returned.
    """
    expected = _recorded(header)
    xxhash = _xxh3()
    private = memoryview(arena.anonymous(header.data_nbytes))
    copies = []
    for i, entry in enumerate(header.buffers):
        start, stop = header.buffer_range(i)
        source = snapshot[start:stop]
        copy = private[entry.offset : entry.offset + entry.nbytes]
        if entry.nbytes <= COPY_CHUNK:
            copy[:] = source
            digest = xxhash.xxh3_64_hexdigest(copy)
        else:
            hasher = xxhash.xxh3_64()
            for at in range(0, entry.nbytes, COPY_CHUNK):
                piece = copy[at : at + COPY_CHUNK]
                piece[:] = source[at : at + COPY_CHUNK]
                hasher.update(piece)
            digest = hasher.hexdigest()
        if digest != expected[i]:
            raise IntegrityError(f"buffer {i} at [{start}, {stop}) does not match its checksum: the data is damaged")
        copies.append(copy)
    return copies


def _recorded(header: Header) -> tuple[str, ...]:
    if header.checksums is None:
        raise IntegrityError(
            "verify=True, but the snapshot records no checksums (written with checksums=False, or in format 1)"
        )
    return header.checksums.buffers


def verify_buffers(header: Header, buffers: Iterable[Any]) -> None:
    """Check every buffer against its recorded checksum (reads every byte).

    Raises:
        IntegrityError: the snapshot records no checksums, or a buffer does not match (named with its offset).
    """
    for i, (buffer, expected) in enumerate(zip(buffers, _recorded(header), strict=True)):
        if checksum(buffer) != expected:
            start, stop = header.buffer_range(i)
            raise IntegrityError(f"buffer {i} at [{start}, {stop}) does not match its checksum: the data is damaged")


def verify_file(header: Header, fd: int, chunk: int = 8 << 20) -> None:
    """Check the stream and every buffer of the snapshot in file ``fd`` against their recorded checksums,
    reading it with ``pread`` in pieces of ``chunk`` bytes (nothing is mapped: a file that fails is never
    mapped).

    Raises:
        IntegrityError: the snapshot records no checksums, or the stream or a buffer does not match.
        EOFError: the file ends before a range the header declares.
    """
    expected = _recorded(header)
    xxhash = _xxh3()

    def digest(start: int, stop: int) -> str:
        hasher = xxhash.xxh3_64()
        at = start
        while at < stop:
            data = os.pread(fd, min(chunk, stop - at), at)
            if not data:
                raise EOFError(f"the file ends at byte {at}, before byte {stop}")
            hasher.update(data)
            at += len(data)
        return str(hasher.hexdigest())

    stream = os.pread(fd, header.stream_nbytes, header.stream_offset)
    if len(stream) != header.stream_nbytes:
        raise EOFError(f"the file ends before its pickle stream does (offset {header.stream_offset})")
    verify_stream(header, stream)
    for i in range(len(header.buffers)):
        start, stop = header.buffer_range(i)
        if digest(start, stop) != expected[i]:
            raise IntegrityError(f"buffer {i} at [{start}, {stop}) does not match its checksum: the data is damaged")
