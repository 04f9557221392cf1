"""The ``torchscript`` quirk: ScriptModules (scripted, traced, loaded) and ScriptFunctions through torch.jit.save."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from zerocopy_pickle_quirks import torchscript

import zerocopy_pickle as zp
from zerocopy_pickle import native
from zerocopy_pickle.plugin import default_registry
from zerocopy_pickle.testing import ReducerConformance

from .conftest import REPO, region_of, run_python

REBUILD_MODULE = "zerocopy_pickle_quirks.torchscript:rebuild_script_module"
REBUILD_FUNCTION = "zerocopy_pickle_quirks.torchscript:rebuild_script_function"


# -- sample objects (importable: the fresh-interpreter test rebuilds them) ----------------------------------------


class Pair(NamedTuple):
    left: torch.Tensor
    right: int


class Net(torch.nn.Module):
    """A module with a parameter that does not require grad, a buffer, a submodule in eval mode, a TorchScript
    attribute and an exported method besides forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
        self.register_buffer("scale", torch.tensor(0.5))
        self.offset: int = 2
        self.body[0].bias.requires_grad_(False)
        self.body[1].eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.offset

    @torch.jit.export
    def twice(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x) * 2


@torch.jit.script
def helper(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.jit.script
def combine(x: torch.Tensor, pair: Pair, scale: float = 1.5, extra: list[int] | None = None) -> torch.Tensor:
    """A ScriptFunction that calls another, takes a NamedTuple, an Optional list and has defaults."""
    total = helper(x) * scale + pair.left * pair.right
    if extra is not None:
        total = total + len(extra)
    return total


class Small(torch.nn.Module):
    """Traced (a class of its own: tracing a class that torch.jit.script also compiled clashes in torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)).relu()


def _cube(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 3


INPUT = torch.linspace(-1, 1, 8).reshape(2, 4)


def sample() -> dict[str, Any]:
    """The objects the conformance suite dumps: every kind of TorchScript object, and a plain tensor."""
    torch.manual_seed(0)
    scripted = torch.jit.script(Net())
    torch.manual_seed(0)
    traced = torch.jit.trace(Small().eval(), INPUT)
    return {
        "scripted": scripted,  # training mode, with one submodule in eval mode
        "traced": traced,
        "function": combine,
        "traced_function": torch.jit.trace(_cube, INPUT),
        "plain": torch.arange(6.0),
    }


def assert_same_script(expected: Any, actual: Any) -> None:
    """Equality of what torch.jit.save preserves, for the objects of :func:`sample`."""
    if isinstance(expected, dict):
        assert expected.keys() == actual.keys()
        for key in expected:
            assert_same_script(expected[key], actual[key])
    elif isinstance(expected, torch.jit.ScriptModule):
        # torch.jit.load gives back RecursiveScriptModule whatever the original Python class (traced ones too).
        assert isinstance(actual, torch.jit.RecursiveScriptModule)
        assert expected.code == actual.code
        assert [(n, m.training) for n, m in expected.named_modules()] == [
            (n, m.training) for n, m in actual.named_modules()
        ]
        for (name, a), (name2, b) in zip(expected.state_dict().items(), actual.state_dict().items(), strict=True):
            assert name == name2 and torch.equal(a, b), name
        assert [p.requires_grad for p in expected.parameters()] == [p.requires_grad for p in actual.parameters()]
        with torch.no_grad():
            torch.manual_seed(1)  # the same dropout mask on both sides (a module may be in training mode)
            want = expected(INPUT)
            torch.manual_seed(1)
            assert torch.equal(want, actual(INPUT))
    elif isinstance(expected, torch.jit.ScriptFunction):
        assert isinstance(actual, torch.jit.ScriptFunction)
        # Names, not qualified names: torch mangles those of a function traced twice in one process.
        assert (expected.name, str(expected.schema)) == (actual.name, str(actual.schema))
        args = (INPUT, Pair(INPUT, 3)) if expected.name == "combine" else (INPUT,)
        assert torch.equal(expected(*args), actual(*args))
    else:
        assert torch.equal(expected, actual)


def _load_trusted_in_fresh_interpreter(path: Path, factory: str) -> None:
    code = f"""
        import zerocopy_pickle as zp
        from zerocopy_pickle._registry.discovery import resolve_name as _resolve
        from tests.test_quirk_torchscript import assert_same_script
        loaded = zp.load({str(path)!r}, trusted=True)
        assert_same_script(_resolve({factory!r})(), loaded)
        print("ok")
        """
    proc = run_python(code, env={"PYTHONPATH": str(REPO)})
    assert proc.stdout.strip() == "ok", proc.stderr


class TestTorchScriptConformance(ReducerConformance):
    plugin = "torchscript"
    factory = "tests.test_quirk_torchscript:sample"

    def assert_same(self, expected: Any, actual: Any) -> None:
        assert_same_script(expected, actual)

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(REPO)}

    # Loading a TorchScript archive runs TorchScript code, so the plugin declares no safe globals (see
    # quirks/torchscript.py): a restricted load must refuse, and loads must be trusted or allow the rebuilds.
    def test_restricted_load_needs_only_declared_safe_globals(self) -> None:
        data = zp.dumps(self.make_objects())
        with pytest.raises(zp.RestrictedLoadError) as refused:
            zp.loads(data)
        assert REBUILD_MODULE in str(refused.value) and REBUILD_FUNCTION in str(refused.value)
        callable_rebuilds = [zp.allow_function(REBUILD_MODULE), zp.allow_function(REBUILD_FUNCTION)]
        self.assert_same(self.make_objects(), zp.loads(data, allow=callable_rebuilds))

    @pytest.mark.slow
    def test_fresh_interpreter_load(self, tmp_path: Path) -> None:
        path = tmp_path / "fresh.zcp"
        zp.dump(self.make_objects(), path)
        _load_trusted_in_fresh_interpreter(path, self.factory)


# -- registration --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls",
    [
        torch.jit.ScriptModule,
        torch.jit.RecursiveScriptModule,
        torch.jit._trace.TracedModule,
        torch.jit._trace.TopLevelTracedModule,
        torch._C.ScriptFunction,
    ],
)
def test_reducers_are_registered_for_the_real_classes(cls: type) -> None:
    default_registry().ensure_discovered()
    reducer = default_registry().lookup(cls)
    assert reducer is not None and reducer.plugin == "torchscript"


def test_declares_no_safe_globals() -> None:
    info = default_registry().plugins()["torchscript"]
    assert info.state == "loaded" and info.safe_globals == ()
    assert not [pair for pair in default_registry().safe_globals() if pair[0] == "zerocopy_pickle_quirks.torchscript"]
    assert not [
        pair
        for pair in default_registry().safe_globals(plugins=["torchscript"])
        if pair[0] == "zerocopy_pickle_quirks.torchscript"
    ]


def test_restricted_load_refuses_archives_even_when_the_header_names_the_plugin() -> None:
    """Loading an archive runs TorchScript code: trusted-only, whatever the header lists."""
    from zerocopy_pickle_quirks import torchscript

    data = zp.dumps(torch.jit.script(torch.nn.Linear(2, 2)))
    assert "torchscript" in [p.name for p in zp.read_header(data).plugins]
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.loads(data)
    assert ("zerocopy_pickle_quirks.torchscript", "rebuild_script_module") in refused.value.needed
    assert torchscript.rebuild_script_module.__name__ == "rebuild_script_module"


# -- the archive ---------------------------------------------------------------------------------------------------


def _records(archive: Any) -> list[zipfile.ZipInfo]:
    return zipfile.ZipFile(io.BytesIO(bytes(archive))).infolist()


def test_archive_is_stored_aligned_and_loads() -> None:
    module = sample()["scripted"]
    raw = io.BytesIO()
    torch.jit.save(module, raw)
    archive = torchscript.script_archive(module)
    assert torchscript.is_stored_and_aligned(archive)
    assert all(info.compress_type == zipfile.ZIP_STORED for info in _records(archive))
    # Same records, same order (torch's reader takes the archive's name from the first one), same bytes.
    raw_zip, new_zip = zipfile.ZipFile(raw), zipfile.ZipFile(io.BytesIO(bytes(archive)))
    assert raw_zip.namelist() == new_zip.namelist()
    assert all(raw_zip.read(name) == new_zip.read(name) for name in raw_zip.namelist())
    assert new_zip.testzip() is None
    assert_same_script(module, torch.jit.load(io.BytesIO(bytes(archive))))


def test_deflated_unaligned_archive_is_repacked() -> None:
    module = sample()["scripted"]
    raw = zipfile.ZipFile(io.BytesIO(module.save_to_buffer()))
    squeezed = io.BytesIO()
    with zipfile.ZipFile(squeezed, "w", zipfile.ZIP_DEFLATED) as out:  # every record deflated, no padding
        for info in raw.infolist():
            out.writestr(info.filename, raw.read(info))
    assert not torchscript.is_stored_and_aligned(squeezed.getbuffer())
    archive = torchscript.stored_archive(squeezed.getbuffer())
    assert torchscript.is_stored_and_aligned(archive)
    assert_same_script(module, torch.jit.load(io.BytesIO(bytes(archive))))


def test_already_stored_archive_is_kept_as_is() -> None:
    archive = torchscript.script_archive(sample()["scripted"])
    assert torchscript.stored_archive(archive).obj is archive.obj  # no second copy


def test_archive_is_a_zero_copy_aligned_view_of_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "script.zcp"
    zp.dump({"m": sample()["scripted"]}, path)
    seen: list[tuple[int, int, Any]] = []
    original = native.jit_load_from_buffer

    def spy(buffer: Any, map_location: Any = None) -> Any:
        view = memoryview(buffer)
        address = buffer.ctypes.data
        seen.append((address, view.nbytes, region_of(address)))
        for info in _records(view):  # every record's data is 64-byte aligned in memory, not just in the archive
            start = (
                info.header_offset
                + 30
                + len(info.filename.encode())
                + int.from_bytes(view[info.header_offset + 28 : info.header_offset + 30], "little")
            )
            assert (address + start) % torchscript.RECORD_ALIGNMENT == 0, info.filename
        return original(buffer, map_location)

    monkeypatch.setattr(native, "jit_load_from_buffer", spy)
    loaded = zp.load(path, trusted=True)
    assert_same_script(sample()["scripted"], loaded["m"])
    [(_, nbytes, region)] = seen
    assert region is not None and region[2] == str(path)  # the archive is read from the snapshot's mapping
    assert nbytes == torchscript.script_archive(sample()["scripted"]).nbytes


# -- modules -------------------------------------------------------------------------------------------------------


def test_module_state_survives_and_loads_are_independent() -> None:
    objects = sample()
    data = zp.dumps({"m": objects["scripted"], "again": objects["scripted"]})
    first, second = zp.loads(data, trusted=True), zp.loads(data, trusted=True)
    assert first["m"] is first["again"]  # one object in the graph, one load (the pickle memo)
    assert first["m"].training and not getattr(first["m"].body, "1").training
    assert first["m"].offset == 2
    assert torch.equal(first["m"].twice(INPUT), objects["scripted"].twice(INPUT))
    with torch.no_grad():
        first["m"].scale.fill_(100.0)
    assert second["m"].scale.item() == 0.5


def test_scripted_module_inside_a_python_module() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.jit.script(torch.nn.Linear(4, 4)), torch.nn.ReLU()).eval()
    loaded = zp.loads(zp.dumps(model), trusted=True)
    assert isinstance(loaded[0], torch.jit.RecursiveScriptModule)
    assert torch.equal(loaded(INPUT), model(INPUT))


def test_cpu_module_records_its_device_and_honours_map_location() -> None:
    data = zp.dumps({"m": sample()["traced"]})
    assert [p.name for p in zp.read_header(data).plugins] == ["torchscript"]
    # The archive, and one empty marker storage for the module's only device (Note [TorchScript devices]).
    assert sorted((b.nbytes == 0, b.location) for b in zp.read_header(data).buffers) == [(False, "cpu"), (True, "cpu")]
    loaded = zp.loads(data, trusted=True, map_location="cpu")["m"]
    assert all(p.device.type == "cpu" for p in loaded.parameters())


def test_map_location_follows_where_the_markers_land() -> None:
    archive = torchscript._archive_tensor(torchscript.script_archive(sample()["scripted"]))
    # Saved on cuda:0, sent to the CPU by the load's map_location (the marker arrived as a CPU storage).
    moved = torchscript.rebuild_script_module(archive, (("cuda:0", torch.UntypedStorage(0)),))
    assert all(p.device.type == "cpu" for p in moved.parameters())
    assert torchscript._map_location([("cpu", torch.UntypedStorage(0))]) is None  # stays: torch's own default
    assert torchscript._map_location([]) is None
    assert torchscript._map_location([("cuda:0", torch.UntypedStorage(0))]) == torch.device("cpu")
    with pytest.raises(zp.DeviceError, match="one device only"):
        torchscript._map_location([("cuda:0", torch.UntypedStorage(0)), ("cuda:1", torch.empty(0, device="meta"))])
    with pytest.raises(zp.SnapshotError):
        torchscript._map_location([("cpu", b"not a storage")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_module_round_trip() -> None:
    module = torch.jit.script(Net()).cuda().eval()
    data = zp.dumps({"m": module})
    assert "cuda:0" in {b.location for b in zp.read_header(data).buffers}
    on_cuda = zp.loads(data, trusted=True)["m"]
    assert {p.device.type for p in on_cuda.parameters()} == {"cuda"}
    on_cpu = zp.loads(data, trusted=True, map_location="cpu")["m"]
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
    assert torch.allclose(on_cpu(INPUT), module(INPUT.cuda()).cpu())


def test_rebuild_rejects_a_malformed_archive_argument() -> None:
    with pytest.raises(zp.SnapshotError):
        torchscript.rebuild_script_module(torch.zeros(4), ())
    with pytest.raises(zp.SnapshotError):
        torchscript.rebuild_script_function(torch.zeros(4, dtype=torch.uint8), 3)  # type: ignore[arg-type]


# -- functions -----------------------------------------------------------------------------------------------------


def test_script_function_keeps_name_defaults_and_callees() -> None:
    loaded = zp.loads(zp.dumps({"f": combine}), trusted=True)["f"]
    assert isinstance(loaded, torch.jit.ScriptFunction)
    assert str(loaded.schema) == str(combine.schema)  # defaults included, unlike ScriptFunction.save()
    assert "scale=1.5" in str(loaded.schema)
    pair = Pair(INPUT, 2)
    assert torch.equal(loaded(INPUT, pair), combine(INPUT, pair))
    assert torch.equal(loaded(INPUT, pair, 0.5, [1, 2]), combine(INPUT, pair, 0.5, [1, 2]))


def test_archive_without_the_named_function() -> None:
    data = torchscript.reduce_script_function(combine)[1][0]
    with pytest.raises(zp.SnapshotError, match="no function"):
        torchscript.rebuild_script_function(data, "__torch__.not_there")


def test_unsaveable_function_raises_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fn: Any) -> Any:
        raise RuntimeError("Unknown type name '__torch__.Gone'")

    monkeypatch.setattr(torchscript, "_function_holder", refuse)
    with pytest.raises(zp.DumpError, match="hold it in a scripted module"):
        zp.dumps({"f": combine})


# -- why restricted loads refuse TorchScript -----------------------------------------------------------------------


class WritesAFile(torch.nn.Module):
    """A TorchScript module whose __setstate__ (TorchScript, run by torch.jit.load) overwrites a file."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self) -> str:
        return self.target

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.target, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        data = torch.from_file(state[0], True, 4, dtype=torch.uint8)  # shared=True: writes go to the file
        data.fill_(88)
        print("wrote", data.sum())  # keeps the write alive through TorchScript's optimizations
        self.target = state[0]
        self.training = state[1]


def test_loading_torchscript_can_write_files_so_restricted_loads_refuse(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim.txt"
    data = zp.dumps({"m": torch.jit.script(WritesAFile(str(victim)))})
    victim.write_bytes(b"safe")
    with pytest.raises(zp.RestrictedLoadError):
        zp.loads(data)
    assert victim.read_bytes() == b"safe"
    zp.loads(data, trusted=True)  # no Python in the archive, yet torch.jit.load wrote the file
    assert victim.read_bytes() == b"XXXX"
    capfd.readouterr()


def test_traced_function_of_a_lambda() -> None:
    traced = torch.jit.trace(lambda x: x * 3 + 1, INPUT)
    loaded = zp.loads(zp.dumps(traced), trusted=True)
    assert torch.equal(loaded(INPUT), traced(INPUT))


def test_snapshot_scan_names_the_rebuilds() -> None:
    data = zp.dumps({"m": sample()["traced"], "f": combine})
    names = {f"{module}:{name}" for module, name in zp.scan(data)}
    assert {REBUILD_MODULE, REBUILD_FUNCTION} <= names
