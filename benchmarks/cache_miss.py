"""The model cache's fixed per-miss cost on a small model: the plain call against a miss with a server running and
the first call with no server running, interleaved, idle and beside a CPU-bound neighbour.

Run it from the repository root::

    .venv/bin/python -W ignore benchmarks/cache_miss.py --rounds 5            # idle, then with a busy neighbour
    .venv/bin/python -W ignore benchmarks/cache_miss.py --rounds 5 --only busy

The model is a tiny GPT-2 (``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100)``, about 0.7 MB) saved
with ``save_pretrained`` in a temporary folder. Each run is a fresh process that imports torch and transformers
(and for the cached variants calls ``patch_all()``) before the clock starts, then times one
``GPT2LMHeadModel.from_pretrained``; the parent also times the whole process from the call's return to its exit
(``exit``: a process waits at exit for its last filing). Per round, in this order: ``plain``; ``miss`` (a server
started and ready beforehand, cleared before the run); ``first`` (no server in a fresh cache directory:
``patch_all()`` starts one in the background; it is stopped after the run). ``--only busy`` runs with a neighbour
process ``python -c 'while True: pass'`` for the whole measurement. Prints every run, the medians and each
variant's median over the plain median (target: <= 1.1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
from examples import cache_scenario as scenario
from zerocopy_pickle.cache.client import Client
from zerocopy_pickle.cache.messages import Clear
from zerocopy_pickle.cache.protocol import DIR_ENV

RUN = """
import json, sys, time
mode, path = sys.argv[1], sys.argv[2]
import torch, transformers
from transformers import GPT2LMHeadModel
if mode != "plain":
    from zerocopy_pickle import cache
    cache.patch_all(autostart=mode == "first")
from transformers.utils import logging
logging.disable_progress_bar()
start = time.perf_counter()
model = GPT2LMHeadModel.from_pretrained(path)
call = time.perf_counter() - start
print(json.dumps({"call": call, "returned": time.time()}), flush=True)
"""


def build(folder: Path) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=1)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return str(folder)


def one(mode: str, path: str, env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", RUN, mode, path], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    ended = time.time()
    row = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return {"call": row["call"], "exit": ended - row["returned"]}


@contextlib.contextmanager
def neighbour(busy: bool) -> Iterator[None]:
    if not busy:
        yield
        return
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def measure(path: str, rounds: int, busy: bool) -> dict[str, list[dict[str, float]]]:
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "miss": [], "first": []}
    with neighbour(busy), scenario.private_server() as server_env:
        socket = Path(server_env[DIR_ENV]) / "server.sock"
        for _ in range(rounds):
            rows["plain"].append(one("plain", path, dict(os.environ)))
            with Client(socket, timeout=30) as client:
                client.request(Clear())
            rows["miss"].append(one("miss", path, server_env))
            directory = Path(tempfile.mkdtemp(prefix="zcp-miss-")) / "cache"
            directory.mkdir(mode=0o700)
            try:
                rows["first"].append(one("first", path, {**os.environ, DIR_ENV: str(directory)}))
            finally:
                scenario._stop_started_server(directory)
                shutil.rmtree(directory.parent, ignore_errors=True)
    return rows


def report(rows: dict[str, list[dict[str, float]]], title: str) -> None:
    print(title)
    for column in ("call", "exit"):
        plain = statistics.median(r[column] for r in rows["plain"])
        print(f"  {column} ({'from_pretrained' if column == 'call' else 'from its return to the process exit'}), ms")
        for name, runs in rows.items():
            values = [r[column] for r in runs]
            median = statistics.median(values)
            print(f"    {name:<6} {' '.join(f'{1000 * x:6.1f}' for x in values)}   median {1000 * median:6.1f}"
                  + (f" = {median / plain:.2f}x plain" if column == "call" else ""))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("idle", "busy"))
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="zcp-gpt2-"))
    try:
        path = build(folder / "gpt2")
        for condition in ("idle", "busy"):
            if args.only in (None, condition):
                rows = measure(path, args.rounds, busy=condition == "busy")
                report(rows, f"tiny GPT-2, {args.rounds} rounds, {condition}"
                       + (" (a CPU-bound neighbour process)" if condition == "busy" else ""))  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
