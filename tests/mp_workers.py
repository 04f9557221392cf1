"""Functions that run in worker processes of tests/test_multiprocessing.py (importable by spawned children)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

IN, OUT = 64, 32


def build_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 128), nn.ReLU(), nn.Linear(128, OUT))


class Converted(nn.Module):
    """A model the loader changed: a float16 layer and a bitsandbytes 4-bit layer quantized on the CPU."""

    def __init__(self, seed: int = 0) -> None:
        from bitsandbytes.nn import Linear4bit

        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(IN, 128).half()
        self.quantized = Linear4bit(128, OUT, compute_dtype=torch.float32, quant_type="nf4").to("cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(self.first(x.half()).float())


def inputs() -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randn(3, IN)


def mapping_of(address: int) -> dict[str, Any]:
    """The line of /proc/self/maps that holds ``address``, with its Rss and Pss (kB) from smaps."""
    with open("/proc/self/smaps") as smaps:
        current: dict[str, Any] | None = None
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                current = None
                if start <= address < end:
                    current = {"inode": int(fields[4]), "path": " ".join(fields[5:]), "size": end - start}
            elif current is not None and fields[0] in ("Rss:", "Pss:"):
                current[fields[0][:-1].lower()] = int(fields[1])
                if "rss" in current and "pss" in current:
                    return current
    raise LookupError(f"no mapping holds {address:#x}")


def touch(model: Any) -> float:
    """Read every page of every weight (so the mapping's pages are resident)."""
    total = 0.0
    for tensor in model.state_dict().values():
        data = tensor.detach().reshape(-1).view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.reshape(-1)
        total += float(data[::4096].sum())
    return total


def describe(model: Any) -> dict[str, Any]:
    """What a worker reports: where its weights live and what the model computes."""
    first = next(iter(model.state_dict().values()))
    touch(model)
    return {
        "pid": os.getpid(),
        "mapping": mapping_of(first.data_ptr()),
        "output": model(inputs()).float().tolist(),
        "type": type(model).__name__,
    }


_BARRIER: Any = None


def init_barrier(barrier: Any) -> None:
    """A Pool's initializer: the barrier :func:`describe_pair` waits on, so that two tasks run at once, in two
    different workers."""
    global _BARRIER
    _BARRIER = barrier


def describe_pair(pair: tuple[Any, int]) -> dict[str, Any]:
    model, number = pair
    if _BARRIER is not None:
        _BARRIER.wait(120)
    return {**describe(model), "number": number}


def from_queue(queue: Any, results: Any) -> None:
    results.put(describe(queue.get()))


def state_dict_worker(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"mapping": mapping_of(state["0.weight"].data_ptr()), "sum": float(sum(t.sum() for t in state.values()))}


def hold_and_measure(shared: Any, barrier: Any, results: Any) -> None:
    """The pre-fork pattern's worker: load the shared model (or receive it loaded), touch it, wait until every
    worker holds it, then report the mapping's Rss and Pss."""
    # A forked child must not enter the OpenMP thread pool its parent started (it would hang): one thread per
    # worker, as pre-fork servers run their workers anyway.
    torch.set_num_threads(1)
    model = shared.load() if hasattr(shared, "load") else shared
    describe(model)
    barrier.wait()
    first = next(iter(model.state_dict().values()))
    report = describe(model)
    report["mapping"] = mapping_of(first.data_ptr())
    barrier.wait()  # nobody exits (and unmaps) before everyone measured
    results.put(report)


class ModelDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """A dataset that holds a model, as DataLoader workers would (each worker gets the dataset)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        model = self.model
        first = next(iter(model.state_dict().values()))
        return {"worker": info.id if info else -1, "inode": mapping_of(first.data_ptr())["inode"], "index": index}
