"""The model cache against a hostile neighbour: bounded messages, a persistence directory someone else
prepared or changed, and a server or loader started in a directory holding someone's modules."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.internals import arena, writes
from zerocopy_pickle.cache import persistence, protocol
from zerocopy_pickle.cache.client import Client
from zerocopy_pickle.cache.fields import PLACES, BufferRow, decode_buffer_table, encode_buffer_table
from zerocopy_pickle.cache.lru import Entry
from zerocopy_pickle.cache.persistence import KEY_FILE
from zerocopy_pickle.cache.store import Store

from .cache_helpers import ServerProcess, private_dir
from .conftest import REPO

NOBODY = 65534

# -- the wire ---------------------------------------------------------------------------------------------------


def test_a_huge_declared_length_is_refused_before_allocating() -> None:
    for prefix in (struct.pack("<II", 2, 0xFFFF_FFFF), struct.pack("<II", protocol.REQUEST.header + 1, 0)):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            theirs.sendall(prefix)  # and nothing more: the receiver must not wait for (or reserve) the rest
            with pytest.raises(protocol.ProtocolError, match="refused"):
                protocol.receive(ours, protocol.REQUEST)


def test_a_message_is_read_whole_in_pieces_and_a_short_one_is_an_error() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    payload = os.urandom(3 << 20)  # several read pieces, more than a socket buffer
    with ours, theirs:
        sender = threading.Thread(target=protocol.send, args=(theirs, {"op": "x"}, payload))
        sender.start()
        header, data, fds = protocol.receive(ours, protocol.REQUEST)
        sender.join()
        assert header == {"op": "x"} and data == payload and fds == []
        theirs.sendall(struct.pack("<II", 2, 10) + b"{}abc")
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(protocol.ProtocolError, match="hung up 7 bytes before the end"):
            protocol.receive(ours, protocol.REQUEST)


def test_file_descriptors_beyond_a_kinds_limit_are_refused_and_closed() -> None:
    memfd = arena.create_memfd("test")
    before = len(os.listdir("/proc/self/fd"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    one = protocol.Limits(header=1 << 20, payload=1 << 20, fds=1)
    with ours, theirs:
        protocol.send(theirs, {"op": "ping"}, fds=[memfd, memfd])
        with pytest.raises(protocol.ProtocolError, match="file descriptors"):
            protocol.receive(ours, one)
    assert len(os.listdir("/proc/self/fd")) == before  # what arrived was closed
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        protocol.send(theirs, {"op": "ping"}, fds=[memfd, memfd])
        _, _, fds = protocol.receive(ours, protocol.ENTRY)
        assert len(fds) == 2
        for fd in fds:
            os.close(fd)
    os.close(memfd)


def test_buffer_tables_are_checked() -> None:
    row = ["segment", 1, 0, 8, "cpu", None]
    assert decode_buffer_table([row]) == [BufferRow(1, 0, 8, "cpu", None)]
    assert encode_buffer_table(decode_buffer_table([row])) == [row]
    for bad in (
        {},
        [["segment", 1, -1, 8, "cpu", None]],
        [["segment", 1, 0, "8", "cpu", None]],
        [["segment", 1, 0, 8]],
        [None],
        [[1, 0, 8, "cpu", None]],  # the old positional row, without a place
        [["segment", 0, 0, 8, "cpu", None]],  # a store segment id is positive
        [["new", 3, 0, 8, "cpu", None]],  # the new segment is 0
        [["elsewhere", 1, 0, 8, "cpu", None]],
        [["segment", 1, 0, 8, "cpu", 7]],
        [["segment", True, 0, 8, "cpu", None]],
    ):
        with pytest.raises(protocol.ProtocolError):
            decode_buffer_table(bad)
    with pytest.raises(protocol.ProtocolError, match="place"):  # what a client may get: store segments only
        decode_buffer_table([["file", 0, 0, 8, "cpu", None]])
    for file_index in (0, 1, 7):  # the i-th file a loader sent: any index (checked against the files sent)
        row = decode_buffer_table([["file", file_index, 0, 8, "cpu", None]], places=PLACES)[0]
        assert (row.place, row.segment) == ("file", file_index)


# -- the persistence directory ----------------------------------------------------------------------------------


def persisted_store(tmp_path: Path) -> tuple[Path, Path]:
    """A persistence directory holding one entry ("a": b"hello" in one segment), and the key's directory."""
    persist, keys = tmp_path / "persist", tmp_path / "keys"
    keys.mkdir(mode=0o700, exist_ok=True)
    store = Store(persist=persist, key_dir=keys)
    fd = arena.create_memfd("test-segment")
    os.write(fd, b"hello")
    arena.seal(fd)
    store.add(Entry("a", "call a", b"stream", [BufferRow(0, 0, 5, "cpu", None, "new")], []), fd)
    store.close()
    return persist, keys


def test_the_persistence_directory_is_created_private(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)
    assert stat.S_IMODE(persist.stat().st_mode) == 0o700
    for file in persist.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    key = keys / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_size == 32
    again = Store(persist=persist, key_dir=keys)  # the same key, read back: warm
    assert list(again.entries) == ["a"] and again.cold_start is None
    assert again.segments[1].kind == "memfd" and fcntl.fcntl(again.segments[1].fd, fcntl.F_GET_SEALS) & arena.SEALS
    again.close()


def test_a_symlinked_or_open_persistence_directory_is_refused(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(persist)
    with pytest.raises(protocol.CacheError, match="not a plain directory"):
        Store(persist=link, key_dir=keys)
    os.chmod(persist, 0o770)
    with pytest.raises(protocol.CacheError, match="chmod 700"):
        Store(persist=persist, key_dir=keys)
    os.chmod(persist, 0o700)


def test_files_inside_are_not_followed(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)
    index = persist / "index.json"
    real = tmp_path / "elsewhere.json"
    index.rename(real)
    index.symlink_to(real)  # a link to the right bytes is still refused
    store = Store(persist=persist, key_dir=keys)
    assert not store.entries and "cannot be opened as a plain file" in (store.cold_start or "")
    store.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory another user owns")
def test_a_persistence_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)
    os.chown(persist, NOBODY, NOBODY)
    with pytest.raises(protocol.CacheError, match=f"belongs to uid {NOBODY}, not to you"):
        Store(persist=persist, key_dir=keys)
    os.chown(persist, 0, 0)
    # And a file inside owned by someone else (a directory they could write to before it was made private).
    os.chown(persist / "index.json", NOBODY, NOBODY)
    store = Store(persist=persist, key_dir=keys)
    assert not store.entries and "not a private regular file of yours" in (store.cold_start or "")
    store.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_user_preparing_the_directory_runs_nothing(tmp_path: Path) -> None:
    """A nobody process makes the persistence directory in a world-writable place, 0700, with an index whose
    entry would run code: it is refused whatever the index holds."""
    shared = Path(tempfile.mkdtemp(prefix="zcp-shared-"))  # like /tmp: anyone may make a directory in it
    os.chmod(shared, 0o1777)
    trap = shared / "persist"
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                trap.mkdir(mode=0o700)
                (trap / "index.json").write_text("{}")
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        keys = tmp_path / "keys"
        keys.mkdir(mode=0o700)
        with pytest.raises(protocol.CacheError, match="not to you"):
            Store(persist=trap, key_dir=keys)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def sentinel_stream(sentinel: Path) -> bytes:
    """A pickle that creates ``sentinel`` when unpickled."""

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (sentinel,))

    return pickle.dumps(Payload())


def rewrite_index(persist: Path, change: Any) -> None:
    """Change the (valid JSON) body of the index, keeping its old authentication code."""
    index = persist / "index.json"
    outer = json.loads(index.read_text())
    body = json.loads(outer["body"])
    change(body)
    outer["body"] = json.dumps(body)
    index.write_text(json.dumps(outer))
    os.chmod(index, 0o600)


def test_a_tampered_index_starts_cold_and_nothing_is_unpickled(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)
    sentinel = tmp_path / "ran"

    def plant(body: dict[str, Any]) -> None:
        body["entries"][0]["stream"] = sentinel_stream(sentinel).hex()

    rewrite_index(persist, plant)
    store = Store(persist=persist, key_dir=keys)
    assert not store.entries and not store.segments
    assert "authentication code does not match" in (store.cold_start or "")
    store.close()
    assert not sentinel.exists()


def resign_index(persist: Path, keys: Path, change: Any, version: int | None = None) -> None:
    """Change the index's body (and maybe its version) and authenticate it again with the user's key: what an
    older release of this server, or a bug, could have written."""
    import hashlib
    import hmac

    index = persist / "index.json"
    outer = json.loads(index.read_text())
    body = json.loads(outer["body"])
    change(body)
    outer["body"] = json.dumps(body)
    outer["hmac_sha256"] = hmac.new((keys / KEY_FILE).read_bytes(), outer["body"].encode(), hashlib.sha256).hexdigest()
    if version is not None:
        outer["version"] = version
    index.write_text(json.dumps(outer))
    os.chmod(index, 0o600)


def test_an_index_of_an_older_format_is_dropped(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)

    def positional_rows(body: dict[str, Any]) -> None:  # version 2: positional rows, no plugins
        for entry in body["entries"]:
            entry["buffers"] = [row[1:] for row in entry["buffers"]]
            del entry["plugins"], entry["args_plugins"]

    resign_index(persist, keys, positional_rows, version=2)
    store = Store(persist=persist, key_dir=keys)
    assert not store.entries and not store.segments and "format" in (store.cold_start or "")
    store.close()
    # The current version's number over the old rows (the index was left as it was): does not decode either.
    resign_index(persist, keys, lambda body: None, version=persistence._INDEX_VERSION)
    store = Store(persist=persist, key_dir=keys)
    assert not store.entries and not store.segments and "damaged" in (store.cold_start or "")
    store.close()


def test_an_index_without_its_key_starts_cold(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)
    (keys / KEY_FILE).unlink()
    store = Store(persist=persist, key_dir=keys)
    assert not store.entries and "persistence key" in (store.cold_start or "")
    store.close()
    other = tmp_path / "other-keys"
    other.mkdir(mode=0o700)
    store = Store(persist=persist, key_dir=other)  # another user's (or a fresh) key: the code does not match
    assert not store.entries and store.cold_start
    store.close()


@pytest.mark.parametrize("change", [b"HELLO", b"hello!"], ids=["same-size", "other-size"])
def test_a_changed_segment_drops_only_its_entries_and_their_dependents(tmp_path: Path, change: bytes) -> None:
    persist, keys = persisted_store(tmp_path)  # "a" in segment 1
    store = Store(persist=persist, key_dir=keys)
    for key, data, refs in (("b", b"world", []), ("c", b"later", ["a"]), ("d", b"after", ["c"])):
        fd = arena.create_memfd("test-segment")
        os.write(fd, data)
        arena.seal(fd)
        store.add(Entry(key, f"call {key}", b"stream", [BufferRow(0, 0, 5, "cpu", None, "new")], refs), fd)
    store.close()
    segment = persist / "segment-1.bin"
    with open(segment, "r+b") as f:  # changed in place: other bytes (and maybe another size)
        f.write(change)
    again = Store(persist=persist, key_dir=keys)
    # "a" is dropped, and "c" and "d", which took it (or what took it) as an argument; "b" is served as it was.
    assert list(again.entries) == ["b"] and again.cold_start is None
    assert not segment.exists()
    (segment_id,) = again.entries["b"].segment_ids
    restored = again.segments[segment_id]
    assert os.pread(restored.fd, 5, 0) == b"world"
    assert fcntl.fcntl(restored.fd, fcntl.F_GET_SEALS) & arena.SEALS == arena.SEALS  # a sealed memfd, not the file
    again.close()
    third = Store(persist=persist, key_dir=keys)  # the index was rewritten without the dropped entries
    assert list(third.entries) == ["b"] and third.cold_start is None
    third.close()


def test_a_failed_index_write_keeps_the_previous_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    persist, keys = persisted_store(tmp_path)
    before = (persist / "index.json").read_bytes()
    store = Store(persist=persist, key_dir=keys)

    def full_disk(fd: int, pieces: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writes, "write_pieces", full_disk)
    assert store.clear() == 1  # served from memory all the same
    monkeypatch.undo()
    assert (persist / "index.json").read_bytes() == before
    assert not [p for p in persist.iterdir() if p.name.endswith(".tmp")]
    store.close()


# -- a real server: where it and its loader import from, and a hostile peer ----------------------------------------

WHERE_CLIENT = """
import json, os, sys, warnings
warnings.simplefilter("always")
from zerocopy_pickle import cache
cache.patch_all(["tests.cache_helpers:where_am_i"], autostart=True)
from tests import cache_helpers
result = cache_helpers.where_am_i(sys.argv[1])
print(json.dumps({"sys_path": result["sys_path"], "cwd": result["cwd"], "sum": float(result["state"]["w"].sum()),
                  "status": cache.status()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fill", ["caller", "server"])
def test_an_autostarted_server_and_its_loader_import_nothing_from_the_clients_directory(
    tmp_path: Path, fill: str
) -> None:
    import torch

    project = tmp_path / "project"  # the folder a client runs in, holding somebody's diffusers.py
    project.mkdir()
    sentinel = tmp_path / "diffusers-ran"
    (project / "diffusers.py").write_text(f"open({str(sentinel)!r}, 'a').write(str(__import__('os').getpid()))\n")
    torch.save({"w": torch.arange(10.0)}, project / "state.pt")
    with private_dir() as directory:
        env = {**os.environ, "ZEROCOPY_PICKLE_CACHE_DIR": str(directory), "PYTHONPATH": str(REPO),
               "PYTHONUNBUFFERED": "1", "ZEROCOPY_PICKLE_CACHE_FILL": fill}  # fmt: skip
        try:
            proc = subprocess.run(
                [sys.executable, "-c", WHERE_CLIENT, "state.pt"],  # a relative path, resolved in the client's folder
                capture_output=True, text=True, env=env, cwd=project, timeout=300,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            result = json.loads(proc.stdout.splitlines()[-1])
            assert result["sum"] == 45.0, proc.stderr
            status = result["status"]
            # (A client that loads its own misses sent no get to the server it started: it did not wait for it.)
            assert status["misses"] == (fill == "server") and len(status["entries"]) == 1, proc.stderr
            # The server (and the zygote) run in the private runtime directory, and look for modules neither
            # there nor in the client's folder; the call ran in the client's folder (in the loader's child, or in
            # the client itself, which loads its own misses and never needs the loader).
            assert status["loader_ready"] == (fill == "server")
            for pid in (status["pid"], status["loader_pid"]) if fill == "server" else (status["pid"],):
                assert os.readlink(f"/proc/{pid}/cwd") == str(directory)
            assert result["cwd"] == str(project)
            if fill == "server":  # the loader's child cleaned its sys.path (the client's own is the user's)
                assert "" not in result["sys_path"] and str(project) not in result["sys_path"]
                assert str(directory) not in result["sys_path"]
                assert str(REPO) in result["sys_path"]  # an explicit PYTHONPATH entry stays
            assert not sentinel.exists(), sentinel.read_text()
        finally:
            with contextlib.suppress(Exception), Client(directory / "server.sock", timeout=30) as client:
                client.request({"op": "stop"})


@pytest.mark.slow
def test_a_huge_declared_message_is_refused_without_allocating(tmp_path: Path) -> None:
    psutil = pytest.importorskip("psutil")
    with private_dir() as directory:
        server = ServerProcess(directory)
        try:
            process = psutil.Process(server.pid)
            before = process.memory_info().rss
            sock_path = str(directory / "server.sock")
            # 12 bytes claiming 2 GiB: refused with a protocol error, the connection closed.
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hostile:
                hostile.connect(sock_path)
                hostile.sendall(struct.pack("<II", 2, 2 << 30) + b"{}  ")
                reply, _, _ = protocol.receive(hostile)
                assert reply["ok"] is False and "protocol error" in reply["error"] and "refused" in reply["error"]
                with contextlib.suppress(ConnectionResetError):  # a reset: it hung up with bytes unread
                    assert hostile.recv(1) == b""  # hung up
            # Within the limits but never sent: nothing is reserved for what has not arrived.
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
                slow.connect(sock_path)
                slow.sendall(struct.pack("<II", 2, protocol.REQUEST.payload) + b"{}" + b"x" * 1000)
                assert server.request("ping")["ok"]  # others are served meanwhile
                growth = process.memory_info().rss - before
                assert growth < protocol.REQUEST.payload // 4, growth
            assert server.request("ping")["ok"]
            assert process.memory_info().rss - before < protocol.REQUEST.payload // 4
        finally:
            server.stop()


def test_a_missing_segment_drops_only_its_entries(tmp_path: Path) -> None:
    persist, keys = persisted_store(tmp_path)
    store = Store(persist=persist, key_dir=keys)
    fd = arena.create_memfd("test-segment")
    os.write(fd, b"world")
    arena.seal(fd)
    store.add(Entry("b", "call b", b"stream", [BufferRow(0, 0, 5, "cpu", None, "new")], []), fd)
    store.close()
    (persist / "segment-1.bin").unlink()  # a crash between deleting a segment and writing the index
    again = Store(persist=persist, key_dir=keys)
    assert list(again.entries) == ["b"] and again.cold_start is None
    again.close()


def test_the_start_directory_leaves_sys_path_but_explicit_entries_stay(tmp_path: Path) -> None:
    code = (
        "import json, os, sys; from zerocopy_pickle.cache.isolation import cleaned_path; "
        "here = os.getcwd(); dash_m = [here, *[p for p in sys.path[1:] if p != here]]; "  # as Python makes it
        "print(json.dumps([sys.path[0], cleaned_path(sys.path), cleaned_path(dash_m)]))"
    )
    for pythonpath, kept in ((str(REPO), False), (f"{REPO}{os.pathsep}{tmp_path}", True)):
        env = {**os.environ, "PYTHONPATH": pythonpath}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
        first, cleaned, as_if_dash_m = json.loads(proc.stdout)
        assert first == "" and "" not in cleaned and str(REPO) in cleaned  # -c: '' goes, PYTHONPATH stays
        assert (str(tmp_path) in as_if_dash_m) is kept  # -m: the working directory goes unless named explicitly


# -- limits of each kind of message, headers that cannot crash or hang the server, the connection cap -----------

from zerocopy_pickle.cache.messages import request_limits  # noqa: E402
from zerocopy_pickle.cache.server import Server  # noqa: E402


@contextlib.contextmanager
def inprocess_server(**options: Any) -> Any:
    """A :class:`Server` in this process (its counters and threads can be looked at), in a private directory."""
    with private_dir() as directory:
        server = Server(directory / "server.sock", workdir=str(directory), **options)
        server.bind()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server
        finally:
            server.stop()
            thread.join(60)


def frame(header: bytes, payload_nbytes: int = 0) -> bytes:
    return struct.pack("<II", len(header), payload_nbytes) + header


def padded(header: dict[str, Any], nbytes: int) -> bytes:
    """``header`` as JSON, padded with whitespace to exactly ``nbytes``."""
    blob = json.dumps(header).encode()
    assert len(blob) <= nbytes
    return blob + b" " * (nbytes - len(blob))


def exchange(server: Server, data: bytes, fds: list[int] | None = None, payload: bytes = b"") -> tuple[Any, bool]:
    """Send raw bytes (and fds) as one client; the reply, and whether the server hung up after it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(120)
        sock.connect(str(server.path))
        if fds:
            sock.sendmsg([data[:8]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, __import__("array").array("i", fds))])
            data = data[8:]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused before it was all sent
            sock.sendall(data)
            if payload:
                sock.sendall(payload)
        reply, _, received = protocol.receive(sock)
        for fd in received:
            os.close(fd)
        try:  # still served? a ping on the same connection says (EOF or a reset if it hung up: no waiting)
            protocol.send(sock, {"op": "ping"})
            closed = not protocol.receive(sock)[0]["ok"]
        except (OSError, protocol.ProtocolError):
            closed = True
    return reply, closed


def os_threads() -> int:
    """The threads of this process as the kernel counts them (connection threads are not ``threading.Thread``)."""
    return len(os.listdir("/proc/self/task"))


def wait_until(condition: Any, tries: int = 60_000) -> bool:
    """Wait for ``condition()`` (polled; the bound only keeps a broken test from hanging, it is not measured)."""
    for _ in range(tries):
        if condition():
            return True
        threading.Event().wait(0.005)
    return False


def alive(server: Server) -> bool:
    with Client(server.path, timeout=60) as client:
        reply, _, _ = client.request({"op": "ping"})
    return bool(reply["ok"])


def refused(reply: Any, closed: bool, why: str = "") -> bool:
    return reply["ok"] is False and "protocol error" in reply["error"] and why in reply["error"] and closed


def test_the_limits_are_the_documented_ones_defined_once() -> None:
    assert protocol.Limits(header=1 << 20, payload=64 << 20, fds=0) == protocol.REQUEST
    assert protocol.Limits(header=16 << 20, payload=1 << 30, fds=protocol.MAX_FDS) == protocol.PUT
    assert protocol.Limits(header=256 << 20, payload=4 << 30, fds=250) == protocol.ENTRY
    assert protocol.CLIENT == protocol.PUT and protocol.MAX_BUFFERS == 1 << 20
    assert request_limits({"op": "put"}) is protocol.PUT
    for op in ("ping", "get", "status", "clear", "stop", "unknown", None):
        assert request_limits({"op": op}) is protocol.REQUEST
    text = " ".join((REPO / "docs" / "cache.md").read_text().split())
    for documented in ("1 MiB of header, 64 MiB of payload", "16 MiB of header, 1 GiB of payload",
                       "256 MiB of header, 4 GiB of payload"):  # fmt: skip
        assert documented in text


def test_each_limit_one_byte_over_is_refused_and_at_the_limit_passes_the_check() -> None:
    """Through the very call the server makes (``receive(conn, CLIENT, request_limits)``): one byte (or fd) over
    a limit is refused; a message declared at the limit is admitted (it then waits for its bytes: hung up here)."""
    ping, put = {"op": "ping"}, {"op": "put"}
    cases = [  # header bytes, declared payload bytes, header kind, fds
        (protocol.REQUEST.header, 0, ping, 0),
        (64, protocol.REQUEST.payload, ping, 0),
        (protocol.PUT.header, 0, put, 0),
        (64, protocol.PUT.payload, put, 0),
        (64, 0, put, protocol.PUT.fds),
    ]
    memfd = arena.create_memfd("limits")
    try:
        for header_nbytes, payload_nbytes, kind, nfds in cases:
            for over in (0, 1):
                h = header_nbytes + over if header_nbytes > 64 else header_nbytes
                p = payload_nbytes + over if payload_nbytes else 0
                n = nfds + over if nfds else 0
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                with ours, theirs:
                    data = frame(padded(kind, h), p) + b"x" * min(p, 10)
                    sender = threading.Thread(target=_send_and_hang_up, args=(theirs, data, [memfd] * n))
                    sender.start()
                    try:
                        _, _, fds = protocol.receive(ours, protocol.CLIENT, request_limits)
                        outcome = "received"
                        for fd in fds:
                            os.close(fd)
                    except protocol.ProtocolError as e:
                        outcome = str(e)
                    ours.shutdown(socket.SHUT_RDWR)  # a sender still writing what was refused gets EPIPE
                    sender.join()
                    if over:
                        assert "refused" in outcome, (h, p, n, outcome)
                    elif p:  # admitted: what ended it is the sender hanging up before the declared end
                        assert "hung up" in outcome and "refused" not in outcome, (h, p, n, outcome)
                    else:  # admitted whole
                        assert outcome == "received", (h, p, n, outcome)
        # A request (not a put) carries no fds at all.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            _send_and_hang_up(theirs, frame(b'{"op":"get"}'), [memfd])
            with pytest.raises(protocol.ProtocolError, match="at most 0: refused"):
                protocol.receive(ours, protocol.CLIENT, request_limits)
    finally:
        os.close(memfd)


def _send_and_hang_up(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    with contextlib.suppress(OSError):
        if fds:
            sock.sendmsg([data[:8]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, __import__("array").array("i", fds))])
            data = data[8:]
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)


def test_the_server_answers_one_byte_over_each_limit_with_a_protocol_error_and_hangs_up() -> None:
    with inprocess_server() as server:
        # One over: the reply says why, the connection is closed, the server serves on.
        for data in (
            frame(padded({"op": "ping"}, protocol.REQUEST.header + 1)),
            frame(padded({"op": "ping"}, 64), protocol.REQUEST.payload + 1),
            frame(padded({"op": "put"}, 64), protocol.PUT.payload + 1),
            struct.pack("<II", protocol.PUT.header + 1, 0),
        ):
            reply, closed = exchange(server, data)
            assert refused(reply, closed, "refused"), reply
            assert alive(server)
        memfd = arena.create_memfd("limits")
        try:
            reply, closed = exchange(server, frame(b'{"op":"ping"}'), [memfd])
            assert refused(reply, closed, "file descriptors"), reply
            reply, closed = exchange(server, frame(b'{"op":"put"}'), [memfd] * (protocol.PUT.fds + 1))
            assert refused(reply, closed, "file descriptors"), reply
            # At the limit: served (a put at its fd limit is then refused as malformed, on a connection that stays).
            reply, closed = exchange(server, frame(b'{"op":"put"}'), [memfd] * protocol.PUT.fds)
            assert reply["ok"] is False and "malformed request" in reply["error"] and not closed, reply
        finally:
            os.close(memfd)
        reply, closed = exchange(server, frame(padded({"op": "ping"}, protocol.REQUEST.header)))
        assert reply["ok"] and reply["pid"] == os.getpid() and not closed
        payload = b"\0" * protocol.REQUEST.payload
        reply, closed = exchange(server, frame(padded({"op": "ping"}, 64), len(payload)), payload=payload)
        assert reply["ok"] and not closed
        assert alive(server)


HOSTILE_HEADERS = {
    "nested 100,000 deep": b"[" * 100_000,
    "nested 100,000 deep, closed": b"[" * 100_000 + b"]" * 100_000,
    "objects nested deep": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "invalid UTF-8": b'{"op":"ping","x":"\xff\xfe"}',
    "a lone surrogate's bytes": b'{"op":"\xed\xa0\x80"}',
    "not an object": b"[1, 2, 3]",
    "a string": b'"ping"',
    "a number of 100,000 digits": b'{"op":"ping","n":' + b"1" * 100_000 + b"}",
    "a float of 100,000 digits": b'{"op":"ping","n":0.' + b"1" * 100_000 + b"}",
    "a duplicate key": b'{"op":"ping","op":"stop"}',
    "truncated": b'{"op":"pi',
    "unbalanced": b"{" * 10,
    "empty": b"",
    "a byte order mark": b'\xef\xbb\xbf{"op":"ping"}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_every_malformed_header_is_answered_and_the_server_serves_on(name: str) -> None:
    with inprocess_server() as server:
        reply, _ = exchange(server, frame(HOSTILE_HEADERS[name]))
        assert reply["ok"] is False and ("protocol error" in reply["error"] or "malformed" in reply["error"]), reply
        assert alive(server) and server.store.status()["entries"] == []
        assert not server.stopping.is_set(), "a duplicate 'op' is refused, not taken as its last value"
        assert wait_until(lambda: server.connections == 0)  # each connection's thread ended, none left behind


def test_brackets_and_digits_inside_strings_are_only_text() -> None:
    with inprocess_server() as server:
        for text in ("[" * 100_000, "{" * 50_000 + "]" * 50_000, '\\"' * 1000, "1" * 100_000, '"' + "[" * 1000):
            reply, closed = exchange(server, frame(json.dumps({"op": "ping", "describe": text}).encode()))
            assert reply["ok"] and not closed, reply
        hidden = b'{"op":"ping","x":"\\"' + b"[" * 1000 + b'"}'  # an escaped quote does not end the string
        assert exchange(server, frame(hidden))[0]["ok"]


def test_the_nesting_count_agrees_with_a_reference_scanner() -> None:
    import random

    def reference(text: str) -> int | None:
        """Max depth of brackets outside strings, as a JSON parser meets them; None where it stops at a backslash
        outside a string (it reads no further)."""
        depth = deepest = 0
        inside = escaped = False
        for ch in text:
            if inside:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    inside = False
            elif ch == '"':
                inside = True
            elif ch == "\\":
                return deepest
            elif ch in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif ch in "]}":
                depth -= 1
                if depth < 0:
                    return deepest
        return deepest

    rng = random.Random(25)
    for _ in range(20_000):
        text = "".join(rng.choice('[[[]]]{}"\\\\a,') for _ in range(rng.randrange(1, 80)))
        if rng.random() < 0.3:
            text = "[" * rng.randrange(20, 40) + text
        try:
            protocol._check_nesting(text)
        except protocol.ProtocolError:
            continue
        assert reference(text) <= protocol.MAX_JSON_DEPTH, text  # what passes never nests deeper
    nested = "[" * protocol.MAX_JSON_DEPTH + "]" * protocol.MAX_JSON_DEPTH
    protocol._check_nesting(nested)
    assert protocol.decode_header(f'{{"a":{nested[1:-1]}}}'.encode()) == {"a": json.loads(nested[1:-1])}
    with pytest.raises(protocol.ProtocolError, match="deep"):
        protocol._check_nesting("[" + nested + "]")


@pytest.mark.slow
@pytest.mark.parametrize(
    "item", ["{}", "[]", '"ab"', "0.5", "1e5", '{"a":0}', "123456789012", "[[[[[[[[]]]]]]]]", '"",1', "null"]
)
def test_decoding_a_header_costs_memory_linear_in_its_length(item: str) -> None:
    import tracemalloc

    for n in (10_000, 100_000):
        blob = ('{"a":[' + ",".join([item] * n) + "]}").encode()
        tracemalloc.start()
        try:
            header = protocol.decode_header(blob)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(header["a"]) >= n
        assert peak <= protocol.DECODE_BYTES_PER_BYTE * len(blob) + (64 << 10), (item, n, peak / len(blob))


def test_connections_beyond_the_cap_are_refused_counted_and_start_no_thread() -> None:
    cap = 4
    with inprocess_server(max_connections=cap) as server:
        held = []
        try:
            for _ in range(cap):  # each served (a ping answered), then kept open: its thread waits on it
                client = Client(server.path, timeout=60)
                held.append(client)
                assert client.request({"op": "ping"})[0]["ok"]
            assert server.connections == cap
            threads = os_threads()
            for _ in range(3):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
                    extra.settimeout(60)
                    extra.connect(str(server.path))
                    reply, _, _ = protocol.receive(extra)
                    assert reply["ok"] is False and f"{cap} connections at once" in reply["error"], reply
                    assert extra.recv(1) == b""  # closed at once
            assert server.refused_connections == 3
            assert server.connections == cap
            assert os_threads() <= threads  # the refusals started no thread (one of another test may have ended)
        finally:
            for client in held:
                client.close()
        # The slots come back as their connections end (waited for, not timed).
        assert wait_until(lambda: server.connections == 0)
        with Client(server.path, timeout=60) as client:
            status = client.request({"op": "status"})[0]["status"]
        assert status["refused_connections"] >= 3 and status["max_connections"] == cap
        assert status["connections"] == 1  # the connection asking


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout() -> None:
    with inprocess_server(idle_timeout=0.2) as server:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.settimeout(120)
            idle.connect(str(server.path))
            idle.sendall(struct.pack("<II", 100, 0) + b"{")  # and then nothing
            reply, _, _ = protocol.receive(idle)
            assert reply["ok"] is False and "nothing arrived" in reply["error"]
            assert idle.recv(1) == b""
        assert alive(server)
