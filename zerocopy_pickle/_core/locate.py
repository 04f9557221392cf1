"""Internal: finding the object a dump fails on, and its path in the graph
(``obj.encoder.layers[3]._forward_hooks[7]``).

Pickle's own error names a type ("cannot pickle 'function' object") but not where in a graph of thousands of
objects it sits. After a failed dump, :func:`locate_failure` descends from the root: at each node it tries to
pickle each child alone (with the same pickler configuration, tensors out of band and discarded, so nothing is
copied) and follows the first child that fails; the node whose children all pickle is the culprit.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_ATOMIC = (type(None), bool, int, float, complex, str, bytes, bytearray)
_MODULE_CONTAINERS = ("_modules", "_parameters", "_buffers")


@dataclass(frozen=True)
class Failure:
    """Where a dump failed: the path from the root, the object, and the error pickling it alone raised."""

    path: str
    obj: Any
    error: BaseException


def _children(obj: Any, reduce: Callable[[Any], Any]) -> Iterator[tuple[str, Any]]:
    """(path suffix, child) pairs, named as a user would write them."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
    elif isinstance(obj, (set, frozenset)):
        for value in obj:
            yield f"{{{value!r:.40}}}", value
    elif isinstance(obj, torch.nn.Module) and type(obj).__reduce_ex__ is torch.nn.Module.__reduce_ex__:
        for name, value in vars(obj).items():
            if name in _MODULE_CONTAINERS and isinstance(value, dict):
                for key, child in value.items():
                    yield (f"[{key}]" if str(key).isdigit() else f".{key}"), child
            else:
                yield f".{name}", value
    elif not isinstance(obj, (type, torch.Tensor)):
        yield from _reduced_children(obj, reduce)


def _reduced_children(obj: Any, reduce: Callable[[Any], Any]) -> Iterator[tuple[str, Any]]:
    try:
        reduced = reduce(obj)
    except Exception:  # the object itself cannot be reduced: it has no children worth blaming
        return
    if not isinstance(reduced, tuple):
        return
    args = reduced[1] if len(reduced) > 1 else ()
    state = reduced[2] if len(reduced) > 2 else None
    items = reduced[3] if len(reduced) > 3 else None
    pairs = reduced[4] if len(reduced) > 4 else None
    if isinstance(args, tuple):
        for i, arg in enumerate(args):
            if arg is not type(obj):
                yield f"<arg {i}>", arg
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
        for part in state:
            if isinstance(part, dict):
                for key, value in part.items():
                    yield f".{key}", value
    elif isinstance(state, dict):
        for key, value in state.items():
            yield f".{key}", value
    elif state is not None:
        yield "<state>", state
    if items is not None:
        for i, value in enumerate(items):
            yield f"[{i}]", value
    if pairs is not None:
        for key, value in pairs:
            yield f"[{key!r}]", value


def _default_reduce(obj: Any) -> Any:
    return obj.__reduce_ex__(5)


def locate_failure(
    root: Any,
    try_dump: Callable[[Any], BaseException | None],
    root_name: str = "obj",
    reduce: Callable[[Any], Any] | None = None,
) -> Failure | None:
    """Find the deepest object of ``root``'s graph that fails to pickle on its own.

    Args:
        root: the object graph whose dump failed.
        try_dump: pickles one object with the failing configuration; returns the error, or None on success.
        root_name: how the path starts.
        reduce: how the pickler reduces an object (default ``obj.__reduce_ex__(5)``); an object whose reduction
            raises has no children, so a refusing reducer makes its object the culprit.

    Returns:
        The failure, or None if ``root`` pickles on its own after all.
    """
    error = try_dump(root)
    if error is None:
        return None
    node, path = root, root_name
    seen = {id(root)}
    while True:
        for suffix, child in _children(node, reduce or _default_reduce):
            if isinstance(child, _ATOMIC) or id(child) in seen:
                continue
            seen.add(id(child))
            child_error = try_dump(child)
            if child_error is not None:
                node, path, error = child, path + suffix, child_error
                break
        else:
            return Failure(path, node, error)


def paths_to(
    root: Any,
    targets: Iterable[object],
    root_name: str = "obj",
    reduce: Callable[[Any], Any] | None = None,
    limit: int = 100_000,
) -> dict[int, str]:
    """Where each of ``targets`` sits in ``root``'s graph: ``{id(target): path}``, the shortest path found
    breadth-first, for the targets reached within ``limit`` visited objects (a dump's report, not a walk that
    could take as long as the dump itself on a huge graph)."""
    wanted = {id(t) for t in targets}
    found: dict[int, str] = {}
    if id(root) in wanted:
        found[id(root)] = root_name
    queue: collections.deque[tuple[Any, str]] = collections.deque([(root, root_name)])
    seen = {id(root)}
    while queue and len(found) < len(wanted) and len(seen) < limit:
        node, path = queue.popleft()
        for suffix, child in _children(node, reduce or _default_reduce):
            if isinstance(child, _ATOMIC) or id(child) in seen:
                continue
            seen.add(id(child))
            if id(child) in wanted:
                found[id(child)] = path + suffix
            queue.append((child, path + suffix))
    return found
