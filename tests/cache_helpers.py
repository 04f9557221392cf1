"""Helpers for the model-cache tests: a server in a private temporary directory, tiny models, client scripts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .conftest import REPO, run_python


class ServerProcess:
    """``zerocopy-pickle serve`` in its own private directory."""

    def __init__(self, directory: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.env = {"ZEROCOPY_PICKLE_CACHE_DIR": str(directory), "PYTHONPATH": str(REPO), **(env or {})}
        self.log = open(directory.parent / f"{directory.name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "zerocopy_pickle.cache", "serve", *args],
            env={**os.environ, **self.env},
            stdout=self.log,
            stderr=self.log,
            cwd=REPO,
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited: {self.read_log()}")
            with contextlib.suppress(Exception):
                self.request("ping")
                return
            time.sleep(0.1)
        raise AssertionError(f"the server did not start: {self.read_log()}")

    def request(self, op: str) -> dict[str, Any]:
        from zerocopy_pickle.cache.client import Client

        with Client(self.directory / "server.sock", timeout=30) as client:
            reply, _, fds = client.request({"op": op})
        for fd in fds:
            os.close(fd)
        return reply

    def status(self) -> dict[str, Any]:
        return dict(self.request("status")["status"])

    @property
    def pid(self) -> int:
        return self.process.pid

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def fd_targets(self) -> list[str]:
        """What each of the server's open fds refers to (``/memfd:NAME (deleted)`` for a memfd)."""
        targets = []
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # closed while we looked
                targets.append(os.readlink(f"/proc/{self.pid}/fd/{fd}"))
        return targets

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def read_log(self) -> str:
        self.log.flush()
        return (self.directory.parent / f"{self.directory.name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


@contextlib.contextmanager
def private_dir() -> Iterator[Path]:
    """A short private directory (Unix socket paths are limited to 107 bytes)."""
    parent = Path(tempfile.mkdtemp(prefix="zcp-"))
    directory = parent / "cache"
    directory.mkdir(mode=0o700)
    try:
        yield directory
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A server (``zerocopy-pickle serve *args``, with the variables ``env`` added to its environment and its
    clients') in a private directory, stopped at the end."""
    with private_dir() as directory:
        process = ServerProcess(directory, *args, env=env)
        try:
            yield process
        finally:
            process.stop()


def run_client(
    server: ServerProcess,
    code: str,
    *args: str,
    check: bool = True,
    cwd: Path | None = None,
    fresh: bool = False,
    **env: str,
) -> dict[str, Any]:
    """Run a client script (it prints one JSON object as its last line) against ``server``, in ``cwd`` (default:
    the repository), with the variables ``env`` added to the server's: in a child of the test zygote, with torch,
    transformers and diffusers already imported (``tests/zygote.py``), or with ``fresh=True`` in a fresh
    interpreter (for a script that checks what it imports or measures its memory)."""
    proc = run_python(
        code, *args, env={**server.env, **env}, check=check, preloaded=not fresh, **({"cwd": cwd} if cwd else {})
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"the client printed no result:\n{proc.stdout}\n{proc.stderr}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["stderr"] = proc.stderr
    return result


def build_gpt2(directory: Path, seed: int = 0) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=1))
    model.save_pretrained(directory)
    return str(directory)


def gpt2_logits_sum(path: str) -> float:
    """The sum of the logits of the GPT-2 at ``path`` on a fixed prompt, loaded plainly (what a cached load of it
    must reproduce bit for bit: the client scripts print the same sum)."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        return float(GPT2LMHeadModel.from_pretrained(path)(torch.tensor([[1, 2, 3, 4]])).logits.double().sum())


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll ``condition`` until it holds. ``timeout`` only bounds a hang (it fails the test); it never paces one."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout:.0f} s for {what}")
        time.sleep(0.02)


# Loaders the tests route through the cache as patch points ("tests.cache_helpers:gated_load").


def gated_load(path: str, gate: str) -> dict[str, Any]:
    """Loads a torch.save file. In the cache's loader it first creates ``gate/entered`` and waits for
    ``gate/release``, so that a test acts (kills the server) while the loader is known to be working on the miss;
    anywhere else (a client loading directly) it loads at once. The loader's wait is bounded only so that a
    forgotten child ends."""
    import torch

    if os.environ.get("ZEROCOPY_PICKLE_CACHE_LOADER"):
        Path(gate, "entered").touch()
        wait_until(Path(gate, "release").exists, "the test to release the loader", timeout=600)
    return {"state": torch.load(path, weights_only=True), "path": path}


def crash_in_loader(path: str) -> dict[str, Any]:
    """Kills the process that runs it when that is the cache's loader; loads normally elsewhere."""
    import torch

    if os.environ.get("ZEROCOPY_PICKLE_CACHE_LOADER"):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"state": torch.load(path, weights_only=True)}


def where_am_i(path: str) -> dict[str, Any]:
    """Reads ``path`` (maybe relative) and says where the process running it looks for modules and files."""
    import torch

    return {"sys_path": list(sys.path), "cwd": os.getcwd(), "state": torch.load(path, weights_only=True)}


def scripted_module(seed: int) -> Any:
    """A TorchScript module (``torch.jit.script`` of a small network), made with ``seed``."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x)) * 2

    torch.manual_seed(seed)
    return torch.jit.script(Net().eval())


@dataclasses.dataclass
class StableFastRequest:
    x: Any
    bias: Any


@dataclasses.dataclass
class StableFastResult:
    y: Any
    total: Any


def stable_fast_request() -> StableFastRequest:
    import torch

    return StableFastRequest(torch.linspace(-1, 1, 8).reshape(2, 4), torch.arange(3.0))


def stable_fast_module(seed: int) -> Any:
    """What stable-fast's compilers make on CPU: a traced module (its TracedPosArgOnlyModuleWrapper) that takes and
    returns dataclasses."""
    import torch
    from sfast.jit import trace_helper
    from zerocopy_pickle_quirks import stable_fast

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, request: StableFastRequest) -> StableFastResult:
            y = self.linear(request.x) + request.bias
            return StableFastResult(y=y, total=y.sum())

    stable_fast.ensure_patched()  # before tracing, as any process that traces modules to dump them must
    torch.manual_seed(seed)
    traced, call_helper = trace_helper.trace_with_kwargs(
        Model().eval(), (stable_fast_request(),), check_trace=False, strict=False
    )
    return call_helper(traced)


def unpicklable_load(path: str) -> dict[str, Any]:
    """Loads a torch.save file into a result that cannot be pickled (a suspended generator, at
    ``result['handle'].pending``), as a loader whose result holds a live iterator; the cache cannot capture it."""
    import types

    import torch

    pending = (n for n in range(3))
    return {"state": torch.load(path, weights_only=True), "handle": types.SimpleNamespace(pending=pending)}
