"""Internal: the safe set's validating rebuilds of strided tensors and of storages (torch's ``_rebuild_tensor``
functions, ``_rebuild_meta_tensor_no_storage`` and ``_rebuild_wrapper_subclass``, and this library's), and the
checks every tensor rebuild shares: each checks the exact type, size and range of every argument a stream chose
(:mod:`zerocopy_pickle.validate`) before it builds anything, and a view never covers more than
:data:`MAX_VIEW_RATIO` times its storage. Quantized, sparse and nested tensors are rebuilt in ``safe_composite``,
parameters and tensor subclasses in ``safe_parameters``; ``safe_set`` maps the names streams use to them all.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, NoReturn

import torch

from .. import rebuild
from ..validate import (
    MAX_DIMS,
    charge,
    expect,
    expect_bool,
    expect_int,
    expect_int_tuple,
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
