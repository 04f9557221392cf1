"""Internal: loading misses: a zygote that imported torch and the model libraries once, and a short-lived child
per miss.

Importing torch, transformers and diffusers takes seconds; paying it on every miss would make a first load
several times slower than loading without the cache. So the server starts one *zygote* process that imports
them (without touching CUDA) and then only waits. For each miss it forks a child, which starts with everything
imported: the child rebuilds the call's cached arguments from their segments (zero-copy), calls the original
loader, pickles the result with those arguments as references, writes each new storage once into a sealed
memfd (a storage already in the cache, compared byte for byte, is referenced instead), sends the entry and the
memfd back to the server, and exits, taking everything it allocated (and any CUDA context) with it.

The zygote also *learns*. Libraries import most of their submodules lazily, and what a child imports dies with
it; so the zygote imports the modules that define the patch points when it starts, the module of the function a
job calls before it forks for it, and after each job the server
passes on the model-library modules the child imported by itself (a pipeline's components, a tokenizer's
backends). The next child starts with them.

Run as ``python -m zerocopy_pickle.cache.loader FD``; the server does that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from .._names import GlobalName
from .._registry.discovery import resolve_name
from .._storage import arena
from . import entries
from .isolation import WORKDIR_ENV, clean_sys_path
from .jobs import Job, Preload, Ready
from .messages import Failure
from .points import all_patch_points, split_point
from .protocol import CacheError, ProtocolError, fill_nice, receive, send

PRELOAD = ("torch", "safetensors.torch", "transformers", "diffusers")
"""Imported by the zygote when installed, so that children start with them."""

LEARNABLE = frozenset(
    {"torch", "torchvision", "safetensors", "transformers", "diffusers", "accelerate", "bitsandbytes", "peft",
     "tokenizers", "huggingface_hub", "sfast", "zerocopy_pickle", "zerocopy_pickle_quirks", "PIL", "numpy"}
)  # fmt: skip
"""Top-level packages whose submodules the zygote may import ahead of a job: libraries known not to start
threads or touch devices at import. Anything else (a user's package, the dynamic ``diffusers_modules`` /
``transformers_modules``, whose code may change between jobs) is imported by each child itself."""


def learnable(name: str) -> bool:
    return name.partition(".")[0] in LEARNABLE and all(part.isidentifier() for part in name.split("."))


def patch_point_modules() -> list[str]:
    """The modules that define the patch points (``ModelMixin``, ``DiffusionPipeline``, ``PreTrainedModel``...):
    importing them is most of what a first ``from_pretrained`` costs, and every child needs them."""
    return [split_point(point).module for point in all_patch_points()]


def _preload(names: Sequence[str]) -> None:
    for name in names:
        if learnable(name) and name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def run_job(job: Job, payload: bytes, result: socket.socket, segment_fds: Sequence[int]) -> None:
    """Execute one miss in this (forked) process and send the entry to the server."""
    clock = time.perf_counter
    timings: dict[str, float] = {}
    started = clock()
    modules_before = set(sys.modules)
    private = entries.map_segments(job.segments, segment_fds)
    pristine = {i: entries.SegmentView(fd) for i, fd in zip(job.segments, segment_fds, strict=True)}
    ranges: list[tuple[int, int, int]] = []
    for segment_id, memory in private.items():
        start = arena.buffer_address(memoryview(memory))
        assert start is not None  # private mappings are writable
        ranges.append((start, len(memory), segment_id))

    def provenance(view: memoryview) -> tuple[int, int] | None:
        address = arena.buffer_address(view)
        if address is None:  # read-only: not a storage of ours
            return None
        for start, length, segment_id in ranges:
            if start <= address < start + length:
                return segment_id, address - start
        return None

    # Rebuild the cached objects the call refers to (dependencies first), then the call's arguments: each stream
    # through the load core, with its plugins' load hooks (a dynamic module's namespace, say) run first.
    cursor = 0
    rebuilt: dict[str, Any] = {}
    for ref in job.refs:
        args_stream = payload[cursor : cursor + ref.args_nbytes]
        cursor += ref.args_nbytes
        stream = payload[cursor : cursor + ref.stream_nbytes]
        cursor += ref.stream_nbytes
        ref_objects = [rebuilt[key] for key in ref.refs]
        ref_args, ref_kwargs = entries.unpickle(args_stream, [], ref_objects, ref.args_plugins)
        slots = ref_objects + entries.argument_slots(ref_args, ref_kwargs)
        rebuilt[ref.key] = entries.load_entry(stream, ref.buffers, private, slots, ref.plugins)
    call_refs = [rebuilt[key] for key in job.call.refs]
    args, kwargs = entries.unpickle(payload[cursor:], [], call_refs, job.plugins)
    timings["arguments"] = clock() - started

    function = resolve_name(job.call.function)
    if job.call.cls:
        function = getattr(resolve_name(job.call.cls), job.call.function.rpartition(".")[2])
    mark = clock()
    value = function(*args, **kwargs)
    timings["call"] = clock() - mark

    index: dict[str, list[tuple[int, int, int]]] = {}
    for digest, segment_id, offset, nbytes in job.index:
        index.setdefault(digest, []).append((segment_id, offset, nbytes))
    reply, stream, fds = entries.capture(
        value,
        call_refs + entries.argument_slots(args, kwargs),
        file_segments=job.file_segments,
        existing=pristine,
        index=index,
        provenance=provenance,
    )
    timings.update(reply.timings)
    timings["total"] = clock() - started
    imported = sorted(name for name in set(sys.modules) - modules_before if learnable(name))
    try:
        reply = dataclasses.replace(reply, imported=imported, timings=timings)
        send(result, reply.encode(), stream, fds)
    finally:
        for fd in fds:
            os.close(fd)


def lower_priority() -> None:
    """Run this process at the lowest CPU priority (nice 19, :func:`protocol.fill_nice`): it then takes only cycles
    the callers leave (a background fill, or a zygote started for one). Never raises (a process already nicer than
    that stays as it is)."""
    with contextlib.suppress(OSError):
        os.nice(max(0, fill_nice() - os.nice(0)))


def _child(job: Job, payload: bytes, fds: list[int], workdir: str | None) -> int:
    result = socket.socket(fileno=fds[0])
    if job.background:  # nobody waits for this load: it may only use what the machine does not
        lower_priority()
    try:
        if job.workdir:  # relative paths of the call resolve where the caller runs (imports never look there)
            os.chdir(job.workdir)  # or the job fails, and the caller loads directly: never another folder's file
        elif workdir:  # a request that did not say: the folder the server was started for
            with contextlib.suppress(OSError):
                os.chdir(workdir)
        run_job(job, payload, result, fds[1:])
        return 0
    except BaseException as e:
        with contextlib.suppress(OSError):
            failure = Failure(f"{type(e).__name__}: {e}", traceback.format_exc()[-8000:])
            send(result, failure.encode())
        return 1


def zygote_main(control_fd: int, *, background: bool = False) -> None:
    """Import the model libraries, then fork a child for each job the server sends, until it hangs up.
    ``background``: it was started for a background fill and runs (its imports too) at the lowest CPU priority.

    Nothing is imported from the directory the zygote was started in, nor from the server's: ``sys.path`` is
    cleaned first (``isolation.py``), and the working directory is the private one the server started it in.
    """
    clean_sys_path()
    if background:
        lower_priority()
    workdir = os.environ.pop(WORKDIR_ENV, None)
    control = socket.socket(fileno=control_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel: no zombies
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    _preload(patch_point_modules())
    send(control, Ready(os.getpid()).encode())
    while True:
        try:
            header, payload, fds = receive(control)
        except (ConnectionError, CacheError, OSError):
            break
        op = header.get("op")
        if op == Preload.OP:
            with contextlib.suppress(ProtocolError):
                _preload(Preload.decode(header).modules)
            continue
        try:
            if op != Job.OP:
                raise ProtocolError(f"the zygote got {str(op)[:100]!r}, not a job")
            job = Job.decode(header)
        except ProtocolError:  # "stop", or something the server would never send: stop
            for fd in fds:
                os.close(fd)
            break
        _preload([parsed.module for name in (job.call.function, job.call.cls) if (parsed := GlobalName.parse(name))])
        # What the zygote holds is never garbage: out of the collector's sight, a child neither scans it (the
        # libraries are millions of objects: collections cost a child hundreds of milliseconds) nor writes to
        # its pages (which would copy them). The child is short-lived: it does not collect at all.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the child: run the job and leave, never returning into the zygote's loop
            code = 1
            try:
                gc.disable()
                control.close()
                code = _child(job, payload, fds, workdir)
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    zygote_main(int(sys.argv[1]), background=sys.argv[2:] == ["background"])
