"""The load core (``zerocopy_pickle._core.loadcore``): the checks, plugin preparation, argument references and error
conversion that snapshot loads and model-cache entries share."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import BufferTable, LoadPolicy, loadcore
from zerocopy_pickle import Registry, ZeroCopyPickler, default_registry
from zerocopy_pickle.cache import entries


@pytest.fixture
def hooked() -> Iterator[tuple[Registry, list[str]]]:
    """The default registry with a plugin ``test-core-hook`` whose load hook records that it ran."""
    registry = default_registry()
    ran: list[str] = []

    def register(registrar: zp.Registrar) -> None:
        registrar.set_load_hook(lambda: ran.append("hook"))

    registry.add_plugin("test-core-hook", register, package="zcp-core-hook")
    yield registry, ran
    registry.remove_plugin("test-core-hook")


def pickled(obj: Any) -> tuple[bytes, list[memoryview]]:
    out = io.BytesIO()
    views: list[memoryview] = []
    pickler = ZeroCopyPickler(out, buffer_callback=lambda b: views.append(b.raw()) or False)
    pickler.dump(obj)
    return out.getvalue(), views


def test_a_trusted_load_runs_the_plugins_hooks_a_restricted_one_does_not(hooked: tuple[Registry, list[str]]) -> None:
    _, ran = hooked
    stream, views = pickled({"w": torch.arange(4.0)})
    plugins = [("test-core-hook", "zcp-core-hook")]
    restricted = loadcore.load_stream(stream, BufferTable(views), LoadPolicy(trusted=False, plugins=plugins))
    assert torch.equal(restricted["w"], torch.arange(4.0)) and ran == []
    trusted = loadcore.load_stream(stream, BufferTable(views), LoadPolicy(trusted=True, plugins=plugins))
    assert torch.equal(trusted["w"], torch.arange(4.0)) and ran == ["hook"]
    with pytest.raises(zp.PluginError, match="pip install zcp-absent"):
        loadcore.load_stream(
            stream, BufferTable(views), LoadPolicy(trusted=True, plugins=[("test-core-absent", "zcp-absent")])
        )


def test_cache_streams_record_and_prepare_their_plugins(hooked: tuple[Registry, list[str]]) -> None:
    """A cache entry's stream records the plugins its pickler used, and unpickling it runs their hooks."""
    registry, ran = hooked

    class Owned:
        def __init__(self, value: int) -> None:
            self.value = value

    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Owned, lambda obj: (Owned, (obj.value + 1,)))
        registrar.set_load_hook(lambda: ran.append("reducer-plugin"))

    registry.add_plugin("test-core-reducer", register, package="zcp-core-reducer")
    try:
        result = entries.pickle_with_refs([Owned(1)], [], in_band=False)
        assert result.plugins == [("test-core-reducer", "zcp-core-reducer")]
        loaded = entries.unpickle(result.stream, result.views, [], result.plugins)
        assert loaded[0].value == 2 and ran == ["reducer-plugin"]
    finally:
        registry.remove_plugin("test-core-reducer")


def test_argument_references_resolve_only_in_a_trusted_load() -> None:
    mine = torch.nn.Linear(2, 2)
    result = entries.pickle_with_refs({"module": mine, "x": torch.ones(2)}, [mine], in_band=False)
    loaded = entries.unpickle(result.stream, result.views, [mine])
    assert loaded["module"] is mine and torch.equal(loaded["x"], torch.ones(2))
    with pytest.raises(zp.ArgumentError, match="trusted"):
        loadcore.load_stream(result.stream, BufferTable(result.views), LoadPolicy(trusted=False, arguments=[mine]))
    # A restricted load of a stream naming the reference refuses it like any other global it does not allow.
    with pytest.raises(zp.RestrictedLoadError, match="zerocopy_pickle._core.loadcore:argument"):
        loadcore.load_stream(result.stream, BufferTable(result.views), LoadPolicy(trusted=False))
    with pytest.raises(zp.ZeroCopyPickleError, match="only be resolved"):
        loadcore.argument(0)


def test_buffer_count_and_errors_are_the_libraries() -> None:
    stream, views = pickled([torch.arange(3.0), torch.ones(2)])
    with pytest.raises(zp.SnapshotError, match=r"consumes 2 out-of-band buffer\(s\), the table declares 1"):
        loadcore.load_stream(stream, BufferTable(views[:1], name="the table"), LoadPolicy(trusted=True))
    with pytest.raises(zp.SnapshotError, match=r"consumes 2 out-of-band buffer\(s\), the header declares 3"):
        loadcore.load_stream(stream, BufferTable([*views, views[0]]), LoadPolicy(trusted=False))
    with pytest.raises(zp.SnapshotError, match="my stream is corrupt"):
        loadcore.load_stream(
            stream[:-1], BufferTable(views), LoadPolicy(trusted=True, check_bounds=False), where="my stream"
        )
    # The buffers of a deferred source are asked for only once every check passed.
    asked: list[int] = []

    def source() -> list[memoryview]:
        asked.append(1)
        return views

    with pytest.raises(zp.SnapshotError):
        loadcore.load_stream(stream, BufferTable(source, declared=1), LoadPolicy(trusted=False))
    assert asked == []
    assert len(
        loadcore.load_stream(stream, BufferTable(source, declared=2), LoadPolicy(trusted=False))
    ) == 2 and asked == [1]


def test_a_trusted_streams_own_failure_propagates_as_itself() -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (int, ("not a number",))

    stream = pickle.dumps(Boom(), protocol=5)
    with pytest.raises(ValueError, match="invalid literal"):
        loadcore.load_stream(stream, BufferTable([]), LoadPolicy(trusted=True))


def test_admit_stream_decides_as_a_restricted_load_does() -> None:
    """admit_stream (zerocopy-pickle scan) refuses what a restricted load_stream refuses, with the same globals
    needed, and admits it with the same allow-list, reading no buffer."""
    module = torch.nn.Linear(2, 2)
    out = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    ZeroCopyPickler(out, buffer_callback=lambda b: buffers.append(b) or False).dump(module)
    stream = out.getvalue()
    with pytest.raises(zp.RestrictedLoadError) as by_load:
        loadcore.load_stream(stream, BufferTable([b.raw() for b in buffers]), LoadPolicy(trusted=False))
    with pytest.raises(zp.RestrictedLoadError) as by_admission:
        loadcore.admit_stream(stream)
    assert by_admission.value.needed == by_load.value.needed
    assert ("torch.nn.modules.linear", "Linear") in by_admission.value.needed
    loadcore.admit_stream(stream, allow=[torch.nn.Linear])  # no buffers given: none is read
    with pytest.raises(zp.SnapshotError):
        loadcore.admit_stream(stream[: len(stream) // 2])
