"""The reducer registry: registration, MRO lookup, clobbering, plugins' declarations and their isolation."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle.registry import Registry, default_registry


class Shape:
    """Unpicklable without help (it holds a generator)."""

    def __init__(self, sides: int) -> None:
        self.sides = sides
        self.weights = torch.full((sides,), float(sides))
        self.cursor = (i for i in range(sides))


class Square(Shape):
    pass


def rebuild_shape(cls: type, sides: int, weights: torch.Tensor) -> Shape:
    shape = cls.__new__(cls)
    shape.sides, shape.weights, shape.cursor = sides, weights, (i for i in range(sides))
    return shape


def reduce_shape(shape: Shape) -> tuple[Any, ...]:
    return rebuild_shape, (type(shape), shape.sides, shape.weights)


def reduce_square(square: Square) -> tuple[Any, ...]:
    return rebuild_shape, (Square, square.sides * 10, square.weights)


@pytest.fixture
def clean() -> Iterator[Registry]:
    """The default registry, with whatever a test registers removed afterwards."""
    registry = default_registry()
    before = dict(registry.reducers())
    yield registry
    for target in set(registry.reducers()) - set(before):
        registry.unregister_reducer(target)
    for name in list(registry.plugins()):
        if name.startswith("test-"):
            registry.remove_plugin(name)


def test_register_by_type_and_round_trip(clean: Registry) -> None:
    with pytest.raises(zp.DumpError, match="generator"):
        zp.dumps(Shape(3), backend="pickle")
    zp.register_reducer(Shape, reduce_shape)
    loaded = zp.loads(zp.dumps(Shape(3)), trusted=True)
    assert isinstance(loaded, Shape) and loaded.sides == 3 and torch.equal(loaded.weights, torch.full((3,), 3.0))


def test_tensors_inside_reduced_objects_stay_out_of_band(clean: Registry) -> None:
    zp.register_reducer(Shape, reduce_shape)
    shape = Shape(100_000)
    data = bytearray(zp.dumps({"shape": shape, "same": shape.weights}))
    header = zp.read_header(data)
    assert len(header.buffers) == 1 and header.buffers[0].nbytes == 400_000
    loaded = zp.loads(data, trusted=True)
    assert loaded["shape"].weights.data_ptr() == loaded["same"].data_ptr()  # one storage, shared


def test_subclasses_follow_the_mro_and_exact_beats_base(clean: Registry) -> None:
    zp.register_reducer(Shape, reduce_shape)
    assert zp.loads(zp.dumps(Square(4)), trusted=True).sides == 4  # the base's reducer
    zp.register_reducer(Square, reduce_square)
    assert zp.loads(zp.dumps(Square(4)), trusted=True).sides == 40  # the exact one
    assert zp.loads(zp.dumps(Shape(4)), trusted=True).sides == 4


def test_string_target_never_imports_its_module(clean: Registry) -> None:
    name = "zcp_lazy_target_mod"
    assert name not in sys.modules
    zp.register_reducer(f"{name}:Widget", lambda w: (dict, ([("widget", w.size)],)))
    zp.dumps({"x": torch.ones(2)})  # pickling other things never imports it
    assert name not in sys.modules
    module = types.ModuleType(name)
    exec("class Widget:\n    def __init__(self):\n        self.size = 7\n        self.gen = iter(())", module.__dict__)
    sys.modules[name] = module
    try:
        assert zp.loads(zp.dumps(module.Widget()), trusted=True) == {"widget": 7}
    finally:
        del sys.modules[name]


def test_same_name_but_other_class_is_not_matched(clean: Registry) -> None:
    zp.register_reducer(Shape, reduce_shape)
    impostor = type("Shape", (), {"__module__": Shape.__module__, "__qualname__": "Shape"})
    assert clean.lookup(impostor) is None


def test_clobber(clean: Registry) -> None:
    zp.register_reducer(Shape, reduce_shape)
    with pytest.raises(zp.ArgumentError, match="already registered.*clobber=True"):
        zp.register_reducer(f"{Shape.__module__}:Shape", reduce_square)
    zp.register_reducer(Shape, reduce_square, clobber=True)
    assert zp.reducers()[f"{Shape.__module__}:Shape"].reduce is reduce_square


def test_reducers_view_is_read_only(clean: Registry) -> None:
    zp.register_reducer(Shape, reduce_shape)
    view = zp.reducers()
    with pytest.raises(TypeError):
        view["x:y"] = view[f"{Shape.__module__}:Shape"]  # type: ignore[index]
    assert view[f"{Shape.__module__}:Shape"].target == f"{Shape.__module__}:Shape"


def test_unregister(clean: Registry) -> None:
    zp.register_reducer(Shape, reduce_shape)
    removed = zp.unregister_reducer(Shape)
    assert removed.reduce is reduce_shape
    with pytest.raises(zp.ArgumentError, match="no reducer is registered"):
        zp.unregister_reducer(Shape)
    with pytest.raises(zp.DumpError):
        zp.dumps(Shape(2), backend="pickle")


@pytest.mark.parametrize(
    ("target", "reduce"),
    [("no_colon", reduce_shape), ("a:b:c", reduce_shape), (3, reduce_shape), (Shape, "not callable")],
)
def test_malformed_registrations(clean: Registry, target: Any, reduce: Any) -> None:
    with pytest.raises(zp.ArgumentError):
        zp.register_reducer(target, reduce)


def test_reducer_may_decline(clean: Registry) -> None:
    zp.register_reducer(torch.nn.Linear, lambda m: NotImplemented)
    loaded = zp.loads(zp.dumps(torch.nn.Linear(2, 2)), allow=[torch.nn.Linear])
    assert isinstance(loaded, torch.nn.Linear)


def test_plugin_is_recorded_and_its_safe_globals_allowed(clean: Registry) -> None:
    hook_calls: list[int] = []

    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Shape, reduce_shape)
        registrar.add_safe_globals(rebuild_shape, Shape, Square)
        registrar.set_load_hook(lambda: hook_calls.append(1))
        registrar.add_patch_point("some.module:Pipeline.from_pretrained")

    clean.add_plugin("test-shapes", register, package="zcp-test-shapes")
    data = zp.dumps([Shape(2), Square(3)])
    assert [tuple(p) for p in zp.read_header(data).plugins] == [("test-shapes", "zcp-test-shapes")]
    loaded = zp.loads(data)  # restricted, without allow=: the plugin declared what its stream needs
    assert [s.sides for s in loaded] == [2, 3]
    assert hook_calls == [1]
    assert ("test-shapes", "some.module:Pipeline.from_pretrained") in clean.patch_points()
    assert clean.plugins()["test-shapes"].state == "registered"


def test_snapshot_needing_a_missing_plugin(clean: Registry) -> None:
    clean.add_plugin("test-gone", lambda r: r.register_reducer(Shape, reduce_shape), package="zcp-gone")
    data = zp.dumps(Shape(2))
    clean.remove_plugin("test-gone")
    with pytest.raises(zp.PluginError, match=r"plugin 'test-gone'.*not installed: pip install zcp-gone") as info:
        zp.loads(data, trusted=True)
    assert info.value.plugin == "test-gone" and info.value.package == "zcp-gone"
    assert isinstance(info.value, ImportError)


def test_failing_registration_is_rolled_back(clean: Registry) -> None:
    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Shape, reduce_shape)
        raise RuntimeError("half-registered")

    with pytest.raises(zp.PluginError, match="half-registered"):
        clean.add_plugin("test-broken", register)
    assert f"{Shape.__module__}:Shape" not in clean.reducers()
    with pytest.raises(zp.DumpError):
        zp.dumps(Shape(2), backend="pickle")


def test_failing_load_hook(clean: Registry) -> None:
    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Shape, reduce_shape)
        registrar.set_load_hook(lambda: 1 / 0)

    clean.add_plugin("test-hook", register)
    with pytest.raises(zp.PluginError, match="load hook of plugin 'test-hook' failed: ZeroDivisionError"):
        zp.loads(zp.dumps(Shape(1)), trusted=True)


def test_independent_registry_instance() -> None:
    registry = Registry(discover=False)
    registry.register_reducer(Shape, reduce_shape)
    assert registry.lookup(Square) is not None
    assert default_registry().lookup(Square) is None


def test_module_claims_record_the_plugin(clean: Registry) -> None:
    calls: list[int] = []
    name = "zcp_claimed_ns.local.pipe"
    module = types.ModuleType(name)
    exec("class Widget:\n    pass\n", module.__dict__)
    module.Widget.__module__ = name
    sys.modules[name] = module
    for parent in ("zcp_claimed_ns", "zcp_claimed_ns.local"):
        sys.modules[parent] = types.ModuleType(parent)

    def register(registrar: zp.Registrar) -> None:
        registrar.claim_modules("zcp_claimed_ns")
        registrar.set_load_hook(lambda: calls.append(1))

    clean.add_plugin("test-claims", register, package="zcp-claims")
    try:
        for obj in (module.Widget(), module.Widget, [module.Widget()]):
            for backend in ("pickle", "auto"):
                data = zp.dumps(obj, backend=backend)
                assert [p.name for p in zp.read_header(data).plugins] == ["test-claims"], (obj, backend)
        assert zp.read_header(zp.dumps([1, Shape])).plugins == ()  # other modules: not claimed
        zp.loads(zp.dumps(module.Widget()), trusted=True)
        assert calls == [1]
    finally:
        for key in (name, "zcp_claimed_ns", "zcp_claimed_ns.local"):
            del sys.modules[key]
    with pytest.raises(zp.PluginError, match="module prefix must be a dotted module name"):
        clean.add_plugin("test-bad-claim", lambda r: r.claim_modules(".x"))
