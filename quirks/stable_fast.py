"""stable-fast (``sfast``): modules traced through ``sfast.utils.flat_tensors``, made to survive ``torch.jit.save``.

stable-fast traces a module on flat tuples of tensors: ``flat_tensors.flattern`` turns arbitrary inputs and
outputs into tensors, and the ``TracedPosArgOnlyModuleWrapper`` around the traced module turns them back. A
dataclass (``UNet2DConditionOutput``, say) is flattened as its fields plus its *type*, and the type travels by
reference, in an ``ObjectTensor``: a tensor subclass carrying the Python class as an attribute. Traced, that
tensor becomes a constant of the TorchScript graph; ``torch.jit.save`` writes the tensor and drops the
attribute, so a loaded module's outputs can no longer be unflattened (``assert isinstance(t, ObjectTensor)``).

And sfast's ``better_trace`` / ``better_freeze`` attach a ``ScriptModuleClearHook`` to every module they return as
a TorchScript attribute of type ``PyObject``, which ``torch.jit.save`` refuses outright ("Unknown IValue type for
pickling: PyObject"): without a patch, no sfast-traced module can be saved at all.

This quirk patches sfast (Note [sfast clear hooks] for the second part):

* ``flatten_dataclass`` / ``unflatten_dataclass``: the type travels *inside* the flattened stream, as a tensor
  of the bytes of ``pickle.dumps(cls)`` (a reference: module and qualified name), which a graph constant keeps
  through ``torch.jit.save``. The layout is unchanged (one tensor where the ``ObjectTensor`` was), and the
  patched ``unflatten_dataclass`` still accepts an ``ObjectTensor``, so modules traced before the patch keep
  working in their process;
* ``better_trace`` / ``better_freeze``: the clear hooks are kept on the returned Python module instead.

When the patch applies, without ever importing ``sfast`` before its user does:

* at registration (the first dump or load of the process): at once for the sfast modules already imported, and
  through a ``sys.meta_path`` hook for the others, right after they are first imported (the hook then removes
  itself). Modules traced from then on save correctly. ``ensure_patched()`` does the same on demand: call it
  before sfast traces when the process has not used zerocopy_pickle yet;
* when a ``TracedPosArgOnlyModuleWrapper`` is dumped: the reducer patches, rewrites the graph constants of a
  module traced with sfast's own flattening (``ObjectTensor`` holding a dataclass -> the pickled type), and
  refuses, with a clear error, a module that carries sfast's clear hooks (traced before the patch);
* before a snapshot that used this plugin is loaded (load hook): imports ``sfast`` (its C++ extension registers
  the custom TorchScript operators its optimized graphs call) and patches.

The traced module itself is reduced by the ``torchscript`` quirk (``torch.jit.save``), so a snapshot holding one
loads only with ``trusted=True`` (see ``quirks/torchscript.py``). Unflattening a type reads a pickle, at call
time: :func:`class_from_bytes` accepts only a plain global reference (opcode by opcode) that resolves to a
dataclass, so the bytes cannot run anything but the import of the module that defines the class.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import io
import pickle
import pickletools
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from zerocopy_pickle.plugin import DumpError

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

    from zerocopy_pickle.plugin import Registrar

__all__ = [
    "FLAT_TENSORS",
    "WRAPPER_TARGET",
    "class_from_bytes",
    "class_to_bytes",
    "ensure_patched",
    "is_patched",
    "patch_flat_tensors",
    "reduce_traced_wrapper",
    "register",
    "rewrite_class_constants",
]

FLAT_TENSORS = "sfast.utils.flat_tensors"
WRAPPER_TARGET = "sfast.jit.trace_helper:TracedPosArgOnlyModuleWrapper"
_PATCHED = "__zerocopy_pickle_patched__"  # set on each sfast module once patched
_PICKLE_PROTOCOL = 4  # STACK_GLOBAL: nested qualified names; fixed, so the bytes of a type never change
_lock = threading.RLock()


# -- the type, as bytes ------------------------------------------------------------------------------------------

# A pickled class reference is exactly: PROTO, FRAME, two strings (module, qualified name) with their memo
# entries, STACK_GLOBAL, MEMOIZE, STOP. Anything else (a REDUCE, a BUILD...) would run code: refused.
_REFERENCE_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "UNICODE",
        "MEMOIZE",
        "PUT",
        "BINPUT",
        "LONG_BINPUT",
        "GLOBAL",
        "STACK_GLOBAL",
        "STOP",
    }
)


@functools.lru_cache(maxsize=256)
def class_to_bytes(cls: type) -> bytes:
    """``pickle.dumps(cls)``: a reference to a dataclass type by module and qualified name.

    Raises:
        pickle.PicklingError: ``cls`` cannot be pickled by reference (a local class, say).
    """
    data = pickle.dumps(cls, protocol=_PICKLE_PROTOCOL)
    _check_reference(data)
    return data


def _check_reference(data: bytes) -> None:
    try:
        opcodes = [op.name for op, _, _ in pickletools.genops(data)]
    except (ValueError, EOFError) as e:
        raise pickle.UnpicklingError(f"not a pickled class reference: {e}") from e
    unexpected = sorted(set(opcodes) - _REFERENCE_OPCODES)
    if unexpected or opcodes.count("STACK_GLOBAL") + opcodes.count("GLOBAL") != 1:
        raise pickle.UnpicklingError(f"not a pickled class reference (opcodes {unexpected or opcodes})")


class _DataclassUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        cls = super().find_class(module, name)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise pickle.UnpicklingError(f"{module}.{name} is not a dataclass type")
        return cls


@functools.lru_cache(maxsize=256)
def class_from_bytes(data: bytes) -> type:
    """The dataclass type :func:`class_to_bytes` wrote.

    Only a plain global reference is read, and it must name a dataclass: unpickling it imports the module that
    defines the class (as any pickle of it would) and runs nothing else.

    Raises:
        pickle.UnpicklingError: the bytes are anything else.
    """
    _check_reference(data)
    cls = _DataclassUnpickler(io.BytesIO(data)).load()
    assert isinstance(cls, type)
    return cls


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes :func:`class_to_bytes` wrote, from the tensor ``flatten_bytes`` made of them.

    Usually ``uint8``; a graph rewritten by :func:`rewrite_class_constants` may cast it on the way out (the
    constant it replaced was a float ``ObjectTensor``, and the trace recorded ``aten::to`` with that dtype), which
    keeps every value exact.

    Raises:
        ValueError: a value is not a byte.
    """
    values = tensor.detach().flatten().tolist()
    if not all(float(v).is_integer() for v in values):
        raise ValueError("not a byte tensor")
    return bytes(int(v) for v in values)  # ValueError for a value outside 0..255


# -- the patch ---------------------------------------------------------------------------------------------------


def _patched_functions(ft: Any) -> tuple[Any, Any]:
    original_flatten = ft.flatten_dataclass
    original_unflatten = ft.unflatten_dataclass

    def flatten_dataclass(obj: Any) -> tuple[torch.Tensor, ...]:
        """sfast's ``flatten_dataclass``, with the type as a pickled reference (see the module docstring)."""
        try:
            cls: type = type(obj)
            type_bytes = class_to_bytes(cls)
        except (pickle.PicklingError, AttributeError, TypeError):
            # Not importable by reference (a local class): sfast's own ObjectTensor, which works within this
            # process; dumping a module traced with it fails with a clear error (rewrite_class_constants).
            return tuple(original_flatten(obj))
        fields = {field.name: getattr(obj, field.name) for field in dataclasses.fields(obj)}
        return tuple(ft.flatten_bytes(type_bytes)) + tuple(ft.flatten_dict(fields))

    def unflatten_dataclass(tensors: Sequence[torch.Tensor], start: int) -> tuple[Any, int]:
        """sfast's ``unflatten_dataclass``, reading a pickled type, or an ``ObjectTensor`` (traced unpatched)."""
        head = tensors[start]
        if isinstance(head, ft.ObjectTensor) and head.get_value() is not None:
            restored: tuple[Any, int] = original_unflatten(tensors, start)  # traced unpatched, in its process
            return restored
        try:
            cls = class_from_bytes(_tensor_bytes(head))
        except (pickle.UnpicklingError, ValueError) as e:
            raise TypeError(
                "this stable-fast module lost the type of a dataclass it returns: it was traced before "
                "zerocopy_pickle patched sfast.utils.flat_tensors and saved with torch.jit.save outside "
                "zerocopy_pickle; call zerocopy_pickle_quirks.stable_fast.ensure_patched() before tracing it again"
            ) from e
        content, start = ft.unflatten_dict(tensors, start + 1)
        return cls(**content), start

    flatten_dataclass.__wrapped__ = original_flatten  # type: ignore[attr-defined]
    unflatten_dataclass.__wrapped__ = original_unflatten  # type: ignore[attr-defined]
    return flatten_dataclass, unflatten_dataclass


def patch_flat_tensors(ft: Any) -> bool:
    """Patch an imported ``sfast.utils.flat_tensors`` in place; True if this call patched it (idempotent).

    Callers of the two functions (``flatten_obj``, ``unflatten_tensors``) look them up as module globals at each
    call, so replacing the module's attributes is enough.
    """
    with _lock:
        if getattr(ft, _PATCHED, False):
            return False
        ft.flatten_dataclass, ft.unflatten_dataclass = _patched_functions(ft)
        setattr(ft, _PATCHED, True)
        return True


# Note [sfast clear hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# sfast's better_trace / better_freeze attach a ScriptModuleClearHook to every module they return, as a TorchScript
# attribute of type PyObject (its __del__ unregisters the module's class type from torch's global compilation
# unit, so that repeated tracing does not leak types). torch.jit.save cannot write a PyObject ("Unknown IValue type
# for pickling: PyObject"), and no torch API removes an attribute or clones a module without deep-copying it, so a
# module traced by unpatched sfast cannot be saved at all. Patched, the two functions keep the same hooks on the
# returned Python module instead: they run when it dies, which is when sfast's own would (the Python wrapper is
# what sfast's callers hold), and the TorchScript module carries nothing torch.jit.save refuses.
CLEAR_HOOK_ATTRIBUTE = "_sfast_module_registration_clear_hook"
_collecting = threading.local()


def _patch_jit_utils(utils: Any) -> bool:
    with _lock:
        if getattr(utils, _PATCHED, False):
            return False
        original_attach = utils.attach_script_module_clear_hook

        def attach_script_module_clear_hook(script_module: Any, attr_name: str = CLEAR_HOOK_ATTRIBUTE) -> None:
            """sfast's, except inside the patched better_trace / better_freeze (Note [sfast clear hooks])."""
            if not getattr(_collecting, "active", False):
                original_attach(script_module, attr_name)

        def keep_hooks_in_python(original: Any) -> Any:
            @functools.wraps(original)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                outer = getattr(_collecting, "active", False)
                _collecting.active = True
                try:
                    module = original(*args, **kwargs)
                finally:
                    _collecting.active = outer
                hooks = [utils.ScriptModuleClearHook(sub._c) for sub in module.modules() if hasattr(sub, "_c")]
                object.__setattr__(module, CLEAR_HOOK_ATTRIBUTE + "s", hooks)  # a Python attribute, not TorchScript
                return module

            return wrapper

        utils.attach_script_module_clear_hook = attach_script_module_clear_hook
        utils.better_trace = keep_hooks_in_python(utils.better_trace)
        utils.better_freeze = keep_hooks_in_python(utils.better_freeze)
        setattr(utils, _PATCHED, True)
        return True


def _patch_trace_helper(helper: Any) -> bool:
    # trace_helper binds better_trace with `from .utils import better_trace`: rebind it to the patched one.
    with _lock:
        utils = sys.modules.get("sfast.jit.utils")
        if utils is None or getattr(helper, _PATCHED, False):
            return False
        _patch_jit_utils(utils)
        helper.better_trace = utils.better_trace
        setattr(helper, _PATCHED, True)
        return True


_PATCHES: dict[str, Callable[[Any], bool]] = {  # (sfast modules: untyped)
    FLAT_TENSORS: patch_flat_tensors,
    "sfast.jit.utils": _patch_jit_utils,
    "sfast.jit.trace_helper": _patch_trace_helper,
}
"""What to patch in each sfast module, applied to each as soon as it is imported."""


def is_patched() -> bool:
    """Whether every sfast module this quirk patches is imported and patched."""
    return all(getattr(sys.modules.get(name), _PATCHED, False) for name in _PATCHES)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module; everything else is the real loader's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _PATCHES[module.__name__](module)
        if is_patched():
            _remove_import_hook()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package... (tracebacks, inspect)
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches each sfast module of :data:`_PATCHES` right after it is first imported, wherever it is found."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _PATCHES:
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, _PatchOnImport):
                continue
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec  # (a loader without exec_module: patched later, by the reducer or the load hook)


def _remove_import_hook() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _PatchOnImport)]


def ensure_patched() -> None:
    """Patch the sfast modules already imported, and the others as soon as they are. Imports nothing."""
    with _lock:
        for name, patch in _PATCHES.items():
            module = sys.modules.get(name)
            if module is not None:
                patch(module)
        if is_patched():
            _remove_import_hook()
        elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())


# -- modules traced before the patch -----------------------------------------------------------------------------


def _graphs(module: Any) -> list[Any]:
    """The graphs of every method of a ScriptModule and of its submodules."""
    graphs = []
    for _, submodule in module.named_modules():
        c_module = getattr(submodule, "_c", None)
        if c_module is None:
            continue
        for name in c_module._method_names():
            graphs.append(c_module._get_method(name).graph)
    return graphs


def rewrite_class_constants(module: Any) -> int:
    """Replace, in the graphs of a traced module, every constant ``ObjectTensor`` that holds a dataclass type
    (what sfast's unpatched ``flatten_dataclass`` leaves in a graph) by the pickled type, which
    ``torch.jit.save`` keeps. Returns how many were replaced. The module computes the same afterwards (the
    patched ``unflatten_dataclass`` reads either form).

    Raises:
        DumpError: a constant holds a type that cannot be pickled by reference (a local class).
    """
    ft = sys.modules.get(FLAT_TENSORS)
    if ft is None or not isinstance(module, torch.jit.ScriptModule):
        return 0
    replaced = 0
    for graph in _graphs(module):
        for node in graph.findAllNodes("prim::Constant"):
            if not node.hasAttribute("value") or node.kindOf("value") != "t":
                continue
            value = node.t("value")
            if not isinstance(value, ft.ObjectTensor):
                continue
            cls = value.get_value()
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                continue
            try:
                type_bytes = class_to_bytes(cls)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise DumpError(
                    f"a stable-fast traced module returns the dataclass {cls.__qualname__}, which cannot be "
                    f"pickled by reference ({e}); define it at module level"
                ) from e
            (encoded,) = ft.flatten_bytes(type_bytes)
            node.t_("value", encoded.to(value.device))
            replaced += 1
    return replaced


# -- reducer and hooks -------------------------------------------------------------------------------------------


def reduce_traced_wrapper(wrapper: Any) -> Any:
    """Prepare a ``TracedPosArgOnlyModuleWrapper`` for pickling, then let it pickle as the module it is.

    Patches sfast and rewrites its traced module's class constants (:func:`rewrite_class_constants`); the
    traced module itself then goes through the ``torchscript`` quirk. Returns NotImplemented: the wrapper is an
    ordinary ``nn.Module`` (this plugin is recorded in the snapshot through the ``sfast`` module claim).
    """
    ensure_patched()
    module = getattr(wrapper, "module", None)
    if isinstance(module, torch.jit.ScriptModule):
        c_modules: list[Any] = [getattr(sub, "_c", None) for sub in module.modules()]
        if any(c is not None and c.hasattr(CLEAR_HOOK_ATTRIBUTE) for c in c_modules):
            raise DumpError(
                "this stable-fast module was traced before zerocopy_pickle patched sfast: it carries sfast's clear "
                "hooks as PyObject attributes, which torch.jit.save cannot write (Note [sfast clear hooks] in "
                "zerocopy_pickle_quirks.stable_fast). Call zerocopy_pickle_quirks.stable_fast.ensure_patched() (or "
                "any zerocopy_pickle dump or load) before sfast traces, and trace again"
            )
        rewrite_class_constants(module)
    return NotImplemented


def load_hook() -> None:
    """Before a snapshot that used this plugin is unpickled: import sfast (its C++ extension registers the
    TorchScript operators its optimized graphs call) and patch ``flat_tensors``."""
    ensure_patched()
    importlib.import_module("sfast.jit.trace_helper")  # imports the other two; the import hook patches all three
    ensure_patched()  # in case a loader could not be wrapped


def register(registry: Registrar) -> None:
    """Register the stable-fast quirk (entry point ``stable-fast``). Imports no part of sfast."""
    # Every snapshot that pickles an sfast object records this plugin, so that loading it runs load_hook first.
    registry.claim_modules("sfast")
    registry.set_load_hook(load_hook)
    registry.register_reducer(WRAPPER_TARGET, reduce_traced_wrapper)
    ensure_patched()
