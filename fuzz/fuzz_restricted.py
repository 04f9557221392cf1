"""Coverage-guided fuzzing (atheris / libFuzzer) of restricted loads with random opcode programs over the safe set.

    PYTHONPATH=. .venv/bin/python fuzz/fuzz_restricted.py -max_total_time=600 -rss_limit_mb=4096 \
        -max_len=4096 -len_control=0 fuzz/corpus-restricted

Each input drives the program generator of ``tests/test_opcode_programs.py`` (through hypothesis'
``fuzz_one_input``, so libFuzzer's mutations become structured programs: GLOBALs of the safe set and of the
plugins' safe globals, BUILD, REDUCE, NEWOBJ, APPENDS, SETITEMS, DUP, POP, memo, buffers and tensor views, and
the shapes the analysis's cost model bounds: memo DAGs, keys and members hashed many times through the memo,
nesting around MAX_DEPTH, deque/defaultdict chains, top-down filling and cycles, names around
MAX_NAME_LENGTH). The
program is wrapped into a snapshot and loaded with the defaults. Loading it must succeed or raise a
``zerocopy_pickle.ZeroCopyPickleError``, write no sentinel file and change no watched global or standard
stream; anything else, a crash, an out-of-memory or a timeout is a finding. The process runs under
``RLIMIT_AS`` (1.5 GiB above its baseline), with stdin from /dev/null (a program may iterate ``sys.stdin``).

``ZCP_FUZZ_KEEP_GOING=1`` reports each *kind* of finding once (to stderr) and keeps fuzzing instead of stopping
at the first: useful while known holes are open, to measure throughput and look for new kinds.
The bounded property-based version of this harness runs in CI (tests/test_opcode_programs.py).
"""

from __future__ import annotations

import os
import re
import resource
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.* and the package

# zerocopy_pickle imports its submodules on first use: import every module a load runs here, so that they are
# instrumented (coverage feedback comes only from modules imported inside this block).
with atheris.instrument_imports(include=["zerocopy_pickle", "zerocopy_pickle_quirks"]):
    import zerocopy_pickle_quirks.bnb
    import zerocopy_pickle_quirks.parametrize
    import zerocopy_pickle_quirks.runtime_objects  # noqa: F401

    import zerocopy_pickle._core.pickler
    import zerocopy_pickle._core.snapshot
    import zerocopy_pickle._devices.device
    import zerocopy_pickle._storage.decoding
    import zerocopy_pickle._storage.format
    import zerocopy_pickle._storage.integrity
    import zerocopy_pickle._trust.restricted
    import zerocopy_pickle._trust.streamcheck
    import zerocopy_pickle.rebuild
    import zerocopy_pickle.validate  # noqa: F401

from tests.test_opcode_programs import make_target

KEEP_GOING = os.environ.get("ZCP_FUZZ_KEEP_GOING") == "1"
SENTINEL = Path(tempfile.mkdtemp(prefix="zcp-fuzz-")) / "PWNED"
TARGET = make_target(SENTINEL, max_examples=1)
FUZZ_ONE = TARGET.hypothesis.fuzz_one_input  # type: ignore[attr-defined]
SEEN: set[str] = set()


def _kind(error: BaseException) -> str:
    """A finding's kind: its type and message with the stream, the changed attributes' names, numbers and
    addresses left out."""
    text = str(error).split("; stream", 1)[0].split(" | ", 1)[0]
    return f"{type(error).__name__}: " + re.sub(r"0x[0-9a-f]+|\d+", "#", text)[:300]


def one_input(data: bytes) -> None:
    if not KEEP_GOING:
        FUZZ_ONE(data)
        return
    try:
        FUZZ_ONE(data)
    except Exception as e:
        kind = _kind(e)
        if kind not in SEEN:
            SEEN.add(kind)
            print(f"\nFINDING #{len(SEEN)}: {kind}\n  {str(e)[:1500]}", file=sys.stderr, flush=True)


def _limit_memory() -> None:
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[0]) * resource.getpagesize()
    limit = base + (3 << 29)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _limit_memory()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
