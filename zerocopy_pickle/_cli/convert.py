"""The ``convert`` command: a torch.save file (zip or legacy format, ``weights_only=True`` unless ``--trusted``; a
TorchScript archive only with ``--trusted``) or a .safetensors file, written as a snapshot."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from .._console import printable
from ..cache.cli import human
from ..errors import ZeroCopyPickleError
from .exits import EXIT_OK


def _sniff(path: str) -> str:
    """What ``path`` is (:func:`zerocopy_pickle._storage.sources.sniff`, the detection loads use too); anything unknown
    is handed to torch.load, whose error then says what is wrong."""
    from .._storage.sources import at_fd, sniff

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        kind = sniff(at_fd(fd), os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return "torch" if kind is None or kind.startswith("torch.save") else kind


def _torch_load(path: str, *, weights_only: bool) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():
        # A TorchScript archive (converted with --trusted only): torch.load dispatches it to torch.jit.load, and
        # says so in a warning with its source line; the command's output already names the kind.
        warnings.filterwarnings("ignore", message=".*looks like a TorchScript archive", category=UserWarning)
        try:
            # Mapped: the tensors are read once, while they are written into the snapshot.
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
        # The legacy (pre-1.6) format cannot be mapped; read it.
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def _torch_load_failure(path: str, error: Exception) -> str:
    """One line for what ``torch.load`` said: its weights-only refusal is a page of advice with terminal escapes
    (two options, links); keep the global it refused and say what to do here."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    if "Weights only load failed" in text:
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n\n|$)", text, re.DOTALL)
        detail = f": {' '.join(found.group(1).split())}" if found else ""
        return (
            f"cannot read {path} with torch.load(weights_only=True){detail}. If you trust the file, convert it "
            f"with --trusted (full pickle)."
        )
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"cannot read {path} as a torch.save file: {first}"


def run_convert(args: argparse.Namespace) -> int:
    from .._core.snapshot import Snapshot, dump

    kind = _sniff(args.input)
    if kind == "snapshot":
        raise ZeroCopyPickleError(f"{args.input} is already a zerocopy_pickle snapshot")
    if kind == "torchscript" and not args.trusted:
        raise ZeroCopyPickleError(
            f"{args.input} is a TorchScript archive (torch.jit.save): reading it runs the TorchScript code it holds, "
            f"which torch.load(weights_only=True) refuses; if you trust the file, convert it with --trusted"
        )
    if kind == "safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ZeroCopyPickleError(
                "converting .safetensors needs the safetensors package: pip install 'zerocopy-pickle[safetensors]'"
            ) from e
        try:
            obj: Any = load_file(args.input)
        except Exception as e:  # safetensors raises its own SafetensorError, among others
            raise ZeroCopyPickleError(f"cannot read {args.input} as a safetensors file: {e}") from e
    else:
        try:
            obj = _torch_load(args.input, weights_only=not args.trusted)
        except Exception as e:  # torch.load raises UnpicklingError, RuntimeError, EOFError, ...
            raise ZeroCopyPickleError(_torch_load_failure(args.input, e)) from e
    dump(obj, args.output, fsync=args.fsync)
    with Snapshot.open(args.output) as snap:
        print(
            printable(f"{args.input} ({kind}) -> {args.output}: ")
            + f"{human(snap.nbytes)}, {len(snap.header.buffers)} storages"
        )
    return EXIT_OK
