"""Overmind's side of ``benchmarks/cache.py``: the seed scenario run through Overmind (PyPI ``overmind-cache`` 1.1.2).

This file has two roles. Run by path with the Python of a virtualenv where Overmind is installed (see
``/work/shared/anchors/overmind/install.sh``; that venv has no zerocopy_pickle, so this file needs only the
standard library, torch, diffusers, transformers and overmind)::

    OVERMIND_PY benchmarks/overmind_runner.py info                                # versions, as one JSON line
    OVERMIND_PY benchmarks/overmind_runner.py serve [--daemon|--fork]             # Overmind's server, shimmed
    OVERMIND_PY benchmarks/overmind_runner.py run plain|overmind VARIANT PATHS_JSON DTYPE   # one timed run

and imported by ``benchmarks/cache.py`` (standard library only at import time), which uses :class:`Overmind`
to start the server in the background, run the timed runs as fresh processes, and stop the server by its pid.

``run`` performs exactly the steps of ``zerocopy_pickle.cache.scenario`` (same calls, same arguments, same touch
of one byte per 4 KiB page of every distinct weight) and prints the same JSON line (seconds per step, ``load``,
``touch``, ``total``), so both tables show the rows side by side.

Overmind does not run as published on a CPU-only torch 2.13; ``serve`` applies the two shims it needs and nothing
else: its server's ``main()`` first replaces ``torch._C._cuda_*`` functions with sentinels, and a CPU build lacks
some of them, so the same ``main()`` runs here without that step; and its tensor reducer imports
``torch.multiprocessing.reductions.check_serializing_named_tensor``, which torch 2.13 removed (named tensors are
gone), so a no-op is put there, in the server and in the loader processes it spawns.

Overmind's client starts a missing server itself by running ``overmind-server --daemon`` (``--fork`` on a
terminal) from ``PATH``, then polls for it once a second. For the "first call, no server running" row,
:meth:`Overmind.run_autostart` puts a directory on ``PATH`` whose ``overmind-server`` is this file's ``serve``
(detaching as the real one does, and writing its pid to ``$ZCP_BENCH_OVERMIND_PIDFILE`` so it can be stopped).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).resolve()
STEPS = ("vae", "edge", "depth", "pipeline")
REMOTE_STEP = "remote"
SMALL_STEPS = ("llama", "gpt2", "small-vae")  # zerocopy_pickle.cache.scenario.SMALL_STEPS
PIDFILE_ENV = "ZCP_BENCH_OVERMIND_PIDFILE"


# ---------------------------------------------------------------------------------------------------------
# In the Overmind venv: the shims, the server, one timed run
# ---------------------------------------------------------------------------------------------------------


def _shim_named_tensor_check() -> None:
    """torch 2.13 removed ``check_serializing_named_tensor``; Overmind's tensor reducer still imports it."""
    from torch.multiprocessing import reductions

    if not hasattr(reductions, "check_serializing_named_tensor"):

        def check_serializing_named_tensor(tensor: Any) -> None:  # no named tensors exist in torch 2.13
            return None

        reductions.check_serializing_named_tensor = check_serializing_named_tensor  # type: ignore[attr-defined]


def _detach(pidfile: str | None) -> None:
    """Become a daemon (as ``overmind-server --daemon`` does): double fork, new session; the parent returns."""
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # not the caller's pipes: whoever waits for their end would wait for the server
        os.dup2(devnull, fd)
    if pidfile:
        Path(pidfile).write_text(str(os.getpid()))


def serve(argv: list[str]) -> None:
    """Overmind's ``overmind.server.start()`` and ``main()``, less the CUDA sentinels, plus the reducer shim."""
    import logging
    import multiprocessing
    from multiprocessing.connection import Listener

    from overmind import common, server
    from overmind.utils.log import init as init_log

    common.IN_OVERMIND_SERVER = True
    env = common.OvermindEnv.get()
    if "--daemon" in argv or "--fork" in argv:
        _detach(os.environ.get(PIDFILE_ENV))
        init_log(logging.DEBUG, env.log_path)
    else:
        init_log(logging.DEBUG, None)
    multiprocessing.set_start_method("spawn")
    _shim_named_tensor_check()
    listener = Listener(env.comm_endpoint, authkey=env.venv_hash.encode("utf-8"))
    instance = server.ThreadedServer([server.OvermindService()], listener)
    common.SERVER_INSTANCE = instance
    print(f"overmind server (shimmed) listening, pid {os.getpid()}", flush=True)
    instance.run()


def _touch(modules: list[Any]) -> int:
    """Read one byte of every 4 KiB page of every distinct weight (``zerocopy_pickle.cache.scenario._touch``)."""
    import torch

    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or not storage.nbytes():
                continue
            seen.add(storage.data_ptr())
            data = torch.empty(0, dtype=torch.uint8).set_(storage)
            total += int(data[::4096].max())
    return total


def run_steps(mode: str, variant: str, paths: dict[str, str], dtype_name: str) -> dict[str, Any]:
    """One run, in this process: the scenario's loads and the touch, each timed (after the imports)."""
    import torch

    if mode == "overmind":
        import overmind.api

        overmind.api.monkey_patch_all()
    elif mode != "plain":
        raise SystemExit(f"unknown mode {mode!r}: plain or overmind")
    from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    dtype = getattr(torch, dtype_name)
    times: dict[str, Any] = {}
    if variant == "small":  # zerocopy_pickle.cache.scenario._run_small: three ~1 MB models, loaded as saved
        from transformers import GPT2LMHeadModel, LlamaForCausalLM

        small = []
        for step, load in zip(SMALL_STEPS, (LlamaForCausalLM, GPT2LMHeadModel, AutoencoderKL), strict=True):
            start = time.perf_counter()
            small.append(load.from_pretrained(paths[step]))
            times[step] = time.perf_counter() - start
        return _timed_touch(times, small)
    start = time.perf_counter()
    vae = AutoencoderKL.from_pretrained(paths["pipeline"], subfolder="vae", torch_dtype=dtype)
    times["vae"] = time.perf_counter() - start
    start = time.perf_counter()
    edge = ControlNetModel.from_pretrained(paths["edge"], torch_dtype=dtype)
    times["edge"] = time.perf_counter() - start
    start = time.perf_counter()
    depth = ControlNetModel.from_pretrained(paths["depth"], torch_dtype=dtype)
    times["depth"] = time.perf_counter() - start
    kwargs: dict[str, Any] = {"vae": vae, "safety_checker": None, "torch_dtype": dtype}
    if variant == "wrapper":
        kwargs["controlnet"] = MultiControlNetModel([edge, depth])
    start = time.perf_counter()
    pipe = StableDiffusionControlNetPipeline.from_pretrained(paths["pipeline"], **kwargs)
    times["pipeline"] = time.perf_counter() - start
    modules = [vae, edge, depth, *(c for c in pipe.components.values() if isinstance(c, torch.nn.Module))]
    if variant == "remote":
        from transformers import AutoModel

        start = time.perf_counter()
        modules.append(AutoModel.from_pretrained(paths["remote"], trust_remote_code=True, dtype=dtype))
        times[REMOTE_STEP] = time.perf_counter() - start
    return _timed_touch(times, modules)


def _timed_touch(times: dict[str, Any], modules: list[Any]) -> dict[str, Any]:
    times["load"] = sum(times.values())
    start = time.perf_counter()
    _touch(modules)
    times["touch"] = time.perf_counter() - start
    times["total"] = times["load"] + times["touch"]
    return times


def info() -> dict[str, Any]:
    import diffusers
    import overmind
    import torch
    import transformers

    return {
        "prefix": sys.prefix,
        "python": sys.version.split()[0],
        "overmind": overmind.__version__,  # its _version.py; the sdist's metadata may say 0.0.0
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }


# ---------------------------------------------------------------------------------------------------------
# In the benchmark's process (standard library only): start, run, stop
# ---------------------------------------------------------------------------------------------------------


class OvermindUnavailable(RuntimeError):
    """Overmind cannot be run with the given Python (the reason is the message)."""


def _session_members(sid: int) -> list[int]:
    """Pids of the live processes in session ``sid`` (a detached server and the loaders it spawned)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            members.append(int(entry.name))
    return members


def _stop_session(pid: int, timeout: float = 10.0) -> None:
    """Stop the server ``pid`` (a session leader) and whatever is left of its session, by pid."""
    members = _session_members(pid)
    if pid not in members:
        members.append(pid)
    for member in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _session_members(pid):
        time.sleep(0.05)
    for member in _session_members(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


class Overmind:
    """Overmind, run from the Python of its own virtualenv: availability, its server, timed runs."""

    def __init__(self, python: str) -> None:
        path = Path(python)
        if path.is_dir():  # a venv folder
            path = path / "bin" / "python"
        if not path.exists():
            raise OvermindUnavailable(f"{path} does not exist")
        self.python = str(path)
        proc = subprocess.run([self.python, str(RUNNER), "info"], capture_output=True, text=True, check=False,
                              timeout=300)  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise OvermindUnavailable(f"{self.python} cannot import overmind, torch and diffusers ({tail})")
        self.info: dict[str, Any] = json.loads(lines[-1])
        # Overmind's server listens on an abstract Unix socket named after the venv (common.OvermindEnv).
        digest = base64.b32encode(hashlib.sha1(self.info["prefix"].encode("utf-8")).digest())[:10].decode()
        self._endpoint = f"\0overmind.{digest}"
        self._authkey = digest.encode("utf-8")

    def ping(self) -> bool:
        """Whether an Overmind server of this venv answers."""
        from multiprocessing.connection import Client

        try:
            with Client(self._endpoint, authkey=self._authkey) as conn:
                conn.send(("ping", (), {}))
                return bool(conn.recv() == "pong")
        except (OSError, EOFError):
            return False

    def _refuse_running(self) -> None:
        if self.ping():
            raise OvermindUnavailable(
                "an Overmind server of this venv is already running (its socket "
                f"@{self._endpoint[1:]} answers); stop it first, so that the runs measured here use a fresh one"
            )

    @contextlib.contextmanager
    def server(self, log: Path) -> Any:
        """Overmind's server, shimmed, in the background and answering; stopped (by pid) on exit."""
        self._refuse_running()
        with open(log, "ab") as out:
            proc = subprocess.Popen([self.python, str(RUNNER), "serve"], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=out, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not self.ping():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Overmind's server did not start (see {log})")
                time.sleep(0.1)
            yield proc.pid
        finally:
            _stop_session(proc.pid)
            proc.wait(timeout=30)

    def run(self, mode: str, variant: str, paths: dict[str, str], dtype: str, env: dict[str, str] | None = None
            ) -> dict[str, Any]:  # fmt: skip
        """One timed run, a fresh process of the Overmind venv's Python."""
        proc = subprocess.run(
            [self.python, "-W", "ignore", str(RUNNER), "run", mode, variant, json.dumps(paths), dtype],
            env=env, capture_output=True, text=True, check=False, timeout=900,
        )  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"an Overmind run ({mode}, {variant}) failed:\n{proc.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def run_autostart(self, variant: str, paths: dict[str, str], dtype: str, scratch: Path) -> dict[str, Any]:
        """The first call with no server running: Overmind's client starts ``overmind-server`` itself."""
        self._refuse_running()
        bin_dir = scratch / "bin"
        bin_dir.mkdir(exist_ok=True)
        launcher = bin_dir / "overmind-server"
        launcher.write_text(f'#!/bin/sh\nexec "{self.python}" "{RUNNER}" serve "$@"\n')
        launcher.chmod(0o700)
        pidfile = scratch / "overmind-server.pid"
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PIDFILE_ENV: str(pidfile)}
        try:
            return self.run("overmind", variant, paths, dtype, env=env)
        finally:
            with contextlib.suppress(OSError, ValueError):
                _stop_session(int(pidfile.read_text()))
            pidfile.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["info"]:
        print(json.dumps(info()))
    elif argv[:1] == ["serve"]:
        serve(argv[1:])
    elif argv[:1] == ["run"] and len(argv) == 5:
        import warnings

        warnings.simplefilter("ignore")
        print(json.dumps(run_steps(argv[1], argv[2], json.loads(argv[3]), argv[4])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
elif __name__ == "__mp_main__":  # a loader process Overmind's server spawned: it pickles tensors
    _shim_named_tensor_check()
