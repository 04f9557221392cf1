"""Internal: the blocklist of restricted loads: the globals no ``allow=`` can admit, by name and by the identity of
what a name resolves to.

Modules and functions that execute code, spawn processes, touch files or the network, or unpickle nested
streams (:data:`BLOCKED_MODULES`, :data:`BLOCKED_NAMES`). :func:`is_blocked` matches a global by its name, its
owning module and, once resolved, by what it is, so an alias in a harmless-looking module is refused too. Every
check of a name reads a bounded prefix of it (:func:`_module_blocked`).
"""

from __future__ import annotations

import builtins
import functools
import importlib
import io
import os
import pickle
import sys
import threading
import types
from typing import Any

import torch

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
