"""Write-window size against dump and touch time: why ``writes.WRITE_CHUNK`` is 1 MiB.

Run it from the repository root, as root (it drops the page cache before every write)::

    .venv/bin/python benchmarks/dump_windows.py                 # 2000 MiB, 5 rounds
    .venv/bin/python benchmarks/dump_windows.py --mib 500 --rounds 3

For each window size, a file of ``--mib`` MiB (``fallocate``'d, in ``--dir``) is written with one ``pwrite`` per
aligned window, as ``zerocopy_pickle.dump`` writes back-to-back buffers; then the file is mapped ``MAP_PRIVATE``
and one byte of every 4 KiB page is read, twice (the second touch is reported: the page cache is warm, so this
is the cost of the page faults, which depends on the folio size the writes left). ``shifted`` writes 2 MiB chunks
starting 4 KiB into the file (windows cut at unaligned offsets, as before the writer aligned them). Sizes are
interleaved within each round. Columns: median and minimum write time, median touch time, page faults of a touch.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20


def write(directory: str, source: memoryview, nbytes: int, window: int, shift: int) -> tuple[int, float]:
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.posix_fallocate(fd, 0, nbytes + shift)
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    start = time.perf_counter()
    position, end = shift, shift + nbytes
    while position < end:
        stop = min(end, (position // window + 1) * window) if shift == 0 else min(end, position + window)
        at = (position - shift) % source.nbytes
        os.pwrite(fd, source[at : at + (stop - position)], position)
        position = stop
    return fd, time.perf_counter() - start


def touch(fd: int) -> tuple[float, int]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    start = time.perf_counter()
    pages = np.frombuffer(m, dtype=np.uint8)[::4096]
    int(pages.sum())
    seconds = time.perf_counter() - start
    del pages
    m.close()
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=str(REPO / "benchmarks" / "out"))
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="windows-", dir=args.dir)
    source = memoryview(np.random.default_rng(0).random(min(args.mib, 1000) * MiB // 8)).cast("B")
    configs = {"2 MiB": (2 * MiB, 0), "1 MiB": (MiB, 0), "512 KiB": (512 << 10, 0), "shifted": (2 * MiB, 4096)}
    results: dict[str, list[tuple[float, float, int]]] = {k: [] for k in configs}
    try:
        for _ in range(args.rounds):
            for name, (window, shift) in configs.items():
                fd, seconds = write(directory, source, args.mib * MiB, window, shift)
                try:
                    touch(fd)
                    results[name].append((seconds, *touch(fd)))
                finally:
                    os.close(fd)
    finally:
        os.rmdir(directory)
    print(f"{args.mib} MiB, {args.rounds} rounds, {os.cpu_count()} CPUs")
    print(f"  {'windows':<9} {'write s':>8} {'min':>7} {'touch s':>8} {'faults':>7}")
    for name, rows in results.items():
        w = [r[0] for r in rows]
        print(
            f"  {name:<9} {statistics.median(w):8.3f} {min(w):7.3f} "
            f"{statistics.median(r[1] for r in rows):8.4f} {int(statistics.median(r[2] for r in rows)):7d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
