"""Internal: the model cache's commands: ``serve``, ``status``, ``stop``, ``clear``.

``python -m zerocopy_pickle.cache COMMAND`` runs them (:func:`main`; what a patched client uses to start a server),
and the ``zerocopy-pickle`` console script offers them beside its snapshot commands (:func:`add_cache_commands`).
Nothing here imports torch: the server must not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ZeroCopyPickleError

__all__ = ["add_cache_commands", "human", "main"]


def human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    number = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = number[-1] if number and number[-1] in units else ""
    try:
        return int(float(number[: len(number) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8G, 512M or 1000000") from None


def _serve(args: argparse.Namespace) -> int:
    from .server import serve

    serve(max_bytes=args.max_bytes, persist=Path(args.persist) if args.persist else None, copy_files=args.copy_files)
    return 0


def _status(args: argparse.Namespace) -> int:
    from .. import cache

    info = cache.status()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    budget = human(info["max_bytes"]) if info["max_bytes"] else "unbounded"
    print(
        f"zerocopy_pickle cache: server pid {info['pid']}, loader pid {info['loader_pid']}\n"
        f"  {len(info['entries'])} entries, {human(info['total_bytes'])} in memory and "
        f"{human(info['file_bytes'])} in {len(info['files'])} checkpoint files, {info['segments']} segments "
        f"({human(info['logical_bytes'])} before sharing), budget {budget}\n"
        f"  hits {info['hits']}, misses {info['misses']}, evictions {info['evictions']}, stale {info['stale']}"
        + (f"\n  persisted in {info['persist']}" if info["persist"] else "")
    )
    for entry in info["entries"]:
        print(f"  {entry['key'][:12]}  {human(entry['nbytes']):>10}  hits {entry['hits']:>5}  {entry['call']}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from .. import cache

    cache.stop()
    print("zerocopy_pickle cache stopped")
    return 0


def _clear(args: argparse.Namespace) -> int:
    from .. import cache

    print(f"zerocopy_pickle cache: dropped {cache.clear()} entries")
    return 0


def add_cache_commands(sub: Any) -> None:
    """Add the cache's commands to an ``argparse`` subparsers object."""
    p = sub.add_parser("serve", help="run the model cache server in the foreground")
    p.add_argument("--max-bytes", type=_size, default=None, help="evict LRU entries beyond this size (e.g. 16G)")
    p.add_argument("--persist", default=None, metavar="DIR", help="keep entries on disk here; restart warm")
    p.add_argument(
        "--copy-files",
        action="store_true",
        help="copy every storage into the cache's memory, even those that are untouched views of a checkpoint "
        "file (by default the cache references such files instead)",
    )
    p.set_defaults(func=_serve)
    p = sub.add_parser("status", help="show the cache server's entries, sizes, hits and misses")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.set_defaults(func=_status)
    p = sub.add_parser("stop", help="stop the cache server")
    p.set_defaults(func=_stop)
    p = sub.add_parser("clear", help="drop every entry of the cache server")
    p.set_defaults(func=_clear)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zerocopy_pickle.cache COMMAND``."""
    parser = argparse.ArgumentParser(prog="python -m zerocopy_pickle.cache", description="Run the model cache.")
    add_cache_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ZeroCopyPickleError, OSError) as e:
        print(f"zerocopy-pickle {args.command}: error: {e}", file=sys.stderr)
        return 1
