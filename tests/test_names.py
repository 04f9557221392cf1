"""``GlobalName``, the one parser, formatter and resolver of ``"module:qualname"`` (zerocopy_pickle/_names.py), and
the callers that keep their own rules on top of it."""

from __future__ import annotations

import collections
import sys

import pytest

import zerocopy_pickle as zp
from tests.internals import GlobalName, resolve_name
from zerocopy_pickle.cache.points import check_patch_point, split_point


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("collections:OrderedDict", GlobalName("collections", "OrderedDict")),
        ("a.b:C.d", GlobalName("a.b", "C.d")),
        ("torch._utils:_rebuild_tensor_v2", GlobalName("torch._utils", "_rebuild_tensor_v2")),
        ("odd-module:not an identifier", GlobalName("odd-module", "not an identifier")),  # the form only
    ],
)
def test_parse_takes_module_colon_qualname_and_formats_back(text: str, expected: GlobalName) -> None:
    name = GlobalName.parse(text)
    assert name == expected
    assert str(name) == text
    assert name.pair == (expected.module, expected.qualname)


@pytest.mark.parametrize("text", ["", ":", "collections", "collections:", ":OrderedDict", "a:b:c", None, 7, b"a:b"])
def test_parse_refuses_anything_else(text: object) -> None:
    assert GlobalName.parse(text) is None


def test_dotted_is_identifiers_on_both_sides() -> None:
    assert GlobalName("a.b", "C.d").dotted
    assert not GlobalName("odd-module", "f").dotted
    assert not GlobalName("a", "C..d").dotted


def test_of_names_what_an_object_calls_itself() -> None:
    assert GlobalName.of(collections.OrderedDict) == GlobalName("collections", "OrderedDict")
    assert GlobalName.of(zp.load) == GlobalName("zerocopy_pickle._core.snapshot", "load")
    assert GlobalName.of(object()) is None  # an instance has no __qualname__


def test_lookup_walks_attributes_and_resolve_raises_the_one_missing_global_error() -> None:
    assert GlobalName("collections", "OrderedDict.fromkeys").lookup() == collections.OrderedDict.fromkeys
    with pytest.raises(ModuleNotFoundError):
        GlobalName("no_such_module_here", "x").lookup()
    with pytest.raises(zp.MissingGlobalError) as caught:
        GlobalName("collections", "NoSuchThing").resolve()
    error = caught.value
    assert isinstance(error, ImportError)
    assert (error.module, error.qualname, error.name) == ("collections", "NoSuchThing", "collections")
    assert isinstance(error.__cause__, AttributeError)
    assert str(error).startswith("the stream needs collections:NoSuchThing, which cannot be imported here (")
    assert "no_such_module_here" not in sys.modules


def test_names_are_hashable_and_ordered_for_tables() -> None:
    table = {GlobalName("b", "x"): 1, GlobalName("a", "y"): 2}
    assert table[GlobalName.parse("b:x")] == 1
    assert sorted(table) == [GlobalName("a", "y"), GlobalName("b", "x")]


def test_callers_keep_their_own_rules_on_the_one_form() -> None:
    assert check_patch_point("transformers.modeling_utils:PreTrainedModel.from_pretrained")
    assert not check_patch_point("odd-module:f")  # a patch point is dotted identifiers
    assert not check_patch_point(None)
    assert split_point("a.b:C.m") == GlobalName("a.b", "C.m")
    with pytest.raises(ValueError, match="is not a patch point"):
        split_point("a:b:c")
    assert resolve_name("collections:OrderedDict") is collections.OrderedDict
    with pytest.raises(ValueError, match="is not a 'module:qualname' name"):
        resolve_name("collections.OrderedDict")
    with pytest.raises(zp.ArgumentError, match="must have the form 'module:qualname'"):
        zp.loads(zp.dumps(1), allow=["collections"])
