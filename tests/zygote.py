"""Client interpreters forked from one that has already imported torch, transformers and diffusers.

The model cache's end-to-end tests run hundreds of short client scripts, each of which imports torch and
transformers or diffusers before its first model load: 7-13 s of CPU per interpreter on the 2-core test machine,
most of the suite's time. A zygote (one per pytest worker, started on first use) imports those libraries once and
forks a child per script; the child runs the script as ``python -c`` would (``__main__``, ``sys.argv``, the
working directory, the environment, stdout and stderr into files, the exit status, ``atexit``), so a script
cannot tell the difference except that those libraries are already in ``sys.modules`` (and their pages are
shared with the zygote).

Not every interpreter may come from here. :func:`usable` sends a script to a fresh interpreter instead when its
environment differs from the zygote's in anything but the library's own ``ZEROCOPY_PICKLE_*`` variables (the
preloaded libraries read theirs at import: ``HF_HOME``, ``TORCH_*``, ...), and a test that checks what an
interpreter imports, or measures its memory, asks for a fresh one (``run_client(..., fresh=True)``).
``ZEROCOPY_PICKLE_TEST_FRESH=1`` sends every script to a fresh interpreter (to compare).

Each script is forked twice: the zygote forks a waiter, which forks the script's process, sends its pid (so the
caller can kill it on a timeout), waits for it and sends its exit status the way :mod:`subprocess` reports it
(negative: killed by that signal). The zygote never waits: it ignores ``SIGCHLD``, so its waiters are reaped by
the kernel, and a waiter restores the default before it forks.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: What the zygote imports before it forks (what the cache tests' client scripts import before their loads).
PRELOAD = (
    "import torch",
    "import transformers.modeling_utils",
    "from transformers import GPT2LMHeadModel",
    "from diffusers import AutoencoderKL, UNet2DConditionModel",
)

#: Variables that may differ from the zygote's: nothing preloaded reads them at import (pytest sets the first for
#: each test; torch sets the second in the pytest process the first time it compiles, and reads it when it does).
READ_LATER = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})

_FRAME = struct.Struct("!I")

_SERVE = r'''
import array, json, os, signal, socket, struct, sys

FRAME = struct.Struct("!I")


def read_exactly(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def run_script(request, out_fd, err_fd):
    """In the script's process: become ``python -c CODE ARGS`` in CWD with ENV, then exit with its status."""
    import atexit, builtins, importlib, threading, traceback, types

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.closerange(3, 1 << 16)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-c", *request["args"]]
    sys.path[0] = ""  # as python -c: the working directory first
    sys.path_importer_cache.pop("", None)
    importlib.invalidate_caches()
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        threading._shutdown()  # the interpreter's own exit: non-daemon threads first, then atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status & 0xFF)


def wait_for_script(conn, request, out_fd, err_fd):
    """In the waiter: fork the script's process, report its pid, then its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        run_script(request, out_fd, err_fd)
    os.close(out_fd)
    os.close(err_fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
    os._exit(0)


def serve(path):
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    parent = os.getppid()
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:
                return  # the pytest worker is gone (it stops the zygote when it exits normally)
            continue
        conn.settimeout(None)
        try:
            fds = array.array("i")
            msg, ancdata, _, _ = conn.recvmsg(FRAME.size, socket.CMSG_LEN(2 * fds.itemsize))
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            (size,) = FRAME.unpack(msg + read_exactly(conn, FRAME.size - len(msg)))
            request = json.loads(read_exactly(conn, size))
            if request.get("op") == "stop":
                return
            out_fd, err_fd = fds
            if os.fork() == 0:
                listener.close()
                wait_for_script(conn, request, out_fd, err_fd)
            os.close(out_fd)
            os.close(err_fd)
        finally:
            conn.close()


for line in sys.argv[2:]:
    exec(line)
serve(sys.argv[1])
'''


def _forced_fresh() -> bool:
    return os.environ.get("ZEROCOPY_PICKLE_TEST_FRESH", "") not in ("", "0")


class Zygote:
    """The zygote of this pytest process: started on first use, stopped at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None
        self._directory = Path(tempfile.mkdtemp(prefix="zcp-zygote-"))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}

    @property
    def socket_path(self) -> Path:
        return self._directory / "zygote.sock"

    def usable(self, env: Mapping[str, str]) -> bool:
        """Whether a script with environment ``env`` may be forked from the zygote: the same environment but for
        the library's own variables and those in :data:`READ_LATER`."""
        if _forced_fresh():
            return False
        keys = {k for k in set(env) | set(self.env) if not k.startswith("ZEROCOPY_PICKLE_")} - READ_LATER
        return all(env.get(k) == self.env.get(k) for k in keys)

    def _ensure_started(self) -> None:
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return
            if self._process is not None:
                raise AssertionError(f"the test zygote exited ({self._process.returncode})")
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(self.socket_path), *PRELOAD],
                env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert self._process.stdout is not None
            line = self._process.stdout.readline()  # after the preloads: "ready", or EOF if it failed
            if line.strip() != "ready":
                self._process.wait()
                raise AssertionError(f"the test zygote did not start ({self._process.returncode})")
            atexit.register(self.stop)

    def run(
        self, code: str, args: tuple[str, ...], env: Mapping[str, str], cwd: str, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run ``python -c code *args`` in a child of the zygote, as :func:`subprocess.run` with
        ``capture_output=True, text=True`` would."""
        self._ensure_started()
        request = json.dumps({"code": code, "args": list(args), "env": dict(env), "cwd": str(cwd)}).encode()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(str(self.socket_path))
                fds = array.array("i", [out.fileno(), err.fileno()])
                conn.sendmsg([_FRAME.pack(len(request))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                conn.sendall(request)
                replies = conn.makefile("rb")
                started = replies.readline()
                if not started:
                    raise AssertionError("the test zygote did not start the script")
                pid = json.loads(started)["pid"]
                conn.settimeout(timeout)
                try:
                    finished = replies.readline()
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                    raise subprocess.TimeoutExpired(["python", "-c", code, *args], timeout) from None
                if not finished:
                    raise AssertionError("the test zygote's waiter ended without the script's status")
                returncode = json.loads(finished)["returncode"]
            out.seek(0)
            err.seek(0)
            # As text=True decodes: universal newlines.
            stdout = out.read().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            stderr = err.read().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        return subprocess.CompletedProcess(["python", "-c", code, *args], returncode, stdout, stderr)

    def stop(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket_path))
            request = json.dumps({"op": "stop"}).encode()
            fds = array.array("i", [0, 0])
            conn.sendmsg([_FRAME.pack(len(request))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            conn.sendall(request)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
            self._directory.rmdir()


ZYGOTE = Zygote()
