"""Plugin discovery through real entry points (a .dist-info installed into a temporary directory)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle.plugin import DISABLE_ENV, Registry, default_registry
from zerocopy_pickle.testing import ReducerConformance

from .conftest import REPO, InstalledPlugins, install_example_plugins, run_python


def test_discovery_registers_the_example_plugin(example_plugins: InstalledPlugins) -> None:
    plugins = default_registry().plugins()
    assert plugins["example"].state == "loaded"
    assert plugins["example"].package == "zcp-example-plugin"
    assert "zcp_example_types:Reading" in zp.reducers()
    assert "zcp_example_types" not in sys.modules  # registering never imported the target library


def test_broken_plugin_is_isolated_and_reported_once(example_plugins: InstalledPlugins) -> None:
    messages = [str(w.message) for w in example_plugins.warnings if issubclass(w.category, zp.PluginWarning)]
    assert len(messages) == 1
    assert "'broken' (from zcp-broken-plugin) failed to load" in messages[0]
    assert "broken on purpose" in messages[0]
    info = default_registry().plugins()["broken"]
    assert info.state == "failed"
    assert "collections:OrderedDict" not in zp.reducers()  # its half-done registration was rolled back
    default_registry().ensure_discovered()  # cached: no second warning, no second attempt
    assert zp.loads(zp.dumps({"t": torch.ones(2)}))["t"].sum() == 2  # plain pickling unaffected


def test_plugin_reducer_used_in_this_process(example_plugins: InstalledPlugins) -> None:
    import zcp_example_plugin
    import zcp_example_types

    reading = zcp_example_types.Reading("t", torch.arange(4.0))
    data = zp.dumps({"r": reading})
    assert [p.name for p in zp.read_header(data).plugins] == ["example"]
    calls = zcp_example_plugin.LOAD_HOOK_CALLS
    loaded = zp.loads(data)  # restricted: the plugin's safe globals suffice
    assert loaded["r"] == reading
    assert calls == zcp_example_plugin.LOAD_HOOK_CALLS  # a restricted load runs no load hook


def test_trusted_load_runs_the_load_hook(example_plugins: InstalledPlugins) -> None:
    import zcp_example_plugin
    import zcp_example_types

    data = zp.dumps({"r": zcp_example_types.Reading("t", torch.arange(4.0))})
    calls = zcp_example_plugin.LOAD_HOOK_CALLS
    zp.loads(data, trusted=True)
    assert calls + 1 == zcp_example_plugin.LOAD_HOOK_CALLS


DUMP = """
import sys, torch, zerocopy_pickle as zp
from zcp_example_types import sample
zp.dump(sample(), sys.argv[1])
print(sorted(zp.default_registry().plugins()))
"""

LOAD = """
import sys, zerocopy_pickle as zp
from zerocopy_pickle.testing import assert_same
loaded = zp.load(sys.argv[1])
import zcp_example_plugin, zcp_example_types
assert_same(zcp_example_types.sample(), loaded)
print("hook calls", zcp_example_plugin.LOAD_HOOK_CALLS)
"""


@pytest.mark.slow
def test_fresh_interpreters_discover_the_plugin(example_plugins: InstalledPlugins, tmp_path: Path) -> None:
    path = tmp_path / "readings.zcp"
    out = run_python(DUMP, str(path), env=example_plugins.env).stdout
    assert "example" in out
    assert "hook calls 0" in run_python(LOAD, str(path), env=example_plugins.env).stdout  # restricted: no hook


@pytest.mark.slow
def test_load_without_the_plugin_names_what_to_install(example_plugins: InstalledPlugins, tmp_path: Path) -> None:
    path = tmp_path / "readings.zcp"
    run_python(DUMP, str(path), env=example_plugins.env)
    proc = run_python(
        "import sys, zerocopy_pickle as zp\nzp.load(sys.argv[1])", str(path), check=False, env={"PYTHONPATH": str(REPO)}
    )
    assert proc.returncode != 0
    assert "PluginError" in proc.stderr
    assert "plugin 'example', which is not installed: pip install zcp-example-plugin" in proc.stderr


@pytest.mark.slow
def test_disabled_by_environment(example_plugins: InstalledPlugins, tmp_path: Path) -> None:
    path = tmp_path / "readings.zcp"
    run_python(DUMP, str(path), env=example_plugins.env)
    env = {**example_plugins.env, DISABLE_ENV: "example,broken"}
    proc = run_python(LOAD, str(path), check=False, env=env)
    assert proc.returncode != 0
    assert f"which {DISABLE_ENV} disables" in proc.stderr
    assert "broken" not in proc.stderr.split("PluginError")[0]  # a disabled broken plugin is not even tried


def test_rediscover_after_install_at_run_time(tmp_path: Path) -> None:
    registry = Registry()  # a private one, discovering on its own: the process's registry is left alone
    assert "example" not in registry.plugins()
    site = install_example_plugins(tmp_path / "site", broken=False)
    sys.path.insert(0, str(site))
    try:
        import importlib

        importlib.invalidate_caches()
        assert "example" not in registry.plugins()  # discovery is cached...
        registry.rediscover()
        assert registry.plugins()["example"].state == "loaded"  # ...until asked again
    finally:
        sys.path.remove(str(site))
        for module in ("zcp_example_plugin", "zcp_example_types"):
            sys.modules.pop(module, None)
        registry.rediscover()
    assert "example" not in registry.plugins()
    assert "example" not in default_registry().plugins()


def test_cache_patch_points_come_from_their_own_group(example_plugins: InstalledPlugins, tmp_path: Path) -> None:
    """A distribution declares patch points for the model cache in the cache's group; the registry never sees them."""
    from zerocopy_pickle.cache import loader, points

    assert "zcp_example_types:Reading.__init__" in points.declared_patch_points()
    assert points.all_patch_points()[: len(points.DEFAULT_PATCH_POINTS)] == list(points.DEFAULT_PATCH_POINTS)
    assert "zcp_example_types" in loader.patch_point_modules()
    assert "zcp_example_types" not in sys.modules  # declaring a patch point never imports its module
    assert not hasattr(default_registry(), "patch_points")
    assert not hasattr(zp.Registrar, "add_patch_point")
    # A malformed declaration is skipped with a warning naming it.
    info = tmp_path / "site" / "zcp_bad_points-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zcp-bad-points\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[zerocopy_pickle.cache_patch_points]\nbad = not a point\n")
    import importlib

    importlib.invalidate_caches()
    with pytest.warns(UserWarning, match="patch point 'bad' .*zcp-bad-points.*not 'module:qualname'"):
        declared = points.declared_patch_points()
    assert "not a point" not in declared and "zcp_example_types:Reading.__init__" in declared


class TestExamplePluginConformance(ReducerConformance):
    """The shared conformance suite, applied to the example plugin (as a third-party plugin would)."""

    plugin = "example"
    factory = "zcp_example_types:sample"

    @pytest.fixture(autouse=True)
    def _installed(self, example_plugins: InstalledPlugins) -> None:
        self._env = example_plugins.env

    def env(self) -> dict[str, str]:
        return self._env
