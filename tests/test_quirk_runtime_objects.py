"""The runtime-objects quirk: locks, thread locals and events rebuilt fresh; files, sockets, generators and
threads refused with a DumpError that names their path, under every backend."""

from __future__ import annotations

import asyncio
import io
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from zerocopy_pickle_quirks import runtime_objects

import zerocopy_pickle as zp
from zerocopy_pickle.plugin import default_registry
from zerocopy_pickle.testing import ReducerConformance
from zerocopy_pickle.testing import assert_same as assert_same_graph

from .conftest import REPO
from .hostile_streams import naming

BACKENDS = ("pickle", "auto", "cloudpickle", "dill")


# -- models holding runtime objects (importable: they pickle by reference) ---------------------------------------


class CountingLocal(threading.local):
    """A thread-local subclass whose __init__ runs again in each thread that uses it."""

    def __init__(self) -> None:
        self.calls = 0


class NeedsArgsLocal(threading.local):
    def __init__(self, size: int) -> None:
        self.buffer = [0] * size


class TaggedEvent(threading.Event):
    """A subclass with an attribute of its own, which must survive."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag


class Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Linear(4, 4)
        self.lock = threading.Lock()
        self.rlock = threading.RLock()
        self.local = threading.local()
        self.local.scratch = torch.ones(3)  # per thread: dropped
        self.ready = threading.Condition(self.lock)  # shares self.lock
        self.loaded = threading.Event()
        self.loaded.set()
        self.stop = threading.Event()
        self.counter = CountingLocal()
        self.tagged = TaggedEvent("warm")
        self.slots = threading.BoundedSemaphore(4)
        self.slots.acquire()
        self.tokens = threading.Semaphore(2)
        self.barrier = threading.Barrier(3, timeout=5.0)
        self.pending: queue.Queue[int] = queue.Queue()
        self.pending.put(7)
        self.log = sys.stderr
        self.cache_file: Any = None


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), Cache())
        self.cache = self.layers[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.cache.lock, self.cache.rlock:
            return self.cache.table(self.layers[:2](x))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = torch.nn.Linear(4, 2)
        self.head_lock = threading.RLock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.head_lock:
            return self.head(self.encoder(x))


MODEL_CLASSES = [Model, Encoder, Cache, CountingLocal, TaggedEvent, torch.nn.Linear, torch.nn.ReLU, torch.nn.Sequential]


@pytest.fixture
def model() -> Model:
    torch.manual_seed(0)
    return Model().eval()


def check_rebuilt(original: Model, loaded: Model, log: object = sys.stderr) -> None:
    """What the quirk promises for each runtime object of a loaded Model (``log``: what Cache.log was dumped as)."""
    cache, old = loaded.encoder.cache, original.encoder.cache
    assert cache is loaded.encoder.layers[2]
    assert type(cache.lock) is type(threading.Lock())
    assert type(cache.rlock) is type(loaded.head_lock) is type(threading.RLock())
    for lock in (cache.lock, cache.rlock, loaded.head_lock):
        assert lock.acquire(blocking=False)  # released, and it works
        lock.release()
    assert cache.ready._lock is cache.lock  # the condition still shares the lock
    with cache.ready:
        assert not cache.ready.wait(timeout=0.01)
        cache.ready.notify_all()
    assert type(cache.local) is threading.local
    assert not hasattr(cache.local, "scratch")  # thread-local attributes are dropped
    assert cache.loaded.is_set()
    assert not cache.stop.is_set()  # an Event's flag is preserved
    assert type(cache.counter) is CountingLocal and cache.counter.calls == 0
    assert type(cache.tagged) is TaggedEvent and cache.tagged.tag == "warm" and not cache.tagged.is_set()
    assert cache.slots._value == 4  # a BoundedSemaphore comes back full
    assert cache.tokens._value == old.tokens._value == 2
    assert cache.barrier.parties == 3 and cache.barrier.n_waiting == 0 and not cache.barrier.broken
    assert cache.pending.get_nowait() == 7
    assert cache.pending.not_empty._lock is cache.pending.mutex
    assert cache.log is log


# -- round trips -----------------------------------------------------------------------------------------------


def test_plugin_is_discovered() -> None:
    info = default_registry().plugins()["runtime-objects"]
    assert info.state == "loaded", info.error
    registered = zp.reducers()
    for target in ("_thread:lock", "_thread:RLock", "_thread:_local", "threading:Condition", "threading:Event"):
        assert registered[target].plugin == "runtime-objects"


def test_type_names_match_this_python() -> None:
    # The registrations are by name, never importing anything: the names must be the real ones.
    from zerocopy_pickle.plugin import type_key

    live = [
        threading.Lock(),
        threading.RLock(),
        threading.local(),
        threading.Condition(),
        threading.Event(),
        threading.Semaphore(),
        threading.BoundedSemaphore(),
        threading.Barrier(1),
    ]
    assert {type_key(type(obj)) for obj in live} <= set(runtime_objects.REBUILT)
    refused = [io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair]
    refused += [io.TextIOWrapper, socket.socket.__mro__[1], threading.Thread]
    assert {type_key(cls) for cls in refused} <= set(runtime_objects.REFUSED)


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_rebuilds_runtime_objects(model: Model, backend: str) -> None:
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = model(x)
    model.encoder.cache.lock.acquire()  # held at dump time: comes back released
    model.head_lock.acquire()
    data = zp.dumps(model, backend=backend)
    assert [p.name for p in zp.read_header(data).plugins] == ["runtime-objects"]
    loaded = zp.loads(data, trusted=True)
    check_rebuilt(model, loaded)
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)


STANDARD_STREAM = ("zerocopy_pickle_quirks.runtime_objects", "rebuild_standard_stream")


def test_restricted_load_needs_only_the_model_classes(model: Model) -> None:
    data = zp.dumps(model)
    allow: list[Any] = [*MODEL_CLASSES, queue.Queue, "collections:deque"]
    with pytest.raises(zp.RestrictedLoadError) as refused:  # Cache.log is sys.stderr: never in restricted loads
        zp.loads(data, allow=allow)
    assert refused.value.needed == (STANDARD_STREAM,)
    model.encoder.cache.log = None
    loaded = zp.loads(zp.dumps(model), allow=allow)
    check_rebuilt(model, loaded, log=None)


def test_held_rlock_comes_back_usable_from_another_thread(model: Model) -> None:
    model.head_lock.acquire()
    loaded = zp.loads(zp.dumps(model), trusted=True)
    got: list[bool] = []
    worker = threading.Thread(target=lambda: got.append(loaded.head_lock.acquire(timeout=5)))
    worker.start()
    worker.join()
    assert got == [True]


def test_shared_locks_stay_shared() -> None:
    lock = threading.Lock()
    graph = {"a": lock, "b": [lock], "cond": threading.Condition(lock), "event": threading.Event()}
    loaded = zp.loads(zp.dumps(graph))
    assert loaded["a"] is loaded["b"][0] is loaded["cond"]._lock
    with loaded["cond"]:
        assert loaded["a"].locked()
    assert not loaded["a"].locked()


def test_thread_local_subclass_runs_init_per_thread() -> None:
    local = CountingLocal()
    local.calls = 5
    loaded = zp.loads(zp.dumps(local), allow=[CountingLocal])
    assert type(loaded) is CountingLocal and loaded.calls == 0
    loaded.calls = 1
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(loaded.calls))
    worker.start()
    worker.join()
    assert seen == [0] and loaded.calls == 1


def test_thread_local_subclass_needing_arguments_is_refused() -> None:
    holder = {"buffers": NeedsArgsLocal(3)}
    with pytest.raises(zp.DumpError) as info:
        zp.dumps(holder)
    assert info.value.path == "obj['buffers']"
    assert "needs some" in str(info.value) and "None before dumping" in str(info.value)


def test_subclass_class_must_be_allowed_in_restricted_loads() -> None:
    data = zp.dumps(TaggedEvent("x"))
    with pytest.raises(zp.RestrictedLoadError):
        zp.loads(data)
    assert zp.loads(data, allow=[TaggedEvent]).tag == "x"


def test_rebuild_functions_check_their_class_argument() -> None:
    with pytest.raises(zp.UnsafeArgumentError, match="not a subclass"):
        runtime_objects.rebuild_event(True, dict)
    with pytest.raises(zp.UnsafeArgumentError, match="not a subclass"):
        runtime_objects.rebuild_rlock(dict)
    with pytest.raises(zp.UnsafeArgumentError, match="not a subclass"):
        runtime_objects.rebuild_thread_local(dict)
    with pytest.raises(zp.UnsafeArgumentError, match="not one of"):
        runtime_objects.rebuild_thread_local("threading:local")
    with pytest.raises(zp.UnsafeArgumentError, match="not a standard stream"):
        runtime_objects.rebuild_standard_stream("modules")


def test_pure_python_thread_local_and_rlock() -> None:
    import _threading_local

    graph = {"local": _threading_local.local(), "rlock": threading._RLock()}
    graph["local"].x = 1
    loaded = zp.loads(zp.dumps(graph))  # by name and by a function: no class in the stream
    assert type(loaded["local"]) is _threading_local.local and not hasattr(loaded["local"], "x")
    assert type(loaded["rlock"]) is threading._RLock
    assert loaded["rlock"].acquire(blocking=False)
    loaded["rlock"].release()


# -- refusals --------------------------------------------------------------------------------------------------


def _generator() -> Iterator[int]:
    yield 1


async def _coroutine() -> int:
    return 1


async def _async_generator() -> AsyncIterator[int]:
    yield 1


def _culprit(kind: str, tmp_path: Path) -> Any:
    if kind == "text file":
        return open(tmp_path / "cache.txt", "w")
    if kind == "binary file":
        return open(tmp_path / "cache.bin", "wb+")
    if kind == "raw file":
        return open(tmp_path / "cache.raw", "wb", buffering=0)
    if kind == "generator":
        return _generator()
    if kind == "coroutine":
        return _coroutine()
    if kind == "async generator":
        return _async_generator()
    if kind == "socket":
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if kind == "thread":
        return threading.Thread(target=print)
    raise AssertionError(kind)


def _dispose(culprit: Any) -> None:
    if isinstance(culprit, (io.IOBase, socket.socket)) or asyncio.iscoroutine(culprit):
        culprit.close()


REFUSED_KINDS = (
    "text file",
    "binary file",
    "raw file",
    "generator",
    "coroutine",
    "async generator",
    "socket",
    "thread",
)


REFUSAL_CASES = [(kind, backend) for kind in REFUSED_KINDS for backend in BACKENDS]


@pytest.mark.parametrize(("kind", "backend"), REFUSAL_CASES)
def test_refusal_names_the_path_under_every_backend(model: Model, tmp_path: Path, kind: str, backend: str) -> None:
    culprit = model.encoder.cache.cache_file = _culprit(kind, tmp_path)
    try:
        with pytest.raises(zp.DumpError) as info:
            zp.dump(model, tmp_path / "model.zcp", backend=backend)
    finally:
        _dispose(culprit)
    assert info.value.path == "obj.encoder.layers[2].cache_file"
    message = str(info.value)
    assert "None before dumping" in message, message
    assert not (tmp_path / "model.zcp").exists()


def test_refusal_message_of_the_reducer_itself(tmp_path: Path) -> None:
    with open(tmp_path / "f.txt", "w") as f, pytest.raises(runtime_objects.RuntimeObjectRefused) as info:
        runtime_objects.reduce_file(f)
    assert "open file handle" in str(info.value) and "f.txt" in str(info.value)
    assert "register_reducer('_io:TextIOWrapper', reduce, clobber=True)" in str(info.value)
    assert isinstance(info.value, TypeError)
    with pytest.raises(runtime_objects.RuntimeObjectRefused, match="closed file object"):
        runtime_objects.reduce_file(f)


def test_refusal_reaches_the_file_inside_a_wrapper(tmp_path: Path) -> None:
    # A file handle nested in an ordinary object (a logging handler, here) is found and named.
    import logging

    handler = logging.FileHandler(tmp_path / "log.txt")
    try:
        with pytest.raises(zp.DumpError) as info:
            zp.dumps({"handler": handler})
    finally:
        handler.close()
    assert info.value.path == "obj['handler'].stream"


def test_standard_streams_are_rebound_by_name_in_trusted_loads_only() -> None:
    graph = {"out": sys.stdout, "err": sys.stderr, "orig": sys.__stderr__}
    data = zp.dumps(graph)
    with pytest.raises(zp.RestrictedLoadError) as refused:  # never the process's own streams to a stream's author
        zp.loads(data)
    assert refused.value.needed == (STANDARD_STREAM,)
    loaded = zp.loads(data, trusted=True)
    assert loaded["out"] is sys.stdout and loaded["err"] is sys.stderr and loaded["orig"] is sys.__stderr__


# -- the shared conformance suite -------------------------------------------------------------------------------


def sample() -> dict[str, Any]:
    """Runtime objects in a plain container (restricted loads need no allow=), a tensor beside them."""
    held = threading.Lock()
    held.acquire()
    rlock = threading.RLock()
    rlock.acquire()
    local = threading.local()
    local.value = 3
    event = threading.Event()
    event.set()
    slots = threading.BoundedSemaphore(3)
    slots.acquire()
    shared = threading.Lock()
    return {
        "weights": torch.arange(6.0).reshape(2, 3),
        "held": held,
        "rlock": rlock,
        "local": local,
        "shared": shared,
        "condition": threading.Condition(shared),
        "event": event,
        "clear": threading.Event(),
        "tokens": threading.Semaphore(5),
        "slots": slots,
        "barrier": threading.Barrier(2),
    }


def assert_runtime_same(expected: Any, actual: Any, where: str = "obj") -> None:
    """Equality as the quirk defines it: same types, locks released, thread-locals empty, flags and counters kept
    (a BoundedSemaphore full), tensors and containers compared deeply."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and expected.keys() == actual.keys(), where
        for key in expected:
            assert_runtime_same(expected[key], actual[key], f"{where}[{key!r}]")
        if "condition" in actual:
            assert actual["condition"]._lock is actual["shared"], f"{where}: the condition lost its lock"
        return
    assert type(expected) is type(actual), f"{where}: {type(actual)} is not {type(expected)}"
    if isinstance(expected, (type(threading.Lock()), type(threading.RLock()))):
        assert actual.acquire(blocking=False), f"{where}: not released"
        actual.release()
    elif isinstance(expected, threading.local):
        assert not vars(actual), f"{where}: thread-local attributes survived"
    elif isinstance(expected, threading.Condition):
        assert type(actual._lock) is type(expected._lock), where
    elif isinstance(expected, threading.Event):
        assert actual.is_set() == expected.is_set(), where
    elif isinstance(expected, threading.BoundedSemaphore):
        assert actual._value == actual._initial_value == expected._initial_value, where
    elif isinstance(expected, threading.Semaphore):
        assert actual._value == expected._value, where
    elif isinstance(expected, threading.Barrier):
        assert (actual.parties, actual.n_waiting, actual.broken) == (expected.parties, 0, False), where
    elif expected is sys.stderr:
        assert actual is sys.stderr, where
    else:
        assert_same_graph(expected, actual, where)


class TestRuntimeObjectsConformance(ReducerConformance):
    plugin = "runtime-objects"
    factory = "tests.test_quirk_runtime_objects:sample"

    def assert_same(self, expected: Any, actual: Any) -> None:
        assert_runtime_same(expected, actual)

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(REPO)}

    @pytest.mark.slow
    def test_fresh_interpreter_load(self, tmp_path: Path) -> None:
        # The suite's fresh interpreter compares with zerocopy_pickle.testing.assert_same, which cannot compare
        # two distinct locks: run the same check, comparing with this module's assert_runtime_same.
        from .conftest import run_python

        path = tmp_path / "fresh.zcp"
        zp.dump(sample(), path)
        proc = run_python(
            """
            import sys
            import zerocopy_pickle as zp
            from tests.test_quirk_runtime_objects import assert_runtime_same, sample
            assert_runtime_same(sample(), zp.load(sys.argv[1]))
            print("ok")
            """,
            str(path),
            env=self.env(),
        )
        assert proc.stdout.strip() == "ok", proc.stderr


# -- hostile streams ---------------------------------------------------------------------------------------------


class Reduce:
    """Pickles as ``func(*args)``: how a hostile stream calls a function with arguments of its choosing."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


@pytest.mark.slow
def test_restricted_load_never_touches_stdin() -> None:
    """A stream naming the process's stdin (to read it, or block on it) is refused before anything reads it; the
    child's stdin is a pipe holding data, which must be intact afterwards."""
    code = """
        import sys
        import zerocopy_pickle as zp
        from zerocopy_pickle_quirks import runtime_objects as ro
        from tests.test_quirk_runtime_objects import Reduce

        stdin = Reduce(ro.rebuild_standard_stream, "stdin")
        streams = [
            zp.dumps(stdin),
            zp.dumps({"lines": Reduce(list, (stdin,))}),
            zp.dumps(Reduce(ro.rebuild_condition, stdin)),
        ]
        for data in streams:
            try:
                zp.loads(data)
            except zp.RestrictedLoadError as e:
                assert ("zerocopy_pickle_quirks.runtime_objects", "rebuild_standard_stream") in e.needed
            else:
                raise AssertionError("a restricted load handed out stdin")
        print(repr(sys.stdin.read()))
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        input="secret line\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr("secret line\n")


def test_hostile_calls_of_the_safe_globals_are_refused() -> None:
    lock = Reduce(runtime_objects.rebuild_lock)
    calls = [
        Reduce(runtime_objects.rebuild_semaphore, 10**100),
        Reduce(runtime_objects.rebuild_semaphore, -1),
        Reduce(runtime_objects.rebuild_event, 1),
        Reduce(runtime_objects.rebuild_barrier, 2, runtime_objects.rebuild_lock, None),  # an action: trusted only
        Reduce(runtime_objects.rebuild_barrier, 0, None, None),
        Reduce(runtime_objects.rebuild_barrier, 2, None, float("nan")),
        Reduce(runtime_objects.rebuild_condition, "lock"),
        Reduce(runtime_objects.rebuild_thread_local, "os:system"),
        Reduce(runtime_objects.set_runtime_state, Reduce(runtime_objects.rebuild_condition, lock), {"_lock": None}),
        Reduce(runtime_objects.set_runtime_state, Reduce(runtime_objects.rebuild_event, False), {"set": None}),
        Reduce(runtime_objects.set_runtime_state, lock, {"x": 1}),
    ]
    for call in calls:
        with pytest.raises(zp.SnapshotError):
            zp.loads(naming(zp.dumps(call), "runtime-objects"))


def test_barrier_with_an_action_loads_trusted_only() -> None:
    barrier = threading.Barrier(2, action=_barrier_action)
    data = zp.dumps(barrier)
    with pytest.raises(zp.RestrictedLoadError):
        zp.loads(data, allow=[_barrier_action])  # rebuild_barrier_with_action is not a safe global
    loaded = zp.loads(data, trusted=True)
    assert loaded.parties == 2 and loaded._action is _barrier_action


def _barrier_action() -> None:
    pass


def test_declares_only_validating_functions() -> None:
    import types

    registry = default_registry()
    pairs = registry.safe_globals(plugins=["runtime-objects"])
    assert STANDARD_STREAM not in pairs
    assert ("_threading_local", "local") not in pairs
    for module, name in pairs:
        assert type(registry.resolve_safe_global(module, name)) is types.FunctionType
