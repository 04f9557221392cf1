"""Internal: ``zerocopy-pickle``: inspect and convert snapshots, and run the demo.

zerocopy-pickle inspect FILE [--json] [--buffers N]
zerocopy-pickle convert IN OUT [--trusted] [--fsync]
zerocopy-pickle demo [--size tiny|sd15] [--repeat N] [--dir DIR] [--snapshot [--size-mb N]]
zerocopy-pickle serve [--max-bytes N] [--persist DIR] | status [--json] | stop | clear

Snapshot modules are imported inside the commands that need them: ``serve`` (the model cache's server) must
not import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from . import format as fmt
from .cache.cli import add_cache_commands
from .cache.cli import human as _human
from .errors import ZeroCopyPickleError

__all__ = ["main"]


def _inspect(args: argparse.Namespace) -> int:
    from .restricted import format_global
    from .snapshot import Snapshot, scan

    with Snapshot.open(args.file) as snap:
        header = snap.header
    globals_needed = scan(args.file)
    by_dtype: Counter[str] = Counter()
    by_location: Counter[str] = Counter()
    for entry in header.buffers:
        by_dtype[entry.dtype or "?"] += entry.nbytes
        by_location[entry.location] += entry.nbytes
    if args.json:
        report: dict[str, Any] = {
            "file": os.fspath(args.file),
            "format_version": header.version,
            "total_nbytes": header.total_nbytes,
            "header_nbytes": header.header_nbytes,
            "stream": {"offset": header.stream_offset, "nbytes": header.stream_nbytes},
            "data": {"offset": header.data_offset, "nbytes": header.data_nbytes},
            "producer": header.producer,
            "plugins": [p._asdict() for p in header.plugins],
            "checksums": header.checksums._asdict() if header.checksums else None,
            "signed": bool(header.signature),
            "buffers": [entry._asdict() for entry in header.buffers],
            "nbytes_by_dtype": dict(by_dtype),
            "nbytes_by_location": dict(by_location),
            "globals": [format_global(g) for g in globals_needed],
        }
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    out = [
        f"{args.file}: zerocopy_pickle snapshot, format v{header.version}, {_human(header.total_nbytes)}",
        "  written by: " + ", ".join(f"{k} {v}" for k, v in sorted(header.producer.items())),
        f"  header     [{fmt.FIXED_NBYTES}, {header.stream_offset})  {header.header_nbytes} bytes",
        f"  stream     [{header.stream_offset}, {header.stream_offset + header.stream_nbytes})  "
        f"{_human(header.stream_nbytes)}",
        f"  data       [{header.data_offset}, {header.total_nbytes})  {_human(header.data_nbytes)} in "
        f"{len(header.buffers)} buffers",
        "  plugins:   " + (", ".join(f"{p.name} (from {p.package})" for p in header.plugins) or "none"),
        "  checksums: "
        + (f"{header.checksums.algorithm}, stream and {len(header.buffers)} buffers" if header.checksums else "none"),
        "  signature: " + ("HMAC-SHA256 (verify with load(..., key=...))" if header.signature else "none"),
        "  by dtype:  " + ", ".join(f"{d} {_human(n)}" for d, n in by_dtype.most_common()),
        "  by device: " + ", ".join(f"{d} {_human(n)}" for d, n in by_location.most_common()),
        f"  globals the stream needs ({len(globals_needed)}):",
        *(f"    {format_global(g)}" for g in globals_needed),
    ]
    shown = header.buffers[: args.buffers]
    if shown:
        out.append(f"  buffers (first {len(shown)} of {len(header.buffers)}):")
        out.append(f"    {'#':>5} {'offset':>14} {'nbytes':>14}  {'location':<8} dtype")
        for i, entry in enumerate(shown):
            out.append(
                f"    {i:>5} {header.data_offset + entry.offset:>14} {entry.nbytes:>14}  {entry.location:<8} "
                f"{entry.dtype or '?'}"
            )
    print("\n".join(out))
    return 0


def _sniff(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(fmt.MAGIC_PREFIX):
        return "snapshot"
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    return "torch"  # the legacy (pre-1.6) torch.save format starts with a pickle


def _torch_load(path: str, *, weights_only: bool) -> Any:
    import torch

    try:
        # Mapped: the tensors are read once, while they are written into the snapshot.
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
    # The legacy (pre-1.6) format cannot be mapped; read it.
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def _convert(args: argparse.Namespace) -> int:
    from .snapshot import Snapshot, dump

    kind = _sniff(args.input)
    if kind == "snapshot":
        raise ZeroCopyPickleError(f"{args.input} is already a zerocopy_pickle snapshot")
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
            hint = ""
            if "Weights only load failed" in str(e):
                hint = " If you trust the file, convert it with --trusted (full pickle)."
            raise ZeroCopyPickleError(f"cannot read {args.input} as a torch.save file: {e}{hint}") from e
    dump(obj, args.output, fsync=args.fsync)
    with Snapshot.open(args.output) as snap:
        print(f"{args.input} ({kind}) -> {args.output}: {_human(snap.nbytes)}, {len(snap.header.buffers)} storages")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.snapshot:
        from . import demo

        return demo.run(size_mb=args.size_mb, repeat=args.repeat, directory=args.dir)
    from .cache.scenario import run_demo

    return run_demo(size=args.size, runs=args.repeat, directory=args.dir)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerocopy-pickle",
        description="Inspect and convert zerocopy_pickle snapshots; run the demo.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="show a snapshot's header, buffers, sizes, dtypes and needed globals")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--buffers", type=int, default=20, metavar="N", help="list the first N buffers (default 20)")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("convert", help="convert a torch.save file or .safetensors file into a snapshot")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="load a torch.save file with full pickle (weights_only=False); only for files you trust",
    )
    p.add_argument("--fsync", action="store_true", help="flush the snapshot to stable storage")
    p.set_defaults(func=_convert)

    add_cache_commands(sub)

    p = sub.add_parser(
        "demo",
        help="build a ControlNet pipeline locally and run the seed scenario plain and through the model cache; "
        "with --snapshot, dump and load a model timed against torch.load and safetensors",
    )
    p.add_argument("--snapshot", action="store_true", help="run the snapshot demo instead of the cache demo")
    p.add_argument("--size", choices=("tiny", "sd15"), default="tiny", help="the cache demo's pipeline (default tiny)")
    p.add_argument("--size-mb", type=int, default=256, help="size of the snapshot demo's model in MiB (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="runs per variant or method (default 3)")
    p.add_argument("--dir", default=None, help="directory for the files (default: a temporary one)")
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerocopy-pickle`` console script."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ZeroCopyPickleError, OSError) as e:
        print(f"zerocopy-pickle {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
