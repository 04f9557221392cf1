"""Internal: routing loaders through the cache: ``from_pretrained`` of diffusers and transformers, ``torch.load``,
``safetensors.torch.load_file``, and every patch point installed packages declare
(:mod:`zerocopy_pickle.cache.points`).

A patch point is ``"module:Class.method"`` (a classmethod, called on any subclass) or ``"module:function"``.
:func:`patch_all` patches the points whose modules are imported, and installs an import hook that patches the
others when their module is first imported: it works before or after ``import diffusers``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .._registry.registry import default_registry
from .client import cached_call
from .points import all_patch_points, split_point

_lock = threading.RLock()
_originals: dict[str, tuple[Any, str, Any]] = {}  # point -> (owner, attribute, original attribute value)
_pending: set[str] = set()
_options: dict[str, Any] = {"autostart": False}


def _install(point: str, module: ModuleType) -> None:
    if point in _originals:
        return
    qualname = split_point(point).qualname
    owner: Any = module
    *path, attribute = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = inspect.getattr_static(owner, attribute)
    if isinstance(original, classmethod):
        function = original.__func__

        def patched_method(cls: type, *args: Any, **kwargs: Any) -> Any:
            bound = function.__get__(cls, type(cls))
            return cached_call(point, cls, bound, args, kwargs, autostart=_options["autostart"])

        patched_method.__wrapped__ = function  # type: ignore[attr-defined]
        replacement: Any = classmethod(patched_method)
    elif callable(original):

        def patched_function(*args: Any, **kwargs: Any) -> Any:
            return cached_call(point, None, original, args, kwargs, autostart=_options["autostart"])

        patched_function.__wrapped__ = original  # type: ignore[attr-defined]
        replacement = patched_function
    else:
        return
    _originals[point] = (owner, attribute, original)
    setattr(owner, attribute, replacement)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches pending points right after their module is executed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        modules = {split_point(p).module for p in _pending}
        if fullname not in modules:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, wrapped: Any) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create: Callable[[Any], ModuleType | None] | None = getattr(self._wrapped, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        with _lock:
            for point in [p for p in _pending if split_point(p).module == module.__name__]:
                _pending.discard(point)
                _install(point, module)


_finder = _PatchOnImport()


def patch_all(points: Sequence[str] | None = None, *, autostart: bool = True) -> list[str]:
    """Route every patch point through the cache (now, or when its module is first imported). Also loads the
    installed plugins (entry-point discovery), which every routed call needs to pickle its arguments.

    Args:
        points: the patch points; default: :data:`DEFAULT_PATCH_POINTS` and those installed packages declare
            (:mod:`zerocopy_pickle.cache.points`).
        autostart: start ``zerocopy-pickle serve`` in the background when no server is running.

    Returns:
        The points patched so far (the others are patched on import).

    Examples:
        ```python
        from zerocopy_pickle import cache

        cache.patch_all()  # before or after importing diffusers / transformers; starts a server if none runs

        from transformers import AutoModelForCausalLM

        # The first call (in any process of this user) loads as usual and fills the cache in the background;
        # every later one gets the model from shared memory, copy-on-write.
        model = AutoModelForCausalLM.from_pretrained("/models/llama")
        ```

        Only some loaders, without starting a server (``zerocopy-pickle serve`` runs one):

        ```python
        cache.patch_all(["torch:load", "safetensors.torch:load_file"], autostart=False)
        ```
    """
    if points is None:
        points = all_patch_points()
    # Every routed call pickles its arguments for the key, which needs the plugins' reducers: load them now, while
    # the program sets up, rather than on the clock of its first model load (entry-point discovery imports every
    # plugin's registration module: tens of milliseconds).
    default_registry().ensure_discovered()
    with _lock:
        _options["autostart"] = autostart
        for point in points:
            module = sys.modules.get(split_point(point).module)
            if module is not None:
                _install(point, module)
            else:
                _pending.add(point)
        if _pending and _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        return sorted(_originals)


def unpatch_all() -> None:
    """Restore every patched loader and stop patching on import."""
    with _lock:
        for owner, attribute, original in _originals.values():
            setattr(owner, attribute, original)
        _originals.clear()
        _pending.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def patched_points() -> list[str]:
    """The patch points currently routed through the cache."""
    with _lock:
        return sorted(_originals)
