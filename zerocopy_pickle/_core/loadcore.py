"""Internal: the load core: the one place that turns a pickle stream and its out-of-band buffers into an object graph.

Every consumer calls :func:`load_stream`: snapshot files, bytes and memfds (``snapshot.py``, after it decoded and
checked the header) and model-cache entries (``cache/entries.py``, in clients and in the cache's loader). What it
does, in this order, is the same for all of them:

1. a restricted load analyses the stream (``semantics``; remembered by digest) and a trusted one checks its bounds
   (``streamcheck``), unless the caller says the stream is its own (the model cache: see ``check_bounds``);
2. the number of buffers the stream consumes must be the number the caller's table declares;
3. every device the buffers' recorded locations map to must exist (``map_location``);
4. the plugins the stream needs must be installed and loaded, and a *trusted* load runs their load hooks (a
   restricted load runs none: a header an attacker wrote must not make this process import or patch anything);
5. the C unpickler rebuilds the graph (restricted: admitted by the call's allow list first), with argument
   references (:func:`argument`) resolved to the caller's objects in a trusted load;
6. failures become the library's errors: a malformed stream a :class:`~zerocopy_pickle.errors.SnapshotError`; a
   trusted stream's own code failing propagates as itself (the caller chose to run it).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import rebuild
from .._devices import transfer
from .._devices.backend import has_backend
from .._devices.device import MapLocation, Targets, is_cpu
from .._devices.plan import SourceFile
from .._registry.registry import Registry, default_registry
from .._trust import streamcheck
from .._trust.entries import AllowSpec
from .._trust.restricted import stream_uses
from .._trust.semantics import StreamUses
from ..errors import ArgumentError, SnapshotError, ZeroCopyPickleError
from .pickler import ZeroCopyUnpickler


def argument(index: int) -> Any:
    """Stands for the ``index``-th argument object of a load in a stream (the model cache pickles the cached
    objects a call was given, and a result that holds them, as such references).

    Only :func:`load_stream` with ``arguments=`` resolves it, in a trusted load; calling it is a mistake.
    """
    raise ZeroCopyPickleError("an argument reference can only be resolved by a load given its arguments")


ARGUMENT = (argument.__module__, argument.__qualname__)
"""The global a stream names for an argument reference."""


class _ArgumentUnpickler(ZeroCopyUnpickler):
    """A trusted unpickler that resolves :func:`argument` to the caller's objects."""

    def __init__(self, file: Any, arguments: Sequence[object], **kwargs: Any) -> None:
        super().__init__(file, trusted=True, **kwargs)
        self._arguments = arguments

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ARGUMENT:
            return self._arguments.__getitem__
        return super().find_class(module, name)


Buffers = Sequence[Any]


@dataclass(frozen=True)
class BufferTable:
    """The out-of-band buffers a stream consumes, as its caller's table (a snapshot header's rows, a cache
    entry's buffer rows) declares them.

    Args:
        buffers: the buffers in the order the stream consumes them; or a function that returns them, called
            only once every check passed (a snapshot verifies its buffers' checksums there), with ``declared``
            their number.
        declared: the number of buffers, when ``buffers`` is a function.
        locations: the devices the buffers were recorded on, checked against ``map_location`` before anything is
            built (None: not known, not checked).
        tensor_buffers: which buffers hold a tensor's storage (a snapshot header's rows with a dtype): those
            whose target is a device with a bulk transfer (CUDA) are moved there in one transfer per device before
            unpickling (:mod:`zerocopy_pickle._devices.transfer`); others go storage by storage. Needs ``locations``.
        source_file: ``(fd, offsets)``: the file the buffers are views of, and the absolute file offset of each
            buffer (by buffer index). A transfer to a device may then read the buffers' bytes from the file
            rather than from the buffers (when they are mostly not in the page cache: docs/devices.md). Only
            for buffers whose bytes are exactly the file's (not private copies made while verifying them);
            the fd must stay open during the load, which does not keep it.
        name: how errors name what declared the buffers.

    Raises:
        ArgumentError: ``buffers`` is a function and ``declared`` is not given.
    """

    buffers: Buffers | Callable[[], Buffers]
    declared: int | None = None
    locations: Sequence[str] | None = None
    tensor_buffers: Sequence[bool] | None = None
    source_file: tuple[int, Sequence[int]] | None = None
    name: str = "the header"

    def __post_init__(self) -> None:
        if callable(self.buffers) and self.declared is None:
            raise ArgumentError("a BufferTable whose buffers come from a function needs declared=, their number")

    @property
    def count(self) -> int:
        """How many buffers the table declares."""
        if callable(self.buffers):
            assert self.declared is not None  # __post_init__
            return self.declared
        return len(self.buffers)


@dataclass(frozen=True)
class LoadPolicy:
    """What one load admits, runs and where it places storages: everything a caller decides about a load.

    Args:
        trusted: full pickle (runs whatever the stream names); False: restricted to the safe set, the plugins'
            safe globals and ``allow``.
        plugins: ``(name, package)`` of every plugin the stream needs (a snapshot header's or a cache entry's).
        allow: further globals a restricted load may resolve.
        map_location: where storages go, as for ``torch.load``; made a :class:`~zerocopy_pickle._devices.device.
            Targets` once per load, which checks, transfers and the unpickler's storage builder all place by.
        arguments: objects the stream's :func:`argument` references resolve to (trusted loads only).
        check_bounds: check a trusted stream's bounds and buffer count (``streamcheck``) before it runs. Only a
            stream this user's own process wrote may skip it (the model cache: its entries come from the user's
            server, which got them from the user's loader; checking would cost each fresh process tens of
            milliseconds per large entry, and a trusted stream can run any code anyway).
        registry: whose plugins and safe globals (default: the process's).
    """

    trusted: bool
    plugins: Sequence[tuple[str, str]] = ()
    allow: AllowSpec = ()
    map_location: MapLocation | Targets = None
    arguments: Sequence[object] | None = None
    check_bounds: bool = True
    registry: Registry | None = None


def load_stream(
    stream: bytes,
    table: BufferTable,
    policy: LoadPolicy,
    *,
    uses: StreamUses | None = None,
    where: str = "the pickle stream",
) -> Any:
    """Unpickle ``stream`` with the out-of-band buffers of ``table``, as ``policy`` says: the checks, the
    plugins' preparation and the unpickler every load goes through.

    Args:
        stream: the pickle stream (a private copy: what is checked is what is unpickled).
        table: its buffers and what the caller knows of them.
        policy: trust, plugins, allow list, placement.
        uses: the stream's analysis, if the caller has it.
        where: how errors name the stream.

    Raises:
        SnapshotError: the stream is malformed, consumes another number of buffers, or (restricted) does not
            rebuild; a transfer read from ``table.source_file`` found the file truncated.
        RestrictedLoadError: a restricted stream names globals the call does not allow.
        DeviceError: a target device does not exist here.
        PluginError: a plugin is missing, disabled or broken, or its load hook failed.
        ArgumentError: ``arguments`` with a restricted load; a malformed ``map_location``.
    """
    trusted = policy.trusted
    if policy.arguments is not None and not trusted:
        raise ArgumentError("argument references resolve only in a trusted load")
    targets = Targets.of(policy.map_location)  # map_location examined once, for the whole load
    registry = policy.registry if policy.registry is not None else default_registry()
    count = table.count
    # A restricted load works out what the stream does (and checks its bounds) before anything runs; a trusted
    # one checks the bounds only. Both are remembered by the stream's digest.
    if uses is None and not trusted:
        uses = stream_uses(stream)
    consumed = uses.next_buffers if uses is not None else streamcheck.validated(stream) if policy.check_bounds else None
    if consumed is not None and consumed != count:
        raise SnapshotError(f"{where} consumes {consumed} out-of-band buffer(s), {table.name} declares {count}")
    if table.locations is not None:
        targets.check(table.locations)
    # Plugins' load hooks run only once trust is decided, and only for trusted loads.
    plugins = list(policy.plugins)
    registry.prepare_load(plugins, trusted=trusted)
    if not trusted:
        # The restricted unpickler's safe globals need every plugin discovered (importing their registration
        # modules). Done before the buffers are asked for: a snapshot starts its prefetch there, and imports
        # from a cold disk would otherwise queue behind its reads.
        registry.ensure_discovered()
    buffers = table.buffers() if callable(table.buffers) else table.buffers
    # One storage per buffer, placed where its header row (and map_location) says; the bulk transfer below fills
    # it once the stream is admitted, the storage builder as the stream references each buffer.
    placed = rebuild.Placement(buffers, table.locations)
    unpickler: ZeroCopyUnpickler
    if policy.arguments is not None:
        unpickler = _ArgumentUnpickler(
            io.BytesIO(stream), policy.arguments, buffers=buffers, map_location=targets, registry=registry,
            placed=placed,
        )  # fmt: skip
    else:
        unpickler = ZeroCopyUnpickler(
            io.BytesIO(stream),
            buffers=buffers,
            map_location=targets,
            trusted=trusted,
            allow=policy.allow,
            registry=registry,
            plugins=[name for name, _ in plugins],
            stream_uses=uses,
            placed=placed,
        )
    try:
        if table.locations is not None and table.tensor_buffers is not None:
            unpickler.admit()  # a restricted stream that would be refused moves nothing to a device
            _place(placed, buffers, table, targets)
        return unpickler.load()
    except ZeroCopyPickleError:
        raise
    except (pickle.UnpicklingError, EOFError) as e:
        raise SnapshotError(f"{where} is corrupt: {e}") from e
    except Exception as e:
        if trusted:
            raise  # the stream's own code failed: the caller chose to run it
        raise SnapshotError(f"{where} does not rebuild: {type(e).__name__}: {e}") from e


def admit_stream(
    stream: bytes,
    *,
    plugins: Iterable[tuple[str, str]] = (),
    allow: AllowSpec = (),
    registry: Registry | None = None,
) -> None:
    """Decide whether a restricted :func:`load_stream` of ``stream`` would admit it, on the stream alone: the
    same analysis, the same presence check of ``plugins`` and the same unpickler's admission, in the same
    order, with no buffer read and nothing unpickled (``zerocopy-pickle scan``).

    Raises:
        RestrictedLoadError: the load would refuse the stream (its ``needed`` and ``blocked`` say what).
        SnapshotError: the stream is malformed.
        PluginError: a plugin it needs is missing or disabled.
    """
    registry = registry if registry is not None else default_registry()
    uses = stream_uses(stream)
    plugins = list(plugins)
    registry.prepare_load(plugins, trusted=False)
    ZeroCopyUnpickler(
        io.BytesIO(stream),
        buffers=[],
        allow=allow,
        registry=registry,
        plugins=[name for name, _ in plugins],
        stream_uses=uses,
    ).admit()


def _place(placed: rebuild.Placement, buffers: Buffers, table: BufferTable, targets: Targets) -> None:
    """Move the tensor buffers bound to bulk-transfer devices there, one transfer per device, and record
    ``index -> storage`` in ``placed`` for the unpickler's storage builder (it returns that storage for every
    ``rebuild_storage`` of the buffer, whatever the stream's own location argument says). A callable
    ``map_location`` decides storage by storage, after it sees each one: nothing is moved ahead. The file of
    ``table.source_file``, if any, may be read instead of the buffers."""
    assert table.locations is not None  # load_stream's condition, with tensor_buffers
    assert table.tensor_buffers is not None
    if callable(targets.map_location):
        return
    groups: dict[torch.device, list[int]] = {}
    for index, (location, holds_tensor) in enumerate(zip(table.locations, table.tensor_buffers, strict=True)):
        target = targets.target(location) if holds_tensor else None
        if target is None or is_cpu(target):
            continue
        device = transfer.device_of(target)
        if has_backend(device):
            groups.setdefault(device, []).append(index)
    for device, indices in groups.items():
        hosts = [rebuild.storage_from_buffer(buffers[index]) for index in indices]
        source = None
        if table.source_file is not None:
            fd, offsets = table.source_file
            source = SourceFile(fd, tuple(offsets[index] for index in indices))
        for index, storage in zip(indices, transfer.move(hosts, device, source=source), strict=True):
            placed[index] = storage
