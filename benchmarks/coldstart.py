"""Cold starts side by side: the disk's limits, then every loader in fresh processes, cold and warm.

Run it from the repository root, as root for ``--drop-caches`` (about 12 GB of disk in ``--workdir``, minutes)::

    .venv/bin/python benchmarks/coldstart.py --drop-caches --reps 3 --json coldstart.json
    .venv/bin/python benchmarks/coldstart.py --drop-caches --reps 3 --busy --json coldstart-busy.json
    .venv/bin/python benchmarks/coldstart.py --drop-caches --cases sd15 --models /work/sd15 --reps 3
    .venv/bin/python benchmarks/coldstart.py --from-json coldstart.json --plot docs/coldstart.png

Cases (``--cases``, default ``llm,many``):

* ``llm``: an LLM-like state dict, 291 float16 tensors, 3.4 GB (32 layers of hidden 2048, MLP 5632, vocabulary
  32000: the attention, MLP and norm weights of each layer, the embedding, the final norm, the head);
* ``many``: 1000 float32 tensors of 2 MiB (2000 MiB);
* ``sd15``: the SD1.5-sized ControlNet pipeline of ``benchmarks/cache.py`` (``--models DIR``, built there once) through
  the model cache, the seed scenario's ``vae`` variant in float16, each run a fresh process
  (``examples/cache_scenario.py``): plain ``from_pretrained`` after the page cache was dropped, against a cache
  miss (a fresh server, started and ready, then the page cache dropped) and a hit of that server after the page
  cache was dropped again.

Each file is written once in every format a loader reads (``zp.dump``, ``safetensors.torch.save_file``,
``torch.save``, and each streaming peer's own from ``benchmarks/coldstart_peers.py``, pinned in the ``bench``
extra). Then, per case:

1. **The disk's limits** on the zerocopy_pickle file, cold, at the start of every round (the disk's speed drifts:
   each round's loaders are compared with that round's limit): buffered reads (``sendfile`` to ``/dev/null``, no
   copy) and ``O_DIRECT`` reads into private memory, by 1, 2, 4 and 8 threads each reading a contiguous part
   sequentially, 16 MiB per call. The best of them is "the disk's best parallel read of the same bytes". Right
   before each cold run the rate is probed again (the better of 1 and 4 buffered streams), and each cold run is
   also reported against its own probe.
2. **Each loader in a fresh process**, interleaved and rotated across ``--reps`` rounds: cold (once the process
   has imported everything and run the touch's own code on a small tensor, the page cache is dropped with
   ``--drop-caches``, else only the benchmark's files are evicted, ``fadvise(DONTNEED)``; pages the process has
   mapped stay, so this measures reading the model, not paging torch's code back in), then warm (the same loader
   again, the page cache as its cold run left it). A run loads, then reads one byte of
   every 4 KiB page of every tensor; it reports the load call, the total (load and touch: the model is usable),
   the page faults of the touch, peak RSS, and its anonymous against file-backed resident memory at the end
   (``RssAnon``/``RssFile`` of ``/proc/self/status``: a copying loader holds anonymous memory, a mapping loader
   file-backed pages it shares with the page cache).

``--busy`` runs a CPU-bound neighbour process (a Python loop) for the whole benchmark: the user's busy machine.
Medians per loader and the ratios (cold total ÷ the disk's best; warm total ÷ safetensors' warm total) are printed
and written with every run to ``--json``; ``--plot`` draws the cold and warm totals per case.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
DISK_CHUNK = 16 * MIB


# --- the files -----------------------------------------------------------------------------------------------------


def llm_state_dict() -> dict[str, Any]:
    import torch

    hidden, mlp, vocab, layers = 2048, 5632, 32000, 32
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.float16).uniform_(-0.05, 0.05, generator=generator)

    sd = {"model.embed_tokens.weight": weight(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = weight(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = weight(mlp, hidden)
        sd[p + "mlp.up_proj.weight"] = weight(mlp, hidden)
        sd[p + "mlp.down_proj.weight"] = weight(hidden, mlp)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
    sd["model.norm.weight"] = torch.ones(hidden, dtype=torch.float16)
    sd["lm_head.weight"] = weight(vocab, hidden)
    return sd


def many_state_dict() -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return {f"t{i:04d}": torch.empty(512 * 1024).uniform_(generator=generator) for i in range(1000)}


CASES = {"llm": llm_state_dict, "many": many_state_dict}


def peers() -> list[Any]:
    """The streaming peers that work here (``benchmarks/coldstart_peers.py``), and why the others do not."""
    try:
        import coldstart_peers
    except ImportError as e:
        print(f"no streaming peers: {e}", file=sys.stderr)
        return []
    usable = []
    for peer in coldstart_peers.PEERS:
        why = peer.unavailable()
        if why is None:
            usable.append(peer)
        else:
            print(f"{peer.name}: not run ({why})", file=sys.stderr)
    return usable


def build(case: str, workdir: Path, peer_list: list[Any]) -> dict[str, str]:
    """Every file of ``case`` (written once, reused), by loader name."""
    folder = workdir / case
    folder.mkdir(parents=True, exist_ok=True)
    files = {"zp": folder / "sd.zcp", "safetensors": folder / "sd.safetensors", "torch-mmap": folder / "sd.pt"}
    if not all(p.exists() for p in files.values()):
        import safetensors.torch
        import torch

        import zerocopy_pickle as zp

        sd = CASES[case]()
        zp.dump(sd, files["zp"])
        safetensors.torch.save_file(sd, str(files["safetensors"]))
        torch.save(sd, files["torch-mmap"])
        del sd
    paths = {name: str(path) for name, path in files.items()}
    paths["zp (no prefetch)"] = paths["zp"]
    for peer in peer_list:
        marker = folder / f"{peer.name}.path"
        if marker.exists() and Path(marker.read_text()).exists():
            paths[peer.name] = marker.read_text()
        else:
            target = folder / peer.name
            target.mkdir(exist_ok=True)
            paths[peer.name] = peer.prepare(paths["safetensors"], str(target))
            marker.write_text(paths[peer.name])
    return paths


# --- cold and warm ---------------------------------------------------------------------------------------------------


def drop_caches(files: list[str], whole: bool) -> None:
    """Empty the page cache (``whole``, as root), or evict ``files`` alone."""
    os.sync()
    if whole:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    for name in files:
        for path in Path(name).rglob("*") if Path(name).is_dir() else [Path(name)]:
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _read_parts(path: str, threads: int, direct: bool) -> float:
    """Seconds for ``threads`` threads to read ``path``, each a contiguous part, sequentially."""
    size = os.path.getsize(path)
    step = -(-size // threads) // mmap.PAGESIZE * mmap.PAGESIZE + mmap.PAGESIZE

    def read(start: int, stop: int) -> None:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            if direct:
                buffer = mmap.mmap(-1, DISK_CHUNK)  # page-aligned, as O_DIRECT needs
                view = memoryview(buffer)
                while start < stop:
                    got = os.preadv(fd, [view[: min(DISK_CHUNK, stop - start + mmap.PAGESIZE)]], start)
                    if got <= 0:
                        break
                    start += got
            else:
                null = os.open(os.devnull, os.O_WRONLY)
                try:
                    while start < stop:
                        got = os.sendfile(null, fd, start, min(DISK_CHUNK, stop - start))
                        if got <= 0:
                            break
                        start += got
                finally:
                    os.close(null)
        finally:
            os.close(fd)

    parts = [(i * step, min(size, (i + 1) * step)) for i in range(threads)]
    workers = [threading.Thread(target=read, args=part) for part in parts if part[1] > part[0]]
    began = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - began


def probe_limit(path: str, whole: bool) -> float:
    """The disk's rate (GB/s) right before a cold run: the better of one and four buffered streams (the best two
    ways in the full sweep on this machine), since the disk's speed drifts within seconds."""
    size = os.path.getsize(path)
    best = 0.0
    for threads in (4, 1):
        drop_caches([path], whole)
        best = max(best, size / _read_parts(path, threads, False) / 1e9)
    return best


def disk_limits(path: str, whole: bool) -> dict[str, float]:
    """GB/s of each way of reading ``path`` cold (see the module docstring)."""
    size = os.path.getsize(path)
    rates = {}
    for direct in (False, True):
        for threads in (1, 2, 4, 8):
            drop_caches([path], whole)
            rates[f"{'direct' if direct else 'buffered'} x{threads}"] = size / _read_parts(path, threads, direct) / 1e9
    return rates


# --- one run, in a fresh process -------------------------------------------------------------------------------------


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _touch(sd: dict[str, Any]) -> int:
    import torch

    total = 0
    for tensor in sd.values():
        total += int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def child(loader: str, path: str, ready: Any = None) -> dict[str, Any]:
    """Load ``path`` with ``loader``, touch every page, report (runs in the fresh process). ``ready``: called once
    everything but the timed part ran (the imports, the touch's own code on a small tensor), so that the caller
    can empty the page cache then: the cold run measures the data's reads, not torch's code being paged in."""
    import torch

    import zerocopy_pickle as zp

    _touch({"warm-up": torch.ones(1 << 20, dtype=torch.uint8)})
    if loader not in ("zp", "zp (no prefetch)", "safetensors", "torch-mmap"):
        sys.path.insert(0, str(HERE))
        import coldstart_peers

        (peer,) = [p for p in coldstart_peers.PEERS if p.name == loader]
    if ready is not None:
        ready()
    began = time.perf_counter()
    if loader == "zp":
        sd = zp.load(path)
    elif loader == "zp (no prefetch)":
        sd = zp.load(path, prefetch=False)
    elif loader == "safetensors":
        import safetensors.torch

        sd = safetensors.torch.load_file(path)
    elif loader == "torch-mmap":
        sd = torch.load(path, mmap=True, weights_only=True)
    else:
        sd = peer.load(path)
    loaded = time.perf_counter()
    reading = zp.prefetches()
    before = resource.getrusage(resource.RUSAGE_SELF)
    _touch(sd)
    touched = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_SELF)
    for job in reading:
        job.wait()
    return {
        "prefetch": [{"seconds": job.seconds, "read": job.read, "streams": job.streams} for job in reading],
        "load": loaded - began,
        "total": touched - began,
        "touch": touched - loaded,
        "faults": after.ru_minflt - before.ru_minflt,
        "major_faults": after.ru_majflt - before.ru_majflt,
        "peak_rss": _status("VmHWM"),  # not ru_maxrss: it keeps the parent's peak across exec
        "anon": _status("RssAnon"),
        "file": _status("RssFile"),
    }


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, zerocopy_pickle, zerocopy_pickle._core.snapshot, safetensors.torch
import coldstart

def ready():
    print("ready", flush=True)
    sys.stdin.readline()

print(json.dumps(coldstart.child(sys.argv[2], sys.argv[3], ready)), flush=True)
"""


def run(loader: str, path: str, cold: list[str] | None = None, whole: bool = False) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter, timed from after its imports; with ``cold`` (the files to evict),
    the page cache is emptied (``whole``) or those files evicted once the child is ready."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    argv = [sys.executable, "-c", _CHILD, str(HERE), loader, path]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as process:  # fmt: skip
        assert process.stdin is not None
        assert process.stdout is not None
        line = process.stdout.readline()
        if line.strip() == "ready":
            if cold is not None:
                drop_caches(cold, whole)
            process.stdin.write("go\n")
            process.stdin.flush()
        out, err = process.communicate()
        lines = (line + out).strip().splitlines()
    if process.returncode or not lines:
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {process.returncode}"}
    return dict(json.loads(lines[-1]))


# --- the SD1.5-sized pipeline through the cache --------------------------------------------------------------------


def cache_case(models: Path, reps: int, whole: bool) -> dict[str, list[dict[str, Any]]]:
    """Cold plain runs of the seed scenario against cold misses and cold hits, interleaved."""
    sys.path.insert(0, str(HERE))
    from cache import _paths

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
    from examples import cache_scenario as scenario
    from examples.models import build_controlnet_pipeline

    if not (models / "pipeline").exists():
        build_controlnet_pipeline(models, size="sd15")
    paths = _paths(models)
    files = [str(models)]
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "miss": [], "hit": []}
    for _ in range(reps):
        drop_caches(files, whole)
        rows["plain"].append(scenario._one_run(dict(os.environ), "plain", "vae", paths, "float16"))
        with scenario.private_server() as env:
            drop_caches(files, whole)
            rows["miss"].append(scenario._one_run(env, "cache", "vae", paths, "float16"))
            drop_caches(files, whole)
            rows["hit"].append(scenario._one_run(env, "cache", "vae", paths, "float16"))
    return rows


# --- the report ------------------------------------------------------------------------------------------------------


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def report(results: dict[str, Any]) -> None:
    for case, data in results["cases"].items():
        if case == "sd15":
            print("\nsd15 through the cache (totals, s):")
            plain = _median(data["plain"], "total")
            for mode, runs in data.items():
                median = _median(runs, "total")
                ratio = f"  {median / plain:.2f}x plain" if median is not None and plain else ""
                totals = " ".join(f"{r['total']:.2f}" if "total" in r else "failed" for r in runs)
                print(f"  {mode:6s} {totals}  median {median}{ratio}")
            continue
        bests = [max(rates.values()) for rates in data["disk"]]
        best = statistics.median(bests)
        print(f"\n{case}: {data['nbytes'] / 1e9:.2f} GB; the disk's limits per round, GB/s:")
        for number, rates in enumerate(data["disk"]):
            print(f"  round {number}: " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
        limit = data["nbytes"] / best / 1e9
        print(f"  best per round {', '.join(f'{b:.2f}' for b in bests)} GB/s (median {best:.2f}: {limit:.2f} s)")
        print("  cold total ÷ the limit probed right before the run (the better of 1 and 4 buffered streams):")
        for loader, runs in data["loaders"].items():
            within = [r["total"] / (data["nbytes"] / r["limit"] / 1e9) for r in runs["cold"] if "limit" in r]
            if within:
                shown = ", ".join(f"{x:.2f}" for x in within)
                print(f"    {loader:26s} median {statistics.median(within):.2f}: {shown}")
        warm_reference = _median(data["loaders"].get("safetensors", {}).get("warm", []), "total")
        print(f"  {'loader':28s} {'cold total':>10s} {'÷ limit':>8s} {'warm total':>10s} {'÷ st warm':>9s} "
              f"{'cold load':>9s} {'warm faults':>11s} {'peak RSS':>9s} {'anon':>8s} {'file':>8s}")  # fmt: skip
        for loader, runs in data["loaders"].items():
            cold, warm = runs["cold"], runs["warm"]
            errors = [r["error"] for r in cold + warm if "error" in r]
            if errors:
                print(f"  {loader:28s} failed: {errors[0][:100]}")
                continue
            c, w = _median(cold, "total"), _median(warm, "total")
            assert c is not None
            assert w is not None
            ratio = f"{w / warm_reference:9.2f}" if warm_reference else " " * 9
            print(f"  {loader:28s} {c:10.3f} {c / limit:8.2f} {w:10.3f} {ratio} {_median(cold, 'load'):9.3f} "
                  f"{_median(warm, 'faults'):11.0f} {_median(cold, 'peak_rss') / 1e9:8.2f}G "
                  f"{_median(cold, 'anon') / 1e9:7.2f}G {_median(cold, 'file') / 1e9:7.2f}G")  # fmt: skip


def plot(results: dict[str, Any], target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in results["cases"] if c != "sd15"]
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        data = results["cases"][case]
        names = [n for n, r in data["loaders"].items() if not any("error" in x for x in r["cold"] + r["warm"])]
        cold = [_median(data["loaders"][n]["cold"], "total") for n in names]
        warm = [_median(data["loaders"][n]["warm"], "total") for n in names]
        ys = range(len(names))
        ax.barh([y + 0.2 for y in ys], cold, height=0.4, label="cold: load + touch")
        ax.barh([y - 0.2 for y in ys], warm, height=0.4, label="warm: load + touch")
        best = statistics.median(max(rates.values()) for rates in data["disk"])
        ax.axvline(data["nbytes"] / best / 1e9, color="k", ls="--", lw=1,
                   label="the disk's best parallel read")  # fmt: skip
        ax.set_yticks(list(ys), names)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (medians)")
        ax.set_title(f"{case}: {data['nbytes'] / 1e9:.1f} GB{' (busy machine)' if results.get('busy') else ''}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="llm,many")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--drop-caches", action="store_true", help="drop the whole page cache before each cold run")
    parser.add_argument("--busy", action="store_true", help="run a CPU-bound neighbour process meanwhile")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "zcp-coldstart")
    parser.add_argument("--models", type=Path, help="sd15: the folder benchmarks/cache.py --models built (or builds)")
    parser.add_argument("--loaders", help="comma-separated: only these loaders")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from-json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        if args.drop_caches and os.geteuid() != 0:
            parser.error("--drop-caches needs root (without it, only the benchmark's files are evicted)")
        neighbour = (
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
        )  # fmt: skip
        try:
            results = measure(args)
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    report(results)
    if args.plot:
        plot(results, str(args.plot))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import zerocopy_pickle as zp

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "busy": args.busy, "drop_caches": args.drop_caches,
        "versions": {"zerocopy_pickle": zp.__version__, "torch": torch.__version__}, "cases": {},
    }  # fmt: skip
    peer_list = [] if args.no_peers else peers()
    for peer in peer_list:
        results["versions"][peer.name] = peer.version()
    for case in args.cases.split(","):
        if case == "sd15":
            if args.models is None:
                raise SystemExit("--cases sd15 needs --models DIR")
            results["cases"]["sd15"] = cache_case(args.models, args.reps, args.drop_caches)
            continue
        paths = build(case, args.workdir, peer_list)
        if args.loaders:
            paths = {k: v for k, v in paths.items() if k in args.loaders.split(",")}
        every_file = list(dict.fromkeys(paths.values()))
        zp_file = str(args.workdir / case / "sd.zcp")
        data: dict[str, Any] = {"nbytes": zp.read_header(zp_file).data_nbytes, "disk": [], "loaders": {}}
        order = list(paths)
        for rep in range(args.reps):
            data["disk"].append(disk_limits(zp_file, args.drop_caches))
            for loader in order[rep % len(order) :] + order[: rep % len(order)]:
                probe = probe_limit(zp_file, args.drop_caches)
                cold = run(loader, paths[loader], every_file, args.drop_caches)
                if "total" in cold:
                    cold["limit"] = probe
                warm = run(loader, paths[loader])
                runs = data["loaders"].setdefault(loader, {"cold": [], "warm": []})
                runs["cold"].append(cold)
                runs["warm"].append(warm)
                print(f"{case} rep {rep} {loader}: cold {cold.get('total', cold.get('error'))}, "
                      f"warm {warm.get('total', warm.get('error'))}", file=sys.stderr, flush=True)  # fmt: skip
        results["cases"][case] = data
    return results


if __name__ == "__main__":
    raise SystemExit(main())
