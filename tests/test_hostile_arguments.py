"""zerocopy_pickle.testing.check_hostile_arguments: it passes validating functions and catches each way a function
can mishandle what a hostile stream gives it."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from zerocopy_pickle import validate
from zerocopy_pickle.testing import check_hostile_arguments, hostile_values


def checked(name: Any, shape: Any, values: Any = None) -> torch.Tensor:
    where = "checked"
    dtype = validate.dtype_from_name(name, where)
    dims = validate.expect_int_tuple(shape, where, "shape", hi=64)
    validate.expect_optional_tensor(values, where, "values")
    return torch.zeros(dims, dtype=dtype)


def no_arguments() -> list[int]:
    return []


def resolves_names(name: Any) -> Any:
    if type(name) is not str:
        validate.fail("resolves_names", "name must be str")
    return getattr(torch, name)  # the hole the bitsandbytes quirk had


def uses_isinstance(value: Any) -> Any:
    if not isinstance(value, int):
        validate.fail("uses_isinstance", "value must be int")
    return value + 1  # an int subclass gets through, and its __add__... of the attacker's choosing


def iterates(values: Any) -> int:
    return sum(1 for _ in values)


def calls(fn: Any) -> None:
    if type(fn) is str:
        validate.fail("calls", "fn must be callable")
    fn()


def compares_first(value: Any) -> None:
    if value == "float16":  # __eq__ of a hostile object runs before any check
        return
    validate.fail("compares_first", "no")


def returns_stdin(name: Any) -> Any:
    validate.expect_choice(name, ("stdin",), "returns_stdin", "name")
    return sys.stdin


def test_validating_functions_pass() -> None:
    check_hostile_arguments(checked, "checked")
    check_hostile_arguments(no_arguments, "no_arguments")


@pytest.mark.parametrize(
    ("fn", "finding"),
    [
        (resolves_names, "not a ZeroCopyPickleError|shared object"),
        (uses_isinstance, "not plain data|ran hostile methods"),
        (iterates, "not a ZeroCopyPickleError|ran hostile methods|not plain data"),
        (calls, "function called|ran hostile methods|not a ZeroCopyPickleError"),
        (compares_first, "ran hostile methods"),
        (returns_stdin, "shared object"),
    ],
)
def test_mishandled_arguments_are_reported(fn: Any, finding: str) -> None:
    with pytest.raises(AssertionError, match=finding):
        check_hostile_arguments(fn, fn.__name__)


def test_the_process_streams_are_restored_and_untouched() -> None:
    streams = sys.stdin, sys.stdout, sys.stderr
    with pytest.raises(AssertionError):
        check_hostile_arguments(returns_stdin, "returns_stdin")
    assert (sys.stdin, sys.stdout, sys.stderr) == streams


def test_the_values_cover_the_attacks_of_the_review() -> None:
    labels = [label for label, _ in hostile_values()]
    for needed in ("'system'", "'__class__'", "'torch.float16'", "'os.system'", "int 2**63", "generator"):
        assert any(needed.replace("2**63", str(2**63)) in label for label in labels), needed
    values = [value for _, value in hostile_values()]
    assert os.getcwd in values and sys.stdin in values
    assert any(type(v) is not torch.Tensor and isinstance(v, torch.Tensor) for v in values)  # a tensor subclass


def test_builtin_callables_without_a_signature_are_tried_at_every_arity() -> None:
    with pytest.raises(AssertionError, match="hostile calls were mishandled"):
        check_hostile_arguments(dict, "dict")  # dict(generator) iterates it, dict(x=...) ...
