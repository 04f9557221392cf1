"""Internal: on a miss, read the checkpoint files the call is about to read into the page cache while the library
underneath imports, builds its modules and parses headers.

A miss knows the files its key was computed from (every file under each path an argument names, with its size).
Among them, :func:`likely_read` picks the weight files a ``from_pretrained`` reads: files with a checkpoint suffix,
in each folder the safetensors files when there are any (transformers and diffusers prefer them to ``.bin``), and
of those the requested ``variant`` (``model.fp16.safetensors``) or, without one, the files with no variant in their
name. :func:`start` reads each through :mod:`zerocopy_pickle.readahead` (a few sequential streams per file, front
first, files in path order), and :func:`stop` cancels what is still reading once the call returned: a file the
guess got wrong costs at most the reads that ran while the call did.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from .. import readahead

__all__ = ["SUFFIXES", "likely_read", "start", "stop"]

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


def start(paths: Sequence[str]) -> list[readahead.Prefetch]:
    """Start reading each of ``paths`` into the page cache (where it pays: see :func:`readahead.start`)."""
    jobs = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            job = readahead.start(fd, 0, os.fstat(fd).st_size, name=path)
        except OSError:
            job = None
        finally:
            os.close(fd)
        if job is not None:
            jobs.append(job)
    return jobs


def stop(jobs: Iterable[readahead.Prefetch]) -> None:
    """Cancel what is still reading (the call has returned: whatever it needed, it read)."""
    for job in jobs:
        job.cancel()
