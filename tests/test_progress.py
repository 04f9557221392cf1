"""Progress bars: on a terminal above the threshold, for dumps, freezes, conversions, cache fills and downloads;
never when stderr is not a terminal, below the threshold, or with ZEROCOPY_PICKLE_PROGRESS=0."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import uuid
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import tqdm

import zerocopy_pickle as zp
from tests.internals import progress, remote, writes
from zerocopy_pickle.cache import entries
from zerocopy_pickle.errors import ArgumentError

from .conftest import REPO


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal, and keeps what was written to it."""

    def isatty(self) -> bool:
        return True


class Recorded(tqdm.tqdm):
    """tqdm, remembering every bar it drew (its total and the count it reached when it closed)."""

    bars: ClassVar[list[tuple[str, int, int]]] = []

    def close(self) -> None:
        if not self.disable and self.n is not None:
            Recorded.bars.append((self.desc, int(self.total), int(self.n)))
        super().close()


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every bar :func:`progress.bar` shows during the test, as (desc, total, final count)."""
    monkeypatch.setattr(tqdm, "tqdm", Recorded)  # progress imports `from tqdm import tqdm` when it shows one
    Recorded.bars = []
    return Recorded.bars


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> FakeTerminal:
    """A stderr that is a terminal, for ``redirect_stderr`` in the test's body (pytest's capturing sets
    ``sys.stderr`` again between a fixture and the test); the threshold is 1 MiB; ZEROCOPY_PICKLE_PROGRESS unset."""
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.delenv(progress.MIN_ENV, raising=False)
    monkeypatch.setattr(progress, "THRESHOLD", 1 << 20)
    return FakeTerminal()


def state(nbytes: int = 3 << 20) -> dict[str, Any]:
    return {"w": torch.randn(nbytes // 4), "b": torch.arange(10.0), "name": "model"}


def written_bytes(path: Path) -> int:
    """The bytes a dump to ``path`` wrote: header, stream and every buffer (not the padding between them)."""
    header = zp.read_header(path)
    return header.stream_offset + header.stream_nbytes + sum(entry.nbytes for entry in header.buffers)


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no-checksums"])
def test_dump_to_a_path_shows_a_bar_that_counts_every_byte_written(
    tmp_path: Path, terminal: FakeTerminal, bars: list[tuple[str, int, int]], checksums: bool
) -> None:
    path = tmp_path / "model.zcp"
    with redirect_stderr(terminal):
        zp.dump(state(), path, checksums=checksums)
    assert bars == [("dump model.zcp", written_bytes(path), written_bytes(path))]
    shown = terminal.getvalue()
    assert "dump model.zcp" in shown and "100%" in shown
    assert torch.equal(zp.load(path)["b"], torch.arange(10.0))


def test_the_parallel_hashing_path_reports_too(
    tmp_path: Path, terminal: FakeTerminal, bars: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.internals import integrity

    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 1 << 20)
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    path = tmp_path / "model.zcp"
    obj = state()
    with redirect_stderr(terminal):
        zp.dump(obj, path)
    assert bars == [("dump model.zcp", written_bytes(path), written_bytes(path))]
    assert torch.equal(zp.load(path, verify=True)["w"], obj["w"])  # the checksums recorded are still right


def test_dump_to_a_file_object_and_freeze_count_the_whole_snapshot(
    terminal: FakeTerminal, bars: list[tuple[str, int, int]]
) -> None:
    obj = state()
    out = io.BytesIO()
    with redirect_stderr(terminal):
        zp.dump(obj, out)
        snapshot = zp.freeze(obj, name="frozen")
    assert out.getvalue() == zp.dumps(obj)  # the bar's smaller writes change nothing written
    with snapshot:
        size = os.fstat(snapshot.fd).st_size
        assert torch.equal(snapshot.load()["w"], obj["w"])
    assert bars == [("dump", len(out.getvalue()), len(out.getvalue())), ("freeze frozen", size, size)]


def test_no_bar_when_stderr_is_not_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bars: list[tuple[str, int, int]]
) -> None:
    stream = io.StringIO()  # isatty() is False: a log file, a pipe
    monkeypatch.setattr(progress, "THRESHOLD", 0)
    with redirect_stderr(stream):
        zp.dump(state(), tmp_path / "m.zcp")
        zp.freeze(state()).close()
    assert stream.getvalue() == "" and bars == []


def test_no_bar_below_the_threshold_or_when_turned_off(
    tmp_path: Path, terminal: FakeTerminal, bars: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    with redirect_stderr(terminal):
        zp.dump(state(nbytes=1 << 18), tmp_path / "small.zcp")  # 256 KiB: under the 1 MiB of the fixture
        for off in ("0", "off", " OFF "):
            monkeypatch.setenv(progress.ENV, off)
            zp.dump(state(), tmp_path / "big.zcp")
    assert terminal.getvalue() == "" and bars == []
    monkeypatch.setenv(progress.ENV, "auto")
    with redirect_stderr(terminal):
        zp.dump(state(), tmp_path / "big.zcp")
    assert [desc for desc, _, _ in bars] == ["dump big.zcp"]


def test_the_default_threshold_is_256_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.MIN_ENV, raising=False)
    monkeypatch.delenv(progress.ENV, raising=False)
    assert progress.THRESHOLD == 256 << 20
    with redirect_stderr(FakeTerminal()):
        with progress.bar((256 << 20) - 1, "x") as report:
            assert report is None
        with progress.bar(256 << 20, "x") as report:
            assert report is not None
            report(256 << 20)


@pytest.mark.parametrize(
    ("value", "nbytes"), [("64M", 64 << 20), ("1G", 1 << 30), ("2GiB", 2 << 30), ("1000000", 1_000_000), ("1.5k", 1536)]
)
def test_the_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, nbytes: int) -> None:
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setenv(progress.MIN_ENV, value)
    with redirect_stderr(FakeTerminal()), progress.bar(nbytes - 1, "x") as below, progress.bar(nbytes, "x") as at:
        assert below is None and at is not None


@pytest.mark.parametrize(
    ("name", "value"), [(progress.ENV, "yes"), (progress.MIN_ENV, "lots"), (progress.MIN_ENV, "-5M")]
)
def test_a_malformed_setting_is_an_argument_error_on_a_terminal_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    for stream in (io.StringIO(), FakeTerminal()):
        with redirect_stderr(stream), pytest.raises(ArgumentError, match=name):
            zp.dump(state(nbytes=1 << 12), tmp_path / "m.zcp")
    assert not (tmp_path / "m.zcp").exists()


def test_write_pieces_reports_in_steps_and_writes_the_same_bytes(tmp_path: Path) -> None:
    pieces = [b"head", bytes(range(256)) * ((40 << 20) // 256), b"", b"tail"]
    reports: list[int] = []
    with open(tmp_path / "out", "wb") as f:
        total = writes.write_pieces(f.fileno(), pieces, progress=reports.append)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)
    assert sum(reports) == total == sum(map(len, pieces))
    assert len(reports) >= 3 and max(reports) <= 2 * writes.PROGRESS_STEP  # a bar that moves, not one 40 MiB jump


def test_write_placed_reports_each_window_not_the_padding(tmp_path: Path) -> None:
    big = bytes(range(256)) * ((5 << 20) // 256)
    placed = [(0, b"x" * 100), (8192, big), (8192 + len(big) + 100, b"y" * 10)]
    reports: list[int] = []
    with open(tmp_path / "out", "wb") as f:
        writes.write_placed(f.fileno(), placed, progress=reports.append)
    assert sum(reports) == 100 + len(big) + 10
    assert max(reports) <= writes.WRITE_CHUNK
    data = (tmp_path / "out").read_bytes()
    assert data[8192 : 8192 + len(big)] == big and data[-10:] == b"y" * 10


def test_a_cache_fill_shows_a_bar(terminal: FakeTerminal, bars: list[tuple[str, int, int]]) -> None:
    views = [memoryview(bytearray(os.urandom(1 << 20))), memoryview(bytearray(b"z" * (2 << 20) + b"q"))]
    with redirect_stderr(terminal):
        rows, fd = entries.build_segment(views, ["cpu", "cpu"], {}, {}, lambda view: None)
    assert fd is not None
    try:
        size = os.fstat(fd).st_size
        assert rows[1].offset + views[1].nbytes == size
    finally:
        os.close(fd)
    assert bars == [("cache fill", size, size)]
    assert "cache fill" in terminal.getvalue()


def test_a_download_shows_a_bar(
    terminal: FakeTerminal, bars: list[tuple[str, int, int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("fsspec")
    monkeypatch.setenv(remote.DIR_ENV, str(tmp_path / "remote"))
    url = f"memory://bucket/{uuid.uuid4().hex}.zcp"
    obj = state()
    with redirect_stderr(terminal):
        zp.dump(obj, url)  # the local write before the upload has its own bar
    assert [desc for desc, _, _ in bars] == [f"dump {url}"]
    bars.clear()
    with redirect_stderr(terminal):
        loaded = zp.load(url)
    assert torch.equal(loaded["w"], obj["w"])
    size = bars[0][1]
    assert bars == [(f"fetch {url}", size, size)] and size > 3 << 20


def run_on_a_terminal(args: list[str], env: dict[str, str], *, size: tuple[int, int] = (0, 0)) -> tuple[int, str, str]:
    """Run ``args`` with stderr on a real pseudo-terminal of ``size`` rows and columns (a fresh one is 0x0, as
    under ``docker exec -t``), stdout a pipe; returns the exit code, stdout, and what reached the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=REPO)
    finally:
        os.close(slave)
    shown = b""
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child's end closed
                break
            if not data:
                break
            shown += data
    finally:
        os.close(master)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    return proc.wait(timeout=600), out, shown.decode(errors="replace")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.randn(3 << 18), "b": torch.arange(4)}, src)  # 3 MiB
    return src


@pytest.mark.slow
@pytest.mark.parametrize("size", [(24, 100), (0, 0)], ids=["sized", "unsized"])
def test_convert_on_a_real_terminal_shows_the_bar(tmp_path: Path, checkpoint: Path, size: tuple[int, int]) -> None:
    script = shutil.which("zerocopy-pickle", path=os.path.dirname(sys.executable))
    assert script is not None, "the zerocopy-pickle console script is not installed"
    env = {k: v for k, v in os.environ.items() if k != progress.ENV}
    env[progress.MIN_ENV] = "1M"  # the checkpoint is 3 MiB
    dst = tmp_path / "m.zcp"
    code, out, shown = run_on_a_terminal([script, "convert", str(checkpoint), str(dst)], env, size=size)
    assert code == 0, shown
    assert "dump m.zcp" in shown and "100%" in shown, shown
    last = shown.rstrip().rsplit("\r", 1)[-1]  # the bar as it was left
    assert len(last) <= (size[1] or 80), last
    assert "(torch)" in out and "dump m.zcp" not in out  # the bar is on stderr only
    assert torch.equal(zp.load(dst)["b"], torch.arange(4))

    env[progress.ENV] = "0"
    code, out, shown = run_on_a_terminal(
        [script, "convert", str(checkpoint), str(tmp_path / "off.zcp")], env, size=size
    )
    assert code == 0 and "dump" not in shown and "%" not in shown, shown


@pytest.mark.slow
def test_convert_with_stderr_in_a_pipe_shows_no_bar(tmp_path: Path, checkpoint: Path) -> None:
    script = shutil.which("zerocopy-pickle", path=os.path.dirname(sys.executable))
    assert script is not None
    env = {k: v for k, v in os.environ.items() if k != progress.ENV}
    env[progress.MIN_ENV] = "1"
    proc = subprocess.run(
        [script, "convert", str(checkpoint), str(tmp_path / "m.zcp")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "dump m.zcp" not in proc.stderr and "%|" not in proc.stderr
