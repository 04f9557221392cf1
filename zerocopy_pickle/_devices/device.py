"""Internal: placing loaded storages on devices: ``map_location`` with ``torch.load``'s semantics.

Every storage is rebuilt first as a CPU view into the snapshot's mapping. It stays there (zero-copy) when its
target is the CPU; otherwise it is copied to the target device. The target follows ``torch.load``:

* ``None``: the device the storage was saved from;
* a string or :class:`torch.device`: that device, for every storage;
* a dict: maps saved locations (``"cuda:1"``) to new ones; unmapped locations stay;
* a callable ``f(storage, location)``: returns the storage to use, or None for the default.

:meth:`Targets.check` runs before unpickling, so a load that cannot place its storages fails before it has
built anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from ..errors import ArgumentError, DeviceError

MapLocation = (
    str
    | torch.device
    | Mapping[str, str | torch.device]
    | Callable[[torch.UntypedStorage, str], torch.UntypedStorage | None]
    | None
)


def _parse(location: str, map_location: MapLocation) -> torch.device:
    try:
        return torch.device(location)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"{location!r} is not a device name (map_location={map_location!r:.80})") from e


def _check_available(device: torch.device, saved: str, map_location: MapLocation) -> None:
    hint = (
        f"the snapshot holds storages saved on {saved!r}; pass map_location='cpu' (or a dict or callable, as "
        f"for torch.load) to load them elsewhere"
    )
    if map_location is not None:
        hint = f"map_location={map_location!r:.80} sends storages saved on {saved!r} there"
    _require(device, hint)


def _require(device: torch.device, hint: str) -> None:
    if device.type in ("cpu", "meta"):
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"cannot place a storage on {device}: CUDA is not available here; {hint}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"cannot place a storage on {device}: this machine has {torch.cuda.device_count()} CUDA "
                f"device(s); {hint}"
            )
        return
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if callable(is_available) and not is_available():
        raise DeviceError(f"cannot place a storage on {device}: {device.type} is not available here; {hint}")


def check_device(device: torch.device, what: str) -> None:
    """Check that ``device`` exists here, for ``what`` (a call that names its target directly).

    Raises:
        DeviceError: it does not; the message says why.
    """
    _require(device, f"{what} sends tensors there")


def is_cpu(location: str) -> bool:
    """Whether a device name denotes the CPU."""
    return location == "cpu" or location.startswith("cpu:")


def static_target(map_location: MapLocation, location: str) -> str | None:
    """The device a storage saved on ``location`` goes to, or None when a callable decides at load time.

    Raises:
        ArgumentError: ``map_location`` is not one of the accepted kinds.
    """
    if map_location is None:
        return location
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if isinstance(map_location, Mapping):
        return str(map_location.get(location, location))
    _check_kind(map_location)
    return None  # a callable


def _check_kind(map_location: MapLocation) -> None:
    if not (map_location is None or isinstance(map_location, (str, torch.device, Mapping)) or callable(map_location)):
        raise ArgumentError(
            f"map_location must be None, a device string, a torch.device, a dict or a callable, "
            f"not {type(map_location).__name__}"
        )


class Targets:
    """One load's ``map_location``, examined once: its kind checked when the load starts, each saved location's
    target worked out once (remembered for the load's life), the devices checked before anything is built, and
    every storage placed through it. The load core makes one per load and hands it to the unpickler, whose
    storage builder places with it; :meth:`of` passes one through, so every layer may accept either.

    Raises:
        ArgumentError: ``map_location`` is not one of the accepted kinds (when made).
    """

    __slots__ = ("_static", "map_location")

    def __init__(self, map_location: MapLocation = None) -> None:
        _check_kind(map_location)  # before anything is read
        self.map_location = map_location
        self._static: dict[str, str | None] = {}

    @classmethod
    def of(cls, map_location: MapLocation | Targets) -> Targets:
        """``map_location`` as a :class:`Targets` (itself when it already is one)."""
        return map_location if isinstance(map_location, Targets) else cls(map_location)

    def target(self, location: str) -> str | None:
        """Where a storage saved on ``location`` goes; None when a callable decides, storage by storage."""
        try:
            return self._static[location]
        except KeyError:
            target = self._static[location] = static_target(self.map_location, location)
            return target

    def stays_on_cpu(self, location: str) -> bool:
        """Whether a storage saved on ``location`` stays the CPU storage it was built as."""
        target = self.target(location)
        return target is not None and is_cpu(target)

    def check(self, locations: Iterable[str]) -> None:
        """Check, before anything is built, that every saved location can be placed where it is sent.

        Raises:
            DeviceError: a target device does not exist here; the message names ``map_location``.
        """
        for location in set(locations):
            target = self.target(location)
            if target is not None and not is_cpu(target):
                _check_available(_parse(target, self.map_location), location, self.map_location)

    def restore(self, storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        """Place a freshly rebuilt CPU storage, saved on ``location``, where ``map_location`` sends it.

        Raises:
            DeviceError: the target does not exist, or a callable returned something that is not a storage.
        """
        target = self.target(location)  # worked out once per location: not again in restore()
        if target is not None and is_cpu(target):
            return storage
        return _restore_to(storage, location, target, self.map_location)


def default_restore(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
    """Move a CPU storage to ``location`` (kept as is, without a copy, when that is the CPU)."""
    device = _parse(location, None)
    if device.type == "cpu":
        return storage
    if device.type == "meta":
        return torch.UntypedStorage(storage.nbytes(), device="meta")
    _check_available(device, location, None)
    moved: torch.UntypedStorage = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device).untyped_storage()
    moved.copy_(storage)
    return moved


def _restore_to(
    storage: torch.UntypedStorage, location: str, target: str | None, map_location: MapLocation
) -> torch.UntypedStorage:
    """Place a freshly rebuilt CPU storage, saved on ``location``, at ``target`` (``static_target``'s answer for it;
    None: ``map_location`` is a callable, which decides).

    Raises:
        DeviceError: the target does not exist, or a callable returned something that is not a storage.
    """
    if target is not None:
        return default_restore(storage, target)
    assert callable(map_location)
    result = map_location(storage, location)
    if result is None:
        return default_restore(storage, location)
    if isinstance(result, torch.storage.TypedStorage):
        return result._untyped_storage
    if not isinstance(result, torch.UntypedStorage):
        raise DeviceError(
            f"map_location callable returned {type(result).__name__} for a storage saved on {location!r}; "
            f"it must return a storage or None"
        )
    return result
