"""``dump`` to a path is atomic: a failed, interrupted or killed dump leaves the previous snapshot at that path
byte-identical and no temporary file behind; a successful one replaces the file by rename, so loads already
mapping the old snapshot keep seeing it.

Also: ``dump`` to binary file objects, and ``fsync=True``; and the writer of files in a directory held open
(``_storage/atomic.py``: the cache's persistence files, the identities of URL downloads), which leaves the previous
file intact and no temporary behind just as well.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.conftest import REPO, run_python
from tests.internals import atomic

MiB = 1 << 20


def small_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(32, 32), "b": torch.randn(32), "step": torch.tensor(seed)}


def medium_state() -> dict[str, torch.Tensor]:
    """Several MiB in several storages, so that a write is interrupted with some but not all bytes out."""
    torch.manual_seed(1)
    return {f"layer{i}": torch.randn(256, 1024) for i in range(4)}  # 4 x 1 MiB


def assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    """Every name in ``directory``, dot files included."""
    return sorted(os.listdir(directory))


def temp_names(directory: Path) -> list[str]:
    return [name for name in listing(directory) if name.endswith(".zcp-tmp")]


@pytest.fixture
def old_snapshot(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], str]:
    """A valid snapshot at ``tmp_path / "state.zcp"``: ``(path, its state, its sha256)``."""
    path = tmp_path / "state.zcp"
    state = small_state()
    zp.dump(state, path)
    return path, state, digest(path)


def assert_untouched(
    old: tuple[Path, dict[str, torch.Tensor], str], names_before: list[str], *, trusted: bool = False
) -> None:
    path, state, sha = old
    assert listing(path.parent) == names_before, "a dump left a file behind (or removed one)"
    assert digest(path) == sha, "the previous snapshot changed"
    assert_state_equal(zp.load(path, trusted=trusted), state)


@pytest.fixture(params=["tmpfile", "named"])
def write_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``tmpfile``: the normal O_TMPFILE path. ``named``: a file system without O_TMPFILE, where the dump
    falls back to a named temporary file (O_TMPFILE refused with EOPNOTSUPP, as tmpfs-less FUSE mounts do)."""
    if request.param == "named":
        real_open = os.open

        def no_tmpfile(path: object, flags: int, *args: object, **kwargs: object) -> int:
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported (simulated)")
            return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", no_tmpfile)
    return str(request.param)


# ---------------------------------------------------------------------------------------------------------
# Unpicklable graphs
# ---------------------------------------------------------------------------------------------------------


def _module_level_function() -> None:  # picklable by reference, unlike a lambda or a local function
    pass


@pytest.mark.parametrize(
    "poison",
    [
        pytest.param(lambda: lambda x: x, id="lambda"),
        pytest.param(lambda: open(__file__, "rb"), id="open-file"),  # noqa: SIM115 - the poison itself
        pytest.param(lambda: (i for i in range(3)), id="generator"),
        pytest.param(lambda: io.BytesIO(b"x").getbuffer(), id="memoryview"),
    ],
)
def test_unpicklable_graph_raises_dump_error_and_changes_nothing(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], poison: Callable[[], object]
) -> None:
    path = old_snapshot[0]
    before = listing(path.parent)
    graph = {
        "tensors": medium_state(),
        "fn": _module_level_function,
        "nested": [torch.ones(3), {"deep": poison()}],  # after some tensors were already pickled
        "after": torch.zeros(2),
    }
    # The plain pickle backend: auto would pickle some of these by value (lambda, memoryview). Locks are not poison:
    # the runtime-objects quirk rebuilds them.
    with pytest.raises(zp.DumpError) as info:
        zp.dump(graph, path, backend="pickle")
    assert info.value.path == "obj['nested'][1]['deep']"
    assert "at obj['nested'][1]['deep']" in str(info.value) and info.value.__cause__ is not None  # what failed
    assert_untouched(old_snapshot, before)

    with pytest.raises(zp.DumpError):
        zp.dump(graph, path, fsync=True, backend="pickle")
    with pytest.raises(zp.DumpError):
        zp.dumps(graph, backend="pickle")
    with pytest.raises(zp.DumpError):
        zp.freeze(graph, backend="pickle")
    assert_untouched(old_snapshot, before)


def test_unpicklable_graph_to_a_new_path_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "new.zcp"
    with pytest.raises(zp.DumpError):
        zp.dump({"a": torch.ones(3), "gen": (i for i in range(3))}, path)
    assert listing(tmp_path) == []


def test_unpicklable_graph_to_a_file_object_writes_nothing(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with pytest.raises(zp.DumpError):
        zp.dump({"a": torch.ones(3), "fn": lambda: 0}, buffer, backend="pickle")
    assert buffer.getvalue() == b""


# ---------------------------------------------------------------------------------------------------------
# Write errors: a full disk, a file size limit, a failed rename
# ---------------------------------------------------------------------------------------------------------

FSIZE_CHILD = """
import errno, os, resource, signal, sys
import torch
import zerocopy_pickle as zp

path, limit, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "named":
    real_open = os.open
    def no_tmpfile(p, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported (simulated)")
        return real_open(p, flags, *args, **kwargs)
    os.open = no_tmpfile
state = {f"layer{i}": torch.full((256 * 1024,), float(i)) for i in range(8)}  # 8 MiB, over the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    zp.dump(state, path)
except OSError as e:
    print("OSError", errno.errorcode.get(e.errno, e.errno), type(e).__name__)
else:
    print("no error")
"""


@pytest.mark.slow
def test_file_size_limit_raises_oserror_and_keeps_the_old_snapshot(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], write_mode: str
) -> None:
    path = old_snapshot[0]
    limit = 1 * MiB
    assert path.stat().st_size < limit
    before = listing(path.parent)
    out = run_python(FSIZE_CHILD, str(path), str(limit), write_mode).stdout.split()
    assert out[:2] == ["OSError", "EFBIG"], out
    assert out[2] != "DumpError"
    assert_untouched(old_snapshot, before)


class FailingWritev:
    """``os.writev`` (and, through :meth:`install`, ``os.pwritev`` and ``os.pwrite``: a dump to a path writes
    with those) that writes at most ``budget`` bytes in all, then fails with ``error``."""

    def __init__(self, budget: int, error: int = errno.ENOSPC, watch: Path | None = None) -> None:
        self.budget = budget
        self.error = error
        self.written = 0
        self.calls = 0
        self.watch = watch
        self.names_while_writing: list[str] = []
        self.real = os.writev
        self.real_pwritev = os.pwritev

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FailingWritev:
        monkeypatch.setattr(os, "writev", self)
        monkeypatch.setattr(os, "pwritev", self)
        monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: self(fd, [data], offset))
        return self

    def __call__(self, fd: int, buffers: list[memoryview], offset: int | None = None) -> int:
        self.calls += 1
        if self.watch is not None:
            self.names_while_writing = listing(self.watch)
        room = self.budget - self.written
        if room <= 0:
            raise OSError(self.error, os.strerror(self.error))
        batch, total = [], 0
        for view in buffers:  # a short write, as a nearly full disk gives
            take = memoryview(view).cast("B")[: room - total]
            batch.append(take)
            total += take.nbytes
            if total >= room:
                break
        n = self.real(fd, batch) if offset is None else self.real_pwritev(fd, batch, offset)
        self.written += n
        return n


def test_disk_full_raises_oserror_and_keeps_the_old_snapshot(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], write_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = old_snapshot[0]
    before = listing(path.parent)
    fake = FailingWritev(budget=(3 * MiB) // 2, watch=path.parent).install(monkeypatch)
    with pytest.raises(OSError, match="No space left") as info:
        zp.dump(medium_state(), path)
    assert info.value.errno == errno.ENOSPC
    assert not isinstance(info.value, zp.ZeroCopyPickleError)
    assert fake.written == (3 * MiB) // 2  # it did write, then failed
    assert fake.calls >= 2
    # While writing, the temporary file was unnamed (O_TMPFILE) or carried the temporary name.
    extra = sorted(set(fake.names_while_writing) - set(before))
    if write_mode == "tmpfile":
        assert extra == []
    else:
        assert len(extra) == 1, extra
        assert extra[0].startswith(".state.zcp."), extra
        assert extra[0].endswith(".zcp-tmp"), extra
    monkeypatch.undo()
    assert_untouched(old_snapshot, before)


def test_disk_full_on_a_new_path_creates_nothing(
    tmp_path: Path, write_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    FailingWritev(budget=100_000).install(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        zp.dump(medium_state(), tmp_path / "new.zcp", fsync=True)
    assert listing(tmp_path) == []


def test_failed_rename_leaves_no_temporary_file(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], write_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = old_snapshot[0]
    before = listing(path.parent)
    seen: list[list[str]] = []

    def failing_replace(src: object, dst: object, **kwargs: object) -> None:
        seen.append(listing(path.parent))
        raise OSError(errno.EACCES, "rename refused (simulated)")

    monkeypatch.setattr(os, "replace", failing_replace)
    monkeypatch.setattr(atomic, "_exchange", failing_replace)  # the route taken when the target exists
    with pytest.raises(OSError, match="rename refused"):
        zp.dump(medium_state(), path)
    assert len(seen) == 1
    assert len(set(seen[0]) - set(before)) == 1  # the complete temporary file existed, under its temp name
    monkeypatch.undo()
    assert_untouched(old_snapshot, before)


def test_failed_fsync_leaves_no_temporary_file(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], write_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = old_snapshot[0]
    before = listing(path.parent)

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "fsync failed (simulated)")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        zp.dump(medium_state(), path, fsync=True)
    monkeypatch.undo()
    assert_untouched(old_snapshot, before)


def test_without_proc_link_the_unnamed_file_is_copied(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """linkat on /proc/self/fd can fail (no /proc); the dump then copies the unnamed file to the temp name."""
    path = old_snapshot[0]
    before = listing(path.parent)

    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOENT, "no /proc (simulated)")

    monkeypatch.setattr(os, "link", no_link)
    state = medium_state()
    zp.dump(state, path)
    monkeypatch.undo()
    assert listing(path.parent) == before
    assert path.read_bytes() == zp.dumps(state)
    assert_state_equal(zp.load(path), state)


# ---------------------------------------------------------------------------------------------------------
# A dump killed mid-write
# ---------------------------------------------------------------------------------------------------------

KILLED_CHILD = """
import os, resource, signal, sys
import torch
import zerocopy_pickle as zp

count, kill_after = int(sys.argv[2]), int(sys.argv[3])
state = {f"layer{i}.weight": torch.full((512 * 1024,), float(i + 1)) for i in range(count)}  # 2 MiB each
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
written = 0
pwrite, pwritev = os.pwrite, os.pwritev


def dies_midway(n):  # SIGKILL from inside the write path once kill_after bytes are in: no handler, no cleanup
    global written
    written += n
    if written >= kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    return n


os.pwrite = lambda fd, data, offset: dies_midway(pwrite(fd, data, offset))
os.pwritev = lambda fd, views, offset: dies_midway(pwritev(fd, views, offset))
print("writing", flush=True)
zp.dump(state, sys.argv[1])
print("done", flush=True)
"""


@pytest.mark.slow
def test_a_dump_killed_mid_write_leaves_the_old_snapshot_and_no_temporary_file(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str],
) -> None:
    """The dumping process gets SIGKILL (no handler or cleanup runs) at a point set in advance rather than raced
    for: from inside its own write calls, once 32 MiB of the 64 are written (the file is preallocated, so its size
    says nothing about progress)."""
    path = old_snapshot[0]
    before = listing(path.parent)
    count, kill_after = 32, 32 * MiB
    assert path.stat().st_size < kill_after < count * 2 * MiB
    proc = run_python(KILLED_CHILD, str(path), str(count), str(kill_after), check=False, timeout=300)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.split() == ["writing"]
    assert_untouched(old_snapshot, before)


# ---------------------------------------------------------------------------------------------------------
# File objects and fsync
# ---------------------------------------------------------------------------------------------------------


def test_dump_to_an_open_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    state = medium_state() | small_state()
    with open(path, "wb") as f:
        zp.dump(state, f)
    assert path.read_bytes() == zp.dumps(state)
    assert_state_equal(zp.load(path), state)
    with open(path, "rb") as f:
        assert_state_equal(zp.load(f), state)
        assert f.read() == b""  # positioned after the snapshot
    with open(path, "rb") as f:
        assert_state_equal(zp.load(f, copy=True), state)
    assert_state_equal(zp.loads(path.read_bytes()), state)


def test_dump_to_an_unbuffered_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    state = medium_state()
    with open(path, "wb", buffering=0) as f:
        zp.dump(state, f)
    assert path.read_bytes() == zp.dumps(state)
    assert_state_equal(zp.load(path), state)


def test_dump_to_bytesio_round_trips() -> None:
    state = medium_state() | small_state()
    buffer = io.BytesIO()
    zp.dump(state, buffer)
    data = buffer.getvalue()
    assert data == zp.dumps(state)
    assert_state_equal(zp.loads(data), state)
    assert_state_equal(zp.loads(bytearray(data)), state)
    buffer.seek(0)
    assert_state_equal(zp.load(buffer), state)
    assert buffer.tell() == len(data)


def test_several_snapshots_in_one_file_object_load_in_order(tmp_path: Path) -> None:
    path = tmp_path / "many.zcp"
    states = [small_state(seed) for seed in range(3)]
    with open(path, "wb") as f:
        for state in states:
            zp.dump(state, f)
    with open(path, "rb") as f:
        for state in states:
            assert_state_equal(zp.load(f), state)
        assert f.read() == b""
    buffer = io.BytesIO(path.read_bytes())
    for state in states:
        assert_state_equal(zp.load(buffer), state)


def test_fsync_true_flushes_the_file_and_the_directory(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], write_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = old_snapshot[0]
    before = listing(path.parent)
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    state = medium_state()
    zp.dump(state, path, fsync=True)
    assert synced == ["file", "dir"]
    synced.clear()
    zp.dump(state, path)  # the default does not fsync
    assert synced == []
    monkeypatch.undo()
    assert listing(path.parent) == before
    assert path.read_bytes() == zp.dumps(state)
    assert_state_equal(zp.load(path), state)


def test_dump_creates_a_regular_file_with_umask_permissions(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    zp.dump(small_state(), path)
    reference = tmp_path / "reference"
    reference.write_bytes(b"")
    assert stat.S_ISREG(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)


# ---------------------------------------------------------------------------------------------------------
# Replacing a snapshot that is mapped
# ---------------------------------------------------------------------------------------------------------


def test_replacing_a_snapshot_keeps_existing_loads_valid(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    old = {f"layer{i}": torch.full((256 * 1024,), float(i)) for i in range(8)}  # 8 MiB, not touched yet
    zp.dump(old, path)
    old_inode = path.stat().st_ino
    loaded = zp.load(path)
    snap = zp.Snapshot.open(path)
    new = {f"layer{i}": torch.full((64,), -1.0) for i in range(3)}  # smaller: a truncation would SIGBUS
    zp.dump(new, path)
    assert path.stat().st_ino != old_inode  # renamed over, not rewritten in place
    assert_state_equal(loaded, old)  # first touch of most pages happens only now
    assert_state_equal(snap.load(), old)  # an open Snapshot keeps the old inode
    snap.close()
    assert_state_equal(zp.load(path), new)
    assert listing(tmp_path) == ["state.zcp"]


REPLACED_CHILD = """
import sys
import torch
import zerocopy_pickle as zp

state = zp.load(sys.argv[1])  # mapped, no data page touched
print("loaded", flush=True)
sys.stdin.readline()  # the parent replaces the file meanwhile
bad = [n for n, t in state.items() if not bool((t == float(n[len("layer"):])).all())]
print("ok" if not bad and len(state) == 8 else f"bad {bad}", flush=True)
"""


@pytest.mark.slow
def test_replacing_a_snapshot_keeps_another_process_load_valid(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    old = {f"layer{i}": torch.full((256 * 1024,), float(i)) for i in range(8)}
    zp.dump(old, path)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(REPLACED_CHILD), str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        assert proc.stdout.readline().strip() == "loaded"
        zp.dump({"other": torch.zeros(10)}, path)
        zp.dump({"yet another": torch.ones(5)}, path, fsync=True)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip() == "ok"
    assert_state_equal(zp.load(path), {"yet another": torch.ones(5)})
    assert listing(tmp_path) == ["state.zcp"]


@pytest.fixture(autouse=True)
def _no_stray_temp_files(tmp_path: Path) -> Iterator[None]:
    yield
    assert temp_names(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------
# Names, links and permissions: a dump behaves like open(path, "wb") from the outside
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [230, 234, 255])
def test_dump_with_a_long_name(tmp_path: Path, write_mode: str, length: int) -> None:
    """The temporary name stays within NAME_MAX however long the target's name is."""
    path = tmp_path / ("a" * (length - 4) + ".zcp")
    zp.dump(small_state(), path)
    zp.dump(small_state(1), path)  # and over an existing file
    assert_state_equal(zp.load(path), small_state(1))
    assert listing(tmp_path) == [path.name]


def test_dump_writes_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real" / "weights.zcp"
    target.parent.mkdir()
    zp.dump(small_state(), target)
    link = tmp_path / "link.zcp"
    link.symlink_to(target)
    zp.dump(small_state(1), link)
    assert link.is_symlink()
    assert_state_equal(zp.load(target), small_state(1))
    assert sorted(listing(target.parent)) == ["weights.zcp"]


def test_replacing_a_file_keeps_its_permissions(tmp_path: Path, write_mode: str) -> None:
    path = tmp_path / "private.zcp"
    zp.dump(small_state(), path)
    os.chmod(path, 0o600)
    zp.dump(small_state(1), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert_state_equal(zp.load(path), small_state(1))


def test_link_failure_other_than_a_missing_proc_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.zcp"
    zp.dump(small_state(), path)
    before = digest(path)

    def quota(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EDQUOT, "quota exceeded (simulated)")

    monkeypatch.setattr(os, "link", quota)
    with pytest.raises(OSError, match="quota"):
        zp.dump(small_state(1), path)
    monkeypatch.undo()
    assert digest(path) == before
    assert listing(tmp_path) == ["x.zcp"]


def test_replacing_a_snapshot_swaps_names_atomically(
    old_snapshot: tuple[Path, dict[str, torch.Tensor], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over an existing file the dump exchanges the two names (no rename-over, which makes ext4 flush), then
    unlinks the old one; where the exchange is unavailable it falls back to a plain rename."""
    path = old_snapshot[0]
    before = listing(path.parent)
    old_inode = path.stat().st_ino
    exchanged: list[bool] = []
    real_exchange = atomic._exchange

    def spy(new: str, old: str) -> bool:
        exchanged.append(real_exchange(new, old))
        return exchanged[-1]

    monkeypatch.setattr(atomic, "_exchange", spy)
    zp.dump(small_state(1), path)
    assert exchanged == [True]
    assert path.stat().st_ino != old_inode
    assert listing(path.parent) == before
    assert_state_equal(zp.load(path), small_state(1))
    monkeypatch.setattr(atomic, "_exchange", lambda new, old: False)
    zp.dump(small_state(2), path)
    assert listing(path.parent) == before
    assert_state_equal(zp.load(path), small_state(2))


# ---------------------------------------------------------------------------------------------------------
# The writer of files in a directory held open (_storage/atomic.py)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A directory with ``old.bin`` in it, and an fd of the directory."""
    (tmp_path / "old.bin").write_bytes(b"previous content")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield tmp_path, fd
    finally:
        os.close(fd)


def test_atomic_write_puts_the_new_content_in_place_privately(directory: tuple[Path, int]) -> None:
    where, fd = directory
    atomic.write(fd, "old.bin", b"new content")
    atomic.write(fd, "new.bin", b"a new file", fsync=True)
    assert (where / "old.bin").read_bytes() == b"new content"
    assert (where / "new.bin").read_bytes() == b"a new file"
    assert stat.S_IMODE((where / "new.bin").stat().st_mode) == 0o600
    assert listing(where) == ["new.bin", "old.bin"]  # no temporary left


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(directory: tuple[Path, int]) -> None:
    where, fd = directory
    seen: list[list[str]] = []

    def half_then_full(out: int) -> None:
        os.write(out, b"half of it")
        seen.append(listing(where))
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    def write() -> None:
        with atomic.replacing(fd, "old.bin") as out:
            half_then_full(out)

    with pytest.raises(OSError, match="No space"):
        write()
    assert len(seen[0]) == 2  # the temporary existed, beside the old file, under another name
    assert (where / "old.bin").read_bytes() == b"previous content"
    assert listing(where) == ["old.bin"]


@pytest.mark.parametrize("step", ["rename", "fsync"])
def test_a_failed_rename_or_fsync_leaves_the_old_file_and_no_temporary(
    directory: tuple[Path, int], monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    where, fd = directory

    def failing(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, f"{step} failed (simulated)")

    monkeypatch.setattr(os, step, failing)
    with pytest.raises(OSError, match=f"{step} failed"):
        atomic.write(fd, "old.bin", b"new content", fsync=True)
    monkeypatch.undo()
    assert (where / "old.bin").read_bytes() == b"previous content"
    assert listing(where) == ["old.bin"]


def test_atomic_write_without_replace_keeps_an_existing_file(directory: tuple[Path, int]) -> None:
    where, fd = directory
    with pytest.raises(FileExistsError):
        atomic.write(fd, "old.bin", b"new content", replace=False)
    atomic.write(fd, "key.bin", b"made once", replace=False)
    assert (where / "old.bin").read_bytes() == b"previous content"
    assert (where / "key.bin").read_bytes() == b"made once"
    assert listing(where) == ["key.bin", "old.bin"]


def test_atomic_write_replaces_a_link_at_its_name_and_never_follows_it(
    directory: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    where, fd = directory
    victim = tmp_path_factory.mktemp("elsewhere") / "victim"
    victim.write_bytes(b"do not touch")
    (where / "link.bin").symlink_to(victim)
    atomic.write(fd, "link.bin", b"new content")
    assert not (where / "link.bin").is_symlink()
    assert (where / "link.bin").read_bytes() == b"new content"
    assert victim.read_bytes() == b"do not touch"
