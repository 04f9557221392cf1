"""Host to device: one 5-6 GB snapshot loaded to ``cuda:0`` four ways, and a cached pipeline put on the GPU.

Needs a CUDA device. Run it from the repository root (benchmarks/device_check.sh runs it with the CUDA tests)::

    python benchmarks/device.py --models /tmp/sd15              # SD1.5-sized ControlNet pipeline (diffusers)
    python benchmarks/device.py --synthetic 5.5                 # no diffusers: 1100 tensors, 5.5 GB
    python benchmarks/device.py --models /tmp/sd15 --json out.json
    python benchmarks/device.py --synthetic 5.5 --scratch /data/zcp   # the file on a disk, for part 3

Part 1, in this process, from one snapshot file in the page cache (read once before): the graph is the
pipeline's modules (``--models``: the UNet, both ControlNets, VAE and text encoder in float16, built with
``examples.models.build_controlnet_pipeline(size="sd15")`` when DIR is empty) or ``--synthetic GB`` of
float16 linear layers. Each way is timed ``--repeat`` times after ``torch.cuda.empty_cache()`` (so every
way pays its device allocations), to the end of ``torch.cuda.synchronize()``:

* ``per-storage``: the graph loaded zero-copy on the CPU (not timed), then ``.to("cuda")`` tensor by tensor
  (Overmind's way: one pageable copy and one allocation per tensor);
* ``module.to``: ``.to("cuda")`` of the graph after a plain load into private memory (``pipe.to``);
* ``pinned peak``: the same number of bytes in one pinned host tensor, copied in one piece into a device buffer
  allocated beforehand (the link's practical peak; allocation not timed);
* ``zerocopy load``: ``zp.load(snapshot, map_location="cuda:0")``, everything included;
* ``to_device staged`` / ``to_device registered``: ``zp.to_device`` of the graph loaded zero-copy (the
  transfer alone: what follows a cache hit).

Part 3, cold (``--no-cold`` skips it): the same snapshot file with its pages evicted from the page cache before
every run (``fsync`` and ``POSIX_FADV_DONTNEED``, which needs no root; as root also ``echo 3 >
/proc/sys/vm/drop_caches``), checked with ``cachestat``. The file must be on a disk, not tmpfs (``--scratch``):

* ``cold disk peak``: the file's data read with ``O_DIRECT`` by 8 threads into one pinned buffer (no device):
  what the disk delivers;
* ``cold per-storage``: ``.to("cuda")`` tensor by tensor from the mapping (every page faulted in on the way);
* ``cold load, mapping``: ``zp.load(map_location="cuda:0")`` copying from the mapping (``COLD_BELOW = 0``: the
  path before cold reads);
* ``cold load, file reads``: the same load with the default ``COLD_BELOW``: the file read straight into the
  pinned slots by ``coldread.READERS`` threads (``O_DIRECT`` where aligned);
* ``cold move, file reads``: ``transfer.move`` of the zero-copy load's storages given the file directly: the
  cold transfer alone, whether or not the load passes its file;
* ``warm load, file reads``: the file reads forced on a warm page cache (``COLD_BELOW = 2``; every chunk is
  resident, so read buffered, from the cache), against part 1's ``zerocopy load`` (copies from the mapping):
  whether the threshold is where it should be.

Each cold way also records which path its transfers took and the bytes read direct and buffered
(``transfer.STATS``). Targets: cold file reads at least 0.8 of the disk peak, and faster than the mapping.

Part 2 (``--models`` only), fresh processes: plain ``from_pretrained`` of the VAE, two ControlNets and the
pipeline, then ``.to("cuda")`` of each, against the same calls through the model cache (a private server
started here; one miss, then hits) followed by one ``zp.to_device``. Target: a hit and its ``to_device`` in less
than a third of the plain time.

Prints GB/s (10^9 bytes per second) and the ratios the issue asks for: zerocopy_pickle's rate over the pinned
peak (target >= 0.8) and over per-storage (target >= 3).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zerocopy_pickle as zp
from zerocopy_pickle._devices import coldread, transfer
from zerocopy_pickle._devices.plan import SourceFile
from zerocopy_pickle._storage import readahead

CHILD = r"""
import json, sys, time
import torch
mode, paths = sys.argv[1], json.loads(sys.argv[2])
if mode == "cache":
    from zerocopy_pickle.cache import patch_all
    patch_all()
import zerocopy_pickle as zp
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline
torch.cuda.init()
dtype = torch.float16
start = time.perf_counter()
vae = AutoencoderKL.from_pretrained(paths["pipeline"], subfolder="vae", torch_dtype=dtype)
edge = ControlNetModel.from_pretrained(paths["edge"], torch_dtype=dtype)
depth = ControlNetModel.from_pretrained(paths["depth"], torch_dtype=dtype)
pipe = StableDiffusionControlNetPipeline.from_pretrained(
    paths["pipeline"], vae=vae, controlnet=edge, safety_checker=None, torch_dtype=dtype)
loaded = time.perf_counter()
if mode == "cache":
    zp.to_device([pipe, depth], "cuda")
else:
    pipe.to("cuda")
    depth.to("cuda")
torch.cuda.synchronize()
end = time.perf_counter()
assert pipe.unet.conv_in.weight.device.type == "cuda" and depth.conv_in.weight.device.type == "cuda"
print(json.dumps({"load": loaded - start, "to_cuda": end - loaded, "total": end - start}))
"""


def _graph(args: argparse.Namespace) -> dict[str, Any]:
    if args.synthetic:
        torch.manual_seed(0)
        count = 1100
        width = int((args.synthetic * 1e9 / 2 / count) ** 0.5)
        return {"layers": torch.nn.ModuleList(torch.nn.Linear(width, width).half() for _ in range(count))}
    from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
    from examples.models import build_controlnet_pipeline

    root = Path(args.models)
    if not (root / "pipeline").exists():
        build_controlnet_pipeline(root, size="sd15")
    dtype = torch.float16
    edge = ControlNetModel.from_pretrained(root / "controlnet-edge", torch_dtype=dtype)
    depth = ControlNetModel.from_pretrained(root / "controlnet-depth", torch_dtype=dtype)
    vae = AutoencoderKL.from_pretrained(root / "pipeline", subfolder="vae", torch_dtype=dtype)
    pipe = StableDiffusionControlNetPipeline.from_pretrained(
        root / "pipeline", vae=vae, controlnet=edge, safety_checker=None, torch_dtype=dtype
    )
    return {"unet": pipe.unet, "text_encoder": pipe.text_encoder, "vae": vae, "edge": edge, "depth": depth}


def _tensors(graph: dict[str, Any]) -> list[torch.Tensor]:
    return [t for module in graph.values() for t in (*module.parameters(), *module.buffers())]


def _nbytes(graph: dict[str, Any]) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _tensors(graph)}
    return sum(storages.values())


def _timed(prepare: Callable[[], Any], run: Callable[[Any], Any], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        state = prepare()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        start = time.perf_counter()
        result = run(state)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del result, state
        torch.cuda.empty_cache()
    return times


def part1(args: argparse.Namespace, scratch: Path) -> tuple[dict[str, Any], Path]:
    graph = _graph(args)
    nbytes = _nbytes(graph)
    path = scratch / "graph.zcp"
    zp.dump(graph, path)
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    allow = {"trusted": True}
    ways: dict[str, list[float]] = {}

    def per_storage(loaded: dict[str, Any]) -> list[torch.Tensor]:
        return [t.to("cuda") for t in _tensors(loaded)]

    ways["per-storage"] = _timed(lambda: zp.load(path, **allow), per_storage, args.repeat)
    ways["module.to"] = _timed(
        lambda: zp.load(path, copy=True, **allow), lambda g: [m.to("cuda") for m in g.values()], args.repeat
    )
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    peak = []
    for _ in range(args.repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device_buffer.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        peak.append(time.perf_counter() - start)
    ways["pinned peak"] = peak
    del host, device_buffer
    ways["zerocopy load"] = _timed(lambda: None, lambda _: zp.load(path, map_location="cuda:0", **allow), args.repeat)
    for method in ("staged", "registered"):
        ways[f"to_device {method}"] = _timed(
            lambda: zp.load(path, **allow), lambda g, m=method: zp.to_device(g, "cuda:0", method=m), args.repeat
        )
    return {"nbytes": nbytes, "tensors": len(_tensors(graph)), "ways": ways}, path


def _evict(path: Path) -> int:
    """Drop the file's pages from the page cache; the bytes of it still cached afterwards (0 on a disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if os.geteuid() == 0:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cached = readahead.cached_bytes(fd, 0, os.fstat(fd).st_size)
        return -1 if cached is None else cached
    finally:
        os.close(fd)


def _disk_peak(path: Path, host: torch.Tensor, threads: int = 8, chunk: int = 64 << 20) -> int:
    """Read the whole file with O_DIRECT (buffered where refused) by ``threads`` into ``host`` (pinned, at
    least the file's size and a chunk)."""
    size = os.path.getsize(path)
    base = host.data_ptr() + (-host.data_ptr() % 4096)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)

    def read(offset: int) -> int:
        view = memoryview((ctypes.c_char * chunk).from_address(base + offset)).cast("B")
        return os.preadv(fd, [view], offset)

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(read, range(0, size, chunk)))
    finally:
        os.close(fd)


def part3(path: Path, repeat: int) -> dict[str, Any]:
    """Loads of the snapshot at ``path`` whose pages are not in the page cache (see the module's docstring)."""
    results: dict[str, Any] = {"ways": {}, "paths": {}, "still cached": []}
    if _evict(path) > os.path.getsize(path) // 100:
        results["skipped"] = f"{path} stays in the page cache after eviction (tmpfs?): pass --scratch on a disk"
        return results

    def timed(name: str, run: Callable[[], Any], below: float = coldread.COLD_BELOW, cold: bool = True) -> None:
        times = []
        default = coldread.COLD_BELOW
        before = dict(transfer.STATS)
        try:
            coldread.COLD_BELOW = below
            for _ in range(repeat):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                if cold:
                    results["still cached"].append(_evict(path))
                start = time.perf_counter()
                result = run()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                del result
        finally:
            coldread.COLD_BELOW = default
        results["ways"][name] = times
        results["paths"][name] = {k: v - before.get(k, 0) for k, v in transfer.STATS.items() if v != before.get(k, 0)}

    hosts = [torch.empty(os.path.getsize(path) + (64 << 20), dtype=torch.uint8, pin_memory=True)]  # not timed
    timed("cold disk peak", lambda: _disk_peak(path, hosts[0]))
    hosts.clear()
    timed("cold per-storage", lambda: [t.to("cuda") for t in _tensors(zp.load(path, prefetch=False, trusted=True))])
    timed("cold load, mapping", lambda: zp.load(path, map_location="cuda:0", trusted=True), below=0.0)
    timed("cold load, file reads", lambda: zp.load(path, map_location="cuda:0", trusted=True))
    # The transfer alone, given its file directly (what the load does once snapshot.py passes source_file=).
    graph = zp.load(path, prefetch=False, trusted=True)  # zero-copy views of the mapping; not timed
    storages = list({t.untyped_storage()._cdata: t.untyped_storage() for t in _tensors(graph)}.values())
    header = zp.read_header(path)
    first = min(header.buffer_range(i)[0] for i, entry in enumerate(header.buffers) if entry.dtype is not None)
    low = min(s.data_ptr() for s in storages)
    source = SourceFile(-1, tuple(s.data_ptr() - low + first for s in storages))
    with open(path, "rb") as f:  # the offsets are right: the file's bytes are the storages' bytes
        for storage, offset in list(zip(storages, source.offsets, strict=True))[:: max(1, len(storages) // 8)]:
            n = min(storage.nbytes(), 4096)
            assert os.pread(f.fileno(), n, offset) == bytes(storage[:n].cpu()) if n else True
        fd = f.fileno()
        timed(
            "cold move, file reads",
            lambda: transfer.move(storages, torch.device("cuda:0"), source=dataclasses.replace(source, fd=fd)),
        )
    del graph
    storages.clear()
    with open(path, "rb") as f:  # back into the page cache
        while f.read(64 << 20):
            pass
    timed("warm load, file reads", lambda: zp.load(path, map_location="cuda:0", trusted=True), below=2.0, cold=False)
    return results


def _child(env: dict[str, str], mode: str, paths: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, json.dumps(paths)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"the {mode} run failed:\n{proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def part2(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
    from examples import cache_scenario as scenario

    root = Path(args.models)
    paths = {"pipeline": str(root / "pipeline"), "edge": str(root / "controlnet-edge"),
             "depth": str(root / "controlnet-depth")}  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "miss": [], "hit": []}
    for _ in range(args.repeat):
        runs["plain"].append(_child(dict(os.environ), "plain", paths))
    with scenario.private_server() as env:
        runs["miss"].append(_child(env, "cache", paths))
        for _ in range(args.repeat):
            runs["hit"].append(_child(env, "cache", paths))
    return runs


def report(results: dict[str, Any]) -> None:
    one = results["part1"]
    nbytes = one["nbytes"]
    print(f"{nbytes / 1e9:.2f} GB in {one['tensors']} tensors to {results['device']}; seconds (median of runs), GB/s")
    rates = {}
    for way, times in one["ways"].items():
        median = statistics.median(times)
        rates[way] = nbytes / median / 1e9
        print(f"  {way:<22} {median:8.3f} s {rates[way]:7.1f} GB/s   runs: {' '.join(f'{t:.3f}' for t in times)}")
    best = max(rates["zerocopy load"], rates["to_device staged"], rates["to_device registered"])
    print(f"  zerocopy load / pinned peak: {rates['zerocopy load'] / rates['pinned peak']:.2f} (target >= 0.8)")
    print(f"  best to_device / pinned peak: {best / rates['pinned peak']:.2f}")
    print(f"  zerocopy load / per-storage: {rates['zerocopy load'] / rates['per-storage']:.2f}x (target >= 3)")
    print(f"  staged / registered: {rates['to_device staged'] / rates['to_device registered']:.2f}")
    three = results.get("part3")
    if three and three.get("skipped"):
        print(f"cold: skipped: {three['skipped']}")
    elif three:
        print(f"cold page cache (bytes still cached before each run: {three['still cached']}); seconds, GB/s")
        cold = {}
        for way, times in three["ways"].items():
            median = statistics.median(times)
            cold[way] = nbytes / median / 1e9
            paths = ", ".join(f"{k} {v}" for k, v in three["paths"].get(way, {}).items())
            print(f"  {way:<22} {median:8.3f} s {cold[way]:7.1f} GB/s   runs: {' '.join(f'{t:.3f}' for t in times)}")
            if paths:
                print(f"  {'':<22} transfers: {paths}")
        if "cold" not in three["paths"]["cold load, file reads"]:
            print("  the cold load copied from the mapping: snapshot loads do not pass source_file= yet")
        reads, mapping = cold["cold load, file reads"], cold["cold load, mapping"]
        moved = cold["cold move, file reads"]
        print(f"  cold move (transfer alone) / disk peak: {moved / cold['cold disk peak']:.2f} (target >= 0.8)")
        print(f"  cold move (transfer alone) / cold mapping load: {moved / mapping:.2f}x")
        print(f"  cold file reads / disk peak: {reads / cold['cold disk peak']:.2f} (target >= 0.8)")
        print(f"  cold file reads / cold mapping: {reads / mapping:.2f}x")
        print(f"  cold file reads / cold per-storage: {reads / cold['cold per-storage']:.2f}x")
        warm = cold["warm load, file reads"] / rates["zerocopy load"]
        print(f"  warm file reads / warm zerocopy load: {warm:.2f} (above 1: raise coldread.COLD_BELOW)")
    two = results.get("part2")
    if two:
        print("fresh processes, VAE + two ControlNets + pipeline, then on the GPU; seconds (load, to cuda, total)")
        for name, runs in two.items():
            cols = " | ".join(f"{r['load']:.3f} {r['to_cuda']:.3f} {r['total']:.3f}" for r in runs)
            print(f"  {name:<6} {cols}")
        plain = statistics.median(r["total"] for r in two["plain"])
        hit = statistics.median(r["total"] for r in two["hit"])
        print(f"  hit + to_device / plain + .to: {hit / plain:.2f} (target < 0.33)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--models", help="folder of the SD1.5-sized pipeline (built there when empty)")
    source.add_argument("--synthetic", type=float, help="GB of float16 linear layers instead (no diffusers)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--scratch", help="folder for the snapshot file (a disk, for part 3; default: the temp dir)")
    parser.add_argument("--no-cold", action="store_true", help="skip part 3 (cold page cache)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/device.py needs a CUDA device; none is available here", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.scratch:
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zcp-device-", dir=args.scratch) as scratch:
        results["part1"], path = part1(args, Path(scratch))
        if not args.no_cold:
            results["part3"] = part3(path, args.repeat)
    if args.models:
        results["part2"] = part2(args)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
