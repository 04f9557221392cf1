"""The model cache's first calls against the plain call, interleaved: no server running yet, a miss, a hit.

Run it from the repository root on a quiet machine, on models ``benchmarks/cache.py --models DIR`` built::

    .venv/bin/python -W ignore benchmarks/cache_first_call.py --models /work/sd15 --variant vae --rounds 4

Each round, each a fresh process (``examples/cache_scenario.py``): a plain run; a run with ``patch_all()`` and
no server in a fresh cache directory (it starts one in the background and loads the calls itself); a hit against
that server, which is then stopped; a miss against a fresh server started and ready beforehand. Prints the load
of the four steps and the total (load and the touch of every page) per run, the medians, and each first call's
median over the plain median (target: <= 1.1).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from cache import _paths  # benchmarks/ is sys.path[0] when run as a script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
from examples import cache_scenario as scenario
from zerocopy_pickle.cache.protocol import DIR_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="a folder benchmarks/cache.py --models built")
    parser.add_argument("--variant", default="vae", choices=("vae", "wrapper", "remote"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args(argv)
    paths = _paths(Path(args.models))
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "no server": [], "hit": [], "miss": []}
    for _ in range(args.rounds):
        rows["plain"].append(scenario._one_run(dict(os.environ), "plain", args.variant, paths, args.dtype))
        directory = Path(tempfile.mkdtemp(prefix="zcp-first-")) / "cache"
        directory.mkdir(mode=0o700)
        env = {**os.environ, DIR_ENV: str(directory)}
        try:
            rows["no server"].append(scenario._one_run(env, "autostart", args.variant, paths, args.dtype))
            rows["hit"].append(scenario._one_run(env, "cache", args.variant, paths, args.dtype))
        finally:
            scenario._stop_started_server(directory)
            shutil.rmtree(directory.parent, ignore_errors=True)
        with scenario.private_server() as server_env:
            rows["miss"].append(scenario._one_run(server_env, "cache", args.variant, paths, args.dtype))
    for column in ("load", "total"):
        plain = statistics.median(r[column] for r in rows["plain"])
        what = "load of the steps" if column == "load" else "total: load of the steps and touch of every page"
        print(f"{args.variant}, {args.rounds} rounds; {what}, seconds")
        for name, runs in rows.items():
            values = [r[column] for r in runs]
            median = statistics.median(values)
            runs_text = " ".join(f"{x:.3f}" for x in values)
            print(f"  {name:<10} {runs_text}   median {median:.3f} = {median / plain:.2f}x plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
