"""The test zygote's children behave as ``python -c`` interpreters (tests/zygote.py), but for what is preloaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .cache_helpers import wait_until
from .conftest import REPO
from .zygote import ZYGOTE


def both(code: str, *args: str, cwd: Path = REPO, timeout: float = 120, **extra: str) -> tuple[object, object]:
    """``code`` run by a fresh interpreter and by a child of the zygote, in the same environment."""
    env = {**ZYGOTE.env, **extra}
    code = textwrap.dedent(code)
    fresh = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    forked = ZYGOTE.run(code, args, env, str(cwd), timeout)
    return fresh, forked


def test_a_child_has_the_libraries_preloaded_and_a_fresh_interpreter_does_not() -> None:
    fresh, forked = both("import sys; print('diffusers' in sys.modules, 'transformers' in sys.modules)")
    assert fresh.stdout == "False False\n" and forked.stdout == "True True\n"


def test_argv_cwd_environment_and_main_are_those_of_python_c(tmp_path: Path) -> None:
    (tmp_path / "local_module.py").write_text("VALUE = 7\n")
    code = """
    import os, pickle, sys
    import local_module  # the working directory is first on sys.path, as for python -c
    class Here:  # defined in __main__: pickles by reference to it
        pass
    print(sys.argv, os.getcwd(), os.environ["ZEROCOPY_PICKLE_PROBE"], local_module.VALUE, __name__)
    print(type(pickle.loads(pickle.dumps(Here()))).__module__, sys.stdin.read() == "")
    """
    fresh, forked = both(code, "a b", "c", cwd=tmp_path, ZEROCOPY_PICKLE_PROBE="yes")
    assert fresh.returncode == forked.returncode == 0, (fresh.stderr, forked.stderr)
    assert forked.stdout == fresh.stdout == f"['-c', 'a b', 'c'] {tmp_path} yes 7 __main__\n__main__ True\n"


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("pass", 0),
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit('a message')", 1),
        ("raise ValueError('boom')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
        ("import os; os._exit(5)", 5),
    ],
)
def test_the_exit_status_and_the_error_output_are_those_of_python_c(code: str, status: int) -> None:
    fresh, forked = both(code)
    assert fresh.returncode == forked.returncode == status
    assert fresh.stdout == forked.stdout
    if "message" in code:
        assert fresh.stderr == forked.stderr == "a message\n"
    if "boom" in code:
        assert fresh.stderr.splitlines()[-1] == forked.stderr.splitlines()[-1] == "ValueError: boom"


def test_non_daemon_threads_are_joined_then_atexit_runs_and_output_is_flushed() -> None:
    code = """
    import atexit, sys, threading, time
    atexit.register(lambda: print("atexit", flush=True))
    done = threading.Event()
    def late():
        done.wait()
        print("thread")
    threading.Thread(target=late).start()
    sys.stdout.write("unflushed ")
    done.set()
    """
    fresh, forked = both(code)
    assert fresh.stdout == forked.stdout == "unflushed thread\natexit\n"


def test_a_script_past_its_timeout_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    with pytest.raises(subprocess.TimeoutExpired):
        ZYGOTE.run(code, (str(pid_file),), ZYGOTE.env, str(REPO), timeout=5)
    # Its pid, if it got as far as writing it before the kill (it had seconds; a fork takes milliseconds).
    pid = int(pid_file.read_text() or 0) if pid_file.exists() else 0

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True  # killed and reaped by its waiter
        return False

    if pid:
        wait_until(gone, "the script to be killed")
    assert ZYGOTE.run("print('next')", (), ZYGOTE.env, str(REPO), 120).stdout == "next\n"  # the zygote serves on


def test_a_script_may_not_come_from_the_zygote_when_the_environment_differs_beyond_the_library_s_variables() -> None:
    env = dict(ZYGOTE.env)
    if not os.environ.get("ZEROCOPY_PICKLE_TEST_FRESH"):
        assert ZYGOTE.usable(env)
        assert ZYGOTE.usable({**env, "ZEROCOPY_PICKLE_CACHE_DIR": "/elsewhere", "PYTEST_CURRENT_TEST": "x"})
    assert not ZYGOTE.usable({**env, "HF_HOME": "/elsewhere"})  # read by huggingface_hub at import
    assert not ZYGOTE.usable({k: v for k, v in env.items() if k != "PYTHONPATH"})
