"""Internal: a cached call's key and request: the arguments pickled with cached objects as references, the
fingerprint of every local file they name, a Hub id's commit, the versions (:func:`describe`), and the table of
objects this process got from the cache (:func:`register_result`, :func:`cached_key`).

Nothing here talks to the server: the client sends what :func:`describe` returns (docs/cache.md, "How it works").
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import json
import os
import re
import stat
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._core.loadcore import argument
from .._names import GlobalName
from .._storage.fileid import FileIdentity
from .._version import __version__
from . import entries
from .fields import MAX_FILE_CHECKS, Call, FileCheck
from .messages import Get
from .points import split_point
from .protocol import REQUEST, CacheError


@dataclass(frozen=True)
class Request:
    """A call as the cache asks for it (:func:`describe`)."""

    get: Get
    """The message sent to the server: the key, the call, what it names, the files to check on a hit."""
    key: str
    payload: bytes
    """The arguments as pickled, cached objects as references (the loader unpickles them to make the call)."""
    ref_objects: list[Any]
    """The cached objects among the arguments, in the order the references number them."""
    kwargs: dict[str, Any]
    """The keyword arguments as the loader is to call it (a Hub id pinned to the commit the key names)."""


MAX_FINGERPRINT_FILES = 100_000


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


class _NeedsByValue(Exception):
    """An argument is a function or a class: the arguments are pickled again, by value where they must be."""


class _ArgumentPickler(entries.RefPickler):
    """Pickles a call's arguments, replacing every cached object it meets by a reference (in meeting order).

    With ``stop_at_code`` it raises :class:`_NeedsByValue` at the first function or class: :func:`_pickle_arguments`
    then pickles them again with ``by_value``. Nearly every call's arguments (paths, dtypes, configs) hold none, and
    so never import cloudpickle (1.5-2 ms of a process's first hit) or build its pickler.
    """

    def __init__(self, file: Any, *, by_value: bool, stop_at_code: bool) -> None:
        super().__init__(file, [], by_value=by_value)
        self._stop_at_code = stop_at_code
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
        if self._stop_at_code and isinstance(obj, (types.FunctionType, type)):
            raise _NeedsByValue
        return super().reducer_override(obj)


def _stat_row(st: os.stat_result) -> list[int]:
    """A file's identity as a fingerprint row holds it after the file's name: a :class:`FileIdentity`'s fields
    (the checks the server makes on every hit are built from these rows, so both come from one definition)."""
    return list(FileIdentity.of(st))


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
    stack: list[tuple[Path, str, frozenset[tuple[int, int]]]] = [(root, "", frozenset({FileIdentity.of(top).file}))]
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
                folder = FileIdentity.of(st).file
                if folder not in above:
                    stack.append((Path(child.path), name + os.sep, above | {folder}))
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
    """The installed version of ``module``'s top-level package: its ``__version__`` where it is imported and
    says one (transformers, diffusers, peft: the loader's module is imported by the time it is called), else its
    distribution's metadata. Looked up once per process: parsing a distribution's metadata costs 5-15 ms, on
    the caller's path at its first miss."""
    top = module.split(".", maxsplit=1)[0]
    version = getattr(sys.modules.get(top), "__version__", None)
    if isinstance(version, str) and version:
        return version
    try:
        return importlib.metadata.version(top)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _pickle_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bytes, _ArgumentPickler]:
    """A call's arguments as the key pickles them, and their pickler (its ``ref_objects`` and ``ref_keys``):
    plainly when they hold no function or class; else again, functions and classes by value where plain pickle
    cannot take them, when cloudpickle is installed (:func:`entries.by_value`; without it, by reference).

    Raises:
        Uncacheable: an argument cannot be pickled.
    """
    try:
        return _dump_arguments(args, kwargs, by_value=False, stop_at_code=entries.by_value())
    except _NeedsByValue:
        return _dump_arguments(args, kwargs, by_value=True, stop_at_code=False)


def _dump_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, by_value: bool, stop_at_code: bool
) -> tuple[bytes, _ArgumentPickler]:
    out = io.BytesIO()
    pickler = _ArgumentPickler(out, by_value=by_value, stop_at_code=stop_at_code)
    try:
        pickler.dump((args, kwargs))
    except _NeedsByValue:
        raise
    except Exception as e:
        raise Uncacheable(f"an argument cannot be pickled ({type(e).__name__}: {e})") from e
    finally:
        pickler.clear_memo()
    return out.getvalue(), pickler


def describe(point: str, cls: type | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Request:
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
    stream, pickler = _pickle_arguments(args, kwargs)
    files: dict[str, list[Any]] = {}
    _local_paths([list(args), {k: v for k, v in kwargs.items() if k != "cache_dir"}], files)
    if hub is not None:
        for path in (hub["snapshot"], hub["refs"]):
            if path is not None:
                files.setdefault(os.path.realpath(path), _fingerprint(path))
    module = split_point(point).module
    import torch

    owner = str(GlobalName(cls.__module__, cls.__qualname__)) if cls is not None else None
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
    checks = [FileCheck(root if not row[0] else os.path.join(root, row[0]), FileIdentity(*row[1:]))
              for root, rows in files.items() for row in rows]  # fmt: skip
    sent = [c.encode() for c in checks]  # as the header holds them
    if len(checks) > MAX_FILE_CHECKS or len(json.dumps(sent)) > REQUEST.header * 3 // 4:
        raise Uncacheable(f"the call's arguments name too many files (at most {MAX_FILE_CHECKS}, in a request)")
    name = f"{cls.__qualname__}.{point.rpartition('.')[2]}" if cls is not None else split_point(point).qualname
    shown = next((a for a in args if isinstance(a, (str, os.PathLike))), "")
    get = Get(
        key,
        Call(point, owner, pickler.ref_keys),
        f"{name}({os.fspath(shown)!r}{', ...' if len(args) + len(kwargs) > 1 else ''})",
        entries.plugin_list(pickler.plugins_used),
        _working_directory(),
        checks,
    )
    return Request(get, key, stream, pickler.ref_objects, kwargs)
