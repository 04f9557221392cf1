"""Nothing a load does can outlive it except its result.

A restricted load may call the safe set's functions and classes, plugins' declared safe globals, and the
runtime-objects quirk's rebuild of a standard stream. Whatever a stream does with them, successful or refused,
none of them may be different afterwards: no function's ``__defaults__``/``__kwdefaults__``/``__code__``/
``__dict__``/``__globals__``, no class attribute, no module entry they are found under, no standard stream (by
identity or attributes). The watched set is computed at test time from ``safe_globals()`` and the registry, so
it follows the code.

Every stream of the hostile corpus is loaded with the defaults (this file's and tests/test_hostile.py's), with
``zp.loads`` and ``zp.load(path)``.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp

from . import test_hostile
from .hostile_streams import G, ProcessState, as_snapshot, build, program
from .test_attacks import CORPUS


def _hostile(name: str, sentinel: Path) -> bytes:
    return test_hostile.as_snapshot(test_hostile.PAYLOADS[name](sentinel))


CASES: dict[str, Callable[[Path], bytes]] = {
    **{f"attacks:{name}": maker for name, maker in CORPUS.items()},
    **{f"hostile:{name}": (lambda path, name=name: _hostile(name, path)) for name in test_hostile.PAYLOADS},
}


def load_both_ways(data: bytes, tmp_path: Path) -> None:
    """Load with the defaults through both entry points, whatever the outcome (tests/test_attacks.py and
    tests/test_hostile.py check the outcome; this file checks what is left behind)."""
    path = tmp_path / "hostile.zcp"
    path.write_bytes(data)
    for load in (lambda: zp.loads(data), lambda: zp.load(path)):
        with contextlib.suppress(Exception):  # the outcome is checked elsewhere; here only what is left behind
            load()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_load_leaves_no_trace(name: str, tmp_path: Path, alias_module: None) -> None:
    """Whatever the hostile stream ``name`` does, every watched global and standard stream is unchanged after
    its load (a BUILD on a function, a class, a dtype, ``sys.stderr``; a chain that sets attributes)."""
    sentinel = tmp_path / "PWNED"
    data = CASES[name](sentinel)
    before = ProcessState()
    try:
        load_both_ways(data, tmp_path)
        changes = before.changes()
        assert not changes, f"the load of {name} changed the process: {changes}"
    finally:
        before.restore()
    assert not sentinel.exists(), "a payload ran"


# -- controls: the fixture sees changes, and an ordinary load makes none ---------------------------------------


def test_ordinary_loads_leave_no_trace(tmp_path: Path) -> None:
    """Control: a legitimate snapshot (tensors, a parameter, containers) loads without a reported change."""
    obj = {
        "t": torch.arange(6.0).reshape(2, 3),
        "p": torch.nn.Parameter(torch.ones(2)),
        "od": collections.OrderedDict(a=1),
        "dev": torch.device("cpu"),
        "dtype": torch.float16,
    }
    data = zp.dumps(obj)
    before = ProcessState()
    load_both_ways(data, tmp_path)
    assert before.changes() == []


def test_the_fixture_sees_a_changed_default() -> None:
    """Control: the state snapshot notices a replaced ``__defaults__``, a planted class attribute and a planted
    attribute on ``sys.stderr``, and restores them."""
    before = ProcessState()
    target = torch._utils._rebuild_tensor_v2
    old = target.__defaults__
    try:
        target.__defaults__ = ("x",)
        collections.Counter.planted = 1  # type: ignore[attr-defined]
        changes = before.changes()
        assert any("_rebuild_tensor_v2" in c and "__defaults__" in c for c in changes), changes
        assert any("Counter" in c and "planted" in c for c in changes), changes
    finally:
        before.restore()
    assert target.__defaults__ is old
    assert not hasattr(collections.Counter, "planted")
    assert before.changes() == []


def test_the_watched_set_covers_the_safe_set_and_plugins() -> None:
    """Control: the safe set's values, the objects its names denote, the plugins' safe globals and the standard
    streams are all watched."""
    watched = ProcessState().objects
    assert any(obj is torch._utils._rebuild_tensor_v2 for obj in watched.values())
    assert any(obj is collections.OrderedDict for obj in watched.values())
    assert "sys.stderr" in watched and "sys.stdin" in watched
    plugin_pairs = zp.default_registry().safe_globals()
    assert plugin_pairs, "no plugin declares safe globals: the plugin part of the watch list is untested"
    resolved = [key for key in watched if ":" in key and tuple(key.split(":", 1)) in plugin_pairs]
    assert resolved, "no plugin safe global resolved"


def test_a_corpus_stream_that_mutates_is_caught(tmp_path: Path) -> None:
    """Control on the assembler: a hand-built BUILD on a function, loaded trusted (the caller chose to run it),
    is reported as a change; so a restricted load that did the same would be too."""
    data = as_snapshot(program(build(G("torch._utils", "_rebuild_tensor"), {"planted": 1})))
    before = ProcessState()
    try:
        zp.loads(data, trusted=True)
        assert before.changes(), "a planted function attribute went unnoticed"
    finally:
        before.restore()
    assert before.changes() == []
