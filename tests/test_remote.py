"""Snapshots at URLs: fetched once into the local cache, verified, resumed, then mapped; dumps upload.

Against real servers on loopback, started here: an HTTP server (ranges, ETags, and faults on demand: a
connection cut mid-body, a corrupted byte, a truncated file) and an S3 endpoint (moto's server mode, through
s3fs); and fsspec's memory and local filesystems.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import remote


@pytest.fixture(autouse=True)
def remote_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "remote-cache"
    monkeypatch.setenv(remote.DIR_ENV, str(directory))
    return directory


def state(seed: int = 0, n: int = 40_000) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(n), "b": torch.arange(10.0)}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cached_files(directory: Path) -> list[str]:
    return sorted(p.suffix for p in directory.iterdir()) if directory.exists() else []


class Server(http.server.ThreadingHTTPServer):
    """Serves files from ``root`` with ranges and ETags; ``faults`` says what to break next."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.root = root
        self.log: list[tuple[str, str, str | None]] = []
        self.cut_at: int | None = None  # absolute offset at which the next GET stops sending (once)
        self.corrupt_at: int | None = None  # absolute offset of a byte every GET flips
        self.lock = threading.Lock()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"

    def gets(self) -> list[str | None]:
        return [rng for method, _, rng in self.log if method == "GET"]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self.serve(head=True)

    def do_GET(self) -> None:
        self.serve(head=False)

    def serve(self, head: bool) -> None:
        path = self.server.root / self.path.lstrip("/")
        rng = self.headers.get("Range")
        with self.server.lock:
            self.server.log.append((self.command, self.path, rng))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start, stop, status = 0, len(data), 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if match:
            start, status = int(match[1]), 206
            stop = min(int(match[2]) + 1, len(data)) if match[2] else len(data)
        body = bytearray(data[start:stop])
        if self.server.corrupt_at is not None and start <= self.server.corrupt_at < stop:
            body[self.server.corrupt_at - start] ^= 0xFF
        stat = path.stat()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        cut = self.server.cut_at
        if cut is not None and start <= cut < stop:
            self.server.cut_at = None
            self.wfile.write(body[: cut - start])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    root = tmp_path / "served"
    root.mkdir()
    srv = Server(root)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(remote, "WINDOW", 64 << 10)
    return 64 << 10


# ---------------------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------------------


def test_an_http_snapshot_is_fetched_once_and_mapped(server: Server, remote_dir: Path, small_windows: int) -> None:
    zp.dump(state(), server.root / "m.zcp")
    size = (server.root / "m.zcp").stat().st_size
    loaded = zp.load(server.url("m.zcp"))
    assert equal(loaded, state())
    windows = -(-size // small_windows)
    assert len(server.gets()) == windows, "the download in windows"
    assert cached_files(remote_dir) == [".json", ".lock", ".zcp"]
    again = zp.load(server.url("m.zcp"))
    assert equal(again, state()) and len(server.gets()) == windows, "unchanged: nothing fetched again"
    cached = next(remote_dir.glob("*.zcp"))
    assert cached.read_bytes() == (server.root / "m.zcp").read_bytes()
    # The load maps the cached file (its storages are views of it).
    with open("/proc/self/maps") as maps:
        assert str(cached) in maps.read()


def test_a_changed_object_is_fetched_again(server: Server, small_windows: int) -> None:
    zp.dump(state(0), server.root / "m.zcp")
    old = zp.load(server.url("m.zcp"))
    zp.dump(state(1), server.root / "m.zcp")  # a new file (new inode): a new ETag
    assert equal(zp.load(server.url("m.zcp")), state(1))
    assert equal(old, state(0)), "a load already made keeps its own mapping"


def test_an_interrupted_download_fails_clearly_and_resumes(
    server: Server, remote_dir: Path, small_windows: int
) -> None:
    zp.dump(state(n=200_000), server.root / "m.zcp")
    size = (server.root / "m.zcp").stat().st_size
    server.cut_at = 5 * small_windows + 1000
    with pytest.raises(OSError, match="the download stopped at byte .* the next load resumes it"):
        zp.load(server.url("m.zcp"))
    assert not list(remote_dir.glob("*.zcp")), "nothing mapped or kept as a snapshot"
    assert next(remote_dir.glob("*.part")).stat().st_size == 5 * small_windows
    before = len(server.gets())
    assert equal(zp.load(server.url("m.zcp")), state(n=200_000))
    resumed = server.gets()[before:]
    assert resumed[0] == f"bytes={5 * small_windows}-{6 * small_windows - 1}", "resumed where it stopped"
    assert len(resumed) == -(-size // small_windows) - 5
    assert not list(remote_dir.glob("*.part"))


def test_a_corrupt_download_is_detected_deleted_and_never_mapped(server: Server, remote_dir: Path) -> None:
    zp.dump(state(), server.root / "m.zcp")
    header = zp.read_header(server.root / "m.zcp")
    server.corrupt_at = header.buffer_range(0)[0] + 100
    with pytest.raises(zp.IntegrityError, match="the download is corrupt"):
        zp.load(server.url("m.zcp"))
    assert cached_files(remote_dir) == [".lock"], "the download was deleted"
    server.corrupt_at = None
    assert equal(zp.load(server.url("m.zcp")), state())


def test_a_truncated_snapshot_on_the_server_is_refused(server: Server, remote_dir: Path) -> None:
    data = zp.dumps(state())
    (server.root / "m.zcp").write_bytes(data[: len(data) - 4096])
    with pytest.raises(zp.SnapshotError):
        zp.load(server.url("m.zcp"))
    assert not list(remote_dir.glob("*.zcp"))


def test_a_snapshot_without_checksums_cannot_be_verified(server: Server) -> None:
    zp.dump(state(), server.root / "m.zcp", checksums=False)
    with pytest.raises(zp.SnapshotError, match="without checksums"):
        zp.load(server.url("m.zcp"))


def test_nothing_there_and_read_only_protocols(server: Server) -> None:
    with pytest.raises(FileNotFoundError, match="no snapshot at"):
        zp.load(server.url("missing.zcp"))
    with pytest.raises(zp.ArgumentError, match="read-only"):
        zp.dump(state(), server.url("m.zcp"))


def test_concurrent_loads_of_one_url_fetch_it_once(server: Server, small_windows: int) -> None:
    zp.dump(state(n=100_000), server.root / "m.zcp")
    size = (server.root / "m.zcp").stat().st_size
    results: list[Any] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            results.append(zp.load(server.url("m.zcp")))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(results) == 4 and all(equal(r, state(n=100_000)) for r in results)
    assert len(server.gets()) == -(-size // small_windows), "one download for four loads"


class Config:
    def __init__(self, steps: int) -> None:
        self.steps = steps


def test_a_url_load_is_restricted_like_a_file(server: Server) -> None:
    zp.dump({"c": Config(3)}, server.root / "m.zcp")
    with pytest.raises(zp.RestrictedLoadError, match="tests.test_remote:Config"):
        zp.load(server.url("m.zcp"))
    assert zp.load(server.url("m.zcp"), allow=[Config])["c"].steps == 3


# ---------------------------------------------------------------------------------------------------------
# S3 (moto's server), memory and local
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    from moto.server import ThreadedMotoServer

    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        monkeypatch.setenv(name, value)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "skip_instance_cache": True}
    import s3fs

    with contextlib.suppress(FileExistsError):  # moto's backend is one per process: made by an earlier test
        s3fs.S3FileSystem(**options).mkdir("models")
    yield options
    moto.stop()


@pytest.mark.slow
def test_dump_to_s3_and_load_back(s3: dict[str, Any], remote_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    downloads: list[str] = []
    real = remote._download
    monkeypatch.setattr(remote, "_download", lambda *args: (downloads.append(args[4]), real(*args))[1])
    url = "s3://models/unet.zcp"
    zp.dump(state(0), url, storage_options=s3)
    assert equal(zp.load(url, storage_options=s3), state(0))
    assert equal(zp.load(url, storage_options=s3), state(0))
    assert downloads == [url], "the second load maps the cached copy"
    zp.dump(state(1), url, storage_options=s3)  # a new object: a new ETag
    assert equal(zp.load(url, storage_options=s3), state(1))
    assert downloads == [url, url]
    with pytest.raises(FileNotFoundError):
        zp.load("s3://models/missing.zcp", storage_options=s3)


def test_an_s3_endpoint_that_ignores_range_is_cut_off_after_the_window(
    s3: dict[str, Any], small_windows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint that answers every ranged GET with the whole object: the client takes the window and the
    slack from the body (counted through a wrapper around the body's ``read``) and refuses; s3fs's own
    ``cat_file`` would have read the whole body."""
    import s3fs

    url = "s3://models/ignores-range.zcp"
    zp.dump(state(0, n=400_000), url, storage_options=s3)  # 1.6 MB: 25 windows
    real = s3fs.S3FileSystem._call_s3
    taken: list[int] = []

    async def ignoring_range(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("Range", None)
        response = await real(self, method, *args, **kwargs)
        if method == "get_object":
            body, read = response["Body"], response["Body"].read

            async def counting(n: int = -1) -> bytes:
                data: bytes = await read(n)
                taken.append(len(data))
                return data

            body.read = counting
        return response

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", ignoring_range)
    with pytest.raises(zp.SnapshotError, match="the endpoint sent more"):
        zp.load(url, storage_options=s3)
    assert small_windows < sum(taken) <= small_windows + remote.SLACK, taken
    fs, path = remote._filesystem(url, s3)
    with pytest.raises(zp.SnapshotError, match="ignores Range"):  # past the start: refused before the body
        remote._reader(fs, path, url)(small_windows, 2 * small_windows)


def test_memory_and_local_urls() -> None:
    url = f"memory://bucket/{hashlib.sha256(os.urandom(8)).hexdigest()}.zcp"
    zp.dump(state(), url)
    assert equal(zp.load(url), state())


def test_file_urls_are_local_paths(tmp_path: Path, remote_dir: Path) -> None:
    zp.dump(state(), f"file://{tmp_path}/m.zcp")
    assert (tmp_path / "m.zcp").is_file()
    assert equal(zp.load(f"file://{tmp_path}/m.zcp"), state())
    assert not remote_dir.exists(), "nothing fetched: mapped where it is"
    assert remote.is_url("s3://b/k") and remote.is_url("simplecache::s3://b/k")
    assert not remote.is_url("/tmp/x") and not remote.is_url("file:///tmp/x") and not remote.is_url(Path("s3://b"))


def test_fsspecs_local_filesystem_goes_through_the_cache(tmp_path: Path, remote_dir: Path) -> None:
    url = f"local://{tmp_path}/m.zcp"
    zp.dump(state(), url)  # fsspec's LocalFileSystem: put_file
    assert (tmp_path / "m.zcp").is_file()
    assert equal(zp.load(url), state())
    assert cached_files(remote_dir) == [".json", ".lock", ".zcp"]


def test_a_download_leaves_the_large_folios_a_sequential_read_leaves(server: Server, remote_dir: Path) -> None:
    # What the download writes stays in the page cache for the load that maps it: written in order, window by
    # window, it is in large folios (a later mapped load faults once per folio), as after a plain sequential read.
    from tests.test_readahead import touch_faults
    from tests.test_transfer import evict

    big = {f"w{i}": torch.randn(1 << 20) for i in range(24)}  # 96 MiB
    zp.dump(big, server.root / "big.zcp")
    zp.load(server.url("big.zcp"), prefetch=False)
    (cached,) = remote_dir.glob("*.zcp")
    downloaded = touch_faults(cached)
    evict(cached)
    with open(cached, "rb") as f:
        while f.read(8 << 20):
            pass
    sequential = touch_faults(cached)
    assert downloaded <= 1.5 * sequential + 64, (downloaded, sequential)


# ---------------------------------------------------------------------------------------------------------
# The download directory: private, never through symlinks
# ---------------------------------------------------------------------------------------------------------


def file_name(url: str, suffix: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:40] + suffix


def test_a_download_directory_open_to_others_is_refused(server: Server, remote_dir: Path) -> None:
    zp.dump(state(), server.root / "m.zcp")
    remote_dir.mkdir(mode=0o700)
    remote_dir.chmod(0o777)
    with pytest.raises(remote.UnsafeDirectoryError, match=f"{re.escape(str(remote_dir))}.*chmod 700"):
        zp.load(server.url("m.zcp"))
    assert not server.gets(), "refused before anything was downloaded"
    remote_dir.chmod(0o700)
    assert equal(zp.load(server.url("m.zcp")), state())


def test_a_symlinked_download_directory_is_refused(server: Server, remote_dir: Path, tmp_path: Path) -> None:
    zp.dump(state(), server.root / "m.zcp")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    remote_dir.symlink_to(elsewhere)
    with pytest.raises(remote.UnsafeDirectoryError, match=f"{re.escape(str(remote_dir))} is not a plain directory"):
        zp.load(server.url("m.zcp"))
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("suffix", [".lock", ".part", ".part.json", ".json", ".zcp"])
def test_a_symlink_planted_at_a_file_name_is_never_followed(
    server: Server, remote_dir: Path, tmp_path: Path, suffix: str
) -> None:
    zp.dump(state(), server.root / "m.zcp")
    url = server.url("m.zcp")
    remote_dir.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_bytes(b"do not touch")
    (remote_dir / file_name(url, suffix)).symlink_to(target)
    if suffix in (".part", ".zcp"):  # names a download removes or replaces whole: the link goes, never followed
        assert equal(zp.load(url), state())
        assert not (remote_dir / file_name(url, suffix)).is_symlink()
    else:
        with pytest.raises(remote.UnsafeDirectoryError, match=f"{re.escape(file_name(url, suffix))}.*rm "):
            zp.load(url)
    assert target.read_bytes() == b"do not touch"


def test_a_load_maps_the_file_that_was_verified_whatever_its_name_points_to_later(
    monkeypatch: pytest.MonkeyPatch, remote_dir: Path, tmp_path: Path
) -> None:
    # The download directory's parents are not checked: someone who controls one can swap the directory between
    # the fetch and the open. A load maps the fd opened under the lock, never the path again.
    url = f"memory://bucket/{hashlib.sha256(os.urandom(8)).hexdigest()}.zcp"
    zp.dump(state(0), url)
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    fetch = remote._fetch

    def fetch_then_swap(*args: Any) -> tuple[int, Path]:
        fd, local = fetch(*args)
        zp.dump(state(1), planted / local.name)
        remote_dir.rename(tmp_path / "moved-away")
        remote_dir.symlink_to(planted)
        return fd, local

    monkeypatch.setattr(remote, "_fetch", fetch_then_swap)
    assert equal(zp.load(url), state(0))


def test_a_fifo_planted_at_a_file_name_does_not_block(server: Server, remote_dir: Path) -> None:
    zp.dump(state(), server.root / "m.zcp")
    url = server.url("m.zcp")
    remote_dir.mkdir(mode=0o700)
    for suffix in (".lock", ".json"):
        os.mkfifo(remote_dir / file_name(url, suffix))
        with pytest.raises(remote.UnsafeDirectoryError, match="not a regular file"):
            zp.load(url)
        os.unlink(remote_dir / file_name(url, suffix))


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root (os.chown)")
def test_a_download_directory_of_another_user_is_refused(server: Server, remote_dir: Path) -> None:
    zp.dump(state(), server.root / "m.zcp")
    remote_dir.mkdir(mode=0o700)
    os.chown(remote_dir, 65534, 65534)
    with pytest.raises(remote.UnsafeDirectoryError, match=f"{re.escape(str(remote_dir))} belongs to uid 65534"):
        zp.load(server.url("m.zcp"))
    os.chown(remote_dir, 0, 0)
    url = server.url("m.zcp")
    (remote_dir / file_name(url, ".lock")).touch(mode=0o600)
    os.chown(remote_dir / file_name(url, ".lock"), 65534, 65534)  # a file of someone else's inside
    with pytest.raises(remote.UnsafeDirectoryError, match="uid 65534"):
        zp.load(url)


# ---------------------------------------------------------------------------------------------------------
# A server that ignores Range: the client stops after the window, without buffering the body
# ---------------------------------------------------------------------------------------------------------


class Flood(http.server.BaseHTTPRequestHandler):
    """Claims a huge object and answers every GET with all of it (ignoring Range), or with a 206 that goes on past
    the range (``server.mode``); counts what it managed to write before the client hung up."""

    protocol_version = "HTTP/1.1"
    server: FloodServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(self.server.size))
        self.send_header("ETag", '"flood"')
        self.end_headers()

    def do_GET(self) -> None:
        rng = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        start = int(rng[1]) if rng else 0
        if self.server.mode == "ignore":
            self.send_response(200)
            self.send_header("Content-Length", str(self.server.size))
        else:
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{self.server.size - 1}/{self.server.size}")
            self.send_header("Content-Length", str(self.server.size - start))
        self.end_headers()
        chunk, sent = b"\0" * (64 << 10), 0
        try:
            while sent < self.server.size:
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            pass
        finally:
            self.server.sent.append(sent)
            self.server.done.set()
            self.close_connection = True


class FloodServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str, size: int) -> None:
        super().__init__(("127.0.0.1", 0), Flood)
        self.mode, self.size = mode, size
        self.sent: list[int] = []
        self.done = threading.Event()


@pytest.mark.parametrize("mode", ["ignore", "overlong"])
def test_a_server_sending_more_than_a_window_is_cut_off_after_the_window(
    mode: str, small_windows: int, remote_dir: Path
) -> None:
    size = 1 << 30  # claimed and sent (zeros, made as they go), never held by either side
    flood = FloodServer(mode, size)
    thread = threading.Thread(target=flood.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{flood.server_address[1]}/big.zcp"
        with pytest.raises(zp.SnapshotError, match="the server sent more"):
            remote.fetch(url)
        assert flood.done.wait(120), "the client hung up (waited for, not timed)"
        # What the server managed to write: the window and the slack the client read, plus what the kernel's
        # socket buffers held: nowhere near the gigabyte it tried to send.
        assert flood.sent[0] < small_windows + remote.SLACK + (32 << 20), flood.sent
        if mode == "ignore":  # a window past the start: refused on the status line, no body read at all
            import fsspec

            fs, path = fsspec.core.url_to_fs(url)
            with pytest.raises(zp.SnapshotError, match="ignores Range"):
                remote._reader(fs, path, url)(small_windows, 2 * small_windows)
    finally:
        flood.shutdown()
        flood.server_close()


def test_a_ranged_read_takes_at_most_the_window_and_the_slack(small_windows: int) -> None:
    """Bytes the client takes from the response, counted through a wrapper around aiohttp's stream reader."""
    import aiohttp

    flood = FloodServer("ignore", 1 << 30)
    thread = threading.Thread(target=flood.serve_forever, daemon=True)
    thread.start()
    taken: list[int] = []
    real = aiohttp.StreamReader.read

    async def counting(self: Any, n: int = -1) -> bytes:
        data: bytes = await real(self, n)
        taken.append(len(data))
        return data

    try:
        url = f"http://127.0.0.1:{flood.server_address[1]}/big.zcp"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(aiohttp.StreamReader, "read", counting)
            with pytest.raises(zp.SnapshotError, match="the server sent more"):
                remote.fetch(url)
        assert small_windows < sum(taken) <= small_windows + remote.SLACK, taken
    finally:
        flood.shutdown()
        flood.server_close()
