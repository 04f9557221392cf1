"""The library's exception hierarchy.

Every error this library raises on purpose derives from :class:`ZeroCopyPickleError`, and also from the
built-in kind a caller would already catch for that situation (``ValueError`` for a malformed snapshot,
``pickle.UnpicklingError`` for a refused global, ``pickle.PicklingError`` for an object that cannot be
dumped), so existing ``except`` clauses keep working.
"""

from __future__ import annotations

import pickle

__all__ = [
    "ArgumentError",
    "DeviceError",
    "DumpError",
    "IntegrityError",
    "MissingGlobalError",
    "PluginError",
    "RestrictedLoadError",
    "SnapshotError",
    "TrustedOnlyWarning",
    "Unpicklable",
    "UnsafeArgumentError",
    "ZeroCopyPickleError",
]


class ZeroCopyPickleError(Exception):
    """Base class of every error raised by zerocopy_pickle.

    Every one pickles (a worker process sends it back to its parent, ``multiprocessing`` re-raises it), attributes
    included: ``BaseException``'s own reduction would call the class with the message alone.
    """

    def __reduce__(self) -> tuple[object, ...]:
        state = dict(vars(self))
        if isinstance(self, ImportError):  # name and path are not in __dict__
            state["name"], state["path"] = self.name, self.path
        return _rebuild_error, (type(self), self.args, state)


def _rebuild_error(cls: type[ZeroCopyPickleError], args: tuple[object, ...], state: dict[str, object]) -> BaseException:
    """The unpickling side of :meth:`ZeroCopyPickleError.__reduce__`: the instance without calling ``__init__``."""
    if not (isinstance(cls, type) and issubclass(cls, ZeroCopyPickleError)):
        raise TypeError(f"not a zerocopy_pickle error class: {cls!r:.80}")
    error = cls.__new__(cls, *args)
    error.args = args
    for key, value in state.items():
        setattr(error, key, value)
    return error


class SnapshotError(ZeroCopyPickleError, ValueError):
    """A snapshot is malformed, truncated, or inconsistent with its header.

    The message names the field or range that is wrong and where it is.
    """


class MissingGlobalError(SnapshotError, ImportError):
    """A global the stream names cannot be imported here: its module is missing, or has no such attribute.

    Also an ``ImportError``, as ``pickle.loads`` raises (``ModuleNotFoundError`` or ``AttributeError`` there), so
    ``except ImportError`` matches; the original error is its ``__cause__``.

    Attributes:
        module: the module the stream names (also ``name``, as for every ``ImportError``).
        qualname: the qualified name in it.
    """

    def __init__(self, message: str, *, module: str, qualname: str) -> None:
        super().__init__(message)
        self.name = module
        self.module = module
        self.qualname = qualname


class UnsafeArgumentError(SnapshotError):
    """A function a restricted load called (a safe global) was given an argument of the wrong exact type, size
    or value: the stream is malformed or hostile. Raised by the checks in :mod:`zerocopy_pickle.validate`."""


class IntegrityError(SnapshotError):
    """A snapshot's bytes do not match its checksums, or its signature is missing or does not verify."""


class DumpError(ZeroCopyPickleError, pickle.PicklingError):
    """An object graph could not be written as a snapshot.

    Attributes:
        path: where in the graph the object that cannot be pickled sits (``obj.layers[3]._forward_hooks[7]``),
            when it could be located.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class Unpicklable(ZeroCopyPickleError, TypeError):
    """Raised by a reducer to refuse an object for good (an open file, a thread): no backend is tried after it,
    and the dump's :class:`DumpError` carries this message, which should say what to do instead."""


class RestrictedLoadError(ZeroCopyPickleError, pickle.UnpicklingError):
    """A restricted load met a global that is not on this call's allow-list.

    Attributes:
        refused: the ``(module, qualname)`` pair that was refused.
        needed: every pair the stream references that this call does not allow but could (see
            :func:`zerocopy_pickle.scan`), when it could be determined.
        blocked: every pair the stream references that is on the blocklist: no ``allow=`` permits those.
        allow: the whole ``allow=`` list that admits the stream (this call's entries and the ones it lacks: names
            as ``"module:qualname"`` strings, :func:`~zerocopy_pickle.allow_function` entries for what the stream
            calls), ready to pass; None when no ``allow=`` can (see ``trusted_only``) or it was not worked out.
        trusted_only: why only ``trusted=True`` loads the stream (empty when an ``allow=`` can).
    """

    def __init__(
        self,
        message: str,
        *,
        refused: tuple[str, str],
        needed: tuple[tuple[str, str], ...] = (),
        blocked: tuple[tuple[str, str], ...] = (),
        allow: tuple[object, ...] | None = None,
        trusted_only: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.refused = refused
        self.needed = needed
        self.blocked = blocked
        self.allow = allow
        self.trusted_only = trusted_only


class DeviceError(ZeroCopyPickleError, RuntimeError):
    """A storage cannot be placed on the device its snapshot or ``map_location`` asks for."""


class ArgumentError(ZeroCopyPickleError, ValueError):
    """An argument has the wrong type or value (an ``allow=`` entry, a ``map_location``, an option)."""


class PluginError(ZeroCopyPickleError, ImportError):
    """A plugin a snapshot needs is missing, disabled or broken, or a plugin could not be registered.

    Attributes:
        plugin: the plugin's name.
        package: the distribution that provides it, when known (what to install).
    """

    def __init__(self, message: str, *, plugin: str, package: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.package = package


class TrustedOnlyWarning(UserWarning):
    """:func:`~zerocopy_pickle.dump` or :func:`~zerocopy_pickle.dumps` wrote a snapshot that only
    ``trusted=True`` can load (code pickled by value: lambdas, local and ``__main__`` functions and classes; or
    the dill backend). The message names where each such object sits in the graph and how to make the snapshot
    restricted-loadable. Silence it with ``warnings.simplefilter("ignore", zp.TrustedOnlyWarning)`` where
    trusted loads are intended."""
