"""Internal: an opened snapshot to its objects, around the load core: the header, signature and checksums checked
first, the buffers sliced from the mapping into a :class:`~zerocopy_pickle._core.loadcore.BufferTable`, the
prefetch started once every check passed (and cancelled when the load fails), the load logged.

:func:`load_view` serves ``loads`` (a buffer), :func:`load_opened` ``load`` and ``Snapshot.load`` (a file or memfd
with its fd kept for the prefetch and for a device's bulk transfer). The records go to the logger of
``zerocopy_pickle._core.snapshot``, the one docs/usage.md documents for loads, beside the dumps'.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from .._devices.device import MapLocation, Targets, is_cpu
from .._registry.registry import Registry
from .._storage import format, integrity, readahead, sources
from .._trust.entries import AllowSpec
from ..errors import ArgumentError
from . import loadcore

log = logging.getLogger("zerocopy_pickle._core.snapshot")  # the loads' records beside the dumps' (docs/usage.md)


Prefetching = bool | str | None
"""``prefetch=`` of :func:`load` and :meth:`Snapshot.load`: None (the default), True, False or ``"wait"``."""


def load_opened(opened: sources.Opened, mode: str | None, *, map_location: MapLocation, source: str,
                 **kwargs: Any) -> Any:  # fmt: skip
    """:func:`load_view` of an opened snapshot, with its prefetch (``mode``), closing its kept fd."""
    job = None
    targets = Targets.of(map_location)  # examined once: here for the prefetch, then by the load core

    def start_prefetch() -> None:
        nonlocal job
        if mode is not None and opened.file is not None and stays_on_cpu(targets, opened.header):
            fd, offset = opened.file
            start = offset + opened.header.data_offset
            job = readahead.start(fd, start, start + opened.header.data_nbytes, name=source)

    try:
        result = load_view(
            opened.view,
            map_location=targets,
            stable=opened.stable,
            header=opened.header,
            source=source,
            before_buffers=start_prefetch,
            file=opened.file,
            **kwargs,
        )
    except BaseException:
        if job is not None:
            job.cancel()  # a failed load leaves nothing running
        raise
    finally:
        if opened.file is not None:
            os.close(opened.file[0])
    if job is not None and mode == "wait":
        job.wait()
    return result


def stays_on_cpu(targets: Targets, header: format.Header) -> bool:
    """Whether a load's storages are built over the mapping (else a bulk transfer reads the file for the device,
    and reading it into the page cache as well would compete with it). A callable decides storage by storage on
    the CPU storages: its ``target`` is None."""
    devices = {targets.target(entry.location) for entry in header.buffers if entry.dtype is not None}
    return all(target is None or is_cpu(target) for target in devices)


def prefetch_mode(prefetch: Prefetching) -> str | None:
    """``"start"``, ``"wait"`` or None (no prefetch) for a ``prefetch=`` argument."""
    if prefetch is None:
        return {"off": None, "wait": "wait", "on": "start"}[readahead.switch()]
    if prefetch is True:
        return "start"
    if prefetch is False:
        return None
    if prefetch == "wait":
        return "wait"
    raise ArgumentError(f"prefetch must be None, True, False or 'wait', not {prefetch!r:.40}")


def load_view(
    view: memoryview,
    *,
    map_location: MapLocation | Targets,
    trusted: bool | None,
    allow: AllowSpec,
    verify: bool = False,
    key: bytes | str | None = None,
    stable: bool = False,
    registry: Registry | None = None,
    header: format.Header | None = None,
    source: str = "a buffer",
    level: int = logging.DEBUG,
    before_buffers: Callable[[], object] | None = None,
    file: tuple[int, int] | None = None,
) -> Any:
    """Unpickle the snapshot that fills ``view`` (writable, aligned); storages become views into it.

    Everything that can be checked is checked before the unpickler runs: the header, the signature (with a
    key), the stream's checksum, bounds and buffer count, the buffers' checksums (with ``verify``), that every
    device exists, that every plugin is loaded. ``trusted=None`` means trusted only if a key verified the
    signature.

    What is checked is what is used: the header and the stream are parsed, checked and unpickled from private
    copies (``bytes``). ``stable`` says that nobody can change the bytes behind ``view`` (private memory, a
    sealed memfd); otherwise ``verify`` copies every buffer into private memory as it checks it, and the
    storages are views into that copy. ``header``: the header already decoded from ``view`` (by
    :func:`~zerocopy_pickle._storage.sources.open_source`), else it is decoded here. ``source`` and ``level``: how the
    log record of the load names the snapshot, and at which level it is logged. ``before_buffers``: called once
    every check passed, just before the buffers are sliced (a prefetch starts there, so that a refused load reads
    nothing and the checks' own reads, such as plugins' imports, do not queue behind it). ``file``: ``(fd, offset)``
    of the file ``view`` maps (offset: of the snapshot's first byte), for a bulk transfer to a device that reads
    the file itself where its pages are not cached; it is not used when ``verify`` copied the buffers.
    """
    start = time.perf_counter()
    if header is None:
        header = sources.read_header(sources.at_view(view), view.nbytes)
    stream = bytes(view[header.stream_offset : header.stream_offset + header.stream_nbytes])
    if key is not None:
        integrity.verify_signature(header, stream, key)
    if trusted is None:
        trusted = key is not None
    integrity.verify_stream(header, stream)

    def checked_buffers() -> list[memoryview]:
        if before_buffers is not None:
            before_buffers()
        if verify and not stable:
            return integrity.copy_verified(header, view)  # later writes to the file cannot reach these
        buffers = [view[start:stop] for start, stop in map(header.buffer_range, range(len(header.buffers)))]
        if verify:
            integrity.verify_buffers(header, buffers)
        return buffers

    table = loadcore.BufferTable(
        checked_buffers,
        declared=len(header.buffers),
        locations=[entry.location for entry in header.buffers],
        tensor_buffers=[entry.dtype is not None for entry in header.buffers],
        source_file=None if file is None or (verify and not stable) else buffer_offsets(header, *file),
    )
    policy = loadcore.LoadPolicy(
        trusted=trusted, plugins=header.plugins, allow=allow, map_location=map_location, registry=registry
    )
    result = loadcore.load_stream(stream, table, policy, where=f"the pickle stream (offset {header.stream_offset})")
    log.log(level, "loaded %s: %d bytes, %d buffers, %s%s, %.3f s", source, header.total_nbytes,
            len(header.buffers), "trusted" if trusted else "restricted", ", verified" if verify else "",
            time.perf_counter() - start)  # fmt: skip
    return result


def buffer_offsets(header: format.Header, fd: int, offset: int) -> tuple[int, list[int]]:
    """``(fd, the absolute file offset of each buffer)``, as :func:`loadcore.load_stream`'s ``source_file``."""
    return fd, [offset + header.buffer_range(index)[0] for index in range(len(header.buffers))]
