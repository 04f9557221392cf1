"""bitsandbytes: 4-bit and 8-bit quantized parameters and the linear layers that hold them.

Plain pickle gets these wrong or refuses them:

* ``Params4bit`` keeps its quantization statistics in a ``QuantState`` attribute. torch's ``Parameter`` reducer
  rebuilds a plain ``Parameter`` (the subclass and its state are lost), and pickling the ``QuantState`` by
  ``__dict__`` ties the snapshot to bitsandbytes' private attribute layout. This quirk reduces a quantized
  ``Params4bit`` to its packed data plus ``quant_state.as_dict(packed=True)`` (bitsandbytes' own serialization
  format, the one its ``state_dict`` uses) and rebuilds it with ``Params4bit.from_prequantized`` on the device the
  data was loaded to. Every tensor of the record (the packed weight, ``absmax``, the quant maps, the packed blob of
  non-tensor fields) goes through the pickler, so the weight stays zero-copy: a view into the snapshot's mapping.
* ``Int8Params`` keeps ``CB`` (the int8 rows, sharing the weight's storage) and ``SCB`` (the row scales) as
  attributes; they are rebuilt with the constructor, storages shared as they were.
* ``Linear4bit`` and ``Linear8bitLt`` (and their subclasses) are reduced as ordinary modules with three
  corrections: ``Linear4bit.quant_state`` is relinked to the weight's own ``QuantState`` when it was the same
  object; ``Linear8bitLt``'s load-state-dict pre-hook (a torch ``_WrappedHook`` around bitsandbytes'
  ``maybe_rearrange_weight``) is re-registered at load instead of being pickled; and what accelerate put on the
  instance (``_hf_hook``, ``_old_forward``, the hooked ``forward``, ``dispatch_model``'s ``to``/``cuda`` warning
  wrappers) is left out of the snapshot. An ``AlignDevicesHook`` that offloads nothing is attached again after
  loading, with the same settings; any other accelerate hook makes the dump fail with an error that says how to
  remove it. The ``to``/``cuda`` wrappers are not re-created: they only log a warning (their error case, offloaded
  weights, is refused at dump time).

CPU inference packs a ``Linear4bit`` weight into a CPU-specific layout on its first forward pass (bitsandbytes
``_convert_weight_packed_for_cpu``: the weight is re-tiled, ``absmax`` is dequantized to bfloat16 and the nested
statistics are dropped). Converting back is lossy for nested statistics, so the quirk never converts: it records
the packed layout as it is, with the few attributes bitsandbytes adds to the ``QuantState`` for it, and the loaded
layer computes bit for bit what the original computes. A CPU-packed weight loaded onto another device is unpacked
there with bitsandbytes' own inverse, as ``Params4bit.cuda()`` does.

Nothing here imports bitsandbytes or accelerate at registration: reducers are registered by type name, run only on
objects of those libraries (so the library is already imported), and the rebuild functions import it on first use.
Restricted loads accept the rebuild functions and state setters below, and nothing else of this quirk: each is a
plain function that checks the exact type, range and size of every argument before it imports or builds anything
(``zerocopy_pickle.validate``; a bad one raises ``UnsafeArgumentError``). No class is declared safe: the layer
classes' constructors allocate a weight of whatever size they are given, and a class would be open to NEWOBJ and
BUILD. bitsandbytes' own classes (``Params4bit``, ``Int8Params``, the layers) travel as names from fixed tables
that the rebuild functions map to the class; a subclass travels as a class object, which a restricted load accepts
only through ``allow=`` and which must still derive from the class the rebuild builds. ``QuantState`` is built
field by field from the checked ``as_dict(packed=True)`` record (its JSON blob decoded here, at most 4 KiB), never
through ``QuantState.from_dict``, which resolves the dtype with ``getattr(torch, <string from the stream>)``; the
shape must fit the blocks ``absmax`` covers and the 4-bit values the data holds, the data and every statistic
must be dense (contiguous: bitsandbytes' kernels read them from their data pointer), and in the CPU layout
``absmax`` and the data must have exactly the shapes that layout gives an ``(N, K)`` weight. ``MatmulLtState``
(``Linear8bitLt.state``) is reduced to its known fields and rebuilt from them. Snapshots written before these
rules that name ``Params4bit``/``Int8Params``/``MatmulLtState`` as classes load with ``trusted=True`` (or
``allow=``).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import sys
from collections import OrderedDict
from typing import Any

import torch

from zerocopy_pickle.plugin import PluginError, Registrar, SnapshotError, Unpicklable, validate

fail = validate.fail

# The rebuild functions and state setters below are named by every snapshot that used this quirk
# (``zerocopy_pickle_quirks.bnb:<name>``): never rename or move one, nor change the meaning of its arguments.
__all__ = [
    "BitsandbytesNotImported",
    "import_bitsandbytes",
    "rebuild_bnb_module",
    "rebuild_int8params",
    "rebuild_matmul_lt_state",
    "rebuild_params4bit",
    "rebuild_quant_state",
    "reduce_bnb_module",
    "reduce_int8params",
    "reduce_matmul_lt_state",
    "reduce_params4bit",
    "reduce_quant_state",
    "register",
    "set_bnb_module_state",
    "set_param_state",
]

_NN = "bitsandbytes.nn.modules"
PARAMS4BIT = f"{_NN}:Params4bit"
INT8PARAMS = f"{_NN}:Int8Params"
QUANT_STATE = "bitsandbytes.functional:QuantState"
MATMUL_LT_STATE = "bitsandbytes.autograd._functions:MatmulLtState"

# The layer classes a stream may name by string (rebuild_bnb_module); other subclasses of the two bases travel as
# class objects, which a restricted load accepts only through allow=.
_MODULE_CLASSES = ("Linear4bit", "LinearFP4", "LinearNF4", "Linear8bitLt")
_MODULE_BASES = ("Linear4bit", "Linear8bitLt")

# QuantState's own attributes; as_dict(packed=True) carries all of them.
_QUANT_STATE_FIELDS = frozenset(
    {"absmax", "shape", "code", "dtype", "blocksize", "quant_type", "offset", "state2", "nested"}
)
# What bitsandbytes' _convert_weight_packed_for_cpu adds to a QuantState (as_dict does not carry them).
_CPU_PACKING_FIELDS = (
    "packing_format_for_cpu",
    "original_dtype",
    "original_nested",
    "original_qshape",
    "original_storage_type",
)
# A CPU-packed state whose statistics were nested has had its ``state2`` attribute deleted (not set to None), and
# keeps its ``offset`` tensor, which as_dict does not carry once ``nested`` is False.
_NO_STATE2 = "state2_deleted"
_STALE_OFFSET = "offset"

# Params4bit's own attributes besides quant_state and module, restored as they were (from_prequantized derives
# them from the quant state, which disagrees for a CPU-packed one: it says nested=False, quant_storage=uint8).
_PARAMS4BIT_FIELDS = ("blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized")
_INT8PARAMS_FIELDS = ("CB", "SCB", "has_fp16_weights")
# What set_param_state never replaces: the attributes the rebuild functions checked against the data.
_PARAM_RESERVED = frozenset((*_PARAMS4BIT_FIELDS, *_INT8PARAMS_FIELDS, "quant_state", "module", "data"))

# Instance attributes accelerate adds (accelerate.hooks._accelerate_added_attributes, plus the hook itself).
_ACCELERATE_DEVICE_METHODS = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa", "neuron")
_ALIGN_DEVICES_HOOK = "accelerate.hooks:AlignDevicesHook"
_SEQUENTIAL_HOOK = "accelerate.hooks:SequentialHook"
_HOOK_SPEC_KEYS = frozenset({"execution_device", "io_same_device", "offload_buffers", "place_submodules", "skip_keys"})


def _type_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_NOT_IMPORTED = (
    "this snapshot holds bitsandbytes objects, and this process has not imported bitsandbytes: a restricted load "
    "never imports a library because a snapshot names it (importing bitsandbytes loads about 1,400 modules and its "
    "native library, and registers torch operators). Run `import bitsandbytes` before loading it (or load it with "
    "trusted=True, which imports bitsandbytes first)"
)


class BitsandbytesNotImported(PluginError, SnapshotError):
    """A rebuild function of this quirk ran before the program imported bitsandbytes (a restricted load never
    imports it). A ``PluginError`` (what is missing, and what to do), and a ``SnapshotError`` like every failure of
    a function a restricted load calls."""


def _bnb(name: str) -> Any:
    """A module of bitsandbytes, which this process has already imported (its submodules come with it): the rebuild
    functions run in restricted loads, where a hostile header alone must not make the process import a library.
    A trusted load imports it first (:func:`import_bitsandbytes`, the load hook).

    Raises:
        BitsandbytesNotImported: bitsandbytes is not imported; the message says what to do.
    """
    if "bitsandbytes" not in sys.modules:
        raise BitsandbytesNotImported(_NOT_IMPORTED, plugin="bitsandbytes", package="bitsandbytes")
    return importlib.import_module(name)


def _bnb_nn() -> Any:
    return _bnb(_NN)


def _bnb_functional() -> Any:
    return _bnb("bitsandbytes.functional")


def import_bitsandbytes() -> None:
    """The load hook (trusted loads only): import bitsandbytes, which the rebuild functions need."""
    importlib.import_module("bitsandbytes")


def _class_arg(cls: object, names: tuple[str, ...], base: str, where: str) -> Any:
    """The class a rebuild builds: a name from ``names`` (a class of ``bitsandbytes.nn.modules``, what the reducers
    write for bitsandbytes' own classes), or a class object (a subclass, which only the caller's ``allow=`` lets a
    restricted load name) deriving from ``bitsandbytes.nn.modules.<base>``. Checked before importing anything."""
    if type(cls) is str:
        validate.expect_choice(cls, names, where, "class name")
        return getattr(_bnb_nn(), cls)
    if type(cls) is not type:
        fail(where, f"the class must be a name from {list(names)} or a class, not {type(cls).__qualname__}")
    return validate.expect_class(cls, getattr(_bnb_nn(), base), where, "the class")


def _class_ref(cls: type, names: tuple[str, ...]) -> str | type:
    """What a reducer writes for ``cls``: its name when it is one of bitsandbytes' own (no class object in the
    stream: restricted loads need no allow=), else the class itself."""
    return cls.__qualname__ if cls.__module__ == _NN and cls.__qualname__ in names else cls


def _check_new_attribute(cls: type, name: object, where: str) -> str:
    """An attribute name a rebuild may set: a plain identifier that shadows nothing of the class (so a stream
    cannot replace ``data``, ``grad``, a property or a method through the state setter)."""
    validate.expect_str(name, where, "attribute name", max_len=256)
    assert isinstance(name, str)
    if not name.isidentifier() or name.startswith("__") or hasattr(cls, name):
        fail(where, f"refusing to set attribute {name[:80]!r} on a {cls.__name__}")
    return name


def _type_has(obj: object, base: type) -> bool:
    """Whether ``base`` is in the MRO of ``obj``'s real type (``isinstance`` would ask ``obj.__class__``)."""
    return base in type(obj).__mro__


# -- QuantState ------------------------------------------------------------------------------------------------

_QUANT_TYPES = ("nf4", "fp4")
_PACKED_KEYS = tuple(f"quant_state.bitsandbytes__{q}" for q in _QUANT_TYPES)
_TENSOR_STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_PLAIN_STATS = ("quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset")
_STATS_KEYS = frozenset((*_TENSOR_STATS, *_PLAIN_STATS, *_PACKED_KEYS))
_MAX_BLOB = 4096  # the packed JSON of the non-tensor fields is about 150 bytes
_MAX_BLOCKSIZE = 1 << 16
# What bitsandbytes 0.50's kernels read (backends/cpu, cuda and default ops.py; functional.py):
_CODE_4BIT = 16  # the 4-bit quantization map (quant_map), float32: the CUDA gemv indexes it by a nibble
_CODE_8BIT = 256  # the nested 8-bit map (nested_quant_map), float32: indexed by a byte
_BLOCKSIZES_4BIT = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # dequantize_4bit, gemv_4bit, gemm_4bit
_NESTED_BLOCKSIZE = 256  # matmul_4bit implements nested statistics only in blocks of 256; the fused kernels assume it
_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # dequantize_4bit's output dtypes
# Params4bit.quant_storage: the dtype the packed bytes are stored as (transformers' bnb_4bit_quant_storage choices).
_QUANT_STORAGE = (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CPU_BLOCK_N = 32  # rows per tile of the CPU layout (_convert_weight_packed_for_cpu's block_n)


def _quant_state_record(quant_state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(quant_state.as_dict(packed=True), CPU-packing attributes)``, reading ``quant_state`` only."""
    fields = vars(quant_state)
    unknown = sorted(set(fields) - _QUANT_STATE_FIELDS - set(_CPU_PACKING_FIELDS))
    if unknown:
        # A bitsandbytes release added state this quirk does not know how to carry: failing is better than a
        # snapshot that silently computes something else.
        raise Unpicklable(
            f"zerocopy_pickle's bitsandbytes quirk does not know the QuantState attribute(s) {unknown}; "
            f"this bitsandbytes version is not supported yet"
        )
    layout = {name: fields[name] for name in _CPU_PACKING_FIELDS if name in fields}
    if "state2" not in fields:
        layout[_NO_STATE2] = True
    if not quant_state.nested and fields.get("offset") is not None:
        layout[_STALE_OFFSET] = fields["offset"]
    # as_dict(packed=True) reads the state without changing it: tensors (absmax, quant maps) as they are, the
    # nested quant map as a copy, and the non-tensor fields JSON-encoded into a uint8 tensor. All are tensors,
    # so all go out of band.
    return quant_state.as_dict(packed=True), layout


def _plain_stats(stats: dict[str, Any], where: str) -> dict[str, Any]:
    """The non-tensor fields of a packed record: from its JSON blob (a 1-D ``uint8`` tensor of at most
    ``_MAX_BLOB`` bytes, decoded here, never by bitsandbytes), or given as plain entries."""
    blobs = [key for key in _PACKED_KEYS if key in stats]
    if len(blobs) > 1:
        fail(where, f"the statistics hold {len(blobs)} packed blobs")
    plain = {key: stats[key] for key in _PLAIN_STATS if key in stats}
    if blobs:
        blob = validate.expect_tensor(stats[blobs[0]], where, blobs[0], dtype=torch.uint8, dim=1)
        if blob.numel() > _MAX_BLOB or blob.device.type == "meta":
            fail(where, f"{blobs[0]} is {blob.numel()} bytes on {blob.device} (at most {_MAX_BLOB}, with data)")
        try:
            decoded = json.loads(bytes(blob.cpu().contiguous().numpy().tobytes()).decode("utf-8"))
        except (ValueError, RecursionError) as e:
            fail(where, f"{blobs[0]} is not JSON: {e}")
        validate.expect_keys(decoded, frozenset(_PLAIN_STATS), where, blobs[0])
        if plain:
            fail(where, f"the statistics hold both a packed blob and the entries {sorted(plain)}")
        plain = decoded
        if plain.get("quant_type") != blobs[0].rpartition("__")[2]:
            fail(where, f"{blobs[0]} does not match its quant_type")
    return plain


def _shape_of(value: object, where: str) -> torch.Size:
    if type(value) is list:  # JSON has no tuples
        value = tuple(value)
    return torch.Size(validate.expect_int_tuple(value, where, "shape"))


def _quant_state_from_record(stats: object, layout: object, where: str) -> Any:
    """A ``QuantState`` built from a checked ``as_dict(packed=True)`` record, field by field (never through
    ``QuantState.from_dict``, which resolves the dtype with ``getattr(torch, <string>)``), on the device its
    ``absmax`` was loaded to. Every check runs before bitsandbytes is touched.

    The checks are exactly what bitsandbytes 0.50's kernels read (``backends/{cpu,cuda,default}/ops.py``), since
    they read every statistic from its data pointer without looking at its size: for a weight of ``n`` values in
    blocks of ``blocksize`` (one of the sizes the 4-bit kernels accept), ``absmax`` holds exactly
    ``ceil(n / blocksize)`` entries (float32; uint8 when nested), ``quant_map`` exactly 16 float32 (the 4-bit
    code the CUDA gemv reads by index); nested statistics hold ``ceil(blocks / 256)`` float32 ``nested_absmax``
    entries and a 256-entry float32 ``nested_quant_map`` (indexed by a byte), blocksize 256 (the only one the
    fused kernels implement) and dtype float32. Every tensor is dense."""
    record = validate.expect_keys(stats, _STATS_KEYS, where, "quantization statistics")
    checked_layout = _check_layout(layout, where)
    packed_for_cpu = checked_layout.get("packing_format_for_cpu") is True
    absmax = _dense(record.get("absmax"), where, "absmax", dim=2 if packed_for_cpu else 1)
    code = _dense(record.get("quant_map"), where, "quant_map", dim=1, dtype=torch.float32, numel=_CODE_4BIT)
    plain = _plain_stats(record, where)
    quant_type = validate.expect_choice(plain.get("quant_type"), _QUANT_TYPES, where, "quant_type")
    blocksize = _blocksize(plain.get("blocksize"), _BLOCKSIZES_4BIT, where, "blocksize")
    dtype = validate.dtype_from_name(plain.get("dtype"), where)
    shape = _shape_of(plain.get("shape"), where)
    if not shape:
        fail(where, "shape must have at least one dimension")
    blocks = -(-math.prod(shape) // blocksize)
    nested_keys: list[str] = [key for key in ("nested_absmax", "nested_quant_map") if key in record]
    nested_keys += [key for key in ("nested_blocksize", "nested_dtype", "nested_offset") if key in plain]
    if packed_for_cpu:
        _check_cpu_packed_stats(absmax, shape, blocksize, dtype, nested_keys, where)
    elif dtype not in _COMPUTE_DTYPES:  # dequantize_4bit's output dtype
        fail(where, f"dtype {dtype} is not one of {list(_COMPUTE_DTYPES)}")
    elif absmax.numel() != blocks:
        fail(
            where, f"absmax has {absmax.numel()} entries; shape {tuple(shape)} in blocks of {blocksize} needs {blocks}"
        )
    nested = None
    if nested_keys:
        if len(nested_keys) != 5:
            fail(where, f"nested statistics are incomplete: {sorted(nested_keys)}")
        if absmax.dtype is not torch.uint8:
            fail(where, f"nested absmax holds bytes (uint8), not {absmax.dtype}")
        nested_blocksize = _blocksize(plain["nested_blocksize"], (_NESTED_BLOCKSIZE,), where, "nested_blocksize")
        nested_blocks = -(-blocks // nested_blocksize)
        nested_absmax = _dense(
            record["nested_absmax"], where, "nested_absmax", dim=1, dtype=torch.float32, numel=nested_blocks
        )
        nested_code = _dense(
            record["nested_quant_map"], where, "nested_quant_map", dim=1, dtype=torch.float32, numel=_CODE_8BIT
        )
        nested_dtype = validate.dtype_from_name(plain["nested_dtype"], where, "nested_dtype")
        if nested_dtype is not torch.float32:
            fail(where, f"nested_dtype must be float32 (the absmax it restores), not {nested_dtype}")
        nested_offset = validate.expect_float(plain["nested_offset"], where, "nested_offset")
        nested = (nested_absmax, nested_code, nested_blocksize, nested_dtype, nested_offset)
    elif not packed_for_cpu and absmax.dtype is not torch.float32:
        fail(where, f"absmax must be float32 (the kernels read it as float), not {absmax.dtype}")
    validate.charge(absmax.numel() + code.numel() + (0 if nested is None else nested[0].numel() + _CODE_8BIT), where)
    device = absmax.device
    quant_state_cls = _bnb_functional().QuantState
    offset = state2 = None
    if nested is not None:
        nested_absmax, nested_code, nested_blocksize, nested_dtype, nested_offset = nested
        offset = torch.tensor(nested_offset, dtype=torch.float32, device=device)
        state2 = quant_state_cls(
            absmax=nested_absmax.to(device), blocksize=nested_blocksize, code=nested_code.to(device), dtype=nested_dtype
        )
    quant_state = quant_state_cls(
        quant_type=quant_type,
        absmax=absmax,
        blocksize=blocksize,
        code=code.to(device),
        dtype=dtype,
        shape=shape,
        offset=offset,
        state2=state2,
    )
    _apply_layout(quant_state, checked_layout)
    return quant_state


def _blocksize(value: object, sizes: tuple[int, ...], where: str, what: str) -> int:
    """A block size among ``sizes`` (the ones bitsandbytes' kernels implement)."""
    validate.expect_int(value, where, what, 1, _MAX_BLOCKSIZE)
    if value not in sizes:
        fail(where, f"{what} {value} is not one the kernels support ({list(sizes)})")
    assert isinstance(value, int)
    return value


def _dense(
    value: object,
    where: str,
    what: str,
    *,
    dim: int | None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    numel: int | None = None,
) -> torch.Tensor:
    """An exact tensor of ``dim`` dimensions (of ``dtype`` and exactly ``numel`` elements, when given) whose elements
    lie one after another in memory: bitsandbytes' kernels read statistics and packed weights from their data
    pointer as dense arrays of a fixed type and size, and a view with zero or larger strides (which still fits its
    storage), a shorter tensor or a narrower dtype would have them read past it."""
    tensor = validate.expect_tensor(value, where, what, dim=dim, dtype=dtype)
    if not tensor.is_contiguous():
        fail(where, f"{what} is not contiguous (strides {tensor.stride()} for shape {tuple(tensor.shape)})")
    if numel is not None and tensor.numel() != numel:
        fail(where, f"{what} has {tensor.numel()} elements, not exactly {numel}")
    return tensor


def _check_cpu_packed_stats(
    absmax: torch.Tensor, shape: torch.Size, blocksize: int, dtype: torch.dtype, nested_keys: list[str], where: str
) -> None:
    """The statistics of a weight in bitsandbytes' CPU layout (``_convert_weight_packed_for_cpu``, on CPUs with
    AVX512-BF16): for an ``(N, K)`` weight (``N`` a multiple of the layout's 32-row tiles), ``absmax`` is
    ``(K // blocksize, N)`` bfloat16, the dtype bfloat16, and the nested statistics are folded into it. The CPU
    kernel indexes it by those sizes, so they must be exact."""
    if len(shape) != 2 or shape[1] % blocksize or shape[0] % _CPU_BLOCK_N:
        fail(
            where,
            f"a CPU-packed weight's shape must be (N, K) with N a multiple of {_CPU_BLOCK_N} and K of {blocksize}, "
            f"not {tuple(shape)}",
        )
    if dtype is not torch.bfloat16:
        fail(where, f"a CPU-packed state's dtype is bfloat16, not {dtype}")
    expected = (shape[1] // blocksize, shape[0])
    if tuple(absmax.shape) != expected or absmax.dtype is not torch.bfloat16:
        found = f"{absmax.dtype} {tuple(absmax.shape)}"
        fail(where, f"a CPU-packed absmax must be bfloat16 of shape {expected}, not {found}")
    if nested_keys:
        fail(where, f"CPU-packed statistics have no nested statistics, but hold {sorted(nested_keys)}")


def _check_layout(layout: object, where: str) -> dict[str, Any]:
    """What ``_convert_weight_packed_for_cpu`` added to (or removed from) a QuantState, checked."""
    table = validate.expect_keys(layout, frozenset((*_CPU_PACKING_FIELDS, _NO_STATE2, _STALE_OFFSET)), where, "layout")
    checked: dict[str, Any] = {}
    for name, value in table.items():
        if name == _NO_STATE2:
            checked[name] = validate.expect_bool(value, where, name)
        elif name == _STALE_OFFSET:
            checked[name] = _dense(value, where, name, dim=0, dtype=torch.float32)
        elif name in ("original_dtype", "original_storage_type"):
            dtype = validate.expect_optional(value, torch.dtype, where, name)
            allowed = _COMPUTE_DTYPES if name == "original_dtype" else _QUANT_STORAGE
            if dtype is not None and dtype not in allowed:
                fail(where, f"{name} {dtype} is not one of {list(allowed)}")
            checked[name] = dtype
        elif name == "original_qshape":
            checked[name] = torch.Size(validate.expect_int_tuple(value, where, name))
        else:
            checked[name] = validate.expect_bool(value, where, name)
    return checked


def _apply_layout(quant_state: Any, layout: dict[str, Any]) -> None:
    """Put back a checked layout (:func:`_check_layout`) on a QuantState this module built."""
    for name, value in layout.items():
        if name == _NO_STATE2:
            if value:
                vars(quant_state).pop("state2", None)
        else:
            setattr(quant_state, name, value)


def reduce_quant_state(quant_state: Any) -> tuple[Any, ...]:
    """A ``QuantState`` met on its own (not as a ``Params4bit``'s): its packed dict and CPU layout."""
    stats, layout = _quant_state_record(quant_state)
    return rebuild_quant_state, (stats, layout)


def rebuild_quant_state(stats: dict[str, Any], layout: dict[str, Any]) -> Any:
    """A ``QuantState`` from ``as_dict(packed=True)`` output, on the device its ``absmax`` was loaded to."""
    return _quant_state_from_record(stats, layout, "bitsandbytes rebuild_quant_state")


# -- Params4bit and Int8Params -----------------------------------------------------------------------------------

_PARAM_CLASSES = ("Params4bit",)
_INT8_CLASSES = ("Int8Params",)


def reduce_params4bit(param: Any) -> tuple[Any, ...]:
    """``Params4bit`` to its data (a plain tensor over the same storage), its quant state's packed dict, its own
    attributes, and (as pickle state, so that a reference cycle through the module resolves) its module and any
    further instance attributes (transformers adds ``_is_hf_initialized``)."""
    fields = vars(param)
    quant_state = fields.get("quant_state")
    stats, layout = (None, {}) if quant_state is None else _quant_state_record(quant_state)
    attrs = {name: fields[name] for name in _PARAMS4BIT_FIELDS if name in fields}
    extra = {k: v for k, v in fields.items() if k not in _PARAMS4BIT_FIELDS and k not in ("quant_state", "module")}
    # param.data is a plain Tensor aliasing the parameter's storage: the pickler's tensor reducer takes it.
    cls = _class_ref(type(param), _PARAM_CLASSES)
    args = (cls, param.data, stats, layout, attrs, param.requires_grad)
    module = fields.get("module")
    if module is None and not extra:
        return rebuild_params4bit, args
    return rebuild_params4bit, args, (module, extra), None, None, set_param_state


def _params4bit_attrs(attrs: object, where: str) -> dict[str, Any]:
    table = validate.expect_keys(attrs, frozenset(_PARAMS4BIT_FIELDS), where, "Params4bit attributes")
    checked: dict[str, Any] = {}
    for name, value in table.items():
        if name == "blocksize":
            checked[name] = _blocksize(value, _BLOCKSIZES_4BIT, where, name)
        elif name == "quant_type":
            checked[name] = validate.expect_choice(value, _QUANT_TYPES, where, name)
        elif name == "quant_storage":
            checked[name] = validate.expect(value, torch.dtype, where, name)
            if value not in _QUANT_STORAGE:
                fail(where, f"quant_storage {value} is not one of {list(_QUANT_STORAGE)}")
        else:  # compress_statistics, bnb_quantized
            checked[name] = validate.expect_bool(value, where, name)
    return checked


def rebuild_params4bit(
    cls: str | type,
    data: torch.Tensor,
    stats: dict[str, Any] | None,
    layout: dict[str, Any],
    attrs: dict[str, Any],
    requires_grad: bool,
) -> Any:
    """A ``Params4bit``: quantized ones with a ``QuantState`` built from the checked record (as
    ``from_prequantized`` does, on the device ``data`` was loaded to: its recorded device, or where the load's
    ``map_location`` sent it), others through the constructor. ``cls`` is ``"Params4bit"`` or a subclass."""
    where = "bitsandbytes rebuild_params4bit"
    if type(cls) not in (str, type):
        fail(where, f"the class must be a name or a class, not {type(cls).__qualname__}")
    data = validate.expect_tensor(data, where, "data")
    checked_attrs = _params4bit_attrs(attrs, where)
    requires_grad = validate.expect_bool(requires_grad, where, "requires_grad")
    if requires_grad and not (data.is_floating_point() or data.is_complex()):
        fail(where, f"data of dtype {data.dtype} cannot require gradients")
    if stats is None:
        validate.expect_keys(layout, frozenset(), where, "layout")
        if checked_attrs.get("bnb_quantized") is True:
            # Linear4bit.forward would attach the layer's quant_state to these bytes and read them by its shape.
            fail(where, "a Params4bit without quantization statistics cannot say it is quantized (bnb_quantized)")
        klass = _class_arg(cls, _PARAM_CLASSES, "Params4bit", where)
        return klass(data, requires_grad=requires_grad, **checked_attrs)
    # The 4-bit kernels read (n + 1) // 2 bytes of packed values from data's pointer, whatever its dtype.
    data = _dense(data, where, "quantized data", dim=None, dtype=_QUANT_STORAGE)
    quant_state = _quant_state_from_record(stats, layout, where)
    shape = quant_state.shape
    if quant_state.absmax.device != data.device:
        fail(where, f"quantized data is on {data.device}, its statistics on {quant_state.absmax.device}")
    if getattr(quant_state, "packing_format_for_cpu", False):
        n, k = shape
        if data.dtype is not torch.uint8 or tuple(data.shape) != (n, k // 2):
            fail(where, f"CPU-packed data must be uint8 of shape {(n, k // 2)}, not {data.dtype} {tuple(data.shape)}")
    else:
        packed_bytes = (math.prod(shape) + 1) // 2
        if data.nbytes != packed_bytes:
            fail(
                where,
                f"shape {tuple(shape)} packs into {packed_bytes} bytes (two 4-bit values a byte), but the data holds "
                f"{data.nbytes} ({data.numel()} {data.dtype})",
            )
        if checked_attrs.get("quant_storage", data.dtype) is not data.dtype:
            fail(where, f"quant_storage {checked_attrs['quant_storage']} is not the data's dtype {data.dtype}")
    for name in ("blocksize", "quant_type"):
        if name in checked_attrs and checked_attrs[name] != getattr(quant_state, name):
            fail(where, f"{name} {checked_attrs[name]!r} disagrees with the statistics' {getattr(quant_state, name)!r}")
    if checked_attrs.get("bnb_quantized") is False:
        fail(where, "quantized data with bnb_quantized=False (moving it would quantize the packed bytes again)")
    klass = _class_arg(cls, _PARAM_CLASSES, "Params4bit", where)
    device = data.device
    # What from_prequantized does, with the QuantState built above instead of QuantState.from_dict. data stays
    # where it is: a view into the snapshot's mapping.
    param = torch.Tensor._make_subclass(klass, data)
    param.requires_grad = requires_grad
    param.quant_state = quant_state
    param.blocksize = quant_state.blocksize
    param.compress_statistics = quant_state.nested
    param.quant_type = quant_state.quant_type
    param.bnb_quantized = True
    param.quant_storage = data.dtype
    param.module = None
    for name, value in checked_attrs.items():
        setattr(param, name, value)
    if getattr(param.quant_state, "packing_format_for_cpu", False) and device.type != "cpu":
        # The CPU layout computes only on the CPU; moved elsewhere by map_location, unpack as Params4bit.cuda()
        # does (on these fresh objects).
        param.data, param.quant_state = _bnb_functional()._convert_weight_packed_for_cpu_inverse(
            param.data, param.quant_state
        )
    return param


def reduce_int8params(param: Any) -> tuple[Any, ...]:
    """``Int8Params`` to its data, ``CB`` and ``SCB`` (tensors: shared storages stay shared) and its flags."""
    fields = vars(param)
    extra = {k: v for k, v in fields.items() if k not in _INT8PARAMS_FIELDS}
    args = (
        _class_ref(type(param), _INT8_CLASSES),
        param.data,
        param.requires_grad,
        fields.get("has_fp16_weights", False),
        fields.get("CB"),
        fields.get("SCB"),
    )
    if not extra:
        return rebuild_int8params, args
    return rebuild_int8params, args, (None, extra), None, None, set_param_state


def rebuild_int8params(
    cls: str | type,
    data: torch.Tensor,
    requires_grad: bool,
    has_fp16_weights: bool,
    CB: torch.Tensor | None,  # bitsandbytes' names
    SCB: torch.Tensor | None,
) -> Any:
    """An ``Int8Params`` through its constructor (which wraps ``data`` without copying it)."""
    where = "bitsandbytes rebuild_int8params"
    if type(cls) not in (str, type):
        fail(where, f"the class must be a name or a class, not {type(cls).__qualname__}")
    data = validate.expect_tensor(data, where, "data")
    requires_grad = validate.expect_bool(requires_grad, where, "requires_grad")
    has_fp16_weights = validate.expect_bool(has_fp16_weights, where, "has_fp16_weights")
    CB, SCB = _int8_rows(CB, SCB, where)
    if CB is not None and (
        data.dtype is not torch.int8 or data.shape != CB.shape or data.device != CB.device or not data.is_contiguous()
    ):
        # Quantized, data is CB (the layer's forward hands weight.data on as the int8 rows)
        fail(where, f"quantized data must be int8 like CB {tuple(CB.shape)}, not {data.dtype} {tuple(data.shape)}")
    if requires_grad and not (data.is_floating_point() or data.is_complex()):
        fail(where, f"data of dtype {data.dtype} cannot require gradients")
    klass = _class_arg(cls, _INT8_CLASSES, "Int8Params", where)
    return klass(data, requires_grad=requires_grad, has_fp16_weights=has_fp16_weights, CB=CB, SCB=SCB)


def _int8_rows(CB: object, SCB: object, where: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``CB`` and ``SCB`` of an ``Int8Params`` or ``MatmulLtState``, as the int8 matmul reads them: both None, or
    ``CB`` a dense 2-D int8 ``(rows, columns)`` matrix (cuBLASLt reads it from its pointer) and ``SCB`` its dense
    float32 row scales, exactly one a row (``int8_mm_dequant`` reads ``rows`` floats from its pointer)."""
    if CB is None and SCB is None:
        return None, None
    if CB is None or SCB is None:
        fail(where, "CB and SCB come together (the int8 rows and their scales), or neither")
    rows = _dense(CB, where, "CB", dim=2, dtype=torch.int8)
    scales = _dense(SCB, where, "SCB", dim=1, dtype=torch.float32, numel=rows.shape[0])
    if scales.device != rows.device:
        fail(where, f"SCB is on {scales.device}, CB on {rows.device}")
    return rows, scales


def set_param_state(param: Any, state: tuple[Any, dict[str, Any]]) -> None:
    """Pickle's state setter for the parameters: the owning module (``Params4bit.module``) and further instance
    attributes, set after the parameter exists so that the module can refer back to it."""
    where = "bitsandbytes set_param_state"
    if not _type_has(param, torch.Tensor):
        fail(where, f"expected a Params4bit or Int8Params, not {type(param).__qualname__}")
    if type(state) is not tuple or len(state) != 2:
        fail(where, "a bitsandbytes parameter's state must be a tuple (module, attributes)")
    module, extra = state
    if module is not None and not _type_has(module, torch.nn.Module):
        fail(where, f"a Params4bit's module must be a Module, not {type(module).__qualname__}")
    extra = validate.expect_str_dict(extra, where, "attributes", max_len=256)
    nn = _bnb_nn()
    is_4bit = _type_has(param, nn.Params4bit)
    if not (is_4bit or _type_has(param, nn.Int8Params)):
        fail(where, f"expected a Params4bit or Int8Params, not {type(param).__qualname__}")
    if module is not None and not is_4bit:
        fail(where, "only a Params4bit has a module")
    names = [_check_new_attribute(type(param), name, where) for name in extra]
    reserved = sorted(set(names) & _PARAM_RESERVED)
    if reserved:
        # rebuild_params4bit/rebuild_int8params checked these against the data; replacing them afterwards (a
        # quant_state of another shape, CB of other rows) would have the kernels read past the data.
        fail(where, f"refusing to replace {reserved}, which the rebuild checked against the data")
    if is_4bit:
        param.module = module
    for name in names:
        setattr(param, name, extra[name])


# -- MatmulLtState -----------------------------------------------------------------------------------------------

_MATMUL_BOOLS = ("force_no_igemmlt", "has_accumulated_gradients", "is_training", "has_fp16_weights", "use_pool")
_MATMUL_TENSORS = ("CB", "SB", "SCB", "SBt", "CBt", "subB", "idx")
_MATMUL_FIELDS = frozenset((*_MATMUL_BOOLS, *_MATMUL_TENSORS, "threshold", "outlier_pool"))


def reduce_matmul_lt_state(state: Any) -> tuple[Any, ...]:
    """``Linear8bitLt.state`` (a dataclass of tensors and flags) to its fields, by name."""
    fields = dict(vars(state))
    unknown = sorted(set(fields) - _MATMUL_FIELDS)
    if unknown:
        raise Unpicklable(
            f"zerocopy_pickle's bitsandbytes quirk does not know the MatmulLtState attribute(s) {unknown}; "
            f"this bitsandbytes version is not supported yet"
        )
    if fields.pop("outlier_pool", None) is not None:
        raise Unpicklable(
            "a Linear8bitLt's MatmulLtState holds an outlier pool (use_pool during training), a process-wide "
            "singleton of bitsandbytes: reset it (layer.state.outlier_pool = None) before dumping"
        )
    return rebuild_matmul_lt_state, (fields,)


def rebuild_matmul_lt_state(fields: dict[str, Any]) -> Any:
    """A ``MatmulLtState`` with the checked ``fields`` (flags, the threshold, tensors or None)."""
    where = "bitsandbytes rebuild_matmul_lt_state"
    table = validate.expect_keys(fields, _MATMUL_FIELDS - {"outlier_pool"}, where, "fields")
    checked: dict[str, Any] = {}
    for name, value in table.items():
        if name in _MATMUL_BOOLS:
            checked[name] = validate.expect_bool(value, where, name)
        elif name == "threshold":
            checked[name] = validate.expect_float(value, where, name, 0.0)
        elif name == "idx":  # the outlier columns a forward found: indices into CB's columns
            checked[name] = validate.expect_optional_tensor(value, where, name, dtype=torch.int64, dim=1)
        elif name not in ("CB", "SCB"):
            checked[name] = validate.expect_optional_tensor(value, where, name)
    checked["CB"], checked["SCB"] = _int8_rows(table.get("CB"), table.get("SCB"), where)
    state = _bnb("bitsandbytes.autograd._functions").MatmulLtState()
    for name, value in checked.items():
        setattr(state, name, value)
    return state


# -- Linear4bit and Linear8bitLt ---------------------------------------------------------------------------------


def _is_own_method(module: Any, method: object, name: str) -> bool:
    """Whether ``method`` is ``type(module).<name>`` bound to ``module``: what the attribute lookup finds anyway."""
    return getattr(method, "__self__", None) is module and getattr(method, "__func__", None) is getattr(
        type(module), name, None
    )


def _hook_specs(module: Any, hook: Any) -> list[dict[str, Any]]:
    """The settings of the accelerate hooks on ``module``, to attach equivalent ones after loading."""
    key = _type_key(type(hook))
    if key == _SEQUENTIAL_HOOK:
        return [spec for inner in hook.hooks for spec in _hook_specs(module, inner)]
    if key == _ALIGN_DEVICES_HOOK and not hook.offload:
        # An offload-free AlignDevicesHook holds no weights: its behaviour is its settings. tied_params_map (keyed
        # by data pointers of this process) only matters when offloading.
        return [
            {
                "execution_device": hook.execution_device,
                "io_same_device": bool(hook.io_same_device),
                "offload_buffers": bool(hook.offload_buffers),
                "place_submodules": bool(hook.place_submodules),
                "skip_keys": hook.skip_keys,
            }
        ]
    what = f"{key} (offloading)" if key == _ALIGN_DEVICES_HOOK else key
    raise Unpicklable(
        f"{type(module).__name__} carries the accelerate hook {what}, which zerocopy_pickle cannot snapshot: its "
        f"weights live outside the module or its behaviour is unknown. Dispatch the model without offloading, or "
        f"call accelerate.hooks.remove_hook_from_module(model, recurse=True) before dumping."
    )


def _strip_accelerate(module: Any, state: dict[str, Any]) -> dict[str, Any] | None:
    """Remove from ``state`` (a copy of the module's ``__dict__``) what accelerate added to the instance; return the
    hooks to attach again after loading (and the device the layer's weights were on), or None."""
    specs: list[dict[str, Any]] = []
    hook = state.pop("_hf_hook", None)
    if hook is not None:
        specs = _hook_specs(module, hook)
    if "_old_forward" in state:
        old_forward = state.pop("_old_forward")
        forward = state.pop("forward", None)
        # add_hook_to_module replaced forward by partial(new_forward, module) over the class's own forward; a
        # forward the user replaced before hooking would be lost, so refuse that.
        hooked = isinstance(forward, functools.partial) and bool(forward.args) and forward.args[0] is module
        if not (hooked and _is_own_method(module, old_forward, "forward")):
            raise Unpicklable(
                f"{type(module).__name__} has an accelerate hook over a replaced forward method, which "
                f"zerocopy_pickle cannot snapshot; call accelerate.hooks.remove_hook_from_module first"
            )
    elif _is_own_method(module, state.get("forward"), "forward"):
        # remove_hook_from_module leaves the bound class method behind as an instance attribute: same behaviour.
        del state["forward"]
    for name in _ACCELERATE_DEVICE_METHODS:
        # dispatch_model's warning wrappers (functools.wraps over the bound method): they log "You shouldn't move
        # a model that is dispatched using accelerate hooks", and refuse meta weights, which dumping refuses.
        if _is_own_method(module, getattr(state.get(name), "__wrapped__", None), name):
            del state[name]
    if not specs:
        return None
    weight = state.get("_parameters", {}).get("weight")
    return {"hooks": specs, "device": None if weight is None else str(weight.device)}


def _strip_rearrange_hooks(state: dict[str, Any]) -> list[int]:
    """Replace Linear8bitLt's ``maybe_rearrange_weight`` pre-hook by a placeholder (in a copy); return its keys."""
    hooks = state.get("_load_state_dict_pre_hooks")
    rearrange = getattr(_bnb_nn(), "maybe_rearrange_weight", None)
    if not hooks or rearrange is None:
        return []
    keys = [
        key
        for key, hook in hooks.items()
        if type(hook).__name__ == "_WrappedHook" and getattr(hook, "hook", None) is rearrange and not hook.with_module
    ]
    if keys:
        state["_load_state_dict_pre_hooks"] = OrderedDict((k, None if k in keys else v) for k, v in hooks.items())
    return keys


def reduce_bnb_module(module: Any) -> tuple[Any, ...]:
    """A bitsandbytes linear layer as an ordinary module, from a corrected copy of its ``__dict__`` (the module
    itself is never changed): accelerate's additions and the rearrange pre-hook left out, ``quant_state`` left out
    when it is the weight's (relinked at load)."""
    cls = type(module)
    state = dict(vars(module))
    hooks = _strip_accelerate(module, state)
    rearrange_keys = _strip_rearrange_hooks(state)
    relink = False
    quant_state = state.get("quant_state")
    if quant_state is not None:
        weight = state.get("_parameters", {}).get("weight")
        if weight is not None and getattr(weight, "__dict__", {}).get("quant_state") is quant_state:
            del state["quant_state"]
            relink = True
    name = _class_ref(cls, _MODULE_CLASSES)
    return rebuild_bnb_module, (name,), (state, relink, rearrange_keys, hooks), None, None, set_bnb_module_state


def _module_bases() -> tuple[type, ...]:
    nn = _bnb_nn()
    return tuple(getattr(nn, name) for name in _MODULE_BASES)


def rebuild_bnb_module(cls: str | type) -> Any:
    """An empty instance of a bitsandbytes layer class (``__init__`` is not called: its state follows): a name
    from ``_MODULE_CLASSES``, or a subclass of ``Linear4bit``/``Linear8bitLt`` the caller allowed."""
    where = "bitsandbytes rebuild_bnb_module"
    if type(cls) is str:
        validate.expect_choice(cls, _MODULE_CLASSES, where, "layer class name")
        klass = getattr(_bnb_nn(), cls)
    else:
        validate.expect(cls, type, where, "layer class")
        klass = validate.expect_class(cls, _module_bases(), where, "layer class")
    if klass.__new__ is not object.__new__:
        fail(where, f"{_type_key(klass)} defines __new__")
    return object.__new__(klass)


# Module.__dict__ entries that shadow class attributes on purpose.
_MODULE_INSTANCE_OVERRIDES = frozenset({"training"})


def set_bnb_module_state(module: Any, state: tuple[Any, ...]) -> None:
    """Pickle's state setter for the layers: ``Module.__setstate__``, then what the reducer took apart.

    The attribute names are checked first: identifiers that shadow nothing of the class (a stream cannot
    replace ``forward`` or a property), and the layer must be one :func:`rebuild_bnb_module` built and not yet
    filled (its ``__dict__`` is empty)."""
    where = "bitsandbytes set_bnb_module_state"
    if not _type_has(module, torch.nn.Module):
        fail(where, f"expected a bitsandbytes layer, not {type(module).__qualname__}")
    if type(state) is not tuple or len(state) != 4:
        fail(where, "a bitsandbytes layer's state must be a tuple (dict, relink, rearrange keys, hooks)")
    fields, relink, rearrange_keys, hooks = state
    fields = validate.expect_str_dict(fields, where, "the layer's attributes", max_len=4096)
    relink = validate.expect_bool(relink, where, "relink")
    if type(rearrange_keys) is not list or len(rearrange_keys) > 64:
        fail(where, "rearrange keys must be a list of at most 64 ints")
    keys = [validate.expect_int(key, where, "rearrange key", 0, 1 << 62) for key in rearrange_keys]
    record = None if hooks is None else _check_hooks(hooks, where)
    if not issubclass(type(module), _module_bases()):
        fail(where, f"expected a bitsandbytes Linear4bit or Linear8bitLt, not {type(module).__qualname__}")
    if vars(module):
        fail(where, "the layer is already filled")
    cls = type(module)
    for name in fields:
        if not name.isidentifier() or name.startswith("__"):
            fail(where, f"refusing to set attribute {name[:80]!r} on a {cls.__name__}")
        if name not in _MODULE_INSTANCE_OVERRIDES and hasattr(cls, name):
            fail(where, f"refusing to set attribute {name!r}, which would shadow {cls.__name__}.{name}")
    fields = dict(fields)
    for name in ("_parameters", "_buffers", "_modules"):
        table = fields.get(name, {} if name == "_buffers" else None)
        if type(table) not in (dict, OrderedDict):
            fail(where, f"the layer's {name} must be a dict")
        assert isinstance(table, dict)
        validate.charge(len(table), where)
        # A copy: the stream keeps its own dict and could put another weight in it after the checks below.
        fields[name] = type(table)(table)
    _check_module_hooks(fields, keys, where)
    _check_layer_tensors(cls, fields, relink, where)
    module.__setstate__(fields)
    if keys:
        wrapped_hook = importlib.import_module("torch.nn.modules.module")._WrappedHook
        pre_hooks = module._load_state_dict_pre_hooks
        for key in keys:
            if key in pre_hooks:
                pre_hooks[key] = wrapped_hook(_bnb_nn().maybe_rearrange_weight)
    if relink:
        module.quant_state = module._parameters["weight"].quant_state
    if record is not None:
        _attach_hooks(module, record)


@functools.cache
def _module_hook_attributes() -> frozenset[str]:
    """The hook tables every ``nn.Module`` has (``_forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks``,
    ``_state_dict_hooks``, ...), read from a fresh module so that tables a torch release adds are covered too."""
    return frozenset(
        name for name, value in vars(torch.nn.Module()).items() if "hook" in name and isinstance(value, dict)
    )


def _check_module_hooks(fields: dict[str, Any], rearrange_keys: list[int], where: str) -> None:
    """A layer's hook tables hold no hook (hooks are code: a stream would choose what runs on every forward, backward
    or state-dict call); only the load-state-dict pre-hooks hold placeholders (None) where the reducer took out
    bitsandbytes' own ``maybe_rearrange_weight``, which the setter puts back. ``_is_full_backward_hook`` is None or a
    bool."""
    for name in _module_hook_attributes():
        if name not in fields:
            continue
        table = validate.expect(fields[name], (dict, OrderedDict), where, name)
        if name == "_load_state_dict_pre_hooks":
            if any(key not in rearrange_keys or value is not None for key, value in table.items()):
                fail(where, f"{name} must hold no hooks (only the placeholders of bitsandbytes' own)")
        elif table:
            fail(where, f"{name} must be empty (hooks are code; they never travel in a restricted load)")
    flag = fields.get("_is_full_backward_hook")
    if flag is not None:
        validate.expect_bool(flag, where, "_is_full_backward_hook")


def _check_layer_tensors(cls: type, fields: dict[str, Any], relink: bool, where: str) -> None:
    """The layer's weight and bias agree with what its forward hands the kernels: a ``Params4bit`` (``Linear4bit``)
    or ``Int8Params`` (``Linear8bitLt``) weight; a bias that is None or a dense 1-D tensor of one entry per output
    row (the fused kernels read that many from its pointer); a 4-bit layer's own ``quant_state`` None or its
    weight's; an 8-bit layer's ``state`` a ``MatmulLtState`` whose int8 rows, when set, have the weight's shape."""
    nn = _bnb_nn()
    params = fields["_parameters"]
    weight, bias = params.get("weight"), params.get("bias")
    if issubclass(cls, nn.Linear4bit):
        if not _type_has(weight, nn.Params4bit):
            fail(where, f"a Linear4bit's weight must be a Params4bit, not {type(weight).__qualname__}")
        quant_state = vars(weight).get("quant_state")
        if "quant_state" in fields and fields["quant_state"] is not None and fields["quant_state"] is not quant_state:
            fail(where, "a Linear4bit's quant_state must be None or its weight's own")
        if relink and quant_state is None:
            fail(where, "relink needs a quantized weight")
        rows = quant_state.shape[0] if quant_state is not None else (weight.shape[0] if weight.dim() else 1)
    else:
        if not _type_has(weight, nn.Int8Params):
            fail(where, f"a Linear8bitLt's weight must be an Int8Params, not {type(weight).__qualname__}")
        if relink:
            fail(where, "only a Linear4bit relinks a quant_state")
        state: Any = fields.get("state")
        matmul_state = _bnb("bitsandbytes.autograd._functions").MatmulLtState
        if type(state) is not matmul_state:
            fail(where, f"a Linear8bitLt's state must be a MatmulLtState, not {type(state).__qualname__}")
        if state.CB is not None and (state.CB.shape != weight.shape or state.CB.device != weight.device):
            fail(where, f"the layer's int8 rows {tuple(state.CB.shape)} are not its weight's {tuple(weight.shape)}")
        rows = weight.shape[0] if weight.dim() else 1
    if bias is not None:
        if type(bias) not in (torch.Tensor, torch.nn.Parameter):
            fail(where, f"the bias must be a tensor, not {type(bias).__qualname__}")
        if bias.dim() != 1 or bias.numel() != rows or not bias.is_contiguous():
            fail(where, f"the bias must be dense with {rows} entries (one per output row), not {tuple(bias.shape)}")


def _same_device(device: object, name: str) -> bool:
    """Whether accelerate's ``device`` (a ``torch.device``, a string, or an accelerator index) is ``name``."""
    try:
        target = torch.device(name)
        if isinstance(device, int):  # torch.device(0) needs an accelerator present; compare by hand
            return target.type != "cpu" and target.index == device
        return isinstance(device, (str, torch.device)) and torch.device(device) == target
    except RuntimeError:
        return False


def _check_device(value: object, where: str) -> Any:
    """An accelerate execution device: None, an accelerator index, a device string, or a ``torch.device``."""
    if value is None or type(value) is torch.device:
        return value
    if type(value) is int:
        return validate.expect_int(value, where, "execution_device", 0, 1 << 16)
    name = validate.expect_str(value, where, "execution_device", max_len=64)
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        fail(where, f"execution_device {name!r} is not a device")
    return name


def _check_hooks(record: object, where: str) -> dict[str, Any]:
    """The accelerate hook settings the reducer recorded, checked (before accelerate is imported)."""
    table = validate.expect_keys(record, frozenset({"hooks", "device"}), where, "accelerate hook settings")
    specs = table.get("hooks")
    if type(specs) is not list or not 1 <= len(specs) <= 16:
        fail(where, "accelerate hook settings must hold a list of 1 to 16 hooks")
    checked = []
    for spec in specs:
        settings = dict(validate.expect_keys(spec, _HOOK_SPEC_KEYS, where, "accelerate hook"))
        for name in ("io_same_device", "offload_buffers", "place_submodules"):
            if name in settings:
                validate.expect_bool(settings[name], where, name)
        if "execution_device" in settings:
            settings["execution_device"] = _check_device(settings["execution_device"], where)
        skip = settings.get("skip_keys")
        if skip is not None and type(skip) is not str:
            if type(skip) not in (list, tuple) or len(skip) > 256:
                fail(where, "skip_keys must be None, a str or a list of at most 256 str")
            settings["skip_keys"] = [validate.expect_str(k, where, "skip_keys entry") for k in skip]
        checked.append(settings)
    device = table.get("device")
    if device is not None:
        validate.expect_str(device, where, "device", max_len=64)
    return {"hooks": checked, "device": device}


def _attach_hooks(module: Any, record: dict[str, Any]) -> None:
    """Attach accelerate ``AlignDevicesHook``s with the recorded (checked) settings, as ``dispatch_model`` did.

    A hook whose execution device was the device of the layer's weights follows the weights when the load's
    ``map_location`` moved them (a layer dumped on ``cuda:0`` and loaded with ``map_location="cpu"`` executes on
    the CPU, instead of being sent back to a GPU the loading machine may not have)."""
    specs = record["hooks"]
    if "accelerate" not in sys.modules:  # as for bitsandbytes: a snapshot never makes a load import a library
        raise BitsandbytesNotImported(
            "this snapshot holds a bitsandbytes layer dispatched with accelerate hooks, and this process has not "
            "imported accelerate: run `import accelerate` before loading it (pip install accelerate)",
            plugin="bitsandbytes",
            package="accelerate",
        )
    accelerate_hooks = importlib.import_module("accelerate.hooks")
    dumped_on, weight = record.get("device"), module._parameters.get("weight")
    built = []
    for spec in specs:
        settings = dict(spec)
        execution_device = settings.get("execution_device")
        if (
            isinstance(dumped_on, str)
            and weight is not None
            and str(weight.device) != dumped_on
            and _same_device(execution_device, dumped_on)
        ):
            settings["execution_device"] = weight.device
        built.append(accelerate_hooks.AlignDevicesHook(offload=False, **settings))
    hook = built[0] if len(built) == 1 else accelerate_hooks.SequentialHook(*built)
    accelerate_hooks.add_hook_to_module(module, hook)


# -- registration ------------------------------------------------------------------------------------------------


def register(registry: Registrar) -> None:
    """Register the bitsandbytes reducers by type name: this imports neither bitsandbytes nor accelerate."""
    registry.register_reducer(PARAMS4BIT, reduce_params4bit)
    registry.register_reducer(INT8PARAMS, reduce_int8params)
    registry.register_reducer(QUANT_STATE, reduce_quant_state)
    for name in _MODULE_BASES:  # subclasses (LinearFP4, LinearNF4, ...) are covered through their MRO
        registry.register_reducer(f"{_NN}:{name}", reduce_bnb_module)
    registry.register_reducer(MATMUL_LT_STATE, reduce_matmul_lt_state)
    # Trusted loads only: a restricted load's rebuild functions refuse to run until the program imported bitsandbytes
    # (a header an attacker wrote must not make the process import it).
    registry.set_load_hook(import_bitsandbytes)
    # Plain functions only, each checking its arguments' exact types and sizes before doing anything: restricted
    # loads call them with whatever a stream chose. No class is declared (a constructor allocates what it is told;
    # NEWOBJ/BUILD on it would set anything): bitsandbytes' own classes travel by name.
    registry.add_safe_globals(
        rebuild_params4bit,
        rebuild_int8params,
        rebuild_quant_state,
        rebuild_matmul_lt_state,
        rebuild_bnb_module,
        set_param_state,
        set_bnb_module_state,
    )
