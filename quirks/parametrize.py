"""Parametrized modules (``torch.nn.utils.parametrize``): ``weight_norm``, ``spectral_norm``, ``orthogonal`` and any
``register_parametrization``.

Registering a parametrization replaces the module's class by one torch generates for that instance
(``type("Parametrized<Orig>", (Orig,), ...)`` in ``torch.nn.utils.parametrize``, importable by no name), whose
``__getstate__`` raises "Serialization of parametrized modules is only supported through state_dict()". Plain
pickle therefore refuses every model that holds one (transformers' ``Wav2Vec2Model``: its positional convolution
is weight-normed). This quirk reduces such a module to

* its original class (``type(m).__bases__[0]``, what ``parametrize.type_before_parametrizations`` returns),
* its ``__dict__`` with a placeholder (None) where ``_modules["parametrizations"]`` was, so the order of its
  submodules is kept,
* the ``parametrizations`` ``ModuleDict``'s names, its ``ParametrizationList`` objects and its ``training`` flag,

and rebuilds it with torch's own ``_inject_new_class`` / ``_inject_property`` (the same generated class, the
same properties: ``m.weight`` is computed through the parametrizations, ``parametrize.cached()``,
``remove_parametrizations`` and ``m.weight = X`` through ``right_inverse`` work as before). ``right_inverse`` is
never run at load: the saved originals are set as they were.

A ``ParametrizationList`` is reduced to its parametrization modules, its original tensors (``original``, or
``original0..N-1`` when the first ``right_inverse`` returned a sequence; Parameters stay Parameters and keep their
identity through the pickle memo, buffers stay buffers), ``is_tensor``, ``unsafe`` and ``training``. torch's own
parametrizations (``_WeightNorm``, ``_SpectralNorm`` with its ``_u``/``_v`` buffers, ``_Orthogonal``) travel by
name with their few checked fields, so a restricted load needs no ``allow=`` for them; any other parametrization
module (a user's) is pickled as the ordinary module it is, and a restricted load needs its class in ``allow=``.
Every tensor goes through the pickler: originals and buffers are zero-copy views of the snapshot.
Each load gets its own generated class, as each ``register_parametrization`` does.

Restricted loads: the rebuild functions and the state setter below are the quirk's safe globals. Each checks
the exact type and size of every argument first: the original class must be a class (metaclass ``type`` or
``abc.ABCMeta``) deriving from ``nn.Module`` with an ordinary ``__new__``, which only the load's ``allow=`` lets a
stream name; parametrization modules must be ``nn.Module`` instances; tensor names are identifiers of at most
128 characters that shadow nothing of the class or the module; counts must agree (``is_tensor`` with exactly one
original, lists of at most 64 parametrizations and originals); built-in parametrizations' fields come from fixed
schemas (the orthogonal map by member name, never resolved from the stream). Nothing from the stream is called:
torch's parametrization modules run only when the loaded module computes its weight, as they would in the
program that dumped it.

``weight_norm``'s load-state-dict pre-hook (a closure of torch's, which no stream can name) is left out, its
place kept, and rebuilt at load as an equivalent function of this module, so a state dict of the old
``weight_g``/``weight_v`` form still loads. Plain attributes others put on these modules (transformers marks
every module ``_is_hf_initialized``) travel with them and are set after checks: identifiers that shadow nothing.

Limits: a hook, a parameter or submodule of its own, or a tensor subclass as an original, on a
``ParametrizationList`` (or on a built-in parametrization) makes it travel as an ordinary module (trusted loads,
or ``allow=`` its class); hooks or tensors on the ``parametrizations`` ``ModuleDict``, or extra class attributes
on the generated class, are refused at dump. Another reference to ``m.parametrizations`` elsewhere in the graph
comes back as a separate ``ModuleDict`` (holding the same lists). The module reducer is registered on
``nn.Module`` (the generated classes share no other base), so a more specific reducer registered for the
original class (another quirk's layer) takes precedence over it.
"""

from __future__ import annotations

import abc
import collections
import functools
from typing import Any

import torch
from torch.nn.utils import parametrizations as torch_parametrizations
from torch.nn.utils import parametrize as torch_parametrize

from zerocopy_pickle.plugin import Registrar, Unpicklable, UnsafeArgumentError, validate

fail = validate.fail

# The rebuild functions and the state setter are named by every snapshot written with this quirk
# (``zerocopy_pickle_quirks.parametrize:<name>``): never rename or move one, nor change its arguments' meaning.
__all__ = [
    "ParametrizationRefused",
    "rebuild_builtin_parametrization",
    "rebuild_parametrization_list",
    "rebuild_parametrized_module",
    "reduce_builtin_parametrization",
    "reduce_parametrization_list",
    "reduce_parametrized_module",
    "register",
    "set_parametrized_state",
]

PLUGIN = "parametrize"
_PARAMETRIZE = "torch.nn.utils.parametrize"
_PARAMETRIZATIONS = "torch.nn.utils.parametrizations"
MODULE_TARGET = "torch.nn.modules.module:Module"
LIST_TARGET = f"{_PARAMETRIZE}:ParametrizationList"

MAX_NAME = 128
"""Longest tensor name a parametrized module may have in a snapshot."""
MAX_TENSORS = 4096
"""Most parametrized tensors one module may have."""
MAX_CHAIN = 64
"""Most parametrizations stacked on one tensor, and most originals one ``right_inverse`` may return."""
MAX_POWER_ITERATIONS = 1 << 16
"""Most power iterations a spectral norm may run per forward (torch's default is 1)."""

_Module = torch.nn.Module
_ModuleDict = torch.nn.ModuleDict
_ParametrizationList = torch_parametrize.ParametrizationList
_MODULE_METACLASSES = (type, abc.ABCMeta)
_DICTS = (dict, collections.OrderedDict)


class ParametrizationRefused(Unpicklable):
    """A parametrized module this quirk cannot snapshot faithfully (the message says what to do)."""


@functools.cache
def _fresh_module_state() -> dict[str, Any]:
    """The ``__dict__`` of a fresh ``nn.Module`` (its hook tables, ``training``...), read from torch itself."""
    return dict(vars(_Module()))


def _extra_attributes(module: Any, own: frozenset[str]) -> dict[str, Any] | None:
    """The attributes of ``module``'s ``__dict__`` beyond what a fresh ``nn.Module`` has and the fields in ``own``
    (transformers marks every module ``_is_hf_initialized``, say); None when the module is not plain: a hook
    table or the non-persistent set is not empty, ``training`` is not a bool, or an extra name is not an identifier
    that shadows nothing of the class."""
    state = vars(module)
    fresh = _fresh_module_state()
    extra: dict[str, Any] = {}
    for key, value in state.items():
        if key in own or key in ("training", "_parameters", "_buffers", "_modules"):
            continue
        if key in fresh:
            if value != fresh[key]:
                return None
        elif key.isidentifier() and not key.startswith("__") and not hasattr(type(module), key):
            extra[key] = value
        else:
            return None
    return extra if type(state.get("training")) is bool else None


def _set_extra(module: Any, extra: object, own: frozenset[str], where: str) -> None:
    """Set the checked extra attributes on a rebuilt module: identifiers of at most ``MAX_NAME`` characters that
    are none of a module's own attributes or ``own``, and shadow nothing of the class (a stream cannot replace
    ``forward``, ``_parameters`` or a property)."""
    table = validate.expect_str_dict(extra, where, "extra attributes", max_len=256)
    validate.charge(len(table), where)
    reserved = _fresh_module_state().keys() | own
    for name in table:
        validate.expect_str(name, where, "attribute name", max_len=MAX_NAME)
        if not name.isidentifier() or name.startswith("__") or name in reserved or hasattr(type(module), name):
            fail(where, f"refusing to set attribute {name[:80]!r} on a {type(module).__qualname__}")
    for name, value in table.items():
        module.__dict__[name] = value


def _type_has(obj: object, base: type) -> bool:
    """Whether ``base`` is in the MRO of ``obj``'s real type (``isinstance`` would ask ``obj.__class__``)."""
    return base in type(obj).__mro__


def _type_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# -- torch's own parametrizations, by name ---------------------------------------------------------------------

_ORTH_MAPS = tuple(member.name for member in torch_parametrizations._OrthMaps)
# name -> (class, required attributes, optional attributes, buffers that come all together or not at all)
_BUILTIN: dict[str, tuple[type, frozenset[str], frozenset[str], tuple[str, ...]]] = {
    "_WeightNorm": (torch_parametrizations._WeightNorm, frozenset({"dim"}), frozenset(), ()),
    "_SpectralNorm": (
        torch_parametrizations._SpectralNorm,
        frozenset({"dim", "eps"}),
        frozenset({"n_power_iterations"}),
        ("_u", "_v"),
    ),
    "_Orthogonal": (torch_parametrizations._Orthogonal, frozenset({"shape", "orthogonal_map"}), frozenset(), ("base",)),
}


def reduce_builtin_parametrization(module: Any) -> Any:
    """torch's ``_WeightNorm``, ``_SpectralNorm`` or ``_Orthogonal`` as ``(kind, training, fields, buffers)``;
    NotImplemented (an ordinary module: ``allow=`` its class) for a subclass, or one with hooks, parameters,
    submodules or attributes of its own."""
    cls = type(module)
    kind = cls.__qualname__
    entry = _BUILTIN.get(kind)
    if entry is None or entry[0] is not cls:
        return NotImplemented
    _, required, optional, buffer_names = entry
    state = vars(module)
    own = required | optional | frozenset(buffer_names)
    extra = _extra_attributes(module, own)
    if extra is None or state["_parameters"] or state["_modules"]:
        return NotImplemented
    buffers = state["_buffers"]
    if set(buffers) not in (set(), set(buffer_names)) or any(
        value is not None and type(value) is not torch.Tensor for value in buffers.values()
    ):
        return NotImplemented
    if any(name in state for name in buffer_names):
        return NotImplemented  # a plain attribute named like one of its buffers
    fields = {key: state[key] for key in required | optional if key in state}
    if kind == "_Orthogonal":
        if type(fields.get("orthogonal_map")) is not torch_parametrizations._OrthMaps:
            return NotImplemented
        fields["shape"] = tuple(fields["shape"]) if isinstance(fields.get("shape"), tuple) else fields.get("shape")
        fields["orthogonal_map"] = fields["orthogonal_map"].name
    try:  # what the rebuild would refuse (a changed field) travels as an ordinary module instead
        table = validate.expect_keys(fields, required | optional, "parametrize", "fields")
        if required - set(table):
            return NotImplemented
        _check_builtin_fields(kind, table, dict(buffers), "parametrize")
    except UnsafeArgumentError:
        return NotImplemented
    return rebuild_builtin_parametrization, (kind, state["training"], fields, dict(buffers), extra)


def _check_builtin_fields(kind: str, fields: dict[str, Any], buffers: dict[str, Any], where: str) -> dict[str, Any]:
    """The fields of one of torch's parametrizations, checked against its schema; returned as they are set."""
    checked = dict(fields)
    if kind == "_WeightNorm":
        validate.expect_int(fields["dim"], where, "dim", -validate.MAX_DIMS, validate.MAX_DIMS)
    elif kind == "_SpectralNorm":
        validate.expect_int(fields["dim"], where, "dim", 0, validate.MAX_DIMS)
        checked["eps"] = validate.expect_float(fields["eps"], where, "eps", 0.0)
        has_iterations = "n_power_iterations" in fields
        if has_iterations:
            validate.expect_int(fields["n_power_iterations"], where, "n_power_iterations", 1, MAX_POWER_ITERATIONS)
        if has_iterations != bool(buffers):
            fail(where, "a spectral norm has n_power_iterations exactly when it has its _u and _v buffers")
        if buffers:
            u = validate.expect_tensor(buffers["_u"], where, "_u", dim=1)
            v = validate.expect_tensor(buffers["_v"], where, "_v", dim=1)
            if not (u.dtype.is_floating_point or u.dtype.is_complex) or v.dtype != u.dtype or v.device != u.device:
                fail(where, f"_u and _v must be floating vectors of one dtype and device, not {u.dtype}/{v.dtype}")
    else:
        checked["shape"] = torch.Size(validate.expect_int_tuple(fields["shape"], where, "shape"))
        name = validate.expect_choice(fields["orthogonal_map"], _ORTH_MAPS, where, "orthogonal_map")
        checked["orthogonal_map"] = torch_parametrizations._OrthMaps[name]
        base = buffers.get("base")
        if base is not None:
            validate.expect_tensor(base, where, "base")
            if base.dim() < 2:
                fail(where, f"base must be a matrix (or a batch of them), not {base.dim()}-dimensional")
    return checked


def rebuild_builtin_parametrization(
    kind: str, training: bool, fields: dict[str, Any], buffers: dict[str, Any], extra: dict[str, Any]
) -> Any:
    """One of torch's parametrization modules, by class name from a fixed table, its fields set without running
    ``__init__`` (which would draw new random ``_u``/``_v`` vectors)."""
    where = "parametrize rebuild_builtin_parametrization"
    validate.expect_choice(kind, tuple(_BUILTIN), where, "parametrization")
    cls, required, optional, buffer_names = _BUILTIN[kind]
    validate.expect_bool(training, where, "training")
    table = validate.expect_keys(fields, required | optional, where, "fields")
    missing = sorted(required - set(table))
    if missing:
        fail(where, f"a {kind} needs the field(s) {missing}")
    present = validate.expect_keys(buffers, frozenset(buffer_names), where, "buffers")
    if present and len(present) != len(buffer_names):
        fail(where, f"a {kind} has all of the buffers {list(buffer_names)} or none")
    checked = _check_builtin_fields(kind, table, present, where)
    validate.expect_str_dict(extra, where, "extra attributes", max_len=256)
    module: Any = object.__new__(cls)
    _Module.__init__(module)
    for name, value in checked.items():
        object.__setattr__(module, name, value)
    for name in buffer_names:
        if name in present:
            module._buffers[name] = present[name]
    module.training = training
    _set_extra(module, extra, required | optional | frozenset(buffer_names), where)
    return module


# -- ParametrizationList -----------------------------------------------------------------------------------------

_LIST_FIELDS = frozenset({"unsafe", "is_tensor", "ntensors"})


def _original_names(is_tensor: bool, count: int) -> list[str]:
    return ["original"] if is_tensor else [f"original{i}" for i in range(count)]


def _list_args(plist: Any) -> tuple[Any, ...] | None:
    """``(modules, originals, is_tensor, unsafe, training)`` of a ``ParametrizationList`` torch made, else None."""
    state = vars(plist)
    extra = _extra_attributes(plist, _LIST_FIELDS)
    if extra is None or not set(state) >= _LIST_FIELDS:
        return None
    is_tensor, ntensors, unsafe = state["is_tensor"], state["ntensors"], state["unsafe"]
    if type(is_tensor) is not bool or type(unsafe) is not bool or type(ntensors) is not int:
        return None
    if not 1 <= ntensors <= MAX_CHAIN or (is_tensor and ntensors != 1):
        return None
    names = _original_names(is_tensor, ntensors)
    params, buffers = state["_parameters"], state["_buffers"]
    if set(params) | set(buffers) != set(names) or set(params) & set(buffers):
        return None
    originals = []
    for name in names:
        tensor = params[name] if name in params else buffers[name]
        if type(tensor) is not (torch.nn.Parameter if name in params else torch.Tensor):
            return None  # a tensor subclass, or a Parameter kept as a buffer: not what torch registers
        originals.append(tensor)
    modules = state["_modules"]
    if not 1 <= len(modules) <= MAX_CHAIN or list(modules) != [str(i) for i in range(len(modules))]:
        return None
    if any(not _type_has(m, _Module) for m in modules.values()):
        return None
    return list(modules.values()), tuple(originals), is_tensor, unsafe, state["training"], extra


def reduce_parametrization_list(plist: Any) -> Any:
    """A ``ParametrizationList`` as its modules, originals and flags; NotImplemented (an ordinary module, whose
    class a restricted load then needs in ``allow=``) for a subclass or one carrying hooks or extra attributes."""
    if type(plist) is not _ParametrizationList:
        return NotImplemented
    args = _list_args(plist)
    return NotImplemented if args is None else (rebuild_parametrization_list, args)


def rebuild_parametrization_list(
    modules: list[Any],
    originals: tuple[Any, ...],
    is_tensor: bool,
    unsafe: bool,
    training: bool,
    extra: dict[str, Any],
) -> Any:
    """A ``ParametrizationList`` holding ``modules`` (the parametrizations, first to last) and the original
    tensors as they were saved: its ``__init__`` is not run (it would call ``right_inverse`` on them again)."""
    where = "parametrize rebuild_parametrization_list"
    if type(modules) is not list or not 1 <= len(modules) <= MAX_CHAIN:
        fail(where, f"modules must be a list of 1 to {MAX_CHAIN} parametrization modules")
    if type(originals) is not tuple or not 1 <= len(originals) <= MAX_CHAIN:
        fail(where, f"originals must be a tuple of 1 to {MAX_CHAIN} tensors")
    validate.expect_bool(is_tensor, where, "is_tensor")
    validate.expect_bool(unsafe, where, "unsafe")
    validate.expect_bool(training, where, "training")
    validate.expect_str_dict(extra, where, "extra attributes", max_len=256)
    validate.charge(len(modules) + len(originals), where)
    for i, module in enumerate(modules):
        if not _type_has(module, _Module):
            fail(where, f"modules[{i}] must be an nn.Module, not {type(module).__qualname__}")
    for i, tensor in enumerate(originals):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            fail(where, f"originals[{i}] must be a torch.Tensor or a Parameter, not {type(tensor).__qualname__}")
    if is_tensor and len(originals) != 1:
        fail(where, f"is_tensor=True takes exactly one original tensor, not {len(originals)}")
    plist = object.__new__(_ParametrizationList)
    _Module.__init__(plist)
    for i, module in enumerate(modules):
        plist._modules[str(i)] = module
    plist.unsafe = unsafe
    plist.is_tensor = is_tensor
    plist.ntensors = len(originals)
    for name, tensor in zip(_original_names(is_tensor, len(originals)), originals, strict=True):
        if type(tensor) is torch.nn.Parameter:
            plist._parameters[name] = tensor
        else:
            plist._buffers[name] = tensor
    plist.training = training
    _set_extra(plist, extra, _LIST_FIELDS | frozenset(_original_names(is_tensor, len(originals))), where)
    return plist


def _check_list(plist: object, where: str, what: str) -> None:
    """``plist`` is a filled ``ParametrizationList`` whose counts agree: what ``get_parametrized`` relies on."""
    if type(plist) is not _ParametrizationList:
        fail(where, f"{what} must be a ParametrizationList, not {type(plist).__qualname__}")
    state = vars(plist)
    is_tensor, ntensors = state.get("is_tensor"), state.get("ntensors")
    if type(is_tensor) is not bool or type(ntensors) is not int or not 1 <= ntensors <= MAX_CHAIN:
        fail(where, f"{what} is not a filled ParametrizationList (is_tensor, ntensors)")
    if is_tensor and ntensors != 1:
        fail(where, f"{what} has is_tensor=True and {ntensors} originals")
    # Exact str keys (expect_str_dict) before any set or sort: no key's own __hash__, __eq__ or __lt__ runs.
    params = validate.expect_str_dict(state.get("_parameters"), where, f"{what}'s parameters", max_len=MAX_CHAIN)
    buffers = validate.expect_str_dict(state.get("_buffers"), where, f"{what}'s buffers", max_len=MAX_CHAIN)
    modules = validate.expect_str_dict(state.get("_modules"), where, f"{what}'s parametrizations", max_len=MAX_CHAIN)
    validate.charge(len(params) + len(buffers) + len(modules), where)
    names = _original_names(is_tensor, ntensors)
    if sorted(set(params) | set(buffers)) != sorted(names) or set(params) & set(buffers):
        fail(where, f"{what} must hold exactly the originals {names}, not {sorted(set(params) | set(buffers))[:8]}")
    if not 1 <= len(modules) <= MAX_CHAIN or list(modules) != [str(i) for i in range(len(modules))]:
        fail(where, f"{what} must hold 1 to {MAX_CHAIN} parametrizations named 0, 1, ...")
    for key, module in modules.items():
        if not _type_has(module, _Module):
            fail(where, f"{what}[{key}] must be an nn.Module, not {type(module).__qualname__}")


# -- the parametrized module -------------------------------------------------------------------------------------


def _weight_norm_compat_hook(
    name: str,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """What ``weight_norm``'s load-state-dict pre-hook does (a closure over ``name`` in torch, which no stream can
    name): a state dict of the old ``weight_g``/``weight_v`` form loads into the parametrized module."""
    g_key, v_key = f"{prefix}{name}_g", f"{prefix}{name}_v"
    if g_key in state_dict and v_key in state_dict:
        original0 = state_dict.pop(g_key)
        original1 = state_dict.pop(v_key)
        state_dict[f"{prefix}parametrizations.{name}.original0"] = original0
        state_dict[f"{prefix}parametrizations.{name}.original1"] = original1


def _compat_hook_name(wrapped: object) -> str | None:
    """The tensor name of ``weight_norm``'s load-state-dict pre-hook (torch's closure, or this quirk's rebuilt
    one) held by ``wrapped``, a torch ``_WrappedHook``; None for any other hook."""
    if type(wrapped).__name__ != "_WrappedHook" or vars(wrapped).get("with_module") is not False:
        return None
    hook = vars(wrapped).get("hook")
    if isinstance(hook, functools.partial):
        ok = hook.func is _weight_norm_compat_hook and len(hook.args) == 1 and not hook.keywords
        return hook.args[0] if ok and type(hook.args[0]) is str else None
    code = getattr(hook, "__code__", None)
    closure: Any = getattr(hook, "__closure__", None)
    if (
        getattr(hook, "__module__", None) != _PARAMETRIZATIONS
        or getattr(hook, "__qualname__", None) != "weight_norm.<locals>._weight_norm_compat_hook"
        or code is None
        or code.co_freevars != ("name",)
        or closure is None
    ):
        return None
    name = closure[0].cell_contents
    return name if type(name) is str else None


def _generated_class(cls: type) -> bool:
    """Whether ``cls`` is a class torch's ``_inject_new_class`` made."""
    return (
        cls.__module__ == _PARAMETRIZE
        and cls.__qualname__.startswith("Parametrized")
        and len(cls.__bases__) == 1
        and "__getstate__" in vars(cls)
    )


def reduce_parametrized_module(module: Any) -> Any:
    """A module of a class torch generated for its parametrizations, as its original class, its state and its
    parametrizations; NotImplemented for any other module (pickled as usual)."""
    cls = type(module)
    if not _generated_class(cls):
        return NotImplemented
    original = cls.__bases__[0]
    state = dict(vars(module))
    name = f"{original.__module__}.{original.__qualname__}"
    modules: Any = state.get("_modules")
    pdict = modules.get("parametrizations") if isinstance(modules, dict) else None
    if type(pdict) is not _ModuleDict:
        raise ParametrizationRefused(
            f"{name} has a parametrized class but no parametrizations ModuleDict: it was changed after "
            f"register_parametrization. Call torch.nn.utils.parametrize.remove_parametrizations on it, or save its "
            f"state_dict()"
        )
    names = tuple(pdict._modules)
    extra = sorted(key for key in vars(cls) if not (key.startswith("__") and key.endswith("__")) and key not in names)
    if extra:
        raise ParametrizationRefused(
            f"the parametrized class of {name} has attributes torch does not put there ({extra[:8]}): set them on "
            f"{original.__qualname__} or on the instance before dumping"
        )
    dict_extra = _extra_attributes(pdict, frozenset())
    if dict_extra is None or pdict._parameters or pdict._buffers:
        raise ParametrizationRefused(
            f"the parametrizations ModuleDict of {name} carries hooks, tensors or attributes of its own, which "
            f"this quirk does not carry: remove them before dumping"
        )
    plists = tuple(pdict._modules.values())
    table = type(modules)(modules)
    table["parametrizations"] = None  # a placeholder: keeps the submodules' order
    state["_modules"] = table
    # weight_norm's compatibility pre-hook is a closure no stream can name: a placeholder, rebuilt at load.
    compat: list[tuple[int, str]] = []
    pre_hooks = state.get("_load_state_dict_pre_hooks")
    if isinstance(pre_hooks, dict):
        for key, wrapped in pre_hooks.items():
            hook_name = _compat_hook_name(wrapped)
            if hook_name is not None and type(key) is int and hook_name in names:
                compat.append((key, hook_name))
        if compat:
            placeholders = {key for key, _ in compat}
            state["_load_state_dict_pre_hooks"] = type(pre_hooks)(
                (key, None if key in placeholders else value) for key, value in pre_hooks.items()
            )
    return (
        rebuild_parametrized_module,
        (original,),
        (state, names, plists, pdict.training, tuple(compat), dict_extra),
        None,
        None,
        set_parametrized_state,
    )


def rebuild_parametrized_module(cls: type) -> Any:
    """An empty instance of ``cls`` (the module's original class, which only the load's ``allow=`` lets a
    restricted stream name); :func:`set_parametrized_state` fills it and gives it its parametrized class."""
    where = "parametrize rebuild_parametrized_module"
    if type(cls) not in _MODULE_METACLASSES:
        fail(where, f"the module class must be a class, not {type(cls).__qualname__}")
    if _Module not in cls.__mro__:
        fail(where, f"{_type_key(cls)} is not an nn.Module class")
    if cls is _ParametrizationList or _generated_class(cls):
        fail(where, f"{_type_key(cls)} cannot be the original class of a parametrized module")
    new: object = cls.__new__
    if new is not object.__new__:
        fail(where, f"{_type_key(cls)} defines __new__")
    return object.__new__(cls)


def _check_names(names: object, where: str) -> tuple[str, ...]:
    if type(names) is not tuple or not 1 <= len(names) <= MAX_TENSORS:
        fail(where, f"the parametrized tensor names must be a tuple of 1 to {MAX_TENSORS} str")
    seen: set[str] = set()
    for name in names:
        validate.expect_str(name, where, "tensor name", max_len=MAX_NAME)
        if not name.isidentifier() or name.startswith("__") or name == "parametrizations":
            fail(where, f"{name[:80]!r} is not a tensor name (an identifier, not a dunder or 'parametrizations')")
        if name in seen:
            fail(where, f"the tensor name {name!r} appears twice")
        seen.add(name)
    return names


def set_parametrized_state(module: Any, state: tuple[Any, ...]) -> None:
    """Pickle's state setter for :func:`rebuild_parametrized_module`: the module's ``__dict__`` (through its class's
    ``__setstate__``, as pickle's BUILD would), a new ``parametrizations`` ``ModuleDict`` of the checked lists in
    its saved place, then torch's own generated class and one property per parametrized tensor."""
    where = "parametrize set_parametrized_state"
    if not _type_has(module, _Module):
        fail(where, f"expected a module, not {type(module).__qualname__}")
    if type(state) is not tuple or len(state) != 6:
        fail(
            where,
            "the state must be a tuple (fields, tensor names, parametrization lists, training, pre-hooks, "
            "the ModuleDict's extra attributes)",
        )
    fields, names, plists, training, compat, dict_extra = state
    fields = validate.expect_str_dict(fields, where, "the module's attributes", max_len=1 << 16)
    names = _check_names(names, where)
    if type(plists) is not tuple or len(plists) != len(names):
        fail(where, f"expected one ParametrizationList per tensor name ({len(names)}), as a tuple")
    validate.expect_bool(training, where, "the parametrizations' training flag")
    if type(compat) is not tuple or len(compat) > len(names):
        fail(where, "the weight_norm pre-hooks must be a tuple of at most one (key, tensor name) per tensor")
    for entry in compat:
        if type(entry) is not tuple or len(entry) != 2:
            fail(where, "each weight_norm pre-hook must be a (key, tensor name) pair")
        validate.expect_int(entry[0], where, "pre-hook key", 0, validate.MAX_ELEMENTS)
        if type(entry[1]) is not str or entry[1] not in names:
            fail(where, f"a weight_norm pre-hook names {entry[1]!r:.80}, which is not a parametrized tensor")
    cls = type(module)
    if vars(module) or _generated_class(cls) or cls is _ParametrizationList:
        fail(where, "the module must be an empty one rebuild_parametrized_module built")
    validate.charge(len(fields) + 2 * len(names), where)
    if len({id(plist) for plist in plists}) != len(plists):
        fail(where, "one ParametrizationList is given for two tensors")
    for name, plist in zip(names, plists, strict=True):
        _check_list(plist, where, f"the parametrizations of {name!r}")
    fields = dict(fields)
    for key in ("_parameters", "_buffers", "_modules"):
        table = validate.expect_str_dict(fields.get(key), where, f"the module's {key}")
        validate.charge(len(table), where)
        fields[key] = type(table)(table)  # a copy: the stream keeps its own dict and could change it later
    if compat:
        pre_hooks = fields.get("_load_state_dict_pre_hooks")
        if type(pre_hooks) not in _DICTS:
            fail(where, "the module's _load_state_dict_pre_hooks must be a dict")
        assert isinstance(pre_hooks, dict)
        validate.charge(len(pre_hooks), where)
        if any(type(key) is not int for key in pre_hooks):  # handle ids: no key's own __eq__ runs in the lookups
            fail(where, "the module's _load_state_dict_pre_hooks must be keyed by int handle ids")
        pre_hooks = type(pre_hooks)(pre_hooks)
        wrapped_hook = torch.nn.modules.module._WrappedHook
        for key, name in compat:
            if key not in pre_hooks or pre_hooks[key] is not None:
                fail(where, f"the module's _load_state_dict_pre_hooks has no placeholder at {key}")
            pre_hooks[key] = wrapped_hook(functools.partial(_weight_norm_compat_hook, name))
        fields["_load_state_dict_pre_hooks"] = pre_hooks
    submodules = fields["_modules"]
    if "parametrizations" not in submodules or submodules["parametrizations"] is not None:
        fail(where, "the module's _modules must hold the placeholder None under 'parametrizations'")
    if "parametrizations" in fields:
        fail(where, "the module's attributes must not hold 'parametrizations'")
    for name in names:
        if name in fields or any(name in fields[key] for key in ("_parameters", "_buffers", "_modules")):
            fail(where, f"the tensor name {name!r} is also an attribute, parameter, buffer or submodule")
        if hasattr(cls, name):
            fail(where, f"the tensor name {name!r} would shadow {cls.__qualname__}.{name}")
    pdict = _ModuleDict()
    for name, plist in zip(names, plists, strict=True):
        pdict._modules[name] = plist
    pdict.training = training
    _set_extra(pdict, dict_extra, frozenset(), where)
    submodules["parametrizations"] = pdict
    module.__setstate__(fields)
    torch_parametrize._inject_new_class(module)
    for name in names:
        torch_parametrize._inject_property(module, name)


# -- registration ----------------------------------------------------------------------------------------------

SAFE_GLOBALS = (
    rebuild_parametrized_module,
    set_parametrized_state,
    rebuild_parametrization_list,
    rebuild_builtin_parametrization,
)
"""What the reduced streams call in restricted loads; each checks every argument's exact type and size first."""


def register(registry: Registrar) -> None:
    """Entry point of the ``parametrize`` plugin.

    The generated classes have no common base and no importable name, so the module reducer is registered on
    ``nn.Module`` and answers NotImplemented (pickle as usual) for every module whose class torch did not
    generate; more specific registrations (other quirks' layer classes) still win through the MRO lookup."""
    registry.register_reducer(MODULE_TARGET, reduce_parametrized_module)
    registry.register_reducer(LIST_TARGET, reduce_parametrization_list)
    for name in _BUILTIN:
        registry.register_reducer(f"{_PARAMETRIZATIONS}:{name}", reduce_builtin_parametrization)
    registry.add_safe_globals(*SAFE_GLOBALS)
