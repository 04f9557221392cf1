"""Restricted loading: which globals a stream may name, what no allow-list can permit, and what a stream needs.

Pickle resolves every class and function a stream names through ``Unpickler.find_class``; anything it
returns can be called. A restricted load answers ``find_class`` from an :class:`AllowList`: the built-in
safe set (tensors, storages, containers, primitives, this library's rebuild functions), plugins' declared
safe globals, and what the caller passes for that one call. Three rules hold whatever the list says:

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
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import rebuild
from .errors import ArgumentError, RestrictedLoadError
from .streamcheck import walk_stream

__all__ = ["AllowList", "AllowSpec", "format_global", "is_blocked", "refusal_message", "safe_globals", "scan_stream"]

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
        "numpy.testing", "numpy.f2py", "numpy.distutils", "numpy.lib.npyio",
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
       ("numpy", "fromfile"), ("numpy", "memmap"), ("numpy", "save"), ("numpy", "savez")}
)  # fmt: skip


def _module_blocked(module: str) -> bool:
    parts = module.split(".")
    return any(".".join(parts[:i]) in BLOCKED_MODULES for i in range(1, len(parts) + 1))


@functools.lru_cache(maxsize=1)
def _blocked_objects() -> frozenset[int]:
    """ids of the blocked callables themselves, to refuse them under any alias (``io.open``, ``pty.spawn``, ...)."""
    objects: list[Any] = [getattr(builtins, name) for _, name in BLOCKED_NAMES if hasattr(builtins, name)]
    objects += [
        os.system, os.popen, os.execv, os.execve, os.spawnv, os.fork, os.remove, os.unlink, os.rmdir, os.open,
        os.kill, io.open, pickle.loads, pickle.load, pickle.Unpickler, torch.load, torch.save, torch.jit.load,
        importlib.import_module, types.FunctionType, types.CodeType, types.MethodType,
    ]  # fmt: skip
    objects += [getattr(torch.serialization, "load", None), getattr(torch.hub, "load", None)]
    return frozenset(id(o) for o in objects if o is not None)


def is_blocked(pair: tuple[str, str], obj: object = None) -> bool:
    """Whether a global can never be allowed: by its name, or (when resolved) by what it is."""
    module, qualname = pair
    if pair in BLOCKED_NAMES or _module_blocked(module) or (module, qualname.split(".")[0]) in BLOCKED_NAMES:
        return True
    if obj is not None:
        if id(obj) in _blocked_objects():
            return True
        owner = getattr(obj, "__module__", None)
        if isinstance(owner, str) and _module_blocked(owner):
            return True
    return False


def format_global(pair: tuple[str, str]) -> str:
    """``("collections", "OrderedDict")`` -> ``"collections:OrderedDict"``, the form ``allow=`` takes."""
    return f"{pair[0]}:{pair[1]}"


def _pair_of(obj: Any) -> tuple[str, str]:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise ArgumentError(
            f"allow= entries must be classes, functions, 'module:qualname' strings or (module, qualname) "
            f"tuples; {obj!r:.80} has no __module__/__qualname__ (pass its 'module:qualname' string instead)"
        )
    return module, qualname


@functools.lru_cache(maxsize=1)
def safe_globals() -> Mapping[tuple[str, str], object]:
    """The built-in safe set: every global a stream of tensors, storages and containers needs.

    Constructors that turn a small argument into a large object (``bytes(n)``, ``bytearray(n)``, ``range``)
    are left out: they would let a few bytes of stream allocate gigabytes.

    Returns:
        A read-only mapping from ``(module, qualname)`` to the object it resolves to. It is computed once;
        nothing ever adds to it.
    """
    objects: list[Any] = [
        # Containers and primitives that pickle by reference rather than by opcode.
        collections.OrderedDict,
        collections.defaultdict,
        collections.deque,
        collections.Counter,
        *(list, dict, set, frozenset, tuple, int, float, complex, bool, str, slice),
        # Tensors and parameters (what Tensor.__reduce_ex__ and Parameter.__reduce_ex__ name).
        torch._utils._rebuild_tensor,
        torch._utils._rebuild_tensor_v2,
        torch._utils._rebuild_tensor_v3,
        torch._utils._rebuild_parameter,
        torch._utils._rebuild_parameter_with_state,
        torch._utils._rebuild_qtensor,
        torch._utils._rebuild_nested_tensor,
        torch._utils._rebuild_meta_tensor_no_storage,
        torch._tensor._rebuild_from_type_v2,
        torch.serialization._get_layout,
        torch.Tensor,
        torch.Size,
        torch.device,
        torch.nn.Parameter,
        torch.nn.Buffer,
        # This library's storage rebuilders.
        rebuild.rebuild_storage,
        rebuild.rebuild_tensor,
        rebuild.rebuild_typed_storage,
        rebuild.rebuild_meta_storage,
    ]
    table: dict[tuple[str, str], object] = {_pair_of(obj): obj for obj in objects}
    # torch builds sparse tensors without checking their indices, and checks them after torch.load: a
    # restricted load builds them checked, at once (indices out of bounds would read out of bounds later).
    table["torch._utils", "_rebuild_sparse_tensor"] = rebuild.rebuild_sparse_tensor_checked
    # dtypes, qschemes and memory formats pickle as module attributes: ("torch", "float16").
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.qscheme, torch.memory_format)):
            table["torch", name] = value
    return types.MappingProxyType(table)


class AllowList:
    """The globals one load may resolve: the built-in safe set plus this call's ``allow=``.

    Args:
        allow: classes or functions (matched by their ``__module__`` and ``__qualname__``), strings
            ``"module:qualname"``, or ``(module, qualname)`` tuples.
        extra: further pairs to allow (plugins' declared safe globals), mapped to the resolved object or
            None to import on first use.

    Raises:
        ArgumentError: an entry is not one of the accepted forms.
    """

    __slots__ = ("_allowed", "_safe")

    def __init__(self, allow: AllowSpec = (), extra: Mapping[tuple[str, str], object | None] | None = None):
        self._safe = safe_globals()
        allowed: dict[tuple[str, str], object | None] = dict(extra) if extra else {}
        if isinstance(allow, (str, bytes)) or not isinstance(allow, Iterable):
            raise ArgumentError(f"allow= must be a list of entries, not {type(allow).__name__}: wrap it in [...]")
        for item in allow:
            if isinstance(item, str):
                module, sep, qualname = item.partition(":")
                if not sep or not module or not qualname or ":" in qualname:
                    raise ArgumentError(
                        f"allow= string {item!r} must have the form 'module:qualname', e.g. 'collections:OrderedDict'"
                    )
                allowed.setdefault((module, qualname), None)
            elif isinstance(item, tuple):
                if len(item) != 2 or not all(isinstance(p, str) and p for p in item):
                    raise ArgumentError(f"allow= tuple {item!r:.80} must be (module, qualname), two non-empty strings")
                allowed.setdefault((item[0], item[1]), None)
            else:
                allowed[_pair_of(item)] = item
        self._allowed = allowed

    def __contains__(self, pair: object) -> bool:
        return pair in self._safe or pair in self._allowed

    def find_class(self, module: str, qualname: str) -> object:
        """Resolve ``module:qualname`` if this list allows exactly that pair and it is not blocked.

        Raises:
            RestrictedLoadError: the pair is blocked, or not allowed (the caller adds the full list of what
                the stream needs; see :func:`scan_stream`).
        """
        pair = (module, qualname)
        obj = self._safe.get(pair)
        if obj is not None:
            return obj
        if is_blocked(pair):
            raise _blocked_error(pair)
        try:
            obj = self._allowed[pair]
        except KeyError:
            raise RestrictedLoadError(
                f"refusing to load global {format_global(pair)!r}: it is not on this load's allow-list",
                refused=pair,
            ) from None
        if obj is None:
            obj = _resolve(module, qualname)
        if is_blocked(pair, obj):
            raise _blocked_error(pair)
        return obj


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
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if "." in qualname and not (isinstance(obj, type) and obj.__module__ == module and obj.__qualname__ == qualname):
        raise RestrictedLoadError(
            f"refusing to load global {format_global((module, qualname))!r}: a dotted name must lead to the class "
            f"it names, and this one leads to {type(obj).__name__} {getattr(obj, '__module__', '?')}:"
            f"{getattr(obj, '__qualname__', '?')}",
            refused=(module, qualname),
        )
    return obj


def refusal_message(
    error: RestrictedLoadError, allow_list: AllowList, stream_globals: Iterable[tuple[str, str]]
) -> RestrictedLoadError:
    """The error a refused load raises: what was refused, every global the stream needs that this call does
    not allow (as the exact ``allow=`` that would accept them), and every blocked one (which only a trusted
    load accepts)."""
    blocked = tuple(g for g in stream_globals if is_blocked(g))
    needed = tuple(g for g in stream_globals if g not in allow_list and g not in blocked)
    parts = [f"{error} (restricted load)."]
    if needed:
        names = ", ".join(repr(format_global(g)) for g in needed)
        parts.append(
            f"This snapshot needs {len(needed)} global(s) that this call does not allow: {names}. If you trust "
            f"where it came from, pass allow=[{names}] to allow exactly those for this call"
            + ("." if blocked else ", or trusted=True to unpickle without restrictions.")
        )
    by_value = sorted({m for m, _ in (*needed, *blocked) if m.split(".")[0] in ("cloudpickle", "dill")})
    if by_value:
        parts.append(
            f"It holds functions or classes pickled by value ({', '.join(by_value)}): loading them runs their "
            f"code, so only trusted=True loads it, and only if you trust where it came from."
        )
    if blocked:
        names = ", ".join(repr(format_global(g)) for g in blocked)
        parts.append(
            f"It names {len(blocked)} blocked global(s) that no allow= can permit: {names}. Only trusted=True "
            f"loads it: do that only if you made this snapshot or trust its source completely."
        )
    elif not needed:
        parts.append("Pass trusted=True to unpickle without restrictions.")
    return RestrictedLoadError(" ".join(parts), refused=error.refused, needed=needed, blocked=blocked)


def scan_stream(stream: bytes | bytearray | memoryview) -> tuple[tuple[str, str], ...]:
    """List the globals a pickle stream references, without running it.

    GLOBAL and INST name their global inline; STACK_GLOBAL takes two strings from the stack, which the scan
    follows through string opcodes and the memo. A STACK_GLOBAL fed any other way (possible only in a
    hand-made stream) is reported as ``("<dynamic>", "<dynamic>")``; the load-time check still applies.

    Returns:
        ``(module, qualname)`` pairs in order of first appearance.

    Raises:
        SnapshotError: the stream is malformed or breaks a bound (see :mod:`zerocopy_pickle.streamcheck`).
    """
    return walk_stream(stream, collect_globals=True).globals
