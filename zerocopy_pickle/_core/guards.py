"""Internal: what every load and dump runs inside: torch's pending sparse tensors checked and released
(:func:`sparse_tensors_checked`), and the garbage collector paused (:data:`gc_paused`), both safe with loads in
several threads and across ``fork``. The pickler and unpickler enter them; nothing here knows a stream.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import SnapshotError


# Note [Sparse tensors in loads]: torch's _rebuild_sparse_tensor builds a sparse tensor unchecked and appends it to
# torch._utils._sparse_tensors_to_validate; torch.load validates that list (when sparse invariant checks are on,
# torch.sparse.check_sparse_tensor_invariants) and clears it before it returns. A load here does the same for the
# tensors it added, and releases them whether it succeeds or fails, so none stays referenced by torch for good.
# (Restricted loads rebuild sparse tensors with safe_composite.safe_rebuild_sparse_tensor, which checks at once and
# adds nothing; a trusted load runs torch's own.) Entries of other loads running at the same time are left alone.
@contextlib.contextmanager
def sparse_tensors_checked() -> Iterator[None]:
    pending: list[torch.Tensor] = torch._utils._sparse_tensors_to_validate
    before = {id(t) for t in pending} if pending else set()
    try:
        yield
    except BaseException:
        _take_new(pending, before)
        raise
    added = _take_new(pending, before)
    if added and torch.sparse.check_sparse_tensor_invariants.is_enabled():
        for tensor in added:
            _validate_sparse(tensor)


def _take_new(pending: list[torch.Tensor], before: set[int]) -> list[torch.Tensor]:
    """Remove from ``pending`` (by identity: ``==`` on tensors compares elements) what is not in ``before``."""
    if not pending:
        return []
    added = [t for t in pending if id(t) not in before]
    if added:
        pending[:] = [t for t in pending if id(t) in before]
    return added


def _validate_sparse(tensor: torch.Tensor) -> None:
    """torch._utils._validate_loaded_sparse_tensors for one tensor, raising a SnapshotError."""
    layout = tensor.layout
    try:
        if layout is torch.sparse_coo:
            torch._validate_sparse_coo_tensor_args(
                tensor._indices(), tensor._values(), tensor.size(), tensor.is_coalesced(), check_pinning=False
            )
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            torch._validate_sparse_compressed_tensor_args(
                tensor.crow_indices(),
                tensor.col_indices(),
                tensor.values(),
                tensor.size(),
                layout,
                check_pinning=False,
            )
        elif layout in (torch.sparse_csc, torch.sparse_bsc):
            torch._validate_sparse_compressed_tensor_args(
                tensor.ccol_indices(),
                tensor.row_indices(),
                tensor.values(),
                tensor.size(),
                layout,
                check_pinning=False,
            )
    except (RuntimeError, ValueError, IndexError) as e:
        raise SnapshotError(f"a {layout} sparse tensor in the snapshot violates its invariants: {e}") from e


# Note [GC during loads]: unpickling a model creates thousands of container objects (modules, their dicts,
# parameters), which triggers generation-2 collections; each one walks every object of the process, and a process
# that imported diffusers and transformers holds millions. Measured on an SD1.5 pipeline in such a process: the
# unpickling itself takes ~25 ms, the collections it triggered up to ~200 ms more. Nothing a load creates is
# garbage until it returns, so collections are paused for its duration (counted, so that concurrent loads in
# several threads re-enable collection only when the last one ends, and only if it was enabled before; a fork
# child drops the pauses of threads that did not survive the fork).
class _GCPause:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depths: dict[int, int] = {}  # thread ident -> pauses it holds
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Any:
        me = threading.get_ident()
        with self._lock:
            if not self._depths:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depths[me] = self._depths.get(me, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._release(me)

    def _release(self, thread: int) -> None:
        depth = self._depths.pop(thread) - 1
        if depth:
            self._depths[thread] = depth
        elif not self._depths and self._was_enabled:
            gc.enable()

    def _after_fork_in_child(self) -> None:
        # Only the forking thread survives a fork: the loads other threads had in flight never end in the child,
        # and one of them may have held the lock. Keep the forking thread's own pauses (it ends them itself).
        self._lock = threading.Lock()
        me = threading.get_ident()
        held, self._depths = self._depths, {t: d for t, d in self._depths.items() if t == me}
        if held and not self._depths and self._was_enabled:
            gc.enable()


gc_paused = _GCPause()
os.register_at_fork(after_in_child=gc_paused._after_fork_in_child)
