"""Internal: ``zerocopy-pickle``, the command line (``docs/cli.md`` documents every command, its output and its
JSON).

zerocopy-pickle [-v | -q] inspect FILE [--json] [--buffers N] [--verify]
zerocopy-pickle [-v | -q] scan FILE [--json] [--allow MODULE:QUALNAME ...]
zerocopy-pickle [-v | -q] convert IN OUT [--trusted] [--fsync]
zerocopy-pickle [-v | -q] native [--build [--force]] [--json]
zerocopy-pickle [-v | -q] demo [--size tiny|sd15] [--repeat N] [--dir DIR] [--snapshot [--size-mb N]]
zerocopy-pickle [-v | -q] serve [--max-bytes N] [--persist DIR] | status [--json] | stop | clear
zerocopy-pickle --version

Every command exits with one of the ``EXIT_*`` statuses below (documented in ``--help``), and reports an expected
failure (an error of :mod:`zerocopy_pickle.errors`, an ``OSError``) as one line ``zerocopy-pickle CMD: error: ...``
on stderr, without a traceback; with ``--json`` it also prints ``{"error": ..., "exit_code": ...}`` on stdout.
``-v``/``-q`` set the level of the ``zerocopy_pickle`` logger (:mod:`zerocopy_pickle._console`, which also filters
known third-party noise); only the command line configures logging, never the library.

Snapshot modules (and torch) are imported inside the commands that need them: ``serve`` (the model cache's
server) must not import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._console import printable
from ._storage import format as fmt
from ._version import __version__
from .cache.cli import EXIT_INTERRUPTED, EXIT_NO_SERVER, NoServer, add_cache_commands
from .cache.cli import human as _human
from .errors import IntegrityError, MissingGlobalError, RestrictedLoadError, ZeroCopyPickleError

EXIT_OK = 0
"""The command did what it was asked."""
EXIT_ERROR = 1
"""An error: a file is missing or is not a snapshot, a conversion or a native build failed, ..."""
EXIT_USAGE = 2
"""The command line is wrong (argparse's own status: an unknown option, a missing argument)."""
EXIT_REFUSED = 3
"""A restricted load refuses the snapshot: ``scan`` found globals outside the allow-list (or a use it forbids)."""
EXIT_INTEGRITY = 4
"""The snapshot's bytes do not match its checksums (``scan``: the stream; ``inspect --verify``: everything)."""
# EXIT_NO_SERVER = 5 and EXIT_INTERRUPTED = 130 come from zerocopy_pickle.cache.cli, whose own entry
# (`python -m zerocopy_pickle.cache`) uses them too: `status`, `stop` or `clear` found no cache server running;
# Ctrl-C.

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


# ---------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    from ._core.snapshot import Snapshot, scan
    from ._storage import integrity
    from ._trust.entries import format_global

    with Snapshot.open(args.file) as snap:
        header = snap.header
        if args.verify:
            integrity.verify_file(header, snap.fileno())
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
            "verified": bool(args.verify),
            "buffers": [entry._asdict() for entry in header.buffers],
            "nbytes_by_dtype": dict(by_dtype),
            "nbytes_by_location": dict(by_location),
            "globals": [format_global(g) for g in globals_needed],
        }
        _print_json(report)
        return EXIT_OK
    # Every string from the file goes through printable(): names and versions are the file's to choose.
    out = [
        f"{printable(args.file)}: zerocopy_pickle snapshot, format v{header.version}, {_human(header.total_nbytes)}",
        "  written by: " + ", ".join(printable(f"{k} {v}") for k, v in sorted(header.producer.items())),
        f"  header     [{fmt.FIXED_NBYTES}, {header.stream_offset})  {header.header_nbytes} bytes",
        f"  stream     [{header.stream_offset}, {header.stream_offset + header.stream_nbytes})  "
        f"{_human(header.stream_nbytes)}",
        f"  data       [{header.data_offset}, {header.total_nbytes})  {_human(header.data_nbytes)} in "
        f"{len(header.buffers)} buffers",
        "  plugins:   " + (", ".join(printable(f"{p.name} (from {p.package})") for p in header.plugins) or "none"),
        "  checksums: "
        + (f"{header.checksums.algorithm}, stream and {len(header.buffers)} buffers" if header.checksums else "none")
        + (" (verified: all match)" if args.verify else ""),
        "  signature: " + ("HMAC-SHA256 (verify with load(..., key=...))" if header.signature else "none"),
        "  by dtype:  " + ", ".join(f"{printable(d)} {_human(n)}" for d, n in by_dtype.most_common()),
        "  by device: " + ", ".join(f"{printable(d)} {_human(n)}" for d, n in by_location.most_common()),
        f"  globals the stream needs ({len(globals_needed)}):",
        *(f"    {printable(format_global(g))}" for g in globals_needed),
    ]
    shown = header.buffers[: args.buffers]
    if shown:
        out.append(f"  buffers (first {len(shown)} of {len(header.buffers)}):")
        out.append(f"    {'#':>5} {'offset':>14} {'nbytes':>14}  {'location':<8} dtype")
        for i, entry in enumerate(shown):
            location, dtype = printable(entry.location), printable(entry.dtype or "?")
            out.append(f"    {i:>5} {header.data_offset + entry.offset:>14} {entry.nbytes:>14}  {location:<8} {dtype}")
    print("\n".join(out))
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------------------------


def _scan(args: argparse.Namespace) -> int:
    from ._core.loadcore import admit_stream
    from ._storage import integrity, sources
    from ._trust.entries import format_global
    from ._trust.restricted import scan_stream

    opened = sources.open_source(args.file, sources.INSPECT, what="scan")
    header = opened.header
    stream = bytes(opened.view[header.stream_offset : header.stream_offset + header.stream_nbytes])
    opened.view.release()
    # What a load checks first: a damaged stream is refused before anything looks at what it names.
    integrity.verify_stream(header, stream)
    pairs = scan_stream(stream)
    # The verdict is the restricted load's own decision, not a copy of it (loadcore.admit_stream: the same
    # analysis, plugin presence check and allow list admission, run on the stream alone).
    refusal: RestrictedLoadError | None = None
    try:
        admit_stream(stream, plugins=header.plugins, allow=args.allow)
    except RestrictedLoadError as e:
        refusal = e
    statuses = _statuses(pairs, header.plugins, args.allow, refusal)

    def verdict(pair: tuple[str, str]) -> str:
        return statuses[pair]

    if args.json:
        _print_json(
            {
                "file": os.fspath(args.file),
                "allow": list(args.allow),
                "globals": [
                    {"name": format_global(p), "module": p[0], "qualname": p[1], "status": verdict(p)} for p in pairs
                ],
                "restricted": {
                    "accepted": refusal is None,
                    "refused": [format_global(p) for p in refusal.needed] if refusal else [],
                    "blocked": [format_global(p) for p in refusal.blocked] if refusal else [],
                    "message": str(refusal) if refusal else None,
                },
            }
        )
    else:
        out = [f"{printable(args.file)}: the stream needs {len(pairs)} globals"]
        out += [f"  {verdict(p):<8} {printable(format_global(p))}" for p in pairs]
        allowing = printable(f" with --allow {' '.join(args.allow)}") if args.allow else ""
        if refusal is None:
            out.append(f"restricted load{allowing}: accepted")
        else:
            out.append(f"restricted load{allowing}: refused: {printable(str(refusal))}")
        print("\n".join(out))
    return EXIT_OK if refusal is None else EXIT_REFUSED


def _statuses(
    pairs: Sequence[tuple[str, str]],
    plugins: Sequence[tuple[str, str]],
    allow: Sequence[str],
    refusal: RestrictedLoadError | None,
) -> dict[tuple[str, str], str]:
    """What ``scan`` says of each global: ``blocked``, ``refused`` or ``allowed``, from the allow-list a restricted
    load of this stream builds (the load core's own, for the plugins the header names and ``allow``), asked one
    global at a time, whatever else the stream holds.

    The load's verdict (``refusal``) says why the whole stream is refused, but not always which global: a stream
    whose analysis already fails (code pickled by value, a REDUCE of something that is not a global) is refused
    before any name is checked, with no ``needed`` or ``blocked``. So no status is read off the verdict alone: a
    global is ``allowed`` only if the load's allow-list resolves it and it is not on the blocklist, by name or by
    what it denotes, and a global the verdict lists as ``needed`` or ``blocked`` is never ``allowed``. A status is
    about the name: a stream refused for what it does with an allowed global (calls a dtype) keeps it ``allowed``.
    """
    from ._core.loadcore import restricted_allow_list
    from ._registry.registry import default_registry
    from ._trust.advice import refusal_message
    from ._trust.blocklist import is_blocked
    from ._trust.restricted import safe_globals

    allow_list = restricted_allow_list(allow, default_registry(), [name for name, _ in plugins])
    # The load's own classification of every global it cannot admit (blocked by name, or by what an imported
    # module's attribute is), as a refusal would word it.
    classified = refusal_message(RestrictedLoadError("", refused=("", "")), allow_list, pairs)
    blocked = set(classified.blocked)
    refused: set[tuple[str, str]] = set()
    if refusal is not None:
        blocked.update(refusal.blocked)
        refused.update(refusal.needed)  # not refusal.refused: that can be a use refused, of an allowed name
    statuses: dict[tuple[str, str], str] = {}
    safe = safe_globals()
    for pair in pairs:
        if pair in safe:  # the safe set is looked up before the blocklist (a few torch._C._nn values)
            status = "allowed"
        elif pair in blocked or is_blocked(pair):
            status = "blocked"
        elif pair in refused:
            status = "refused"
        else:
            try:
                allow_list.find_class(*pair)
            except RestrictedLoadError as e:
                status = "blocked" if pair in e.blocked else "refused"
            except MissingGlobalError:  # allowed by name, not importable: the load cannot admit it either
                status = "refused"
            else:
                status = "allowed"
        statuses[pair] = status
    return statuses


# ---------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------


def _sniff(path: str) -> str:
    """What ``path`` is (:func:`zerocopy_pickle._storage.sources.sniff`, the detection loads use too); anything unknown
    is handed to torch.load, whose error then says what is wrong."""
    from ._storage.sources import at_fd, sniff

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


def _convert(args: argparse.Namespace) -> int:
    from ._core.snapshot import Snapshot, dump

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
            + f"{_human(snap.nbytes)}, {len(snap.header.buffers)} storages"
        )
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------
# native
# ---------------------------------------------------------------------------------------------------------


def _native(args: argparse.Namespace) -> int:
    import warnings

    from . import native  # with ZEROCOPY_PICKLE_NATIVE=1, importing it builds, or raises NativeBuildError

    build: dict[str, Any] | None = None
    if args.build:
        cached = native.extension_path().is_file() and not args.force
        started = time.monotonic()
        path = native.build(force=args.force)
        build = {"path": str(path), "compiled": not cached, "seconds": round(time.monotonic() - started, 3)}
    # A broken cached build warns (NativeWarning) when auto mode first looks at it; the status line says so.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", native.NativeWarning)
        state = native.status()
    hint = ""
    # Auto mode's own reasons start with "auto:"; others (a use() block) need no advice.
    if state.reason.startswith("auto:") and state.backend == "python" and state.extension_path is not None:
        hint = (
            "; rebuild it: zerocopy-pickle native --build --force"
            if state.built
            else "; build them once: zerocopy-pickle native --build"
        )
    if args.json:
        _print_json(
            {
                "backend": state.backend,
                "mode": state.mode,
                "reason": state.reason,
                "extension_path": None if state.extension_path is None else str(state.extension_path),
                "built": state.built,
                "build": build,
            }
        )
        return EXIT_OK
    if build is not None:
        if build["compiled"]:
            print(f"built the native helpers in {build['seconds']:.1f} s: {build['path']}")
        else:
            print(f"the native helpers were already built: {build['path']}")
    print(f"native: {state.backend} ({state.reason}{hint})")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------------------


def _examples_checkout() -> Path | None:
    """The source checkout this library is imported from, if it has the ``examples/`` the demos live in (an
    editable install of a clone); None for an installed wheel, which ships no examples."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "examples" / "__init__.py").is_file() else None


def _demo(args: argparse.Namespace) -> int:
    root = _examples_checkout()
    if root is None:
        print(
            "zerocopy-pickle demo: the demos are the examples/ of a source checkout, which an installed package "
            "does not include; run it from a clone: git clone https://github.com/zerocopy-pickle/zerocopy-pickle "
            "&& cd zerocopy-pickle && make demo",
            file=sys.stderr,
        )
        return EXIT_ERROR
    sys.path.insert(0, str(root))  # first: a package of another project named "examples" must not answer
    if args.snapshot:
        from examples import snapshot_demo

        return snapshot_demo.run(size_mb=args.size_mb, repeat=args.repeat, directory=args.dir)
    from examples import cache_scenario

    return cache_scenario.run_demo(size=args.size, runs=args.repeat, directory=args.dir)


# ---------------------------------------------------------------------------------------------------------
# The parser and main
# ---------------------------------------------------------------------------------------------------------


def _print_json(report: dict[str, Any]) -> None:
    # ensure_ascii: every character outside printable ASCII is a \uXXXX escape, C0 and DEL as well as what
    # json.dumps would otherwise leave raw (C1 controls such as the CSI 0x9b, the bidirectional overrides).
    json.dump(report, sys.stdout, indent=2, ensure_ascii=True)
    print()


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
    p.set_defaults(func=_inspect)


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
    p.set_defaults(func=_scan)


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
    p.set_defaults(func=_convert)


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
    p.set_defaults(func=_native)


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
    p.set_defaults(func=_demo)


def _exit_code(error: BaseException) -> int:
    if isinstance(error, NoServer):
        return EXIT_NO_SERVER
    if isinstance(error, IntegrityError):
        return EXIT_INTEGRITY
    if isinstance(error, RestrictedLoadError):
        return EXIT_REFUSED
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerocopy-pickle`` console script: run one command and return its exit status."""
    from ._console import configure_logging, quiet_third_party

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
        code = _exit_code(e)
        print(f"zerocopy-pickle {args.command}: error: {printable(str(e))}", file=sys.stderr)
        if getattr(args, "json", False):
            _print_json({"error": str(e), "exit_code": code})
        return code


if __name__ == "__main__":
    sys.exit(main())
