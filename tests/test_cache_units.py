"""The model cache's parts in isolation: the store (LRU, sharing, compaction, persistence), the private
directory, keys, and what the server and the zygote import. The end-to-end behaviour is in test_cache.py."""

from __future__ import annotations

import gc
import importlib.metadata
import json
import mmap
import os
import pickle
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_python
from tests.internals import arena
from zerocopy_pickle.cache import client, filebacked, filing, keys, loader, protocol
from zerocopy_pickle.cache.fields import MAX_FILE_CHECKS, BufferRow, FileCheck
from zerocopy_pickle.cache.keys import Request, Uncacheable, _fingerprint, describe
from zerocopy_pickle.cache.lru import Entry
from zerocopy_pickle.cache.messages import Get
from zerocopy_pickle.cache.store import Store


def sealed_segment(data: bytes) -> int:
    fd = arena.create_memfd("test-segment")
    os.write(fd, data)
    arena.seal(fd)
    return fd


def read_range(store: Store, row: BufferRow) -> bytes:
    segment = store.segments[row.segment]
    return os.pread(segment.fd, row.nbytes, row.offset)


def entry(key: str, rows: list[tuple[int, int, int]]) -> Entry:
    """An entry whose buffers are ``(segment, offset, nbytes)`` rows (segment 0: the segment sent with it; -1:
    the first file sent with it)."""

    def row(s: int, o: int, n: int) -> BufferRow:
        if s < 0:
            return BufferRow(-s - 1, o, n, "cpu", None, "file")
        return BufferRow(s, o, n, "cpu", f"digest-{s}-{o}", "segment" if s else "new")

    return Entry(key, f"call {key}", b"stream", [row(s, o, n) for s, o, n in rows], [])


PAGE = mmap.PAGESIZE


def test_lru_eviction_keeps_the_newest_and_frees_segments() -> None:
    store = Store(max_bytes=3 * PAGE)
    for key in ("a", "b", "c"):
        store.add(entry(key, [(0, 0, 2 * PAGE)]), sealed_segment(key.encode() * 2 * PAGE))
        store.get(key)
    assert list(store.entries) == ["c"]  # each needs two pages of the three: only the newest fits
    assert store.evictions == 2 and store.total_bytes() == 2 * PAGE and len(store.segments) == 1
    store.close()


def test_get_refreshes_recency() -> None:
    store = Store(max_bytes=5 * PAGE)
    store.add(entry("a", [(0, 0, 2 * PAGE)]), sealed_segment(b"a" * 2 * PAGE))
    store.add(entry("b", [(0, 0, 2 * PAGE)]), sealed_segment(b"b" * 2 * PAGE))
    assert store.get("a") is not None  # a is now the most recently used
    store.add(entry("c", [(0, 0, 2 * PAGE)]), sealed_segment(b"c" * 2 * PAGE))
    assert sorted(store.entries) == ["a", "c"]
    store.close()


def test_shared_segment_is_compacted_instead_of_kept_whole() -> None:
    store = Store(max_bytes=6 * PAGE)
    big = b"A" * (4 * PAGE) + b"shared-bytes" + b"\0" * (PAGE - 12)
    store.add(entry("a", [(0, 0, 4 * PAGE), (0, 4 * PAGE, 12)]), sealed_segment(big))
    segment_a = next(iter(store.segments))
    # b uses a's small buffer (deduplicated) and brings 1 page of its own.
    store.add(entry("b", [(segment_a, 4 * PAGE, 12), (0, 0, PAGE)]), sealed_segment(b"B" * PAGE))
    store.add(entry("c", [(0, 0, 3 * PAGE)]), sealed_segment(b"C" * 3 * PAGE))
    # 5 + 1 + 3 pages > 6: evicting a alone would leave its 5-page segment alive for b's 12 bytes.
    assert sorted(store.entries) == ["b", "c"]
    assert segment_a not in store.segments
    assert store.total_bytes() <= store.max_bytes
    b_rows = store.entries["b"].buffers
    assert read_range(store, b_rows[0]) == b"shared-bytes" and read_range(store, b_rows[1]) == b"B" * PAGE
    compacted = store.segments[b_rows[0].segment]
    assert compacted.nbytes < PAGE and arena.is_sealed(compacted.fd)
    # A load that started before the compaction refers to the old range: it is repointed, not refused.
    late = store.add(entry("d", [(segment_a, 4 * PAGE, 12)]), None)
    assert read_range(store, late.buffers[0]) == b"shared-bytes"
    store.close()


def test_entry_referring_to_a_freed_segment_is_refused() -> None:
    store = Store()
    with pytest.raises(protocol.CacheError, match="gone"):
        store.add(entry("x", [(42, 0, 10)]), None)
    store.close()


def test_unsealed_segment_is_refused() -> None:
    store = Store()
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.write(fd, b"x" * 10)
    with pytest.raises(protocol.CacheError, match="not sealed"):
        store.add(entry("x", [(0, 0, 10)]), fd)
    store.close()


def test_persistence_round_trip_and_damaged_directory(tmp_path: Path) -> None:
    persist, keys = tmp_path / "persist", tmp_path / "keys"
    keys.mkdir(mode=0o700)
    store = Store(persist=persist, key_dir=keys)
    store.add(entry("a", [(0, 0, 5)]), sealed_segment(b"hello"))
    store.close()
    again = Store(persist=persist, key_dir=keys)
    assert list(again.entries) == ["a"] and read_range(again, again.entries["a"].buffers[0]) == b"hello"
    again.close()
    (persist / "index.json").write_text("{not json")
    cold = Store(persist=persist, key_dir=keys)  # damaged: starts cold instead of failing
    assert not cold.entries and not cold.segments and "damaged" in (cold.cold_start or "")
    cold.close()


def test_a_persisted_file_segment_keeps_its_identity_in_the_first_order(tmp_path: Path) -> None:
    """The index lists a file segment's identity as ``[dev, ino, size, mtime_ns, ctime_ns]``, the order indexes
    had before ``FileIdentity``: such a row is restored (the file reopened, the entry kept); a changed file is not."""
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * PAGE)
    persist, keys = tmp_path / "persist", tmp_path / "keys"
    keys.mkdir(mode=0o700)
    store = Store(persist=persist, key_dir=keys)
    store.add(entry("f", [(-1, 0, PAGE)]), None, [os.open(weights, os.O_RDONLY)])
    store.close()
    body = json.loads(json.loads((persist / "index.json").read_text())["body"])
    (row,) = [s for s in body["segments"] if s["kind"] == "file"]
    info = weights.stat()
    assert row["identity"] == [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    again = Store(persist=persist, key_dir=keys)
    assert list(again.entries) == ["f"] and read_range(again, again.entries["f"].buffers[0]) == b"w" * PAGE
    again.close()
    time.sleep(0.05)  # past the coarse clock's tick, so the rewrite's ctime is another
    with open(weights, "r+b") as f:  # in place, same size
        f.write(b"x")
    os.utime(weights, ns=(info.st_atime_ns, info.st_mtime_ns))
    changed = Store(persist=persist, key_dir=keys)
    assert not changed.entries and changed.cold_start is None  # the segment dropped, the index still trusted
    changed.close()


def test_every_file_a_key_was_computed_from_is_checked_on_every_hit(tmp_path: Path) -> None:
    """An entry keeps the identities of the files its key was computed from; a hit checks them again, and an entry
    whose files are not what they were is dropped (a miss), even when the request's key is the same (a client
    that could not see the change, or a change after the key was computed), and across a restart."""
    weights, other = tmp_path / "weights.bin", tmp_path / "other.bin"
    weights.write_bytes(b"one")
    other.write_bytes(b"xyz")
    persist, keys = tmp_path / "persist", tmp_path / "keys"
    keys.mkdir(mode=0o700)
    store = Store(persist=persist, key_dir=keys)
    for key, file in (("a", weights), ("b", other)):
        made = entry(key, [(0, 0, 5)])
        made.files = [FileCheck.of(str(file), file.stat())]
        store.add(made, sealed_segment(b"hello"))
    assert store.get("a") is not None and store.get("b") is not None
    store.close()
    store = Store(persist=persist, key_dir=keys)  # restarted: the checks were persisted with the entries
    assert store.entries["a"].files == [FileCheck.of(str(weights), weights.stat())]
    before = weights.stat()
    with open(weights, "r+b") as f:  # in place, same size, the modification time put back
        f.write(b"two")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert store.get("a") is None and "a" not in store.entries
    assert (store.stale, store.misses) == (1, 1)
    assert store.get("b") is not None  # the other entry's file did not change
    other.unlink()
    assert store.get("b") is None and store.stale == 2  # a file that is gone
    store.close()


def test_runtime_dir_refuses_unsafe_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    private = tmp_path / "private"
    monkeypatch.setenv(protocol.DIR_ENV, str(private))
    assert protocol.runtime_dir() == private and (private.stat().st_mode & 0o777) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    monkeypatch.setenv(protocol.DIR_ENV, str(open_dir))
    with pytest.raises(protocol.CacheError, match="accessible to other users"):
        protocol.runtime_dir()
    link = tmp_path / "link"
    link.symlink_to(private)
    monkeypatch.setenv(protocol.DIR_ENV, str(link))
    with pytest.raises(protocol.CacheError, match="not a plain directory"):
        protocol.runtime_dir()


def test_key_follows_file_changes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    weights = checkpoint / "weights.bin"
    weights.write_bytes(b"one")
    point = "torch.serialization:load"
    first = describe(point, None, (str(checkpoint),), {}).key
    assert describe(point, None, (str(checkpoint),), {}).key == first  # stable
    before = weights.stat()
    weights.write_bytes(b"two")  # same size, same inode
    # The key is each file's size, mtime, ctime and inode, never its bytes: with the mtime put back, the ctime
    # (which nobody can set back) still changed, and so did the key.
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_mtime_ns == before.st_mtime_ns and weights.stat().st_ctime_ns != before.st_ctime_ns
    second = describe(point, None, (str(checkpoint),), {}).key
    assert second != first
    assert describe(point, None, (str(checkpoint),), {}).key == second  # stable again
    # A new mtime, set rather than waited for (a file system's timestamp granularity can be coarse).
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert describe(point, None, (str(checkpoint),), {}).key != first
    assert describe(point, None, (str(checkpoint),), {"mmap": True}).key != first


def test_key_follows_the_loaders_library_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's version is its imported package's ``__version__`` (no metadata parse on the caller's path),
    else its distribution's."""
    import types

    fake = types.ModuleType("zcp_fake_loader")
    fake.__version__ = "1.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "zcp_fake_loader", fake)
    keys._library_version.cache_clear()
    point = "zcp_fake_loader.models:load"
    first = describe(point, None, ("x",), {}).key
    fake.__version__ = "2.0"  # type: ignore[attr-defined]
    keys._library_version.cache_clear()  # a process sees one version: looked up once
    assert describe(point, None, ("x",), {}).key != first
    assert keys._library_version("zcp_fake_loader.models") == "2.0"
    del fake.__version__
    keys._library_version.cache_clear()
    assert keys._library_version("zcp_fake_loader") == "?"  # no distribution either
    assert keys._library_version("pytest") == importlib.metadata.version("pytest")
    keys._library_version.cache_clear()


def test_symlinked_subfolders_are_followed_and_cycles_are_not(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    for name, data in (("vae-a", b"aaaa"), ("vae-b", b"bbbb")):
        (shared / name).mkdir(parents=True)
        (shared / name / "weights.bin").write_bytes(data)
    model = tmp_path / "pipeline"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    (model / "vae").symlink_to(shared / "vae-a")
    (model / "also-vae").symlink_to(shared / "vae-a")  # the same folder twice (not a cycle): both rows
    (model / "vae" / "loop").symlink_to(model)  # a cycle through the link: not followed again
    (model / "self").symlink_to(".")
    rows = _fingerprint(str(model))
    names = [row[0] for row in rows]
    assert names == sorted(["also-vae/weights.bin", "model_index.json", "vae/weights.bin"])
    vae_row = rows[names.index("vae/weights.bin")]
    assert vae_row[4] == (shared / "vae-a" / "weights.bin").stat().st_ino  # the identity of the file it leads to
    point = "torch.serialization:load"
    first = describe(point, None, (str(model),), {}).key
    (model / "vae").unlink()
    (model / "vae").symlink_to(shared / "vae-b")  # re-pointed: same names and sizes, another folder
    assert describe(point, None, (str(model),), {}).key != first


def test_requests_carry_the_callers_working_directory_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    get = describe("torch.serialization:load", None, ("model.pt",), {}).get
    assert get.cwd == str(tmp_path)
    header = get.encode()
    assert Get.decode(header).cwd == str(tmp_path)
    for bad in ("relative/dir", "", 3, ["/"], "/a\0b", "/" + "x" * 5000):
        with pytest.raises(protocol.ProtocolError, match="absolute path"):
            Get.decode({**header, "cwd": bad})
    assert Get.decode({**header, "cwd": None}).cwd is None


def test_hub_ids_key_on_the_commit_and_its_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where no "org/tiny" folder exists
    repo = tmp_path / "hub" / "models--org--tiny"
    commits = ["a" * 40, "b" * 40]
    for commit in commits:
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commits[0] + "\n")
    point = "transformers.modeling_utils:PreTrainedModel.from_pretrained"

    def request(**kwargs: object) -> Request:
        return describe(point, None, ("org/tiny",), {"cache_dir": str(tmp_path / "hub"), **kwargs})

    first = request()
    assert first.key == request().key
    assert request(revision=commits[0]).key != first.key  # another revision, the same commit: keyed apart
    # The loader is told the commit and the cache the key names.
    args, kwargs = pickle.loads(first.payload)
    assert args == ("org/tiny",) and kwargs == {"revision": commits[0], "cache_dir": str(tmp_path / "hub")}
    (repo / "snapshots" / commits[0] / "config.json").write_text("c" * 40)  # the snapshot's files changed
    assert request().key != first.key
    (repo / "refs" / "main").write_text(commits[1])
    moved = pickle.loads(request().payload)[1]
    assert moved["revision"] == commits[1]
    for bad in ({"revision": "v1"}, {"revision": "../refs/main"}, {"revision": "f" * 40}):
        with pytest.raises(Uncacheable):
            request(**bad)  # no such ref, not a ref name, no such snapshot
    (repo / "refs" / "v2").write_text("not a commit")
    with pytest.raises(Uncacheable, match="commit"):
        request(revision="v2")
    with pytest.raises(Uncacheable, match="cannot be known offline"):
        describe(point, None, ("org/absent",), {"cache_dir": str(tmp_path / "hub")})
    # Not a repository id, or not a from_pretrained: keyed as before, without looking at the Hub cache.
    assert pickle.loads(describe("torch.serialization:load", None, ("org/absent",), {}).payload)[1] == {}
    describe(point, None, ("./not/a/repo",), {})


def test_a_call_naming_more_files_than_a_request_can_list_is_not_cached(tmp_path: Path) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(MAX_FILE_CHECKS):
        (folder / f"{i}.bin").touch()
    get = describe("torch.serialization:load", None, (str(folder),), {}).get
    assert len(get.files) == MAX_FILE_CHECKS and len(json.dumps(get.encode())) < protocol.REQUEST.header
    (folder / "one-more.bin").touch()
    with pytest.raises(Uncacheable, match="too many files"):
        describe("torch.serialization:load", None, (str(folder),), {})


def test_learnable_modules() -> None:
    assert loader.learnable("diffusers.pipelines.controlnet.pipeline_controlnet")
    assert loader.learnable("transformers.models.clip.modeling_clip")
    assert not loader.learnable("diffusers_modules.local.my_pipeline")  # repository code: may change
    assert not loader.learnable("transformers_modules.repo.abc.modeling_x")
    assert not loader.learnable("my_company.models")
    assert not loader.learnable("__main__")
    assert "diffusers.models.modeling_utils" in loader.patch_point_modules()


def test_server_side_imports_no_torch() -> None:
    proc = run_python(
        """
        import sys
        import zerocopy_pickle.cache.server, zerocopy_pickle._cli, zerocopy_pickle.cache
        print(sorted(m for m in ("torch", "numpy", "diffusers", "transformers") if m in sys.modules))
        """
    )
    assert json.loads(proc.stdout.strip().replace("'", '"')) == []


@pytest.mark.slow
def test_the_loader_and_the_cache_command_import_nothing_above_them() -> None:
    """The loader needs neither the client nor the patching (no client -> loader -> patch -> client cycle), and
    ``python -m zerocopy_pickle.cache`` runs the cache's own commands, not the top-level CLI."""
    proc = run_python(
        """
        import runpy, sys
        import zerocopy_pickle.cache.loader
        print(sorted(m for m in ("zerocopy_pickle.cache.client", "zerocopy_pickle.cache.patch") if m in sys.modules))
        sys.argv = ["zerocopy_pickle.cache", "--help"]
        try:
            runpy.run_module("zerocopy_pickle.cache", run_name="__main__")
        except SystemExit:
            pass
        print(sorted(m for m in ("zerocopy_pickle._cli", "zerocopy_pickle._core.snapshot") if m in sys.modules))
        """
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert lines == ["[]", "[]"], proc.stdout
    assert "serve" in proc.stdout and "status" in proc.stdout  # the cache's commands, from --help


def test_file_ranges_find_untouched_views_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (4 * PAGE // 256) * 4)  # 16 pages
    fd = os.open(path, os.O_RDONLY)
    try:
        memory = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    view = memoryview(memory)
    untouched = view[PAGE : 3 * PAGE]
    unfaulted = view[8 * PAGE + 100 : 12 * PAGE]
    written = view[4 * PAGE : 6 * PAGE]
    written[10] = 255 - written[10]  # copy-on-write: this page is not the file's any more
    anonymous = memoryview(bytearray(4096))
    assert bytes(untouched[:1]) == b"\0"  # faulted in by reading
    ranges, fds = filebacked.file_ranges([untouched, written, unfaulted, anonymous])
    try:
        assert len(fds) == 1 and os.fstat(fds[0]).st_ino == path.stat().st_ino
        assert ranges[0] == filebacked.FileRange(0, PAGE)
        assert ranges[1] is None
        assert ranges[2] == filebacked.FileRange(0, 8 * PAGE + 100)
        assert ranges[3] is None
    finally:
        for fd in fds:
            os.close(fd)
        del untouched, unfaulted, written, view
        memory.close()


def test_read_maps_with_addresses_keeps_exactly_the_file_mappings_holding_one(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "1000-3000 r--p 00000000 08:01 11 /lib/a.so",
            "3000-5000 rw-p 00002000 08:01 11 /lib/a.so",
            "5000-6000 rw-p 00000000 00:00 0 ",  # anonymous
            "6000-9000 r--p 00001000 08:02 12 /data/w.safetensors",
            "9000-a000 r--p 00000000 08:02 13 /data/gone.bin (deleted)",
            "a000-b000 rw-p 00000000 00:00 0 [heap]",
        ]
    )
    everything = filebacked.read_maps(text)
    assert [m.path for m in everything] == ["/lib/a.so", "/lib/a.so", "/data/w.safetensors"]
    # 0x1000 is the first byte of a mapping, 0x5fff anonymous memory, 0x8fff the last byte of a mapping, 0x9000 a
    # deleted file's, 0xb000 past every mapping.
    found = filebacked.read_maps(text, addresses=[0x1000, 0x5FFF, 0x8FFF, 0x9000, 0xB000])
    assert found == [everything[0], everything[2]]
    assert filebacked.read_maps(text, addresses=[]) == []
    # This process's own maps: the filter finds a file mapping's view as the full parse does.
    path = tmp_path / "weights.bin"
    path.write_bytes(b"w" * 2 * PAGE)
    with open(path, "rb") as f:
        memory = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(memory)
    try:
        address = arena.buffer_address(view[PAGE:])
        assert address is not None
        (mapping,) = filebacked.read_maps(addresses=[address])
        assert mapping.path == str(path) and mapping in filebacked.read_maps()
    finally:
        view.release()
        memory.close()


def test_renamed_file_is_followed_and_deleted_file_is_copied(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x" * 4 * PAGE)
    with open(path, "rb") as f:
        memory = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(memory)[:PAGE]
    path.rename(tmp_path / "old.bin")
    path.write_bytes(b"y" * 4 * PAGE)  # the old path names another file now; the mapping is of old.bin
    ranges, fds = filebacked.file_ranges([view])
    assert ranges == [filebacked.FileRange(0, 0)] and os.fstat(fds[0]).st_ino == (tmp_path / "old.bin").stat().st_ino
    os.close(fds[0])
    (tmp_path / "old.bin").unlink()  # nothing on disk names it: its bytes are copied
    assert filebacked.file_ranges([view]) == ([None], [])
    del view
    memory.close()


def test_file_segment_goes_stale_when_its_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * PAGE)
    store = Store(max_bytes=PAGE)
    store.add(entry("k", [(-1, 0, PAGE)]), None, [os.open(path, os.O_RDONLY)])
    assert store.total_bytes() == 0 and store.status()["file_bytes"] == PAGE  # the budget counts memfds only
    assert store.get("k") is not None
    # The same file again (another entry): one segment.
    store.add(entry("k2", [(-1, 0, 16)]), None, [os.open(path, os.O_RDONLY)])
    assert len(store.segments) == 1
    before = path.stat()
    with open(path, "r+b") as f:  # rewritten in place, same size, and the mtime put back
        f.write(b"b" * PAGE)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert store.get("k") is None and store.stale == 1
    assert "k" not in store.entries
    store.close()


def test_store_refuses_a_file_segment_that_is_not_a_regular_file() -> None:
    store = Store()
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(protocol.CacheError, match="not a regular file"):
        store.add(entry("x", [(-1, 0, 1)]), None, [read_end])
    store.close()


def test_filing_children_keep_the_heap_out_of_collections_until_the_last_one_is_gone() -> None:
    # Which objects are frozen, not how many: the count also falls whenever a frozen object is freed (by any
    # thread of this worker), so comparing counts between two steps says nothing.
    def frozen(obj: object) -> bool:
        return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())  # get_objects skips frozen ones

    freeze = filing._GcFreeze()
    assert gc.get_freeze_count() == 0
    before = [object()]
    try:
        freeze.before_fork()
        assert frozen(before)  # every object tracked at the fork is frozen
        later = [object()]
        assert not frozen(later)
        freeze.before_fork()  # a second filing while the first child lives freezes what came since
        assert frozen(before) and frozen(later)
        freeze.child_gone()
        assert frozen(before) and frozen(later)  # one child is still alive
        freeze.child_gone()
        assert gc.get_freeze_count() == 0  # every child gone: all of it is collected as usual again
        assert not frozen(before) and not frozen(later)
    finally:
        gc.unfreeze()


def test_filing_leaves_a_program_s_own_gc_freeze_alone() -> None:
    freeze = filing._GcFreeze()
    try:
        gc.freeze()  # the program's own (a pre-fork server does this before forking its workers)
        own = gc.get_freeze_count()
        made_later = [[] for _ in range(1000)]  # tracked objects a second freeze would catch
        # The count only falls by itself (a frozen object another thread frees leaves the permanent generation),
        # so a freeze of ours shows as a rise of at least the 1000 objects made above.
        freeze.before_fork()
        assert gc.get_freeze_count() < own + len(made_later)
        freeze.child_gone()
        assert 0 < gc.get_freeze_count() < own + len(made_later)  # not thawed: unfreeze cannot tell its from ours
        del made_later
    finally:
        gc.unfreeze()


def test_filing_never_thaws_what_a_program_froze_while_children_lived() -> None:
    freeze = filing._GcFreeze()
    try:
        freeze.before_fork()
        ours = gc.get_freeze_count()
        made_later = [[] for _ in range(100)]  # tracked objects that only a second freeze can catch
        gc.freeze()  # the program's own, while the filing child lives
        assert gc.get_freeze_count() > ours
        freeze.child_gone()
        assert gc.get_freeze_count() > ours  # left frozen: unfreezing would undo the program's freeze too
        del made_later
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_cache_pickles_without_cloudpickle() -> None:
    """cloudpickle is optional (the ``cache`` extra brings it): without it, the cache's picklers pickle by
    reference, so a call's arguments and a model still pickle, and only what needs by-value pickling (a lambda)
    cannot be cached; a cache that needed cloudpickle made every patched call fail without it."""
    proc = run_python(
        """
        import sys
        sys.modules["cloudpickle"] = None  # as if not installed: importing it raises, find_spec says None
        import os, pickle, tempfile, torch
        from zerocopy_pickle.cache import client, entries
        assert entries.by_value() is False
        folder = tempfile.mkdtemp()  # a local path: the key is its files' fingerprints, no Hub lookup
        described = client.describe("transformers:PreTrainedModel.from_pretrained", None, (folder, torch.ones(2)), {})
        pickled = entries.pickle_with_refs({"w": torch.zeros(3)}, [], in_band=False)
        print(len(pickled.views), pickled.views[0].nbytes, sorted(vars(described)))
        try:
            entries.pickle_with_refs(lambda: 1, [], in_band=True)
        except (pickle.PicklingError, AttributeError) as e:
            print("lambda:", type(e).__name__)
        """
    )
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("1 12 ")
    assert lines[1] in ("lambda: PicklingError", "lambda: AttributeError")


@pytest.mark.slow
def test_a_filing_childs_records_go_to_fill_log(tmp_path: Path) -> None:
    """A forked filing child writes its records to the runtime directory's fill.log, even though the library's
    only handler is a NullHandler and the caller's own handlers point at the caller's streams."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    run_python(
        """
        import logging, sys
        from zerocopy_pickle.cache import filing
        logging.getLogger("zerocopy_pickle").addHandler(logging.StreamHandler(sys.stdout))  # the caller's
        filing._detach_stdio()
        logging.getLogger("zerocopy_pickle.cache.client").error("filing X failed: boom")
        """,
        env={"ZEROCOPY_PICKLE_CACHE_DIR": str(directory)},
    )
    text = (directory / "fill.log").read_text()
    assert "ERROR zerocopy_pickle.cache.client: filing X failed: boom" in text


def test_cache_status_prints_what_clients_sent_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Entry calls and keys come from the cache's clients: a model path with terminal control sequences must not
    reach the terminal as they are (text), and ``--json`` stays ASCII."""
    from zerocopy_pickle import cache
    from zerocopy_pickle.cache import cli

    hostile = "m.from_pretrained('/tmp/\x1b]0;owned\x07\x1b[2J\u202ex')"
    info = {
        "pid": 1, "loader_pid": None, "max_bytes": 0, "total_bytes": 0, "file_bytes": 0, "files": [],
        "segments": 0, "logical_bytes": 0, "hits": 0, "misses": 0, "evictions": 0, "stale": 0,
        "persist": "/tmp/\x1b[31mred",
        "entries": [{"key": "\x1b[1m" + "a" * 40, "nbytes": 10, "hits": 1, "call": hostile}],
    }  # fmt: skip
    monkeypatch.setattr(cache, "status", lambda: info)
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b]0;owned\\x07" in out and "\\u202e" in out and "\\x1b[31mred" in out
    assert cli.main(["status", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.isascii() and "\x1b" not in out and json.loads(out)["entries"][0]["call"] == hostile


def test_filing_never_counts_the_frozen_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """gc.get_freeze_count walks every frozen object (45-90 ms on a process with transformers imported, at every
    miss): a filing asks it only whether anything is frozen before it freezes, when nothing is (free)."""
    seen: list[int] = []
    count = gc.get_freeze_count

    def counting() -> int:
        seen.append(count())
        return seen[-1]

    monkeypatch.setattr(gc, "get_freeze_count", counting)
    freeze = filing._GcFreeze()
    try:
        freeze.before_fork()
        freeze.before_fork()
        freeze.child_gone()
        freeze.child_gone()
    finally:
        gc.unfreeze()
    assert seen == [0]
    assert gc.freeze is not freeze._watch  # gc.freeze is the program's own again


def _resident_bytes(memory: mmap.mmap) -> int:
    """The bytes of ``memory`` mapped into this process's page tables (its ``Rss`` in /proc/self/smaps)."""
    import ctypes

    anchor = ctypes.c_char.from_buffer(memory)
    start = f"{ctypes.addressof(anchor):x}-"
    del anchor
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(start):
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


def _private_mapping_of(nbytes: int) -> mmap.mmap:
    fd = os.memfd_create("zcp-prefault-test")
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as shared:
            shared[:] = b"\1" * nbytes  # in the page cache: the private mapping below has nothing mapped yet
        return arena.map_private(fd, nbytes)
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ and smaps are Linux's")
def test_a_small_hit_is_prefaulted_before_it_is_unpickled_and_a_large_one_in_the_background(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(client.PREFAULT_ENV, raising=False)
    prefaulter = client._Prefaulter()
    small = _private_mapping_of(1 << 20)
    assert _resident_bytes(small) == 0
    prefaulter.submit([small])
    if not prefaulter._supported:
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    assert _resident_bytes(small) == len(small)  # in the caller's thread: done when submit returns

    monkeypatch.setattr(client, "INLINE_PREFAULT_BYTES", 1 << 20)
    large = _private_mapping_of(4 << 20)
    prefaulter.submit([large])
    deadline = time.monotonic() + 60
    while _resident_bytes(large) < len(large):  # the worker thread's: wait for it, on the condition
        assert time.monotonic() < deadline, "the background prefault never populated the mapping"
        time.sleep(0.01)
    assert small[:1] == large[:1] == b"\1"  # populated readable, contents as written
    monkeypatch.setenv(client.PREFAULT_ENV, "0")
    off = _private_mapping_of(1 << 20)
    prefaulter.submit([off])
    assert _resident_bytes(off) == 0


@pytest.mark.slow
def test_arguments_without_code_pickle_without_cloudpickle_and_code_still_keys_by_value() -> None:
    """A call's arguments are pickled plainly unless they hold a function or a class (cloudpickle is not imported
    for a path and a dtype: 1.5-2 ms of a process's first hit); a lambda in them is pickled by value, so two
    different closures give two keys and the same one again gives the same key."""
    proc = run_python(
        """
        import sys, tempfile, torch
        from zerocopy_pickle.cache import client
        folder = tempfile.mkdtemp()
        point = "transformers:PreTrainedModel.from_pretrained"
        plain = client.describe(point, None, (folder,), {"torch_dtype": torch.float16})
        print("cloudpickle imported:", "cloudpickle" in sys.modules)
        def hook(k):
            return lambda x: x + k
        one = client.describe(point, None, (folder,), {"hook": hook(1)})
        one_again = client.describe(point, None, (folder,), {"hook": hook(1)})
        two = client.describe(point, None, (folder,), {"hook": hook(2)})
        print("cloudpickle imported:", "cloudpickle" in sys.modules)
        print(one.key == one_again.key, one.key != two.key, plain.key not in (one.key, two.key))
        """
    )
    assert proc.stdout.splitlines() == ["cloudpickle imported: False", "cloudpickle imported: True", "True True True"]
