"""One refusal, the right answer: a restricted load's refusal either gives the whole ``allow=`` that loads the
stream (copy-pasteable: names, and ``zerocopy_pickle.allow_function(...)`` for what the stream calls) or says at
once that only ``trusted=True`` can, and why.

Property-tested over the test corpus: real objects whose snapshots need ``allow=`` or ``trusted=True``, and
every hand-written hostile stream of tests/test_attacks.py and tests/test_hostile.py. For each refusal, the
suggestion is pasted (evaluated from the message's own text) and followed.
"""

from __future__ import annotations

import collections
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerocopy_pickle as zp
from tests.internals import spell_allow

from . import refusal_models as rm
from .test_load_leaves_no_trace import CASES as HOSTILE


def _quantized() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 4)), {nn.Linear}, dtype=torch.qint8)


def _hooked() -> nn.Module:
    layer = nn.Linear(2, 2)
    layer.register_forward_hook(lambda *args: None)  # code pickled by value
    return layer


def _scripted() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.script(nn.Linear(2, 2))


def _compiled() -> nn.Module:
    return torch.compile(nn.Linear(2, 2))  # type: ignore[return-value]


def _numpy() -> dict[str, Any]:
    import numpy as np

    return {"loss": np.float64(0.91), "table": np.arange(6).reshape(2, 3)}


class Counted(collections.OrderedDict):  # type: ignore[type-arg]
    pass


REAL: dict[str, Callable[[], object]] = {
    "a class in a dict": lambda: {"config": rm.Config(3), "w": torch.ones(2)},
    "a dataclass": lambda: rm.Point(1.0, 2.0),
    "an enum member": lambda: [rm.Color.RED, rm.Color.BLUE],
    "a module subclass holding a class": rm.Block,
    "a function as a value": lambda: {"activation": rm.scale},
    "a stream that calls a function": lambda: [rm.Paired(1, 2), rm.Paired(3, 4)],
    "a functools.partial": lambda: rm.PARTIAL,
    "a custom __new__ filled by BUILD": rm.Interned,
    "an OrderedDict subclass defined in the test": lambda: Counted(a=1),
    "numpy values": _numpy,
    "dynamic quantization": _quantized,
    "a lambda forward hook": _hooked,
    "TorchScript": _scripted,
    "a torch.compile'd module": _compiled,
}


def follow(data: bytes, **load: Any) -> tuple[zp.RestrictedLoadError | None, object]:
    """Load ``data`` restricted; on a refusal, check it and follow its advice once. Returns the first refusal
    (None if it loaded at once) and what the followed load returned (None when the refusal said trusted only)."""
    try:
        return None, zp.loads(data, **load)
    except zp.RestrictedLoadError as e:
        first = e
    message = str(first)
    if first.trusted_only:
        assert first.allow is None and "trusted=True" in message, message
        assert "allow=[" not in message, f"a trusted-only refusal suggests an allow=: {message}"
        return first, None
    assert first.allow, f"a refusal neither suggests allow= nor says trusted only: {message}"
    spelled = spell_allow(first.allow)
    assert spelled in message, message
    pasted = eval(spelled.removeprefix("allow="), {"zerocopy_pickle": zp})  # what a user pastes
    assert pasted == list(first.allow)
    try:
        return first, zp.loads(data, allow=pasted, **load)
    except zp.RestrictedLoadError as e:
        raise AssertionError(
            f"following the refusal's advice {spelled} was refused again: {e}\n\nfirst: {message}"
        ) from None


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_refusal_of_a_real_object_loads_when_followed_or_says_trusted_only_at_once(name: str) -> None:
    obj = REAL[name]()
    data = zp.dumps(obj)
    refusal, loaded = follow(data)
    if refusal is not None and refusal.trusted_only:
        zp.loads(data, trusted=True)  # and trusted does load it
        return
    assert type(loaded) is type(obj)


EXPECTED = {  # what the advice must be, not only that it works
    "a class in a dict": ["tests.refusal_models:Config"],
    "a stream that calls a function": [zp.allow_function("tests.refusal_models:make_pair")],
    "a function as a value": ["tests.refusal_models:scale"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_advice_is_exactly_what_the_stream_needs(name: str) -> None:
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.loads(zp.dumps(REAL[name]()))
    assert list(refused.value.allow or ()) == EXPECTED[name]
    assert not refused.value.trusted_only


def test_a_value_entry_for_a_called_function_is_upgraded_in_the_advice() -> None:
    data = zp.dumps(rm.Paired(1, 2))
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.loads(data, allow=["tests.refusal_models:make_pair"])  # admitted as a value: the stream calls it
    assert refused.value.allow == (zp.allow_function("tests.refusal_models:make_pair"),)
    assert "zerocopy_pickle.allow_function('tests.refusal_models:make_pair')" in str(refused.value)
    assert "No allow=" not in str(refused.value)
    assert zp.loads(data, allow=list(refused.value.allow)) == (1, 2)


def test_the_advice_keeps_the_entries_this_call_gave() -> None:
    data = zp.dumps({"c": rm.Config(1), "p": rm.Point(0.0, 1.0)})
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.loads(data, allow=[rm.Config])
    assert refused.value.needed == (("tests.refusal_models", "Point"),)
    assert refused.value.allow == ("tests.refusal_models:Config", "tests.refusal_models:Point")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a custom __new__ filled by BUILD", "its own __new__"),
        ("dynamic quantization", "torch:ScriptObject"),
        ("a lambda forward hook", "pickled by value"),
        ("numpy values", None),
    ],
)
def test_trusted_only_refusals_say_why_in_the_first_message(name: str, why: str | None) -> None:
    refusal, _ = follow(zp.dumps(REAL[name]()))
    if why is None:  # numpy values: restricted-loadable or trusted-only, never a dead end (checked by follow)
        return
    assert refusal is not None and refusal.trusted_only and why in str(refusal), refusal


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_refusal_of_a_hostile_stream_never_suggests_what_runs_its_payload(
    name: str, tmp_path: Path, alias_module: None
) -> None:
    """Following the advice of a hostile stream's refusal either loads it (what it admits is harmless: the
    payload never runs) or the first message already said trusted only; a later refusal may come only from a
    safe function checking its arguments, never from the policy."""
    sentinel = tmp_path / "PWNED"
    data = HOSTILE[name](sentinel)
    try:
        follow(data)  # a second refusal by the policy fails inside (AssertionError)
    except zp.RestrictedLoadError:
        raise
    except zp.ZeroCopyPickleError:
        pass  # a safe function refused its arguments, or the stream is malformed: not a dead-end refusal
    assert not sentinel.exists(), "a payload ran"


# -- at dump time: a snapshot that only trusted=True will load says so, and where ----------------------------


def test_a_dump_with_code_pickled_by_value_warns_with_its_path(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model[0].register_forward_hook(lambda *args: None)
    with pytest.warns(zp.TrustedOnlyWarning) as caught:
        zp.dump(model, tmp_path / "m.zcp")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert re.search(r"obj\[0\]\._forward_hooks\[\d+\] = function tests\.test_refusal_advice\..*<lambda>", message)
    assert "trusted=True" in message and "module level" in message
    assert caught[0].filename == __file__, "the warning points at the caller's dump"
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.load(tmp_path / "m.zcp")
    assert refused.value.trusted_only and refused.value.allow is None
    assert isinstance(zp.load(tmp_path / "m.zcp", trusted=True), nn.Sequential)


def test_code_reached_only_through_other_code_by_value_is_found_by_the_pickler_s_own_reduction() -> None:
    """The warning's paths come from walking the graph with the pickler's own reduction (by value, as
    cloudpickle reduces a function: its closure, globals, defaults), not with ``__reduce_ex__``, which knows
    nothing of the function a closure holds."""

    def helper(x: int) -> int:
        return x + 1

    def outer(y: int) -> int:
        return helper(y)

    with pytest.warns(zp.TrustedOnlyWarning) as caught:
        zp.dumps({"hook": outer})
    message = str(caught[0].message)
    assert "obj['hook'] = function tests.test_refusal_advice." in message  # names are cut at 120 characters
    assert re.search(r"obj\['hook'\]\.__closure__\[0\][^;=]* = function tests\.test_refusal_advice\.", message)
    assert "somewhere in the graph" not in message


def test_many_objects_by_value_are_counted_and_the_first_named() -> None:
    functions = {f"f{i}": (lambda i=i: i) for i in range(40)}
    with pytest.warns(zp.TrustedOnlyWarning, match=r"holds 40 function\(s\).*obj\['f0'\] = function.*and 24 more"):
        zp.dumps(functions)


def test_restricted_loadable_dumps_and_freeze_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", zp.TrustedOnlyWarning)
        zp.dumps({"config": rm.Config(1), "model": rm.Block(), "activation": rm.scale})
        hooked = nn.Linear(2, 2)
        hooked.register_forward_hook(lambda *args: None)
        zp.freeze(hooked).close()  # a frozen snapshot loads trusted: nothing to warn about


def test_the_dill_backend_warns_only_when_its_stream_needs_trusted() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", zp.TrustedOnlyWarning)
        plain = zp.dumps({"w": torch.ones(2)}, backend="dill")  # plain data: restricted-loadable
    assert torch.equal(zp.loads(plain)["w"], torch.ones(2))
    hooked = nn.Linear(2, 2)
    hooked.register_forward_hook(lambda *args: None)
    with pytest.warns(zp.TrustedOnlyWarning, match="dill backend"):
        data = zp.dumps(hooked, backend="dill")
    with pytest.raises(zp.RestrictedLoadError):
        zp.loads(data)
