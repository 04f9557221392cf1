"""The parser of the command line, in one place (every command's options, help text and examples, the exit codes
and environment variables ``--help`` lists), and :func:`main`, which runs one command: it sets the logging level
from ``-v``/``-q`` and turns an expected failure into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

from .._console import printable
from .._version import __version__
from ..cache.cli import add_cache_commands
from ..errors import ZeroCopyPickleError
from . import convert, demo, inspection, native
from .exits import (
    EXIT_ERROR,
    EXIT_INTEGRITY,
    EXIT_INTERRUPTED,
    EXIT_NO_SERVER,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    exit_code,
    print_json,
)

_FORMATTER = argparse.RawDescriptionHelpFormatter

_EXIT_TABLE = f"""\
exit codes:
  {EXIT_OK}    ok
  {EXIT_ERROR}    error: a file is missing or is not a snapshot, a conversion or native build failed
  {EXIT_USAGE}    usage error: an unknown option or a missing argument
  {EXIT_REFUSED}    refused: a restricted load would refuse the snapshot (scan)
  {EXIT_INTEGRITY}    integrity: the snapshot does not match its checksums (scan, inspect --verify)
  {EXIT_NO_SERVER}    no cache server is running (status, stop, clear)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)"""

_ENVIRONMENT = """\
environment:
  ZEROCOPY_PICKLE_NATIVE     0/python, 1/native, or auto (default): the backend (see `native`)
  ZEROCOPY_PICKLE_HOME       the library's files: native builds, URL downloads (default
                             $XDG_CACHE_HOME/zerocopy_pickle, else ~/.cache/zerocopy_pickle)
  ZEROCOPY_PICKLE_CACHE_DIR  the model cache server's private directory (default
                             $XDG_RUNTIME_DIR/zerocopy_pickle, else /tmp/zerocopy_pickle-UID)
  ZEROCOPY_PICKLE_DISABLE_PLUGINS  comma-separated plugin names not to load
  ZEROCOPY_PICKLE_PROGRESS   0/off: no progress bars; unset/auto: a bar on a terminal (convert, dumps)
  ZEROCOPY_PICKLE_PROGRESS_MIN  the smallest operation that gets a bar (default 256M)
  ZEROCOPY_PICKLE_PREFETCH   0/off: loads and cache hits read no data ahead; wait: loads wait for it
  ZEROCOPY_PICKLE_CACHE_MISS_PREFETCH  1: a cache miss prefetches the checkpoints it will read
  ZEROCOPY_PICKLE_DUMP_WRITERS  1: dumps write with one thread; auto (default): two up to 1 GiB
  ZEROCOPY_PICKLE_PREFETCH_STREAMS  threads per prefetch (default 4)
  CXX                        the C++ compiler `native --build` uses (default c++)"""


def _verbosity_options(parser: argparse.ArgumentParser, suffix: str = "") -> None:
    """``-v`` and ``-q``, on the top-level parser and (under other names, added up in main) on each command, so
    that they work before or after the command's name."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        dest="verbose" + suffix,
        help="log more: -v info, -vv debug (stderr)",
    )
    group.add_argument(
        "-q", "--quiet", action="count", default=0, dest="quiet" + suffix, help="log errors only (stderr)"
    )


def _command(sub: Any, name: str, *, help: str, description: str, examples: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=description, epilog="examples:\n" + examples, formatter_class=_FORMATTER
    )
    _verbosity_options(parser, "_command")
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerocopy-pickle",
        formatter_class=_FORMATTER,
        description="Inspect, scan and convert zerocopy_pickle snapshots, build the native helpers, run the\n"
        "model cache server, and run the demos. `zerocopy-pickle COMMAND --help` describes each command.",
        epilog=f"""\
examples:
  zerocopy-pickle convert model.pt model.zcp       # a torch.save or .safetensors file into a snapshot
  zerocopy-pickle inspect model.zcp                # header, sizes, dtypes, the globals it needs
  zerocopy-pickle scan model.zcp --json            # would a restricted load accept it?
  zerocopy-pickle native --build                   # build the optional native helpers once
  zerocopy-pickle serve --max-bytes 16G &          # the model cache server
  zerocopy-pickle status --json

{_EXIT_TABLE}

{_ENVIRONMENT}

Errors are one line on stderr: `zerocopy-pickle COMMAND: error: ...`; with --json, stdout also gets
{{"error": MESSAGE, "exit_code": CODE}}. Documentation: docs/cli.md.""",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _verbosity_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_inspect(sub)
    _add_scan(sub)
    _add_convert(sub)
    _add_native(sub)
    add_cache_commands(sub)
    for name in ("serve", "status", "stop", "clear"):
        _verbosity_options(sub.choices[name], "_command")
    _add_demo(sub)
    return parser


def _add_inspect(sub: Any) -> None:
    p = _command(
        sub,
        "inspect",
        help="show a snapshot's header, buffers, sizes, dtypes and needed globals",
        description="Print what a snapshot holds, from its header and stream, without loading it: format version,\n"
        "sizes of the header, stream and data regions, the producer's versions, plugins, checksums, signature,\n"
        "bytes by dtype and by device, the globals the stream needs, and the first N buffers.\n"
        f"With --verify, also read every byte and check it against the checksums (exit {EXIT_INTEGRITY} on a "
        "mismatch).",
        examples="  zerocopy-pickle inspect model.zcp\n"
        "  zerocopy-pickle inspect model.zcp --buffers 0      # no buffer table\n"
        "  zerocopy-pickle inspect model.zcp --verify         # check every checksum too\n"
        "  zerocopy-pickle inspect model.zcp --json | jq '.nbytes_by_dtype'",
    )
    p.add_argument("file", help="the snapshot")
    p.add_argument("--json", action="store_true", help="print a JSON report (see docs/cli.md for its keys)")
    p.add_argument("--buffers", type=int, default=20, metavar="N", help="list the first N buffers (default 20)")
    p.add_argument(
        "--verify", action="store_true", help="check the stream and every buffer against the recorded checksums"
    )
    p.set_defaults(func=inspection.run_inspect)


def _add_scan(sub: Any) -> None:
    p = _command(
        sub,
        "scan",
        help="list the globals a snapshot needs and whether a restricted load accepts it",
        description="List the globals (classes and functions) a snapshot's stream names, without unpickling it,\n"
        "and say what a restricted load (zerocopy_pickle.load without trusted=True) decides about each:\n"
        "  allowed   in the safe set, declared by a plugin the header names, or given with --allow\n"
        "  refused   not on the allow-list: allow=[...] (classes) or allow_function (functions) admits it\n"
        "  blocked   on the blocklist (runs code, touches files or the network): only trusted=True loads it\n"
        "The decision is the restricted load's own, on the same stream (its checksum is verified first).\n"
        f"Exits {EXIT_OK} if a restricted load accepts the snapshot, {EXIT_REFUSED} if it refuses it, "
        f"{EXIT_INTEGRITY} if the stream is damaged.",
        examples="  zerocopy-pickle scan model.zcp\n"
        "  zerocopy-pickle scan model.zcp --allow mypkg.models:Net    # as load(..., allow=['mypkg.models:Net'])\n"
        "  zerocopy-pickle scan model.zcp --json | jq -r '.restricted.refused[]'\n"
        "  zerocopy-pickle scan model.zcp -q >/dev/null && echo 'loads without trusted=True'",
    )
    p.add_argument("file", help="the snapshot")
    p.add_argument("--json", action="store_true", help="print a JSON report (see docs/cli.md for its keys)")
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="MODULE:QUALNAME",
        help="allow this global too, as load(allow=[...]) would (repeatable; imports its module)",
    )
    p.set_defaults(func=inspection.run_scan)


def _add_convert(sub: Any) -> None:
    p = _command(
        sub,
        "convert",
        help="convert a torch.save file or .safetensors file into a snapshot",
        description="Read a torch.save file (zip or legacy format) or a .safetensors file and write it as a\n"
        "snapshot; prints the input's kind, the snapshot's size and its number of storages. A torch.save file\n"
        "is read with weights_only=True unless --trusted.",
        examples="  zerocopy-pickle convert model.pt model.zcp\n"
        "  zerocopy-pickle convert model.safetensors model.zcp --fsync\n"
        "  zerocopy-pickle convert pipeline.pt pipeline.zcp --trusted   # full pickle: only for files you trust",
    )
    p.add_argument("input", help="the torch.save or .safetensors file")
    p.add_argument("output", help="the snapshot to write (replaced atomically)")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="load a torch.save file with full pickle (weights_only=False); only for files you trust",
    )
    p.add_argument("--fsync", action="store_true", help="flush the snapshot to stable storage")
    p.set_defaults(func=convert.run_convert)


def _add_native(sub: Any) -> None:
    p = _command(
        sub,
        "native",
        help="say which backend (native helpers or Python) is active and why; --build builds the helpers",
        description="Print one line: which implementation of the helpers is active (native or python) and why\n"
        "(ZEROCOPY_PICKLE_NATIVE, a cached build, or none for this torch and Python). The native helpers\n"
        "make loads of many small tensors about 10% faster and TorchScript imports lighter; auto mode uses\n"
        "them only once built. --build compiles them into the cache (30 to 60 s of CPU; needs a C++ compiler\n"
        "and ninja: pip install ninja), says where and how long it took, and exits 1 if it cannot.",
        examples="  zerocopy-pickle native\n"
        "  zerocopy-pickle native --build\n"
        "  zerocopy-pickle native --build --force     # rebuild even if cached\n"
        "  zerocopy-pickle native --json | jq -r .backend",
    )
    p.add_argument("--build", action="store_true", help="build the native helpers into the cache (or find them)")
    p.add_argument("--force", action="store_true", help="with --build: rebuild even if a build is cached")
    p.add_argument("--json", action="store_true", help="print a JSON report (see docs/cli.md for its keys)")
    p.set_defaults(func=native.run_native)


def _add_demo(sub: Any) -> None:
    p = _command(
        sub,
        "demo",
        help="build a ControlNet pipeline locally and run the seed scenario plain and through the model cache; "
        "with --snapshot, dump and load a model timed against torch.load and safetensors",
        description="The cache demo (default): build a small StableDiffusionControlNetPipeline and two\n"
        "ControlNets in a temporary folder, run the same loading scenario plain and through a fresh cache\n"
        "server, and print their timings. Needs the [bench] extra (diffusers, transformers).\n"
        "With --snapshot: dump a TinyGPT model and load it back with torch.load, safetensors and\n"
        "zerocopy_pickle, and print a table of times and memory.",
        examples="  zerocopy-pickle demo\n"
        "  zerocopy-pickle demo --size sd15 --repeat 5\n"
        "  zerocopy-pickle demo --snapshot --size-mb 1024",
    )
    p.add_argument("--snapshot", action="store_true", help="run the snapshot demo instead of the cache demo")
    p.add_argument("--size", choices=("tiny", "sd15"), default="tiny", help="the cache demo's pipeline (default tiny)")
    p.add_argument("--size-mb", type=int, default=256, help="size of the snapshot demo's model in MiB (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="runs per variant or method (default 3)")
    p.add_argument("--dir", default=None, help="directory for the files (default: a temporary one)")
    p.set_defaults(func=demo.run_demo)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerocopy-pickle`` console script: run one command and return its exit status."""
    from .._console import configure_logging, quiet_third_party

    args = _parser().parse_args(argv)  # exits 2 on a usage error, 0 after --help or --version
    verbosity = args.verbose + args.verbose_command - args.quiet - args.quiet_command
    if args.command == "serve":
        verbosity += 1  # a server in the foreground says where it serves, and when it stops
    configure_logging(verbosity)
    quiet_third_party()
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"zerocopy-pickle {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`zerocopy-pickle inspect F | head`): nobody is left to tell. Point stdout at
        # /dev/null so that the interpreter's final flush does not fail again.
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except (ZeroCopyPickleError, OSError, EOFError) as e:
        code = exit_code(e)
        print(f"zerocopy-pickle {args.command}: error: {printable(str(e))}", file=sys.stderr)
        if getattr(args, "json", False):
            print_json({"error": str(e), "exit_code": code})
        return code
