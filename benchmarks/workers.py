"""One model, many worker processes: memory (PSS) of 4 workers holding it, and the time to hand one a pipeline.

Run it from the repository root on models ``benchmarks/cache.py --models DIR`` built (SD1.5-sized, float16)::

    .venv/bin/python -W ignore benchmarks/workers.py --models /work/sd15
    .venv/bin/python -W ignore benchmarks/workers.py --models /work/sd15 --workers 4 --json out.json

Part 1, memory: the pipeline's UNet held by ``--workers`` spawned worker processes at once, each having read
every page of its weights, five ways:

* ``each loads, as saved``: every worker calls ``UNet2DConditionModel.from_pretrained(torch_dtype=float16)``
  itself (the files are float16: diffusers maps them, and the workers share the page cache);
* ``each loads, to bfloat16``: the same, converting (a model the loader changed: private copies);
* ``zerocopy Shared`` / ``zerocopy Shared, bfloat16``: the parent loads it (float16, or converted to bfloat16),
  wraps it once in ``zerocopy_pickle.multiprocessing.Shared``, drops its own copy, and passes the ``Shared`` as
  each worker's argument (one sealed memfd, one fd per worker);
* ``torch.multiprocessing``: the parent loads it, calls ``share_memory()`` and passes the module through
  ``torch.multiprocessing``'s spawn context (its default sharing: one shared-memory fd per storage).

Each worker reports its PSS and RSS (``/proc/self/smaps_rollup``) and its open fds while all of them hold the
model; the parent measures itself at the same moment. The table gives workers + parent PSS (what the machine
pays), the workers' sum, and medians per worker.

Part 2, hand-off: the whole ControlNet pipeline (``StableDiffusionControlNetPipeline`` with one ControlNet) put on
a ``multiprocessing`` queue to a worker that is already running, from ``put`` to the worker holding it
(``time.monotonic`` is one clock for every process); the preparation before (``Shared``: freezing it into the
memfd; ``torch.multiprocessing``: ``share_memory()`` of every module) is timed apart. Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

from zerocopy_pickle.multiprocessing import Shared


def _memory() -> dict[str, int]:
    values = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss"):
                values[name.lower()] = int(rest.split()[0]) * 1024
    values["fds"] = len(os.listdir("/proc/self/fd"))
    return values


def _touch(model: Any) -> None:
    for tensor in model.state_dict().values():
        data = tensor.detach().reshape(-1)
        if data.numel():
            data.view(torch.uint8)[::4096].sum()


def _hold(how: str, payload: Any, touched: Any, done: Any, results: Any) -> None:
    torch.set_num_threads(1)
    if how.startswith("each loads"):
        from diffusers import UNet2DConditionModel

        path, dtype = payload
        model = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=getattr(torch, dtype))
    else:
        model = payload
    _touch(model)
    touched.wait()  # every worker holds its model: measure now
    results.put({"how": how, **_memory()})
    done.wait()  # the parent measured too: nobody unmaps before


WAYS = ("each loads, as saved", "each loads, to bfloat16", "zerocopy Shared", "zerocopy Shared, bfloat16",
        "torch.multiprocessing")  # fmt: skip


def part1(models: Path, workers: int) -> dict[str, dict[str, Any]]:
    import gc

    from diffusers import UNet2DConditionModel

    path = str(models / "pipeline")
    out: dict[str, dict[str, Any]] = {}
    for how in WAYS:
        context: Any = multiprocessing.get_context("spawn")
        payload: Any
        if how.startswith("each loads"):
            payload = (path, "bfloat16" if "bfloat16" in how else "float16")
        else:
            dtype = torch.bfloat16 if "bfloat16" in how else torch.float16
            unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=dtype)
            if how.startswith("zerocopy"):
                payload = Shared(unet)
                del unet  # the parent keeps the memfd only, as docs/distributed.md's recipe does
                gc.collect()
            else:
                context = torch.multiprocessing.get_context("spawn")
                payload = unet.share_memory()  # moved into shared memory: the parent's copy is that one
        touched, done, results = context.Barrier(workers), context.Barrier(workers + 1), context.Queue()
        procs = [context.Process(target=_hold, args=(how, payload, touched, done, results)) for _ in range(workers)]
        for proc in procs:
            proc.start()
        rows = [results.get(timeout=1800) for _ in procs]
        out[how] = {"workers": rows, "parent": _memory()}
        done.wait()
        for proc in procs:
            proc.join(600)
        del payload
        gc.collect()
    return out


def _receive(queue: Any, ready: Any, results: Any) -> None:
    import diffusers  # noqa: F401 - imported before the clock starts, as a running worker has it

    ready.set()
    while True:
        item = queue.get()
        if item is None:
            return
        now = time.monotonic()
        pipe = item["pipe"]
        results.put({"received": now, "unet": type(pipe.unet).__name__})
        del pipe, item


def part2(models: Path, rounds: int) -> dict[str, list[dict[str, float]]]:
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    dtype = torch.float16
    edge = ControlNetModel.from_pretrained(models / "controlnet-edge", torch_dtype=dtype)
    pipe = StableDiffusionControlNetPipeline.from_pretrained(
        models / "pipeline", controlnet=edge, safety_checker=None, torch_dtype=dtype
    )
    out: dict[str, list[dict[str, float]]] = {"zerocopy Shared": [], "torch.multiprocessing": []}
    for how, rows in out.items():
        module = torch.multiprocessing if how == "torch.multiprocessing" else multiprocessing
        context: Any = module.get_context("spawn")
        queue, ready, results = context.Queue(), context.Event(), context.Queue()
        worker = context.Process(target=_receive, args=(queue, ready, results))
        worker.start()
        ready.wait(600)
        for _ in range(rounds):
            start = time.monotonic()
            if how == "zerocopy Shared":
                item: Any = Shared(pipe)
            else:
                for component in pipe.components.values():
                    if isinstance(component, torch.nn.Module):
                        component.share_memory()
                item = pipe
            prepared = time.monotonic()
            queue.put({"pipe": item})
            result = results.get(timeout=1800)
            rows.append({"prepare": prepared - start, "hand-off": result["received"] - prepared})
            del item
        queue.put(None)
        worker.join(600)
    return out


def report(results: dict[str, Any]) -> None:
    one = results.get("part1")
    if one:
        count = len(next(iter(one.values()))["workers"])
        print(f"{count} workers holding the UNet, after reading every page; GiB (fds: open fds per worker)")
        print(f"  {'':<26} {'workers+parent PSS':>18} {'workers PSS':>11} {'PSS/worker':>10} {'RSS/worker':>10}"
              f" {'fds':>5}")  # fmt: skip
        for how, row in one.items():
            rows = row["workers"]
            pss = sum(r["pss"] for r in rows)
            gib = 2**30
            print(f"  {how:<26} {(pss + row['parent']['pss']) / gib:18.2f} {pss / gib:11.2f} "
                  f"{statistics.median(r['pss'] for r in rows) / gib:10.2f} "
                  f"{statistics.median(r['rss'] for r in rows) / gib:10.2f} "
                  f"{statistics.median(r['fds'] for r in rows):5.0f}")  # fmt: skip
    two = results.get("part2")
    if two:
        print("handing the ControlNet pipeline to a running worker; seconds, medians (runs)")
        for how, rows in two.items():
            prep = statistics.median(r["prepare"] for r in rows)
            hand = statistics.median(r["hand-off"] for r in rows)
            runs = " ".join(f"{r['prepare']:.2f}+{r['hand-off']:.2f}" for r in rows)
            print(f"  {how:<22} prepare {prep:6.2f}   hand-off {hand:6.2f}   ({runs})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="a folder benchmarks/cache.py --models built")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="1,2")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    models = Path(args.models)
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs", "torch": torch.__version__}
    parts = args.parts.split(",")
    if "1" in parts:
        results["part1"] = part1(models, args.workers)
    if "2" in parts:
        results["part2"] = part2(models, args.rounds)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
