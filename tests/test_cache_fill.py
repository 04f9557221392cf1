"""Misses load in the caller, as the plain call does: the first call with no server running, a miss with
one running, what the caller changes afterwards, and the server's checks on what a client files (a ``put``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.internals import arena
from zerocopy_pickle.cache import protocol
from zerocopy_pickle.cache.client import Client
from zerocopy_pickle.cache.fields import BufferRow, Call
from zerocopy_pickle.cache.jobs import JobResult
from zerocopy_pickle.cache.messages import Get, Put

from .cache_helpers import (
    ServerProcess,
    build_gpt2,
    gpt2_logits_sum,
    private_dir,
    run_client,
    running_server,
    wait_until,
)
from .conftest import REPO, run_python

pytestmark = pytest.mark.slow

CLIENT = """
import json, os, sys, warnings
warnings.simplefilter("always")
import torch
from zerocopy_pickle import cache
from zerocopy_pickle.cache import client
if sys.argv[4] == "thread":  # as where CUDA is initialized: captured in the calling thread, sent by another
    client._fork_is_safe = lambda: False
cache.patch_all(autostart=sys.argv[2] == "autostart")
from transformers import GPT2LMHeadModel
model = GPT2LMHeadModel.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
if sys.argv[3] == "change":  # what a user may do right after loading: change the weights in place
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
client._filer.drain()
import gc, time
deadline = time.monotonic() + 60  # the reaper thread thaws the heap once it has waited for the filing child
while gc.get_freeze_count() and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"sum": float(logits.double().sum()), "key": cache.cached_key(model), "pid": os.getpid(),
                  "frozen": gc.get_freeze_count()}))
"""


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_gpt2(tmp_path_factory.mktemp("fill") / "gpt2")


@pytest.fixture(scope="module")
def plain_sum(gpt2: str) -> float:
    return gpt2_logits_sum(gpt2)


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with running_server() as process:
        yield process


@pytest.mark.parametrize("how", ["fork", "thread"])
def test_first_call_with_no_server_loads_here_and_fills_the_cache(gpt2: str, plain_sum: float, how: str) -> None:
    with private_dir() as directory:
        env = {"ZEROCOPY_PICKLE_CACHE_DIR": str(directory), "PYTHONPATH": str(REPO)}
        first = run_python(CLIENT, gpt2, "autostart", "keep", how, env=env, preloaded=True)
        try:
            result = json.loads(first.stdout.strip().splitlines()[-1])
            assert result["sum"] == plain_sum
            assert "CacheWarning" not in first.stderr, first.stderr
            # The server the call started came up while the caller loaded, and got the caller's result before the
            # caller exited; its loader was never needed.
            with Client(directory / "server.sock", timeout=30) as client:
                status = client.request({"op": "status"})[0]["status"]
            assert (status["hits"], status["misses"], len(status["entries"])) == (0, 0, 1)
            assert status["loader_pid"] is None
            second = run_python(CLIENT, gpt2, "autostart", "keep", how, env=env, preloaded=True)
            second = json.loads(second.stdout.strip().splitlines()[-1])
            assert second["sum"] == plain_sum and second["key"] == result["key"]
            with Client(directory / "server.sock", timeout=30) as client:
                status = client.request({"op": "status"})[0]["status"]
            assert (status["hits"], len(status["entries"])) == (1, 1)
        finally:
            with Client(directory / "server.sock", timeout=30) as client:
                client.request({"op": "stop"})


@pytest.mark.parametrize("how", ["fork", "thread"])
def test_a_miss_loads_in_the_caller_and_the_next_process_hits(
    server: ServerProcess, gpt2: str, plain_sum: float, how: str
) -> None:
    first = run_client(server, CLIENT, gpt2, "no-autostart", "keep", how)
    assert first["sum"] == plain_sum and first["key"] is not None
    assert first["frozen"] == 0  # the heap frozen for the filing child was thawed once it was gone
    status = server.status()
    assert (status["hits"], status["misses"], len(status["entries"])) == (0, 1, 1)
    assert status["loader_pid"] is None  # no zygote was started for it
    second = run_client(server, CLIENT, gpt2, "no-autostart", "keep", how)
    assert second["sum"] == plain_sum and second["key"] == first["key"]
    assert server.status()["hits"] == 1


@pytest.mark.parametrize("how", ["fork", "thread"])
def test_what_the_caller_changes_after_the_call_stays_out_of_the_entry(
    server: ServerProcess, gpt2: str, plain_sum: float, how: str
) -> None:
    changed = run_client(server, CLIENT, gpt2, "no-autostart", "change", how)
    assert changed["sum"] == plain_sum  # computed before the change
    hit = run_client(server, CLIENT, gpt2, "no-autostart", "keep", how)
    assert server.status()["hits"] == 1
    assert hit["sum"] == plain_sum  # the weights as loaded, not as the first process changed them


def _put(key: str, refs: list[str], rows: list[BufferRow], new_segment: bool, files: int = 0) -> Put:
    return Put(Get(key, Call("tests.cache_helpers:where_am_i", None, refs), "a test put"),
               JobResult(rows, [], [], {}, new_segment, files), 0)  # fmt: skip


def _request(server: ServerProcess, put: Put, payload: bytes, fds: list[int]) -> dict[str, Any]:
    with Client(server.directory / "server.sock", timeout=30) as client:
        try:
            return client.request(put, payload, fds=fds)[0]
        except protocol.CacheError as e:
            return {"ok": False, "error": str(e)}


def _memfd(data: bytes, *, sealed: bool, name: str = "test-put") -> int:
    fd = arena.create_memfd(name)
    os.write(fd, data)
    if sealed:
        arena.seal(fd)
    return fd


def _stream() -> bytes:
    import pickle

    return pickle.dumps({"x": 1}, protocol=5)


def test_the_server_checks_what_a_client_files(server: ServerProcess) -> None:
    rows = [BufferRow(0, 0, 8, "cpu", None, "new")]
    fd = _memfd(b"\0" * 8, sealed=False)
    try:
        reply = _request(server, _put("k-unsealed", [], rows, True), _stream(), [fd])
    finally:
        os.close(fd)
    assert not reply["ok"] and "not sealed" in reply["error"]

    fd = _memfd(b"\0" * 8, sealed=True)
    try:
        reply = _request(server, _put("k-refs", ["no-such-entry"], rows, True), _stream(), [fd])
        assert not reply["ok"] and "not in the cache" in reply["error"]
        # A row that names a file that was not sent; a header that declares more fds than arrived.
        bad_rows = [BufferRow(3, 0, 8, "cpu", None, "file")]
        reply = _request(server, _put("k-file", [], bad_rows, False, files=1), _stream(), [fd])
        assert not reply["ok"] and "malformed" in reply["error"] and "did not send" in reply["error"]
        reply = _request(server, _put("k-count", [], rows, True, files=2), _stream(), [fd])
        assert not reply["ok"] and "malformed" in reply["error"]
        # Only a put may carry fds.
        with (
            Client(server.directory / "server.sock", timeout=30) as client,
            pytest.raises(protocol.CacheError, match="a .status. message may carry at most 0"),
        ):
            client.request({"op": "status"}, fds=[fd])
    finally:
        os.close(fd)
    assert server.status()["entries"] == []
    # Every memfd the refused puts sent is closed (by name: a count taken at the start could include a
    # connection the server was still closing).
    wait_until(
        lambda: not any("test-put" in target for target in server.fd_targets()),
        "the server to close every fd of the refused puts",
    )

    # A valid put is filed; a second put for the same key keeps the first entry and closes its own memfd.
    for data, name in ((b"\1" * 8, "test-put-first"), (b"\2" * 8, "test-put-duplicate")):
        fd = _memfd(data, sealed=True, name=name)
        try:
            assert _request(server, _put("k-good", [], rows, True), _stream(), [fd])["ok"]
        finally:
            os.close(fd)
    assert [e["key"] for e in server.status()["entries"]] == ["k-good"]
    wait_until(
        lambda: not any("test-put-duplicate" in target for target in server.fd_targets()),
        "the server to close the duplicate put's memfd",
    )
    with Client(server.directory / "server.sock", timeout=30) as client:
        get = Get("k-good", Call("tests.cache_helpers:where_am_i"), fill=True)
        reply, stream, fds = client.request(get)
    try:
        assert reply["hit"] and stream == _stream() and len(fds) == 1
        assert os.pread(fds[0], 8, 0) == b"\1" * 8
    finally:
        for fd in fds:
            os.close(fd)
    # A miss with fill is answered at once: the client is to load it.
    with Client(server.directory / "server.sock", timeout=30) as client:
        reply, _, fds = client.request(Get("k-other", Call("tests.cache_helpers:where_am_i"), fill=True))
    assert reply == {"ok": True, "miss": True, "files": True, "uncacheable": None} and fds == []


def test_a_call_that_raises_raises_in_the_caller_and_files_nothing(server: ServerProcess, tmp_path: Path) -> None:
    code = """
import json, sys, warnings
warnings.simplefilter("always")
import torch
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
try:
    torch.load(sys.argv[1])
except FileNotFoundError as e:
    print(json.dumps({"raised": type(e).__name__}))
"""
    result = run_client(server, code, str(tmp_path / "missing.pt"))
    assert result["raised"] == "FileNotFoundError"
    assert "CacheWarning" not in result["stderr"], result["stderr"]
    status = server.status()
    assert (status["misses"], status["entries"]) == (1, [])
