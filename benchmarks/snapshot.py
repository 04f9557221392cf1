"""Side-by-side benchmark: zerocopy_pickle against torch.save/torch.load, safetensors and plain pickle.

Run it from the repository root::

    .venv/bin/python benchmarks/snapshot.py                      # full size: 2 GiB state dict, 256 MiB model
    .venv/bin/python benchmarks/snapshot.py --tensors 50 --model-mb 32 --repeat 2   # a quick check
    .venv/bin/python benchmarks/snapshot.py --skip pickle,zp-freeze --json out.json --plot docs/benchmark.png

Workloads (each measured with every method that can handle it):

* ``tensors``: a state dict of ``--tensors`` float32 tensors of ``--tensor-mb`` MiB each (default 1000 x 2 MiB).
* ``model-state``: the state dict of a GPT-style transformer built locally (``examples.models.build_model``,
  about ``--model-mb`` MiB of float32 weights) whose output head is tied to its embedding.
* ``model-module``: the same model as a whole ``nn.Module``. Loads are restricted everywhere: torch.load with
  ``weights_only=True`` inside ``torch.serialization.safe_globals(...)``, zerocopy_pickle with ``allow=`` (both
  lists computed from the saved file before timing); plain pickle cannot be restricted.

Methods (``--skip`` takes their keys, comma-separated):

* ``torch``: ``torch.save`` / ``torch.load(weights_only=True)``.
* ``torch-mmap``: ``torch.load(mmap=True, weights_only=True)`` of the torch.save file (no dump of its own).
* ``safetensors``: ``save_file`` / ``load_file``. safetensors refuses tensors that share memory, so every
  tensor whose storage another key already holds (the tied head) is dropped before saving; the output says so.
  It cannot save a whole module. (Recent safetensors, 0.8 here, writes straight from tensor memory, and its
  ``load_file`` maps the file ``MAP_PRIVATE``: its tensors are lazy views too.)
* ``pickle``: ``pickle.dump(obj, file, protocol=5)`` / ``pickle.load(file)`` (tensors travel in band).
* ``zp``: ``zerocopy_pickle.dump`` / ``zerocopy_pickle.load`` (a file, mapped ``MAP_PRIVATE``).
* ``zp-freeze``: ``zerocopy_pickle.freeze`` (a sealed memfd, no file system) / ``Snapshot.load``.
* with ``zp``, two rows that load the ``zp`` file without a dump of their own: ``load(trusted=True)`` (no
  restrictions: the fast path of snapshots you trust and of the model cache), and a restricted load that first
  forgets every stream analysis (``zerocopy_pickle._trust.semantics.forget()``), i.e. the first restricted load of that
  stream in a process; the ``zp`` row's restricted loads are the later ones, which find the analysis by the
  stream's digest.

Columns (median seconds of ``--repeat`` runs):

* ``dump``: writing a new file (into the page cache, no fsync). Before each timed dump, outside the timer, the
  method's previous file is deleted and ``os.sync()`` runs: the kernel throttles writers once enough dirty pages
  pile up, which would punish whichever method runs after another's dump. ``--overwrite`` times the other common
  case, a dump over the previous file: torch.save, safetensors and pickle truncate it in place, which frees its
  pages and, on ext4 (``auto_da_alloc``), starts writeback of the new data when the file is closed; zerocopy_pickle
  swaps the new file in with ``renameat2(RENAME_EXCHANGE)`` and frees the old one's pages off the caller's path.
* ``load``: the load call alone. Lazy loaders (mmap) have not read any tensor byte yet.
* ``load+pages``: load, then read one byte of every 4 KiB page of every distinct loaded tensor
  (``t.view(torch.uint8).reshape(-1)[::4096].max()`` per tensor): the cost of faulting every page in.
* ``load+read``: load, then read every byte (``t.view(torch.uint8).reshape(-1).max()`` per tensor: a
  memory-bound reduction that writes nothing; a uint8 ``sum()`` widens to int64 and is several times slower).
  A tensor whose bytes another tensor already covered (the tied head) is touched once.

``load`` and ``load+pages`` come from one timed run (two timestamps), ``load+read`` from a second run.

Baselines for "load + touch": ``raw mmap`` maps the zerocopy_pickle file itself (``mmap.ACCESS_COPY``, i.e.
``MAP_PRIVATE``, as ``zp.load`` maps it), makes uint8 tensor views over exactly the byte ranges of the
snapshot's buffers (from its header), and touches them with the same functions; the timed region covers
mapping, views and touching. ``raw mmap, one op`` touches the whole data region as a single tensor, for
reference.

Touching runs with ``torch.set_num_threads(1)`` (``--threads``): the touch ops are memory-bound, and on a busy
machine an OpenMP parallel region waits for a descheduled worker thread, which made a 1 MiB ``max()`` up to 100x
slower with 2 threads on 2 loaded CPUs, swamping everything else measured.

Fairness: every method writes its own file once untimed (a warm-up that also checks the loaded values equal
the originals), then the timed dumps run, then ``os.sync()``, then the timed loads, all from a warm page cache.
Methods are interleaved within each repetition (and their order rotated between repetitions); the previous
result is freed and ``gc.collect()`` runs before each timer starts. Loaders that copy into process memory can
reuse memory the allocator kept from the previous repetition, which a fresh process would have to fault in.

The table ends with the project's targets, each marked PASS or MISS:

* zerocopy_pickle load / safetensors load_file <= 0.5
* zerocopy_pickle load+touch / raw mmap touch of the same bytes <= 1.1 (for both touch variants)
* torch.save / zerocopy_pickle dump >= 2, and safetensors save_file / zerocopy_pickle dump >= 2
* restricted load / trusted load <= 1.5, for the later loads and for the first load of a stream

Raw samples go to ``--json PATH``, with the minor page faults of each touch run (a file whose page cache holds
2 MiB folios maps 2 MiB per fault; 4 KiB pages, as in a memfd without shmem THP, take 32 faults for that with
the kernel's default 64 KiB fault-around). A plot (grouped bars, log time scale, one panel per workload) goes
to ``--plot PATH`` (default ``docs/benchmark.png``; ``--plot ''`` skips it). Files are written under ``--dir``
(default: a temporary directory under ``benchmarks/out/``) and removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import mmap
import os
import pickle
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import zerocopy_pickle as zp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's root, where examples/ is
from examples.models import build_model
from zerocopy_pickle._trust import semantics

REPO = Path(__file__).resolve().parent.parent
PAGE = 4096
MiB = 2**20
COLUMNS = ("dump", "load", "load+pages", "load+read")
METHOD_KEYS = ("torch", "torch-mmap", "safetensors", "pickle", "zp", "zp-freeze")
RAW = "raw mmap of the .zcp, per-tensor views"
RAW_ONE_OP = "raw mmap of the .zcp, one op"


# ---------------------------------------------------------------------------------------------------------
# Touching loaded tensors
# ---------------------------------------------------------------------------------------------------------


def tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    """The tensors of a loaded state dict or module."""
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]  # parameters() skips the tied duplicate
    return [v for v in obj.values() if isinstance(v, torch.Tensor)]


def _distinct_bytes(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """Each tensor as flat uint8, skipping a tensor whose bytes were already yielded (tied weights)."""
    seen = set()
    for t in tensors:
        b = t.reshape(-1).view(torch.uint8)
        key = (b.data_ptr(), b.numel())
        if key not in seen:
            seen.add(key)
            yield b


def touch_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Read one byte of every 4 KiB page of every distinct tensor."""
    return sum(int(b[::PAGE].max()) for b in _distinct_bytes(tensors) if b.numel())


def read_all(tensors: Iterable[torch.Tensor]) -> int:
    """Read every byte of every distinct tensor (a uint8 max: memory-bound, writes nothing)."""
    return sum(int(b.max()) for b in _distinct_bytes(tensors) if b.numel())


TOUCHES = {"load+pages": touch_pages, "load+read": read_all}


def raw_mmap_touch(path: str, ranges: Sequence[tuple[int, int]], touch: Callable[[list[torch.Tensor]], int]) -> Any:
    """Map ``path`` privately, view each ``[start, stop)`` as a uint8 tensor, touch them; return what to free."""
    with open(path, "rb") as f:
        memory = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    views = [whole[start:stop] for start, stop in ranges]
    touch(views)
    return memory, whole, views


# ---------------------------------------------------------------------------------------------------------
# Methods and workloads
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Method:
    key: str
    label: str
    load: Callable[[], Any]
    dump: Callable[[], Any]
    path: str | None = None  # the file its dump writes (None: no file)
    timed_dump: bool = True  # False: the dump writes a file another method already times
    release: Callable[[], None] = lambda: None  # frees what the last dump holds (outside any timer)
    check: Callable[[Any, Any], str | None] | None = None  # (original, loaded): raises on a mismatch, or a note


@dataclass
class Workload:
    key: str
    title: str
    obj: Any
    nbytes: int
    methods: list[Method] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    zp_path: str | None = None
    labels: dict[str, str] = field(default_factory=dict)  # method key -> row label
    shared_dump: set[str] = field(default_factory=set)  # rows whose file another row's dump writes
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # row -> column -> seconds
    faults: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # row -> column -> minor page faults

    def record(self, label: str, column: str, seconds: float, faults: int | None = None) -> None:
        self.samples.setdefault(label, {c: [] for c in COLUMNS})[column].append(seconds)
        if faults is not None:
            self.faults.setdefault(label, {}).setdefault(column, []).append(faults)

    def median(self, label: str, column: str) -> float | None:
        values = self.samples.get(label, {}).get(column)
        return statistics.median(values) if values else None


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    return {t.untyped_storage().data_ptr(): t for t in tensors}


def _check_state(original: dict[str, torch.Tensor], loaded: Any) -> str | None:
    """Raise if the loaded values differ; return a note if tensors that shared memory no longer do."""
    if loaded.keys() != original.keys():
        raise AssertionError(f"loaded keys differ: {sorted(loaded.keys() ^ original.keys())[:5]}")
    for name, value in loaded.items():
        if not torch.equal(value, original[name]):
            raise AssertionError(f"loaded tensor {name!r} differs from the original")
    got, expected = len(_distinct_storages(loaded.values())), len(_distinct_storages(original.values()))
    if got != expected:
        return f"loads {got} distinct storages where the original has {expected}: tied weights come apart"
    return None


def _check_module(original: torch.nn.Module, loaded: Any) -> str | None:
    if type(loaded) is not type(original):
        raise AssertionError(f"loaded a {type(loaded).__name__}, expected {type(original).__name__}")
    return _check_state(original.state_dict(), loaded.state_dict())


def _resolve(dotted: str) -> Any:
    """``"torch.nn.modules.linear.Linear"`` -> the class (the longest importable prefix is the module)."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"cannot resolve {dotted!r}")


def make_methods(workload: Workload, directory: str, skip: set[str]) -> None:
    """Fill ``workload.methods`` (and its notes) with each method that can handle its object."""
    obj = workload.obj
    is_module = isinstance(obj, torch.nn.Module)
    check = _check_module if is_module else _check_state
    base = os.path.join(directory, workload.key)
    methods: list[Method] = []

    pt = base + ".pt"
    torch_globals: list[Any] | None = None  # for modules: what the first save needs, resolved before timing

    def torch_load(**kwargs: Any) -> Any:
        with torch.serialization.safe_globals(torch_globals or []):
            return torch.load(pt, weights_only=True, **kwargs)

    def torch_save() -> None:
        nonlocal torch_globals
        torch.save(obj, pt)
        if is_module and torch_globals is None:
            torch_globals = [_resolve(g) for g in torch.serialization.get_unsafe_globals_in_checkpoint(pt)]

    if "torch" not in skip:
        methods.append(Method("torch", "torch.save / torch.load", torch_load, torch_save, pt, check=check))
    if "torch-mmap" not in skip:
        timed = "torch" in skip
        methods.append(
            Method(
                "torch-mmap", "torch.load(mmap=True)", lambda: torch_load(mmap=True), torch_save, pt, timed, check=check
            )
        )
        if not timed:
            workload.notes.append("torch.load(mmap=True) reads the torch.save file: it has no dump of its own")

    if "safetensors" not in skip:
        if is_module:
            workload.notes.append("safetensors: n/a (it stores tensors only, not a whole nn.Module)")
        else:
            from safetensors.torch import load_file, save_file

            st = base + ".safetensors"
            untied: dict[str, torch.Tensor] = {}
            holders: dict[int, str] = {}
            for name, t in obj.items():
                ptr = t.untyped_storage().data_ptr()
                if ptr in holders:
                    workload.notes.append(
                        f"safetensors: dropped {name!r} before saving: it shares memory with {holders[ptr]!r} "
                        f"(tied), which safetensors refuses"
                    )
                    continue
                holders[ptr] = name
                untied[name] = t
            methods.append(
                Method(
                    "safetensors",
                    "safetensors save_file / load_file",
                    lambda: load_file(st),
                    lambda: save_file(untied, st),
                    st,
                    check=lambda _, loaded: _check_state(untied, loaded),
                )
            )

    if "pickle" not in skip:
        pkl = base + ".pkl"

        def pickle_dump() -> None:
            with open(pkl, "wb") as f:
                pickle.dump(obj, f, protocol=5)

        def pickle_load() -> Any:
            with open(pkl, "rb") as f:
                return pickle.load(f)

        methods.append(
            Method("pickle", "pickle.dump / pickle.load (protocol 5)", pickle_load, pickle_dump, pkl, check=check)
        )

    zcp = base + ".zcp"
    allow: list[str] | None = None  # for modules: exactly what the first dump names, computed before timing

    def zp_dump() -> None:
        nonlocal allow
        zp.dump(obj, zcp)
        if is_module and allow is None:
            allow = [f"{module}:{name}" for module, name in zp.scan(zcp)]

    def zp_load() -> Any:
        return zp.load(zcp, allow=allow or ())

    if "zp" not in skip:
        methods.append(Method("zp", "zerocopy_pickle dump / load", zp_load, zp_dump, zcp, check=check))
        workload.zp_path = zcp
        # The same file, loaded trusted (no restrictions), and restricted as the first load of its stream in a
        # process (the stream's analysis is remembered by its digest; this forgets it before each load).
        methods.append(
            Method("zp-trusted", "zerocopy_pickle load(trusted=True)", lambda: zp.load(zcp, trusted=True), zp_dump,
                   zcp, timed_dump=False, check=check)
        )  # fmt: skip

        def zp_load_first() -> Any:
            semantics.forget()
            return zp_load()

        methods.append(
            Method("zp-first", "zerocopy_pickle load, first of its stream", zp_load_first, zp_dump, zcp,
                   timed_dump=False, check=check)
        )  # fmt: skip
    if "zp-freeze" not in skip:
        frozen: list[zp.Snapshot] = []  # the snapshot of the last freeze, to load from

        def freeze() -> None:
            frozen.append(zp.freeze(obj))

        def load_frozen() -> Any:
            return frozen[-1].load()  # the latest freeze, looked up at call time

        def release() -> None:
            while frozen:
                frozen.pop().close()

        methods.append(
            Method(
                "zp-freeze", "zerocopy_pickle freeze / Snapshot.load", load_frozen, freeze, release=release, check=check
            )
        )
    workload.methods = methods
    workload.labels = {m.key: m.label for m in methods}
    workload.shared_dump = {m.label for m in methods if not m.timed_dump}
    rows = [m.label for m in methods] + ([RAW, RAW_ONE_OP] if workload.zp_path else [])
    workload.samples = {row: {c: [] for c in COLUMNS} for row in rows}


def make_workloads(args: argparse.Namespace, directory: str, skip: set[str]) -> list[Workload]:
    workloads = []
    if args.tensors > 0:
        numel = int(args.tensor_mb * MiB) // 4
        g = torch.Generator().manual_seed(0)
        seed = torch.randn(numel, generator=g)
        state = {f"tensor.{i}": seed + i for i in range(args.tensors)}  # distinct storages, cheap to make
        nbytes = sum(t.nbytes for t in state.values())
        title = f"state dict: {args.tensors} x {args.tensor_mb:g} MiB float32 tensors ({nbytes / MiB:.0f} MiB)"
        workloads.append(Workload("tensors", title, state, nbytes))
    if args.model_mb > 0:
        model = build_model(size_mb=args.model_mb)
        state = model.state_dict()
        distinct = _distinct_storages(state.values())
        nbytes = sum(t.untyped_storage().nbytes() for t in distinct.values())
        layers = len(model.blocks.layers)
        what = f"TinyGPT, {layers} layers, {nbytes / MiB:.0f} MiB float32, tied head"
        workloads.append(Workload("model-state", f"model state dict ({what}, {len(state)} tensors)", state, nbytes))
        workloads.append(Workload("model-module", f"whole nn.Module ({what})", model, nbytes))
    for w in workloads:
        make_methods(w, directory, skip)
    return workloads


# ---------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    k %= max(1, len(items))
    return [*items[k:], *items[:k]]


def warm_up(w: Workload) -> None:
    """Write every file once, check each method loads the original values, and warm the page cache."""
    for m in w.methods:
        m.dump()
        gc.collect()
    os.sync()
    for m in w.methods:
        loaded = m.load()
        note = m.check(w.obj, loaded) if m.check is not None else None
        if note:
            w.notes.append(f"{m.key}: {note}")
        read_all(tensors_of(loaded))
        del loaded
        gc.collect()


def bench_dumps(w: Workload, repeat: int, overwrite: bool) -> None:
    timed = [m for m in w.methods if m.timed_dump]
    for rep in range(repeat):
        for m in rotated(timed, rep):
            m.release()
            if m.path and not overwrite:
                os.unlink(m.path)  # a new file each time (see the module docstring)
            gc.collect()
            os.sync()
            start = time.perf_counter()
            m.dump()
            w.record(m.label, "dump", time.perf_counter() - start)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench_loads(w: Workload, repeat: int) -> None:
    os.sync()  # the last dumps' writeback must not compete with the loads
    ranges: list[tuple[int, int]] = []
    whole: list[tuple[int, int]] = []
    if w.zp_path is not None:
        with zp.Snapshot.open(w.zp_path) as snap:
            header = snap.header
        ranges = [header.buffer_range(i) for i in range(len(header.buffers))]
        whole = [(header.data_offset, header.data_offset + header.data_nbytes)]
    for rep in range(repeat):
        for m in rotated(w.methods, rep):
            gc.collect()
            faults = _minor_faults()
            start = time.perf_counter()
            result = m.load()
            loaded = time.perf_counter()
            touch_pages(tensors_of(result))
            done = time.perf_counter()
            w.record(m.label, "load", loaded - start)
            w.record(m.label, "load+pages", done - start, _minor_faults() - faults)
            result = None
            gc.collect()
            faults = _minor_faults()
            start = time.perf_counter()
            result = m.load()
            read_all(tensors_of(result))
            w.record(m.label, "load+read", time.perf_counter() - start, _minor_faults() - faults)
            result = None
        if w.zp_path is None:
            continue
        for label, spans in ((RAW, ranges), (RAW_ONE_OP, whole)):
            for column, touch in TOUCHES.items():
                gc.collect()
                faults = _minor_faults()
                start = time.perf_counter()
                held = raw_mmap_touch(w.zp_path, spans, touch)
                w.record(label, column, time.perf_counter() - start, _minor_faults() - faults)
                del held
    gc.collect()


def run_workload(w: Workload, repeat: int, overwrite: bool) -> None:
    print(f"\n[{w.key}] {w.title}: warming up ...", flush=True)
    try:
        warm_up(w)
        print(f"[{w.key}] dumps ...", flush=True)
        bench_dumps(w, repeat, overwrite)
        print(f"[{w.key}] loads ...", flush=True)
        bench_loads(w, repeat)
    finally:
        for m in w.methods:
            m.release()
        w.methods, w.obj = [], None  # let the workload's tensors go before the next one


# ---------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    value: float
    op: str  # "<=" or ">="
    bound: float

    @property
    def passed(self) -> bool:
        return self.value <= self.bound if self.op == "<=" else self.value >= self.bound


def targets(w: Workload) -> list[Target]:
    labels = w.labels
    zp_label = labels.get("zp")
    out: list[Target] = []
    if zp_label is None:
        return out

    def ratio(num: str | None, num_col: str, den: str | None, den_col: str) -> float | None:
        a = w.median(num, num_col) if num else None
        b = w.median(den, den_col) if den else None
        return a / b if a is not None and b else None

    st = labels.get("safetensors")
    pt = labels.get("torch")
    checks = [
        ("zerocopy_pickle load / safetensors load_file", ratio(zp_label, "load", st, "load"), "<=", 0.5),
        *(
            (f"zerocopy_pickle {col} / raw mmap {col[5:]}", ratio(zp_label, col, RAW, col), "<=", 1.1)
            for col in TOUCHES
        ),
        ("torch.save / zerocopy_pickle dump", ratio(pt, "dump", zp_label, "dump"), ">=", 2.0),
        ("restricted load / trusted load", ratio(zp_label, "load", labels.get("zp-trusted"), "load"), "<=", 1.5),
        (
            "restricted load (first of its stream) / trusted load",
            ratio(labels.get("zp-first"), "load", labels.get("zp-trusted"), "load"),
            "<=",
            1.5,
        ),
        ("safetensors save_file / zerocopy_pickle dump", ratio(st, "dump", zp_label, "dump"), ">=", 2.0),
    ]
    for name, value, op, bound in checks:
        if value is not None:
            out.append(Target(name, value, op, bound))
    return out


def _fmt(seconds: float | None, missing: str = "-") -> str:
    return missing if seconds is None else f"{seconds:.3g}"


def print_report(workloads: list[Workload], repeat: int) -> None:
    for w in workloads:
        print(f"\n== [{w.key}] {w.title} ==")
        print(f"median seconds of {repeat} runs, warm page cache")
        print("(load+pages: load, then read one byte of every 4 KiB page; load+read: load, then read every byte)")
        width = max((len(label) for label in w.samples), default=6) + 2
        print(f"  {'method':<{width}}" + "".join(f"{c:>12}" for c in COLUMNS))
        for label in w.samples:
            cells = [
                _fmt(w.median(label, c), "(shared)" if c == "dump" and label in w.shared_dump else "-") for c in COLUMNS
            ]
            print(f"  {label:<{width}}" + "".join(f"{c:>12}" for c in cells))
        for note in w.notes:
            print(f"  note: {note}")
        found = targets(w)
        if found:
            print("  targets:")
            for t in found:
                verdict = "PASS" if t.passed else "MISS"
                print(f"    {t.name:<52} {t.value:8.3f}  (target {t.op} {t.bound:g})  {verdict}")


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zerocopy_pickle": zp.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def write_json(path: str, args: argparse.Namespace, workloads: list[Workload], extra: dict[str, Any]) -> None:
    report = {
        "config": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
        "environment": environment() | extra,
        "columns": list(COLUMNS),
        "workloads": [
            {
                "key": w.key,
                "title": w.title,
                "nbytes": w.nbytes,
                "notes": w.notes,
                "methods": {
                    label: {
                        "samples": cols,
                        "median": {c: w.median(label, c) for c in COLUMNS},
                        "minor_faults": w.faults.get(label, {}),
                    }
                    for label, cols in w.samples.items()
                },
                "targets": [t.__dict__ | {"passed": t.passed} for t in targets(w)],
            }
            for w in workloads
        ],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nraw results: {path}")


def plot(path: str, workloads: list[Workload], repeat: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 5.5), squeeze=False)
    labels = list(dict.fromkeys(label for w in workloads for label in w.samples))
    colors = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    for ax, w in zip(axes[0], workloads, strict=True):
        present = list(w.samples)
        bar = 0.8 / len(present)
        for i, label in enumerate(present):
            xs, ys = [], []
            for j, column in enumerate(COLUMNS):
                value = w.median(label, column)
                if value is not None:
                    xs.append(j - 0.4 + bar * (i + 0.5))
                    ys.append(value)
            ax.bar(xs, ys, bar, color=colors[label])
        ax.set_yscale("log")
        ax.set_xticks(range(len(COLUMNS)), COLUMNS)
        ax.set_ylabel("seconds (median, log scale)")
        ax.set_title(textwrap.fill(f"[{w.key}] {w.title}", 64), fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    handles = [Rectangle((0, 0), 1, 1, color=colors[label]) for label in labels]
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(f"zerocopy_pickle vs torch / safetensors / pickle: median of {repeat} runs, warm page cache")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=1000, help="tensors in the state-dict workload (0 skips it)")
    p.add_argument("--tensor-mb", type=float, default=2, help="MiB per tensor in the state-dict workload")
    p.add_argument("--model-mb", type=int, default=256, help="approximate model size in MiB (0 skips the model)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per method and column; medians are reported")
    p.add_argument("--dir", default=None, help="where to write the files (default: a temp dir under benchmarks/out/)")
    p.add_argument("--skip", default="", help=f"comma-separated methods to skip: {', '.join(METHOD_KEYS)}")
    p.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads for the run (default 1; 0: torch's default)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="time dumps that replace the previous file instead of creating one"
    )
    p.add_argument("--json", default=None, help="write the raw results to this JSON file")
    p.add_argument("--plot", default=str(REPO / "docs" / "benchmark.png"), help="PNG plot path ('' to skip)")
    args = p.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - set(METHOD_KEYS)
    if unknown:
        p.error(f"--skip: unknown method(s) {sorted(unknown)}; choose from {', '.join(METHOD_KEYS)}")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parent = args.dir or str(REPO / "benchmarks" / "out")
    os.makedirs(parent, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="snapshot-bench-", dir=parent)
    load_before = os.getloadavg()
    started = time.perf_counter()
    try:
        workloads = make_workloads(args, directory, args.skip)
        env = environment()
        print(
            f"python {env['python']}, torch {env['torch']} ({env['torch_threads']} threads), "
            f"{env['cpus']} CPUs, {env['memory_gib']} GiB; files in {directory}"
        )
        for w in workloads:
            run_workload(w, args.repeat, args.overwrite)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    load_after = os.getloadavg()
    print_report(workloads, args.repeat)
    print(
        f"\nload average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        f"(on {os.cpu_count()} CPUs; other work on the machine skews these numbers); "
        f"total {time.perf_counter() - started:.0f} s"
    )
    extra = {"loadavg_before": load_before, "loadavg_after": load_after}
    if args.json:
        write_json(args.json, args, workloads, extra)
    if args.plot:
        plot(args.plot, workloads, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
