"""Object graphs through Ray's object store: one copy per node, copy-on-write views in every worker.

A local Ray (``ray.init(num_cpus=2)``) is started once for this module. Actors report the mapping behind their
weights (/proc/self/smaps): a private mapping of the object store's file, the same file for every actor.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle import ray as zray

from .mp_workers import build_model, inputs, mapping_of

ray = pytest.importorskip("ray")  # a dev dependency: under make test a missing one fails (strict skips)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def registered() -> Iterator[None]:
    zray.register()
    try:
        yield
    finally:
        zray.unregister()


def expected(model: Any) -> list[list[float]]:
    with torch.no_grad():
        return model(inputs()).tolist()  # type: ignore[no-any-return]


def big_model() -> torch.nn.Module:
    """Large enough (4 MB) that Ray keeps it in the object store, not inline with a task."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.Linear(1024, 32))  # fmt: skip


def big_inputs() -> torch.Tensor:
    torch.manual_seed(4)
    return torch.randn(2, 64)


@ray.remote(num_cpus=1)
class Holder:
    def __init__(self, ref: Any) -> None:
        self.model = ray.get(ref[0])

    def report(self) -> dict[str, Any]:
        weight = self.model[2].weight
        touched = float(sum(t.reshape(-1).view(torch.uint8)[::4096].sum() for t in self.model.state_dict().values()))
        with torch.no_grad():
            output = self.model(big_inputs()).tolist()
        return {"mapping": mapping_of(weight.data_ptr()), "output": output, "touched": touched, "pid": os.getpid()}

    def write(self) -> float:
        with torch.no_grad():
            self.model[2].weight.add_(1.0)
        return float(self.model[2].weight[0, 0])


def private_store_view(report: dict[str, Any]) -> bool:
    return "plasma" in report["mapping"]["path"]


@pytest.mark.slow
def test_a_frozen_graph_round_trips_through_the_store_as_copy_on_write_views(cluster: None) -> None:
    model = big_model()
    got = ray.get(ray.put(zray.Frozen(model)))
    assert type(got) is torch.nn.Sequential
    with torch.no_grad():
        assert torch.equal(got(big_inputs()), model(big_inputs()))
    line = mapping_of(got[2].weight.data_ptr())
    assert "plasma" in line["path"], "a view of the object store's pages"
    with torch.no_grad():
        got[2].weight.add_(1.0)  # private: the store's copy is unchanged
    again = ray.get(ray.put(zray.Frozen(model)))
    assert torch.equal(again[2].weight, model[2].weight)


@pytest.mark.slow
def test_actors_share_one_copy_and_their_writes_stay_their_own(cluster: None) -> None:
    model = big_model()
    ref = ray.put(zray.Frozen(model))
    holders = [Holder.remote([ref]) for _ in range(2)]
    reports = ray.get([h.report.remote() for h in holders])
    with torch.no_grad():
        reference = model(big_inputs()).tolist()
    assert len({r["pid"] for r in reports}) == 2
    for report in reports:
        assert private_store_view(report) and report["output"] == reference
        # The store's pages are mapped by the store and by each actor: none of them is charged the whole.
        assert report["mapping"]["pss"] <= report["mapping"]["rss"] / 2
    assert len({r["mapping"]["inode"] for r in reports}) == 1
    written = ray.get(holders[0].write.remote())
    assert written == pytest.approx(float(model[2].weight[0, 0].detach()) + 1.0)
    after = ray.get(holders[1].report.remote())
    assert after["output"] == reference, "one actor's write never reaches another"
    assert torch.equal(ray.get(ref)[2].weight, model[2].weight)
    for holder in holders:
        ray.kill(holder)


@pytest.mark.slow
def test_registered_modules_travel_as_snapshots(cluster: None, registered: None) -> None:
    model = big_model()
    got = ray.get(ray.put(model))
    assert "plasma" in mapping_of(got[2].weight.data_ptr())["path"]
    with torch.no_grad():
        assert torch.equal(got(big_inputs()), model(big_inputs()))

    @ray.remote
    def where(m: torch.nn.Module) -> str:
        return str(mapping_of(m[2].weight.data_ptr())["path"])

    assert "plasma" in ray.get(where.remote(model)), "a module passed as a task's argument too"
    assert zray.registered()


def test_small_graphs_and_plain_pickles_load_from_a_copy() -> None:
    import pickle

    state = build_model().state_dict()
    back = pickle.loads(pickle.dumps(zray.Frozen(state), protocol=5))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    back = pickle.loads(pickle.dumps(zray.Frozen(state), protocol=4))
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_without_map_files_it_copies_with_one_warning(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    data = zp.dumps({"w": torch.arange(5.0)})
    (tmp_path / "store").write_bytes(data)
    with open(tmp_path / "store", "r+b") as f:
        shared = mmap.mmap(f.fileno(), len(data), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    real_open = os.open

    def no_map_files(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).startswith("/proc/self/map_files/"):
            raise PermissionError(1, "Operation not permitted")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_map_files)
    monkeypatch.setattr(zray, "_warned", [])
    with pytest.warns(zray.RayCopyWarning, match="CAP_SYS_ADMIN"):
        first = zray._rebuild(memoryview(shared))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = zray._rebuild(memoryview(shared))  # once per process
    assert torch.equal(first["w"], torch.arange(5.0)) and torch.equal(second["w"], torch.arange(5.0))
    first["w"].add_(1)
    assert torch.equal(second["w"], torch.arange(5.0))


def test_registered_tensors_outside_modules_travel_once_per_storage(cluster: None, registered: None) -> None:
    torch.manual_seed(5)
    base = torch.randn(300_000)
    weight = torch.nn.Parameter(torch.randn(512, 512), requires_grad=False)
    grad = torch.ones(3, requires_grad=True)
    state = {"base": base, "view": base[1000:2000], "tied": weight, "again": weight, "grad": grad,
             "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(), "steps": 20}  # fmt: skip
    got = ray.get(ray.put(state))
    assert "plasma" in mapping_of(got["base"].data_ptr())["path"]
    assert "plasma" in mapping_of(got["tied"].data_ptr())["path"]
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr(), "one storage"
    assert got["view"].storage_offset() == 1000 and torch.equal(got["view"], base[1000:2000])
    assert got["again"] is got["tied"] and type(got["tied"]) is torch.nn.Parameter and not got["tied"].requires_grad
    assert torch.equal(got["tied"], weight) and got["grad"].requires_grad and got["grad"].is_leaf
    # A lazily conjugated tensor cannot be rebuilt with set_: Ray's own way, still equal.
    assert torch.equal(got["conj"], torch.tensor([1 - 2j, 3 + 1j])) and got["steps"] == 20
    got["base"].add_(1.0)  # private
    assert torch.equal(ray.get(ray.put(state))["base"], base)
