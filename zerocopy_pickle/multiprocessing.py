"""Models for worker processes: one sealed memfd per object graph, mapped copy-on-write by every worker.

``torch.multiprocessing`` sends a model storage by storage: one shared-memory file and one fd per storage
(thousands for a pipeline; "too many open files"), and every receive maps each of them. Here an object graph
travels as one sealed memfd holding a snapshot of it, and one fd:

* :class:`Shared` freezes a graph once (any graph: a module, a state dict, a whole pipeline). Pickled by
  ``multiprocessing`` (a ``Queue``, a ``Pool``'s or a ``ProcessPoolExecutor``'s arguments, a ``Process``'s
  arguments, a spawned DataLoader worker's dataset) it sends that memfd's fd, and the receiving process gets
  the graph itself, loaded as copy-on-write views of the memfd: every receiver of one ``Shared`` maps the same
  physical pages, however many times it is sent. In a process that inherits it (``fork``), :meth:`Shared.load`
  does the same.
* :func:`register` makes every ``torch.nn.Module`` that ``multiprocessing`` pickles travel that way without a
  wrapper: each message freezes the module it carries (so what arrives is the module as it was when sent),
  in one memfd, with one fd.

Receiving processes load trusted: ``multiprocessing`` unpickles whatever its channels carry (it is pickle), and
the fd comes from the sending process, sealed. Never read a ``multiprocessing`` channel someone else can write to.
See docs/distributed.md.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.reduction
import multiprocessing.util
import os
import threading
from typing import Any

import torch

from ._core.snapshot import Snapshot, freeze, prefetch
from .errors import ArgumentError, ZeroCopyPickleError

__all__ = ["Shared", "register", "registered", "unregister"]


def _send_fd(fd: int) -> Any:
    """An object that pickles as a duplicate of ``fd`` for the receiving process (``multiprocessing``'s
    ``DupFd``). While a ``Process`` is being spawned the fd is passed to the child when it starts, after this
    returns, so it gets a duplicate of its own, closed once the spawn's ``Popen`` object is gone; otherwise the
    resource sharer duplicates it at once. Either way the caller may close ``fd`` as soon as this returns."""
    popen = multiprocessing.context.get_spawning_popen()
    if popen is None:
        return multiprocessing.reduction.DupFd(fd)
    own = os.dup(fd)
    multiprocessing.util.Finalize(popen, os.close, (own,))
    return popen.DupFd(popen.duplicate_for_child(own))


def _receive(dup: Any) -> Any:
    """The receiving side: the graph behind the fd ``dup`` carries, loaded zero-copy (the fd is closed after)."""
    fd = dup.detach()
    try:
        snapshot = Snapshot.from_fd(fd, trusted=True)
    finally:
        os.close(fd)
    with snapshot:
        return snapshot.load()


class Shared:
    """An object graph frozen once into a sealed memfd, to hand to other processes (and to load here).

    Args:
        obj: the graph (a module, a state dict, a pipeline, anything :func:`zerocopy_pickle.freeze` takes).
        backend: the pickling backend, as for :func:`zerocopy_pickle.dump`.

    Raises:
        DumpError: part of the graph cannot be pickled (nothing was created).

    The memfd lives as long as this object (or until :meth:`close`); graphs already loaded from it, here or in
    other processes, keep their mappings and stay valid after that.

    Examples:
        One model, frozen once, for a pool of workers (each maps the same physical pages):

        ```python
        import multiprocessing as mp

        import torch
        from zerocopy_pickle.multiprocessing import Shared


        def work(model, x):  # the worker receives the model itself, mapped copy-on-write
            with torch.no_grad():
                return model(x).shape


        if __name__ == "__main__":
            model = Shared(torch.nn.Linear(512, 512))  # one sealed memfd, one fd per message
            with mp.get_context("spawn").Pool(2) as pool:
                print(pool.starmap(work, [(model, torch.randn(1, 512))] * 4))
        ```

        In this process, or one that inherited it (``fork``):

        >>> import torch
        >>> from zerocopy_pickle.multiprocessing import Shared
        >>> shared = Shared(torch.nn.Linear(4, 2))
        >>> shared.load().out_features
        2
        >>> shared.close()
    """

    __slots__ = ("_snapshot",)

    def __init__(self, obj: object, *, backend: str = "auto") -> None:
        self._snapshot = freeze(obj, backend=backend, name="zerocopy_pickle.shared")

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, *, trusted: bool | None = None) -> Shared:
        """Share a snapshot that already exists, without copying it: one from :func:`zerocopy_pickle.freeze`,
        or a snapshot file (:meth:`Snapshot.open`; its receivers then map the file's page-cache pages). The fd
        is duplicated: ``snapshot`` stays the caller's to close. A file whose pages are not in the page cache is
        read into it from here, in background threads (:func:`zerocopy_pickle.prefetch`), while the workers start:
        their loads then find the pages there instead of each faulting them in from the disk.

        Receivers load every ``Shared`` trusted (pickle runs code), so the snapshot must be one this process
        trusts: ``trusted=None`` takes the snapshot's own default (True for :func:`~zerocopy_pickle.freeze`,
        False for a file opened without a key); say ``trusted=True`` for a file you wrote yourself.

        Raises:
            ArgumentError: the snapshot is not trusted (the message says how to share it anyway).
            ZeroCopyPickleError: ``snapshot`` is closed.
        """
        fd = snapshot.fd  # raises when closed
        if not (snapshot._trusted if trusted is None else trusted):
            raise ArgumentError(
                "Shared.from_snapshot: the worker processes that receive a Shared load it trusted, and this "
                "snapshot loads restricted by default; pass trusted=True if you trust its stream (a file you "
                "wrote), or load it here and share the graph: Shared(zerocopy_pickle.load(path, allow=...))"
            )
        self = cls.__new__(cls)
        self._snapshot = Snapshot.from_fd(fd, trusted=True)
        if not snapshot.sealed:
            prefetch(self._snapshot.fd)
        return self

    @property
    def snapshot(self) -> Snapshot:
        """The sealed memfd's :class:`~zerocopy_pickle.Snapshot`."""
        return self._snapshot

    @property
    def nbytes(self) -> int:
        """The snapshot's size in bytes."""
        return self._snapshot.nbytes

    def load(self, **kwargs: Any) -> Any:
        """A new copy-on-write graph over the memfd (what a receiving process gets); ``kwargs`` as for
        :meth:`Snapshot.load` (``map_location=`` for one)."""
        return self._snapshot.load(**kwargs)

    def close(self) -> None:
        """Close the memfd: this object can be neither loaded nor sent any more."""
        self._snapshot.close()

    def __reduce__(self) -> tuple[Any, ...]:
        if self._snapshot.closed:
            raise ZeroCopyPickleError("this Shared graph was closed; it can no longer be sent")
        return _receive, (_send_fd(self._snapshot.fd),)

    def __repr__(self) -> str:
        state = "closed" if self._snapshot.closed else f"{self._snapshot.nbytes} bytes"
        return f"<zerocopy_pickle.multiprocessing.Shared, {state}>"


_lock = threading.Lock()
_previous: list[Any] = []  # [ForkingPickler's own reducer_override or None] while registered


def _reduce_module(module: torch.nn.Module) -> tuple[Any, ...]:
    snapshot = freeze(module, name="zerocopy_pickle.shared")
    try:
        return _receive, (_send_fd(snapshot.fd),)
    finally:
        snapshot.close()


def register() -> None:
    """Make ``multiprocessing`` send every ``torch.nn.Module`` it pickles as one sealed memfd (idempotent).

    Installs a ``reducer_override`` on ``multiprocessing.reduction.ForkingPickler``, the pickler of every queue,
    pipe, pool and spawned process of this process (one that was there before is called for everything else).
    Each message freezes the modules it carries: send one model to many workers as one :class:`Shared` to freeze
    it once. Call it in a worker too (a ``Pool``'s ``initializer``) for models that worker sends back.
    """
    with _lock:
        if _previous:
            return
        pickler = multiprocessing.reduction.ForkingPickler
        previous = pickler.__dict__.get("reducer_override")

        def reducer_override(self: Any, obj: Any) -> Any:
            if isinstance(obj, torch.nn.Module):
                return _reduce_module(obj)
            if previous is not None:
                return previous(self, obj)
            return NotImplemented

        reducer_override.__qualname__ = "zerocopy_pickle.multiprocessing.reducer_override"
        _previous.append(previous)
        pickler.reducer_override = reducer_override  # type: ignore[method-assign]


def unregister() -> None:
    """Undo :func:`register` (``ForkingPickler`` gets back the ``reducer_override`` it had, if any)."""
    with _lock:
        if not _previous:
            return
        previous = _previous.pop()
        pickler = multiprocessing.reduction.ForkingPickler
        if previous is None:
            del pickler.reducer_override
        else:
            pickler.reducer_override = previous  # type: ignore[method-assign]


def registered() -> bool:
    """Whether :func:`register` is in effect."""
    return bool(_previous)
