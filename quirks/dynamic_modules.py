"""Dynamic module namespaces: code that diffusers and transformers import from the Hugging Face modules cache.

``DiffusionPipeline.from_pretrained(..., custom_pipeline=...)`` (or a ``model_index.json`` naming custom code) and
``AutoModel.from_pretrained(..., trust_remote_code=True)`` copy a repository's Python files into the modules
cache and import them under two synthetic top-level packages:

* ``diffusers_modules``: ``<HF_MODULES_CACHE>/diffusers_modules/local/<file>.py`` for a local folder (module
  ``diffusers_modules.local.<file>``), ``.../git/<name>.py`` for a community pipeline, and
  ``.../local/<user>--<repo>/<commit>/<file>.py`` for a Hub repository;
* ``transformers_modules``: ``<HF_MODULES_CACHE>/transformers_modules/<repo name>/<hash or commit>/<file>.py``,
  the repository name sanitized (``tiny-model`` becomes ``tiny_hyphen_model``).

Both libraries create an empty ``__init__.py`` at every level and append ``HF_MODULES_CACHE`` to ``sys.path``
(``init_hf_modules``), but only when ``from_pretrained`` runs: a fresh interpreter cannot import
``transformers_modules...`` at all, so a snapshot of such an object would not load there.

This plugin claims both namespaces (``Registrar.claim_modules``), so every snapshot that pickles a class or an
instance from them records the plugin; before such a snapshot is unpickled, its load hook
(:func:`prepare_namespaces`) registers each namespace whose folder exists in the cache as a package in
``sys.modules`` whose ``__path__`` is that folder. The rest is the ordinary import system: unpickling imports
``transformers_modules.<repo>.<hash>.modeling_x`` from the cache, relative imports included, exactly as
``from_pretrained`` left it.

The hook executes nothing (the namespace packages are created without running their empty ``__init__.py``) and
imports neither diffusers nor transformers: it reads their ``HF_MODULES_CACHE`` constant when the library is
already imported (that is the folder the library itself uses), and otherwise computes the path the way both
libraries do (``$HF_MODULES_CACHE``, else ``<HF_HOME>/modules`` with huggingface_hub's ``HF_HOME`` rule). It also
appends a finder to ``sys.meta_path`` that turns a missing module under either namespace into an error saying
which cache was searched and how to fill it. Classes from these namespaces are repository code: restricted loads
refuse them unless ``allow=`` names them (or ``trusted=True``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

from zerocopy_pickle.plugin import Registrar

__all__ = ["NAMESPACES", "default_modules_cache", "modules_cache", "prepare_namespaces", "register"]

PLUGIN = "dynamic-modules"

NAMESPACES = ("diffusers_modules", "transformers_modules")
"""The top-level packages diffusers and transformers import repository code into."""

# Where each library keeps its own copy of the cache path, read only if the library is already imported.
_LIBRARY_CONSTANT = {
    "diffusers_modules": ("diffusers.utils.constants", "HF_MODULES_CACHE"),
    "transformers_modules": ("transformers.utils.hub", "HF_MODULES_CACHE"),
}
_LIBRARY = {"diffusers_modules": "diffusers", "transformers_modules": "transformers"}

_lock = threading.Lock()


def default_modules_cache() -> str:
    """``HF_MODULES_CACHE`` as diffusers and transformers compute it when they are imported.

    Both do ``os.getenv("HF_MODULES_CACHE", os.path.join(HF_HOME, "modules"))`` with huggingface_hub's
    ``HF_HOME``: ``$HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``, with ``~`` and
    variables expanded. huggingface_hub's own value is used when it is already imported.
    """
    cache = os.getenv("HF_MODULES_CACHE")
    if cache is not None:
        return cache
    hub_constants = sys.modules.get("huggingface_hub.constants")
    hf_home = getattr(hub_constants, "HF_HOME", None)
    if not isinstance(hf_home, str):
        default_home = os.path.join(os.path.expanduser("~"), ".cache")
        hf_home = os.path.expandvars(
            os.path.expanduser(
                os.getenv("HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", default_home), "huggingface"))
            )
        )
    return os.path.join(hf_home, "modules")


def modules_cache(namespace: str) -> str:
    """The modules cache folder that holds ``namespace`` (one of :data:`NAMESPACES`), as an absolute path.

    The owning library's ``HF_MODULES_CACHE`` constant if that library is imported (never importing it),
    else :func:`default_modules_cache`.
    """
    module_name, attribute = _LIBRARY_CONSTANT[namespace]
    value = getattr(sys.modules.get(module_name), attribute, None)
    return os.path.abspath(value if isinstance(value, str) else default_modules_cache())


def _namespace_package(namespace: str, directory: str) -> ModuleType:
    # A package whose submodules are searched in `directory`; its (empty) __init__.py is not executed.
    spec = importlib.machinery.ModuleSpec(namespace, None, origin=directory, is_package=True)
    spec.submodule_search_locations = [directory]
    return importlib.util.module_from_spec(spec)


class _MissingDynamicModule:
    """Last on ``sys.meta_path``: reached only when no other finder found a module under a dynamic namespace,
    it raises an error that says which cache was searched and how to fill it."""

    def __init__(self, plugin: str) -> None:
        self.plugin = plugin

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        namespace = fullname.partition(".")[0]
        if namespace not in NAMESPACES:
            return None
        cache = modules_cache(namespace)
        library = _LIBRARY[namespace]
        how = (
            "AutoModel/AutoConfig.from_pretrained(..., trust_remote_code=True)"
            if library == "transformers"
            else "DiffusionPipeline.from_pretrained(..., custom_pipeline=..., trust_remote_code=True)"
        )
        raise ModuleNotFoundError(
            f"No module named {fullname!r} in the {library} modules cache {os.path.join(cache, namespace)} "
            f"(zerocopy_pickle plugin {self.plugin!r}): the snapshot needs repository code that {library} copied "
            f"there when it was loaded with {how}. Run that once on this machine, or point HF_MODULES_CACHE "
            f"(or HF_HOME) at a modules cache that holds it",
            name=fullname,
        )

    def invalidate_caches(self) -> None:
        """Nothing cached (``importlib.invalidate_caches`` calls this on every finder)."""


def prepare_namespaces(plugin: str = PLUGIN) -> None:
    """Register ``diffusers_modules`` and ``transformers_modules`` as packages over the modules cache.

    The load hook: idempotent, and cheap (a ``stat`` per namespace not yet imported). A namespace already in
    ``sys.modules`` (``from_pretrained`` ran in this process, or this hook did) is left alone; one whose folder
    does not exist is skipped (an import under it then fails with an error naming the cache searched).
    """
    with _lock:
        for namespace in NAMESPACES:
            if namespace in sys.modules:
                continue
            directory = os.path.join(modules_cache(namespace), namespace)
            if os.path.isdir(directory):
                sys.modules[namespace] = _namespace_package(namespace, directory)
        if not any(isinstance(finder, _MissingDynamicModule) for finder in sys.meta_path):
            sys.meta_path.append(_MissingDynamicModule(plugin))


def register(registry: Registrar) -> None:
    """Entry point of the ``dynamic-modules`` plugin: claim both namespaces and set the load hook."""
    name = registry.name
    registry.claim_modules(*NAMESPACES)
    registry.set_load_hook(lambda: prepare_namespaces(name))
