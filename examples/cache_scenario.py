"""The seed scenario, timed: load a VAE, two ControlNets, then the pipeline with ``vae=vae`` (and, in the
``wrapper`` variant, ``controlnet=MultiControlNetModel([edge, depth])``; in the ``remote`` variant, then a
transformers model with its own code, ``AutoModel.from_pretrained(..., trust_remote_code=True)``), plain and
through the cache.

``zerocopy-pickle demo`` runs it on a tiny pipeline built here; ``benchmarks/cache.py`` on an SD1.5-sized one.
Every run is a fresh process (as a user's program is), timed from after its imports; after the four loads it
touches every page of every weight once, because a zero-copy load defers page faults to first use and a fair
total includes them.

    python -m examples.cache_scenario plain|cache|autostart vae|wrapper|remote|small PATHS_JSON DTYPE

``small`` is another scenario on the same footing: a tiny LLaMA, a tiny GPT-2 and a small VAE (about 1 MB each),
where a cache's fixed cost per call shows.

``cache`` runs against a server started (and ready) beforehand; ``autostart`` is the first call of the day:
``patch_all()`` with no server running, which starts one (:func:`measure_autostart`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zerocopy_pickle._console import quiet_third_party
from zerocopy_pickle.cache import CacheError, Client
from zerocopy_pickle.cache.messages import StatusReply, StatusRequest, Stop
from zerocopy_pickle.cache.protocol import DIR_ENV

from . import importable
from .models import build_controlnet_pipeline

STEPS = ("vae", "edge", "depth", "pipeline")
REMOTE_STEP = "remote"  # the remote variant's fifth step: the model whose classes live in transformers_modules
SMALL_STEPS = ("llama", "gpt2", "small-vae")  # the small variant: three models of about 1 MB, as saved (float32)
TOTALS = ("load", "touch", "total")


def _steps(run: dict[str, Any]) -> tuple[str, ...]:
    """A run's steps, in the order they ran (a run's dict keeps it, through JSON too)."""
    return tuple(key for key in run if key not in TOTALS)


def _touch(modules: list[Any]) -> int:
    """Read one byte of every 4 KiB page of every distinct weight (the page faults a first forward pays)."""
    import torch

    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or not storage.nbytes():
                continue
            seen.add(storage.data_ptr())
            data = torch.empty(0, dtype=torch.uint8).set_(storage)
            total += int(data[::4096].max())
    return total


def _run_steps(mode: str, variant: str, paths: dict[str, str], dtype_name: str) -> dict[str, Any]:
    """One run, in this process: the four loads and the touch, each timed."""
    import torch

    if mode in ("cache", "autostart"):  # autostart: no server runs yet, the first patched call starts one
        from zerocopy_pickle.cache import patch_all

        patch_all(autostart=mode == "autostart")
    elif mode != "plain":
        raise ValueError(f"unknown mode {mode!r}: plain, cache or autostart")
    from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    dtype = getattr(torch, dtype_name)
    times: dict[str, float] = {}
    if variant == "small":
        return _timed_touch(times, _run_small(paths, times))
    start = time.perf_counter()
    vae = AutoencoderKL.from_pretrained(paths["pipeline"], subfolder="vae", torch_dtype=dtype)
    times["vae"] = time.perf_counter() - start
    start = time.perf_counter()
    edge = ControlNetModel.from_pretrained(paths["edge"], torch_dtype=dtype)
    times["edge"] = time.perf_counter() - start
    start = time.perf_counter()
    depth = ControlNetModel.from_pretrained(paths["depth"], torch_dtype=dtype)
    times["depth"] = time.perf_counter() - start
    kwargs: dict[str, Any] = {"vae": vae, "safety_checker": None, "torch_dtype": dtype}
    if variant == "wrapper":
        kwargs["controlnet"] = MultiControlNetModel([edge, depth])
    start = time.perf_counter()
    pipe = StableDiffusionControlNetPipeline.from_pretrained(paths["pipeline"], **kwargs)
    times["pipeline"] = time.perf_counter() - start
    modules = [vae, edge, depth, *(c for c in pipe.components.values() if isinstance(c, torch.nn.Module))]
    if variant == "remote":
        from transformers import AutoModel

        start = time.perf_counter()
        modules.append(AutoModel.from_pretrained(paths["remote"], trust_remote_code=True, dtype=dtype))
        times[REMOTE_STEP] = time.perf_counter() - start
    return _timed_touch(times, modules)


def _run_small(paths: dict[str, str], times: dict[str, float]) -> list[Any]:
    """The small variant's loads (``benchmarks/cache.py --variants small`` builds the models): a tiny LLaMA, a tiny
    GPT-2 and a small VAE, each about 1 MB, loaded as saved."""
    from diffusers import AutoencoderKL
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    modules = []
    loaders: tuple[Any, ...] = (LlamaForCausalLM, GPT2LMHeadModel, AutoencoderKL)
    for step, load in zip(SMALL_STEPS, loaders, strict=True):
        start = time.perf_counter()
        modules.append(load.from_pretrained(paths[step]))
        times[step] = time.perf_counter() - start
    return modules


def _timed_touch(times: dict[str, float], modules: list[Any]) -> dict[str, Any]:
    times["load"] = sum(times[step] for step in _steps(times))
    start = time.perf_counter()
    _touch(modules)
    times["touch"] = time.perf_counter() - start
    times["total"] = times["load"] + times["touch"]
    return times


@contextmanager
def private_server(*args: str) -> Iterator[dict[str, str]]:
    """A cache server in a private temporary directory; yields the environment that reaches it."""
    directory = Path(tempfile.mkdtemp(prefix="zcp-demo-")) / "cache"
    directory.mkdir(mode=0o700)
    env = {**os.environ, "ZEROCOPY_PICKLE_CACHE_DIR": str(directory)}
    log = open(directory.parent / "server.log", "ab")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "zerocopy_pickle.cache", "serve", *args], env=env, stdout=log,
                              stderr=log)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(directory / "server.sock", timeout=5) as client:
                    client.request(StatusRequest())
                break  # answering: clients load their own misses, so nothing else needs to be ready
            except CacheError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise CacheError(f"the demo's cache server did not get ready (see {directory.parent / 'server.log'})")
            time.sleep(0.1)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def _run_process(
    env: dict[str, str], mode: str, variant: str, paths: dict[str, str], dtype: str
) -> subprocess.CompletedProcess[str]:
    """One run in a fresh process; its stdout ends with the result line."""
    # TQDM_DISABLE: no progress bars from diffusers' and transformers' loads in the run's stderr, which is shown
    # only if the run fails. tqdm reads it when imported, before the run could set it itself (torch imports it).
    return subprocess.run(
        [sys.executable, "-m", "examples.cache_scenario", mode, variant, json.dumps(paths), dtype],
        env=importable({**env, "TQDM_DISABLE": "1"}), capture_output=True, text=True, check=False, timeout=3600,
    )  # fmt: skip


def _one_run(env: dict[str, str], mode: str, variant: str, paths: dict[str, str], dtype: str) -> dict[str, Any]:
    proc = _run_process(env, mode, variant, paths, dtype)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"a scenario run failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _started_in(directory: Path) -> list[int]:
    """Pids of the live processes whose environment names ``directory`` as their cache directory: the server a run
    started there, its loader and the loader's children (they inherit the run's environment)."""
    marker = f"\0{DIR_ENV}={directory}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:  # gone, or a zombie
                continue
            if marker in b"\0" + environ + b"\0" and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _stop_started_server(directory: Path, wait: float = 120.0) -> None:
    """Stop the server a run started in ``directory`` (if one started) and everything it started.

    The processes are found by their environment, not by asking the server: on a busy machine a server the run
    started at its exit may still be importing when this is called. It is asked to stop once it answers (or
    ``wait`` seconds have passed); whatever of it is still alive after that is killed, so nothing outlives
    this call whatever the machine's load."""
    deadline = time.monotonic() + wait
    while _started_in(directory) and time.monotonic() < deadline:
        try:
            with Client(directory / "server.sock", timeout=wait) as client:
                client.request(Stop())
            break
        except CacheError:  # not listening yet
            time.sleep(0.05)
    while _started_in(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    while pids := _started_in(directory):  # past the deadline: kill (a loader's children are found too)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _wait_for_fills(directory: Path, wait: float = 600.0) -> None:
    """Wait until the server in ``directory`` has no background fill running (``ZEROCOPY_PICKLE_CACHE_FILL=
    background``: the run that missed has exited, its entries are still being loaded for the next run)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        with contextlib.suppress(CacheError), Client(directory / "server.sock", timeout=30) as client:
            if not StatusReply.decode(client.request(StatusRequest())[0]).status.get("filling"):
                return
        time.sleep(0.05)


def measure_autostart(paths: dict[str, str], variant: str, dtype: str = "float32") -> dict[str, Any]:
    """The first call of the day: one run with ``patch_all()`` and no server running yet, in a fresh private
    cache directory (so the run starts its own server, as a user's first program does); that server is stopped
    afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="zcp-autostart-")) / "cache"
    directory.mkdir(mode=0o700)
    try:
        return _one_run({**os.environ, DIR_ENV: str(directory)}, "autostart", variant, paths, dtype)
    finally:
        _stop_started_server(directory)
        shutil.rmtree(directory.parent, ignore_errors=True)


def measure(
    paths: dict[str, str],
    *,
    runs: int,
    variants: tuple[str, ...] = ("vae", "wrapper", "remote"),
    dtype: str = "float32",
    autostart: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Run the scenario ``runs`` times plain and ``runs`` times through a fresh cache server, per variant; with
    ``autostart``, also once with no server running (:func:`measure_autostart`) before the server is started.

    Returns:
        ``{"plain/vae": [run, ...], "autostart/vae": [run], "cache/vae": [...], ...}``; the first cache run of a
        variant is its miss.
    """
    results: dict[str, list[dict[str, Any]]] = {}
    for variant in variants:
        results[f"plain/{variant}"] = [_one_run(dict(os.environ), "plain", variant, paths, dtype) for _ in range(runs)]
        if autostart:
            results[f"autostart/{variant}"] = [measure_autostart(paths, variant, dtype)]
        with private_server() as env:
            results[f"cache/{variant}"] = []
            for _ in range(runs):
                results[f"cache/{variant}"].append(_one_run(env, "cache", variant, paths, dtype))
                _wait_for_fills(Path(env[DIR_ENV]))
    return results


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    """Seconds per step, per run, like Overmind's table; then medians of the warm runs.

    ``results`` maps ``MODE/VARIANT`` to runs; the warm runs are every run of ``plain/...``, every run after the
    first of the others (a mode with one run, such as ``autostart/...``, has none).
    """
    steps = dict.fromkeys(step for runs in results.values() for run in runs for step in _steps(run))
    columns = (*steps, *TOTALS)
    width = max([24, *(len(name) + 7 for name in results)])
    print(f"  {'run':<{width}}" + "".join(f"{c:>10}" for c in columns))
    for name, runs in results.items():
        for i, run in enumerate(runs):
            label = f"{name}, {'1st' if i == 0 else f'{i + 1}th' if i > 2 else ('2nd', '3rd')[i - 1]}"
            print(f"  {label:<{width}}" + "".join(f"{run[c]:10.3f}" if c in run else f"{'-':>10}" for c in columns))
    print("\n  warm medians (plain: every run; the others: every run after the first)")
    for name, runs in results.items():
        warm = runs if name.startswith("plain") else runs[1:]
        if warm:
            print(
                f"  {name:<{width}}"
                + "".join(
                    f"{statistics.median(r[c] for r in warm):10.3f}" if c in warm[0] else f"{'-':>10}" for c in columns
                )
            )


def run_demo(size: str = "tiny", runs: int = 3, directory: str | None = None) -> int:
    """``zerocopy-pickle demo``: build the pipeline, run the scenario plain and cached, print the tables."""

    quiet_third_party()  # the build imports diffusers and transformers here; the runs below do in their children

    with tempfile.TemporaryDirectory(dir=directory, prefix="zcp-demo-models-") as tmp:
        print(f"building a {size} StableDiffusionControlNetPipeline and two ControlNets in {tmp} ...", flush=True)
        paths = build_controlnet_pipeline(tmp, size=size)
        print(f"running the seed scenario {runs} times per variant, plain and through a fresh cache server ...\n")
        results = measure(paths, runs=runs, dtype="float32" if size == "tiny" else "float16")
    print_table(results)
    print(
        "\n'vae': the pipeline is loaded with vae=vae; 'wrapper': also controlnet=MultiControlNetModel([edge, "
        "depth]); 'remote': 'vae', then a transformers model with its own code (trust_remote_code=True)."
        "\nThe first cache run of each variant is its miss; later runs are hits served from shared memory."
    )
    return 0


if __name__ == "__main__":
    import warnings

    # The parent reads this process's stdout for the result line and shows its stderr only if the run fails:
    # keep that stderr to what can explain a failure (and _one_run turns the progress bars off).
    quiet_third_party()
    # The steps call from_pretrained(..., torch_dtype=...) as the seed code does (and benchmarks/overmind_runner.py,
    # which must run the same calls on older diffusers), where current diffusers ask for dtype=.
    warnings.filterwarnings("ignore", message=r"`torch_dtype` is deprecated", category=FutureWarning)
    mode, variant, paths_json, dtype_name = sys.argv[1:5]
    print(json.dumps(_run_steps(mode, variant, json.loads(paths_json), dtype_name)))
