"""The safe set's validating rebuilds of tensors, parameters and storages (torch's ``_rebuild_*`` functions and
this library's): each checks the exact type, size and range of every argument a stream chose
(:mod:`zerocopy_pickle.validate`) before it builds anything, and a view never covers more than
:data:`MAX_VIEW_RATIO` times its storage. ``safe_set`` maps the names streams use to them.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import types
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from .. import rebuild
from ..validate import (
    MAX_DIMS,
    charge,
    expect,
    expect_bool,
    expect_float,
    expect_int,
    expect_int_tuple,
    expect_optional,
    expect_str,
    fail,
)

MAX_VIEW_RATIO = 16
"""A tensor view may cover at most this many times the elements its storage holds ..."""
MAX_VIEW_ELEMENTS = 1 << 20
"""... or this many elements, whichever is larger. A stride-0 view of one element with 2**31 elements costs a
few bytes of stream and gigabytes when anything iterates or copies it; real checkpoints' broadcast views
(``position_ids`` expanded over a batch of 1) stay far inside the bound."""


# -- tensors ---------------------------------------------------------------------------------------------------


# Sub-byte dtypes pack several elements into each byte of their storage.
_PER_BYTE = {torch.quint4x2: 2, torch.quint2x4: 4}


@functools.cache
def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_view(
    where: str,
    storage_nbytes: int,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    ratio: int = MAX_VIEW_RATIO,
) -> None:
    """Refuse a strided view that reads outside its storage or is out of proportion to it.

    Raises:
        UnsafeArgumentError: the view needs more bytes than the storage has, or covers more than
            ``max(MAX_VIEW_RATIO * storage elements, MAX_VIEW_ELEMENTS)`` elements.
    """
    if len(size) != len(stride):
        fail(where, f"size has {len(size)} dimensions but stride has {len(stride)}")
    capacity = storage_nbytes * _PER_BYTE[dtype] if dtype in _PER_BYTE else storage_nbytes // _element_size(dtype)
    numel = math.prod(size)
    if numel == 0:
        if offset > capacity:
            fail(where, f"storage offset {offset} is past the storage's {capacity} elements")
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= capacity:
        fail(
            where,
            f"the view (offset {offset}, size {size}, stride {stride}) reaches element {last}, but the storage "
            f"holds {capacity} {dtype} elements",
        )
    if numel > max(ratio * capacity, MAX_VIEW_ELEMENTS):
        fail(
            where,
            f"the view covers {numel} elements of a {capacity}-element storage (more than {ratio}x and "
            f"more than {MAX_VIEW_ELEMENTS}): refused as a memory amplification",
        )


def _empty_hooks(hooks: Any, where: str) -> None:
    expect(hooks, (dict, collections.OrderedDict), where, "backward_hooks")
    if hooks:
        fail(where, "backward_hooks must be empty (hooks are code; they never travel in a restricted load)")


def _metadata(metadata: Any, where: str) -> dict[str, bool] | None:
    if metadata is None:
        return None
    expect(metadata, (dict, collections.OrderedDict), where, "metadata")
    for key, value in metadata.items():
        if key not in ("conj", "neg"):
            fail(where, f"metadata key {key!r:.40} is not 'conj' or 'neg'")
        expect_bool(value, where, f"metadata[{key!r}]")
    return dict(metadata)


def _shape(size: Any, stride: Any, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return expect_int_tuple(size, where, "size"), expect_int_tuple(stride, where, "stride")


def _requires_grad(flag: Any, dtype: torch.dtype, where: str) -> bool:
    expect_bool(flag, where, "requires_grad")
    if flag and not (dtype.is_floating_point or dtype.is_complex):
        fail(where, f"requires_grad=True on a {dtype} tensor")
    return bool(flag)


_UNTYPED = torch.UntypedStorage
_DTYPE = torch.dtype


def _exact_ints(values: tuple[Any, ...]) -> bool:
    for value in values:  # noqa: SIM110 - a loop is several times cheaper than all() over a generator here
        if type(value) is not int or value < 0:
            return False
    return True


def _set_view(
    where: str, storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: tuple[int, ...], stride: Any
) -> torch.Tensor:
    """A tensor over ``storage``; torch's ``set_`` checks that the view fits, this checks its proportion."""
    tensor = rebuild.empty_tensor(dtype, storage.device)
    try:
        tensor.set_(storage, offset, size, stride)
    except RuntimeError:
        check_view(where, storage.nbytes(), dtype, offset, size, stride)  # raises the precise error
        raise
    numel = tensor.numel()
    if numel > MAX_VIEW_ELEMENTS:
        check_view(where, storage.nbytes(), dtype, offset, size, stride)
    return tensor


def safe_rebuild_tensor(
    storage: Any, dtype: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any
) -> torch.Tensor:
    """:func:`zerocopy_pickle.rebuild.rebuild_tensor`, arguments checked (the hot path of a restricted load)."""
    if (
        type(storage) is not _UNTYPED
        or type(dtype) is not _DTYPE
        or type(storage_offset) is not int
        or storage_offset < 0
        or type(size) is not tuple
        or type(stride) is not tuple
        or len(size) != len(stride)
        or len(size) > MAX_DIMS
        or not _exact_ints(size)
        or not _exact_ints(stride)
    ):
        return _explain_dense("zerocopy_pickle.rebuild:rebuild_tensor", storage, dtype, storage_offset, size, stride)
    tensor = _set_view("zerocopy_pickle.rebuild:rebuild_tensor", storage, dtype, storage_offset, size, stride)
    if requires_grad is not False:
        tensor.requires_grad_(_requires_grad(requires_grad, dtype, "zerocopy_pickle.rebuild:rebuild_tensor"))
    return tensor


def _explain_dense(where: str, storage: Any, dtype: Any, offset: Any, size: Any, stride: Any) -> NoReturn:
    """Raise the precise error for arguments the fast checks refused."""
    if type(storage) is not _UNTYPED:
        fail(where, f"storage must be torch.UntypedStorage, not {type(storage).__qualname__}")
    expect(dtype, torch.dtype, where, "dtype")
    expect_int(offset, where, "storage_offset")
    size, stride = _shape(size, stride, where)
    check_view(where, storage.nbytes(), dtype, offset, size, stride)
    fail(where, "invalid tensor view")


def _typed(storage: Any, where: str) -> torch.storage.TypedStorage:
    if type(storage) is not torch.storage.TypedStorage:
        fail(where, f"storage must be torch.storage.TypedStorage, not {type(storage).__qualname__}")
    return storage


def _dense(
    where: str, storage: Any, dtype: torch.dtype, offset: Any, size: Any, stride: Any, requires_grad: Any
) -> torch.Tensor:
    untyped = storage._untyped_storage
    expect_int(offset, where, "storage_offset")
    size, stride = _shape(size, stride, where)
    if len(size) != len(stride):
        fail(where, f"size has {len(size)} dimensions but stride has {len(stride)}")
    tensor = _set_view(where, untyped, dtype, offset, size, stride)
    if _requires_grad(requires_grad, dtype, where):
        tensor.requires_grad_(True)
    return tensor


def safe_rebuild_tensor_v1(storage: Any, storage_offset: Any, size: Any, stride: Any) -> torch.Tensor:
    """``torch._utils._rebuild_tensor``, arguments checked."""
    where = "torch._utils:_rebuild_tensor"
    typed = _typed(storage, where)
    return _dense(where, typed, typed.dtype, storage_offset, size, stride, False)


def safe_rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2``, arguments checked; hooks must be empty."""
    where = "torch._utils:_rebuild_tensor_v2"
    typed = _typed(storage, where)
    _empty_hooks(backward_hooks, where)
    meta = _metadata(metadata, where)
    tensor = _dense(where, typed, typed.dtype, storage_offset, size, stride, requires_grad)
    if meta:
        torch._utils.set_tensor_metadata(tensor, meta)
    return tensor


def safe_rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v3``, arguments checked; hooks must be empty."""
    where = "torch._utils:_rebuild_tensor_v3"
    typed = _typed(storage, where)
    expect(dtype, torch.dtype, where, "dtype")
    _empty_hooks(backward_hooks, where)
    meta = _metadata(metadata, where)
    tensor = _dense(where, typed, dtype, storage_offset, size, stride, requires_grad)
    if meta:
        torch._utils.set_tensor_metadata(tensor, meta)
    return tensor


def safe_rebuild_meta_tensor_no_storage(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> torch.Tensor:
    """``torch._utils._rebuild_meta_tensor_no_storage``, arguments checked (meta tensors hold no memory)."""
    where = "torch._utils:_rebuild_meta_tensor_no_storage"
    expect(dtype, torch.dtype, where, "dtype")
    size, stride = _shape(size, stride, where)
    if len(size) != len(stride):
        fail(where, f"size has {len(size)} dimensions but stride has {len(stride)}")
    grad = _requires_grad(requires_grad, dtype, where)
    try:
        return torch.empty_strided(size, stride, dtype=dtype, device="meta", requires_grad=grad)
    except RuntimeError as e:  # a size whose product overflows int64
        fail(where, f"torch refused the meta tensor: {str(e)[:200]}")


_PER_TENSOR = (torch.per_tensor_affine,)
_QUANTIZED = (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4)
_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_affine_float_qparams)


def safe_rebuild_qtensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    quantizer_params: Any,
    requires_grad: Any,
    backward_hooks: Any,
) -> torch.Tensor:
    """``torch._utils._rebuild_qtensor``, arguments checked *before* torch allocates the (full-size) tensor."""
    where = "torch._utils:_rebuild_qtensor"
    typed = _typed(storage, where)
    _empty_hooks(backward_hooks, where)
    expect_int(storage_offset, where, "storage_offset")
    size, stride = _shape(size, stride, where)
    # torch allocates the whole quantized tensor before it swaps in the storage: no broadcast views here.
    check_view(where, typed._untyped_storage.nbytes(), typed.dtype, storage_offset, size, stride, ratio=1)
    expect_bool(requires_grad, where, "requires_grad")
    if requires_grad:
        fail(where, "quantized tensors cannot require grad")
    params = expect(quantizer_params, tuple, where, "quantizer_params")
    if not params or type(params[0]) is not torch.qscheme:
        fail(where, "quantizer_params must start with a torch.qscheme")
    if typed.dtype not in _QUANTIZED:
        fail(where, f"the storage's dtype {typed.dtype} is not a quantized dtype")
    if params[0] in _PER_TENSOR:
        if len(params) != 3:
            fail(where, "per-tensor quantizer_params must be (qscheme, scale, zero_point)")
        expect_float(expect(params[1], float, where, "scale"), where, "scale")
        expect_int(params[2], where, "zero_point", lo=-(1 << 31), hi=(1 << 31) - 1)
    elif params[0] in _PER_CHANNEL:
        if len(params) != 4:
            fail(where, "per-channel quantizer_params must be (qscheme, scales, zero_points, axis)")
        axis = expect_int(params[3], where, "axis", hi=max(len(size) - 1, 0))
        channels = size[axis] if size else 1
        for value, what, dtypes in (
            (params[1], "scales", (torch.float32, torch.float64)),
            (params[2], "zero_points", (torch.int32, torch.int64, torch.float32, torch.float64)),
        ):
            qparam = _index_tensor(value, where, what)
            if qparam.dtype not in dtypes or qparam.dim() != 1 or qparam.numel() != channels or qparam.is_meta:
                fail(where, f"{what} must be a 1-D tensor of {channels} {' or '.join(map(str, dtypes))} values")
            if qparam.device != typed.device:
                fail(where, f"{what} is on {qparam.device}, the storage on {typed.device}")
    else:
        fail(where, f"unknown qscheme {params[0]}")
    # The full-size allocation torch makes first is bounded by check_view above, and charged: a stream could
    # name the same storage over and over.
    charge(math.prod(size), where)
    try:
        tensor: torch.Tensor = torch._utils._rebuild_qtensor(
            typed, storage_offset, size, stride, params, requires_grad, collections.OrderedDict()
        )
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        fail(where, f"the quantized tensor does not rebuild (torch refused it): {str(e)[:300]}")
    return tensor


def _index_tensor(value: Any, where: str, what: str) -> torch.Tensor:
    if type(value) is not torch.Tensor:
        fail(where, f"{what} must be torch.Tensor, not {type(value).__qualname__}")
    if value.layout is not torch.strided:
        fail(where, f"{what} must be a strided tensor, not {value.layout}")
    return value


def _private(
    value: Any, where: str, what: str, dtypes: tuple[torch.dtype, ...], dim: int | None = None
) -> torch.Tensor:
    """A private, contiguous copy of an index or metadata tensor, checked (exact type, strided, dtype, dimensions,
    holding data), and charged to the load's budget before it is made.

    The tensor a stream passes is usually a view of a mapped file, and a ``MAP_PRIVATE`` mapping still shows later
    writes to the file on every page this process has not written: indices checked in place could be rewritten
    out of bounds a moment after the check, and ``to_dense()`` would then write out of bounds. The check reads the
    copy, and the sparse or nested tensor is built over the copy, so what was checked is what the kernels read."""
    tensor = _index_tensor(value, where, what)
    if tensor.dtype not in dtypes:
        fail(where, f"{what} has dtype {tensor.dtype}, not {' or '.join(map(str, dtypes))}")
    if dim is not None and tensor.dim() != dim:
        fail(where, f"{what} has {tensor.dim()} dimensions, not {dim}")
    if tensor.is_meta:
        fail(where, f"{what} is a meta tensor: it holds no values to check")
    charge(tensor.numel(), where)
    return tensor.detach().clone(memory_format=torch.contiguous_format)


_INDEX_DTYPES = (torch.int32, torch.int64)


def safe_rebuild_sparse_tensor(layout: Any, data: Any) -> torch.Tensor:
    """``torch._utils._rebuild_sparse_tensor`` with its invariants checked at once (torch checks them only
    after ``torch.load`` returns; out-of-bounds indices read out of bounds later), on private copies of the
    indices (:func:`_private`; the values stay views: no later write to them reaches outside the tensor)."""
    where = "torch._utils:_rebuild_sparse_tensor"
    expect(layout, torch.layout, where, "layout")
    data = expect(data, tuple, where, "data")
    if layout == torch.sparse_coo:
        if len(data) not in (3, 4):
            fail(where, "COO data must be (indices, values, size[, is_coalesced])")
        _index_tensor(data[0], where, "indices")
        values = _index_tensor(data[1], where, "values")
        size = expect_int_tuple(data[2], where, "size")
        coalesced = expect_optional(data[3], bool, where, "is_coalesced") if len(data) == 4 else None
        charge(values.numel(), where)
        indices = _private(data[0], where, "indices", (torch.int64,), dim=2)
        try:
            return torch.sparse_coo_tensor(indices, values, size, check_invariants=True, is_coalesced=coalesced)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            fail(where, f"the COO tensor does not rebuild (torch refused it): {str(e)[:300]}")
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        if len(data) != 4:
            fail(where, "compressed data must be (compressed_indices, plain_indices, values, size)")
        _index_tensor(data[0], where, "compressed_indices")
        _index_tensor(data[1], where, "plain_indices")
        values = _index_tensor(data[2], where, "values")
        size = expect_int_tuple(data[3], where, "size")
        if data[0].dtype is not data[1].dtype:
            fail(where, f"compressed_indices ({data[0].dtype}) and plain_indices ({data[1].dtype}) differ in dtype")
        charge(values.numel(), where)
        compressed = _private(data[0], where, "compressed_indices", _INDEX_DTYPES)
        plain = _private(data[1], where, "plain_indices", _INDEX_DTYPES)
        try:
            return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout, check_invariants=True)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            fail(where, f"the compressed sparse tensor does not rebuild (torch refused it): {str(e)[:300]}")
    return fail(where, f"unknown sparse layout {layout}")


_MAX_NESTED_BUFFER = 1 << 56
"""Most elements a nested tensor's buffer may have: with at most 64 dimensions, no sum of a component's offset and
its ``(size - 1) * stride`` terms (each checked to stay below the buffer) can overflow int64."""


def safe_rebuild_nested_tensor(buffer: Any, sizes: Any, strides: Any, storage_offsets: Any) -> torch.Tensor:
    """``torch._utils._rebuild_nested_tensor``, with every component checked to lie inside the buffer, on private
    copies of ``sizes``, ``strides`` and ``storage_offsets`` (:func:`_private`: the nested tensor keeps the copies,
    so a later write to the file cannot move a component outside the buffer); the buffer stays a view."""
    where = "torch._utils:_rebuild_nested_tensor"
    buffer = _index_tensor(buffer, where, "buffer")
    for value, what in ((sizes, "sizes"), (strides, "strides"), (storage_offsets, "storage_offsets")):
        _index_tensor(value, where, what)
    if buffer.dim() != 1 or not buffer.is_contiguous():
        fail(where, "buffer must be a contiguous 1-D tensor")
    if buffer.is_meta:
        fail(where, "buffer is a meta tensor")
    numel = buffer.numel()
    if numel > _MAX_NESTED_BUFFER:
        fail(where, f"buffer has {numel} elements (at most {_MAX_NESTED_BUFFER})")
    sizes = _private(sizes, where, "sizes", (torch.int64,), dim=2)
    strides = _private(strides, where, "strides", (torch.int64,), dim=2)
    offsets = _private(storage_offsets, where, "storage_offsets", (torch.int64,), dim=1)
    if sizes.device.type != "cpu" or strides.device.type != "cpu" or offsets.device.type != "cpu":
        fail(where, "sizes, strides and storage_offsets must be CPU tensors")
    if strides.shape != sizes.shape or offsets.shape != sizes.shape[:1]:
        fail(where, "sizes and strides must be (n, d) tensors and storage_offsets an (n,) tensor")
    if sizes.shape[1] > MAX_DIMS:
        fail(where, f"components have {sizes.shape[1]} dimensions (at most {MAX_DIMS})")
    if bool((sizes < 0).any()) or bool((strides < 0).any()) or bool((offsets < 0).any()):
        fail(where, "sizes, strides and storage_offsets must not be negative")
    if sizes.shape[0]:
        filled = ~(sizes == 0).any(dim=1)  # components with at least one element
        if bool(filled.any()):
            # Each term (size - 1) * stride of a filled component must stay below the buffer: checked as
            # size - 1 <= (numel - 1) // stride, which cannot overflow, before any product is formed.
            limit = max(numel - 1, 0) // strides.clamp(min=1)
            beyond = ((sizes - 1 > limit) & (strides > 0)).any(dim=1) | (offsets >= numel)
            if numel == 0 or bool((beyond & filled).any()):
                fail(where, f"a component reaches past the buffer's {numel} elements")
            terms = torch.where(filled.unsqueeze(1), sizes - 1, 0).clamp(min=0) * strides
            last = offsets + terms.sum(dim=1)
            if bool(((last >= numel) & filled).any()):
                fail(where, f"a component reaches past the buffer's {numel} elements")
    try:
        return torch._nested_view_from_buffer(buffer, sizes, strides, offsets)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        fail(where, f"the nested tensor does not rebuild (torch refused it): {str(e)[:300]}")


_TENSOR_META = type(torch.Tensor)


def safe_rebuild_wrapper_subclass(
    cls: Any,
    dtype: Any,
    size: Any,
    stride: Any,
    storage_offset: Any,
    layout: Any,
    device: Any,
    requires_grad: Any,
) -> torch.Tensor:
    """``torch._utils._rebuild_wrapper_subclass``: an empty wrapper tensor subclass (one that holds no storage of its
    own; its ``__dict__``, restored by ``_rebuild_from_type_v2``, holds the data).

    ``cls`` must be a tensor subclass with its own ``__torch_dispatch__``, and it is a class the load resolved: the
    caller allowed it (``allow=[cls]``), as ``torch.serialization.add_safe_globals`` must list it for ``torch.load``.
    Nothing is allocated; ``device`` is kept as recorded (a wrapper holds no memory to move)."""
    where = "torch._utils:_rebuild_wrapper_subclass"
    if type(cls) is not _TENSOR_META or torch.Tensor not in cls.__mro__ or cls is torch.Tensor:
        fail(where, f"cls must be a tensor subclass, not {type(cls).__qualname__}")
    if cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        fail(where, f"{cls.__qualname__} is not a wrapper tensor subclass (it has no __torch_dispatch__ of its own)")
    expect(dtype, torch.dtype, where, "dtype")
    size, stride = _shape(size, stride, where)
    if len(size) != len(stride) or len(size) > MAX_DIMS:
        fail(where, f"size has {len(size)} dimensions but stride has {len(stride)}")
    expect_int(storage_offset, where, "storage_offset")
    expect(layout, torch.layout, where, "layout")
    if layout is not torch.strided:
        fail(where, f"layout must be torch.strided, not {layout}")
    expect(device, torch.device, where, "device")
    grad = _requires_grad(requires_grad, dtype, where)
    try:
        wrapper: torch.Tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            size,
            strides=stride,
            dtype=dtype,
            storage_offset=storage_offset,
            layout=layout,
            device=device,
            requires_grad=grad,
        )
        return wrapper
    except RuntimeError as e:
        fail(where, f"torch refused the wrapper: {e}")


def safe_rebuild_memory_format(name: Any) -> torch.memory_format:
    """:func:`zerocopy_pickle.rebuild.rebuild_memory_format`: a memory format by name, from a fixed table."""
    where = "zerocopy_pickle.rebuild:rebuild_memory_format"
    charge(len(expect_str(name, where, "name", max_len=64)), where)
    try:
        return rebuild.MEMORY_FORMATS[name]
    except KeyError:
        fail(where, f"{name!r:.60} is not a torch memory format")


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


# -- storages (this library's) -----------------------------------------------------------------------------------


def safe_rebuild_typed_storage(storage: Any, dtype: Any) -> torch.storage.TypedStorage:
    """:func:`zerocopy_pickle.rebuild.rebuild_typed_storage`, arguments checked."""
    where = "zerocopy_pickle.rebuild:rebuild_typed_storage"
    if type(storage) is not torch.UntypedStorage:
        fail(where, f"storage must be torch.UntypedStorage, not {type(storage).__qualname__}")
    expect(dtype, torch.dtype, where, "dtype")
    return rebuild.rebuild_typed_storage(storage, dtype)


def safe_rebuild_meta_storage(nbytes: Any) -> torch.UntypedStorage:
    """:func:`zerocopy_pickle.rebuild.rebuild_meta_storage`, arguments checked (meta storages hold no memory)."""
    return rebuild.rebuild_meta_storage(expect_int(nbytes, "zerocopy_pickle.rebuild:rebuild_meta_storage", "nbytes"))


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
