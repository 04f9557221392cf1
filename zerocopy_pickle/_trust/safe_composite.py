"""Internal: the safe set's validating rebuilds of quantized, sparse and nested tensors (torch's
``_rebuild_qtensor``, ``_rebuild_sparse_tensor`` and ``_rebuild_nested_tensor``): the tensors built from other
tensors a stream passes (scales and zero points, indices, components' sizes, strides and offsets). Every argument
is checked (:mod:`zerocopy_pickle.validate`, and the view checks of ``safe_tensors``) before torch builds
anything, and index tensors are checked on private copies, so that what was checked is what the kernels read.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from ..validate import (
    MAX_DIMS,
    charge,
    expect,
    expect_bool,
    expect_float,
    expect_int,
    expect_int_tuple,
    expect_optional,
    fail,
)
from .safe_tensors import _empty_hooks, _shape, _typed, check_view

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
