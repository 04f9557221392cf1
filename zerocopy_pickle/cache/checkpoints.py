"""Internal: on a miss, read the checkpoint files the call is about to read into the page cache while the library
underneath imports, builds its modules and parses headers.

A miss knows the files its key was computed from (every file under each path an argument names, with its size).
Among them, :func:`likely_read` picks the weight files a ``from_pretrained`` reads: files with a checkpoint suffix,
in each folder the safetensors files when there are any (transformers and diffusers prefer them to ``.bin``), and
of those the requested ``variant`` (``model.fp16.safetensors``) or, without one, the files with no variant in their
name. :func:`start` reads them through :mod:`zerocopy_pickle._storage.readahead` (a few sequential streams per
file, front first, one file after another in path order), and :func:`stop` cancels what is still reading once the call
returned: a file the guess got wrong costs at most the reads that ran while the call did.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence

from .._storage import readahead

SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
"""What a checkpoint file's name ends with."""


def _variant_of(name: str) -> str | None:
    """``fp16`` for ``diffusion_pytorch_model.fp16.safetensors``; None for ``model-00001-of-00002.safetensors``."""
    stem = name.rsplit(".", 1)[0]
    return stem.rsplit(".", 1)[1] if "." in stem else None


def likely_read(files: Iterable[tuple[str, int]], variant: str | None = None) -> list[str]:
    """The paths among ``files`` (``(path, size)``) that a ``from_pretrained`` will likely read, chosen folder by
    folder as the module docstring says, in path order; files under :data:`readahead.MIN_NBYTES` are left out (one
    faulting thread reads them as fast)."""
    folders: dict[str, list[str]] = {}
    for path, size in files:
        if path.endswith(SUFFIXES) and size >= readahead.MIN_NBYTES:
            folders.setdefault(os.path.dirname(path), []).append(path)
    chosen: list[str] = []
    for paths in folders.values():
        safetensors = [p for p in paths if p.endswith(".safetensors")]
        candidates = safetensors or paths
        wanted = [p for p in candidates if _variant_of(os.path.basename(p)) == variant]
        chosen.extend(wanted if wanted or variant is None else candidates)
    return sorted(chosen)


class Reading:
    """The prefetch of a miss's checkpoint files, one file after another in path order (all at once, the files'
    streams competed with the library's own reads of the file it needed first: a cold miss of the seed scenario
    took 1.6x the plain call, on the development VM), in a daemon thread."""

    def __init__(self, paths: Sequence[str]) -> None:
        self._paths = list(paths)
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._current: readahead.Prefetch | None = None
        self.jobs: list[readahead.Prefetch] = []
        self._thread = threading.Thread(target=self._run, name="zerocopy_pickle-prefetch-files", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for path in self._paths:
            if self._cancelled.is_set():
                return
            job = _start_one(path)
            if job is None:
                continue
            with self._lock:
                self.jobs.append(job)
                self._current = job
                if self._cancelled.is_set():
                    job.cancel()
            job.wait()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled.set()
            if self._current is not None:
                self._current.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every file was read (or the reading was cancelled); True if it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _start_one(path: str) -> readahead.Prefetch | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return readahead.start_file(fd, name=path)
    except OSError:
        return None
    finally:
        os.close(fd)


def start(paths: Sequence[str]) -> Reading:
    """Start reading ``paths`` into the page cache, one after another (each where it pays: see
    :func:`readahead.start`)."""
    return Reading(paths)


def stop(reading: Reading) -> None:
    """Cancel what is still reading (the call has returned: whatever it needed, it read)."""
    reading.cancel()
