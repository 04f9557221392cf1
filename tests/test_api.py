"""The public surface: names, types, docs, packaging, and round trips through a fresh interpreter."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import pickle
import pkgutil
from pathlib import Path

import pytest

import zerocopy_pickle as zp

from .conftest import REPO, run_python

PUBLIC = {
    "dump", "load", "dumps", "loads", "freeze", "scan", "Snapshot", "ZeroCopyPickler", "ZeroCopyUnpickler",
    "ZeroCopyPickleError", "SnapshotError", "DumpError", "RestrictedLoadError", "DeviceError", "ArgumentError",
    "PluginError", "PluginWarning", "Reducer", "Registrar", "register_reducer", "unregister_reducer", "reducers",
    "Registry", "default_registry", "TrustedOnlyWarning",
    "BACKENDS", "read_header", "IntegrityError", "Unpicklable", "MissingGlobalError",
    "UnsafeArgumentError", "allow_function", "to_device", "__version__", "prefetch", "prefetches", "Prefetch",
}  # fmt: skip


def test_all_is_exactly_the_public_api() -> None:
    assert set(zp.__all__) == PUBLIC
    for name in zp.__all__:
        assert hasattr(zp, name), name


def test_public_callables_are_documented_and_typed() -> None:
    for name in PUBLIC - {"__version__", "BACKENDS"}:
        obj = getattr(zp, name)
        assert inspect.getdoc(obj), name
        if inspect.isfunction(obj):
            hints = inspect.get_annotations(obj)
            assert "return" in hints, name
    for method in ("open", "from_fd", "load", "close"):
        assert inspect.getdoc(getattr(zp.Snapshot, method)), method


def test_error_hierarchy() -> None:
    assert issubclass(zp.SnapshotError, ValueError)
    assert issubclass(zp.RestrictedLoadError, pickle.UnpicklingError)
    assert issubclass(zp.DumpError, pickle.PicklingError)
    assert issubclass(zp.DeviceError, RuntimeError)
    assert issubclass(zp.ArgumentError, ValueError)
    assert issubclass(zp.PluginError, ImportError)
    assert issubclass(zp.MissingGlobalError, (zp.SnapshotError, ImportError))
    for error in (
        zp.SnapshotError,
        zp.RestrictedLoadError,
        zp.DumpError,
        zp.DeviceError,
        zp.ArgumentError,
        zp.PluginError,
        zp.MissingGlobalError,
    ):
        assert issubclass(error, zp.ZeroCopyPickleError)


def test_no_public_name_shadows_a_submodule() -> None:
    """``import zerocopy_pickle.X as x`` never gives an object the package binds over a submodule named X: each
    top-level name is either a submodule itself or no submodule has its name (``zp.reducers``, the function, once
    hid the reducer table's module ``reducers.py``)."""
    submodules = {info.name for info in pkgutil.iter_modules(zp.__path__)}
    for name in zp.__all__:
        value = getattr(zp, name)
        if name in submodules:
            assert inspect.ismodule(value), f"zerocopy_pickle.{name} is a {type(value).__name__} over a submodule"
    assert callable(zp.reducers)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("zerocopy_pickle.reducers")


def test_version_matches_distribution_metadata() -> None:
    assert importlib.metadata.version("zerocopy-pickle") == zp.__version__


def test_py_typed_is_shipped() -> None:
    assert (Path(zp.__file__).parent / "py.typed").is_file()
    files = importlib.metadata.files("zerocopy-pickle") or []
    assert any(str(f).endswith("py.typed") for f in files) or (Path(zp.__file__).parent / "py.typed").exists()


def test_console_script_entry_point() -> None:
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("zerocopy-pickle") == "zerocopy_pickle._cli:main"


@pytest.mark.slow
def test_import_pulls_in_no_optional_dependency() -> None:
    code = """
    import sys
    import torch  # torch itself imports dill when it is installed: count only what zerocopy_pickle adds
    before = set(sys.modules)
    import zerocopy_pickle
    heavy = ("safetensors", "matplotlib", "dill", "cloudpickle", "transformers", "diffusers", "xxhash", "numpy")
    print([m for m in set(sys.modules) - before if m.split(".")[0] in heavy])
    """
    assert run_python(code).stdout.strip() == "[]"


@pytest.mark.slow
def test_dump_in_one_interpreter_load_in_another(tmp_path: Path) -> None:
    path = tmp_path / "cross.zcp"
    run_python(
        """
        import sys, torch, zerocopy_pickle as zp
        from tests.conftest import TiedNet
        torch.manual_seed(0)
        zp.dump({"model": TiedNet().eval(), "t": torch.arange(5)}, sys.argv[1])
        """,
        str(path),
    )
    out = (
        run_python(
            """
        import sys, torch, zerocopy_pickle as zp
        from tests.conftest import TiedNet, TIED_NET_ALLOW
        obj = zp.load(sys.argv[1], allow=TIED_NET_ALLOW)
        torch.manual_seed(0)
        reference = TiedNet().eval()
        tokens = torch.tensor([[1, 2, 3]])
        model = obj["model"]
        print(torch.equal(model(tokens), reference(tokens)), model.head.weight is model.embed.weight, obj["t"].tolist())
        """,
            str(path),
        )
        .stdout.strip()
        .split(maxsplit=2)
    )
    assert out == ["True", "True", "[0, 1, 2, 3, 4]"]


PUBLIC_MODULES = {
    "zerocopy_pickle",
    "zerocopy_pickle.plugin",
    "zerocopy_pickle.testing",
    "zerocopy_pickle.validate",
    "zerocopy_pickle.errors",
    "zerocopy_pickle.cache",
    "zerocopy_pickle.native",
    "zerocopy_pickle.multiprocessing",
    "zerocopy_pickle.ray",
}


STREAM_NAMED = {"zerocopy_pickle.rebuild", "zerocopy_pickle.safeglobals"}
"""Internal modules kept at the root under their old names: streams name their functions (part of the format)."""


def _module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, name
    return Path(spec.origin).read_text()


def _defines_all(source: str) -> bool:
    return any(
        isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        for node in ast.parse(source).body
    )


def test_internal_modules_are_private_by_name_and_only_public_modules_define_all() -> None:
    """docs/design.md lists the public modules. Every other module is private by its name (an underscore in its
    path: ``zerocopy_pickle._storage.arena``), or is one of the stream-named modules or the model cache's
    internals, whose docstrings say "Internal:"; only public modules define ``__all__``."""
    names = {"zerocopy_pickle"}
    for info in pkgutil.walk_packages(zp.__path__, "zerocopy_pickle."):
        if not info.name.startswith("zerocopy_pickle._csrc"):
            names.add(info.name)
    assert names >= PUBLIC_MODULES | STREAM_NAMED
    design = (REPO / "docs" / "design.md").read_text()
    for name in sorted(names):
        source = _module_source(name)
        docstring = ast.get_docstring(ast.parse(source)) or ""
        private = any(part.startswith("_") for part in name.split(".")[1:])
        if name in PUBLIC_MODULES:
            assert not private and not docstring.startswith("Internal:"), name
            assert f"`{name}`" in design, f"docs/design.md does not list the public module {name}"
            continue
        assert not _defines_all(source), f"{name} is internal and defines __all__ (only public modules do)"
        if not private:
            assert name in STREAM_NAMED or name.startswith("zerocopy_pickle.cache."), (
                f"{name} is neither public nor private by name: move it into a private package"
            )
            assert docstring.startswith("Internal:"), f"{name} is not public, but its docstring does not say so"


def test_the_wheel_lists_every_package_of_the_tree() -> None:
    """pyproject.toml names the packages a wheel holds one by one; a folder of the tree it leaves out (a new wing)
    would be missing from every non-editable install, though an editable one still imports it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"zerocopy_pickle._csrc"}
    for root, prefix in ((REPO / "zerocopy_pickle", "zerocopy_pickle"), (REPO / "quirks", "zerocopy_pickle_quirks")):
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if "__pycache__" not in parts:
                folders.add(".".join((prefix, *parts)))
    assert listed == folders


def test_tests_import_private_modules_only_through_tests_internals() -> None:
    """tests/internals.py is the suite's one door into ``zerocopy_pickle._*``; no other test file imports one."""
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            offenders += [
                f"{path.relative_to(REPO)}:{node.lineno} {module}"
                for module in modules
                if module.startswith("zerocopy_pickle.")
                and any(part.startswith("_") and not part.startswith("__") for part in module.split(".")[1:2])
            ]
    assert offenders == [], "import these through tests/internals.py: " + ", ".join(offenders)


def test_plugin_api_module_exports_what_plugins_need() -> None:
    plugin = importlib.import_module("zerocopy_pickle.plugin")
    for name in plugin.__all__:
        obj = getattr(plugin, name)
        if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
            assert inspect.getdoc(obj), name
    assert plugin.Registrar is zp.Registrar and plugin.Registry is zp.Registry
    assert plugin.validate.expect_int(3, "here", "x") == 3
    assert plugin.type_key(zp.Snapshot) == "zerocopy_pickle._core.snapshot:Snapshot"


def test_quirks_import_only_the_public_plugin_api() -> None:
    """The built-in quirks are registered as a third party would be: nothing private of the library."""
    allowed = {"zerocopy_pickle", "zerocopy_pickle.plugin"}  # as the import-linter contract in pyproject.toml
    seen = set()
    for path in sorted((REPO / "quirks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path.name}: relative import from {node.module!r}")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for module in names:
                if module.partition(".")[0] == "zerocopy_pickle":
                    assert module in allowed, f"{path.name} imports {module}"
                    seen.add(module)
    assert "zerocopy_pickle.plugin" in seen
