"""The ``native`` command: which backend of the helpers is active and why (:func:`zerocopy_pickle.native.status`),
with advice when auto mode falls back to Python; ``--build`` builds the native helpers first
(:func:`zerocopy_pickle.native.build`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from .exits import EXIT_OK, print_json


def run_native(args: argparse.Namespace) -> int:
    import warnings

    from .. import native  # with ZEROCOPY_PICKLE_NATIVE=1, importing it builds, or raises NativeBuildError

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
        print_json(
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
