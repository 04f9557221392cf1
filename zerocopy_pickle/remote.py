"""Internal: snapshots at URLs (fsspec): fetched once into a local cache directory, verified, then mapped.

:func:`zerocopy_pickle.load` given a URL (``s3://bucket/model.zcp``, ``https://...``, ``memory://...``; any
protocol fsspec knows but ``file``) calls :func:`fetch`, which returns a local file to map:

* one cached file per URL in :func:`remote_dir`, named by the URL's digest, with the remote object's identity
  (size and ETag or modification time, from ``fs.info``) beside it: a later load of an unchanged object maps the
  cached file without downloading; a changed one is fetched again;
* the download goes to ``<name>.part`` in windows of :data:`WINDOW` bytes; an interrupted one is resumed from
  where it stopped, if the remote object is still the same;
* before the file is renamed into place (atomically), its header is decoded, its size must be the size the
  header declares, and the stream's and every buffer's checksums are verified (a snapshot dumped with
  ``checksums=False`` is refused: nothing would detect corruption). A download that fails verification is
  deleted, never mapped;
* concurrent fetches of one URL, in threads or processes, take a lock file: one downloads, the others wait and
  map its result.

:func:`upload` is :func:`zerocopy_pickle.dump` to a URL: the snapshot is written to a local temporary file, then
put with ``fs.put_file`` (object stores replace an object whole; readers never see half of it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from . import integrity, progress, sources
from .errors import ArgumentError, IntegrityError, SnapshotError, ZeroCopyPickleError
from .native import cache_dir

__all__ = ["DIR_ENV", "WINDOW", "fetch", "is_url", "remote_dir", "upload"]

DIR_ENV = "ZEROCOPY_PICKLE_REMOTE_DIR"
"""The environment variable that sets :func:`remote_dir`."""

WINDOW = 8 << 20
"""Bytes per ranged read of a download (and the granularity a resumed download restarts at)."""

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*(::|://)")
log = logging.getLogger(__name__)


def is_url(target: object) -> bool:
    """Whether ``target`` is a URL for fsspec (``proto://...`` or a chained ``a::b://...``), not a local path
    (``file://`` URLs count as local: they are mapped where they are)."""
    return isinstance(target, str) and bool(_URL.match(target)) and not target.startswith("file://")


def remote_dir() -> Path:
    """Where fetched snapshots are kept: ``$ZEROCOPY_PICKLE_REMOTE_DIR``, else ``remote/`` under the library's
    cache directory (``$ZEROCOPY_PICKLE_CACHE``, ``$XDG_CACHE_HOME/zerocopy_pickle`` or
    ``~/.cache/zerocopy_pickle``). Nothing is evicted: delete files there to reclaim space."""
    explicit = os.environ.get(DIR_ENV)
    return Path(explicit).expanduser() if explicit else cache_dir() / "remote"


def _filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise ArgumentError(
            f"loading or dumping {url!r:.80} needs fsspec: pip install 'zerocopy-pickle[remote]' (and the "
            f"package of the protocol, such as s3fs for s3://)"
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise ArgumentError(f"cannot open {url!r:.80}: {e}") from e
    return fs, path


def _identity(fs: Any, path: str, url: str) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)  # what the object is now, not what this process listed before
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no snapshot at {url}") from None
    if info.get("type") not in (None, "file"):
        raise SnapshotError(f"{url} is a {info.get('type')}, not a snapshot file")
    size = info.get("size")
    if not isinstance(size, int):
        raise SnapshotError(f"{url}: the server does not say how large it is; a snapshot must have a known size")
    version = next((info[k] for k in ("ETag", "etag", "VersionId", "mtime", "LastModified", "created") if info.get(k)),
                   None)  # fmt: skip
    return {"url": url, "size": size, "version": str(version) if version is not None else None}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def fetch(url: str, storage_options: Mapping[str, Any] | None = None) -> Path:
    """The local, verified copy of the snapshot at ``url``, downloaded if it is not cached or changed.

    Raises:
        FileNotFoundError: nothing at ``url``.
        SnapshotError: the download is not a well-formed snapshot of the size the server declared (truncated,
            or not a snapshot), or it has no checksums; the download was deleted.
        IntegrityError: a checksum does not match (corrupt in transit or at rest); the download was deleted.
        ArgumentError: fsspec (or the protocol's package) is not installed, or the URL is malformed.
        OSError: the download failed (it resumes from where it stopped next time).
    """
    fs, path = _filesystem(url, storage_options)
    identity = _identity(fs, path, url)
    directory = remote_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    name = hashlib.sha256(url.encode()).hexdigest()[:40]
    final, meta = directory / f"{name}.zcp", directory / f"{name}.json"
    part, part_meta = directory / f"{name}.part", directory / f"{name}.part.json"
    with _locked(directory / f"{name}.lock"):
        if _read_json(meta) == identity and final.is_file() and final.stat().st_size == identity["size"]:
            log.info("fetch %s: unchanged, using the local copy %s", url, final)
            return final
        if _read_json(part_meta) != identity or not identity["version"]:
            part.unlink(missing_ok=True)  # another object (or one that cannot say whether it changed): start over
            _write_json(part_meta, identity)
        log.info("fetch %s: downloading %d bytes into %s", url, identity["size"], final)
        _download(lambda start, stop: fs.cat_file(path, start=start, end=stop), part, identity["size"], url)
        try:
            _verify(part, url)
        except BaseException:
            part.unlink(missing_ok=True)
            part_meta.unlink(missing_ok=True)
            raise
        meta.unlink(missing_ok=True)  # a crash before the new identity is written must not leave the old one
        os.replace(part, final)
        _write_json(meta, identity)
        part_meta.unlink(missing_ok=True)
        return final


def _download(read: Callable[[int, int], bytes], part: Path, size: int, url: str) -> None:
    """Append ``[len(part), size)`` of the object to ``part``, one window at a time, each flushed as written:
    an interruption leaves a prefix to resume from."""
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        done = os.fstat(fd).st_size
        if done > size:
            os.ftruncate(fd, 0)
            done = 0
        done -= done % WINDOW  # resume at a window boundary
        os.ftruncate(fd, done)
        with progress.bar(size - done, f"fetch {url:.60}") as report:  # what is left: a resumed download's rest
            while done < size:
                stop = min(done + WINDOW, size)
                try:
                    data = read(done, stop)
                except (OSError, ZeroCopyPickleError):
                    raise
                except Exception as e:  # the protocol's own errors (aiohttp's, botocore's): the transfer broke
                    raise OSError(f"{url}: the download stopped at byte {done} of {size} ({type(e).__name__}: {e}); "
                                  f"the next load resumes it") from e  # fmt: skip
                if len(data) != stop - done:
                    raise SnapshotError(
                        f"{url}: asked for bytes {done}-{stop} of {size}, got {len(data)}: the object changed or "
                        f"the server ignores ranges"
                    )
                view = memoryview(data)
                while view:
                    view = view[os.pwrite(fd, view, done + (stop - done) - len(view)) :]
                if report is not None:
                    report(stop - done)
                done = stop
    finally:
        os.close(fd)


def _verify(part: Path, url: str) -> None:
    fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise SnapshotError(f"{url} is empty, not a snapshot")
        header = sources.read_header(sources.at_fd(fd), size)
        if header.total_nbytes != size:
            raise SnapshotError(f"{url}: the snapshot declares {header.total_nbytes} bytes, the download has {size}")
        if header.checksums is None:
            raise SnapshotError(
                f"{url} was dumped without checksums: a download could not be verified; dump it with "
                f"checksums=True (the default)"
            )
        try:
            integrity.verify_file(header, fd)
        except IntegrityError as e:
            raise IntegrityError(f"{url}: the download is corrupt: {e}") from e
    finally:
        os.close(fd)


def upload(url: str, write: Callable[[Path], None], storage_options: Mapping[str, Any] | None = None) -> None:
    """Write a snapshot with ``write(local_path)`` into a temporary file, then put it at ``url``.

    Raises:
        ArgumentError: fsspec (or the protocol's package) is missing, or the protocol cannot be written.
        OSError: the upload failed (nothing at ``url`` changed, for object stores).
    """
    fs, path = _filesystem(url, storage_options)
    if getattr(fs, "read_only", False) or type(fs).__name__ == "HTTPFileSystem":
        raise ArgumentError(f"cannot dump to {url!r:.80}: {type(fs).__name__} is read-only")
    with tempfile.TemporaryDirectory(prefix="zcp-upload-") as scratch:
        local = Path(scratch) / "snapshot.zcp"
        write(local)
        log.info("upload %s: %d bytes", url, local.stat().st_size)
        fs.put_file(str(local), path)
