"""Dump speed: ``zerocopy_pickle.dump`` to a path against ``safetensors.torch.save_file`` and a plain write loop.

Run it from the repository root (``make bench`` runs it after benchmarks/snapshot.py)::

    .venv/bin/python benchmarks/dump.py                     # 2000 MiB state dict and a 256 MiB model, 5 repeats
    .venv/bin/python benchmarks/dump.py --mib 200 --model-mb 32 --repeat 3    # a quick check
    sudo .venv/bin/python benchmarks/dump.py --repeat 11 --drop-caches --skip write-loop --json out.json
                                                            # the runs of docs/benchmark.md (issue 24)

Workloads (the same tensors for every method):

* ``state``: a state dict of about ``--mib`` MiB in ``--tensors`` tensors, float32 and float16 alternating, of
  sizes spread evenly between 0.5x and 1.5x the mean (1000 tensors of 2 MiB on average by default).
* ``model``: the state dict of the GPT-style model of ``examples.models.build_model(size_mb=--model-mb)``,
  without the tied output head (safetensors refuses tensors that share memory; every method gets the same dict).

Methods, each writing a new file in a directory on the file system of ``--dir``:

* ``zp``: ``zerocopy_pickle.dump(state, path)``, checksums on (the default): atomic (unnamed temporary file,
  renamed into place when complete).
* ``zp-1w``: the same with one writing thread (``ZEROCOPY_PICKLE_DUMP_WRITERS=1``: a second thread only hashes,
  the writer before issue 24), so before and after are interleaved in one run.
* ``zp-ftruncate``: ``zp`` with the file sized by ``ftruncate`` instead of ``writes.preallocate``'s
  ``fallocate``.
* ``zp-nock``: ``zp`` with ``checksums=False``.
* ``safetensors``: ``safetensors.torch.save_file(state, path)`` (0.8 writes a named temporary file, sized with
  ``ftruncate``, one ``write`` per tensor, then renames it).
* ``write-loop``: ``open(path, "wb")`` and one ``f.write`` per tensor's bytes (no header, not atomic): what a naive
  writer of the same bytes costs.

Before each timed dump, outside the timer, the method's previous file is deleted, ``gc.collect()`` and
``os.sync()`` run (the kernel throttles writers once enough dirty pages pile up, which would punish whichever
method runs after another's dump). Methods are interleaved within each repetition and their order rotated
between repetitions. Columns: the median and the minimum wall time of ``--repeat`` runs, the median CPU time of
the process (user + system, all threads; on a busy machine it moves less than the wall time), and the median
wall time relative to safetensors' (``x st``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import zerocopy_pickle as zp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
from examples.models import build_model
from zerocopy_pickle._storage import integrity, writes

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
Samples = dict[str, dict[str, list[float]]]  # method -> {"wall": seconds, "cpu": seconds}


def state_dict(mib: float, tensors: int) -> dict[str, torch.Tensor]:
    """About ``mib`` MiB in ``tensors`` tensors: float32 and float16 alternating, sizes from 0.5x to 1.5x the mean."""
    mean = mib * MiB / tensors
    g = torch.Generator().manual_seed(0)
    seed = torch.randn(int(1.5 * mean) // 2 + 1, generator=g)  # enough elements for the largest float16 one
    state = {}
    for i in range(tensors):
        nbytes = int(mean * (0.5 + i / max(1, tensors - 1)))
        dtype = torch.float32 if i % 2 == 0 else torch.float16
        numel = max(1, nbytes // dtype.itemsize)
        state[f"layers.{i}.weight"] = (seed[:numel] + i).to(dtype)  # a storage of its own, distinct bytes
    return state


def model_state(size_mb: int) -> dict[str, torch.Tensor]:
    """A model's state dict, each storage once (the tied head dropped)."""
    seen: set[int] = set()
    state = {}
    for name, t in build_model(size_mb=size_mb).state_dict().items():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            state[name] = t.contiguous()
    return state


def methods(state: dict[str, torch.Tensor]) -> dict[str, Callable[[str], object]]:
    from safetensors.torch import save_file

    buffers = [t.reshape(-1).view(torch.uint8).numpy().data for t in state.values()]

    def write_loop(path: str) -> None:
        with open(path, "wb") as f:
            for b in buffers:
                f.write(b)

    def one_writer(path: str) -> None:
        os.environ[integrity.WRITERS_ENV] = "1"
        try:
            zp.dump(state, path)
        finally:
            del os.environ[integrity.WRITERS_ENV]

    def ftruncate(path: str) -> None:
        preallocate = writes.preallocate
        setattr(writes, "preallocate", os.ftruncate)  # noqa: B010 (mypy: another signature's name)
        try:
            zp.dump(state, path)
        finally:
            setattr(writes, "preallocate", preallocate)  # noqa: B010

    return {
        "zp": lambda path: zp.dump(state, path),
        "zp-1w": one_writer,
        "zp-ftruncate": ftruncate,
        "zp-nock": lambda path: zp.dump(state, path, checksums=False),
        "safetensors": lambda path: save_file(state, path),
        "write-loop": write_loop,
    }


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench(
    state: dict[str, torch.Tensor], directory: str, repeat: int, skip: set[str], drop_caches: bool = False
) -> Samples:
    table = {k: m for k, m in methods(state).items() if k not in skip}
    return time_interleaved(table, directory, repeat, drop_caches)


def drop_page_cache() -> None:
    """Write back and drop the kernel's clean page cache (needs root): every dump then starts with the same
    amount of free memory, whatever the previous one left cached."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def time_interleaved(
    table: dict[str, Callable[[str], object]], directory: str, repeat: int, drop_caches: bool = False
) -> Samples:
    """Call every ``table[key](path)`` once untimed (the first writes after the workload was built are the
    slowest here, whichever method makes them), then ``repeat`` times, rotating the order each round, each into a
    new file in ``directory`` (the previous one deleted, ``gc.collect()`` and ``os.sync()`` first, and with
    ``drop_caches`` the page cache dropped, all outside the timer); wall and CPU seconds per call. Also used by
    ``dump_variants.py``."""
    keys = list(table)
    samples: Samples = {k: {"wall": [], "cpu": []} for k in keys}
    for rep in range(-1, repeat):  # round -1 warms up and is not counted
        k0 = rep % len(keys)
        for key in keys[k0:] + keys[:k0]:
            path = os.path.join(directory, f"{key}.out")
            if os.path.exists(path):
                os.unlink(path)
            gc.collect()
            os.sync()
            if drop_caches:
                drop_page_cache()
            cpu, start = cpu_seconds(), time.perf_counter()
            table[key](path)
            if rep >= 0:
                samples[key]["wall"].append(time.perf_counter() - start)
                samples[key]["cpu"].append(cpu_seconds() - cpu)
    for key in keys:
        path = os.path.join(directory, f"{key}.out")
        if os.path.exists(path):
            os.unlink(path)
    return samples


def report(title: str, samples: Samples) -> None:
    print(f"\n{title}")
    print(f"  {'method':<12} {'median s':>9} {'min s':>8} {'cpu s':>8} {'x st':>6}   samples (s)")
    base = statistics.median(samples["safetensors"]["wall"]) if "safetensors" in samples else None
    for key, s in samples.items():
        med = statistics.median(s["wall"])
        ratio = f"{med / base:6.2f}" if base else "     -"
        runs = " ".join(f"{x:.3f}" for x in s["wall"])
        print(f"  {key:<12} {med:9.3f} {min(s['wall']):8.3f} {statistics.median(s['cpu']):8.3f} {ratio}   {runs}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=2000, help="size of the state dict workload in MiB (0: skip it)")
    p.add_argument("--tensors", type=int, default=1000, help="tensors in the state dict workload")
    p.add_argument("--model-mb", type=int, default=256, help="size of the model workload (0: skip it)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip", default="", help="methods to leave out, comma-separated (zp, zp-nock, ...)")
    p.add_argument("--dir", default=str(REPO / "benchmarks" / "out"), help="where the files are written")
    p.add_argument("--json", help="also write every sample (wall and CPU seconds per method) to this file")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before every timed dump (needs root; steadier figures where the kernel "
        "reclaims memory in the background)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    os.makedirs(args.dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="dump-", dir=args.dir)
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, zerocopy_pickle {zp.__version__}, "
        f"{os.cpu_count()} CPUs, kernel {platform.release()}, files in {directory}; medians of {args.repeat}"
        + ("; page cache dropped before every dump" if args.drop_caches else "")
    )
    results: dict[str, Any] = {"load_average": os.getloadavg(), "cpus": len(os.sched_getaffinity(0)), "workloads": {}}
    try:
        workloads = []
        if args.mib > 0:
            state = state_dict(args.mib, args.tensors)
            nbytes = sum(t.nbytes for t in state.values())
            workloads.append((f"state dict: {len(state)} fp32/fp16 tensors, {nbytes / MiB:.0f} MiB", state))
        if args.model_mb > 0:
            state = model_state(args.model_mb)
            nbytes = sum(t.nbytes for t in state.values())
            workloads.append((f"model state dict: {len(state)} tensors, {nbytes / MiB:.0f} MiB", state))
        for title, state in workloads:
            samples = bench(state, directory, args.repeat, skip, args.drop_caches)
            report(title, samples)
            results["workloads"][title] = samples
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        results["load_average_after"] = os.getloadavg()
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
