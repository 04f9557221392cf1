"""A result the cache cannot capture is said once, in the caller, and remembered by the server (no process forks
or captures it again) until the files its key was computed from change; ``patch_all()``'s autostart leaves no
``ResourceWarning``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from zerocopy_pickle.cache.client import Client

from .cache_helpers import ServerProcess, private_dir, run_client, running_server
from .conftest import REPO, run_python

pytestmark = pytest.mark.slow

CLIENT = """
import json, os, sys, warnings
from zerocopy_pickle import cache
from zerocopy_pickle.cache import client
from tests import cache_helpers
if sys.argv[2] == "thread":  # as where CUDA is initialized: captured in the calling thread
    client._fork_is_safe = lambda: False
forks = []
real_fork = os.fork
def counting_fork():
    forks.append(1)
    return real_fork()
os.fork = counting_fork
cache.patch_all(["tests.cache_helpers:unpicklable_load"], autostart=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = cache_helpers.unpicklable_load(sys.argv[1])
    client._filer.drain()  # the filing is done (and has said what it found)
    second = cache_helpers.unpicklable_load(sys.argv[1])
    client._filer.drain()
ours = [str(w.message) for w in caught if issubclass(w.category, cache.CacheWarning)]
print(json.dumps({"warnings": ours, "forks": len(forks), "sum": float(first["state"]["w"].sum()),
                  "again": float(second["state"]["w"].sum()), "cached": cache.cached_key(first) is not None}))
"""


def _checkpoint(path: Path, value: float) -> str:
    torch.save({"w": torch.full((64,), value)}, path)
    return str(path)


def _uncacheable(server: ServerProcess) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = server.status()["uncacheable"]
    return rows


@pytest.mark.parametrize("how", ["fork", "thread"])
def test_a_result_that_cannot_be_captured_is_said_once_and_never_tried_again_until_its_file_changes(
    tmp_path: Path, how: str
) -> None:
    path = _checkpoint(tmp_path / "model.pt", 1.0)
    with running_server() as server:
        first = run_client(server, CLIENT, path, how)
        assert first["sum"] == first["again"] == 64.0 and not first["cached"]  # the caller has its results
        # One warning, naming the call, why, and where the object that cannot be pickled sits.
        assert len(first["warnings"]) == 1, first["warnings"]
        warning = first["warnings"][0]
        assert "unpicklable_load(" in warning and "model.pt" in warning, warning
        assert "cannot pickle a generator" in warning and "at result['handle'].pending" in warning, warning
        assert first["forks"] == (1 if how == "fork" else 0)  # the second call was not captured again
        rows = _uncacheable(server)
        assert [row["reports"] for row in rows] == [1]
        assert server.status()["entries"] == []

        # Another process: the server remembered it, so it neither forks nor captures, and says so once.
        second = run_client(server, CLIENT, path, how)
        assert second["sum"] == 64.0 and second["forks"] == 0
        assert second["warnings"] == [warning]
        assert [row["reports"] for row in _uncacheable(server)] == [1]

        # A changed file: the call is tried (captured) again.
        _checkpoint(tmp_path / "model.pt", 2.0)
        third = run_client(server, CLIENT, path, how)
        assert third["sum"] == 128.0 and third["forks"] == (1 if how == "fork" else 0)
        assert len(third["warnings"]) == 1
        reported = {row["key"]: row["reports"] for row in _uncacheable(server)}
        assert len(reported) == 2 and set(reported.values()) == {1}


def test_a_remembered_call_is_tried_again_when_its_file_changes_under_the_same_key(tmp_path: Path) -> None:
    """The server checks the files again (as on a hit): a report for files that are not what they were is
    forgotten, even for a key the client computed the same way."""
    from zerocopy_pickle.cache.fields import Call, FileCheck
    from zerocopy_pickle.cache.messages import Get, Miss, Uncapturable

    path = tmp_path / "model.pt"
    _checkpoint(path, 1.0)
    get = Get("k-uncacheable", Call("tests.cache_helpers:unpicklable_load"), "a call", fill=True,
              files=[FileCheck.of(str(path), path.stat())])  # fmt: skip
    with running_server() as server, Client(server.directory / "server.sock", timeout=30) as client:
        client.request(Uncapturable(get, "TypeError: cannot pickle '_thread.lock' object"))
        reply = Miss.decode(client.request(get)[0])
        assert reply.uncacheable == "TypeError: cannot pickle '_thread.lock' object"
        _checkpoint(path, 2.0)
        assert Miss.decode(client.request(get)[0]).uncacheable is None
        assert _uncacheable(server) == []
        client.request(Uncapturable(get, "x" * 100_000))  # kept short, whatever a client sends
        assert len(_uncacheable(server)[0]["reason"]) <= 4000


def test_an_uncapturable_report_is_a_request_like_any_other() -> None:
    """It is checked as a request (no fds, a well-formed get inside); a malformed one is refused."""
    from zerocopy_pickle.cache.messages import decode_request
    from zerocopy_pickle.cache.protocol import ProtocolError

    with pytest.raises(ProtocolError, match="carries no file descriptors"):
        decode_request({"op": "uncapturable", "request": {}, "reason": "x"}, 1)
    with pytest.raises(ProtocolError, match="'request' is not an object"):
        decode_request({"op": "uncapturable", "request": "k", "reason": "x"})
    with pytest.raises(ProtocolError):
        decode_request({"op": "uncapturable", "request": {"key": "", "call": {}}, "reason": "x"})
    with pytest.raises(ProtocolError):
        decode_request({"op": "uncapturable", "request": {"key": "k", "call": {"function": "m:f"}}, "reason": 3})


AUTOSTART = """
import gc, json, sys
from zerocopy_pickle import cache
from tests import cache_helpers
cache.patch_all(["tests.cache_helpers:where_am_i"], autostart=True)
result = cache_helpers.where_am_i(sys.argv[1])
gc.collect()
print(json.dumps({"loaded": sorted(result["state"])}))
"""


@pytest.mark.parametrize("fill", ["caller", "background"])
def test_autostart_leaves_no_resource_warning(tmp_path: Path, fill: str) -> None:
    path = _checkpoint(tmp_path / "model.pt", 1.0)
    with private_dir() as directory:
        env = {"ZEROCOPY_PICKLE_CACHE_DIR": str(directory), "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "",
               "ZEROCOPY_PICKLE_CACHE_FILL": fill}  # fmt: skip
        code = "import warnings; warnings.simplefilter('error', ResourceWarning)\n" + AUTOSTART
        proc = run_python(code, path, env=env)
        try:
            assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"loaded": ["w"]}
            assert "ResourceWarning" not in proc.stderr and "still running" not in proc.stderr, proc.stderr
            with Client(directory / "server.sock", timeout=30) as client:  # the server it started runs on
                assert client.request({"op": "status"})[0]["status"]["pid"] != os.getpid()
        finally:
            with Client(directory / "server.sock", timeout=30) as client:
                client.request({"op": "stop"})


def test_what_reports_make_the_server_hold_is_bounded(tmp_path: Path) -> None:
    """A peer's reports are remembered within bounds: at most MAX_UNCACHEABLE calls and MAX_UNCACHEABLE_FILES file
    checks in all (the least recently asked for go first); the newest report is always kept."""
    from zerocopy_pickle.cache import lru
    from zerocopy_pickle.cache import store as store_module
    from zerocopy_pickle.cache.fields import MAX_FILE_CHECKS, Call, FileCheck
    from zerocopy_pickle.cache.messages import Get

    path = tmp_path / "model.pt"
    _checkpoint(path, 1.0)
    checks = [FileCheck.of(str(path), path.stat())] * MAX_FILE_CHECKS
    store = store_module.Store()
    try:
        for n in range(40):
            store.mark_uncacheable(Get(f"k{n}", Call("m:f"), "a call", files=checks), "reason")
        rows = store.status()["uncacheable"]
        assert len(rows) * MAX_FILE_CHECKS <= lru.MAX_UNCACHEABLE_FILES
        assert rows[-1]["key"] == "k39" and store.uncacheable("k39") == "reason"
        assert store.uncacheable("k0") is None  # forgotten: the next miss tries it again
        for n in range(lru.MAX_UNCACHEABLE + 10):
            store.mark_uncacheable(Get(f"small{n}", Call("m:f"), "a call"), "reason")
        assert len(store.status()["uncacheable"]) == lru.MAX_UNCACHEABLE
        store.clear()
        assert store.status()["uncacheable"] == []
    finally:
        store.close()


def test_the_reason_names_the_object_inside_code_pickled_by_value() -> None:
    """The reason's path comes from walking the result with the entry pickler's own reduction: a function
    pickled by value is looked into (its closure), so the socket it holds is named, not the function."""
    import socket

    from zerocopy_pickle.cache import entries, filing

    with socket.socket() as held:

        def fn() -> socket.socket:
            return held

        value = {"fn": fn, "ok": 1}
        with pytest.raises(Exception) as failed:
            entries.pickle_with_refs(value, [], in_band=False)
        reason = filing._uncapturable_reason(value, [], failed.value)
    assert "(the socket at result['fn'].__closure__[0]" in reason, reason
