"""Internal: restricted loading: which globals a stream may name, what it may do with each, and what no
allow-list permits.

Pickle resolves every class and function a stream names through ``Unpickler.find_class``, and then its opcodes
act on what was resolved: REDUCE calls it, NEWOBJ instantiates it, BUILD sets state on whatever is below it. A
restricted load decides both, before the C unpickler runs anything:

* **What a stream does** is worked out by :mod:`zerocopy_pickle._trust.semantics` from the opcodes alone (remembered
  by the stream's digest): which named globals it calls, instantiates, and which results it fills. REDUCE on
  anything but a named global, BUILD on anything but an object the load created, container opcodes on anything
  but containers the stream built are refused there, whatever the allow-list says.
* **What it may name** comes from an :class:`AllowList`: the built-in safe set (:mod:`zerocopy_pickle._trust.safe_set`:
  validating wrappers of torch's and this library's rebuild functions, containers, primitives, dtypes), the
  declared safe globals of the plugins the snapshot's header names (functions that check their arguments), and
  the call's ``allow=``: classes the stream may instantiate and fill, objects it may reference as values, and
  functions it may call only through :func:`allow_function`. :meth:`AllowList.admit` checks each use against
  that list.
* Matching is on exact ``(module, qualname)`` pairs. A dotted qualname is resolved only if that exact pair is
  allowed, must resolve to a class, and the object found must carry that same module and qualname: no entry
  can reach through a module's globals (``("pathlib", "os.system")``) or onto a method.
* The blocklist (:func:`is_blocked`) wins over every allow-list: modules and functions that execute code, spawn
  processes, touch files or the network, or unpickle nested streams. It is matched by name *and* by the
  identity of the resolved object, so an alias in a harmless-looking module is refused too.
* There is no process-global, mutable allow-list anywhere (see Note [Per-call allow-lists]).
"""

from __future__ import annotations

import builtins
import collections
import functools
import importlib
import io
import os
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import rebuild
from .._names import GlobalName
from ..errors import ArgumentError, MissingGlobalError, PluginError, RestrictedLoadError, SnapshotError
from . import semantics
from .safe_set import safe_table
from .semantics import StreamUses
from .streamcheck import walk_stream

# Note [Per-call allow-lists]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's weights_only unpickler keeps its extra safe globals in process-wide state
# (torch.serialization.add_safe_globals); a loader that mutates it around a load races with every other
# thread that loads at the same time. Here an AllowList is an immutable value built per call and held by
# that call's unpickler instance only. The built-in safe set is computed once and never mutated.

AllowSpec = Iterable[object]
"""What ``allow=`` accepts: classes or functions, ``"module:qualname"`` strings, or ``(module, qualname)``."""

# -- the blocklist -------------------------------------------------------------------------------------------
# Whole modules (and their submodules): code execution, processes, files, network, nested unpickling, native
# code. Sources: CPython's pickle documentation, the picklescan and fickling rule sets, PyTorch's
# weights-only unpickler and its advisories (CVE-2025-32434, CVE-2026-24747).
BLOCKED_MODULES = frozenset(
    {
        # the operating system, processes, signals, native code
        "os", "posix", "nt", "sys", "subprocess", "pty", "signal", "resource", "ctypes",
        "_ctypes", "cffi", "_posixsubprocess", "multiprocessing", "concurrent", "threading", "_thread", "asyncio",
        # importing and running code
        "importlib", "pkgutil", "runpy", "code", "codeop", "zipimport", "imp", "site", "sysconfig",
        "ensurepip", "venv", "distutils", "setuptools", "pip", "compileall", "py_compile",
        # debuggers, profilers and test runners (each runs a string or a callable it is given)
        "pdb", "bdb", "cProfile", "profile", "timeit", "trace", "tracemalloc", "doctest", "unittest",
        "idlelib", "turtledemo", "lib2to3",
        # nested deserializers
        "pickle", "_pickle", "pickletools", "copyreg", "marshal", "shelve", "dill", "cloudpickle", "joblib",
        "yaml", "jsonpickle",
        # files and archives
        "shutil", "tempfile", "glob", "fileinput", "zipfile", "tarfile", "gzip", "bz2", "lzma", "dbm",
        "sqlite3", "mmap", "_io", "io", "fcntl",
        # the network
        "socket", "_socket", "ssl", "select", "selectors", "socketserver", "http", "httplib", "urllib",
        "urllib2", "ftplib", "smtplib", "poplib", "imaplib", "telnetlib", "xmlrpc", "webbrowser", "requests",
        "aiohttp", "httpx",
        # object-graph gadgets that reach attributes or call methods by name
        "operator", "_operator", "inspect", "gc", "weakref", "logging.config",
        # torch and numpy entry points that load, compile or run code
        "torch.hub", "torch.jit", "torch.package", "torch.utils.cpp_extension", "torch._inductor",
        "torch._dynamo", "torch.distributed", "torch.multiprocessing", "torch._C", "torch.testing",
        "numpy.testing", "numpy.f2py", "numpy.distutils", "numpy.lib.npyio", "numpy.lib._npyio_impl",
        "numpy.lib.format", "numpy.ctypeslib", "torch.fx", "torch.utils.collect_env", "torch.utils.benchmark",
        "torch.export", "torch.onnx", "torch.compiler", "torch.library", "torch.ops", "torch._ops",
        "torch.utils._config_module", "torch._export", "torch._higher_order_ops", "torch.cuda.memory",
        # pagers, browsers and shells reached through documentation and terminal helpers
        "pydoc", "pydoc_data", "antigravity", "this", "tkinter", "turtle", "curses", "readline", "rlcompleter",
    }
)  # fmt: skip
# Single names in otherwise unblocked modules.
BLOCKED_NAMES = frozenset(
    {
        ("builtins", name)
        for name in (
            "eval", "exec", "compile", "getattr", "setattr", "delattr", "__import__", "open", "breakpoint",
            "input", "help", "globals", "locals", "vars", "exit", "quit", "memoryview", "object", "type",
            "super", "classmethod", "staticmethod", "property", "__build_class__", "apply", "execfile", "file",
            "reload",
        )
    }
    | {("__builtin__", name) for name in ("eval", "exec", "compile", "getattr", "setattr", "apply", "open",
                                         "file", "execfile", "__import__", "input", "reload")}
    | {("types", name) for name in ("FunctionType", "LambdaType", "CodeType", "MethodType", "ModuleType",
                                    "CellType", "new_class", "prepare_class", "BuiltinFunctionType")}
    | {("torch.serialization", name) for name in ("load", "_load", "_legacy_load", "save", "_save",
                                                  "_legacy_save", "_open_file_like", "_open_zipfile_reader")}
    | {("torch", "load"), ("torch", "save"), ("torch", "compile"), ("torch", "from_file"), ("numpy", "load"),
       ("numpy", "fromfile"), ("numpy", "memmap"), ("numpy", "save"), ("numpy", "savez"), ("numpy", "loadtxt"),
       ("numpy", "genfromtxt"), ("numpy", "fromregex"), ("numpy", "tofile"), ("torch", "from_numpy")}
    # builtins that call or iterate what they are given, or reach the interpreter
    | {("builtins", name) for name in ("map", "filter", "zip", "enumerate", "reversed", "iter", "next", "sorted",
                                        "min", "max", "sum", "any", "all", "print", "__loader__", "__spec__",
                                        "__builtins__", "id", "hash", "dir", "repr", "format", "callable")}
    | {("functools", name) for name in ("reduce", "partialmethod", "cached_property", "wraps",
                                         "update_wrapper", "singledispatch", "lru_cache", "cache")}
    | {("logging", name) for name in ("FileHandler", "StreamHandler", "basicConfig", "getLogger", "config")}
    | {("codecs", name) for name in ("open", "EncodedFile", "StreamReaderWriter", "lookup")}
    | {("torch.serialization", name) for name in ("add_safe_globals", "safe_globals", "register_package",
                                                  "clear_safe_globals")}
)  # fmt: skip


_LONGEST_BLOCKED = max(map(len, BLOCKED_MODULES))


@functools.lru_cache(maxsize=4096)
def _module_blocked(module: str) -> bool:
    """Whether ``module`` or a package above it is blocked. Linear in the name: only the prefixes that end at a
    dot (or at the end) and are no longer than the longest blocked module can match, and each is sliced once
    (a name from a stream can be megabytes of dots; checking every prefix by joining its parts was quadratic)."""
    end = module.find(".")
    while 0 <= end <= _LONGEST_BLOCKED:
        if module[:end] in BLOCKED_MODULES:
            return True
        end = module.find(".", end + 1, _LONGEST_BLOCKED + 1)
    return len(module) <= _LONGEST_BLOCKED and module in BLOCKED_MODULES


@functools.lru_cache(maxsize=4096)
def _name_blocked(pair: tuple[str, str]) -> bool:
    module, qualname = pair
    return pair in BLOCKED_NAMES or _module_blocked(module) or (module, qualname.partition(".")[0]) in BLOCKED_NAMES


@functools.lru_cache(maxsize=1)
def _blocked_objects() -> frozenset[int]:
    """ids of well-known blocked callables, to refuse them under any alias (``io.open``, ``pty.spawn``, ...)."""
    objects: list[Any] = [
        getattr(builtins, name) for m, name in BLOCKED_NAMES if m == "builtins" and hasattr(builtins, name)
    ]
    objects += [
        os.system, os.popen, os.execv, os.execve, os.spawnv, os.fork, os.remove, os.unlink, os.rmdir, os.open,
        os.kill, io.open, pickle.loads, pickle.load, pickle.Unpickler, torch.load, torch.save, torch.jit.load,
        importlib.import_module, types.FunctionType, types.CodeType, types.MethodType,
    ]  # fmt: skip
    objects += [getattr(torch.serialization, "load", None), getattr(torch.hub, "load", None)]
    return frozenset(id(o) for o in objects if o is not None)


def is_blocked(pair: tuple[str, str], obj: object = None) -> bool:
    """Whether a global can never be allowed: by its name, or (when resolved) by what it is."""
    if _name_blocked(pair):
        return True
    if obj is not None:
        if id(obj) in _blocked_objects() or _is_blocked_object(obj):
            return True
        owner = getattr(obj, "__module__", None)
        if isinstance(owner, str) and _module_blocked(owner):
            return True
    return False


def _is_blocked_object(obj: object) -> bool:
    """Whether ``obj`` is what a blocked name denotes in a module already imported (a module not imported cannot
    have handed its objects to anyone, so this never imports)."""
    return _imported_blocked_objects().get(id(obj)) is obj


_BLOCKED_SEEN: dict[int, object] = {}  # id -> the blocked object itself (held, so no id is ever reused)
_BLOCKED_SEEN_MODULES = [-1]  # len(sys.modules) when _BLOCKED_SEEN was last brought up to date
_BLOCKED_SEEN_LOCK = threading.Lock()


def _imported_blocked_objects() -> dict[int, object]:
    """The objects blocked names denote in the modules imported so far, refreshed when more are imported."""
    if len(sys.modules) != _BLOCKED_SEEN_MODULES[0]:
        with _BLOCKED_SEEN_LOCK:
            _BLOCKED_SEEN_MODULES[0] = len(sys.modules)
            for module_name, name in BLOCKED_NAMES:
                module = sys.modules.get(module_name)
                found = getattr(module, name, None) if module is not None else None
                if found is not None:
                    _BLOCKED_SEEN[id(found)] = found
    return _BLOCKED_SEEN


def format_global(pair: tuple[str, str]) -> str:
    """``("collections", "OrderedDict")`` -> ``"collections:OrderedDict"``, the form ``allow=`` takes."""
    return str(GlobalName(*pair))


def _pair_of(obj: Any) -> tuple[str, str]:
    name = GlobalName.of(obj)
    if name is None:
        raise ArgumentError(
            f"allow= entries must be classes, functions, 'module:qualname' strings or (module, qualname) "
            f"tuples; {obj!r:.80} has no __module__/__qualname__ (pass its 'module:qualname' string instead)"
        )
    return name.pair


def safe_globals() -> Mapping[tuple[str, str], object]:
    """The built-in safe set: every global a stream of tensors, storages and containers needs, mapped to what a
    restricted load pushes for it (a validating function of :mod:`zerocopy_pickle._trust.safe_set` for callables, the
    object itself for values such as dtypes). Read-only; nothing ever adds to it."""
    return _safe_values()


@functools.lru_cache(maxsize=1)
def _safe_values() -> Mapping[tuple[str, str], object]:
    return types.MappingProxyType({pair: entry.value for pair, entry in safe_table().items()})


@dataclass(frozen=True)
class AllowFunction:
    """An ``allow=`` entry that lets a restricted load *call* a function (see :func:`allow_function`)."""

    target: object


def allow_function(target: object) -> AllowFunction:
    """Mark a function in ``allow=`` as callable by the stream: ``allow=[zp.allow_function(my_rebuild)]``.

    A plain ``allow=`` entry admits a class (which the stream may instantiate and fill) or any object as a
    *value* (a function referenced by a module, say ``activation=F.gelu``). Calling a function is different:
    the stream chooses every argument, so a function the load may call must check them itself (see
    :mod:`zerocopy_pickle.validate`). Blocked functions stay blocked.

    Args:
        target: a function, a ``"module:qualname"`` string or a ``(module, qualname)`` tuple.

    Examples:
        A function the stream calls (a reducer's rebuild function), which checks its own arguments:

        ```python
        import zerocopy_pickle as zp
        from mypkg import Interval, rebuild_interval  # rebuild_interval(lo, hi) validates lo and hi

        interval = zp.load("interval.zcp", allow=[Interval, zp.allow_function(rebuild_interval)])
        interval = zp.load("interval.zcp", allow=[Interval, zp.allow_function("mypkg:rebuild_interval")])
        ```
    """
    return AllowFunction(target)


# How an allowed global may be used: as a value only, called (REDUCE/OBJ/INST), instantiated (NEWOBJ).
_VALUE, _FUNCTION, _CLASS, _SAFE, _STORAGE = range(5)

# __new__ implementations known to return a new object every time: instances created through them (and not
# through a metaclass __call__ of its own, as Enum's) can be filled by BUILD and the container opcodes.
_FRESH_NEW_OWNERS = (object, dict, list, set, bytearray, collections.OrderedDict, collections.deque,
                     collections.defaultdict)  # fmt: skip


def _constructs_fresh(cls: type) -> bool:
    """Whether calling or instantiating ``cls`` always yields a new object (so BUILD on it touches nothing else)."""
    if type(cls).__call__ is not type.__call__:
        return False
    for base in cls.__mro__:
        if "__new__" in vars(base):
            return base in _FRESH_NEW_OWNERS
    return False


_NUMPY_MACHINERY = frozenset(
    (module, name)
    for core in ("numpy._core", "numpy.core")
    for module, name in (
        (f"{core}.multiarray", "_reconstruct"),
        (f"{core}.multiarray", "scalar"),
        (f"{core}.numeric", "_frombuffer"),
    )
) | {("numpy", "ndarray"), ("numpy", "dtype")}


def numpy_machinery(pair: tuple[str, str]) -> bool:
    """Whether ``pair`` is one of the NumPy names a ``torch.serialization.add_safe_globals`` list holds for NumPy
    values (``_reconstruct``, ``scalar``, ``_frombuffer``, ``ndarray``, ``dtype``, the ``numpy.dtypes`` classes).

    An ``allow=`` entry naming one is accepted and ignored (Note [NumPy values] in safeglobals): numeric NumPy
    values load through this library's own rebuilds without it, and admitting it would let a stream call
    ``numpy.ndarray(shape)`` (memory from a size alone) or the unchecked ``_reconstruct``. Only
    :func:`allow_function` admits such a function to be called, on the caller's word."""
    module, name = pair
    return pair in _NUMPY_MACHINERY or (module == "numpy.dtypes" and name.endswith("DType"))


class AllowList:
    """The globals one load may resolve, and what it may do with each: the built-in safe set, the plugins'
    declared safe globals, and this call's ``allow=``.

    Args:
        allow: classes (matched by their ``__module__`` and ``__qualname__``; the stream may instantiate them
            and fill them with BUILD), other objects admitted as values, ``"module:qualname"`` strings,
            ``(module, qualname)`` tuples, and :func:`allow_function` entries for functions the stream may call.
        extra: further pairs (plugins' declared safe globals), mapped to the resolved object or None to resolve
            on first use. Each must be a plain function; the stream may call it.
        storage_builder: what ``zerocopy_pickle.rebuild:rebuild_storage`` resolves to in this load.
        resolve_extra: how a pair of ``extra`` mapped to None is resolved (the registry's
            :meth:`~zerocopy_pickle._registry.registry.Registry.resolve_safe_global`, which imports and checks it);
            by default it is imported and must be a plain function.

    Raises:
        ArgumentError: an entry is not one of the accepted forms.
    """

    __slots__ = ("_allowed", "_extra", "_functions", "_resolve_extra", "_resolved", "_safe", "_storage_builder")

    def __init__(
        self,
        allow: AllowSpec = (),
        extra: Mapping[tuple[str, str], object | None] | None = None,
        *,
        storage_builder: object = None,
        resolve_extra: Callable[[str, str], object] | None = None,
    ):
        self._safe = safe_table()
        self._resolve_extra = resolve_extra
        self._extra: dict[tuple[str, str], object | None] = dict(extra) if extra else {}
        self._storage_builder = storage_builder
        allowed: dict[tuple[str, str], object | None] = {}
        functions: set[tuple[str, str]] = set()
        if isinstance(allow, (str, bytes)) or not isinstance(allow, Iterable):
            raise ArgumentError(f"allow= must be a list of entries, not {type(allow).__name__}: wrap it in [...]")
        for item in allow:
            callable_ = isinstance(item, AllowFunction)
            target = item.target if isinstance(item, AllowFunction) else item
            pair, obj = _entry(target)
            if not callable_ and numpy_machinery(pair):
                continue  # Note [NumPy values]: what torch's safe_globals needs for NumPy values, covered here
            if callable_:
                functions.add(pair)
            if obj is not None or pair not in allowed:
                allowed[pair] = obj
        self._allowed = allowed
        self._functions = frozenset(functions)
        self._resolved: dict[tuple[str, str], tuple[object, int]] = {}

    def __contains__(self, pair: object) -> bool:
        return pair in self._safe or pair in self._allowed or pair in self._extra or pair == _STORAGE_PAIR

    def _lookup(self, pair: tuple[str, str]) -> tuple[object, int]:
        """The object a pair resolves to in this load, and how it may be used."""
        known = self._resolved.get(pair)
        if known is not None:
            return known
        entry = self._safe.get(pair)
        if entry is not None:
            result: tuple[object, int] = (entry.value, _SAFE)
        elif pair == _STORAGE_PAIR:
            result = (self._storage_builder or rebuild.rebuild_storage, _STORAGE)
        else:
            if is_blocked(pair):
                raise _blocked_error(pair)
            if pair in self._extra:  # a plugin's function stays callable even if allow= names it too
                obj = self._extra[pair]
                if obj is None:
                    try:
                        obj = (self._resolve_extra or _resolve)(*pair)
                    except PluginError as e:
                        raise RestrictedLoadError(
                            f"refusing to load global {format_global(pair)!r}: {e}", refused=pair
                        ) from e
                if is_blocked(pair, obj):
                    raise _blocked_error(pair)
                if type(obj) is not types.FunctionType:
                    raise RestrictedLoadError(
                        f"refusing to load global {format_global(pair)!r}: a plugin declared it safe, but it is a "
                        f"{type(obj).__name__}, and a plugin's safe globals must be functions that check their "
                        f"arguments",
                        refused=pair,
                    )
                result = (obj, _FUNCTION)
            elif pair in self._allowed:
                obj = self._allowed[pair]
                if obj is None:
                    obj = _resolve(*pair)
                if is_blocked(pair, obj):
                    raise _blocked_error(pair)
                if isinstance(obj, type):
                    use = _CLASS
                elif pair in self._functions:
                    if not callable(obj):
                        raise ArgumentError(f"allow_function({format_global(pair)!r}) names a non-callable object")
                    use = _FUNCTION
                else:
                    use = _VALUE
                result = (obj, use)
            else:
                raise RestrictedLoadError(
                    f"refusing to load global {format_global(pair)!r}: it is not on this load's allow-list",
                    refused=pair,
                )
        self._resolved[pair] = result
        return result

    def find_class(self, module: str, qualname: str) -> object:
        """Resolve ``module:qualname`` if this list allows exactly that pair and it is not blocked.

        Raises:
            RestrictedLoadError: the pair is blocked, or not allowed.
        """
        return self._lookup((module, qualname))[0]

    def admit(self, uses: StreamUses) -> dict[tuple[str, str], object]:
        """Decide whether a stream may run under this list: every global it names must be allowed, every call
        must be of a function the list lets it call or of an allowed class, every NEWOBJ of an allowed class,
        and every BUILD, SETITEM(S), APPEND(S) or ADDITEMS must act on an object that a safe constructor or an
        allowed class created fresh in this load.

        Returns:
            What each named global resolves to (what the unpickler's ``find_class`` returns).

        Raises:
            RestrictedLoadError: naming every global the stream needs that this call does not allow (with the
                ``allow=`` that would), every blocked one, or the use that is not allowed.
        """
        resolved: dict[tuple[str, str], object] = {}
        refused: RestrictedLoadError | None = None
        for pair in uses.globals:
            try:
                resolved[pair] = self._lookup(pair)[0]
            except RestrictedLoadError as e:
                refused = refused or e
        if refused is None:
            refused = self._use_refusal(uses)
        if refused is not None:
            raise refusal_message(refused, self, uses.globals, uses)
        return resolved

    def _use_refusal(
        self, uses: StreamUses, skip: frozenset[tuple[str, str]] = frozenset()
    ) -> RestrictedLoadError | None:
        """The first use of a resolved global that this list does not permit (every global of ``uses`` but
        ``skip`` must have been looked up), or None."""
        for pair in uses.called - skip:
            obj, use = self._resolved[pair]
            if use == _SAFE:
                if not self._safe[pair].callable:
                    return _use_error(pair, "calls", "a value of the safe set, which no load calls")
            elif use == _VALUE:
                what = "function" if callable(obj) else type(obj).__name__
                return _use_error(
                    pair,
                    "calls",
                    f"a {what} that allow= admits as a value only; a load calls a function only if allow= names "
                    f"it with zerocopy_pickle.allow_function(...), with arguments the stream chooses",
                )
        for pair in uses.instantiated - skip:
            obj, use = self._resolved[pair]
            if use != _CLASS:
                return _use_error(pair, "instantiates (NEWOBJ)", "not a class that allow= names")
        for pair, ops in uses.mutated.items():
            if pair in skip:
                continue
            obj, use = self._resolved[pair]
            if use == _SAFE:
                extra_ops = ops - self._safe[pair].result_ops
                if not extra_ops:
                    continue
            elif use == _CLASS and _constructs_fresh(obj):  # type: ignore[arg-type]
                continue
            opcodes = ", ".join(sorted(_OPCODE_NAMES[op] for op in ops))
            return _use_error(
                pair,
                f"applies {opcodes} to an object made by",
                "which a restricted load does not fill: it fills only objects that a safe constructor or an allowed "
                "class with an ordinary __new__ created in this load",
            )
        return None

    def advice(self, uses: StreamUses) -> Advice:
        """What would make a restricted load of a stream that does ``uses`` pass: the whole ``allow=`` to give
        (this list's own entries and the ones it lacks, each a class or value name or an :func:`allow_function`),
        or the reasons no ``allow=`` can.

        The advice follows the rules :meth:`admit` applies, and is then checked by them: a trial list built from
        the suggested entries must admit every use of every global whose kind was known (a global of a module
        not imported yet is never imported here: importing runs the module's code; such names are returned as
        ``unknown``, suggested by how the stream uses them).
        """
        entries: dict[tuple[str, str], bool] = {pair: pair in self._functions for pair in self._allowed}
        needed: list[tuple[str, str]] = []
        unknown: list[tuple[str, str]] = []
        blocked: list[tuple[str, str]] = []
        reasons: list[str] = []
        by_value = sorted({m for m, _ in uses.globals if _by_value_module(m)})
        if by_value:
            reasons.append(f"it holds code pickled by value ({', '.join(by_value)}), and loading it runs that code")
        for pair in uses.globals:
            name = repr(format_global(pair))
            called, made = pair in uses.called, pair in uses.instantiated
            ops = uses.mutated.get(pair, frozenset())
            fills = ", ".join(sorted(_OPCODE_NAMES[op] for op in ops))
            if _by_value_module(pair[0]):
                continue
            safe = self._safe.get(pair)
            if safe is not None or pair == _STORAGE_PAIR:
                if safe is not None and called and not safe.callable:
                    reasons.append(f"it calls {name}, a value of the safe set")
                if made:
                    reasons.append(f"it instantiates {name} (NEWOBJ), which the safe set only calls")
                if safe is not None and ops - safe.result_ops:
                    reasons.append(f"it applies {fills} to what {name} returns")
                continue
            if is_blocked(pair):
                blocked.append(pair)
                continue
            if numpy_machinery(pair) and pair not in self._functions:
                reasons.append(f"it uses {name}, NumPy's own pickle machinery, which allow= does not admit")
                continue
            if pair in self._extra:  # a plugin's safe function: callable, its result never filled
                if made or ops:
                    reasons.append(f"it {'instantiates' if made else 'applies ' + fills + ' to what'} {name} "
                                   f"{'' if made else 'returns '}(a plugin's safe function)")  # fmt: skip
                continue
            obj = self._allowed.get(pair)
            kind = _kind_of(obj) if obj is not None else _classify(pair)
            if kind == "blocked":
                blocked.append(pair)
            elif kind == "class":
                cls = obj if obj is not None else _imported(pair)
                if ops and not (isinstance(cls, type) and _constructs_fresh(cls)):
                    reasons.append(
                        f"it applies {fills} to what {name} makes, and that class has its own __new__ (or "
                        f"metaclass __call__), so the object may not be one this load created"
                    )
                else:
                    entries.setdefault(pair, False)
            elif kind in ("function", "value"):
                if made:
                    reasons.append(f"it instantiates {name} (NEWOBJ), which is not a class")
                elif ops:
                    reasons.append(f"it applies {fills} to what {name} returns, and a restricted load fills only "
                                   f"objects it created")  # fmt: skip
                elif called and kind == "value":
                    reasons.append(f"it calls {name}, which is not callable")
                else:
                    entries[pair] = entries.get(pair, False) or called
            else:  # not imported: allow_function admits a class as a class, and a function to be called
                unknown.append(pair)
                entries[pair] = entries.get(pair, False) or (called and not made and not ops)
            if pair in entries and (pair not in self._allowed or entries[pair] != (pair in self._functions)):
                needed.append(pair)  # missing, or admitted as a value and called
        reasons += [f"{format_global(g)!r} is on the blocklist (it can run code, touch files or the network, or "
                    f"unpickle another stream): no allow= can permit it" for g in blocked]  # fmt: skip
        allow = tuple(allow_function(":".join(pair)) if call else ":".join(pair) for pair, call in entries.items())
        if not reasons:
            trial = AllowList(
                allow, self._extra, storage_builder=self._storage_builder, resolve_extra=self._resolve_extra
            )
            skip = frozenset(unknown)
            try:
                for pair in uses.globals:
                    if pair not in skip:
                        trial._lookup(pair)
                refused = trial._use_refusal(uses, skip)
            except (RestrictedLoadError, MissingGlobalError) as e:
                refused = e  # type: ignore[assignment]
            if refused is not None:
                reasons.append(f"even with those entries, {_unwrapped(str(refused))}")
        return Advice(
            allow=() if reasons else allow,
            needed=tuple(needed),
            unknown=tuple(unknown),
            blocked=tuple(blocked),
            trusted_only=tuple(dict.fromkeys(reasons)),
        )


class Advice(NamedTuple):
    """What :meth:`AllowList.advice` found: ``allow`` (the entries to pass, empty when ``trusted_only``),
    ``needed`` (the globals this call's list lacks), ``unknown`` (names whose module is not imported, whose kind
    could not be checked), ``blocked``, and ``trusted_only`` (why no ``allow=`` can admit the stream)."""

    allow: tuple[str | AllowFunction, ...]
    needed: tuple[tuple[str, str], ...]
    unknown: tuple[tuple[str, str], ...]
    blocked: tuple[tuple[str, str], ...]
    trusted_only: tuple[str, ...]


def _by_value_module(module: str) -> bool:
    """Whether a global's module is one whose functions rebuild code pickled by value (cloudpickle, dill)."""
    return module.partition(".")[0] in ("cloudpickle", "dill")


def spell_allow(entries: Iterable[str | AllowFunction]) -> str:
    """``allow=[...]`` as Python source a user can paste: ``allow=['m:C', zerocopy_pickle.allow_function('m:f')]``."""
    spelled = [f"zerocopy_pickle.allow_function({e.target!r})" if isinstance(e, AllowFunction) else repr(e)
               for e in entries]  # fmt: skip
    return f"allow=[{', '.join(spelled)}]"


def _unwrapped(message: str) -> str:
    """A use refusal's reason, for a sentence of another message."""
    message = message.removeprefix("refusing to load: ").removeprefix("refusing to load ")
    return message.split(". Only trusted=True")[0]


def _imported(pair: tuple[str, str]) -> object:
    """The object an already imported module's attribute path names, or None (nothing is imported)."""
    obj: Any = sys.modules.get(pair[0])
    for part in pair[1].split("."):
        obj = vars(obj).get(part) if obj is not None and hasattr(obj, "__dict__") else None
    return obj


def _kind_of(obj: object) -> str:
    if isinstance(obj, type):
        return "class"
    if _is_blocked_object(obj):
        return "blocked"
    return "function" if callable(obj) else "value"


_STORAGE_PAIR = ("zerocopy_pickle.rebuild", "rebuild_storage")
_OPCODE_NAMES = {"build": "BUILD", "setitem": "SETITEM(S)", "append": "APPEND(S)", "add": "ADDITEMS"}


def _use_error(pair: tuple[str, str], verb: str, reason: str) -> RestrictedLoadError:
    return RestrictedLoadError(
        f"refusing to load: the stream {verb} {format_global(pair)}, {reason}. Only trusted=True loads such a "
        f"stream (do that only if you trust its source)",
        refused=pair,
    )


def _entry(item: object) -> tuple[tuple[str, str], object]:
    """An ``allow=`` entry as ``(pair, object or None)``."""
    if isinstance(item, str):
        name = GlobalName.parse(item)
        if name is None:
            raise ArgumentError(
                f"allow= string {item!r} must have the form 'module:qualname', e.g. 'collections:OrderedDict'"
            )
        return name.pair, None
    if isinstance(item, tuple):
        if len(item) != 2 or not all(isinstance(p, str) and p for p in item):
            raise ArgumentError(f"allow= tuple {item!r:.80} must be (module, qualname), two non-empty strings")
        return (item[0], item[1]), None
    return _pair_of(item), item


def _blocked_error(pair: tuple[str, str]) -> RestrictedLoadError:
    return RestrictedLoadError(
        f"refusing to load global {format_global(pair)!r}: it can run code, touch files or the network, or "
        f"unpickle another stream, and is on the blocklist, which no allow= overrides",
        refused=pair,
        blocked=(pair,),
    )


def _resolve(module: str, qualname: str) -> object:
    """Import an allowed-by-name global. A dotted qualname must lead to a class that names itself so: walking
    attributes never reaches through a module's globals or onto a method."""
    obj = GlobalName(module, qualname).resolve()
    if "." in qualname and not (isinstance(obj, type) and obj.__module__ == module and obj.__qualname__ == qualname):
        raise RestrictedLoadError(
            f"refusing to load global {format_global((module, qualname))!r}: a dotted name must lead to the class "
            f"it names, and this one leads to {type(obj).__name__} {getattr(obj, '__module__', '?')}:"
            f"{getattr(obj, '__qualname__', '?')}",
            refused=(module, qualname),
        )
    return obj


def _classify(pair: tuple[str, str]) -> str:
    """``"class"``, ``"function"`` or ``"unknown"``, without importing anything (a module is looked at only if
    it is imported already: importing a module a hostile stream names runs that module's code)."""
    module = sys.modules.get(pair[0])
    if module is None:
        return "unknown"
    obj: Any = module
    for part in pair[1].split("."):
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            return "unknown"
    if isinstance(obj, type):
        return "class"
    if is_blocked(pair, obj):
        return "blocked"
    return "function" if callable(obj) else "value"


_NUMPY_HINT = (
    "Its NumPy values were pickled by NumPy's own reductions (plain pickle, torch.save, an earlier zerocopy_pickle, "
    "or a dtype restricted loads never rebuild: object, structured, long double): zerocopy_pickle.dump writes "
    "NumPy arrays, scalars and dtypes of numeric and string dtypes with its own checked rebuilds, which load "
    "restricted without allow=, so dumped again from a trusted load of this one, those values load restricted."
)
"""Appended to a trusted-only refusal of a stream that names NumPy (Note [NumPy values] in safeglobals)."""


def refusal_message(
    error: RestrictedLoadError,
    allow_list: AllowList,
    stream_globals: Iterable[tuple[str, str]],
    uses: StreamUses | None = None,
) -> RestrictedLoadError:
    """The error a refused load raises: what was refused, and the one thing that will work — the whole ``allow=``
    to pass (copy-pasteable: class and value names, :func:`allow_function` for what the stream calls), or, at
    once, that only ``trusted=True`` loads the stream and why (code pickled by value, a blocked global, a use
    no allow-list permits). See :meth:`AllowList.advice`; without ``uses`` (``scan``), every global counts as
    named only."""
    if uses is None:
        uses = StreamUses(tuple(dict.fromkeys(stream_globals)), frozenset(), frozenset(), {}, 0)
    advice = allow_list.advice(uses)
    parts = [f"{error} (restricted load)."]
    if advice.trusted_only:
        parts.append(
            f"No allow= can admit this stream: {'; '.join(advice.trusted_only)}. Only trusted=True loads it: do "
            f"that only if you made this snapshot or trust its source completely."
        )
        if any(module == "numpy" or module.startswith("numpy.") for module, _ in uses.globals):
            parts.append(_NUMPY_HINT)
    elif advice.needed:
        names = ", ".join(repr(format_global(g)) for g in advice.needed)
        functions = {e.target for e in advice.allow if isinstance(e, AllowFunction)}
        calls = [g for g in advice.needed if ":".join(g) in functions]
        caveat = (
            f" ({', '.join(repr(format_global(g)) for g in advice.unknown)} could not be checked without importing "
            f"their modules: make sure each is a class or function you trust)"
            if advice.unknown
            else ""
        )
        called = (
            f"; the stream calls {', '.join(repr(format_global(g)) for g in calls)} with arguments it chooses, so "
            f"allow_function admits only a function that checks them"
            if calls
            else ""
        )
        parts.append(
            f"This snapshot needs {len(advice.needed)} global(s) this call does not allow: {names}. If you trust "
            f"where it came from, load it with {spell_allow(advice.allow)} (exactly those, for this call){caveat}"
            f"{called}, or pass trusted=True to unpickle without restrictions."
        )
    else:
        parts.append("Pass trusted=True to unpickle without restrictions (only if you trust its source).")
    return RestrictedLoadError(
        " ".join(parts),
        refused=error.refused,
        needed=advice.needed,
        blocked=advice.blocked,
        allow=advice.allow if not advice.trusted_only else None,
        trusted_only=advice.trusted_only,
    )


def stream_uses(stream: bytes) -> StreamUses:
    """:func:`zerocopy_pickle._trust.semantics.uses`, with a refusal that also says when the stream holds code
    pickled by value (which only a trusted load runs).

    Raises:
        RestrictedLoadError, SnapshotError: as :func:`zerocopy_pickle._trust.semantics.uses`.
    """
    try:
        return semantics.uses(stream)
    except RestrictedLoadError as e:
        try:
            named = walk_stream(stream, collect_globals=True).globals
        except SnapshotError:
            raise e from None
        by_value = sorted({m for m, _ in named if _by_value_module(m)})
        if not by_value:
            raise
        raise RestrictedLoadError(
            f"{e} It holds functions or classes pickled by value ({', '.join(by_value)}): loading them runs their "
            f"code, so only trusted=True loads it, and only if you trust where it came from.",
            refused=e.refused,
            trusted_only=(*e.trusted_only, f"it holds code pickled by value ({', '.join(by_value)})"),
        ) from None


def scan_stream(stream: bytes | bytearray | memoryview) -> tuple[tuple[str, str], ...]:
    """List the globals a pickle stream references, without running it.

    GLOBAL and INST name their global inline; STACK_GLOBAL takes two strings from the stack, which the scan
    follows through string opcodes and the memo. A STACK_GLOBAL fed any other way (possible only in a
    hand-made stream) is reported as ``("<dynamic>", "<dynamic>")``; the load-time check still applies.

    Returns:
        ``(module, qualname)`` pairs in order of first appearance.

    Raises:
        SnapshotError: the stream is malformed or breaks a bound (see :mod:`zerocopy_pickle._trust.streamcheck`).
    """
    return walk_stream(stream, collect_globals=True).globals
