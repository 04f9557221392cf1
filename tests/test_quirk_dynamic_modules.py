"""The dynamic-modules quirk: snapshots of objects whose classes diffusers or transformers imported from the modules
cache (``diffusers_modules``, ``transformers_modules``) load in a fresh interpreter that never called from_pretrained.

The libraries read HF_HOME / HF_MODULES_CACHE when they are imported, so everything that touches them runs in
subprocesses with those variables set. One module-scoped setup writes two tiny local repositories (sources under
tests/fixtures/dynamic_modules/), loads them with from_pretrained and dumps them; each test then loads the
snapshots in fresh interpreters.

ReducerConformance does not fit this plugin (its properties are tested here directly):

* its restricted-load test needs a snapshot that loads with no allow=: classes from these namespaces are repository
  code, which a restricted load must refuse (the plugin declares no safe globals on purpose);
* its factory must recreate the objects in the fresh interpreter, which here means calling from_pretrained there,
  with the environment set before diffusers or transformers is imported; and transformers re-executes a cached
  module that from_pretrained did not import itself, so the factory's classes would not be the loaded objects'.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from zerocopy_pickle_quirks import dynamic_modules

import zerocopy_pickle as zp
from zerocopy_pickle.plugin import default_registry

from .conftest import run_python

SOURCES = Path(__file__).with_name("fixtures") / "dynamic_modules"
# Variables that decide where the libraries look, removed from the subprocesses' environment unless a test sets them.
HF_VARIABLES = ("HF_HOME", "HF_MODULES_CACHE", "XDG_CACHE_HOME", "ZEROCOPY_PICKLE_DISABLE_PLUGINS")


def run(code: str, *args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with exactly the HF variables in ``env``."""
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    return run_python(code, *args, env=offline, unset=HF_VARIABLES, check=check)


SETUP = """
import json, os, shutil, sys
import torch
from safetensors.torch import save_file
from zerocopy_pickle_quirks.dynamic_modules import default_modules_cache, modules_cache
import zerocopy_pickle as zp

root = sys.argv[1]
hf_home = os.environ["HF_HOME"]
expected_cache = os.path.join(hf_home, "modules")
assert default_modules_cache() == expected_cache, default_modules_cache()  # HF_HOME wins over XDG_CACHE_HOME
torch.manual_seed(0)

from tests.dynamic_repos import write_repositories

model_dir, pipe_dir = write_repositories(root)

from transformers import AutoModel
from diffusers import DiffusionPipeline
import diffusers.utils.constants, transformers.utils.hub
# The path the hook computes without the libraries is the one they use.
assert diffusers.utils.constants.HF_MODULES_CACHE == transformers.utils.hub.HF_MODULES_CACHE == expected_cache
assert modules_cache("transformers_modules") == modules_cache("diffusers_modules") == expected_cache

model = AutoModel.from_pretrained(model_dir, trust_remote_code=True).eval()
pipe = DiffusionPipeline.from_pretrained(pipe_dir, trust_remote_code=True)
modules = {"model": type(model).__module__, "pipe": type(pipe).__module__, "unet": type(pipe.unet).__module__}
assert modules["model"].startswith("transformers_modules.tiny_hyphen_remote_hyphen_model."), modules
assert modules["pipe"] == "diffusers_modules.local.my_pipeline", modules
assert modules["unet"] == "diffusers_modules.local.my_unet", modules

ids = torch.tensor([[1, 2, 3, 15]])
sample = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    model_out = model(ids)
pipe_out = pipe(sample)
zp.dump(model, os.path.join(root, "model.zcp"))
zp.dump(pipe, os.path.join(root, "pipe.zcp"))
zp.dump({"ids": ids, "model_out": model_out, "sample": sample, "pipe_out": pipe_out, "modules": modules},
        os.path.join(root, "reference.zcp"))
for name in ("model.zcp", "pipe.zcp"):
    plugins = [p.name for p in zp.read_header(os.path.join(root, name)).plugins]
    assert plugins == ["dynamic-modules"], (name, plugins)
print("ok")
"""

# Loads a snapshot in an interpreter that never calls from_pretrained, and checks what the plugin promises.
FRESH_LOAD = """
import os, sys
import zerocopy_pickle as zp
from zerocopy_pickle.plugin import default_registry

snapshot, reference, kind = sys.argv[1:4]
cache = os.path.abspath(os.environ.get("HF_MODULES_CACHE") or os.path.join(os.environ["HF_HOME"], "modules"))
assert not any(m.split(".")[0] in ("transformers", "diffusers", "huggingface_hub") for m in sys.modules)

# A restricted load's preparation runs no hook: nothing is registered because a header says so.
header = zp.read_header(snapshot)
default_registry().prepare_load((p.name, p.package) for p in header.plugins)
assert not any(m.split(".")[0] in ("transformers_modules", "diffusers_modules") for m in sys.modules)

# The load hook alone (a trusted load's preparation): it registers the namespaces from the cache and imports
# neither library.
default_registry().prepare_load(((p.name, p.package) for p in header.plugins), trusted=True)
assert not any(m.split(".")[0] in ("transformers", "diffusers") for m in sys.modules), "the hook imported a library"
for namespace in ("transformers_modules", "diffusers_modules"):
    assert list(sys.modules[namespace].__path__) == [os.path.join(cache, namespace)], namespace
default_registry().prepare_load(((p.name, p.package) for p in header.plugins), trusted=True)  # idempotent

# Repository code: a restricted load refuses it.
try:
    zp.load(snapshot)
except zp.RestrictedLoadError as e:
    assert any(module.startswith(f"{kind}_modules.") for module, _ in e.needed), e.needed
else:
    raise AssertionError("a restricted load accepted repository code")

first = zp.load(snapshot, trusted=True)
second = zp.load(snapshot, trusted=True)
ref = zp.load(reference)
import torch
if kind == "transformers":
    assert type(first).__module__ == ref["modules"]["model"]
    with torch.no_grad():
        assert torch.equal(first(ref["ids"]), ref["model_out"])
        first.proj.weight.add_(1.0)  # a write to one load reaches no other
        assert torch.equal(second(ref["ids"]), ref["model_out"])
        assert not torch.equal(first(ref["ids"]), ref["model_out"])
else:
    assert type(first).__module__ == ref["modules"]["pipe"] and type(first.unet).__module__ == ref["modules"]["unet"]
    assert torch.equal(first(ref["sample"]), ref["pipe_out"])
    with torch.no_grad():
        first.unet.mix.weight.add_(1.0)
    assert torch.equal(second(ref["sample"]), ref["pipe_out"])
    assert not torch.equal(first(ref["sample"]), ref["pipe_out"])
# from_pretrained never ran here: neither library's init_hf_modules put the cache on sys.path.
assert cache not in sys.path and os.path.join(cache, "") not in sys.path
print("ok")
"""


@dataclass
class Dumped:
    root: Path
    hf_home: Path

    @property
    def cache(self) -> Path:
        return self.hf_home / "modules"


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Dumped:
    """Both repositories loaded with from_pretrained and dumped (HF_HOME in a temporary folder)."""
    root = tmp_path_factory.mktemp("dynamic-modules")
    for name in ("tiny-remote-model", "tiny-pipeline"):
        shutil.copytree(SOURCES / name, root / name)
    hf_home = root / "hf-home"
    run(SETUP, str(root), env={"HF_HOME": str(hf_home), "XDG_CACHE_HOME": str(root / "xdg")})
    return Dumped(root, hf_home)


@pytest.mark.slow
def test_transformers_remote_code_loads_in_a_fresh_interpreter(dumped: Dumped) -> None:
    # HF_HOME alone: the cache path comes from the HF_HOME rule.
    env = {"HF_HOME": str(dumped.hf_home)}
    proc = run(FRESH_LOAD, str(dumped.root / "model.zcp"), str(dumped.root / "reference.zcp"), "transformers", env=env)
    assert proc.stdout.strip() == "ok"


@pytest.mark.slow
def test_diffusers_custom_pipeline_loads_in_a_fresh_interpreter(dumped: Dumped, tmp_path: Path) -> None:
    # HF_MODULES_CACHE set explicitly (and HF_HOME elsewhere): that variable wins, as in both libraries.
    env = {"HF_MODULES_CACHE": str(dumped.cache), "HF_HOME": str(tmp_path / "elsewhere")}
    proc = run(FRESH_LOAD, str(dumped.root / "pipe.zcp"), str(dumped.root / "reference.zcp"), "diffusers", env=env)
    assert proc.stdout.strip() == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("snapshot", ["model.zcp", "pipe.zcp"])
def test_without_the_plugin_the_load_fails_naming_it(dumped: Dumped, snapshot: str) -> None:
    env = {"HF_HOME": str(dumped.hf_home), "ZEROCOPY_PICKLE_DISABLE_PLUGINS": "dynamic-modules"}
    code = """
    import sys
    import zerocopy_pickle as zp
    try:
        zp.load(sys.argv[1], trusted=True)
    except zp.PluginError as e:
        print(e)
    """
    proc = run(code, str(dumped.root / snapshot), env=env)
    assert "needs the zerocopy_pickle plugin 'dynamic-modules'" in proc.stdout, proc.stdout + proc.stderr
    assert "ZEROCOPY_PICKLE_DISABLE_PLUGINS disables" in proc.stdout


@pytest.mark.slow
def test_a_cache_without_the_module_fails_naming_the_cache(dumped: Dumped, tmp_path: Path) -> None:
    empty = tmp_path / "empty-cache"
    code = """
    import sys
    import zerocopy_pickle as zp
    try:
        zp.load(sys.argv[1], trusted=True)
    except zp.SnapshotError as e:
        print(e)
    """
    proc = run(code, str(dumped.root / "model.zcp"), env={"HF_MODULES_CACHE": str(empty)})
    message = proc.stdout
    assert "transformers_modules.tiny_hyphen_remote_hyphen_model." in message, message + proc.stderr
    assert f"modules cache {empty / 'transformers_modules'}" in message
    assert "'dynamic-modules'" in message and "trust_remote_code=True" in message


# -- the hook itself, in this process, over a hand-made cache (no library involved) ---------------------------------


def test_plugin_claims_both_namespaces() -> None:
    registry = default_registry()
    info = registry.plugins()["dynamic-modules"]
    assert info.state == "loaded", info.error
    assert set(info.modules) == {"diffusers_modules", "transformers_modules"}
    assert info.load_hook is not None
    claim = registry.claim_for("transformers_modules.repo.0123abcd.modeling_x")
    assert claim is not None and claim.name == "dynamic-modules"
    assert registry.claim_for("diffusers_modules.local.my_pipeline") is claim
    assert registry.claim_for("transformers") is None and registry.claim_for("diffusers_modulesx") is None


def _forget_library_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    # An imported library's HF_MODULES_CACHE constant wins over the environment (it was read at its import);
    # earlier tests in this process may have imported diffusers or transformers.
    for module_name, _ in dynamic_modules._LIBRARY_CONSTANT.values():
        monkeypatch.delitem(sys.modules, module_name, raising=False)


def test_default_modules_cache_follows_the_libraries_rule(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delitem(sys.modules, "huggingface_hub.constants", raising=False)
    _forget_library_constants(monkeypatch)
    for name in HF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dynamic_modules.default_modules_cache() == str(tmp_path / "home" / ".cache" / "huggingface" / "modules")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dynamic_modules.default_modules_cache() == str(tmp_path / "xdg" / "huggingface" / "modules")
    monkeypatch.setenv("HF_HOME", "~/hf")  # expanded, as huggingface_hub does
    assert dynamic_modules.default_modules_cache() == str(tmp_path / "home" / "hf" / "modules")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    assert dynamic_modules.default_modules_cache() == str(tmp_path / "modules")
    assert dynamic_modules.modules_cache("transformers_modules") == str(tmp_path / "modules")


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The hook's changes to sys.modules and sys.meta_path, undone afterwards; the modules cache taken from the
    environment (HF_MODULES_CACHE), as in a process that has not imported diffusers or transformers."""
    _forget_library_constants(monkeypatch)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for namespace in dynamic_modules.NAMESPACES:
        monkeypatch.delitem(sys.modules, namespace, raising=False)
    before = set(sys.modules)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] in dynamic_modules.NAMESPACES:
                del sys.modules[name]
        importlib.invalidate_caches()


def _write_cache(cache: Path) -> None:
    # The layout transformers writes: an empty __init__.py at every level.
    package = cache / "transformers_modules" / "repo" / "0123abcd"
    package.mkdir(parents=True)
    for folder in (cache, cache / "transformers_modules", package.parent, package):
        (folder / "__init__.py").touch()
    (package / "configuration_x.py").write_text("class XConfig:\n    size = 3\n")
    (package / "modeling_x.py").write_text(
        "from .configuration_x import XConfig\n\nclass XModel:\n    config = XConfig\n"
    )


@pytest.mark.usefixtures("isolated_imports")
def test_hook_registers_the_namespace_from_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "modules"
    _write_cache(cache)
    monkeypatch.setenv("HF_MODULES_CACHE", str(cache))
    hook = default_registry().plugins()["dynamic-modules"].load_hook
    assert hook is not None
    hook()
    package = sys.modules["transformers_modules"]
    assert list(package.__path__) == [str(cache / "transformers_modules")]
    assert "diffusers_modules" not in sys.modules  # no folder in the cache: nothing registered
    module = importlib.import_module("transformers_modules.repo.0123abcd.modeling_x")
    assert module.XModel.config.size == 3  # relative imports resolve inside the cache
    hook()  # idempotent: the registered package stays, and one finder is installed
    assert sys.modules["transformers_modules"] is package
    assert sum(isinstance(f, dynamic_modules._MissingDynamicModule) for f in sys.meta_path) == 1
    with pytest.raises(ModuleNotFoundError, match=r"in the transformers modules cache .*trust_remote_code=True"):
        importlib.import_module("transformers_modules.repo.0123abcd.modeling_missing")
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'diffusers_modules' in the diffusers modules"):
        importlib.import_module("diffusers_modules.local.my_pipeline")


@pytest.mark.usefixtures("isolated_imports")
def test_hook_leaves_an_imported_namespace_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "modules"
    _write_cache(cache)
    monkeypatch.setenv("HF_MODULES_CACHE", str(cache))
    existing = type(sys)("transformers_modules")
    monkeypatch.setitem(sys.modules, "transformers_modules", existing)
    dynamic_modules.prepare_namespaces()
    assert sys.modules["transformers_modules"] is existing


@pytest.mark.usefixtures("isolated_imports")
def test_hook_prefers_the_imported_librarys_constant(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A library already imported uses the path it computed then, whatever the environment says now.
    cache = tmp_path / "library-cache"
    _write_cache(cache)
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "elsewhere"))
    fake_hub = type(sys)("transformers.utils.hub")
    fake_hub.HF_MODULES_CACHE = str(cache)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.utils.hub", fake_hub)
    assert dynamic_modules.modules_cache("transformers_modules") == str(cache)
    assert dynamic_modules.modules_cache("diffusers_modules") == str(tmp_path / "elsewhere")
    dynamic_modules.prepare_namespaces()
    assert list(sys.modules["transformers_modules"].__path__) == [str(cache / "transformers_modules")]


@pytest.mark.slow
def test_dump_of_a_cached_class_records_the_plugin(tmp_path: Path) -> None:
    # Without any library: a class imported from a hand-made cache, in this process and in a fresh one.
    cache = tmp_path / "modules"
    _write_cache(cache)
    code = """
    import sys
    import zerocopy_pickle as zp
    from zerocopy_pickle.plugin import default_registry
    if sys.argv[1] == "dump":
        default_registry().prepare_load([("dynamic-modules", "zerocopy-pickle")], trusted=True)  # the hook
        import importlib
        model = importlib.import_module("transformers_modules.repo.0123abcd.modeling_x").XModel()
        zp.dump({"model": model, "cls": type(model)}, sys.argv[2])
        print([p.name for p in zp.read_header(sys.argv[2]).plugins])
    else:
        loaded = zp.load(sys.argv[2], trusted=True)
        assert type(loaded["model"]) is loaded["cls"] and loaded["cls"].config.size == 3
        print("ok")
    """
    env = {"HF_MODULES_CACHE": str(cache)}
    assert run(code, "dump", str(tmp_path / "x.zcp"), env=env).stdout.strip() == "['dynamic-modules']"
    assert run(code, "load", str(tmp_path / "x.zcp"), env=env).stdout.strip() == "ok"


@pytest.mark.usefixtures("isolated_imports")
def test_dump_of_a_cached_function_records_the_plugin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "modules"
    _write_cache(cache)
    package = cache / "transformers_modules" / "repo" / "0123abcd"
    (package / "activations.py").write_text("def act(x):\n    return x\n")
    monkeypatch.setenv("HF_MODULES_CACHE", str(cache))
    dynamic_modules.prepare_namespaces()
    act = importlib.import_module("transformers_modules.repo.0123abcd.activations").act
    plugins = zp.read_header(zp.dumps({"activation": act}, backend="pickle")).plugins
    assert [p.name for p in plugins] == ["dynamic-modules"]


@pytest.mark.slow
def test_restricted_load_prepares_no_namespace(tmp_path: Path) -> None:
    """A restricted load of a snapshot whose header names dynamic-modules (an attacker can write that header)
    registers no namespace and adds no finder: the repository class is refused as a global, nothing imported."""
    cache = tmp_path / "modules"
    _write_cache(cache)
    code = """
    import sys
    import zerocopy_pickle as zp
    from zerocopy_pickle.plugin import default_registry
    if sys.argv[1] == "dump":
        default_registry().prepare_load([("dynamic-modules", "zerocopy-pickle")], trusted=True)
        import importlib
        model = importlib.import_module("transformers_modules.repo.0123abcd.modeling_x").XModel()
        zp.dump({"model": model}, sys.argv[2])
    else:
        default_registry().ensure_discovered()  # plugins register (stable-fast adds its import hook) first
        finders = list(sys.meta_path)
        for allow in ([], ["transformers_modules.repo.0123abcd.modeling_x:XModel"]):
            try:
                zp.load(sys.argv[2], allow=allow)
            except (zp.RestrictedLoadError, zp.SnapshotError) as e:
                print(type(e).__name__)
            else:
                raise AssertionError("loaded")
        assert "transformers_modules" not in sys.modules and sys.meta_path == finders
        print("ok")
    """
    env = {"HF_MODULES_CACHE": str(cache)}
    run(code, "dump", str(tmp_path / "x.zcp"), env=env)
    out = run(code, "load", str(tmp_path / "x.zcp"), env=env).stdout.split()
    # Not allowed: refused. Allowed: the namespace was not prepared (no load hook in a restricted load), so the
    # class cannot be imported: MissingGlobalError, a SnapshotError and an ImportError.
    assert out == ["RestrictedLoadError", "MissingGlobalError", "ok"], out
