"""Snapshots of models with accelerate-offloaded weights are self-contained or refused (issue 26, item 4).

A dump reads every weight that accelerate offloaded to files (``disk_offload``, ``dispatch_model`` with an
``offload_dir``, ``load_checkpoint_and_dispatch`` with an ``offload_folder``, an ``AlignDevicesHook`` over an
``OffloadedWeightsLoader``) into the snapshot; the loaded model runs without those files, bit for bit. With
``offloaded="refuse"`` the dump fails instead, naming the submodule, the files and the option, and leaves the
previous snapshot in place.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle.errors import ArgumentError, DumpError

accelerate = pytest.importorskip("accelerate")
from accelerate.hooks import AlignDevicesHook, add_hook_to_module  # noqa: E402
from accelerate.utils import OffloadedWeightsLoader, offload_state_dict  # noqa: E402

# Hooked modules carry accelerate's local new_forward, pickled by value: the dump warns that only trusted loads
# load them (that warning is tested elsewhere).
pytestmark = pytest.mark.filterwarnings("ignore:this snapshot holds")


class Block(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 8, dtype=dtype)
        self.down = torch.nn.Linear(8, 4, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(dtype) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def model(dtype: torch.dtype = torch.float32) -> Model:
    torch.manual_seed(0)
    return Model(dtype)


def inputs(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(5, 4, dtype=dtype)


def expected(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return model(dtype)(inputs(dtype))


def loaders(module: torch.nn.Module) -> list[OffloadedWeightsLoader]:
    """Every OffloadedWeightsLoader behind the hooks of ``module``'s submodules."""
    found = []
    for sub in module.modules():
        weights = getattr(getattr(sub, "_hf_hook", None), "weights_map", None)
        while weights is not None and not isinstance(weights, (OffloadedWeightsLoader, dict)):
            weights = getattr(weights, "dataset", None)
        if isinstance(weights, OffloadedWeightsLoader):
            found.append(weights)
    return found


def check_self_contained(path: Path, folder: Path, dtype: torch.dtype = torch.float32) -> None:
    """Move ``folder`` away, load ``path`` and run it: bit for bit, no file left to read."""
    shutil.move(folder, folder.with_name(folder.name + ".moved"))
    loaded = zp.load(path, trusted=True)
    for loader in loaders(loaded):
        assert loader.index == {}
        assert loader.save_folder is None
    with torch.no_grad():
        out = loaded(inputs(dtype))
    assert torch.equal(out, expected(dtype))


# -- what breaks today without the copy: the folder is needed -------------------------------------------------


def test_a_disk_offloaded_model_needs_its_folder(tmp_path: Path) -> None:
    """The premise: the offloaded model itself reads the folder on every forward."""
    m = model()
    accelerate.disk_offload(m, tmp_path / "offload", execution_device="cpu")
    shutil.move(tmp_path / "offload", tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError), torch.no_grad():
        m(inputs())


# -- copied into the snapshot -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_disk_offload_is_copied_into_the_snapshot(tmp_path: Path, dtype: torch.dtype) -> None:
    m = model(dtype)
    folder = tmp_path / "offload"
    accelerate.disk_offload(m, folder, execution_device="cpu")
    assert any(p.suffix == ".dat" for p in folder.iterdir())
    zp.dump(m, tmp_path / "m.zcp")
    check_self_contained(tmp_path / "m.zcp", folder, dtype)
    # the dump changed nothing of the user's model: its hooks still read the folder (moved away now)
    assert all(loader.save_folder is not None for loader in loaders(m))


def test_dispatch_model_with_a_disk_layer_is_copied(tmp_path: Path) -> None:
    m = model()
    folder = tmp_path / "offload"
    device_map = {"layers.0": "cpu", "layers.1": "disk", "layers.2": "disk"}
    accelerate.dispatch_model(m, device_map=device_map, offload_dir=folder)
    assert m.layers[1].up.weight.device.type == "meta"
    data = zp.dumps(m)
    shutil.move(folder, tmp_path / "moved")
    loaded = zp.loads(data, trusted=True)
    assert loaded.layers[1].up.weight.device.type == "meta"  # still offloaded: from the snapshot's memory
    with torch.no_grad():
        assert torch.equal(loaded(inputs()), expected())


def test_load_checkpoint_and_dispatch_with_an_offload_folder_is_copied(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    torch.save(model().state_dict(), checkpoint / "pytorch_model.bin")
    with accelerate.init_empty_weights():
        m = Model()
    folder = tmp_path / "offload"
    device_map = {"layers.0": "cpu", "layers.1": "disk", "layers.2": "disk"}
    m = accelerate.load_checkpoint_and_dispatch(m, str(checkpoint), device_map=device_map, offload_folder=folder)
    zp.dump(m, tmp_path / "m.zcp")
    check_self_contained(tmp_path / "m.zcp", folder)


def test_a_meta_model_with_an_offloading_hook_is_copied(tmp_path: Path) -> None:
    """init_empty_weights parameters, weights served by an AlignDevicesHook over an OffloadedWeightsLoader."""
    folder = tmp_path / "weights"
    offload_state_dict(folder, model().state_dict())
    with accelerate.init_empty_weights():
        m = Model()
    loader = OffloadedWeightsLoader(save_folder=folder)
    add_hook_to_module(m, AlignDevicesHook(execution_device="cpu", offload=True, weights_map=loader,
                                           place_submodules=True))  # fmt: skip
    assert m.layers[0].up.weight.device.type == "meta"
    zp.dump(m, tmp_path / "m.zcp")
    check_self_contained(tmp_path / "m.zcp", folder)


def test_cpu_offload_is_already_self_contained(tmp_path: Path) -> None:
    """cpu_offload keeps its weights in memory: they were always in the snapshot; nothing to refuse."""
    m = model()
    accelerate.cpu_offload(m, execution_device="cpu")
    assert m.layers[0].up.weight.device.type == "meta"
    data = zp.dumps(m)
    assert zp.dumps(m, offloaded="refuse") == data
    loaded = zp.loads(data, trusted=True)
    with torch.no_grad():
        assert torch.equal(loaded(inputs()), expected())


def test_a_dispatched_model_without_offload_dumps_unchanged() -> None:
    m = model()
    accelerate.dispatch_model(m, device_map={"layers.0": "cpu", "layers.1": "cpu", "layers.2": "cpu"},
                              force_hooks=True)  # fmt: skip
    hook = m.layers[0]._hf_hook
    assert not hook.offload
    data = zp.dumps(m)
    assert zp.dumps(m, offloaded="refuse") == data
    loaded = zp.loads(data, trusted=True)
    assert type(loaded.layers[0]._hf_hook) is type(hook)
    assert not loaded.layers[0]._hf_hook.offload
    with torch.no_grad():
        assert torch.equal(loaded(inputs()), expected())


def test_an_unreadable_offloaded_weight_fails_the_dump_and_keeps_the_previous_snapshot(tmp_path: Path) -> None:
    m = model()
    folder = tmp_path / "offload"
    accelerate.disk_offload(m, folder, execution_device="cpu")
    target = tmp_path / "m.zcp"
    zp.dump({"previous": torch.arange(4)}, target)
    before = hashlib.sha256(target.read_bytes()).hexdigest()
    (folder / "layers.1.up.weight.dat").unlink()
    with pytest.raises(DumpError) as caught:
        zp.dump(m, target)
    message = str(caught.value)
    assert "'layers.1.up.weight'" in message
    assert str(folder) in message
    assert "cannot be read" in message
    assert hashlib.sha256(target.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.zcp", "offload"]


# -- refused on request --------------------------------------------------------------------------------------------


def test_refuse_names_the_module_the_folder_and_the_fix(tmp_path: Path) -> None:
    m = model()
    folder = tmp_path / "offload"
    accelerate.dispatch_model(m, device_map={"layers.0": "cpu", "layers.1": "cpu", "layers.2": "disk"},
                              offload_dir=folder)  # fmt: skip
    target = tmp_path / "m.zcp"
    zp.dump({"previous": torch.arange(4)}, target)
    before = target.read_bytes()
    with pytest.raises(DumpError) as caught:
        zp.dump(m, target, offloaded="refuse")
    message = str(caught.value)
    assert "model.layers.2.up (Linear)" in message
    assert str(folder) in message
    assert "'layers.2.up.weight'" in message
    assert "offloaded='copy'" in message
    assert caught.value.path == "obj.layers[2].up"
    assert target.read_bytes() == before
    with pytest.raises(DumpError, match="model.layers.2"):
        zp.dumps(m, offloaded="refuse")
    with pytest.raises(DumpError, match="model.layers.2"):
        zp.freeze(m, offloaded="refuse")


def test_refuse_finds_a_model_nested_in_a_container(tmp_path: Path) -> None:
    m = model()
    folder = tmp_path / "offload"
    accelerate.disk_offload(m, folder, execution_device="cpu")
    with pytest.raises(DumpError) as caught:
        zp.dumps({"model": m, "step": 3}, offloaded="refuse")
    message = str(caught.value)
    assert "OffloadedWeightsLoader" in message
    assert str(folder) in message
    assert "offloaded='copy'" in message
    assert caught.value.path is not None and caught.value.path.startswith("obj['model']")


def test_the_copy_covers_a_model_nested_in_a_container(tmp_path: Path) -> None:
    m = model()
    folder = tmp_path / "offload"
    accelerate.disk_offload(m, folder, execution_device="cpu")
    data = zp.dumps({"model": m, "step": 3})
    shutil.move(folder, tmp_path / "moved")
    loaded = zp.loads(data, trusted=True)
    with torch.no_grad():
        assert torch.equal(loaded["model"](inputs()), expected())


@pytest.mark.parametrize("bad", ["materialize", "", None, 1, b"copy"])
def test_offloaded_takes_copy_or_refuse(bad: object) -> None:
    with pytest.raises(ArgumentError, match="offloaded must be 'copy' or 'refuse'"):
        zp.dumps(torch.ones(2), offloaded=bad)  # type: ignore[arg-type]


def test_a_cache_entry_copies_disk_offloaded_weights_too(tmp_path: Path) -> None:
    """The model cache pickles its entries with its own pickler: it applies the same copy, so an entry of a
    disk-offloaded model does not read the folder either."""
    from tests.internals import BufferTable, LoadPolicy, load_stream
    from zerocopy_pickle.cache.entries import pickle_with_refs

    m = model()
    folder = tmp_path / "offload"
    accelerate.disk_offload(m, folder, execution_device="cpu")
    pickled = pickle_with_refs(m, [], in_band=True)
    shutil.move(folder, folder.with_name("offload.moved"))
    loaded = load_stream(pickled.stream, BufferTable([]), LoadPolicy(trusted=True))
    assert all(loader.index == {} and loader.save_folder is None for loader in loaders(loaded))
    with torch.no_grad():
        assert torch.equal(loaded(inputs()), expected())
