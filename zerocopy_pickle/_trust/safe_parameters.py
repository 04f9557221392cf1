"""Internal: the safe set's validating rebuilds that wrap a tensor another rebuild made: parameters
(``torch.nn.Parameter``, torch's ``_rebuild_parameter`` and ``_rebuild_parameter_with_state``) and tensor
subclasses (``_rebuild_from_type_v2``, which calls only the tensor rebuilders of ``safe_tensors``,
``safe_composite`` and this module, never any other callable). Hooks must be empty, and a state sets plain
attributes only.
"""

from __future__ import annotations

import collections
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from ..validate import charge, expect, fail
from .safe_composite import safe_rebuild_nested_tensor, safe_rebuild_qtensor, safe_rebuild_sparse_tensor
from .safe_tensors import (
    _empty_hooks,
    _requires_grad,
    safe_rebuild_meta_tensor_no_storage,
    safe_rebuild_tensor,
    safe_rebuild_tensor_v1,
    safe_rebuild_tensor_v2,
    safe_rebuild_tensor_v3,
    safe_rebuild_wrapper_subclass,
)

_HOOK_ATTRIBUTES = frozenset({"_backward_hooks", "_post_accumulate_grad_hooks", "grad_fn", "_grad_fn"})


def _state_dicts(state: Any, where: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    if type(state) is tuple:
        if len(state) != 2:
            fail(where, "state must be a dict or a (dict, slots) pair")
        parts = state
    else:
        parts = (state, None)
    out: list[dict[str, Any] | None] = []
    for part in parts:
        if part is None:
            out.append(None)
            continue
        expect(part, (dict, collections.OrderedDict), where, "state")
        charge(len(part), where)
        for key in part:
            if type(key) is not str or key.startswith("__") or key in _HOOK_ATTRIBUTES:
                fail(where, f"state key {key!r:.60} is not a plain attribute name")
        out.append(part)
    return out[0], out[1]


def _set_state(obj: Any, state: Any, where: str) -> Any:
    dict_state, slots_state = _state_dicts(state, where)
    for part in (dict_state, slots_state):
        if part:
            for key, value in part.items():
                setattr(obj, key, value)
    return obj


def _parameter(data: Any, requires_grad: Any, where: str) -> torch.nn.Parameter:
    if type(data) is not torch.Tensor:
        fail(where, f"data must be torch.Tensor, not {type(data).__qualname__}")
    return torch.nn.Parameter(data, _requires_grad(requires_grad, data.dtype, where))


def safe_rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> torch.nn.Parameter:
    """``torch._utils._rebuild_parameter``, arguments checked; hooks must be empty."""
    where = "torch._utils:_rebuild_parameter"
    _empty_hooks(backward_hooks, where)
    return _parameter(data, requires_grad, where)


def safe_rebuild_parameter_with_state(
    data: Any, requires_grad: Any, backward_hooks: Any, state: Any
) -> torch.nn.Parameter:
    """``torch._utils._rebuild_parameter_with_state``: hooks must be empty; state sets plain attributes only."""
    where = "torch._utils:_rebuild_parameter_with_state"
    _empty_hooks(backward_hooks, where)
    _state_dicts(state, where)
    return _set_state(_parameter(data, requires_grad, where), state, where)  # type: ignore[no-any-return]


def safe_parameter(data: Any = None, requires_grad: Any = True) -> torch.nn.Parameter:
    """``torch.nn.Parameter(data, requires_grad)``, arguments checked."""
    where = "torch.nn.parameter:Parameter"
    if data is None:
        fail(where, "data must be a tensor")
    return _parameter(data, requires_grad, where)


@functools.cache
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    """The signature of one of this table's rebuilders (cached: computing one costs tens of microseconds)."""
    return inspect.signature(func)


def safe_rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> torch.Tensor:
    """``torch._tensor._rebuild_from_type_v2``: ``func`` must be one of this table's tensor rebuilders (never any
    other callable); ``new_type`` a tensor class the load resolved (the safe set's or the caller's)."""
    where = "torch._tensor:_rebuild_from_type_v2"
    if type(func) is not types.FunctionType or func not in _TENSOR_REBUILDERS:
        fail(where, f"func must be one of the safe tensor rebuild functions, not {type(func).__qualname__}")
    if type(new_type) is not type and not isinstance(new_type, type):
        fail(where, f"new_type must be a class, not {type(new_type).__qualname__}")
    if not issubclass(new_type, torch.Tensor):
        fail(where, f"new_type {new_type.__qualname__} is not a tensor class")
    expect(args, tuple, where, "args")
    if len(args) > 8:  # every rebuilder takes at most 8 arguments
        fail(where, f"args has {len(args)} entries (at most 8)")
    try:
        _signature(func).bind(*args)
    except TypeError as e:
        fail(where, f"args do not fit {func.__name__}: {e}")
    result = func(*args)
    if type(result) is not new_type:
        result = result.as_subclass(new_type)
    setstate = getattr(new_type, "__setstate__", torch.Tensor.__setstate__)
    if setstate is not torch.Tensor.__setstate__:
        # A tensor subclass the caller allowed, with its own __setstate__: the caller's code, by their choice.
        result.__setstate__(state)
        return result  # type: ignore[no-any-return]
    if state is None:
        return result  # type: ignore[no-any-return]
    return _set_state(result, state, where)  # type: ignore[no-any-return]


# The rebuilders safe_rebuild_from_type_v2 accepts as its ``func``: a stream can name only these.
_TENSOR_REBUILDERS: frozenset[Callable[..., Any]] = frozenset(
    {
        safe_rebuild_tensor,
        safe_rebuild_tensor_v1,
        safe_rebuild_tensor_v2,
        safe_rebuild_tensor_v3,
        safe_rebuild_parameter,
        safe_rebuild_parameter_with_state,
        safe_rebuild_qtensor,
        safe_rebuild_sparse_tensor,
        safe_rebuild_nested_tensor,
        safe_rebuild_meta_tensor_no_storage,
        safe_rebuild_wrapper_subclass,
    }
)
