"""The touch of every page after a warm cache hit: time, page faults and mappings, with and without the populate
thread, against a plain load.

Run it from the repository root on a quiet machine, on models ``benchmarks/cache.py --models DIR`` built::

    .venv/bin/python -W ignore benchmarks/cache_touch.py --models /work/sd15 --variant vae --rounds 4
    .venv/bin/python -W ignore benchmarks/cache_touch.py --models /work/sd15 --copy-files   # entries in memfds only

Each run is a fresh process running the seed scenario's steps (``examples/cache_scenario.py``); the touch (one
byte of every 4 KiB page of every weight) is wrapped to count the process's minor page faults during it and the
mappings it reads through (``/proc/self/maps``: memfds, and ``.safetensors`` checkpoint files). One server,
started and ready beforehand (with ``--copy-files``: ``serve --copy-files``, every byte copied into memfds); a
first run fills it. Then per round: a plain run (not with ``--copy-files``), a hit, and a hit with
``ZEROCOPY_PICKLE_CACHE_PREFAULT=0`` (no populate thread). Prints the medians of load, touch, total and the
touch's faults, the mappings of the last run, and every touch time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from cache import _paths  # benchmarks/ is sys.path[0] when run as a script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
from examples import cache_scenario as scenario
from examples import importable

RUN = """
import json, resource, sys, warnings
warnings.simplefilter("ignore")
from examples import cache_scenario as scenario

counted = {}
touch = scenario._touch

def counting_touch(modules):
    maps = open("/proc/self/maps").read().splitlines()
    counted["memfd_maps"] = sum("memfd:" in line for line in maps)
    counted["file_maps"] = sum(".safetensors" in line for line in maps)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    result = touch(modules)
    counted["touch_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return result

scenario._touch = counting_touch
times = scenario._run_steps(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4])
print(json.dumps({**times, **counted}))
"""


def _run(env: dict[str, str], mode: str, variant: str, paths: dict[str, str], dtype: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", RUN, mode, variant, json.dumps(paths), dtype], env=importable(env),
                          capture_output=True, text=True, check=False, timeout=3600)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"a run failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="a folder benchmarks/cache.py --models built")
    parser.add_argument("--variant", default="vae", choices=("vae", "wrapper"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--copy-files", action="store_true", help="run the server with serve --copy-files")
    args = parser.parse_args(argv)
    paths = _paths(Path(args.models))
    rows: dict[str, list[dict[str, Any]]] = {}
    with scenario.private_server(*(["--copy-files"] if args.copy_files else [])) as env:
        _run(env, "cache", args.variant, paths, args.dtype)  # the miss that fills the cache
        for _ in range(args.rounds):
            if not args.copy_files:
                rows.setdefault("plain", []).append(_run(dict(os.environ), "plain", args.variant, paths, args.dtype))
            rows.setdefault("hit", []).append(_run(env, "cache", args.variant, paths, args.dtype))
            no_prefault = {**env, "ZEROCOPY_PICKLE_CACHE_PREFAULT": "0"}
            rows.setdefault("hit, no populate", []).append(_run(no_prefault, "cache", args.variant, paths, args.dtype))
    print(f"{args.variant}, {args.rounds} rounds{', serve --copy-files' if args.copy_files else ''}; medians, seconds")
    for name, runs in rows.items():

        def median(column: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[column] for r in runs)

        last = runs[-1]
        touches = " ".join(f"{r['touch']:.3f}" for r in runs)
        print(f"  {name:<17} load {median('load'):.3f}  touch {median('touch'):.3f}  total {median('total'):.3f}  "
              f"touch faults {median('touch_faults'):.0f}  mappings: {last['file_maps']} files, "
              f"{last['memfd_maps']} memfds   touches {touches}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
