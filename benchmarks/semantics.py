"""The restricted load's stream analysis: Python (streamcheck.check_stream + semantics.analyze) against the
native pass (csrc/, analyze_stream), and a first restricted load against a trusted one.

Run it from the repository root (the native helpers are built into the cache first if needed)::

    .venv/bin/python benchmarks/semantics.py             # 1000-tensor state dict, GPT-ish module
    .venv/bin/python benchmarks/semantics.py --repeat 51
    .venv/bin/python benchmarks/semantics.py --cases sd100k --repeat 7   # 100,000 small tensors

CPU time (``time.process_time``), median of ``--repeat`` runs, backends interleaved:

* ``analysis``: check + analyze of the snapshot's pickle stream (no digest cache): Python, and native
  (``semantics._native_uses``: the native pass plus wrapping its result in a ``StreamUses``).
* ``load``: ``zp.load`` of the snapshot from a file, trusted, and restricted with the analysis cache cleared
  before each load (a process's first load of that stream), under each backend.
"""

from __future__ import annotations

import argparse
import collections
import gc
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zerocopy_pickle as zp
from zerocopy_pickle import native
from zerocopy_pickle._trust import semantics, streamcheck


def cpu_median(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def state_dict(n: int, shape: tuple[int, ...] = (4, 4)) -> collections.OrderedDict[str, torch.Tensor]:
    return collections.OrderedDict((f"layers.{i}.weight", torch.zeros(shape)) for i in range(n))


def gpt(layers: int = 12, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(256, width),
        *(
            torch.nn.TransformerEncoderLayer(width, 4, dim_feedforward=4 * width, batch_first=True)
            for _ in range(layers)
        ),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, 256, bias=False),
    )


def stream_of(obj: object) -> bytes:
    out = io.BytesIO()
    zp.ZeroCopyPickler(out, buffer_callback=lambda b: False).dump(obj)
    return out.getvalue()


def python_analysis(stream: bytes) -> semantics.StreamUses:
    streamcheck.check_stream(stream)
    return semantics.analyze(stream)


def bench(name: str, obj: object, allow: list[Any] | None, repeat: int, workdir: Path) -> dict[str, Any]:
    stream = stream_of(obj)
    result: dict[str, Any] = {"stream_bytes": len(stream)}
    with native.use("native"):
        assert semantics._native_uses(stream) == python_analysis(stream)
        native_ms = cpu_median(lambda: semantics._native_uses(stream), repeat) * 1e3
    result["analysis_ms"] = {"python": cpu_median(lambda: python_analysis(stream), repeat) * 1e3, "native": native_ms}
    path = workdir / f"{name}.zcp"
    zp.dump(obj, path)

    def restricted() -> None:
        semantics.forget()
        zp.load(path, allow=allow or [])

    loads: dict[str, float] = {}
    for backend in ("python", "native"):
        with native.use(backend):
            restricted()  # warm up
            loads[f"trusted/{backend}"] = cpu_median(lambda: zp.load(path, trusted=True), repeat) * 1e3
            loads[f"restricted-first/{backend}"] = cpu_median(restricted, repeat) * 1e3
    result["load_ms"] = loads
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument(
        "--cases", default="sd,gpt", help="comma-separated: sd (1000 tensors), gpt, sd100k (100,000 small tensors)"
    )
    args = parser.parse_args()
    native.build()
    cases = set(args.cases.split(","))
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "sd" in cases:
            report["state dict, 1000 tensors"] = bench("sd", state_dict(1000), None, args.repeat, Path(tmp))
        if "gpt" in cases:
            gpt_model = gpt()
            allow: list[Any] = sorted({type(m) for m in gpt_model.modules()}, key=lambda t: t.__qualname__)
            allow.append(torch.nn.functional.relu)
            report["GPT-ish module"] = bench("gpt", gpt_model, allow, args.repeat, Path(tmp))
        if "sd100k" in cases:
            report["state dict, 100,000 small tensors"] = bench(
                "sd100k", state_dict(100_000, (2,)), None, args.repeat, Path(tmp)
            )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
