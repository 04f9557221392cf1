"""The commands that read a snapshot without loading it: ``inspect`` (its header, regions, sizes by dtype and by
device, the globals its stream needs, the first buffers; ``--verify``: every checksum) and ``scan`` (the globals
its stream names, and the restricted load's own decision about each and about the whole stream).

Every string from the file goes through :func:`zerocopy_pickle._console.printable` before it is printed: names
and versions are the file's to choose.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .._console import printable
from .._storage import format as fmt
from ..cache.cli import human
from ..errors import MissingGlobalError, RestrictedLoadError
from .exits import EXIT_OK, EXIT_REFUSED, print_json


def run_inspect(args: argparse.Namespace) -> int:
    from .._core.snapshot import Snapshot, scan
    from .._storage import integrity
    from .._trust.entries import format_global

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
        print_json(report)
        return EXIT_OK
    # Every string from the file goes through printable(): names and versions are the file's to choose.
    out = [
        f"{printable(args.file)}: zerocopy_pickle snapshot, format v{header.version}, {human(header.total_nbytes)}",
        "  written by: " + ", ".join(printable(f"{k} {v}") for k, v in sorted(header.producer.items())),
        f"  header     [{fmt.FIXED_NBYTES}, {header.stream_offset})  {header.header_nbytes} bytes",
        f"  stream     [{header.stream_offset}, {header.stream_offset + header.stream_nbytes})  "
        f"{human(header.stream_nbytes)}",
        f"  data       [{header.data_offset}, {header.total_nbytes})  {human(header.data_nbytes)} in "
        f"{len(header.buffers)} buffers",
        "  plugins:   " + (", ".join(printable(f"{p.name} (from {p.package})") for p in header.plugins) or "none"),
        "  checksums: "
        + (f"{header.checksums.algorithm}, stream and {len(header.buffers)} buffers" if header.checksums else "none")
        + (" (verified: all match)" if args.verify else ""),
        "  signature: " + ("HMAC-SHA256 (verify with load(..., key=...))" if header.signature else "none"),
        "  by dtype:  " + ", ".join(f"{printable(d)} {human(n)}" for d, n in by_dtype.most_common()),
        "  by device: " + ", ".join(f"{printable(d)} {human(n)}" for d, n in by_location.most_common()),
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


def run_scan(args: argparse.Namespace) -> int:
    from .._core.loadcore import admit_stream
    from .._storage import integrity, sources
    from .._trust.entries import format_global
    from .._trust.restricted import scan_stream

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
        print_json(
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
    from .._core.loadcore import restricted_allow_list
    from .._registry.registry import default_registry
    from .._trust.advice import refusal_message
    from .._trust.blocklist import is_blocked
    from .._trust.restricted import safe_globals

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
