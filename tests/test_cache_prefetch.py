"""The model cache reads cold files ahead: a miss prefetches the checkpoint files its call will read, and a warm
start from the persistence directory prefetches the persisted segments and the adopted checkpoint files."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.internals import readahead
from tests.test_cache_units import entry, sealed_segment
from tests.test_readahead import write_file
from tests.test_transfer import evict
from zerocopy_pickle.cache import checkpoints, client
from zerocopy_pickle.cache.store import Store

MIB = 1 << 20
BIG = readahead.MIN_NBYTES


def cold_file(path: Path, nbytes: int) -> Path:
    """A file of random bytes, not in the page cache."""
    write_file(path, nbytes)
    evict(path)
    return path


def sized(path: Path, nbytes: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


def test_a_folder_with_safetensors_is_read_through_its_safetensors_only() -> None:
    files = [
        ("/m/model.safetensors", BIG),
        ("/m/pytorch_model.bin", BIG),
        ("/m/config.json", 1000),
        ("/m/tokenizer.json", BIG),  # large, but not a checkpoint
    ]
    assert checkpoints.likely_read(files) == ["/m/model.safetensors"]


def test_shards_of_every_subfolder_are_read_in_path_order() -> None:
    files = [
        ("/p/unet/diffusion_pytorch_model.safetensors", BIG),
        ("/p/text_encoder/model-00002-of-00002.safetensors", BIG),
        ("/p/text_encoder/model-00001-of-00002.safetensors", BIG),
        ("/p/vae/diffusion_pytorch_model.bin", BIG),  # only a .bin in this folder: that is what is read
    ]
    assert checkpoints.likely_read(files) == [
        "/p/text_encoder/model-00001-of-00002.safetensors",
        "/p/text_encoder/model-00002-of-00002.safetensors",
        "/p/unet/diffusion_pytorch_model.safetensors",
        "/p/vae/diffusion_pytorch_model.bin",
    ]


def test_the_requested_variant_is_read_and_no_variant_means_the_plain_files() -> None:
    files = [("/u/diffusion_pytorch_model.safetensors", BIG), ("/u/diffusion_pytorch_model.fp16.safetensors", BIG)]
    assert checkpoints.likely_read(files) == ["/u/diffusion_pytorch_model.safetensors"]
    assert checkpoints.likely_read(files, "fp16") == ["/u/diffusion_pytorch_model.fp16.safetensors"]
    # A variant the folder does not have: the library falls back to what is there, and so does the guess.
    assert checkpoints.likely_read(files[:1], "fp16") == ["/u/diffusion_pytorch_model.safetensors"]


def test_small_checkpoints_are_not_prefetched() -> None:
    assert checkpoints.likely_read([("/m/model.safetensors", BIG - 1)]) == []


def test_a_miss_prefetches_what_its_key_was_computed_from_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "model"
    sized(folder / "model.fp16.safetensors", BIG)
    sized(folder / "model.safetensors", BIG)
    sized(folder / "pytorch_model.bin", BIG)
    (folder / "config.json").write_text("{}")
    point = "torch.serialization:load"
    request = client.describe(point, None, (str(folder),), {})
    assert client._checkpoints_of(request) == []  # off by default (docs/benchmark.md measured why)
    monkeypatch.setenv(client.MISS_PREFETCH_ENV, "1")
    assert client._checkpoints_of(request) == [str(folder / "model.safetensors")]
    request = client.describe(point, None, (str(folder),), {"variant": "fp16"})
    assert client._checkpoints_of(request) == [str(folder / "model.fp16.safetensors")]


def test_start_reads_cold_files_and_stop_cancels_what_still_runs(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "model.safetensors", 64 * MIB)
    reading = checkpoints.start([str(tmp_path / "missing.safetensors"), str(path)])
    assert reading.wait(timeout=120)
    assert len(reading.jobs) == 1  # a file that is gone is no error: the call itself will say
    assert reading.jobs[0].done and reading.jobs[0].read == 64 * MIB
    checkpoints.stop(reading)


def test_files_are_read_one_after_another_and_stop_ends_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = []
    for name in ("a", "b", "c"):
        paths.append(str(cold_file(tmp_path / f"{name}.safetensors", BIG)))
    started: list[str] = []
    first = threading.Event()
    release = threading.Event()
    real = readahead.start

    jobs: list[readahead.Prefetch | None] = []
    overlapped: list[str] = []

    def spy(fd: int, start: int, stop: int, **kwargs: Any) -> readahead.Prefetch | None:
        if not all(job is None or job.done for job in jobs):
            overlapped.append(kwargs["name"])  # a file started before the one before it ended
        started.append(kwargs["name"])
        if len(started) == 2:
            first.set()
            release.wait()
        jobs.append(real(fd, start, stop, **kwargs))
        return jobs[-1]

    monkeypatch.setattr(readahead, "start", spy)
    reading = checkpoints.start(paths)
    assert first.wait(timeout=120)  # the second file is about to start
    checkpoints.stop(reading)
    release.set()
    assert reading.wait(timeout=120)
    assert started == paths[:2]  # the third never started
    assert overlapped == []
    assert all(job.done for job in reading.jobs)


class Spy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[tuple[int, int], int, int, str, bool]] = []
        real = readahead.start

        def spy(fd: int, start: int, stop: int, **kwargs: Any) -> readahead.Prefetch | None:
            info = os.fstat(fd)
            job = real(fd, start, stop, **kwargs)
            self.calls.append(((info.st_dev, info.st_ino), start, stop, kwargs["name"], job is not None))
            return job

        monkeypatch.setattr(readahead, "start", spy)


def test_a_warm_start_prefetches_persisted_segments_and_adopted_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    persist, keys = tmp_path / "persist", tmp_path / "keys"
    keys.mkdir(mode=0o700)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(4 * 4096))
    store = Store(persist=persist, key_dir=keys)
    store.add(entry("copied", [(0, 0, 5)]), sealed_segment(b"hello"))
    store.add(entry("file", [(-1, 0, 4096)]), None, [os.open(weights, os.O_RDONLY)])
    store.close()
    spy = Spy(monkeypatch)
    again = Store(persist=persist, key_dir=keys)
    try:
        assert set(again.entries) == {"copied", "file"}
        seen = {(identity, start, stop) for identity, start, stop, *_ in spy.calls}
        (segment,) = [p for p in persist.iterdir() if p.name.startswith("segment-")]
        for path in (segment, weights):
            info = path.stat()
            assert ((info.st_dev, info.st_ino), 0, info.st_size) in seen, path
    finally:
        again.close()


def test_a_warm_start_opens_nothing_that_is_not_a_regular_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    persist, keys = tmp_path / "persist", tmp_path / "keys"
    keys.mkdir(mode=0o700)
    store = Store(persist=persist, key_dir=keys)
    store.add(entry("copied", [(0, 0, 5)]), sealed_segment(b"hello"))
    store.close()
    (segment,) = [p for p in persist.iterdir() if p.name.startswith("segment-")]
    segment.unlink()
    os.mkfifo(segment, 0o600)  # a FIFO in the segment's place: opening it for reading must not block the start
    spy = Spy(monkeypatch)
    again = Store(persist=persist, key_dir=keys)
    try:
        assert not again.entries  # the restore drops the entry, as for any segment not what was persisted
        assert all(not started for _, _, _, name, started in spy.calls if name == segment.name)
    finally:
        again.close()


def test_a_hit_prefetches_its_cold_checkpoint_files_and_never_a_memfd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = cold_file(tmp_path / "model.safetensors", 64 * MIB)
    memfd = sealed_segment(b"x" * (64 * MIB))
    fd = os.open(path, os.O_RDONLY)
    spy = Spy(monkeypatch)
    try:
        memfd_identity = (os.fstat(memfd).st_dev, os.fstat(memfd).st_ino)
        client._prefetch_file(memfd)
        client._prefetch_file(fd)
    finally:
        os.close(fd)
        os.close(memfd)
    started = {identity: began for identity, _, _, _, began in spy.calls}
    assert started[(path.stat().st_dev, path.stat().st_ino)] is True
    assert started.get(memfd_identity, False) is False
