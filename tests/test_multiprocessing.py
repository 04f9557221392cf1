"""Models for worker processes: one sealed memfd per graph through every multiprocessing channel.

The workers are real processes (``spawn`` unless a test says otherwise: nothing inherited, everything through
the channel), running tests/mp_workers.py. Each reports the mapping behind its weights (/proc/self/smaps):
a memfd of this library's, the same inode for every receiver of one Shared.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.reduction
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle import multiprocessing as zmp

from . import mp_workers
from .mp_workers import build_model, inputs

SPAWN = multiprocessing.get_context("spawn")
TIMEOUT = 120


@pytest.fixture
def registered() -> Iterator[None]:
    zmp.register()
    try:
        yield
    finally:
        zmp.unregister()


def expected(model: Any) -> list[list[float]]:
    with torch.no_grad():
        return model(inputs()).float().tolist()  # type: ignore[no-any-return]


def inode_of(shared: zmp.Shared) -> int:
    return os.fstat(shared.snapshot.fd).st_ino


def is_memfd(report: dict[str, Any]) -> bool:
    return str(report["mapping"]["path"]).startswith("/memfd:zerocopy_pickle")


def test_a_module_travels_as_one_fd_when_registered(registered: None, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    real = zmp._send_fd
    monkeypatch.setattr(zmp, "_send_fd", lambda fd: (sent.append(fd), real(fd))[1])
    model = build_model()
    data = multiprocessing.reduction.ForkingPickler.dumps({"model": model, "again": model, "n": 3})
    assert len(sent) == 1, "one fd for the whole module, sent once however often it appears"
    back = multiprocessing.reduction.ForkingPickler.loads(data)
    assert back["again"] is back["model"] and back["n"] == 3
    assert expected(back["model"]) == expected(model)
    weight = back["model"][0].weight
    assert mp_workers.mapping_of(weight.data_ptr())["path"].startswith("/memfd:zerocopy_pickle")


def test_unregistered_modules_pickle_as_before() -> None:
    assert not zmp.registered()
    model = build_model()
    back = multiprocessing.reduction.ForkingPickler.loads(multiprocessing.reduction.ForkingPickler.dumps(model))
    assert not mp_workers.mapping_of(back[0].weight.data_ptr())["path"].startswith("/memfd:zerocopy_pickle")


def test_register_is_idempotent_and_unregister_restores_the_previous_override() -> None:
    pickler = multiprocessing.reduction.ForkingPickler
    calls: list[Any] = []

    def theirs(self: Any, obj: Any) -> Any:
        calls.append(obj)
        return NotImplemented

    pickler.reducer_override = theirs  # type: ignore[attr-defined]
    try:
        zmp.register()
        zmp.register()
        assert zmp.registered()
        pickler.dumps({"x": object.__new__(Marker)})
        assert any(type(c) is Marker for c in calls), "the previous override still sees other objects"
        zmp.unregister()
        assert pickler.reducer_override is theirs  # type: ignore[attr-defined]
        assert not zmp.registered()
    finally:
        zmp.unregister()
        del pickler.reducer_override  # type: ignore[attr-defined]
    assert "reducer_override" not in pickler.__dict__


class Marker:
    pass


def test_a_module_that_cannot_be_frozen_fails_at_send(registered: None) -> None:
    model = build_model()
    model.handle = open(os.devnull, "rb")  # noqa: SIM115 - a file handle cannot be pickled
    try:
        with pytest.raises(zp.DumpError):
            multiprocessing.reduction.ForkingPickler.dumps(model)
    finally:
        model.handle.close()


@pytest.mark.slow
def test_every_pool_worker_maps_the_same_pages_of_one_shared_model() -> None:
    model = build_model()
    shared = zmp.Shared(model)
    with SPAWN.Pool(2, initializer=mp_workers.init_barrier, initargs=(SPAWN.Barrier(2),)) as pool:
        reports = pool.map(mp_workers.describe_pair, [(shared, i) for i in range(4)], chunksize=1)
    assert len({r["pid"] for r in reports}) == 2, "tasks wait for each other in pairs: both workers took some"
    for report in reports:
        assert is_memfd(report) and report["mapping"]["inode"] == inode_of(shared)
        assert report["output"] == expected(model)


@pytest.mark.slow
def test_a_queue_and_a_process_pool_executor_carry_registered_modules(registered: None) -> None:
    model = build_model(seed=5)
    queue, results = SPAWN.Queue(), SPAWN.Queue()
    worker = SPAWN.Process(target=mp_workers.from_queue, args=(queue, results))
    worker.start()
    queue.put(model)
    report = results.get(timeout=TIMEOUT)
    worker.join(TIMEOUT)
    assert worker.exitcode == 0 and is_memfd(report) and report["output"] == expected(model)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=SPAWN) as executor:
        report = executor.submit(mp_workers.describe, model).result(TIMEOUT)
    assert is_memfd(report) and report["output"] == expected(model)


@pytest.mark.slow
def test_a_shared_state_dict_is_one_memfd() -> None:
    state = build_model().state_dict()
    shared = zmp.Shared(state)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=SPAWN) as executor:
        report = executor.submit(mp_workers.state_dict_worker, shared).result(TIMEOUT)
    assert report["mapping"]["inode"] == inode_of(shared)
    assert report["sum"] == pytest.approx(float(sum(t.sum() for t in state.values())))


@pytest.mark.slow
def test_spawned_dataloader_workers_share_the_dataset_model() -> None:
    shared = zmp.Shared(build_model())
    dataset = mp_workers.ModelDataset(shared)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn", persistent_workers=False
    )
    items = list(loader)
    assert {item["worker"] for item in items} == {0, 1}
    assert {item["inode"] for item in items} == {inode_of(shared)}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pre_fork_workers_share_one_copy_of_a_model_the_loader_changed(method: str) -> None:
    model = mp_workers.Converted()  # float16 conversion and bitsandbytes 4-bit quantization, in the parent
    shared = zmp.Shared(model)
    del model
    context = multiprocessing.get_context(method)
    barrier, results = context.Barrier(4), context.Queue()
    workers = [context.Process(target=mp_workers.hold_and_measure, args=(shared, barrier, results)) for _ in range(4)]
    for worker in workers:
        worker.start()
    reports = [results.get(timeout=TIMEOUT) for _ in workers]
    for worker in workers:
        worker.join(TIMEOUT)
        assert worker.exitcode == 0
    reference = expected(shared.load())
    for report in reports:
        assert is_memfd(report) and report["mapping"]["inode"] == inode_of(shared)
        assert report["output"] == reference
        # Four processes held the same resident pages at once: each is charged about a quarter.
        assert report["mapping"]["rss"] > 0 and report["mapping"]["pss"] <= report["mapping"]["rss"] / 2


def test_a_closed_shared_cannot_be_sent_and_its_loads_outlive_it() -> None:
    shared = zmp.Shared({"w": torch.arange(5.0)})
    loaded = shared.load()
    shared.close()
    assert torch.equal(loaded["w"], torch.arange(5.0))
    assert "closed" in repr(shared)
    with pytest.raises(zp.ZeroCopyPickleError, match="closed"):
        multiprocessing.reduction.ForkingPickler.dumps(shared)


@pytest.mark.slow
def test_an_existing_snapshot_file_is_shared_without_a_copy(tmp_path: Any) -> None:
    model = build_model(seed=9)
    zp.dump(model, tmp_path / "model.zcp")
    with zp.Snapshot.open(tmp_path / "model.zcp") as snapshot:
        with pytest.raises(zp.ArgumentError, match="pass trusted=True if you trust its stream"):
            zmp.Shared.from_snapshot(snapshot)
        shared = zmp.Shared.from_snapshot(snapshot, trusted=True)
    assert shared.nbytes == os.path.getsize(tmp_path / "model.zcp")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=SPAWN) as executor:
        report = executor.submit(mp_workers.describe, shared).result(TIMEOUT)
    assert report["mapping"]["inode"] == os.stat(tmp_path / "model.zcp").st_ino, "the file's own pages"
    assert report["output"] == expected(model)
    shared.close()
    with pytest.raises(zp.ZeroCopyPickleError, match="closed"):
        zmp.Shared.from_snapshot(snapshot, trusted=True)
    frozen = zp.freeze({"w": torch.ones(3)})
    assert torch.equal(zmp.Shared.from_snapshot(frozen).load()["w"], torch.ones(3)), "freeze()d: trusted already"


@pytest.mark.parametrize(
    "name",
    ["zerocopy_pickle.multiprocessing:_receive", "zerocopy_pickle.ray:_rebuild", "zerocopy_pickle.ray:_rebuild_storage",
     "zerocopy_pickle.ray:_rebuild_tensor"],
)  # fmt: skip
def test_the_receiving_functions_are_out_of_reach_of_a_restricted_load(name: str) -> None:
    from .hostile_streams import G, as_snapshot, call, program

    module, qualname = name.split(":")
    data = as_snapshot(program(call(G(module, qualname), b"\0" * 64)))
    with pytest.raises(zp.RestrictedLoadError, match=qualname):
        zp.loads(data)
