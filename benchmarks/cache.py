"""The model cache on an SD1.5-sized ControlNet pipeline: the seed scenario, plain and through the cache.

Run it from the repository root (it needs ~4 GB of disk for the models, ~20 GiB of memory, and minutes)::

    .venv/bin/python benchmarks/cache.py                          # build the models, 3 runs per variant
    .venv/bin/python benchmarks/cache.py --models /tmp/sd15 --runs 4 --json out.json
    .venv/bin/python benchmarks/cache.py --models /tmp/sd15 --overmind /work/overmind-venv --json out.json
    .venv/bin/python benchmarks/cache.py --from-json out.json --plot docs/cache-vs-overmind.png   # re-print, plot

The models are built here with the library defaults of diffusers, random weights, saved in float16 (about
3.6 GB): ``UNet2DConditionModel()`` and a pipeline around it with the SD 1.x VAE and a ViT-L text encoder, and
two ``ControlNetModel.from_unet`` (``examples.models.build_controlnet_pipeline(size="sd15")``). With
``--models DIR`` they are built once into DIR and reused by later runs.

Each run is a fresh process, as a user's program is, timed from after its imports
(``examples/cache_scenario.py``): load the VAE, two ControlNets, then the pipeline with ``vae=vae`` (variant
``vae``) or also ``controlnet=MultiControlNetModel([edge, depth])`` (variant ``wrapper``), or as ``vae`` followed by
a transformers model with its own code, ``AutoModel.from_pretrained(..., trust_remote_code=True)`` (variant
``remote``, ``examples.models.build_remote_code_model``: about 0.3 GB in float16); then touch one byte of
every 4 KiB page of every weight once. The plain runs go first, so the model files are in the page cache for
everybody. Then, per variant, one run with no server running in a fresh cache directory (``autostart``: the first
call of the day, where ``patch_all()`` starts a server; that server is stopped after the run). The cache runs of
a variant then share one fresh server, started and ready (zygote imported) before the first run: that first run
is the miss, the others are hits.

The ``small`` variant loads three models of about 1 MB each, float32 as saved (built here, ``build_small``): a
LLaMA (``LlamaForCausalLM``), a GPT-2 and a VAE (``AutoencoderKL``), where a cache's fixed cost per call shows.
``--busy`` runs everything beside a CPU-bound neighbour process (``python -c 'while True: pass'``).

With ``--overmind PYTHON`` (the Python of a virtualenv where Overmind 1.1.2 is installed, or that venv's folder;
``/work/shared/anchors/overmind/install.sh`` builds one), Overmind runs the same steps in the same kind of fresh
processes (``benchmarks/overmind_runner.py``): once with no server running (its client starts
``overmind-server`` itself: ``overmind-autostart``), then against a fresh server of its own, started beforehand
with the two shims it needs on a CPU-only torch 2.13 (``overmind``: the first run is its cold load, the others
warm). Every server is stopped by its pid at the end. Without ``--overmind``, or when that Python cannot import
Overmind, the output says why Overmind was not run. Overmind does not run the ``remote`` variant: its server
never answers ``AutoModel.from_pretrained(..., trust_remote_code=True)`` (the client waited more than ten minutes
on 2026-12-01), so that variant has no Overmind rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cache_miss import neighbour
from overmind_runner import Overmind, OvermindUnavailable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
from examples.cache_scenario import SMALL_STEPS, STEPS, measure, print_table
from examples.models import build_controlnet_pipeline

Results = dict[str, list[dict[str, Any]]]
VARIANTS = ("vae", "wrapper", "remote", "small")
OVERMIND_VARIANTS = ("vae", "wrapper", "small")  # see the docstring: Overmind never answers the remote-code call


def _paths(root: Path) -> dict[str, str]:
    return {"pipeline": str(root / "pipeline"), "edge": str(root / "controlnet-edge"),
            "depth": str(root / "controlnet-depth"), "remote": str(root / "remote-model"),
            **{step: str(root / "small" / step) for step in SMALL_STEPS}}  # fmt: skip


def build_small(root: Path) -> None:
    """The small variant's models (float32, about 1 MB each, random weights): a LLaMA and a GPT-2 of two layers,
    a VAE of two blocks."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    LlamaForCausalLM(llama).save_pretrained(root / "small" / "llama")
    gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, bos_token_id=0, eos_token_id=1)
    GPT2LMHeadModel(gpt2).save_pretrained(root / "small" / "gpt2")
    AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32,
                  ).save_pretrained(root / "small" / "small-vae")  # fmt: skip


def _median(runs: list[dict[str, Any]], column: str) -> float:
    return statistics.median(r[column] for r in runs)


def _warm(name: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return runs if name.startswith("plain/") else runs[1:]


def measure_overmind(overmind: Overmind, paths: dict[str, str], *, runs: int, variants: tuple[str, ...], dtype: str,
                     scratch: Path, notes: list[str]) -> Results:  # fmt: skip
    """Per variant: one run with no Overmind server running (its client starts one), then ``runs`` runs against
    a fresh server started beforehand (the first is its cold load). A failure is noted and the rest goes on."""
    results: Results = {}
    for variant in variants:
        try:
            results[f"overmind-autostart/{variant}"] = [overmind.run_autostart(variant, paths, dtype, scratch)]
            with overmind.server(scratch / f"overmind-{variant}.log"):
                results[f"overmind/{variant}"] = [overmind.run("overmind", variant, paths, dtype) for _ in range(runs)]
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            notes.append(f"Overmind: {variant} variant failed, its rows are missing or partial ({e})")
            print(notes[-1], flush=True)
    return results


def summary(results: Results, notes: list[str]) -> None:
    """Per variant: warm medians of plain, this cache and Overmind side by side, the first calls, the ratios."""
    print("\n  against the targets (warm: median of every plain run, of the runs after the first otherwise)")
    for variant in VARIANTS:
        plain, cached = results.get(f"plain/{variant}"), results.get(f"cache/{variant}")
        if not plain or not cached:
            continue
        om = results.get(f"overmind/{variant}")
        rows = [("plain", plain), ("this cache", cached[1:])] + ([("Overmind", om[1:])] if om else [])
        print(f"\n  {variant}: warm medians, seconds{'':<13}{'load':>10}{'touch':>10}{'total':>10}")
        for label, warm in rows:
            if warm:
                print(f"    {label:<36}" + "".join(f"{_median(warm, c):10.3f}" for c in ("load", "touch", "total")))
        plain_load, plain_total = _median(plain, "load"), _median(plain, "total")
        if len(cached) > 1:
            ours_total, ours_touch = _median(cached[1:], "total"), _median(cached[1:], "touch")
            print(f"    this cache / plain: total {ours_total / plain_total:.2f}x, load "
                  f"{_median(cached[1:], 'load') / plain_load:.2f}x")  # fmt: skip
            if om and len(om) > 1:
                om_total, om_touch = _median(om[1:], "total"), _median(om[1:], "touch")
                print(f"    this cache / Overmind: total {ours_total / om_total:.2f}x (target <= 0.5), touch "
                      f"{ours_touch / om_touch:.2f}x (target <= 1.0); Overmind / plain: total "
                      f"{om_total / plain_total:.2f}x")  # fmt: skip
        print(f"    first calls, load / total in seconds (plain: the median run, {plain_load:.3f} / {plain_total:.3f})")
        firsts = [
            ("this cache, no server running yet", results.get(f"autostart/{variant}")),
            ("this cache, miss (fresh server ready)", cached),
            ("Overmind, no server running yet", results.get(f"overmind-autostart/{variant}")),
            ("Overmind, cold (fresh server ready)", om),
        ]
        for label, first_runs in firsts:
            if first_runs:
                load, total = first_runs[0]["load"], first_runs[0]["total"]
                target = " (target <= 1.1x)" if label.startswith("this cache") else ""
                print(f"    {label:<40}{load:8.3f} /{total:8.3f} = {total / plain_total:6.2f}x plain total{target}")
    for note in notes:
        print(f"\n  {note}")


def plot(results: Results, path: str) -> None:
    """One panel per variant: warm medians of load, touch and total for plain, this cache and Overmind (log scale,
    because Overmind's wrapper variant re-loads the pipeline every call and is two orders of magnitude above)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    variants = [v for v in ("vae", "wrapper", "remote") if results.get(f"plain/{v}") and results.get(f"cache/{v}")]
    modes = [("plain", "plain diffusers", "tab:gray"), ("cache", "this cache", "tab:blue"),
             ("overmind", "Overmind 1.1.2", "tab:orange")]  # fmt: skip
    titles = {"vae": "vae=vae", "wrapper": "vae=vae, controlnet=MultiControlNetModel",
              "remote": "vae=vae, then a remote-code model"}  # fmt: skip
    columns = ("load", "touch", "total")
    fig, axes = plt.subplots(1, len(variants), figsize=(4.6 * len(variants), 4.6), squeeze=False, sharey=True)
    width = 0.8 / len(modes)
    for ax, variant in zip(axes[0], variants, strict=True):
        for i, (mode, _, color) in enumerate(modes):
            warm = _warm(f"{mode}/{variant}", results.get(f"{mode}/{variant}") or [])
            if not warm:
                continue
            for j, column in enumerate(columns):
                x, value = j - 0.4 + width * (i + 0.5), _median(warm, column)
                ax.bar(x, value, width, color=color)
                ax.text(x, value, f"{value:.3f}", ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(columns)), columns)
        ax.set_title(titles[variant], fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds, median of the warm runs (log scale)")
    handles = [Rectangle((0, 0), 1, 1, color=color) for _, _, color in modes]
    fig.legend(handles, [label for _, label, _ in modes], loc="lower center", ncol=len(modes), fontsize=8)
    fig.suptitle("Seed scenario, every run a fresh process: the four loads, then one byte of every page touched",
                 fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nplot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="build the models into this folder once and reuse them (default: a temp dir)")
    parser.add_argument("--runs", type=int, default=3, help="runs per variant and mode (default 3)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--busy", action="store_true", help="run everything beside a CPU-bound neighbour process")
    parser.add_argument("--size", choices=("sd15", "tiny"), default="sd15", help="the pipeline (tiny: a quick check)")
    parser.add_argument("--overmind", metavar="PYTHON", help="also run Overmind with this Python (or venv folder)")
    parser.add_argument("--json", help="also write the raw per-run figures here")
    parser.add_argument("--from-json", metavar="FILE", help="print (and --plot) a run saved with --json; run nothing")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of the warm medians here")
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    dtype = "float32" if args.size == "tiny" else "float16"

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results, notes = saved["runs"], saved.get("notes", [])
    else:
        results, notes = run(args, variants, dtype)
    print_table(results)
    summary(results, notes)
    print(f"\n  {'beside a CPU-bound neighbour process' if args.busy else 'idle (no neighbour process)'}")
    print(f"  steps: {', '.join(STEPS)} (small: {', '.join(SMALL_STEPS)}); touch: one byte of every 4 KiB page of "
          "every weight; total = load + touch")  # fmt: skip
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps({"notes": notes, "runs": results}, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


def run(args: argparse.Namespace, variants: tuple[str, ...], dtype: str) -> tuple[Results, list[str]]:
    overmind: Overmind | None = None
    if not args.overmind:
        notes = ["Overmind: not run (no --overmind PYTHON given)"]
    else:
        try:
            overmind = Overmind(args.overmind)
        except OvermindUnavailable as e:
            notes = [f"Overmind: not run ({e})"]
        else:
            info = overmind.info
            notes = [f"Overmind {info['overmind']} from {info['prefix']} (torch {info['torch']}, diffusers "
                     f"{info['diffusers']}, transformers {info['transformers']})"]  # fmt: skip
            if "remote" in variants:
                notes.append("Overmind: remote variant not run (its server never answers a trust_remote_code load)")
    with tempfile.TemporaryDirectory(prefix="zcp-bench-cache-") as tmp:
        root = Path(args.models) if args.models else Path(tmp)
        if set(variants) - {"small"} and (
            not (root / "pipeline" / "model_index.json").exists()
            or not (root / "remote-model" / "config.json").exists()
        ):
            print(f"building the {args.size} pipeline and two ControlNets into {root} ...", flush=True)
            build_controlnet_pipeline(root, size=args.size)
        if not (root / "small" / SMALL_STEPS[-1] / "config.json").exists():
            build_small(root)
        nbytes = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
        print(f"models: {nbytes / 1e9:.2f} GB of safetensors in {root}; {args.runs} runs per variant and mode")
        print("\n".join(notes) + "\n", flush=True)
        paths = _paths(root)
        with neighbour(args.busy):
            results = measure(paths, runs=args.runs, variants=variants, dtype=dtype, autostart=True)
            if overmind is not None:
                om_variants = tuple(v for v in variants if v in OVERMIND_VARIANTS)
                results.update(measure_overmind(overmind, paths, runs=args.runs, variants=om_variants, dtype=dtype,
                                                scratch=Path(tmp), notes=notes))  # fmt: skip
    return {k: results[k] for k in sorted(results, key=_order)}, notes


def _order(name: str) -> tuple[int, int]:
    mode, variant = name.split("/")
    modes = ("plain", "autostart", "cache", "overmind-autostart", "overmind")
    return VARIANTS.index(variant), modes.index(mode)


if __name__ == "__main__":
    sys.exit(main())
