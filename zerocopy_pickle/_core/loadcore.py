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

All of that is decided here; the unpickler (``pickler._Unpickler``) is mechanism only, given what was decided
(the buffers, the storage builder, the admitted globals' table or None, the budget). The public
:class:`ZeroCopyUnpickler` lives here too: a restricted one loads through :func:`load_stream` and admits through
:func:`admit_stream`; a trusted one is the mechanism, streaming from its file as ``pickle.Unpickler`` does.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypedDict

import torch

from .. import rebuild
from .._devices import transfer
from .._devices.backend import has_backend
from .._devices.device import MapLocation, Targets, is_cpu
from .._devices.plan import SourceFile
from .._registry.registry import Registry, default_registry
from .._trust import streamcheck
from .._trust.entries import AllowSpec
from .._trust.restricted import AllowList, stream_uses
from .._trust.semantics import StreamUses
from ..errors import ArgumentError, RestrictedLoadError, SnapshotError, ZeroCopyPickleError
from .pickler import _Unpickler


def argument(index: int) -> Any:
    """Stands for the ``index``-th argument object of a load in a stream (the model cache pickles the cached
    objects a call was given, and a result that holds them, as such references).

    Only :func:`load_stream` with ``arguments=`` resolves it, in a trusted load; calling it is a mistake.
    """
    raise ZeroCopyPickleError("an argument reference can only be resolved by a load given its arguments")


ARGUMENT = (argument.__module__, argument.__qualname__)
"""The global a stream names for an argument reference."""


class _ArgumentUnpickler(_Unpickler):
    """A trusted unpickler that resolves :func:`argument` to the caller's objects."""

    def __init__(self, file: Any, arguments: Sequence[object], **kwargs: Any) -> None:
        super().__init__(file, resolved=None, **kwargs)
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
        counted: False: the caller declares no number (a direct :class:`ZeroCopyUnpickler` given buffers that are
            not a list or tuple: an iterable, or None), so the number the stream consumes is not checked, and
            ``buffers`` is a function returning them as the caller gave them (no ``declared``).
        placed: the load's :class:`~zerocopy_pickle.rebuild.Placement`, or a plain dict of storages already
            moved (a direct :class:`ZeroCopyUnpickler`'s ``placed=``); None: a placement of ``buffers`` with
            ``locations``, made by the load (none when not ``counted``).

    Raises:
        ArgumentError: ``buffers`` is a function and ``declared`` is not given.
    """

    buffers: Buffers | Callable[[], Buffers]
    declared: int | None = None
    locations: Sequence[str] | None = None
    tensor_buffers: Sequence[bool] | None = None
    source_file: tuple[int, Sequence[int]] | None = None
    name: str = "the header"
    counted: bool = True
    placed: rebuild.Placement | dict[int, torch.UntypedStorage] | None = None

    def __post_init__(self) -> None:
        if callable(self.buffers) and self.declared is None and self.counted:
            raise ArgumentError("a BufferTable whose buffers come from a function needs declared=, their number")

    @property
    def count(self) -> int | None:
        """How many buffers the table declares (None: not ``counted``)."""
        if not self.counted:
            return None
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
        more_plugins: the names of further plugins whose safe globals a restricted load may use, without needing
            them (no presence check: a direct :class:`ZeroCopyUnpickler`'s ``plugins=``); None: every registered
            plugin's.
        encoding, errors, fix_imports: as for ``pickle.Unpickler`` (a direct :class:`ZeroCopyUnpickler`'s).
    """

    trusted: bool
    plugins: Sequence[tuple[str, str]] = ()
    allow: AllowSpec = ()
    map_location: MapLocation | Targets = None
    arguments: Sequence[object] | None = None
    check_bounds: bool = True
    registry: Registry | None = None
    more_plugins: Sequence[str] | None = ()
    encoding: str = "ASCII"
    errors: str = "strict"
    fix_imports: bool = True

    def plugin_names(self) -> tuple[str, ...] | None:
        """Whose safe globals a restricted load may use: the names of ``plugins`` and ``more_plugins``; None:
        every registered plugin's."""
        if self.more_plugins is None:
            return None
        return (*(name for name, _ in self.plugins), *self.more_plugins)


def restricted_allow_list(
    allow: AllowSpec, registry: Registry, plugins: Iterable[str] | None, *, storage_builder: object = None
) -> AllowList:
    """The allow list a restricted load admits a stream by: ``allow``, the built-in safe set and the safe globals
    of the plugins named ``plugins`` (None: every registered plugin's), with ``rebuild_storage`` resolving to the
    load's ``storage_builder`` (None: :func:`zerocopy_pickle.rebuild.rebuild_storage`).

    Raises:
        ArgumentError: a malformed ``allow`` entry.
    """
    named = None if plugins is None else tuple(plugins)
    return AllowList(
        allow,
        extra=registry.safe_globals(named),
        storage_builder=storage_builder,
        resolve_extra=lambda module, qualname: registry.resolve_safe_global(module, qualname, named),
    )


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
    if consumed is not None and count is not None and consumed != count:
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
    placed = table.placed
    if placed is None and table.counted:
        placed = rebuild.Placement(buffers, table.locations)
    builder = rebuild.StorageBuilder(targets, placed)
    allowed = None
    budget = 0
    if not trusted:
        allowed = restricted_allow_list(policy.allow, registry, policy.plugin_names(), storage_builder=builder)
        held = sum(memoryview(b).nbytes for b in buffers) if isinstance(buffers, (list, tuple)) else 0
        budget = 2 * (len(stream) + held)
    options = _Options(encoding=policy.encoding, errors=policy.errors, fix_imports=policy.fix_imports)
    try:
        # A restricted stream is admitted before anything runs: one that would be refused moves nothing to a
        # device, and the unpickler resolves only what admission resolved.
        resolved = None
        if allowed is not None:
            assert uses is not None  # analysed above
            resolved = allowed.admit(uses)
        unpickler: _Unpickler
        if policy.arguments is not None:
            unpickler = _ArgumentUnpickler(
                io.BytesIO(stream), policy.arguments, buffers=buffers, storage_builder=builder, **options
            )
        else:
            unpickler = _Unpickler(
                io.BytesIO(stream), buffers=buffers, storage_builder=builder, resolved=resolved, budget=budget,
                **options,
            )  # fmt: skip
        if table.locations is not None and table.tensor_buffers is not None:
            assert isinstance(placed, rebuild.Placement)  # made above: the caller's placed= comes without rows
            _place(placed, buffers, table, targets)
        return _rebuilt(unpickler, trusted=trusted)
    except ZeroCopyPickleError:
        raise
    except (pickle.UnpicklingError, EOFError) as e:
        raise SnapshotError(f"{where} is corrupt: {e}") from e
    except Exception as e:
        if trusted:
            raise  # the stream's own code failed: the caller chose to run it
        raise SnapshotError(f"{where} does not rebuild: {type(e).__name__}: {e}") from e


class _Options(TypedDict):
    """``pickle.Unpickler``'s own options."""

    encoding: str
    errors: str
    fix_imports: bool


def _rebuilt(unpickler: _Unpickler, *, trusted: bool) -> Any:
    """What ``unpickler`` loads; in a restricted load, any failure of the unpickling itself a SnapshotError."""
    if trusted:
        return unpickler.load()
    try:
        return unpickler.load()
    except ZeroCopyPickleError:
        raise
    except Exception as e:
        # Only the safe set and allowed globals ran: a failure means the stream is malformed.
        raise SnapshotError(f"the pickle stream does not rebuild: {type(e).__name__}: {e}") from e


def admit_stream(
    stream: bytes,
    *,
    plugins: Iterable[tuple[str, str]] = (),
    allow: AllowSpec = (),
    registry: Registry | None = None,
    more_plugins: Iterable[str] | None = (),
    uses: StreamUses | None = None,
) -> None:
    """Decide whether a restricted :func:`load_stream` of ``stream`` would admit it, on the stream alone: the
    same analysis, the same presence check of ``plugins`` and the same allow list's admission, in the same
    order, with no buffer read and nothing unpickled (``zerocopy-pickle scan``).

    ``more_plugins`` and ``uses`` are :class:`LoadPolicy`'s and :func:`load_stream`'s.

    Raises:
        RestrictedLoadError: the load would refuse the stream (its ``needed`` and ``blocked`` say what).
        SnapshotError: the stream is malformed.
        PluginError: a plugin it needs is missing or disabled.
    """
    registry = registry if registry is not None else default_registry()
    if uses is None:
        uses = stream_uses(stream)
    plugins = list(plugins)
    registry.prepare_load(plugins, trusted=False)
    named = None if more_plugins is None else (*(name for name, _ in plugins), *more_plugins)
    restricted_allow_list(allow, registry, named).admit(uses)


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


class ZeroCopyUnpickler(_Unpickler):
    """A ``pickle.Unpickler`` (C) for streams written by :class:`~zerocopy_pickle.ZeroCopyPickler`.

    Restricted by default, and then a front of the load core (:func:`load_stream`), which :meth:`load` calls: the
    same checks, in the same order, as ``zp.loads`` of a snapshot. Before anything runs, the stream is analysed
    (:mod:`zerocopy_pickle._trust.semantics`; its bounds checked), the number of out-of-band buffers it consumes
    must be the number of ``buffers`` when they are a list or tuple, every plugin is discovered, and the stream
    is admitted by the call's allow list: it may only name the built-in safe set, plugins' declared safe globals
    and what ``allow`` admits, call only what those let it call, and fill only objects it created. Failures are
    the core's: a malformed stream (or one that does not rebuild) a
    :class:`~zerocopy_pickle.errors.SnapshotError`, a refused one a
    :class:`~zerocopy_pickle.errors.RestrictedLoadError`. A restricted unpickler reads ``file`` to its end when it
    is made (one stream per file; a second :meth:`load` finds it empty) and unpickles it with an unpickler of the
    core's own: overriding :meth:`find_class` in a subclass widens nothing, and calling it before :meth:`load`
    resolves nothing.

    ``trusted=True`` is a ``pickle.Unpickler`` as it is, streaming from ``file`` (several pickles, one after
    another, from one file): every global the stream names is imported (a missing one is a
    :class:`~zerocopy_pickle.errors.MissingGlobalError`), ``rebuild_storage`` places each storage by
    ``map_location`` (one storage per buffer of a list or tuple of ``buffers``), and the load runs with the garbage
    collector paused and torch's pending sparse tensors checked. Nothing else is checked: not the stream's bounds,
    not its buffer count, no plugin is looked up or prepared (their load hooks do not run), and pickle's own
    errors propagate as they are (``pickle.UnpicklingError``, ``EOFError``).

    Args:
        file: the pickle stream (anything with ``read``, ``readline``).
        buffers: the out-of-band buffers, in order (an iterable), as for ``pickle.Unpickler``. A writable
            buffer becomes a storage without a copy and is kept alive by it.
        map_location: where storages go, as for ``torch.load`` (or the load core's
            :class:`~zerocopy_pickle._devices.device.Targets` of it).
        trusted: resolve every global (full pickle; runs whatever code the stream names).
        allow: further globals for this unpickler only: classes, values, ``"module:qualname"`` strings, and
            :func:`~zerocopy_pickle._trust.entries.allow_function` entries for functions the stream may call.
        encoding, errors, fix_imports: as for ``pickle.Unpickler``.
        registry: whose plugins' safe globals to allow (default: the process's registry).
        plugins: the names of the plugins whose safe globals this stream may use (a snapshot header's list);
            None allows every registered plugin's. They are not required: a plugin named here that is not
            installed allows nothing (a snapshot's load requires the plugins its header lists).
        stream_uses: the stream's analysis, when the caller already has it
            (:func:`zerocopy_pickle._trust.semantics.uses`). It is not taken on trust: the load works out the
            stream's own (remembered by the stream's digest, so the analysis of this same stream costs a hash)
            and refuses one of another stream.
        placed: the load's :class:`~zerocopy_pickle.rebuild.Placement` (or a dict of storages already moved,
            by buffer identity). Without it, a list or tuple of ``buffers`` gets one of its own, so here too a
            buffer is one storage however often the stream references it.

    Attributes:
        allow_list: the allow list a restricted load of this unpickler admits by (one like the core builds for
            the load: changing it changes nothing); None when trusted.

    Raises:
        ArgumentError: a malformed ``allow`` entry or ``map_location``; (at :meth:`load`, :meth:`admit`)
            ``stream_uses`` that is not this stream's analysis.
    """

    def __init__(
        self,
        file: IO[bytes],
        *,
        buffers: Any = None,
        map_location: MapLocation | Targets = None,
        trusted: bool = False,
        allow: AllowSpec = (),
        encoding: str = "ASCII",
        errors: str = "strict",
        fix_imports: bool = True,
        registry: Registry | None = None,
        plugins: Iterable[str] | None = None,
        stream_uses: StreamUses | None = None,
        placed: rebuild.Placement | dict[int, torch.UntypedStorage] | None = None,
    ) -> None:
        targets = Targets.of(map_location)  # a malformed map_location is refused before anything is read
        options = _Options(encoding=encoding, errors=errors, fix_imports=fix_imports)
        self._trusted = trusted
        if trusted:
            if placed is None and isinstance(buffers, (list, tuple)):
                placed = rebuild.Placement(buffers)
            self.allow_list: AllowList | None = None
            super().__init__(
                file, buffers=buffers, storage_builder=rebuild.StorageBuilder(targets, placed), resolved=None,
                **options,
            )  # fmt: skip
            return
        registry = registry if registry is not None else default_registry()
        named = None if plugins is None else tuple(plugins)
        self.allow_list = restricted_allow_list(allow, registry, named)  # a malformed allow is refused here
        self._policy = LoadPolicy(
            trusted=False, allow=allow, map_location=targets, registry=registry, more_plugins=named,
            encoding=encoding, errors=errors, fix_imports=fix_imports,
        )  # fmt: skip
        if isinstance(buffers, (list, tuple)):
            self._table = BufferTable(buffers, name="buffers=", placed=placed)
        else:
            given = buffers
            self._table = BufferTable(lambda: given, counted=False, placed=placed)
        data = file.read()
        self._stream = data if type(data) is bytes else bytes(data)
        self._given_uses = stream_uses
        # This object unpickles nothing itself (an empty file, no global resolved): the core's unpickler does.
        super().__init__(io.BytesIO(b""), buffers=buffers, storage_builder=None, resolved={}, **options)

    def _uses(self) -> StreamUses:
        """The analysis of the stream, checked against the one the caller gave, if any."""
        uses = stream_uses(self._stream)
        if self._given_uses is not None and self._given_uses != uses:
            raise ArgumentError("stream_uses= is not the analysis of this unpickler's stream")
        return uses

    def admit(self) -> None:
        """Check, before anything runs, that a restricted stream is one its load would admit: the load core's
        :func:`admit_stream` (:meth:`load` does it too, first). Nothing for a trusted unpickler.

        Raises:
            RestrictedLoadError: the stream names globals, or does what, this unpickler does not allow.
            SnapshotError: the stream is malformed.
        """
        if self._trusted:
            return
        policy = self._policy
        admit_stream(
            self._stream,
            allow=policy.allow,
            registry=policy.registry,
            more_plugins=policy.more_plugins,
            uses=self._uses(),
        )

    def load(self) -> Any:
        if self._trusted:
            return super().load()
        uses = self._uses()
        stream, self._stream, self._given_uses = self._stream, b"", None  # read: a second load finds it empty
        return load_stream(stream, self._table, self._policy, uses=uses)

    def find_class(self, module: str, name: str) -> Any:
        if not self._trusted:
            raise RestrictedLoadError(
                "a restricted unpickler resolves globals only inside load()", refused=(module, name)
            )
        return super().find_class(module, name)
