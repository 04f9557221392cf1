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
  map its result;
* the directory gets the checks of the cache's private directories (:func:`private_directory`: a plain
  directory, not a symlink, owned by this user, no access for group or others), made on the opened directory, and
  every file in it is created or opened relative to that fd with ``O_NOFOLLOW`` and used only if it is a regular
  file of this user: nobody else can plant what a load maps (an :class:`UnsafeDirectoryError` says what is wrong
  and how to fix it);
* over HTTP and S3, each window is read as a stream and the read stops at the window's size: a server that
  ignores ``Range`` (answering with the whole object) or sends more than was asked is refused after at most
  :data:`WINDOW` + :data:`SLACK` bytes, never buffered whole (other protocols' clients read a window's body
  whole, then it is checked);
* a load maps the verified file through the fd opened under the URL's lock (:func:`open_fetched`), never by its
  name again.

:func:`upload` is :func:`zerocopy_pickle.dump` to a URL: the snapshot is written to a local temporary file, then
put with ``fs.put_file`` (object stores replace an object whole; readers never see half of it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .._home import home_dir
from ..errors import ArgumentError, IntegrityError, SnapshotError, ZeroCopyPickleError
from . import atomic, integrity, progress, sources
from .fileid import FileIdentity

DIR_ENV = "ZEROCOPY_PICKLE_REMOTE_DIR"
"""The environment variable that sets :func:`remote_dir`."""

WINDOW = 8 << 20
"""Bytes per ranged read of a download (and the granularity a resumed download restarts at)."""

SLACK = 64 << 10
"""Bytes an HTTP window's read may take beyond the window (its last read piece) before it stops: what a server
sends beyond the window is an error, never buffered."""

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*(::|://)")
log = logging.getLogger(__name__)


def is_url(target: object) -> bool:
    """Whether ``target`` is a URL for fsspec (``proto://...`` or a chained ``a::b://...``), not a local path
    (``file://`` URLs count as local: they are mapped where they are)."""
    return isinstance(target, str) and bool(_URL.match(target)) and not target.startswith("file://")


def remote_dir() -> Path:
    """Where fetched snapshots are kept: ``$ZEROCOPY_PICKLE_REMOTE_DIR``, else ``remote/`` under the library's
    files (``$ZEROCOPY_PICKLE_HOME``, ``$XDG_CACHE_HOME/zerocopy_pickle`` or ``~/.cache/zerocopy_pickle``).
    Nothing is evicted: delete files there to reclaim space."""
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return home_dir() / "remote"


class UnsafeDirectoryError(ZeroCopyPickleError, PermissionError):
    """The download directory (or a file in it) could have been prepared or changed by someone else: a symlink,
    another user's, or accessible to others. The message names the path and what to do."""


def private_directory(
    path: Path,
    *,
    create: bool = True,
    what: str = "directory",
    error: Callable[[str], Exception] = UnsafeDirectoryError,
) -> int:
    """An ``O_DIRECTORY`` fd of ``path`` (the caller closes it), after checking that nobody else can have
    prepared or can change what is in it: a plain directory (not a symlink), owned by this user, without any
    access for group or others. Created with mode 0700 (and missing parents) when ``create``.

    The checks are made on the opened directory (``O_NOFOLLOW``), so a name swapped after the check is not
    what gets used: open what is inside relative to the fd (``dir_fd=``). The one implementation of these checks:
    the model cache's runtime and persistence directories use it too (``cache/protocol.py``, which may import this
    layer; this one may not import the cache).

    Raises:
        ``error`` (:class:`UnsafeDirectoryError` by default): the directory is missing (``create=False``), is a
            symlink or not a directory, belongs to another user, or is accessible to others; the message says how
            to fix it.
    """
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700, parents=True)
    try:
        info = os.lstat(path)
    except FileNotFoundError as e:
        raise error(f"the {what} {path} does not exist") from e
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise error(
            f"the {what} {path} is not a plain directory (a symlink or a file): refusing to use it; "
            "name a directory of your own instead"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"the {what} {path} cannot be opened as a plain directory ({e.strerror})") from e
    try:
        opened = os.fstat(fd)
        if not FileIdentity.of(opened).same_file(info):
            raise error(f"the {what} {path} was replaced while it was being checked: refusing to use it")
        if opened.st_uid != os.getuid():
            raise error(
                f"the {what} {path} belongs to uid {opened.st_uid}, not to you (uid {os.getuid()}): refusing to "
                "use it, since whoever owns it controls what is in it; name a directory of your own instead"
            )
        if opened.st_mode & 0o077:
            raise error(
                f"the {what} {path} is accessible to other users (mode {stat.S_IMODE(opened.st_mode):o}); "
                f"it must be 0700: chmod 700 {path}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def _open(directory: int, name: str, flags: int, where: Path) -> int:
    """``name`` in the checked directory ``directory`` (its fd), never through a symlink, and only if it is a
    regular file of this user that nobody else may write (``O_NONBLOCK``: a FIFO planted there never blocks)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=directory)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR, errno.EISDIR):
            raise UnsafeDirectoryError(
                f"{where / name} is not a regular file (a symlink, a FIFO or a directory someone put there): "
                f"refusing to use it; remove it (rm {where / name}) and load again"
            ) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise UnsafeDirectoryError(
                f"{where / name} is not a regular file of yours that only you may write (uid {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):o}): refusing to use it; remove it (rm {where / name}) and load again"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _locked(directory: int, name: str, where: Path) -> Iterator[None]:
    fd = _open(directory, name, os.O_RDWR | os.O_CREAT, where)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_json(directory: int, name: str, where: Path) -> Any:
    try:
        fd = _open(directory, name, os.O_RDONLY, where)
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(1 << 16)  # an identity is a few hundred bytes
        return json.loads(data)
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def _write_json(directory: int, name: str, value: Any) -> None:
    atomic.write(directory, name, json.dumps(value).encode())


def _unlink(directory: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=directory)


def _size_of_file(directory: int, name: str) -> int | None:
    """The size of ``name`` if it is a regular file of this user (never following a symlink), else None."""
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        return None
    return info.st_size


def fetch(url: str, storage_options: Mapping[str, Any] | None = None) -> Path:
    """The local, verified copy of the snapshot at ``url``, downloaded if it is not cached or changed.

    The path is for reading and showing; a load maps the file :func:`open_fetched` opened, not whatever the path
    names later (a parent directory of :func:`remote_dir` is not checked).

    Raises:
        FileNotFoundError: nothing at ``url``.
        SnapshotError: the download is not a well-formed snapshot of the size the server declared (truncated,
            or not a snapshot), or it has no checksums, or the server sent more than a window asked for (it
            ignores ``Range``); the download was deleted.
        IntegrityError: a checksum does not match (corrupt in transit or at rest); the download was deleted.
        UnsafeDirectoryError: the download directory, or a file in it, is not private to this user (a symlink,
            another user's, or open to others): the message names the path and the fix.
        ArgumentError: fsspec (or the protocol's package) is not installed, or the URL is malformed.
        OSError: the download failed (it resumes from where it stopped next time).
    """
    fd, local = _fetch(url, storage_options)
    os.close(fd)
    return local


def open_fetched(url: str, storage_options: Mapping[str, Any] | None = None) -> io.FileIO:
    """:func:`fetch`, returning the verified local copy as an open, unbuffered file (the caller closes it).

    The file is opened relative to the checked download directory's fd, with ``O_NOFOLLOW``, and checked to be a
    regular file of this user that only this user may write, all while the URL's lock is held: what a load maps
    is the file that was verified, even if a directory above :func:`remote_dir` is someone else's and its names
    change later. Raises as :func:`fetch` does.
    """
    fd, _ = _fetch(url, storage_options)
    return io.FileIO(fd, "rb", closefd=True)


def _fetch(url: str, storage_options: Mapping[str, Any] | None) -> tuple[int, Path]:
    """An fd of the verified local copy of ``url`` (opened under the lock, see :func:`open_fetched`), and its
    path."""
    fs, path = _filesystem(url, storage_options)
    identity = _identity(fs, path, url)
    where = remote_dir()
    directory = private_directory(where, what="download directory of URL loads")
    try:
        name = hashlib.sha256(url.encode()).hexdigest()[:40]
        final, meta = f"{name}.zcp", f"{name}.json"
        part, part_meta = f"{name}.part", f"{name}.part.json"
        with _locked(directory, f"{name}.lock", where):
            if _read_json(directory, meta, where) == identity and _size_of_file(directory, final) == identity["size"]:
                log.info("fetch %s: unchanged, using the local copy %s", url, where / final)
                return _open(directory, final, os.O_RDONLY, where), where / final
            if _read_json(directory, part_meta, where) != identity or not identity["version"]:
                _unlink(directory, part)  # another object (or one that cannot say whether it changed): start over
                _write_json(directory, part_meta, identity)
            log.info("fetch %s: downloading %d bytes into %s", url, identity["size"], where / final)
            _download(_reader(fs, path, url), directory, part, identity["size"], url, where)
            try:
                _verify(directory, part, url, where)
            except BaseException:
                _unlink(directory, part)
                _unlink(directory, part_meta)
                raise
            _unlink(directory, meta)  # a crash before the new identity is written must not leave the old one
            # Not atomic.replacing: the download is written into `part` window by window, across processes and
            # interrupted runs (it resumes), and verified there; a failure must keep it to resume from, so only
            # its final rename is done here.
            os.replace(part, final, src_dir_fd=directory, dst_dir_fd=directory)
            _write_json(directory, meta, identity)
            _unlink(directory, part_meta)
            return _open(directory, final, os.O_RDONLY, where), where / final
    finally:
        os.close(directory)


Reader = Callable[[int, int], bytes | bytearray]
"""Bytes ``[start, stop)`` of the remote object."""


def _reader(fs: Any, path: str, url: str) -> Reader:
    """How to read a window of the object: over HTTP (:func:`_http_window`) and S3 (:func:`_s3_window`) a
    streamed ranged GET that stops at the window's size; elsewhere ``fs.cat_file`` (local and in-memory
    filesystems, and protocols whose clients this module does not know: their body is read whole, then
    checked)."""
    kind = type(fs).__name__
    if kind == "HTTPFileSystem" and all(hasattr(fs, name) for name in ("set_session", "encode_url", "kwargs", "loop")):
        from fsspec.asyn import sync

        return lambda start, stop: sync(fs.loop, _http_window, fs, path, url, start, stop)
    if kind == "S3FileSystem" and all(hasattr(fs, name) for name in ("_call_s3", "split_path", "loop")):
        from fsspec.asyn import sync

        return lambda start, stop: sync(fs.loop, _s3_window, fs, path, url, start, stop)
    return lambda start, stop: fs.cat_file(path, start=start, end=stop)


async def _take(read: Callable[[int], Any], want: int, too_much: Callable[[int], Exception]) -> bytearray:
    """At most ``want`` bytes from an async ``read(n)`` (the body of a response), read as they arrive; one
    :data:`SLACK`-sized piece more is taken to see whether the answer goes on, and then ``too_much(received)``
    is raised: the rest of the body is never read."""
    received = bytearray()
    while True:
        piece = await read(min(SLACK, want + 1 - len(received)))
        if not piece:
            return received
        received += piece
        if len(received) > want:
            raise too_much(len(received))


async def _s3_window(fs: Any, path: str, url: str, start: int, stop: int) -> bytearray:
    """Bytes ``[start, stop)`` of an S3 object (s3fs), streamed: at most ``stop - start`` + :data:`SLACK` bytes
    are taken from the body, whatever the endpoint sends (s3fs's own ``cat_file`` reads a body whole).

    Raises:
        SnapshotError: the endpoint ignored the range or sent more than was asked.
    """
    bucket, key, version = fs.split_path(path)
    response = await fs._call_s3(
        "get_object",
        Bucket=bucket,
        Key=key,
        Range=f"bytes={start}-{stop - 1}",
        **({"VersionId": version} if version else {}),
    )
    body = response["Body"]
    try:
        content_range = response.get("ContentRange")
        if not (isinstance(content_range, str) and content_range.startswith(f"bytes {start}-")) and start > 0:
            raise SnapshotError(
                f"{url}: asked for bytes {start}-{stop}, the endpoint answered {str(content_range)[:80]!r}: it "
                f"ignores Range, which a download needs"
            )
        return await _take(
            body.read,
            stop - start,
            lambda got: SnapshotError(
                f"{url}: asked for bytes {start}-{stop} ({stop - start} bytes), the endpoint sent more: refused "
                f"after {got} bytes; serve it from an endpoint that answers ranges exactly"
            ),
        )
    finally:
        body.close()  # hang up: the rest of an over-long answer is never read


async def _http_window(fs: Any, path: str, url: str, start: int, stop: int) -> bytearray:
    """Bytes ``[start, stop)`` over HTTP, read as they arrive: at most ``stop - start`` + :data:`SLACK` bytes are
    taken from the response, whatever the server sends.

    Raises:
        SnapshotError: the server ignored the range (a whole-object answer to a ranged request past the start) or
            sent more than was asked; the rest of its answer is never read.
    """
    want = stop - start
    options = dict(fs.kwargs)
    headers = dict(options.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{stop - 1}"
    headers.setdefault("Accept-Encoding", "identity")  # the range is of the object's bytes, not of a compression
    session = await fs.set_session()
    async with session.get(fs.encode_url(path), headers=headers, **options) as response:
        if response.status == 404:
            raise FileNotFoundError(f"no snapshot at {url}")
        response.raise_for_status()
        if response.status != 206 and start > 0:
            response.close()  # hang up: the rest of a whole-object answer is never read
            raise SnapshotError(
                f"{url}: asked for bytes {start}-{stop} and got the whole object (HTTP {response.status}): the "
                f"server ignores Range, which a download needs; serve it from a server that supports ranges"
            )
        content_range = response.headers.get("Content-Range")
        if response.status == 206 and content_range is not None and not content_range.startswith(f"bytes {start}-"):
            response.close()
            raise SnapshotError(f"{url}: asked for bytes {start}-{stop}, the server sent {content_range[:80]!r}")
        try:
            return await _take(
                response.content.read,
                want,
                lambda got: SnapshotError(
                    f"{url}: asked for bytes {start}-{stop} ({want} bytes), the server sent more"
                    f"{' (it ignores Range)' if response.status != 206 else ''}: refused after {got} bytes; serve "
                    f"it from a server that answers ranges exactly"
                ),
            )
        except SnapshotError:
            response.close()
            raise


def _download(read: Reader, directory: int, part: str, size: int, url: str, where: Path) -> None:
    """Append ``[len(part), size)`` of the object to ``part``, one window at a time, each flushed as written:
    an interruption leaves a prefix to resume from."""
    fd = _open(directory, part, os.O_WRONLY | os.O_CREAT, where)
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


def _verify(directory: int, part: str, url: str, where: Path) -> None:
    fd = _open(directory, part, os.O_RDONLY, where)
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
