"""Ray: one model for several actors of a node, through zerocopy_pickle.ray against Ray's default serialization.

Run it from the repository root on models ``benchmarks/cache.py --models DIR`` built (SD1.5-sized, float16)::

    .venv/bin/python -W ignore benchmarks/ray_get.py --models /work/sd15 --actors 2

A local Ray (``ray.init(num_cpus=N)``) is started here. The pipeline's UNet (float16) is put into the object
store once per way, ``ray.put(unet)`` (Ray's default: tensors pickled in band) and
``ray.put(zerocopy_pickle.ray.Frozen(unet))``; then ``--actors`` actors (the UNet class already imported) each
``ray.get`` it (timed inside the actor), read every page of its weights and report their PSS and RSS
(``/proc/self/smaps_rollup``) while all of them hold it. Prints the put time, the median ``ray.get`` time, and
the actors' summed PSS and RSS (the object store's own copy, one per way, is not in them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _memory() -> dict[str, int]:
    values = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss"):
                values[name.lower()] = int(rest.split()[0]) * 1024
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from diffusers import UNet2DConditionModel

    from zerocopy_pickle import ray as zray

    @ray.remote(num_cpus=1)
    class Holder:
        def __init__(self) -> None:
            from diffusers import UNet2DConditionModel  # noqa: F401 - imported before the clock starts

            import zerocopy_pickle.ray  # noqa: F401

            torch.set_num_threads(1)

        def take(self, refs: list[Any]) -> dict[str, float]:
            start = time.perf_counter()
            self.model = ray.get(refs[0])
            got = time.perf_counter() - start
            for tensor in self.model.state_dict().values():
                tensor.reshape(-1).view(torch.uint8)[::4096].sum()
            return {"get": got}

        def memory(self) -> dict[str, int]:
            return _memory()

        def drop(self) -> None:
            del self.model

    ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False, configure_logging=False)
    unet = UNet2DConditionModel.from_pretrained(Path(args.models) / "pipeline", subfolder="unet",
                                                torch_dtype=torch.float16)  # fmt: skip
    results: dict[str, Any] = {}
    for how in ("ray default", "zerocopy Frozen"):
        start = time.perf_counter()
        ref = ray.put(unet if how == "ray default" else zray.Frozen(unet))
        put = time.perf_counter() - start
        holders = [Holder.remote() for _ in range(args.actors)]
        gets = ray.get([h.take.remote([ref]) for h in holders])
        memory = ray.get([h.memory.remote() for h in holders])
        results[how] = {"put": put, "get": [g["get"] for g in gets], "memory": memory}
        for holder in holders:
            ray.kill(holder)
        del ref
    ray.shutdown()
    gib = 2**30
    print(f"{args.actors} actors each holding the UNet ({sum(p.numel() * 2 for p in unet.parameters()) / 1e9:.2f} GB)")
    for how, row in results.items():
        pss = sum(m["pss"] for m in row["memory"]) / gib
        rss = sum(m["rss"] for m in row["memory"]) / gib
        runs = " ".join(f"{g:.3f}" for g in row["get"])
        print(f"  {how:<16} put {row['put']:6.2f} s   ray.get median {statistics.median(row['get']):6.3f} s "
              f"({runs})   actors' PSS {pss:5.2f} GiB, RSS {rss:5.2f} GiB")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
