"""What each native helper (csrc/) buys over its Python twin (zerocopy_pickle.native).

Run it from the repository root (the native helpers are built into the cache first if needed)::

    .venv/bin/python benchmarks/native.py                                  # 10,000 storages, 128 MiB archive
    .venv/bin/python benchmarks/native.py --storages 2000 --archive-mb 32 --repeat 3   # a quick check

Measurements (median and minimum of ``--repeat`` runs, both backends interleaved in each run; on a shared
machine the minimum is the steadier figure):

* ``storage build``: building ``--storages`` CPU storages over 64-byte slices of one anonymous private mapping,
  as a load does: ``torch.frombuffer(slice, dtype=torch.uint8).untyped_storage()`` (Python) against the native
  builder. ``build`` times creating them, ``free`` dropping them (the native deleter takes the GIL and releases
  the buffer export; the Python one drops a reference to the slice).
* ``load N tensors``: the whole load of a frozen snapshot (``zp.freeze(...).load()``) holding ``--storages``
  small tensors, under each backend: what the storage builder saves out of everything else a load does.
* ``TorchScript load``: ``native.jit_load_from_buffer`` of a ``--archive-mb`` MiB ``torch.jit.save`` archive
  lying in a private file mapping (as in a snapshot's arena), each run in a fresh interpreter. ``peak`` is the
  rise of the process's peak RSS during the call (VmHWM, reset through /proc/self/clear_refs just before, with
  the archive's pages already resident), ``kept`` the rise of RSS after it. Both backends copy every tensor
  out of the archive into the module (that is the module's own memory); the Python path also copies the
  whole archive (``BytesIO.read()`` -> ``bytes``, pybind11 -> ``std::string``, ``std::istringstream``).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import zerocopy_pickle as zp
from zerocopy_pickle import native

BACKENDS = ("python", "native")
MiB = 1 << 20


def median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_storage_build(count: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per-storage build and free time, in microseconds (median and minimum of ``repeat`` runs)."""
    arena = mmap.mmap(-1, count * 64, flags=mmap.MAP_PRIVATE)
    whole = memoryview(arena)
    slices = [whole[i * 64 : (i + 1) * 64] for i in range(count)]
    frombuffer, uint8 = torch.frombuffer, torch.uint8
    with native.use("native"):
        native_build = native.storage_builder()
    assert native_build is not None

    # Each written out as rebuild.StorageBuilder runs it (no extra Python call around the Python path).
    def build_python(slices: list[memoryview] = slices) -> list[torch.UntypedStorage]:
        return [frombuffer(v, dtype=uint8).untyped_storage() for v in slices]

    def build_native(slices: list[memoryview] = slices) -> list[torch.UntypedStorage]:
        return [native_build(v) for v in slices]

    builders = {"python": build_python, "native": build_native}
    samples: dict[str, dict[str, list[float]]] = {name: {"build": [], "free": []} for name in BACKENDS}
    for _ in range(repeat):
        for name in BACKENDS:
            gc.collect()
            start = time.perf_counter()
            storages = builders[name]()
            middle = time.perf_counter()
            del storages
            end = time.perf_counter()
            samples[name]["build"].append((middle - start) / count * 1e6)
            samples[name]["free"].append((end - middle) / count * 1e6)
    del builders, build_python, build_native, slices, whole
    arena.close()
    return {
        name: {**{k: statistics.median(v) for k, v in s.items()}, **{f"{k}-min": min(v) for k, v in s.items()}}
        for name, s in samples.items()
    }


def bench_snapshot_load(count: int, repeat: int) -> dict[str, dict[str, float]]:
    """Microseconds per tensor for a whole load of a frozen snapshot of ``count`` small tensors (median and
    minimum of ``repeat`` runs)."""
    state = {f"layer{i}.weight": torch.full((16,), float(i)) for i in range(count)}
    result: dict[str, list[float]] = {name: [] for name in BACKENDS}
    with zp.freeze(state) as snap:
        for name in BACKENDS:  # warm-up: the stream check's cache, plugin discovery, prototypes
            with native.use(name):
                loaded = snap.load()
                assert torch.equal(loaded["layer7.weight"], state["layer7.weight"])
                del loaded
        for _ in range(repeat):
            for name in BACKENDS:
                with native.use(name):
                    result[name].append(median_time(snap.load, 1) / count * 1e6)
    return {name: {"median": statistics.median(v), "min": min(v)} for name, v in result.items()}


class Big(torch.nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def make_archive(path: Path, megabytes: int) -> None:
    width = 2048
    layers = max(1, round(megabytes * MiB / (width * width * 4)))
    torch.manual_seed(0)
    with torch.no_grad():
        module = torch.jit.script(Big(layers, width).eval())
    torch.jit.save(module, str(path))


def _status() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def child(path: str) -> None:
    """One TorchScript load in this fresh interpreter; prints JSON."""
    warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load's own
    torch.set_num_threads(1)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    arena = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    view = memoryview(arena)
    view.tobytes()  # fault every page in: the archive is resident before the measurement (it is in an arena)
    native.backend()  # resolve (and load the extension) outside the measurement
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status()
    start = time.perf_counter()
    module = native.jit_load_from_buffer(view)
    elapsed = time.perf_counter() - start
    after = _status()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    print(
        json.dumps(
            {
                "backend": native.backend(),
                "seconds": elapsed,
                "peak": after["VmHWM"] - before["VmRSS"],
                "kept": after["VmRSS"] - before["VmRSS"],
                "params": params,
                "archive": size,
            }
        )
    )


def bench_torchscript(megabytes: int, repeat: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "archive.pt"
        make_archive(path, megabytes)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in BACKENDS}
        for _ in range(repeat):
            for name in BACKENDS:
                env = dict(os.environ, **{native.ENV: name})
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", str(path)],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=True,
                )
                run = json.loads(proc.stdout.strip().splitlines()[-1])
                assert run["backend"] == name, run
                runs[name].append(run)
    return {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "backend"} for name, rs in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storages", type=int, default=10_000)
    parser.add_argument("--archive-mb", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    print(f"building or loading the native helpers: {native.build()}", flush=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")

    storage = bench_storage_build(args.storages, args.repeat)
    loads = bench_snapshot_load(args.storages, args.repeat)
    script = bench_torchscript(args.archive_mb, max(1, min(args.repeat, 3)))  # fresh interpreters: 3 at most

    def ratio(py: float, nat: float) -> str:
        return f"{py / nat:.1f}x" if nat else "-"

    rows = [("measurement", "python", "native", "python/native")]
    for label, key in (("storage build", "build"), ("storage free", "free")):
        for stat, suffix in (("median", ""), ("min", "-min")):
            py, nat = storage["python"][key + suffix], storage["native"][key + suffix]
            rows.append((f"{label}, µs each ({args.storages:,}), {stat}", f"{py:.3f}", f"{nat:.3f}", ratio(py, nat)))
    for stat in ("median", "min"):
        py, nat = loads["python"][stat], loads["native"][stat]
        rows.append(
            (f"load {args.storages:,} tensors, µs per tensor, {stat}", f"{py:.2f}", f"{nat:.2f}", ratio(py, nat))
        )
    archive_mib = script["python"]["archive"] / MiB
    rows += [
        (
            f"TorchScript load ({archive_mib:.0f} MiB archive), s",
            f"{script['python']['seconds']:.3f}",
            f"{script['native']['seconds']:.3f}",
            ratio(script["python"]["seconds"], script["native"]["seconds"]),
        ),
        (
            "  peak RSS rise, MiB",
            f"{script['python']['peak'] / MiB:.0f}",
            f"{script['native']['peak'] / MiB:.0f}",
            ratio(script["python"]["peak"], script["native"]["peak"]),
        ),
        (
            "  RSS kept after, MiB (the module's tensors)",
            f"{script['python']['kept'] / MiB:.0f}",
            f"{script['native']['kept'] / MiB:.0f}",
            "",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for i, row in enumerate(rows):
        print(
            "  ".join(
                cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
