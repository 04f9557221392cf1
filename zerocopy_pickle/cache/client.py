"""Internal: the client side of the cache: keys, requests, loading entries, and falling back to a direct load.

The cache may make a load faster, never make it fail: if the server is absent, dead, slow or broken, or a call
cannot be keyed, :func:`cached_call` calls the original loader directly and warns once per cause.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import queue
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import arena
from .._version import __version__
from ..loadcore import argument
from . import entries
from .isolation import WORKDIR_ENV, child_environment
from .messages import MAX_FILE_CHECKS, Call, EntryReply, Failure, FileCheck, Get, Ping
from .protocol import REQUEST, CacheError, ProtocolError, receive, runtime_dir, send, socket_path

__all__ = ["CacheWarning", "Client", "cached_call", "cached_key", "register_result"]

TIMEOUT_ENV = "ZEROCOPY_PICKLE_CACHE_TIMEOUT"
PREFAULT_ENV = "ZEROCOPY_PICKLE_CACHE_PREFAULT"
MAX_FINGERPRINT_FILES = 100_000


class CacheWarning(UserWarning):
    """The cache could not serve a call, which was loaded directly instead (warned once per cause)."""


class Uncacheable(CacheError):
    """This call cannot be keyed (an argument that cannot be pickled, say): it is loaded directly."""


# -- objects this process got from the cache, by identity ------------------------------------------------------

_CACHED: dict[int, tuple[weakref.ref[Any], str]] = {}
_CACHED_LOCK = threading.Lock()


def register_result(obj: Any, key: str) -> None:
    """Remember that ``obj`` is the cached result of ``key``, so that passing it as an argument travels as a
    reference. Objects that cannot be weakly referenced are not remembered (they travel by value)."""
    identity = id(obj)

    def forget(_: object, identity: int = identity) -> None:
        with _CACHED_LOCK:
            _CACHED.pop(identity, None)

    try:
        ref = weakref.ref(obj, forget)
    except TypeError:
        return
    with _CACHED_LOCK:
        _CACHED[identity] = (ref, key)


def cached_key(obj: Any) -> str | None:
    """The key of the cache entry ``obj`` came from, if it came from one."""
    with _CACHED_LOCK:
        found = _CACHED.get(id(obj))
    if found is not None and found[0]() is obj:
        return found[1]
    return None


class _ArgumentPickler(entries.RefPickler):
    """Pickles a call's arguments, replacing every cached object it meets by a reference (in meeting order)."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, [], by_value=True)
        self.ref_objects: list[Any] = []
        self.ref_keys: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        key = cached_key(obj)
        if key is not None:
            index = self._ref_index.get(id(obj))
            if index is None:
                index = self._ref_index[id(obj)] = len(self.ref_objects)
                self.ref_objects.append(obj)
                self.ref_keys.append(key)
            return argument, (index,)
        return super().reducer_override(obj)


def _stat_row(st: os.stat_result) -> list[int]:
    """A file's identity as a fingerprint row holds it: size, mtime, ctime (ns), inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _fingerprint(path: str) -> list[Any]:
    """What identifies a local file or directory's contents: sizes, modification and change times and inodes of
    every file in it, through symlinks as a loader reads them (a file's link to a blob, a ``vae`` subfolder that
    is a link to ``/shared/vae``: rows name each file by its path under ``path``, and hold the identity of the file
    it leads to, so re-pointing a link changes the key). A link back to a directory above it (a cycle) is not
    followed again. The change time (ctime) is there because a rewrite in place that puts the modification time
    back (``rsync --inplace -t``, ``cp -p``) still sets it, and nobody can set it back.

    Raises:
        Uncacheable: the folder holds more than :data:`MAX_FINGERPRINT_FILES` files and folders.
    """
    root = Path(path)
    if root.is_file():
        st = root.stat()
        return [["", *_stat_row(st)]]
    rows: list[Any] = []
    seen = 0
    # Depth first, each folder with the (device, inode) of the folders above it: a link to one of those is a cycle.
    try:
        top = root.stat()
    except OSError:
        return rows
    stack: list[tuple[Path, str, frozenset[tuple[int, int]]]] = [(root, "", frozenset({(top.st_dev, top.st_ino)}))]
    while stack:
        directory, prefix, above = stack.pop()
        try:
            with os.scandir(directory) as listing:
                children = list(listing)
        except OSError:
            continue
        for child in children:
            seen += 1
            if seen > MAX_FINGERPRINT_FILES:
                raise Uncacheable(f"{path} holds more than {MAX_FINGERPRINT_FILES} files and folders")
            name = prefix + child.name
            try:
                st = child.stat()  # through a link
            except OSError:
                continue  # a dangling link: nothing a loader could read
            if stat.S_ISDIR(st.st_mode):
                identity = (st.st_dev, st.st_ino)
                if identity not in above:
                    stack.append((Path(child.path), name + os.sep, above | {identity}))
            elif stat.S_ISREG(st.st_mode):
                rows.append([name, *_stat_row(st)])
    return sorted(rows)


def _local_paths(value: Any, found: dict[str, list[Any]], depth: int = 0) -> None:
    if depth > 4:
        return
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        if value and len(value) < 4096 and os.path.exists(value):
            found.setdefault(os.path.realpath(value), _fingerprint(value))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _local_paths(item, found, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            _local_paths(item, found, depth + 1)


_COMMIT = re.compile(r"[0-9a-f]{40}")
HUB_POINTS = ("from_pretrained",)
"""Patch points whose first argument may be a Hub repository id (resolved to a commit in the local Hub cache)."""


def _hub_snapshot(point: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """For a ``from_pretrained`` call whose first argument is a Hub repository id rather than a local path: the
    repository, revision and commit it resolves to offline, in the local Hub cache (``cache_dir=``, else
    ``huggingface_hub.constants.HF_HUB_CACHE``: ``HF_HUB_CACHE``, ``HF_HOME``...), and that commit's snapshot
    folder; None for any other call.

    Raises:
        Uncacheable: the commit cannot be known offline (the repository or its ``refs/<revision>`` is not in the
            local cache): the key could not say which weights it names.
    """
    if point.rpartition(".")[2] not in HUB_POINTS:
        return None
    name = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if not isinstance(name, str) or not name or len(name) > 200 or os.path.exists(name):
        return None
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        validate_repo_id(name)
    except ValueError:  # HFValidationError: not a repository id
        return None
    revision = kwargs.get("revision") or "main"
    cache_dir = kwargs.get("cache_dir") or constants.HF_HUB_CACHE
    if not isinstance(revision, str) or not isinstance(cache_dir, (str, os.PathLike)):
        raise Uncacheable(f"{name!r}: a revision or cache_dir that is not a string")
    folder = Path(os.path.abspath(cache_dir), "models--" + name.replace("/", "--"))
    refs = None
    if _COMMIT.fullmatch(revision):
        commit = revision
    else:
        parts = revision.split("/")
        if not all(part and part not in (".", "..") for part in parts):
            raise Uncacheable(f"{name!r}: the revision {revision!r} is not a branch or tag name")
        refs = folder.joinpath("refs", *parts)
        try:
            commit = refs.read_text().strip()
        except (OSError, UnicodeDecodeError):
            raise Uncacheable(
                f"the Hub repository {name!r} at {revision!r} is not in the local Hub cache ({folder}): which "
                "commit it names cannot be known offline, so it is not cached"
            ) from None
        if not _COMMIT.fullmatch(commit):
            raise Uncacheable(f"{refs} does not hold a commit hash")
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        raise Uncacheable(f"the Hub repository {name!r} has no snapshot of commit {commit} in {folder}")
    return {"repo": [name, revision, commit], "snapshot": str(snapshot), "refs": str(refs) if refs else None,
            "cache_dir": str(folder.parent)}  # fmt: skip


def _working_directory() -> str | None:
    """This process's working directory, where the call's relative paths resolve (None if it is gone)."""
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    return cwd if cwd.startswith("/") and "\0" not in cwd and len(cwd) <= 4096 else None


@functools.cache
def _library_version(module: str) -> str:
    """The installed version of ``module``'s distribution (looked up once per process: reading the metadata
    costs about half a millisecond, on every cached call otherwise)."""
    top = module.split(".", maxsplit=1)[0]
    try:
        return importlib.metadata.version(top)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def describe(point: str, cls: type | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request for a call: its key, the function to run, the pickled arguments, the referenced entries.

    The key is a BLAKE2b digest of: the patched function and the class it was called on; the arguments as
    pickled, with cached objects replaced by their entries' keys; a fingerprint of every local file or directory
    an argument names (size, mtime, ctime, inode of each file, through symlinked subfolders: a changed checkpoint
    is a different key); for a ``from_pretrained`` of a Hub repository id, the repository, revision and commit it
    resolves to in the local Hub cache and the fingerprint of that commit's snapshot (the loader is then called
    with ``revision=<commit>`` and that ``cache_dir``, so that it reads what the key names); and the versions of
    zerocopy_pickle, torch and the loader's library.

    Raises:
        Uncacheable: an argument cannot be pickled, or a Hub id's commit cannot be known offline.
    """
    hub = _hub_snapshot(point, args, kwargs)
    if hub is not None:  # the loader reads exactly the commit the key names, from the caller's Hub cache
        kwargs = {**kwargs, "revision": hub["repo"][2], "cache_dir": hub["cache_dir"]}
    out = io.BytesIO()
    pickler = _ArgumentPickler(out)
    try:
        pickler.dump((args, kwargs))
    except Exception as e:
        raise Uncacheable(f"an argument cannot be pickled ({type(e).__name__}: {e})") from e
    finally:
        pickler.clear_memo()
    stream = out.getvalue()
    files: dict[str, list[Any]] = {}
    _local_paths([list(args), {k: v for k, v in kwargs.items() if k != "cache_dir"}], files)
    if hub is not None:
        for path in (hub["snapshot"], hub["refs"]):
            if path is not None:
                files.setdefault(os.path.realpath(path), _fingerprint(path))
    module = point.partition(":")[0]
    import torch

    owner = f"{cls.__module__}:{cls.__qualname__}" if cls is not None else None
    material = {
        "point": point,
        "cls": owner,
        "args": hashlib.blake2b(stream, digest_size=32).hexdigest(),
        "refs": pickler.ref_keys,
        "files": files,
        "hub": hub["repo"] if hub is not None else None,
        "versions": [__version__, torch.__version__, _library_version(module), sys.version_info[:2]],
    }
    key = hashlib.blake2b(json.dumps(material, sort_keys=True, default=str).encode(), digest_size=20).hexdigest()
    # The same identities, by the path the loader opens, for the server to check again on every hit.
    checks = [FileCheck(root if not row[0] else os.path.join(root, row[0]), *row[1:])
              for root, rows in files.items() for row in rows]  # fmt: skip
    if len(checks) > MAX_FILE_CHECKS or len(json.dumps(checks)) > REQUEST.header * 3 // 4:  # as the header holds them
        raise Uncacheable(f"the call's arguments name too many files (at most {MAX_FILE_CHECKS}, in a request)")
    name = f"{cls.__qualname__}.{point.rpartition('.')[2]}" if cls is not None else point.partition(":")[2]
    shown = next((a for a in args if isinstance(a, (str, os.PathLike))), "")
    return {
        "get": Get(
            key,
            Call(point, owner, pickler.ref_keys),
            f"{name}({os.fspath(shown)!r}{', ...' if len(args) + len(kwargs) > 1 else ''})",
            entries.plugin_list(pickler.plugins_used),
            _working_directory(),
            checks,
        ),
        "key": key,
        "payload": stream,
        "ref_objects": pickler.ref_objects,
    }


class Client:
    """A connection to the cache server."""

    def __init__(self, path: Path | None = None, timeout: float = 5.0) -> None:
        self.path = path or socket_path(create=False)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(self.path))
        except OSError as e:
            self.sock.close()
            raise CacheError(f"no cache server at {self.path} ({e.strerror or e})") from e

    def request(
        self, message: Any, payload: bytes = b"", timeout: float | None = None
    ) -> tuple[dict[str, Any], bytes, list[int]]:
        """Send a request (a message of :mod:`messages`, or its encoded header) and return the successful reply's
        header (decode it with its message class), payload and fds (the caller closes them).

        Raises:
            CacheError: the server is gone, out of step, or refused the request (a :class:`messages.Failure`).
        """
        header = message.encode() if hasattr(message, "encode") else message
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            send(self.sock, header, payload)
            reply, data, fds = receive(self.sock)
        except (OSError, ProtocolError) as e:
            raise CacheError(f"the cache server did not answer ({type(e).__name__}: {e})") from e
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise CacheError(Failure.decode(reply).error)
        return reply, data, fds

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Prefaulter:
    """Maps the pages of each entry a hit received into this process's page tables, on a background thread.

    A zero-copy load defers page faults to first use: a forward pass over an SD1.5 pipeline takes about
    900,000 of them. Populating the page tables (``MADV_POPULATE_READ``, no copy: writes still copy on write)
    while the caller unpickles and goes on overlaps that work with the caller's, on another core. One worker
    thread, segments in the order the hits came; ``ZEROCOPY_PICKLE_CACHE_PREFAULT=0`` turns it off.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._supported = True

    def submit(self, mappings: Iterable[Any]) -> None:
        if not self._supported or os.environ.get(PREFAULT_ENV, "1") == "0":
            return
        for memory in mappings:
            self._queue.put(memory)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zerocopy_pickle-prefault", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            memory = self._queue.get()
            if self._supported and not arena.prefault(memory):
                self._supported = False  # an older kernel: faults stay where they fall
            del memory


_prefaulter = _Prefaulter()

_WARNED: set[str] = set()
_state = threading.local()


def _warn_once(cause: str, message: str) -> None:
    if cause not in _WARNED:
        _WARNED.add(cause)
        warnings.warn(f"zerocopy_pickle cache: {message}; loading directly", CacheWarning, stacklevel=4)


def _timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, "3600"))
    except ValueError:
        return 3600.0


def start_server_in_background(wait: float = 10.0) -> None:
    """Start ``zerocopy-pickle serve`` as a detached process and wait until it answers."""
    directory = runtime_dir()
    log = directory / "server.log"
    env = dict(os.environ)
    with contextlib.suppress(OSError):  # relative paths of requests resolve here, as if it ran here
        env[WORKDIR_ENV] = os.getcwd()
    with open(log, "ab") as out:
        # Started in the private runtime directory, not here: Python puts its start directory first on sys.path,
        # and this one may hold anybody's modules (see isolation.py).
        subprocess.Popen(
            [sys.executable, "-m", "zerocopy_pickle.cache", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            cwd=directory,
            env=child_environment(env, cleaned=False),
        )
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with Client(timeout=1.0) as client:
                client.request(Ping())
            return
        except CacheError:
            time.sleep(0.05)
    raise CacheError(f"the cache server did not start within {wait:.0f} s (see {log})")


def cached_call(
    point: str,
    cls: type | None,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    autostart: bool = False,
) -> Any:
    """Serve ``original(*args, **kwargs)`` (called as ``cls.<method>`` when ``cls`` is given) from the cache.

    Calls made while another cached call is running in this thread (a pipeline's own component loads, or a
    direct load after a fallback) go straight to ``original``.
    """
    if getattr(_state, "depth", 0) or os.environ.get("ZEROCOPY_PICKLE_CACHE_LOADER"):
        return original(*args, **kwargs)
    _state.depth = 1
    try:
        try:
            request = describe(point, cls, args, kwargs)
        except Uncacheable as e:
            _warn_once(f"uncacheable:{point}", str(e))
            return original(*args, **kwargs)
        try:
            result = _fetch(request, args, kwargs, autostart=autostart)
        except CacheError as e:
            _warn_once(f"error:{type(e).__name__}", str(e))
            return original(*args, **kwargs)
        register_result(result, request["key"])
        return result
    finally:
        _state.depth = 0


def _fetch(request: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, autostart: bool) -> Any:
    try:
        client = Client()
    except CacheError:
        if not autostart:
            raise
        start_server_in_background()
        client = Client()
    with client:
        header, stream, fds = client.request(request["get"], request["payload"], timeout=_timeout())
    try:
        reply = EntryReply.decode(header, len(fds))
        mappings = entries.map_segments(reply.segments, fds)
    finally:
        for fd in fds:
            os.close(fd)
    _prefaulter.submit(mappings.values())
    refs = request["ref_objects"] + entries.argument_slots(args, kwargs)
    try:
        return entries.load_entry(stream, reply.buffers, mappings, refs, reply.plugins)
    except CacheError:
        raise
    except Exception as e:
        raise CacheError(f"the cached entry does not load here ({type(e).__name__}: {e})") from e
