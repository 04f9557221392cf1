"""Internal: the model cache's commands: ``serve``, ``status``, ``stop``, ``clear``.

``python -m zerocopy_pickle.cache COMMAND`` runs them (:func:`main`; what a patched client uses to start a server),
and the ``zerocopy-pickle`` console script offers them beside its snapshot commands (:func:`add_cache_commands`).
``status``, ``stop`` and ``clear`` exit with :data:`EXIT_NO_SERVER` when no server is running, so that a script
can tell that from a failure. Nothing here imports torch: the server must not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._console import printable
from ..errors import ZeroCopyPickleError

EXIT_ERROR = 1
"""Exit status of a command that failed (the message is on stderr)."""
EXIT_NO_SERVER = 5
"""Exit status of ``status``, ``stop`` and ``clear`` when no cache server is running."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT): 128 + the signal's number, as shells report it."""


class NoServer(ZeroCopyPickleError):
    """No cache server is running (raised by the commands here, from the client's :class:`CacheError`)."""


def no_server(error: BaseException) -> bool:
    """Whether a cache error means that no server is running, rather than that one failed: its cause (the
    client chains it) is a missing socket or directory, or a refused connection (a socket left by a server that
    died)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, (FileNotFoundError, ConnectionRefusedError)):
            return True
        cause = cause.__cause__
    return False


def _server_call(function: Any) -> Any:
    """Call a function of :mod:`zerocopy_pickle.cache` that talks to the server, turning "no server" into
    :class:`NoServer`."""
    from .protocol import CacheError, socket_path

    try:
        return function()
    except CacheError as e:
        if not no_server(e):
            raise
        try:
            where = f" at {socket_path(create=False)}"
        except CacheError as missing:  # not even its directory: say which one
            where = f" ({missing})"
        raise NoServer(f"no cache server is running{where}") from e


def human(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: sizes as the commands print them."""
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


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds like 0.5 or 30")
    return seconds


def _serve(args: argparse.Namespace) -> int:
    from .misses import FILL_DELAY
    from .server import serve

    quiet, longest = args.fill_delay or FILL_DELAY
    serve(max_bytes=args.max_bytes, persist=Path(args.persist) if args.persist else None, copy_files=args.copy_files,
          fill_delay=(quiet, longest))  # fmt: skip
    return 0


def _status(args: argparse.Namespace) -> int:
    from .. import cache

    info: dict[str, Any] = _server_call(cache.status)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    budget = human(info["max_bytes"]) if info["max_bytes"] else "unbounded"
    loader = "no loader running" if info["loader_pid"] is None else f"loader pid {info['loader_pid']}"
    print(
        f"zerocopy_pickle cache: server pid {info['pid']}, {loader}\n"
        f"  {len(info['entries'])} entries, {human(info['total_bytes'])} in memory and "
        f"{human(info['file_bytes'])} in {len(info['files'])} checkpoint files, {info['segments']} segments "
        f"({human(info['logical_bytes'])} before sharing), budget {budget}\n"
        f"  hits {info['hits']}, misses {info['misses']}, evictions {info['evictions']}, stale {info['stale']}"
        + (f"\n  persisted in {printable(str(info['persist']))}" if info["persist"] else "")
    )
    for entry in info["entries"]:  # keys and calls come from the cache's clients: escaped, like file strings
        print(
            f"  {printable(str(entry['key'])[:12])}  {human(entry['nbytes']):>10}  hits {entry['hits']:>5}  "
            f"{printable(str(entry['call']))}"
        )
    for row in info.get("uncacheable", []):  # calls whose results a client could not capture: loaded directly
        print(f"  uncacheable: {printable(str(row['call']))}: {printable(str(row['reason']))}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from .. import cache

    _server_call(cache.stop)
    print("zerocopy_pickle cache stopped")
    return 0


def _clear(args: argparse.Namespace) -> int:
    from .. import cache

    print(f"zerocopy_pickle cache: dropped {_server_call(cache.clear)} entries")
    return 0


_FORMATTER = argparse.RawDescriptionHelpFormatter


def add_cache_commands(sub: Any) -> None:
    """Add the cache's commands to an ``argparse`` subparsers object."""
    p = sub.add_parser(
        "serve",
        help="run the model cache server in the foreground",
        formatter_class=_FORMATTER,
        description="Run the model cache server in this terminal until `zerocopy-pickle stop`, SIGTERM or Ctrl-C.\n"
        "Patched programs (zerocopy_pickle.cache.patch_all()) start one in the background when none runs;\n"
        "run it yourself to choose its memory budget or persistence. It logs when it starts and stops (stderr).",
        epilog="examples:\n"
        "  zerocopy-pickle serve                          # unbounded, in memory only\n"
        "  zerocopy-pickle serve --max-bytes 16G          # evict least recently used entries beyond 16 GiB\n"
        "  zerocopy-pickle serve --persist ~/.zcp-cache   # keep entries on disk: a restart is warm",
    )
    p.add_argument("--max-bytes", type=_size, default=None, help="evict LRU entries beyond this size (e.g. 16G)")
    p.add_argument("--persist", default=None, metavar="DIR", help="keep entries on disk here; restart warm")
    p.add_argument(
        "--copy-files",
        action="store_true",
        help="copy every storage into the cache's memory, even those that are untouched views of a checkpoint "
        "file (by default the cache references such files instead)",
    )
    p.add_argument(
        "--fill-delay",
        type=_seconds,
        nargs=2,
        default=None,
        metavar=("QUIET", "MAX"),
        help="start a background fill (ZEROCOPY_PICKLE_CACHE_FILL=background) once no call has reached the server "
        "for QUIET seconds, and at most MAX seconds after its miss (default: 0.5 30)",
    )
    p.set_defaults(func=_serve)
    p = sub.add_parser(
        "status",
        help="show the cache server's entries, sizes, hits and misses",
        formatter_class=_FORMATTER,
        description="Print the running cache server's pids, its entries (key, size, hits, the call that made\n"
        f"each), memory and file sizes, and hit, miss and eviction counts. Exits {EXIT_NO_SERVER} if no server "
        "is running.",
        epilog="examples:\n"
        "  zerocopy-pickle status\n"
        "  zerocopy-pickle status --json | jq .hits\n"
        f"  zerocopy-pickle status >/dev/null 2>&1; [ $? -eq {EXIT_NO_SERVER} ] && echo 'no server'",
    )
    p.add_argument("--json", action="store_true", help="print a JSON report (see docs/cli.md for its keys)")
    p.set_defaults(func=_status)
    p = sub.add_parser(
        "stop",
        help="stop the cache server",
        formatter_class=_FORMATTER,
        description=f"Stop the running cache server (its entries are lost unless it persists them). Exits "
        f"{EXIT_NO_SERVER} if\nno server is running.",
        epilog="examples:\n  zerocopy-pickle stop",
    )
    p.set_defaults(func=_stop)
    p = sub.add_parser(
        "clear",
        help="drop every entry of the cache server",
        formatter_class=_FORMATTER,
        description=f"Drop every entry of the running cache server and print how many there were; the server "
        f"keeps\nrunning. Exits {EXIT_NO_SERVER} if no server is running.",
        epilog="examples:\n  zerocopy-pickle clear",
    )
    p.set_defaults(func=_clear)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zerocopy_pickle.cache COMMAND``."""
    parser = argparse.ArgumentParser(prog="python -m zerocopy_pickle.cache", description="Run the model cache.")
    add_cache_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"zerocopy-pickle {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except NoServer as e:
        print(f"zerocopy-pickle {args.command}: error: {printable(str(e))}", file=sys.stderr)
        return EXIT_NO_SERVER
    except (ZeroCopyPickleError, OSError) as e:
        print(f"zerocopy-pickle {args.command}: error: {printable(str(e))}", file=sys.stderr)
        return EXIT_ERROR
