"""What makes a dump's write fast: the same snapshot bytes written in different ways, timed side by side.

Run it from the repository root::

    .venv/bin/python benchmarks/dump_variants.py                  # 500 MiB (250 x 2 MiB float32), 9 repeats
    .venv/bin/python benchmarks/dump_variants.py --only falloc    # variants whose name contains "falloc"

Every variant writes the data region of one snapshot (the tensors' bytes at the offsets
``zerocopy_pickle.read_header`` gives for it) into an unnamed ``O_TMPFILE`` file in ``--dir``, as
``zerocopy_pickle.dump`` does, and closes it (so the kernel frees it; no rename). A variant's name is
``<preallocation>-<checksums>-<chunk>``:

* preallocation: ``none`` (the file grows with the writes), ``trunc`` (``ftruncate`` to the final size first),
  ``falloc`` (``fallocate`` to the final size first: blocks too).
* checksums: ``nock`` (none), ``sep`` (XXH3 of every buffer first, then the writes: the former dump),
  ``onepass`` (each chunk hashed just before it is written: the dump now), ``thread`` (XXH3 of every buffer in a
  second thread while the main thread writes; xxhash releases the GIL).
* chunk: the bytes per ``pwrite``.

Plus ``writev``: the former writer, one ``writev`` of all pieces (header, stream, padding, buffers) with the
checksums computed first, into an ``O_TMPFILE`` file of no preset size; ``zp``: ``zerocopy_pickle.dump`` itself
(to a path, renamed into place); ``safetensors``: ``save_file``.

Columns: medians and minimums of wall time and of process CPU time (user + system, all threads) over
``--repeat`` runs, interleaved and rotated; ``os.sync()`` and ``gc.collect()`` before each timed run (and with
``--drop-caches``, the page cache dropped).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import xxhash
from dump import time_interleaved  # benchmarks/ is sys.path[0] when run as a script

import zerocopy_pickle as zp

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
_libc = ctypes.CDLL(None, use_errno=True)


def variants(state: dict[str, torch.Tensor]) -> dict[str, Callable[[str], object]]:
    snapshot = zp.dumps(state)
    header = zp.read_header(snapshot)
    size = header.total_nbytes
    views = [t.reshape(-1).view(torch.uint8).numpy().data for t in state.values()]
    placed = [(header.buffer_range(i)[0], v) for i, v in enumerate(views)]
    head = memoryview(snapshot)[: header.data_offset]  # header, stream, padding: the pieces before the data
    del snapshot

    def unnamed(path: str) -> int:
        return os.open(os.path.dirname(path), os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)

    def preallocate(fd: int, how: str) -> None:
        if how == "trunc":
            os.ftruncate(fd, size)
        elif how == "falloc" and _libc.fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(size)) != 0:
            raise OSError(ctypes.get_errno(), "fallocate")

    def write(fd: int, chunk: int, before: Callable[[int, memoryview], object] | None = None) -> None:
        for i, (offset, view) in enumerate(placed):
            for at in range(0, view.nbytes, chunk):
                piece = view[at : at + chunk]
                if before is not None:
                    before(i, piece)
                os.pwrite(fd, piece, offset + at)

    def sep(fd: int, chunk: int) -> None:
        for v in views:
            xxhash.xxh3_64_hexdigest(v)
        write(fd, chunk)

    def onepass(fd: int, chunk: int) -> None:
        hashers = [xxhash.xxh3_64() for _ in views]
        write(fd, chunk, lambda i, piece: hashers[i].update(piece))
        [h.hexdigest() for h in hashers]

    def threaded(fd: int, chunk: int) -> None:
        worker = threading.Thread(target=lambda: [xxhash.xxh3_64_hexdigest(v) for v in views])
        worker.start()
        write(fd, chunk)
        worker.join()

    def nock(fd: int, chunk: int) -> None:
        write(fd, chunk)

    table: dict[str, Callable[[str], object]] = {}
    for how in ("none", "trunc", "falloc"):
        for name, kind in (("nock", nock), ("sep", sep), ("onepass", onepass), ("thread", threaded)):
            for chunk in (256 << 10, 2 << 20, 8 << 20):

                def run(path: str, how: str = how, kind: Callable[[int, int], None] = kind, chunk: int = chunk) -> None:
                    fd = unnamed(path)
                    try:
                        preallocate(fd, how)
                        kind(fd, chunk)
                    finally:
                        os.close(fd)

                table[f"{how}-{name}-{chunk >> 10}k"] = run

    def writev(path: str) -> None:
        for v in views:
            xxhash.xxh3_64_hexdigest(v)
        pieces: list[memoryview] = [head]
        cursor = header.data_offset
        for offset, view in placed:
            pieces += [memoryview(bytes(offset - cursor)), view]
            cursor = offset + view.nbytes
        fd = unnamed(path)
        try:
            while pieces:
                batch = pieces[:1024]
                written = os.writev(fd, batch)
                assert written == sum(p.nbytes for p in batch), "short write"
                pieces = pieces[1024:]
        finally:
            os.close(fd)

    from safetensors.torch import save_file

    table["writev"] = writev
    table["zp"] = lambda path: zp.dump(state, path)
    table["safetensors"] = lambda path: save_file(state, path)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=250, help="float32 tensors of 2 MiB each")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--only", default="", help="comma-separated substrings; a variant runs if its name has all")
    p.add_argument("--names", default="", help="comma-separated variant names to add to those --only selects")
    p.add_argument("--dir", default=str(REPO / "benchmarks" / "out"))
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before every run (needs root)")
    args = p.parse_args(argv)
    seed = torch.randn(MiB // 2, generator=torch.Generator().manual_seed(0))
    state = {f"t.{i}": seed + i for i in range(args.tensors)}
    table = variants(state)
    wanted = [s for s in args.only.split(",") if s]
    keys = [k for k in table if wanted and all(s in k for s in wanted)]
    keys += [k for k in args.names.split(",") if k and k not in keys]
    keys = keys or list(table)
    os.makedirs(args.dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="variants-", dir=args.dir)
    try:
        samples = time_interleaved({k: table[k] for k in keys}, directory, args.repeat, args.drop_caches)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.tensors} x 2 MiB float32 ({args.tensors * 2} MiB), medians of {args.repeat}, {os.cpu_count()} CPUs")
    print(f"  {'variant':<22} {'wall s':>7} {'min':>7} {'cpu s':>7} {'min':>7}")
    for key in keys:
        ws, cs = samples[key]["wall"], samples[key]["cpu"]
        print(f"  {key:<22} {statistics.median(ws):7.3f} {min(ws):7.3f} {statistics.median(cs):7.3f} {min(cs):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
