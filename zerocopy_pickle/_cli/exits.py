"""How a command of the command line ends: the exit statuses every command returns (``EXIT_*``, documented in
``--help`` and ``docs/cli.md``), the status of an expected error, and the JSON report printed on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any

from ..cache import cli as cache_cli
from ..errors import IntegrityError, RestrictedLoadError

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
# The next two are zerocopy_pickle.cache.cli's, whose own entry (`python -m zerocopy_pickle.cache`) uses them too.
EXIT_NO_SERVER = cache_cli.EXIT_NO_SERVER
"""``status``, ``stop`` or ``clear`` found no cache server running (5)."""
EXIT_INTERRUPTED = cache_cli.EXIT_INTERRUPTED
"""Ctrl-C (130)."""


def exit_code(error: BaseException) -> int:
    """The status a command that failed with ``error`` (an expected one: see ``parser.main``) exits with."""
    if isinstance(error, cache_cli.NoServer):
        return EXIT_NO_SERVER
    if isinstance(error, IntegrityError):
        return EXIT_INTEGRITY
    if isinstance(error, RestrictedLoadError):
        return EXIT_REFUSED
    return EXIT_ERROR


def print_json(report: dict[str, Any]) -> None:
    # ensure_ascii: every character outside printable ASCII is a \uXXXX escape, C0 and DEL as well as what
    # json.dumps would otherwise leave raw (C1 controls such as the CSI 0x9b, the bidirectional overrides).
    json.dump(report, sys.stdout, indent=2, ensure_ascii=True)
    print()
