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
Restricted loads accept the rebuild functions below, ``Params4bit``, ``Int8Params`` and bitsandbytes'
``MatmulLtState`` (a dataclass of tensors and flags). The layer classes themselves are deliberately not declared
safe: their constructors allocate a weight of whatever size they are given, so the stream names them by a string
that :func:`rebuild_bnb_module` maps to the class and instantiates without calling ``__init__``.
"""

from __future__ import annotations

import functools
import importlib
from collections import OrderedDict
from typing import Any

import torch

import zerocopy_pickle

# The rebuild functions and state setters below are named by every snapshot that used this quirk
# (``zerocopy_pickle_quirks.bnb:<name>``): never rename or move one, nor change the meaning of its arguments.
__all__ = [
    "rebuild_bnb_module",
    "rebuild_int8params",
    "rebuild_params4bit",
    "rebuild_quant_state",
    "reduce_bnb_module",
    "reduce_int8params",
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

# Instance attributes accelerate adds (accelerate.hooks._accelerate_added_attributes, plus the hook itself).
_ACCELERATE_DEVICE_METHODS = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa", "neuron")
_ALIGN_DEVICES_HOOK = "accelerate.hooks:AlignDevicesHook"
_SEQUENTIAL_HOOK = "accelerate.hooks:SequentialHook"
_HOOK_SPEC_KEYS = frozenset({"execution_device", "io_same_device", "offload_buffers", "place_submodules", "skip_keys"})


def _type_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _bnb_nn() -> Any:
    """``bitsandbytes.nn.modules``, imported on first use (a load in a fresh process)."""
    return importlib.import_module(_NN)


def _bnb_functional() -> Any:
    return importlib.import_module("bitsandbytes.functional")


def _check_class(cls: object, base: type, what: str) -> Any:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{what} must be a subclass of {_type_key(base)}, not {cls!r:.80}")
    return cls


def _check_tensor(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, not {type(value).__name__}")
    return value


def _check_new_attribute(cls: type, name: object) -> str:
    """An attribute name a rebuild may set: a plain identifier that shadows nothing of the class (so a stream
    cannot replace ``data``, ``grad``, a property or a method through the state setter)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("__") or hasattr(cls, name):
        raise TypeError(f"refusing to set attribute {name!r:.80} on a {cls.__name__}")
    return name


# -- QuantState ------------------------------------------------------------------------------------------------


def _quant_state_record(quant_state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(quant_state.as_dict(packed=True), CPU-packing attributes)``, reading ``quant_state`` only."""
    fields = vars(quant_state)
    unknown = sorted(set(fields) - _QUANT_STATE_FIELDS - set(_CPU_PACKING_FIELDS))
    if unknown:
        # A bitsandbytes release added state this quirk does not know how to carry: failing is better than a
        # snapshot that silently computes something else.
        raise TypeError(
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


def _apply_layout(quant_state: Any, layout: object) -> None:
    """Put back what ``_convert_weight_packed_for_cpu`` added to (or removed from) a QuantState."""
    if not isinstance(layout, dict):
        raise TypeError(f"a QuantState layout must be a dict, not {type(layout).__name__}")
    for name, value in layout.items():
        if name == _NO_STATE2:
            if value is True:
                vars(quant_state).pop("state2", None)
            continue
        if name == _STALE_OFFSET:
            quant_state.offset = _check_tensor(value, "offset")
            continue
        if name not in _CPU_PACKING_FIELDS:
            raise TypeError(f"unknown QuantState layout entry {name!r:.80}")
        if name in ("original_dtype", "original_storage_type"):
            ok = value is None or isinstance(value, torch.dtype)
        elif name == "original_qshape":
            ok = isinstance(value, tuple) and all(isinstance(n, int) for n in value)
        else:
            ok = isinstance(value, bool)
        if not ok:
            raise TypeError(f"QuantState layout entry {name!r} has a {type(value).__name__}")
        setattr(quant_state, name, torch.Size(value) if name == "original_qshape" else value)


def _quant_state_from_record(stats: object, layout: object, device: torch.device) -> Any:
    if not isinstance(stats, dict):
        raise TypeError(f"quantization statistics must be a dict, not {type(stats).__name__}")
    # from_dict consumes its argument (pops the packed blob): give it a copy.
    quant_state = _bnb_functional().QuantState.from_dict(dict(stats), device=device)
    _apply_layout(quant_state, layout)
    return quant_state


def reduce_quant_state(quant_state: Any) -> tuple[Any, ...]:
    """A ``QuantState`` met on its own (not as a ``Params4bit``'s): its packed dict and CPU layout."""
    stats, layout = _quant_state_record(quant_state)
    return rebuild_quant_state, (stats, layout)


def rebuild_quant_state(stats: dict[str, Any], layout: dict[str, Any]) -> Any:
    """A ``QuantState`` from ``as_dict(packed=True)`` output, on the device its ``absmax`` was loaded to."""
    absmax = _check_tensor(stats.get("absmax") if isinstance(stats, dict) else None, "absmax")
    return _quant_state_from_record(stats, layout, absmax.device)


# -- Params4bit and Int8Params -----------------------------------------------------------------------------------


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
    args = (type(param), param.data, stats, layout, attrs, param.requires_grad)
    module = fields.get("module")
    if module is None and not extra:
        return rebuild_params4bit, args
    return rebuild_params4bit, args, (module, extra), None, None, set_param_state


def rebuild_params4bit(
    cls: type,
    data: torch.Tensor,
    stats: dict[str, Any] | None,
    layout: dict[str, Any],
    attrs: dict[str, Any],
    requires_grad: bool,
) -> Any:
    """A ``Params4bit``: quantized ones through ``from_prequantized`` on the device ``data`` was loaded to (its
    recorded device, or where the load's ``map_location`` sent it), others through the constructor."""
    nn = _bnb_nn()
    klass = _check_class(cls, nn.Params4bit, "a Params4bit class")
    data = _check_tensor(data, "Params4bit data")
    if not isinstance(attrs, dict) or not set(attrs) <= set(_PARAMS4BIT_FIELDS):
        raise TypeError(f"Params4bit attributes must be a dict with keys from {_PARAMS4BIT_FIELDS}")
    if stats is None:
        return klass(data, requires_grad=bool(requires_grad), **attrs)
    if not isinstance(stats, dict):
        raise TypeError(f"quantization statistics must be a dict, not {type(stats).__name__}")
    device = data.device
    # from_prequantized moves data and statistics to `device`: a no-op here, so the weight stays a view into the
    # snapshot's mapping. from_dict consumes its argument: give it a copy.
    param = klass.from_prequantized(data, dict(stats), requires_grad=bool(requires_grad), device=device)
    for name, value in attrs.items():
        setattr(param, name, value)
    _apply_layout(param.quant_state, layout)
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
        type(param),
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
    cls: type,
    data: torch.Tensor,
    requires_grad: bool,
    has_fp16_weights: bool,
    CB: torch.Tensor | None,  # bitsandbytes' names
    SCB: torch.Tensor | None,
) -> Any:
    """An ``Int8Params`` through its constructor (which wraps ``data`` without copying it)."""
    klass = _check_class(cls, _bnb_nn().Int8Params, "an Int8Params class")
    data = _check_tensor(data, "Int8Params data")
    for name, value in (("CB", CB), ("SCB", SCB)):
        if value is not None:
            _check_tensor(value, name)
    return klass(data, requires_grad=bool(requires_grad), has_fp16_weights=bool(has_fp16_weights), CB=CB, SCB=SCB)


def set_param_state(param: Any, state: tuple[Any, dict[str, Any]]) -> None:
    """Pickle's state setter for the parameters: the owning module (``Params4bit.module``) and further instance
    attributes, set after the parameter exists so that the module can refer back to it."""
    nn = _bnb_nn()
    if not isinstance(param, (nn.Params4bit, nn.Int8Params)):
        raise TypeError(f"expected a Params4bit or Int8Params, not {type(param).__name__}")
    if not (isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict)):
        raise TypeError("a bitsandbytes parameter's state must be (module, attributes)")
    module, extra = state
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(f"a Params4bit's module must be a Module, not {type(module).__name__}")
    if isinstance(param, nn.Params4bit):
        param.module = module
    for name, value in extra.items():
        setattr(param, _check_new_attribute(type(param), name), value)


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
    raise TypeError(
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
            raise TypeError(
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
    name = cls.__qualname__ if cls.__module__ == _NN and cls.__qualname__ in _MODULE_CLASSES else cls
    return rebuild_bnb_module, (name,), (state, relink, rearrange_keys, hooks), None, None, set_bnb_module_state


def _module_bases() -> tuple[type, ...]:
    nn = _bnb_nn()
    return tuple(getattr(nn, name) for name in _MODULE_BASES)


def rebuild_bnb_module(cls: str | type) -> Any:
    """An empty instance of a bitsandbytes layer class (``__init__`` is not called: its state follows)."""
    if isinstance(cls, str):
        if cls not in _MODULE_CLASSES:
            raise TypeError(f"{cls!r:.80} is not a bitsandbytes layer class this quirk rebuilds")
        cls = getattr(_bnb_nn(), cls)
    klass = _check_class(cls, torch.nn.Module, "a bitsandbytes layer class")
    if not issubclass(klass, _module_bases()):
        raise TypeError(f"{_type_key(klass)} is not a bitsandbytes Linear4bit or Linear8bitLt")
    return klass.__new__(klass)


def set_bnb_module_state(module: Any, state: tuple[Any, ...]) -> None:
    """Pickle's state setter for the layers: ``Module.__setstate__``, then what the reducer took apart."""
    if not issubclass(type(module), _module_bases()):  # (not isinstance: keep `module` typed Any)
        raise TypeError(f"expected a bitsandbytes Linear4bit or Linear8bitLt, not {type(module).__name__}")
    if not (isinstance(state, tuple) and len(state) == 4 and isinstance(state[0], dict)):
        raise TypeError("a bitsandbytes layer's state must be (dict, relink, rearrange keys, hooks)")
    fields, relink, rearrange_keys, hooks = state
    module.__setstate__(fields)
    if rearrange_keys:
        wrapped_hook = importlib.import_module("torch.nn.modules.module")._WrappedHook
        pre_hooks = module._load_state_dict_pre_hooks
        for key in rearrange_keys:
            if key in pre_hooks:
                pre_hooks[key] = wrapped_hook(_bnb_nn().maybe_rearrange_weight)
    if relink:
        module.quant_state = module.weight.quant_state
    if hooks is not None:
        _attach_hooks(module, hooks)


def _same_device(device: object, name: str) -> bool:
    """Whether accelerate's ``device`` (a ``torch.device``, a string, or an accelerator index) is ``name``."""
    try:
        target = torch.device(name)
        if isinstance(device, int):  # torch.device(0) needs an accelerator present; compare by hand
            return target.type != "cpu" and target.index == device
        return isinstance(device, (str, torch.device)) and torch.device(device) == target
    except RuntimeError:
        return False


def _attach_hooks(module: Any, record: object) -> None:
    """Attach accelerate ``AlignDevicesHook``s with the recorded settings, as ``dispatch_model`` did.

    A hook whose execution device was the device of the layer's weights follows the weights when the load's
    ``map_location`` moved them (a layer dumped on ``cuda:0`` and loaded with ``map_location="cpu"`` executes on
    the CPU, instead of being sent back to a GPU the loading machine may not have)."""
    if not (isinstance(record, dict) and isinstance(record.get("hooks"), list)):
        raise TypeError("accelerate hook settings must be a dict with a list of hooks")
    specs = record["hooks"]
    if not all(isinstance(s, dict) and set(s) <= _HOOK_SPEC_KEYS for s in specs):
        raise TypeError(f"accelerate hook settings may only name {sorted(_HOOK_SPEC_KEYS)}")
    try:
        accelerate_hooks = importlib.import_module("accelerate.hooks")
    except ImportError as e:
        raise ImportError(
            "this snapshot holds a bitsandbytes layer dispatched with accelerate hooks; loading it needs "
            "accelerate: pip install accelerate"
        ) from e
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


def register(registry: zerocopy_pickle.Registrar) -> None:
    """Register the bitsandbytes reducers by type name: this imports neither bitsandbytes nor accelerate."""
    registry.register_reducer(PARAMS4BIT, reduce_params4bit)
    registry.register_reducer(INT8PARAMS, reduce_int8params)
    registry.register_reducer(QUANT_STATE, reduce_quant_state)
    for name in _MODULE_BASES:  # subclasses (LinearFP4, LinearNF4, ...) are covered through their MRO
        registry.register_reducer(f"{_NN}:{name}", reduce_bnb_module)
    registry.add_safe_globals(
        rebuild_params4bit,
        rebuild_int8params,
        rebuild_quant_state,
        rebuild_bnb_module,
        set_param_state,
        set_bnb_module_state,
        # Constructors that only wrap the tensor they are given (an empty one by default): safe with any arguments.
        PARAMS4BIT,
        INT8PARAMS,
        # A dataclass of tensors and flags (Linear8bitLt.state), pickled by __dict__.
        MATMUL_LT_STATE,
    )
