"""``zerocopy-pickle demo --snapshot``: dump and load a model built here, timed against torch.load and safetensors.

The model is :class:`examples.models.TinyGPT` (no download, no extra package), its output head tied to its
embedding. The demo saves its state dict (and the whole module) with each method, loads it back several times
from a warm page cache, checks that every method returns the same weights and that zerocopy_pickle keeps tied
weights tied, and prints a table of median times. From a checkout: ``python -m examples.snapshot_demo``.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerocopy_pickle import dump, freeze, load

from .models import TinyGPT, build_model


def _median_time(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times = []
    result = None
    for _ in range(repeat):
        result = None  # free the previous result outside the timed region
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _touch(tensors: Any) -> float:
    # Read every byte once: the cost a first forward pass pays for weights loaded lazily.
    return float(sum(t.float().sum() for t in tensors))


def run(size_mb: int = 256, repeat: int = 5, directory: str | None = None) -> int:
    """Run the demo and print its table. Returns a process exit status."""
    from zerocopy_pickle._console import quiet_third_party

    quiet_third_party()
    with tempfile.TemporaryDirectory(dir=directory, prefix="zcp-demo-") as tmp:
        return _run(size_mb, repeat, tmp)


def _run(size_mb: int, repeat: int, tmp: str) -> int:
    model = build_model(size_mb)
    state = model.state_dict()
    nbytes = sum(t.nbytes for t in {t.untyped_storage().data_ptr(): t for t in state.values()}.values())
    n_layers = len(model.blocks.layers)
    print(f"model: TinyGPT, {n_layers} layers, {len(state)} tensors, {nbytes / 2**20:.0f} MiB float32 (tied head)")
    tokens = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens)

    paths = {name: os.path.join(tmp, name) for name in ("state.pt", "state.safetensors", "state.zcp", "model.zcp")}
    rows: list[tuple[str, float, float]] = []  # (method, save seconds, load seconds)

    def bench(name: str, save: Callable[[], Any], load_fn: Callable[[], Any]) -> Any:
        save_s, _ = _median_time(save, repeat)
        load_s, loaded = _median_time(load_fn, repeat)
        rows.append((name, save_s, load_s))
        return loaded

    pt = paths["state.pt"]
    bench("torch.save / torch.load", lambda: torch.save(state, pt), lambda: torch.load(pt, weights_only=True))
    bench(
        "torch.load(mmap=True)",
        lambda: torch.save(state, pt),
        lambda: torch.load(pt, mmap=True, weights_only=True),
    )
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        print("(safetensors is not installed: pip install 'zerocopy-pickle[safetensors]' to compare with it)")
    else:
        st = paths["state.safetensors"]
        untied = {k: v.contiguous() for k, v in state.items() if k != "head.weight"}  # safetensors refuses ties
        bench("safetensors save_file / load_file", lambda: save_file(untied, st), lambda: load_file(st))
    zcp = paths["state.zcp"]
    loaded_state = bench("zerocopy_pickle dump / load", lambda: dump(state, zcp), lambda: load(zcp))
    module_path = paths["model.zcp"]
    allow = [TinyGPT, nn.Embedding, nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.ModuleList,
             nn.MultiheadAttention, nn.modules.linear.NonDynamicallyQuantizableLinear, nn.Linear,
             nn.LayerNorm, nn.Dropout, torch.nn.functional.relu]  # fmt: skip
    loaded_model = bench(
        "zerocopy_pickle, whole nn.Module",
        lambda: dump(model, module_path),
        lambda: load(module_path, allow=allow),
    )
    snap = freeze(model)
    freeze_s, _ = _median_time(snap.load, repeat)
    rows.append(("zerocopy_pickle freeze() -> Snapshot.load()", float("nan"), freeze_s))

    # Same weights everywhere; outputs identical bit for bit; tied weights still tied.
    assert all(torch.equal(loaded_state[k], v) for k, v in state.items())
    with torch.no_grad():
        got = loaded_model(tokens)
    assert torch.equal(got, expected), "the loaded model computes something else"
    assert loaded_model.head.weight is loaded_model.embed.weight, "tied weights came apart"
    start = time.perf_counter()
    _touch(loaded_state.values())
    touch_s = time.perf_counter() - start

    base = rows[0][2]
    print(f"\nmedian of {repeat} runs, warm page cache ({nbytes / 2**20:.0f} MiB):")
    print(f"  {'method':<44} {'save s':>8} {'load s':>9} {'load vs torch.load':>19}")
    for name, save_s, load_s in rows:
        save_text = "" if math.isnan(save_s) else f"{save_s:8.3f}"  # NaN: not applicable
        print(f"  {name:<44} {save_text:>8} {load_s:9.4f} {base / load_s:18.1f}x")
    print(f"\nzerocopy_pickle loads are lazy: reading every loaded byte once took {touch_s:.3f} s afterwards.")
    print("outputs identical to the original model; tied embedding/head still one tensor; restricted load")
    print(f"of the whole module allowed exactly {len(allow)} classes/functions.")
    snap.close()
    return 0


if __name__ == "__main__":
    sys.exit(run())
