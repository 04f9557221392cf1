"""The tests' one door into the package's private modules.

Everything under ``zerocopy_pickle/_*`` is internal: it may move or change without notice, and only this file
names it in an import, so a move changes this file and nothing else in the suite (``tests/test_api.py`` checks
that no other test file imports a private module). Import from here what a test needs: a private module as a
whole (``from tests.internals import arena``) or one of the names listed below. A new internal a test needs is
added here, next to the others from its module. Subprocess scripts written as strings, ``monkeypatch`` targets
and logger names still spell the private paths: they name them, they do not import them here.
"""

from __future__ import annotations

from zerocopy_pickle import _console as console
from zerocopy_pickle._cli import demo as cli_demo
from zerocopy_pickle._cli import exits as cli_exits
from zerocopy_pickle._cli import inspection as cli_inspection
from zerocopy_pickle._cli import main
from zerocopy_pickle._console import NOISE, configure_logging, printable, quiet_third_party
from zerocopy_pickle._core import loadcore, pickler, snapshot
from zerocopy_pickle._core.loadcore import BufferTable, LoadPolicy, load_stream, restricted_allow_list
from zerocopy_pickle._devices import backend, coldread, device, transfer
from zerocopy_pickle._devices.plan import (
    DEVICE_ALIGNMENT,
    DIRECT_ALIGNMENT,
    PAGE,
    SLOTS,
    Plan,
    SourceFile,
    plan,
    plan_reads,
    register_ranges,
)
from zerocopy_pickle._names import GlobalName
from zerocopy_pickle._registry.discovery import resolve_name
from zerocopy_pickle._storage import (
    arena,
    atomic,
    decoding,
    format,
    integrity,
    progress,
    readahead,
    remote,
    sources,
    writes,
)
from zerocopy_pickle._storage.fileid import FileIdentity
from zerocopy_pickle._trust import (
    advice,
    blocklist,
    entries,
    handlers,
    restricted,
    safe_composite,
    safe_parameters,
    safe_set,
    safe_tensors,
    semantics,
    streamcheck,
    tags,
)
from zerocopy_pickle._trust.advice import spell_allow
from zerocopy_pickle._trust.blocklist import is_blocked
from zerocopy_pickle._trust.entries import format_global
from zerocopy_pickle._trust.restricted import AllowList, safe_globals, scan_stream
from zerocopy_pickle._trust.safe_set import NN_BUILTIN_VALUES, safe_table
from zerocopy_pickle._trust.safe_tensors import safe_rebuild_memory_format, safe_rebuild_wrapper_subclass
from zerocopy_pickle._trust.streamcheck import DYNAMIC, MAX_MARKS, MAX_STACK, check_stream, walk_stream

__all__ = [
    "DEVICE_ALIGNMENT",
    "DIRECT_ALIGNMENT",
    "DYNAMIC",
    "MAX_MARKS",
    "MAX_STACK",
    "NN_BUILTIN_VALUES",
    "NOISE",
    "PAGE",
    "SLOTS",
    "AllowList",
    "BufferTable",
    "FileIdentity",
    "GlobalName",
    "LoadPolicy",
    "Plan",
    "SourceFile",
    "advice",
    "arena",
    "atomic",
    "backend",
    "blocklist",
    "check_stream",
    "cli_demo",
    "cli_exits",
    "cli_inspection",
    "coldread",
    "configure_logging",
    "console",
    "decoding",
    "device",
    "entries",
    "format",
    "format_global",
    "handlers",
    "integrity",
    "is_blocked",
    "load_stream",
    "loadcore",
    "main",
    "pickler",
    "plan",
    "plan_reads",
    "printable",
    "progress",
    "quiet_third_party",
    "readahead",
    "register_ranges",
    "remote",
    "resolve_name",
    "restricted",
    "restricted_allow_list",
    "safe_composite",
    "safe_globals",
    "safe_parameters",
    "safe_rebuild_memory_format",
    "safe_rebuild_wrapper_subclass",
    "safe_set",
    "safe_table",
    "safe_tensors",
    "scan_stream",
    "semantics",
    "snapshot",
    "sources",
    "spell_allow",
    "streamcheck",
    "tags",
    "transfer",
    "walk_stream",
    "writes",
]
