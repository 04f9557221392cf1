"""The model cache on an SD1.5-sized ControlNet pipeline: the seed scenario, plain and through the cache.

Run it from the repository root (it needs ~4 GB of disk for the models, ~20 GiB of memory, and minutes)::

    .venv/bin/python benchmarks/cache.py                          # build the models, 3 runs per variant
    .venv/bin/python benchmarks/cache.py --models /tmp/sd15 --runs 4 --json out.json

The models are built here with the library defaults of diffusers, random weights, saved in float16 (about
3.6 GB): ``UNet2DConditionModel()`` and a pipeline around it with the SD 1.x VAE and a ViT-L text encoder, and
two ``ControlNetModel.from_unet`` (``zerocopy_pickle.demo.build_controlnet_pipeline(size="sd15")``). With
``--models DIR`` they are built once into DIR and reused by later runs.

Each run is a fresh process, as a user's program is, timed from after its imports
(``zerocopy_pickle.cache.scenario``): load the VAE, two ControlNets, then the pipeline with ``vae=vae`` (variant
``vae``) or also ``controlnet=MultiControlNetModel([edge, depth])`` (variant ``wrapper``), or as ``vae`` followed by
a transformers model with its own code, ``AutoModel.from_pretrained(..., trust_remote_code=True)`` (variant
``remote``, ``zerocopy_pickle.demo.build_remote_code_model``: about 0.3 GB in float16); then touch one byte of
every 4 KiB page of every weight once. The plain runs go first, so the model files are in the page cache for
everybody. The cache runs of a variant share one fresh server, started and ready (zygote imported) before the
first run: that first run is the miss, the others are hits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from zerocopy_pickle.cache.scenario import STEPS, measure, print_table
from zerocopy_pickle.demo import build_controlnet_pipeline


def _paths(root: Path) -> dict[str, str]:
    return {"pipeline": str(root / "pipeline"), "edge": str(root / "controlnet-edge"),
            "depth": str(root / "controlnet-depth"), "remote": str(root / "remote-model")}  # fmt: skip


def _summary(results: dict[str, list[dict[str, float]]]) -> None:
    print("\n  against the targets (warm = median of the runs after the first cache run)")
    for variant in ("vae", "wrapper", "remote"):
        plain, cached = results.get(f"plain/{variant}"), results.get(f"cache/{variant}")
        if not plain or not cached:
            continue
        plain_load = statistics.median(r["load"] for r in plain)
        first = cached[0]["load"]
        warm = cached[1:]
        ratio = first / plain_load
        line = f"  {variant:<8} first load {first:.3f} s = {ratio:.2f}x plain ({plain_load:.3f} s; target <= 2x)"
        if warm:
            load = statistics.median(r["load"] for r in warm)
            total = statistics.median(r["total"] for r in warm)
            line += f"; warm load {load:.3f} s (target <= 0.10), warm total with touch {total:.3f} s (target <= 0.25)"
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="build the models into this folder once and reuse them (default: a temp dir)")
    parser.add_argument("--runs", type=int, default=3, help="runs per variant and mode (default 3)")
    parser.add_argument("--variants", default="vae,wrapper,remote", help="comma-separated: vae, wrapper, remote")
    parser.add_argument("--size", choices=("sd15", "tiny"), default="sd15", help="the pipeline (tiny: a quick check)")
    parser.add_argument("--json", help="also write the raw per-run figures here")
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    dtype = "float16" if args.size == "sd15" else "float32"

    with tempfile.TemporaryDirectory(prefix="zcp-bench-cache-") as tmp:
        root = Path(args.models) if args.models else Path(tmp)
        if (
            not (root / "pipeline" / "model_index.json").exists()
            or not (root / "remote-model" / "config.json").exists()
        ):
            print(f"building the {args.size} pipeline and two ControlNets into {root} ...", flush=True)
            build_controlnet_pipeline(root, size=args.size)
        nbytes = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
        print(f"models: {nbytes / 1e9:.2f} GB of safetensors in {root}; {args.runs} runs per variant and mode\n")
        results = measure(_paths(root), runs=args.runs, variants=variants, dtype=dtype)
    print_table(results)
    _summary(results)
    print(f"\n  steps: {', '.join(STEPS)}; touch: one byte of every 4 KiB page of every weight; total = load + touch")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
