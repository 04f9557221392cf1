"""Plot the worker and Ray memory figures of docs/distributed.md into docs/distributed.png.

Run it from the repository root::

    .venv/bin/python benchmarks/plot_distributed.py                      # writes docs/distributed.png
    .venv/bin/python benchmarks/plot_distributed.py --out /tmp/dist.png

It measures nothing: the numbers below are copied from docs/distributed.md ("Measured" under worker processes,
and the Ray table), which were produced on 2026-12-01 by

    .venv/bin/python -W ignore benchmarks/workers.py --models /work/sd15 --json F
    .venv/bin/python -W ignore benchmarks/ray_get.py --models /work/sd15 --actors 2

on the development VM (2 vCPUs, 24 GiB, Linux 6.18, torch 2.13.0 CPU). Rerunning those scripts gives new
numbers; change them here and in docs/distributed.md together.
"""

from __future__ import annotations

import argparse
from typing import Any

# benchmarks/workers.py: 4 spawned workers each holding the SD1.5-sized UNet (1.72 GB in float16), after reading
# every page; PSS of the workers and the parent at the same moment, GiB.
WORKERS_PSS_GIB = {
    "each loads it\n(float16)": 3.24,
    "each loads it,\nto bfloat16": 8.11,
    "Shared\n(float16)": 3.27,
    "Shared,\nbfloat16 once": 3.59,
    "torch.\nmultiprocessing": 3.54,
}

# benchmarks/ray_get.py: two actors each holding the UNet (1.74 GB in float16); the actors' summed PSS, GiB, and
# the median ray.get time in an actor, seconds.
RAY_PSS_GIB = {"Ray's default\nray.put(unet)": 5.28, "ray.put(\nFrozen(unet))": 1.82}
RAY_GET_S = {"Ray's default\nray.put(unet)": 10.174, "ray.put(\nFrozen(unet))": 0.050}

OURS = "#3f51b5"
OTHERS = "#9e9e9e"


def plot(out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (workers, ray_pss, ray_get) = plt.subplots(
        1, 3, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2.6, 1, 1]}, constrained_layout=True
    )

    def bars(ax: Any, values: dict[str, float], unit: str, title: str, fmt: str = "g") -> None:
        names = list(values)
        colors = [OURS if "Shared" in n or "Frozen" in n else OTHERS for n in names]
        drawn = ax.bar(names, [values[n] for n in names], color=colors)
        ax.bar_label(drawn, labels=[f"{values[n]:{fmt}} {unit}" for n in names], fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)

    bars(workers, WORKERS_PSS_GIB, "GiB", "4 workers holding one UNet: PSS of workers + parent")
    workers.set_ylabel("GiB")
    bars(ray_pss, RAY_PSS_GIB, "GiB", "Ray, 2 actors: their PSS")
    ray_pss.set_ylabel("GiB")
    bars(ray_get, RAY_GET_S, "s", "Ray: ray.get in an actor", fmt=".3f")
    ray_get.set_ylabel("seconds (log)")
    ray_get.set_yscale("log")
    fig.suptitle("One model, many processes (benchmarks/workers.py, benchmarks/ray_get.py, 2026-12-01)", fontsize=11)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/distributed.png", help="where to write the PNG")
    plot(parser.parse_args().out)


if __name__ == "__main__":
    main()
