"""The reducer registry: registration, MRO lookup, clobbering, plugins' declarations and their isolation."""

from __future__ import annotations

import functools
import io
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle.plugin import Registry, default_registry, validate


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


SHAPES = {"Shape": Shape, "Square": Square}


def rebuild_named_shape(name: Any, sides: Any, weights: Any) -> Shape:
    """What a plugin declares safe: a module-level function that checks every argument's exact type first, and
    takes its class by a name from a fixed table."""
    where = "rebuild_named_shape"
    cls = SHAPES[validate.expect_choice(name, tuple(SHAPES), where, "name")]
    validate.expect_int(sides, where, "sides", 0, 1 << 20)
    validate.expect_tensor(weights, where, "weights", dim=1)
    return rebuild_shape(cls, sides, weights)


def reduce_named_shape(shape: Shape) -> tuple[Any, ...]:
    return rebuild_named_shape, (type(shape).__name__, shape.sides, shape.weights)


def safe_a() -> None:
    """A safe global of test plugin a."""


def safe_b() -> None:
    """A safe global of test plugin b."""


def safe_unnamed() -> None:
    """A safe global registered in-process without a plugin name."""


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


@pytest.fixture
def private() -> Registry:
    """A registry of the test's own (no discovery), passed to dump/load as ``registry=``: no global state."""
    return Registry(discover=False)


def test_register_by_type_and_round_trip(private: Registry) -> None:
    with pytest.raises(zp.DumpError, match="generator"):
        zp.dumps(Shape(3), backend="pickle", registry=private)
    private.register_reducer(Shape, reduce_shape)
    loaded = zp.loads(zp.dumps(Shape(3), registry=private), trusted=True, registry=private)
    assert isinstance(loaded, Shape) and loaded.sides == 3 and torch.equal(loaded.weights, torch.full((3,), 3.0))


def test_every_dump_and_load_takes_a_registry(private: Registry, tmp_path: Path) -> None:
    private.add_plugin("test-every", lambda r: r.register_reducer(Shape, reduce_named_shape), package="zcp-every")
    private.register_reducer(Square, reduce_square)  # in-process: its stream needs trusted=True
    path = tmp_path / "shape.zcp"
    zp.dump(Shape(2), path, registry=private)
    with pytest.raises(zp.PluginError, match="'test-every', which is not installed"):
        zp.load(path, trusted=True)  # the default registry has no such plugin
    assert zp.load(path, trusted=True, registry=private).sides == 2
    with path.open("rb") as f:
        assert zp.load(f, trusted=True, registry=private).sides == 2
    with zp.freeze(Square(3), registry=private) as snap:
        assert snap.load(registry=private).sides == 30
    with pytest.raises(zp.DumpError):
        zp.freeze(Shape(2), backend="pickle")  # the default registry has no reducer for it
    stream = io.BytesIO()
    pickler = zp.ZeroCopyPickler(stream, registry=private, buffer_callback=lambda b: False)
    pickler.dump(Shape(1))
    assert [p.name for p in pickler.plugins_used] == ["test-every"]


def test_tensors_inside_reduced_objects_stay_out_of_band(private: Registry) -> None:
    private.register_reducer(Shape, reduce_shape)
    shape = Shape(100_000)
    data = bytearray(zp.dumps({"shape": shape, "same": shape.weights}, registry=private))
    header = zp.read_header(data)
    assert len(header.buffers) == 1 and header.buffers[0].nbytes == 400_000
    loaded = zp.loads(data, trusted=True, registry=private)
    assert loaded["shape"].weights.data_ptr() == loaded["same"].data_ptr()  # one storage, shared


def test_subclasses_follow_the_mro_and_exact_beats_base(private: Registry) -> None:
    private.register_reducer(Shape, reduce_shape)

    def round_trip(obj: Shape) -> Shape:
        return zp.loads(zp.dumps(obj, registry=private), trusted=True, registry=private)

    assert round_trip(Square(4)).sides == 4  # the base's reducer
    private.register_reducer(Square, reduce_square)
    assert round_trip(Square(4)).sides == 40  # the exact one
    assert round_trip(Shape(4)).sides == 4


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


def test_same_name_but_other_class_is_not_matched(private: Registry) -> None:
    private.register_reducer(Shape, reduce_shape)
    impostor = type("Shape", (), {"__module__": Shape.__module__, "__qualname__": "Shape"})
    assert private.lookup(impostor) is None


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


def test_reducer_may_decline(private: Registry) -> None:
    private.register_reducer(torch.nn.Linear, lambda m: NotImplemented)
    loaded = zp.loads(zp.dumps(torch.nn.Linear(2, 2), registry=private), allow=[torch.nn.Linear], registry=private)
    assert isinstance(loaded, torch.nn.Linear)


def test_plugin_is_recorded_and_its_safe_globals_allowed(private: Registry) -> None:
    hook_calls: list[int] = []

    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Shape, reduce_named_shape)
        registrar.add_safe_globals(rebuild_named_shape)
        registrar.set_load_hook(lambda: hook_calls.append(1))

    private.add_plugin("test-shapes", register, package="zcp-test-shapes")
    data = zp.dumps([Shape(2), Square(3)], registry=private)
    assert [tuple(p) for p in zp.read_header(data).plugins] == [("test-shapes", "zcp-test-shapes")]
    loaded = zp.loads(data, registry=private)  # restricted, without allow=: the plugin declared what its stream needs
    assert [s.sides for s in loaded] == [2, 3] and type(loaded[1]) is Square
    assert hook_calls == []  # a restricted load runs no load hook
    assert private.safe_globals(plugins=["test-shapes"]) == {(__name__, "rebuild_named_shape"): None}
    assert private.plugins()["test-shapes"].state == "registered"
    # The process's registry never saw the plugin: a load through it needs the plugin installed.
    assert "test-shapes" not in default_registry().plugins()
    with pytest.raises(zp.PluginError, match="plugin 'test-shapes', which is not installed"):
        zp.loads(data)


def test_a_plugins_registration_is_only_what_its_registrar_receives(clean: Registry) -> None:
    """No ambient "current plugin": the module-level API inside ``register`` registers for the program, not the
    plugin, and an entry-point module without a ``register`` function is a failed plugin, not an empty one."""

    def register(registrar: zp.Registrar) -> None:
        zp.register_reducer(Shape, reduce_shape)
        registrar.register_reducer(Square, reduce_square)

    clean.add_plugin("test-explicit", register)
    table = clean.reducers()
    assert table[f"{__name__}:Shape"].plugin is None
    assert table[f"{__name__}:Square"].plugin == "test-explicit"
    clean.remove_plugin("test-explicit")
    assert f"{__name__}:Square" not in clean.reducers() and f"{__name__}:Shape" in clean.reducers()
    with pytest.raises(zp.PluginError, match="has no register"):
        clean.add_plugin("test-no-register", types.ModuleType("zcp_no_register"))  # type: ignore[arg-type]


def test_snapshot_needing_a_missing_plugin(private: Registry) -> None:
    private.add_plugin("test-gone", lambda r: r.register_reducer(Shape, reduce_shape), package="zcp-gone")
    data = zp.dumps(Shape(2), registry=private)
    private.remove_plugin("test-gone")
    with pytest.raises(zp.PluginError, match=r"plugin 'test-gone'.*not installed: pip install zcp-gone") as info:
        zp.loads(data, trusted=True, registry=private)
    assert info.value.plugin == "test-gone" and info.value.package == "zcp-gone"
    assert isinstance(info.value, ImportError)


def test_failing_registration_is_rolled_back(private: Registry) -> None:
    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Shape, reduce_shape)
        raise RuntimeError("half-registered")

    with pytest.raises(zp.PluginError, match="half-registered"):
        private.add_plugin("test-broken", register)
    assert f"{Shape.__module__}:Shape" not in private.reducers()
    with pytest.raises(zp.DumpError):
        zp.dumps(Shape(2), backend="pickle", registry=private)


def test_failing_load_hook(private: Registry) -> None:
    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Shape, reduce_shape)
        registrar.set_load_hook(lambda: 1 / 0)

    private.add_plugin("test-hook", register)
    data = zp.dumps(Shape(1), registry=private)
    needed = [(p.name, p.package) for p in zp.read_header(data).plugins]
    private.prepare_load(needed)  # restricted (the default): the hook does not run
    with pytest.raises(zp.PluginError, match="load hook of plugin 'test-hook' failed: ZeroDivisionError"):
        private.prepare_load(needed, trusted=True)


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
        header = zp.read_header(zp.dumps(module.Widget()))
        clean.prepare_load([(p.name, p.package) for p in header.plugins], trusted=True)
        assert calls == [1]
    finally:
        for key in (name, "zcp_claimed_ns", "zcp_claimed_ns.local"):
            del sys.modules[key]
    with pytest.raises(zp.PluginError, match="module prefix must be a dotted module name"):
        clean.add_plugin("test-bad-claim", lambda r: r.claim_modules(".x"))


# -- trust rules: what a plugin may declare safe, whose declarations a load sees, which hooks run ----------------


class _Callable:
    def __call__(self) -> None:
        pass


def _closure_factory() -> Any:
    def inner() -> None:
        pass

    return inner


@pytest.mark.parametrize(
    "entry",
    [
        Shape,  # a class: NEWOBJ/BUILD, a constructor with any arguments
        len,  # a builtin
        Shape(1).__init__,  # a bound method
        lambda: None,
        _closure_factory(),
        functools.partial(safe_a),
        _Callable(),
        os.path.join,  # a plain function, but not of the plugin's own package
        "os:system",  # by name, outside the plugin's package
        "posixpath:join",
    ],
    ids=["class", "builtin", "method", "lambda", "closure", "partial", "callable", "foreign", "foreign-str", "str2"],
)
def test_plugin_safe_globals_must_be_its_own_module_level_functions(clean: Registry, entry: Any) -> None:
    with pytest.raises(zp.PluginError):
        clean.add_plugin("test-bad-safe", lambda r: r.add_safe_globals(entry))
    assert clean.plugins()["test-bad-safe"].state == "failed"  # nothing it declared is kept
    assert not clean.safe_globals(plugins=["test-bad-safe"]).keys() - clean.safe_globals(plugins=[]).keys()
    with pytest.raises(zp.PluginError):
        clean.add_plugin("test-bad-safe", lambda r: r.register_reducer(Shape, reduce_shape, safe_globals=[entry]))


@pytest.mark.parametrize("entry", [Shape, len, lambda: None, functools.partial(safe_a)])
def test_in_process_safe_globals_must_be_functions(clean: Registry, entry: Any) -> None:
    with pytest.raises(zp.PluginError, match="not a plain Python function|not a module-level function"):
        zp.register_reducer(Shape, reduce_shape, safe_globals=[entry])
    assert f"{Shape.__module__}:Shape" not in clean.reducers()


@pytest.mark.parametrize("entry", ["tests.test_registry:a.b", "no_colon", "tests.test_registry:", ":x"])
def test_malformed_safe_global_strings(clean: Registry, entry: str) -> None:
    with pytest.raises(zp.ArgumentError):
        zp.register_reducer(Shape, reduce_shape, safe_globals=[entry])


def test_string_safe_globals_are_checked_when_resolved(clean: Registry) -> None:
    """A ``"module:function"`` entry is not imported at registration; resolving it checks it as a function would be."""
    clean.add_plugin("test-strings", lambda r: r.add_safe_globals(f"{__name__}:Shape", f"{__name__}:safe_a"))
    assert clean.resolve_safe_global(__name__, "safe_a", plugins=["test-strings"]) is safe_a
    with pytest.raises(zp.PluginError, match="is a class, not a plain Python function"):
        clean.resolve_safe_global(__name__, "Shape", plugins=["test-strings"])
    with pytest.raises(zp.PluginError, match="not a declared safe global"):
        clean.resolve_safe_global(__name__, "safe_a", plugins=["test-other"])
    with pytest.raises(zp.PluginError, match="not a declared safe global"):
        clean.resolve_safe_global("os", "system")


def test_safe_globals_of_only_the_plugins_a_header_names(clean: Registry) -> None:
    clean.add_plugin("test-a", lambda r: r.add_safe_globals(safe_a))
    clean.add_plugin("test-b", lambda r: r.register_reducer(Square, reduce_square, safe_globals=[safe_b]))
    zp.register_reducer(Shape, reduce_shape, safe_globals=[safe_unnamed])  # in-process, no plugin name
    a, b, unnamed = ((__name__, f.__name__) for f in (safe_a, safe_b, safe_unnamed))
    everything = clean.safe_globals()  # the old form: every enabled plugin's
    assert {a, b, unnamed} <= set(everything)
    only_a = clean.safe_globals(plugins=["test-a"])
    assert a in only_a and b not in only_a
    assert unnamed in only_a  # the running program's own declaration: no header can name it
    only_b = clean.safe_globals(plugins=[("test-b", "zcp-b")])  # (name, package) pairs, as headers hold them
    assert b in only_b and a not in only_b
    none = clean.safe_globals(plugins=[])
    assert a not in none and b not in none and unnamed in none
    assert not [pair for pair in clean.safe_globals(plugins=[]) if pair[0].startswith("zerocopy_pickle_quirks")]


def test_prepare_load_runs_hooks_only_when_trusted(private: Registry) -> None:
    ran: list[str] = []

    def register(registrar: zp.Registrar) -> None:
        registrar.set_load_hook(lambda: ran.append("hook"))

    private.add_plugin("test-hooked", register, package="zcp-hooked")
    private.prepare_load([("test-hooked", "zcp-hooked")])
    private.prepare_load([("test-hooked", "zcp-hooked")], trusted=False)
    assert ran == []
    private.prepare_load([("test-hooked", "zcp-hooked")], trusted=True)
    assert ran == ["hook"]
    # Presence is still checked in restricted loads, before anything.
    with pytest.raises(zp.PluginError, match="not installed: pip install zcp-absent"):
        private.prepare_load([("test-hooked", "zcp-hooked"), ("test-absent", "zcp-absent")])
    assert ran == ["hook"]


def test_restricted_load_of_a_hostile_header_runs_no_hook(private: Registry) -> None:
    """A snapshot that names a plugin it does not need (an attacker can write any header) gets its presence
    checked, nothing more."""
    ran: list[str] = []

    def register(registrar: zp.Registrar) -> None:
        registrar.register_reducer(Shape, reduce_named_shape)
        registrar.add_safe_globals(rebuild_named_shape)
        registrar.set_load_hook(lambda: ran.append("hook"))

    private.add_plugin("test-header", register)
    data = zp.dumps({"x": Shape(2)}, registry=private)
    assert [p.name for p in zp.read_header(data).plugins] == ["test-header"]
    assert zp.loads(data, registry=private)["x"].sides == 2
    assert ran == []
