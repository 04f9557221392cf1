"""``ZEROCOPY_PICKLE_CACHE_FILL=background``: a miss is loaded in the caller, as the plain call does, and the
server's loader loads the same call for the next process at the lowest CPU priority; the caller neither forks nor
captures. With no server running, the caller starts one and hands it the miss over a socket; a call the loader
cannot load falls back to the caller's own filing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerocopy_pickle.cache.client import Client
from zerocopy_pickle.cache.protocol import FILL_NICE_ENV, fill_nice

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

BACKGROUND = {"ZEROCOPY_PICKLE_CACHE_FILL": "background"}
# The fills these tests wait for run at nice 0: at the default nice 19, beside the parallel suite's CPU-bound
# workers (or any busy neighbour) a fill gets about 1% of a core and may take longer than any bound a test could
# set. test_a_background_fill_runs_at_the_lowest_priority_unless_told_otherwise checks the default without waiting
# for a fill.
UNSTARVED = {FILL_NICE_ENV: "0"}

CLIENT = """
import json, os, sys
import torch
from zerocopy_pickle import cache
from zerocopy_pickle.cache import client, protocol
forks = []
os.register_at_fork(before=lambda: forks.append(1))
cache.patch_all(autostart=sys.argv[2] == "autostart")
from transformers import GPT2LMHeadModel
if sys.argv[3] == "local":  # a class the server's loader cannot import: its background fill fails
    class LocalGPT2(GPT2LMHeadModel):
        pass
    GPT2LMHeadModel = LocalGPT2
model = GPT2LMHeadModel.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
client._filer.drain()
if sys.argv[3] == "linger":  # a process that runs on: it starts the server SPAWN_DELAY after its miss, not at exit
    import time
    deadline = time.monotonic() + 120
    while not protocol.runtime_dir().joinpath("server.sock").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
print(json.dumps({"sum": float(logits.double().sum()), "key": cache.cached_key(model), "forks": len(forks),
                  "cls": type(model).__name__}))
"""


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_gpt2(tmp_path_factory.mktemp("background") / "gpt2")


@pytest.fixture(scope="module")
def plain_sum(gpt2: str) -> float:
    return gpt2_logits_sum(gpt2)


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with running_server(env=UNSTARVED) as process:
        yield process


def _settled(status: dict[str, object], entries: int) -> bool:
    listed = status["entries"]
    assert isinstance(listed, list)
    return status["filling"] == 0 and len(listed) == entries


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _loader_nice(server: ServerProcess) -> int | None:
    pid = server.status()["loader_pid"]
    return _nice(pid) if isinstance(pid, int) else None


def test_a_miss_is_loaded_by_the_server_in_the_background_and_the_caller_files_nothing(
    server: ServerProcess, gpt2: str, plain_sum: float
) -> None:
    first = run_client(server, CLIENT, gpt2, "no-autostart", "keep", **BACKGROUND)
    assert first["sum"] == plain_sum and first["key"] is not None
    assert first["forks"] == 0  # no filing child: the caller paid the key and one round trip
    wait_until(lambda: _settled(server.status(), 1), "the background fill")
    status = server.status()
    assert (status["hits"], status["misses"]) == (0, 1)
    (entry,) = status["entries"]
    assert entry["key"] == first["key"] and "server" in entry["timings"]  # the loader's load, not a put
    assert status["loader_pid"] is not None and _nice(status["loader_pid"]) == 0  # as FILL_NICE_ENV says
    second = run_client(server, CLIENT, gpt2, "no-autostart", "keep", **BACKGROUND)
    assert second["sum"] == plain_sum and second["key"] == first["key"] and second["forks"] == 0
    assert server.status()["hits"] == 1


@pytest.mark.parametrize("when", ["keep", "linger"])  # the server started at the process's exit, or while it runs
def test_the_first_call_with_no_server_hands_its_miss_to_the_server_it_starts(
    gpt2: str, plain_sum: float, when: str
) -> None:
    with private_dir() as directory:
        env = {"ZEROCOPY_PICKLE_CACHE_DIR": str(directory), "PYTHONPATH": str(REPO), **BACKGROUND, **UNSTARVED}
        first = json.loads(
            run_python(CLIENT, gpt2, "autostart", when, env=env, preloaded=True).stdout.strip().splitlines()[-1]
        )
        try:
            assert first["sum"] == plain_sum and first["forks"] == 0

            def status() -> dict[str, object]:
                with Client(directory / "server.sock", timeout=30) as client:
                    return dict(client.request({"op": "status"})[0]["status"])

            wait_until((directory / "server.sock").exists, "the server the first call started")
            wait_until(lambda: _settled(status(), 1), "the fill the first call handed over")
            second = json.loads(
                run_python(CLIENT, gpt2, "autostart", "keep", env=env, preloaded=True).stdout.strip().splitlines()[-1]
            )
            assert second["sum"] == plain_sum and second["key"] == first["key"]
            assert status()["hits"] == 1
        finally:
            with Client(directory / "server.sock", timeout=30) as client:
                client.request({"op": "stop"})


def test_a_background_fill_runs_at_the_lowest_priority_unless_told_otherwise(
    gpt2: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader a background fill starts runs at nice 19 by default, at FILL_NICE_ENV's value where it is set.
    Nothing here waits for the fill itself (at nice 19 beside busy neighbours it may take minutes): only for the
    server (nice 0) to start the loader."""
    monkeypatch.delenv(FILL_NICE_ENV, raising=False)
    assert fill_nice() == 19
    for value, expected in (("7", 7), ("20", 19), ("-1", 19), ("low", 19)):
        monkeypatch.setenv(FILL_NICE_ENV, value)
        assert fill_nice() == expected
    monkeypatch.delenv(FILL_NICE_ENV)
    for env, expected in (({}, 19), ({FILL_NICE_ENV: "7"}, 7)):
        with running_server("--fill-delay", "0", "0", env=env) as server:
            run_client(server, CLIENT, gpt2, "no-autostart", "keep", **BACKGROUND)
            # Its first statement sets its priority: between its start and that statement it runs at the server's.
            wait_until(
                lambda server=server, expected=expected: _loader_nice(server) == expected,
                f"the fill's loader at nice {expected}",
            )


def test_a_call_the_server_cannot_load_is_filed_by_the_next_caller_itself(
    server: ServerProcess, gpt2: str, plain_sum: float
) -> None:
    first = run_client(server, CLIENT, gpt2, "no-autostart", "local", **BACKGROUND)
    assert first["sum"] == plain_sum and first["cls"] == "LocalGPT2" and first["forks"] == 0
    wait_until(lambda: server.status()["filling"] == 0, "the background fill to fail")
    assert server.status()["entries"] == []  # the loader cannot import a class of the caller's __main__
    assert "in the background failed" in server.read_log()
    second = run_client(server, CLIENT, gpt2, "no-autostart", "local", **BACKGROUND)
    assert second["sum"] == plain_sum and second["forks"] >= 1  # told to file its own result: it forked
    wait_until(lambda: _settled(server.status(), 1), "the second caller's filing")
    third = run_client(server, CLIENT, gpt2, "no-autostart", "local", **BACKGROUND)
    assert third["sum"] == plain_sum and third["cls"] == "LocalGPT2" and third["key"] == first["key"]
    assert server.status()["hits"] == 1


def test_a_background_fill_waits_until_no_call_has_come_for_the_quiet_period_or_the_longest_wait(
    gpt2: str, plain_sum: float
) -> None:
    # A quiet period and a longest wait of an hour: the caller has returned and exited, the fill still waits
    # (it would compete with the caller's next loads); the loader was not even started.
    with running_server("--fill-delay", "3600", "3600", env=UNSTARVED) as server:
        first = run_client(server, CLIENT, gpt2, "no-autostart", "keep", **BACKGROUND)
        assert first["sum"] == plain_sum and first["forks"] == 0
        status = server.status()
        assert (status["filling"], status["entries"], status["loader_pid"]) == (1, [], None)
        again = run_client(server, CLIENT, gpt2, "no-autostart", "keep", **BACKGROUND)  # claimed: not filed twice
        assert again["sum"] == plain_sum and again["forks"] == 0 and server.status()["filling"] == 1
    # However busy the server is with calls, a fill starts at its longest wait (here at once).
    with running_server("--fill-delay", "3600", "0", env=UNSTARVED) as server:
        first = run_client(server, CLIENT, gpt2, "no-autostart", "keep", **BACKGROUND)
        wait_until(lambda: _settled(server.status(), 1), "the background fill at its longest wait")
        second = run_client(server, CLIENT, gpt2, "no-autostart", "keep", **BACKGROUND)
        assert second["sum"] == plain_sum and second["key"] == first["key"] and server.status()["hits"] == 1
