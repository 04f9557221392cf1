"""Runtime objects found in real model objects: locks, thread locals, events, open files, generators, threads.

Plain pickle refuses all of them with a message that names a type but not where it sits, and dill (which
``backend="auto"`` falls back to) pickles some in ways a snapshot should not (a file handle reopened at load).

Rebuilt fresh at load (the rebuild functions are safe globals, so restricted loads accept them):

* ``_thread.lock`` (``threading.Lock()``) and ``_thread.RLock`` (``threading.RLock()``, and the pure-Python
  ``threading._RLock``): a new lock, **released** (a held lock belonged to a thread of the dumping process).
  A lock shared by several objects stays shared (the pickle memo).
* ``threading.Condition``: a new condition over its lock, rebuilt as above (so the conditions of a
  ``queue.Queue`` keep sharing one mutex); waiters are dropped.
* ``threading.Event``: a new event whose flag **is preserved** (it is plain data: "stop requested", "ready").
* ``threading.Semaphore``: its current counter is kept. ``threading.BoundedSemaphore``: comes back full (its
  initial value), as its permits were held by threads of the dumping process.
* ``threading.Barrier``: a new barrier with the same parties, action and timeout, not broken, nobody waiting.
* ``threading.local`` (``_thread._local``, and ``_threading_local.local``): a new, empty thread-local of the same
  class. Its attributes are per thread and are **dropped**; a subclass's ``__init__`` runs again, with no
  arguments, in each thread that uses it (a subclass whose ``__init__`` needs arguments is refused at dump).
* ``sys.stdin``/``stdout``/``stderr`` (and the ``sys.__std*__`` originals): rebound by name to the loading
  process's stream, in **trusted loads only** (:func:`rebuild_standard_stream` is not a safe global: a restricted
  load must never hand the process's own streams to a stream's author). Likewise a ``Barrier`` with an action.

Subclasses of these types come back as themselves, with their extra ``__dict__`` entries (set by
:func:`set_runtime_state`, a checked call: restricted loads never apply BUILD to what a plugin's function returned).
The pure-Python ``_threading_local.local`` travels as a name, not as a class.

Refused with a ``TypeError`` that says what to do, under every backend (the dump raises ``DumpError`` whose
``path`` names the object: ``obj.encoder.cache_file``): open files (``FileIO``, ``BufferedReader``/``Writer``/
``Random``/``RWPair``, ``TextIOWrapper`` and their subclasses), sockets, generators, coroutines, async
generators, and threads (``threading.Thread`` and subclasses such as ``Timer``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

from zerocopy_pickle.plugin import Registrar, Unpicklable, validate

__all__ = [
    "RuntimeObjectRefused",
    "rebuild_barrier",
    "rebuild_barrier_with_action",
    "rebuild_bounded_semaphore",
    "rebuild_condition",
    "rebuild_event",
    "rebuild_lock",
    "rebuild_python_rlock",
    "rebuild_rlock",
    "rebuild_semaphore",
    "rebuild_standard_stream",
    "rebuild_thread_local",
    "register",
    "set_runtime_state",
]

PLUGIN = "runtime-objects"

_RLOCK = type(threading.RLock())
_RLOCK_TYPES: tuple[type, ...] = (_RLOCK, *([threading._RLock] if hasattr(threading, "_RLock") else []))
_STANDARD_STREAMS = ("stdin", "stdout", "stderr", "__stdin__", "__stdout__", "__stderr__")


class RuntimeObjectRefused(Unpicklable):
    """An object that cannot survive a process (an open file, a generator, a thread) was met in a dump."""


# -- rebuild functions: their module path and name are part of every snapshot written with them ---------------
#
# Each safe global below is called by restricted loads with arguments a hostile stream chose: it checks the exact
# type and range of every argument (zerocopy_pickle.validate) before it builds anything, and returns a new object.
# A class argument is a subclass the caller's allow= let the stream name (or, for the pure-Python thread-local, a
# name from a fixed table); it must derive from the type the function rebuilds, and its metaclass must be `type`.

_MAX_COUNT = 1 << 62


def _new(cls: object, base: type, where: str) -> Any:
    """An uninitialized instance of ``cls`` (default ``base``), which must be ``base`` or a subclass of it."""
    klass: Any = base if cls is None else validate.expect_class(cls, base, where, "class")
    return klass.__new__(klass)


def rebuild_lock() -> Any:
    """A new, released ``threading.Lock``."""
    return threading.Lock()


def rebuild_rlock(cls: type | None = None) -> Any:
    """A new, released ``threading.RLock`` (of ``cls``, a subclass of an RLock type, when given)."""
    if cls is None:
        return threading.RLock()
    return validate.expect_class(cls, _RLOCK_TYPES, "runtime-objects rebuild_rlock", "class")()


def rebuild_python_rlock() -> Any:
    """A new, released pure-Python ``threading._RLock`` (the ``threading`` module is on the restricted-load
    blocklist, so a stream cannot name that class itself)."""
    return threading._RLock()


_LOCK_TYPES: tuple[type, ...] = (type(threading.Lock()), *_RLOCK_TYPES)


def rebuild_condition(lock: Any, cls: type | None = None) -> threading.Condition:
    """A new ``threading.Condition`` over ``lock`` (a lock or RLock the stream rebuilt, released), no waiters."""
    where = "runtime-objects rebuild_condition"
    if not any(base in type(lock).__mro__ for base in _LOCK_TYPES):
        validate.fail(where, f"lock must be a Lock or RLock, not {type(lock).__qualname__}")
    condition: threading.Condition = _new(cls, threading.Condition, where)
    threading.Condition.__init__(condition, lock)
    return condition


def rebuild_event(flag: bool, cls: type | None = None) -> threading.Event:
    """A new ``threading.Event``, set if ``flag``."""
    where = "runtime-objects rebuild_event"
    validate.expect_bool(flag, where, "flag")
    event: threading.Event = _new(cls, threading.Event, where)
    threading.Event.__init__(event)
    if flag:
        event.set()
    return event


def rebuild_semaphore(value: int, cls: type | None = None) -> threading.Semaphore:
    """A new ``threading.Semaphore`` whose counter is ``value``."""
    where = "runtime-objects rebuild_semaphore"
    validate.expect_int(value, where, "value", 0, _MAX_COUNT)
    semaphore: threading.Semaphore = _new(cls, threading.Semaphore, where)
    threading.Semaphore.__init__(semaphore, value)
    return semaphore


def rebuild_bounded_semaphore(value: int, cls: type | None = None) -> threading.BoundedSemaphore:
    """A new, full ``threading.BoundedSemaphore`` of initial value ``value``."""
    where = "runtime-objects rebuild_bounded_semaphore"
    validate.expect_int(value, where, "value", 0, _MAX_COUNT)
    semaphore: threading.BoundedSemaphore = _new(cls, threading.BoundedSemaphore, where)
    threading.BoundedSemaphore.__init__(semaphore, value)
    return semaphore


def _barrier_args(parties: object, timeout: object, where: str) -> tuple[int, float | None]:
    count = validate.expect_int(parties, where, "parties", 1, _MAX_COUNT)
    seconds = None if timeout is None else validate.expect_float(timeout, where, "timeout", 0.0)
    return count, seconds


def rebuild_barrier(
    parties: int, action: Callable[[], None] | None, timeout: float | None, cls: type | None = None
) -> threading.Barrier:
    """A new ``threading.Barrier`` (filling, nobody waiting), without an action: a barrier's action is a callable
    the stream would choose and a thread would call, so a barrier with one is rebuilt by
    :func:`rebuild_barrier_with_action`, which is not a safe global (``trusted=True`` only)."""
    where = "runtime-objects rebuild_barrier"
    count, seconds = _barrier_args(parties, timeout, where)
    if action is not None:
        validate.fail(where, "a Barrier with an action loads only with trusted=True")
    barrier: threading.Barrier = _new(cls, threading.Barrier, where)
    threading.Barrier.__init__(barrier, count, None, seconds)
    return barrier


def rebuild_barrier_with_action(
    parties: int, action: Callable[[], None], timeout: float | None, cls: type | None = None
) -> threading.Barrier:
    """A new ``threading.Barrier`` with an action (trusted loads only: not a safe global)."""
    where = "runtime-objects rebuild_barrier_with_action"
    count, seconds = _barrier_args(parties, timeout, where)
    barrier: threading.Barrier = _new(cls, threading.Barrier, where)
    threading.Barrier.__init__(barrier, count, action, seconds)
    return barrier


_PURE_LOCAL = "_threading_local:local"


def _thread_local_bases() -> tuple[type, ...]:
    pure = sys.modules.get("_threading_local")  # the pure-Python local, if anything imported it
    return (threading.local,) if pure is None else (threading.local, pure.local)


def rebuild_thread_local(cls: type | str | None = None) -> Any:
    """A new, empty ``threading.local``: of ``cls`` when given, a subclass of a thread-local type, or the name
    ``"_threading_local:local"`` (the pure-Python one, which a stream names this way rather than as a class)."""
    where = "runtime-objects rebuild_thread_local"
    if cls is None:
        return threading.local()
    if type(cls) is str:
        validate.expect_choice(cls, (_PURE_LOCAL,), where, "class name")
        return importlib.import_module("_threading_local").local()
    return validate.expect_class(cls, _thread_local_bases(), where, "class")()


def set_runtime_state(obj: Any, state: dict[str, Any]) -> None:
    """Pickle's state setter for the rebuilt types (their subclasses, mostly): extra ``__dict__`` entries.

    Each name must be an identifier that shadows nothing of the class and none of the base's own instance
    attributes (a stream cannot replace a condition's lock or a semaphore's counter)."""
    where = "runtime-objects set_runtime_state"
    base = next((b for b in _STATEFUL if b in type(obj).__mro__), None)
    if base is None:
        validate.fail(where, f"expected a rebuilt runtime object, not {type(obj).__qualname__}")
    table = validate.expect_str_dict(state, where, "state", max_len=4096)
    reserved = _base_keys(base)
    for name in table:
        if not name.isidentifier() or name.startswith("__") or name in reserved or hasattr(type(obj), name):
            validate.fail(where, f"refusing to set attribute {name[:80]!r} on a {type(obj).__qualname__}")
    for name, value in table.items():
        setattr(obj, name, value)


def rebuild_standard_stream(name: str) -> Any:
    """The loading process's ``sys.<name>`` (``stdout``, ``__stderr__``, ...).

    Not a safe global: a restricted load must never hand the process's own streams to a stream's author (to read
    stdin, or to wrap a stream whose writes then vanish). Snapshots holding a standard stream load with
    ``trusted=True``."""
    if type(name) is not str or name not in _STANDARD_STREAMS:
        validate.fail("runtime-objects rebuild_standard_stream", f"{name!r:.80} is not a standard stream of sys")
    return getattr(sys, name)


# -- reducers -------------------------------------------------------------------------------------------------

_BASE_KEYS: dict[type, frozenset[str]] = {}


def _base_keys(base: type) -> frozenset[str]:
    """The ``__dict__`` keys a fresh ``base()`` has: what the rebuild function recreates by itself."""
    keys = _BASE_KEYS.get(base)
    if keys is None:
        sample = base(1) if base is threading.Barrier else base()
        keys = _BASE_KEYS[base] = frozenset(vars(sample))
    return keys


def _reduced(obj: Any, base: type, rebuild: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(rebuild, args[, state, None, None, set_runtime_state])``: ``type(obj)`` appended for a subclass, and as
    state the ``__dict__`` entries the rebuild does not recreate (a subclass's attributes), each reduced in its
    turn, set by :func:`set_runtime_state` (a call, not BUILD, which restricted loads never apply to what a
    plugin's function returned)."""
    cls = type(obj)
    if cls is not base:
        args = (*args, cls)
    keys = _base_keys(base)
    extra = {key: value for key, value in getattr(obj, "__dict__", {}).items() if key not in keys}
    return (rebuild, args, extra, None, None, set_runtime_state) if extra else (rebuild, args)


def reduce_lock(lock: Any) -> tuple[Any, ...]:
    return rebuild_lock, ()


def reduce_rlock(rlock: Any) -> tuple[Any, ...]:
    cls = type(rlock)
    if cls is _RLOCK:
        return rebuild_rlock, ()
    if cls is getattr(threading, "_RLock", None):
        return rebuild_python_rlock, ()
    return rebuild_rlock, (cls,)


def reduce_condition(condition: threading.Condition) -> tuple[Any, ...]:
    return _reduced(condition, threading.Condition, rebuild_condition, (condition._lock,))  # type: ignore[attr-defined]


def reduce_event(event: threading.Event) -> tuple[Any, ...]:
    return _reduced(event, threading.Event, rebuild_event, (event.is_set(),))


def reduce_semaphore(semaphore: threading.Semaphore) -> tuple[Any, ...]:
    return _reduced(semaphore, threading.Semaphore, rebuild_semaphore, (semaphore._value,))


def reduce_bounded_semaphore(semaphore: threading.BoundedSemaphore) -> tuple[Any, ...]:
    initial = semaphore._initial_value  # type: ignore[attr-defined]
    return _reduced(semaphore, threading.BoundedSemaphore, rebuild_bounded_semaphore, (initial,))


def reduce_barrier(barrier: threading.Barrier) -> tuple[Any, ...]:
    action = barrier._action  # type: ignore[attr-defined]
    args = (barrier.parties, action, barrier._timeout)  # type: ignore[attr-defined]
    return _reduced(
        barrier, threading.Barrier, rebuild_barrier if action is None else rebuild_barrier_with_action, args
    )


def reduce_thread_local(local: Any) -> tuple[Any, ...]:
    cls = type(local)
    if cls is threading.local:
        return rebuild_thread_local, ()
    if f"{cls.__module__}:{cls.__qualname__}" == _PURE_LOCAL:
        return rebuild_thread_local, (_PURE_LOCAL,)
    if cls.__init__ is not object.__init__ and cls.__init__ is not threading.local.__init__:
        try:
            inspect.signature(cls).bind()
        except (TypeError, ValueError) as e:
            raise RuntimeObjectRefused(
                f"cannot rebuild the thread-local {cls.__module__}.{cls.__qualname__}: a thread-local comes back "
                f"empty and its __init__ runs again with no arguments, but this one needs some ({e}). Set the "
                f"attribute that holds it to None before dumping, or register a reducer for the type that holds it"
            ) from None
    return rebuild_thread_local, (cls,)


def reduce_file(stream: Any) -> Any:
    for name in _STANDARD_STREAMS:
        if stream is getattr(sys, name, None):
            return rebuild_standard_stream, (name,)
    try:
        closed = bool(stream.closed)
    except Exception:  # a detached wrapper, say
        closed = True
    kind = "a closed file object" if closed else "an open file handle"
    cls = type(stream)
    raise RuntimeObjectRefused(
        f"cannot pickle {kind} ({_describe(stream)}): a file handle belongs to the process that opened it. Set the "
        f"attribute that holds it to None before dumping (keep its path, and reopen it after loading), or replace "
        f"this refusal with your own reducer: zerocopy_pickle.register_reducer('{cls.__module__}:{cls.__qualname__}'"
        f", reduce, clobber=True)"
    )


def reduce_socket(sock: Any) -> Any:
    raise RuntimeObjectRefused(
        f"cannot pickle a socket ({_describe(sock)}): a connection belongs to the process that opened it. Set the "
        f"attribute that holds it to None before dumping and reconnect after loading, or register a reducer for "
        f"the type that holds it"
    )


def reduce_generator(generator: Any) -> Any:
    kind = type(generator).__name__.replace("_", " ")
    name = getattr(generator, "__qualname__", None) or kind
    raise RuntimeObjectRefused(
        f"cannot pickle a {kind} ({name}): its suspended frame cannot be saved. Set the attribute that holds it "
        f"to None before dumping (keep what it would produce, a list say, or what it needs to be created again "
        f"after loading), or register a reducer for the type that holds it"
    )


def reduce_thread(thread: threading.Thread) -> Any:
    raise RuntimeObjectRefused(
        f"cannot pickle a thread ({thread!r:.100}): threads do not survive their process. Set the attribute that "
        f"holds it to None before dumping and start a new one after loading, or register a reducer for the type "
        f"that holds it"
    )


def _describe(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__module__}.{type(obj).__qualname__}>"
    return text if len(text) <= 120 else text[:117] + "..."


# -- registration ----------------------------------------------------------------------------------------------

REBUILT: dict[str, Callable[[Any], Any]] = {
    "_thread:lock": reduce_lock,
    "_thread:RLock": reduce_rlock,
    "threading:_RLock": reduce_rlock,
    "threading:Condition": reduce_condition,
    "threading:Event": reduce_event,
    "threading:Semaphore": reduce_semaphore,
    "threading:BoundedSemaphore": reduce_bounded_semaphore,
    "threading:Barrier": reduce_barrier,
    "_thread:_local": reduce_thread_local,
    "_threading_local:local": reduce_thread_local,
}
"""Types rebuilt fresh at load, by ``module:QualName`` (the same in CPython 3.10 to 3.13)."""

REFUSED: dict[str, Callable[[Any], Any]] = {
    "_io:FileIO": reduce_file,
    "_io:BufferedReader": reduce_file,
    "_io:BufferedWriter": reduce_file,
    "_io:BufferedRandom": reduce_file,
    "_io:BufferedRWPair": reduce_file,
    "_io:TextIOWrapper": reduce_file,
    "_socket:socket": reduce_socket,
    "builtins:generator": reduce_generator,
    "builtins:coroutine": reduce_generator,
    "builtins:async_generator": reduce_generator,
    "threading:Thread": reduce_thread,
}
"""Types refused with a message that says what to do (the standard streams excepted: rebound by name)."""

SAFE_GLOBALS = (
    rebuild_lock,
    rebuild_rlock,
    rebuild_python_rlock,
    rebuild_condition,
    rebuild_event,
    rebuild_semaphore,
    rebuild_bounded_semaphore,
    rebuild_barrier,
    rebuild_thread_local,
    set_runtime_state,
)
"""What the reduced streams call in restricted loads: each checks its arguments' exact types and ranges, builds a
fresh synchronization object, and checks that a class argument derives from the type it rebuilds. Not among them:
:func:`rebuild_standard_stream` (the process's own ``sys.std*``) and :func:`rebuild_barrier_with_action` (a
callable chosen by the stream), which only ``trusted=True`` loads (or an explicit ``allow=``) accept."""

_STATEFUL: tuple[type, ...] = (
    threading.Condition,
    threading.BoundedSemaphore,  # before Semaphore: the more specific base wins
    threading.Semaphore,
    threading.Event,
    threading.Barrier,
)


def register(registry: Registrar) -> None:
    """Entry point of the ``runtime-objects`` plugin."""
    for target, reduce in {**REBUILT, **REFUSED}.items():
        registry.register_reducer(target, reduce)
    registry.add_safe_globals(*SAFE_GLOBALS)
