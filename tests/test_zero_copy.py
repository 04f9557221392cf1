"""Loads are zero-copy and copy-on-write: every storage is a view into one private mapping of the snapshot.

Checked from the outside, through /proc: where the storages live (``maps``), what a write changes (the file's
bytes, other loads, other processes), how much memory a load costs (``VmRSS``) and that processes mapping the
same snapshot share its physical pages (``Pss`` is about half of ``Rss`` with two mappers).
"""

from __future__ import annotations

import gc
import hashlib
import json
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.conftest import REPO, TIED_NET_ALLOW, mapped_regions, region_of, run_python

MiB = 1 << 20
GiB = 1 << 30
PAGE = mmap.PAGESIZE
MEMFD_REGION = "/memfd:zerocopy_pickle (deleted)"


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def sample_state() -> dict[str, torch.Tensor]:
    """A few tensors of different dtypes and sizes, some spanning many pages, one a view with an offset."""
    torch.manual_seed(0)
    base = torch.randn(64, 1024)
    return {
        "big": torch.randn(256, 1024),  # 1 MiB
        "ints": torch.arange(100_000, dtype=torch.int64),
        "half": torch.randn(3, 5).half(),
        "view": base[10:20],  # a view: its storage is all of ``base``
        "scalar": torch.tensor(3.5),
    }


def storage_regions(obj: dict[str, torch.Tensor]) -> set[tuple[int, int, str]]:
    regions = set()
    for name, tensor in obj.items():
        region = region_of(tensor.untyped_storage().data_ptr())
        assert region is not None, f"{name}: storage address is not mapped at all"
        regions.add(region)
    return regions


def the_region(obj: dict[str, torch.Tensor]) -> tuple[int, int, str]:
    regions = storage_regions(obj)
    assert len(regions) == 1, f"storages of one load lie in {len(regions)} mappings: {regions}"
    return regions.pop()


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def scribble(obj: dict[str, torch.Tensor]) -> None:
    """Write to every page of every loaded storage (through the tensors' storages, views included)."""
    for tensor in obj.values():
        raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        raw[::PAGE].fill_(0xA5)
        raw[-1:].fill_(0x5A)


def mapping_memory(pid: int, path: str) -> tuple[int, int, int]:
    """``(count, Rss, Pss)`` in bytes of the mappings of ``pid`` whose path is ``path`` (from smaps)."""
    count = rss = pss = 0
    current = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                current = head[5].strip() if len(head) > 5 else ""
                count += current == path
            elif current == path and head[0] == "Rss:":
                rss += int(head[1]) * 1024
            elif current == path and head[0] == "Pss:":
                pss += int(head[1]) * 1024
    return count, rss, pss


def rollup(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {
            parts[0].rstrip(":"): int(parts[1]) * 1024
            for parts in (line.split() for line in f)
            if len(parts) == 3 and parts[2] == "kB"
        }


def write_big_state_dict(path: Path, count: int, nbytes_each: int) -> None:
    """Dump ``count`` float32 tensors of ``nbytes_each`` bytes to ``path`` from a separate interpreter, which
    exits before anything is measured (so nothing of it lingers in this process or the measured ones)."""
    run_python(
        """
        import sys
        import torch
        import zerocopy_pickle as zp

        count, numel = int(sys.argv[2]), int(sys.argv[3]) // 4
        zp.dump({f"layer{i}.weight": torch.full((numel,), float(i + 1)) for i in range(count)}, sys.argv[1])
        """,
        str(path),
        str(count),
        str(nbytes_each),
    )
    assert path.stat().st_size >= count * nbytes_each


@pytest.fixture
def big_path(tmp_path: Path) -> Iterator[Path]:
    """A path for a snapshot of gigabytes, removed at teardown (pytest keeps old tmp_paths around)."""
    path = tmp_path / "big.zcp"
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------
# Where the storages live
# ---------------------------------------------------------------------------------------------------------


def test_load_path_storages_are_views_into_one_mapping_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    state = sample_state()
    zp.dump(state, path)
    loaded = zp.load(path)
    assert_state_equal(loaded, state)
    start, end, name = the_region(loaded)
    assert name == os.path.realpath(path)
    # Mapped once, the whole file: the region is exactly the file rounded up to pages.
    assert end - start == round_up(path.stat().st_size)
    # Tensors sharing a storage at dump time still share it (the view's storage is all of ``base``).
    assert loaded["view"].untyped_storage().nbytes() == 64 * 1024 * 4
    assert loaded["view"].storage_offset() == 10 * 1024


def test_two_loads_map_separately(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    zp.dump(sample_state(), path)
    first, second = zp.load(path), zp.load(path)
    region_a, region_b = the_region(first), the_region(second)
    assert region_a != region_b
    assert region_a[2] == region_b[2] == os.path.realpath(path)
    # The regions do not overlap.
    assert region_a[1] <= region_b[0] or region_b[1] <= region_a[0]
    assert first["big"].data_ptr() != second["big"].data_ptr()


def test_load_of_a_file_object_maps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    zp.dump(sample_state(), path)
    with open(path, "rb") as f:
        loaded = zp.load(f)
    _, _, name = the_region(loaded)
    assert name == os.path.realpath(path)


@pytest.mark.parametrize("map_location", ["cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, loc: s])
def test_map_location_cpu_stays_zero_copy(tmp_path: Path, map_location: object) -> None:
    path = tmp_path / "state.zcp"
    state = sample_state()
    zp.dump(state, path)
    loaded = zp.load(path, map_location=map_location)
    assert_state_equal(loaded, state)
    _, _, name = the_region(loaded)
    assert name == os.path.realpath(path)


def test_freeze_load_storages_are_views_into_one_memfd_mapping() -> None:
    state = sample_state()
    with zp.freeze(state) as snap:
        first = snap.load()
        second = snap.load(map_location="cpu")
        assert_state_equal(first, state)
        region_a, region_b = the_region(first), the_region(second)
    assert region_a[2] == region_b[2] == MEMFD_REGION
    assert region_a != region_b
    assert region_a[1] - region_a[0] == round_up(snap.nbytes)


def test_module_parameters_are_views_into_the_mapping(tmp_path: Path, tied_net: torch.nn.Module) -> None:
    path = tmp_path / "net.zcp"
    zp.dump(tied_net, path)
    net = zp.load(path, allow=TIED_NET_ALLOW)
    tensors = dict(net.state_dict(keep_vars=True))
    _, _, name = the_region(tensors)
    assert name == os.path.realpath(path)
    assert net.head.weight is net.embed.weight


def test_loaded_tensors_keep_the_mapping_alive(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    state = sample_state()
    zp.dump(state, path)
    big = zp.load(path)["big"]  # the rest of the graph (and the load's own references) are gone
    gc.collect()
    region = region_of(big.untyped_storage().data_ptr())
    assert region is not None
    assert region[2] == os.path.realpath(path)
    assert torch.equal(big, state["big"])
    del big
    gc.collect()
    assert all(p != os.path.realpath(path) for _, _, p in mapped_regions()), "mapping outlived its storages"


# ---------------------------------------------------------------------------------------------------------
# Copy-on-write
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_writing_a_loaded_tensor_changes_neither_the_file_nor_other_loads(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    state = sample_state()
    zp.dump(state, path)
    digest = sha256(path)

    writer, bystander = zp.load(path), zp.load(path)
    scribble(writer)
    writer["big"].add_(1)
    writer["ints"].zero_()
    assert not torch.equal(writer["big"], state["big"])

    assert sha256(path) == digest
    assert_state_equal(bystander, state)
    assert_state_equal(zp.load(path), state)  # a load made after the write
    assert_state_equal(zp.load(path, copy=True), state)

    # Another process, loading while this one still holds its dirtied mapping, sees the original bytes; what
    # it writes to its own load changes nothing here either.
    proc = run_python(
        """
        import hashlib, sys
        import torch
        import zerocopy_pickle as zp

        state = zp.load(sys.argv[1])
        h = hashlib.sha256()
        for name in sorted(state):
            h.update(state[name].reshape(-1).view(torch.uint8).numpy().tobytes())
        print(h.hexdigest())
        for t in state.values():
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(7)
        """,
        str(path),
    )
    want = hashlib.sha256()
    for name in sorted(state):
        want.update(state[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    assert proc.stdout.strip() == want.hexdigest()

    assert sha256(path) == digest
    assert_state_equal(bystander, state)
    assert writer["ints"].eq(0).all()


@pytest.mark.slow
def test_write_in_another_process_does_not_reach_this_one(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    state = sample_state()
    zp.dump(state, path)
    digest = sha256(path)
    mine = zp.load(path)
    assert mine["big"].sum().item() == pytest.approx(state["big"].sum().item())  # pages mapped here already

    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys
                import torch
                import zerocopy_pickle as zp

                state = zp.load(sys.argv[1])
                for t in state.values():
                    torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(0xFF)
                print("written", flush=True)
                sys.stdin.read()  # stay alive, dirty mapping and all, until the parent has checked
                """
            ),
            str(path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "written":
            proc.kill()
            pytest.fail(f"child failed before writing:\n{proc.communicate()[1]}")
        assert_state_equal(mine, state)
        assert_state_equal(zp.load(path), state)
        assert sha256(path) == digest
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_frozen_snapshot_loads_are_copy_on_write() -> None:
    state = sample_state()
    with zp.freeze(state) as snap:
        assert snap.sealed
        frozen_bytes = os.pread(snap.fd, snap.nbytes, 0)
        writer, bystander = snap.load(), snap.load()
        scribble(writer)
        writer["big"].fill_(-1.0)
        assert writer["big"].eq(-1.0).all()
        assert_state_equal(bystander, state)
        assert_state_equal(snap.load(), state)
        # The memfd's bytes are unchanged too.
        assert os.pread(snap.fd, snap.nbytes, 0) == frozen_bytes
        assert_state_equal(zp.loads(frozen_bytes), state)


@pytest.mark.slow
def test_frozen_snapshot_write_is_private_to_one_process() -> None:
    state = sample_state()
    with zp.freeze(state) as snap:
        mine = snap.load()
        _run_with_fd(snap.fd)  # loads through the inherited fd and writes to every byte of its load
        assert_state_equal(mine, state)
        assert_state_equal(snap.load(), state)


def _run_with_fd(fd: int) -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        import zerocopy_pickle as zp

        snap = zp.Snapshot.from_fd(int(sys.argv[1]), trusted=True)
        state = snap.load()
        for t in state.values():
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(0xFF)
        again = snap.load()
        assert not torch.equal(again["big"], state["big"]), "a write reached another load"
        assert not again["big"].view(torch.uint8).eq(0xFF).all()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(fd)],
        pass_fds=(fd,),
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr


def test_snapshot_open_loads_are_copy_on_write(tmp_path: Path) -> None:
    path = tmp_path / "state.zcp"
    state = sample_state()
    zp.dump(state, path)
    digest = sha256(path)
    with zp.Snapshot.open(path) as snap:
        assert not snap.sealed
        writer, bystander = snap.load(), snap.load()
        assert the_region(writer)[2] == os.path.realpath(path)
        assert the_region(writer) != the_region(bystander)
        scribble(writer)
        writer["ints"].fill_(-5)
        assert_state_equal(bystander, state)
        assert_state_equal(snap.load(), state)
    assert sha256(path) == digest
    assert_state_equal(zp.load(path), state)
    assert writer["ints"].eq(-5).all()  # still valid after close()


# ---------------------------------------------------------------------------------------------------------
# Memory: a load costs almost nothing until touched; processes share the pages
# ---------------------------------------------------------------------------------------------------------

RSS_CHILD = """
import gc, json, os, sys
import torch
import zerocopy_pickle as zp

def vm_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")

def mapping_rss(path):
    rss, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and not head[0].endswith(":"):
                current = head[5].strip() if len(head) > 5 else ""
            elif current == path and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss

path = sys.argv[1]
zp.loads(zp.dumps({"warm": torch.ones(4)}))  # first-call costs (lazy imports, allocator) before measuring
gc.collect()
before = vm_rss()
state = zp.load(path)
after_load = vm_rss()
mapped_after_load = mapping_rss(os.path.realpath(path))
ptrs = {t.untyped_storage().data_ptr() for t in state.values()}
touched = sum(int(t.view(torch.uint8)[::4096].sum()) for t in state.values())
after_touch = vm_rss()
mapped_after_touch = mapping_rss(os.path.realpath(path))
ok = all(float(state[f"layer{i}.weight"][-1]) == i + 1 for i in range(len(state)))
print(json.dumps({
    "before": before, "after_load": after_load, "after_touch": after_touch, "count": len(state),
    "mapped_after_load": mapped_after_load, "mapped_after_touch": mapped_after_touch,
    "min_ptr": min(ptrs), "max_ptr": max(ptrs), "values_ok": ok, "touched": touched,
}))
"""


@pytest.mark.slow
def test_load_does_not_read_the_file_and_touching_it_does(big_path: Path) -> None:
    count, each = 1024, 2 * MiB  # 2 GiB
    write_big_state_dict(big_path, count, each)
    total = count * each

    stats = json.loads(run_python(RSS_CHILD, str(big_path)).stdout)
    assert stats["count"] == count
    assert stats["values_ok"]
    load_cost = stats["after_load"] - stats["before"]
    assert load_cost < 0.03 * total, f"load() raised RSS by {load_cost / MiB:.1f} MiB for a 2 GiB snapshot"
    assert stats["mapped_after_load"] < 0.03 * total
    # Sanity check of the measurement: touching one byte per page brings every page in.
    touch_cost = stats["after_touch"] - stats["after_load"]
    assert 0.95 * total <= touch_cost <= 1.05 * total, f"touching raised RSS by {touch_cost / MiB:.1f} MiB"
    assert 0.95 * total <= stats["mapped_after_touch"] <= total + 64 * MiB


SHARE_CHILD = """
import sys
import torch
import zerocopy_pickle as zp

kind, where = sys.argv[1], sys.argv[2]
if kind == "file":
    state = zp.load(where)
else:
    snap = zp.Snapshot.from_fd(int(where), trusted=True)
    state = snap.load()
    snap.close()
touched = sum(int(t.view(torch.uint8)[::4096].sum()) for t in state.values())
print("ready", flush=True)
sys.stdin.read()  # hold the mapping until the parent has measured
print(len(state), flush=True)
"""


def _measure_two_sharers(kind: str, where: str, region: str, nbytes: int, pass_fds: tuple[int, ...] = ()) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARE_CHILD, kind, where],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            pass_fds=pass_fds,
        )
        for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                proc.kill()
                pytest.fail(f"child failed before it was ready:\n{proc.communicate()[1]}")
        # Both children are alive and blocked on stdin, each with every page of the snapshot mapped.
        for proc in procs:
            count, rss, pss = mapping_memory(proc.pid, region)
            assert count == 1, f"pid {proc.pid} maps {region!r} {count} times"
            assert rss >= 0.95 * nbytes, f"pid {proc.pid}: Rss of the mapping is only {rss / MiB:.1f} MiB"
            ratio = pss / rss
            assert 0.4 <= ratio <= 0.6, f"pid {proc.pid}: Pss/Rss of the snapshot mapping is {ratio:.3f}"
            totals = rollup(proc.pid)
            # The whole process: the shared half of the snapshot is what Pss saves over Rss.
            assert totals["Rss"] - totals["Pss"] >= 0.4 * nbytes
    finally:
        # Closing stdin releases the children; one already reaped by pytest.fail above is skipped.
        outputs = [proc.communicate(timeout=120) if proc.returncode is None else ("", "") for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err


@pytest.mark.slow
def test_two_processes_share_the_pages_of_a_snapshot_file(big_path: Path) -> None:
    count, each = 512, 2 * MiB  # 1 GiB
    write_big_state_dict(big_path, count, each)
    _measure_two_sharers("file", str(big_path), os.path.realpath(big_path), count * each)


@pytest.mark.slow
def test_two_processes_share_the_pages_of_a_frozen_snapshot() -> None:
    count, each = 512, 2 * MiB  # 1 GiB
    state = {f"layer{i}.weight": torch.full((each // 4,), float(i + 1)) for i in range(count)}
    snap = zp.freeze(state)
    del state  # the memfd holds the only copy now
    try:
        assert snap.nbytes >= count * each
        _measure_two_sharers("memfd", str(snap.fd), MEMFD_REGION, count * each, pass_fds=(snap.fd,))
    finally:
        snap.close()
