"""Pickling backends: functions and classes by value (cloudpickle, dill), across processes; errors with paths."""

from __future__ import annotations

import _pickle
import re
import sys
import weakref
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp

from .conftest import REPO, mapped_regions, run_python

BY_VALUE_BACKENDS = ["auto", "cloudpickle", "dill"]

# A script: everything below is defined in its __main__, so nothing can be imported by reference elsewhere.
DUMP_SCRIPT = """
import sys
import torch
import zerocopy_pickle as zp

backend, path = sys.argv[1], sys.argv[2]


class MainNet(torch.nn.Module):  # defined in __main__
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.offset = 1.0

    def forward(self, x):
        return self.linear(x) + self.offset


def make_scaler(scale):
    def hook(module, inputs, output):  # a nested function, closing over scale
        return output * scale
    return hook


def build_local():
    class LocalThing:  # a local class
        def __init__(self):
            self.weights = torch.arange(5.0)

        def total(self):
            return float(self.weights.sum())
    return LocalThing()


torch.manual_seed(0)
net = MainNet()
net.linear.register_forward_hook(lambda module, inputs, output: output + 100)  # a lambda
net.register_forward_hook(make_scaler(3.0))
x = torch.ones(1, 4)
zp.dump({"net": net, "local": build_local(), "x": x, "expected": net(x)}, path, backend=backend)
print(zp.read_header(path).producer["backend"])
"""

LOAD_SCRIPT = """
import sys, torch, zerocopy_pickle as zp
obj = zp.load(sys.argv[1], trusted=True)
assert torch.equal(obj["net"](obj["x"]), obj["expected"]), "hooks or class behave differently"
assert type(obj["net"]).__name__ == "MainNet" and obj["net"].offset == 1.0
assert obj["local"].total() == 10.0
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", BY_VALUE_BACKENDS)
def test_main_classes_local_classes_lambdas_and_closures_across_processes(backend: str, tmp_path: Path) -> None:
    script = tmp_path / "make_model.py"
    script.write_text(DUMP_SCRIPT)
    path = tmp_path / "model.zcp"
    env = {"PYTHONPATH": str(REPO)}
    proc = run_python(f"import runpy, sys; sys.argv = {[str(script), backend, str(path)]!r}; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')", env=env)  # fmt: skip
    assert proc.stdout.strip() == {"auto": "pickle+cloudpickle", "cloudpickle": "pickle+cloudpickle"}.get(
        backend, "dill"
    )
    assert run_python(LOAD_SCRIPT, str(path), env=env).stdout.strip() == "ok"


def test_the_plain_backend_names_the_path_of_what_it_cannot_pickle() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Module()
            self.encoder.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(5))

    net = Net.__new__(Net)  # a module-level-importable type is not needed to locate the failure
    Net.__init__(net)
    handle = net.encoder.layers[3].register_forward_hook(lambda m, i, o: o)
    with pytest.raises(zp.DumpError) as info:
        zp.dumps(net.encoder, backend="pickle")
    error = info.value
    assert error.path == f"obj.layers[3]._forward_hooks[{handle.id}]"
    assert re.search(r"cannot pickle .*<lambda> at obj\.layers\[3\]\._forward_hooks\[\d+\]", str(error))
    assert "backend='auto'" in str(error)


def test_the_path_through_dicts_lists_and_attributes() -> None:
    class Holder:
        pass

    holder = Holder()
    holder.items = [1, {"gen": (i for i in range(3))}]
    with pytest.raises(zp.DumpError) as info:
        zp.dumps({"model": {"parts": [torch.ones(2), holder]}}, backend="pickle")
    assert info.value.path == "obj['model']['parts'][1].items[1]['gen']"
    assert "generator" in str(info.value)  # the runtime-objects quirk refuses generators, and says what to do


@pytest.mark.parametrize("backend", ["pickle", *BY_VALUE_BACKENDS])
def test_storages_stay_out_of_band_and_shared_with_every_backend(backend: str, tmp_path: Path) -> None:
    weight = torch.randn(256, 256)
    path = tmp_path / f"{backend}.zcp"
    zp.dump({"w": weight, "view": weight[10:], "tied": [weight]}, path, backend=backend)
    header = zp.read_header(path)
    assert [b.nbytes for b in header.buffers] == [weight.nbytes]
    assert header.stream_nbytes < 4096
    loaded = zp.load(path, trusted=True)
    assert torch.equal(loaded["w"], weight)
    assert loaded["tied"][0].data_ptr() == loaded["w"].data_ptr() == loaded["view"].data_ptr() - 10 * 256 * 4
    regions = [(s, e) for s, e, p in mapped_regions() if p == str(path)]
    assert any(s <= loaded["w"].data_ptr() < e for s, e in regions)


def test_restricted_load_of_by_value_content_says_to_trust() -> None:
    data = zp.dumps({"fn": lambda x: x + 1})
    with pytest.raises(zp.RestrictedLoadError, match=r"pickled by value \(cloudpickle.*trusted=True"):
        zp.loads(data)
    assert zp.loads(data, trusted=True)["fn"](1) == 2


def test_auto_falls_back_to_dill() -> None:
    target = Holder()
    data = zp.dumps({"ref": weakref.ref(target), "t": torch.ones(3)})  # only dill takes a weak reference
    assert zp.read_header(data).producer["backend"] == "dill"
    loaded = zp.loads(data, trusted=True)
    assert isinstance(loaded["ref"], weakref.ref) and torch.equal(loaded["t"], torch.ones(3))


class Holder:
    """Something a weak reference can point to."""


def test_auto_keeps_importable_things_by_reference() -> None:
    data = zp.dumps({"fn": torch.nn.functional.relu, "cls": torch.nn.Linear})
    assert zp.read_header(data).producer["backend"] == "pickle+cloudpickle"
    loaded = zp.loads(data, allow=[torch.nn.functional.relu, torch.nn.Linear])  # by reference: restricted works
    assert loaded["fn"] is torch.nn.functional.relu and loaded["cls"] is torch.nn.Linear


def test_unknown_and_unavailable_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(zp.ArgumentError, match="backend must be one of"):
        zp.dumps(1, backend="marshal")
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # as if not installed
    with pytest.raises(zp.ArgumentError, match=r"needs cloudpickle: pip install 'zerocopy-pickle\[cloudpickle\]'"):
        zp.dumps(1, backend="cloudpickle")
    monkeypatch.setitem(sys.modules, "dill", None)
    with pytest.raises(zp.ArgumentError, match=r"needs dill"):
        zp.dumps(1, backend="dill")


def test_loading_always_uses_the_c_unpickler() -> None:
    assert issubclass(zp.ZeroCopyUnpickler, _pickle.Unpickler)
    assert issubclass(zp.ZeroCopyPickler, _pickle.Pickler)
