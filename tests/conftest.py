"""Shared fixtures: fresh interpreters, small models, and helpers to read process memory figures."""

from __future__ import annotations

import gc
import importlib
import itertools
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.internals import decoding, readahead
from tests.internals import format as fmt
from tests.zygote import ZYGOTE
from zerocopy_pickle.plugin import default_registry

REPO = Path(__file__).resolve().parent.parent

# `make test` (and so CI) sets this: a test skipped because an optional dependency or the C++ toolchain is
# missing then fails instead, so a broken setup cannot pass as green. Only skips that need what no setup step
# can provide (a CUDA device, running as root) stay skips.
STRICT_SKIPS = os.environ.get("ZEROCOPY_PICKLE_STRICT_SKIPS") == "1"
ALLOWED_SKIP_REASONS = ("CUDA", "needs root")


@pytest.fixture(autouse=True)
def _no_prefetch_outlives_its_test() -> Iterator[None]:
    """Loads of large snapshots start background prefetches that a test need not wait for: end them with the test,
    so that no thread of one test is still reading (and freeing objects) while the next one runs."""
    yield
    for job in readahead.running():
        job.cancel()
        job.wait(timeout=60)


def _fail_strict_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(word in reason for word in ALLOWED_SKIP_REASONS):
            report.outcome = "failed"
            report.longrepr = f"skipped under ZEROCOPY_PICKLE_STRICT_SKIPS=1 (make test): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _fail_strict_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_strict_skip(outcome.get_result())


def run_python(
    code: str,
    *args: str,
    timeout: float = 300,
    check: bool = True,
    env: dict[str, str] | None = None,
    unset: Iterable[str] = (),
    cwd: str | os.PathLike[str] = REPO,
    preloaded: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (same venv) in ``cwd``, with ``args`` as ``sys.argv[1:]``, the variables
    in ``unset`` removed from the environment and ``env`` added.

    ``preloaded=True``: in a child of the test zygote (``tests/zygote.py``), an interpreter with torch, transformers
    and diffusers already imported, where its environment allows (else a fresh one all the same): for scripts
    that only load models, never for one that checks what an interpreter imports or how much memory it uses."""
    removed = set(unset)
    env = {k: v for k, v in os.environ.items() if k not in removed} | {"PYTHONUNBUFFERED": "1", **(env or {})}
    code = textwrap.dedent(code)
    if preloaded and ZYGOTE.usable(env):
        proc = ZYGOTE.run(code, args, env, str(cwd), timeout)
    else:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def python() -> object:
    """``python(code, *args)`` runs code in a fresh interpreter and returns the CompletedProcess."""
    return run_python


class TiedNet(torch.nn.Module):
    """A module with a buffer, a frozen parameter and tied weights (importable, so it pickles by reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.body[0].bias.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)) * self.scale)


TIED_NET_ALLOW = [
    TiedNet,
    torch.nn.Embedding,
    torch.nn.Sequential,
    torch.nn.Linear,
    torch.nn.GELU,
    torch.nn.LayerNorm,
]


@pytest.fixture
def tied_net() -> TiedNet:
    torch.manual_seed(0)
    return TiedNet().eval()


def settled() -> tuple[set[str], set[threading.Thread]]:
    """This process's open fds and live threads after a full collection: the baseline a test compares what the
    code under test leaves behind with. In a parallel run a worker process has run other tests before, and their
    garbage (files, mappings, finished threads) may otherwise be collected in the middle of this test."""
    gc.collect()
    return set(os.listdir("/proc/self/fd")), set(threading.enumerate())


def left_behind(before: tuple[set[str], set[threading.Thread]]) -> tuple[set[str], set[threading.Thread]]:
    """The fds open and the threads alive now that were not in ``before`` (:func:`settled`): what a test asserts
    is empty once the code under test is done."""
    fds, threads = set(os.listdir("/proc/self/fd")), set(threading.enumerate())
    return fds - before[0], threads - before[1]


def header_of(data: bytes) -> fmt.Header:
    """The validated header of a snapshot held in ``data``."""
    header_nbytes, _, _ = decoding.decode_fixed(data[:32], len(data))
    return decoding.decode_header(data[:32], data[32 : 32 + header_nbytes], len(data))


def mapped_regions(pid: int | str = "self") -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every mapping of a process, from /proc/<pid>/maps."""
    regions = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            regions.append((start, end, parts[5].strip() if len(parts) > 5 else ""))
    return regions


def region_of(address: int) -> tuple[int, int, str] | None:
    """The mapping of this process that contains ``address``."""
    for start, end, path in mapped_regions():
        if start <= address < end:
            return start, end, path
    return None


EXAMPLE_PLUGIN_SOURCES = Path(__file__).with_name("fixtures") / "example_plugin"
EXAMPLE_MODULES = ("zcp_example_plugin", "zcp_example_types", "zcp_broken_plugin")


def install_example_plugins(site: Path, *, broken: bool = True) -> Path:
    """Install the example plugin distributions into ``site`` as pip would: modules plus .dist-info folders
    whose entry_points.txt names them (what importlib.metadata reads)."""
    site.mkdir(parents=True, exist_ok=True)
    for module in EXAMPLE_MODULES:
        shutil.copy(EXAMPLE_PLUGIN_SOURCES / f"{module}.py", site / f"{module}.py")
    # The example distribution also declares a patch point for the model cache, in the cache's own group.
    dists = {
        "zcp-example-plugin": "[zerocopy_pickle.plugins]\nexample = zcp_example_plugin\n\n"
        "[zerocopy_pickle.cache_patch_points]\nexample-reading = zcp_example_types:Reading.__init__\n"
    }
    if broken:
        dists["zcp-broken-plugin"] = "[zerocopy_pickle.plugins]\nbroken = zcp_broken_plugin:register\n"
    for dist, entry_points in dists.items():
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(entry_points)
    return site


@dataclass
class InstalledPlugins:
    site: Path
    warnings: list[warnings.WarningMessage]

    @property
    def env(self) -> dict[str, str]:
        """What a fresh interpreter needs to see the plugins."""
        return {"PYTHONPATH": os.pathsep.join([str(self.site), str(REPO)])}


@pytest.fixture
def example_plugins(tmp_path: Path) -> Iterator[InstalledPlugins]:
    """The example plugins installed on sys.path and discovered by the default registry (undone afterwards)."""
    site = install_example_plugins(tmp_path / "site")
    registry = default_registry()
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    registry.rediscover()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry.ensure_discovered()
        yield InstalledPlugins(site, caught)
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()
        for module in EXAMPLE_MODULES:
            sys.modules.pop(module, None)
        registry.rediscover()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Make "cuda:N" a fake bulk-transfer device (tests/test_transfer.py's ``FakeBackend``, which records every
    call); returns the backends made, one per transfer."""
    from tests.internals import backend
    from tests.internals import device as devices

    from .test_transfer import FakeBackend

    made: list[Any] = []

    def factory(device: torch.device) -> Any:
        made.append(FakeBackend())
        return made[-1]

    monkeypatch.setitem(backend._BACKENDS, "cuda", factory)
    real = devices._require
    monkeypatch.setattr(devices, "_require", lambda d, hint: None if d.type == "cuda" else real(d, hint))
    return made


@pytest.fixture
def restore_logging_and_environment() -> Iterator[None]:
    """The CLI's main() configures the zerocopy_pickle logger and sets variables for child processes, as a command
    line does; undo both so that other tests see the library's defaults (``pytestmark`` of the CLI tests)."""
    import logging

    logger = logging.getLogger("zerocopy_pickle")
    level, handlers, environ = logger.level, list(logger.handlers), dict(os.environ)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    for key in set(os.environ) - set(environ):
        del os.environ[key]


@pytest.fixture
def alias_module() -> Iterator[None]:
    """test_hostile's harmless-looking module that re-exports os.system (its payload names it)."""
    import types

    from . import test_hostile

    module = types.ModuleType(test_hostile.ALIAS_MODULE)
    module.run = os.system  # type: ignore[attr-defined]
    sys.modules[test_hostile.ALIAS_MODULE] = module
    yield
    del sys.modules[test_hostile.ALIAS_MODULE]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks added here count for `-m "not slow"` too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The conformance suite's fresh-interpreter load (``zerocopy_pickle.testing``, a library module that does
    not import pytest) starts an interpreter that imports the plugin's library: it is marked ``slow`` here, in
    every plugin's subclass.

    In a parallel run (``make test`` runs pytest-xdist's workers, each collecting the same list), every worker
    starts on its share of the tests marked ``slow`` (:func:`_dealt`): the long ones start while every worker is
    free and the short ones fill the gaps, instead of one worker finishing a queue of long tests alone at the end.
    A serial run keeps the order as collected."""
    for item in items:
        if (
            getattr(getattr(item, "function", None), "__qualname__", "")
            == "ReducerConformance.test_fresh_interpreter_load"
        ):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):
        items[:] = _dealt(items, int(config.workerinput.get("workercount", 1)))


def _dealt(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` ordered so that each worker of a ``--dist worksteal`` run starts with its share of the slow tests.

    worksteal cuts the list into ``workers`` contiguous shares from the front (``len // workers`` for the first,
    then the rest likewise) and later moves tests from the tail of the longest queue to a worker that ran dry.
    With every slow test at the front (the order before), the first worker's share held all of them: the others
    ran their short tests, then took slow ones only as they stole, the last of them starting near the end. Here
    the slow tests are dealt round-robin into shares of the sizes worksteal will cut: every share is its slow
    tests, then short ones (the tail, where stealing takes from). Within each group the files' order stays."""
    sizes = []
    left = len(items)
    for worker in range(workers):
        sizes.append(left // (workers - worker))
        left -= sizes[-1]
    hands: list[list[pytest.Item]] = [[] for _ in sizes]
    open_hands = itertools.cycle(range(workers))
    for item in items:
        if item.get_closest_marker("slow") is not None:
            worker = next(open_hands)
            while len(hands[worker]) == sizes[worker]:  # a full share takes no more (there is room elsewhere)
                worker = next(open_hands)
            hands[worker].append(item)
    rest = iter([item for item in items if item.get_closest_marker("slow") is None])
    return [
        item
        for hand, size in zip(hands, sizes, strict=True)
        for item in hand + list(itertools.islice(rest, size - len(hand)))
    ]
