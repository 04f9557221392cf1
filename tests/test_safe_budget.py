"""Every conversion of the built-in safe set charges the load's budget for what it reads, before it reads it; what a
check relied on is a private copy; and conversions fail with this library's error, never an uncaught ValueError.

Budgets are observed through ``validate.remaining()`` (a counter), never through time."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import safe_composite, safe_set, safe_tensors
from zerocopy_pickle import validate

from .conftest import header_of
from .hostile_streams import G, as_snapshot, call, memo_get, memo_put, program


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sparse CSR and nested tensors are "beta"/"prototype"
        yield


def spent(fn: Any, *args: Any) -> int:
    """How much of a fresh budget ``fn(*args)`` charges."""
    with validate.budget(validate.BUDGET_FLOOR):
        before = validate.remaining()
        fn(*args)
        after = validate.remaining()
    assert before is not None and after is not None
    return before - after


# -- string and number conversions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "value", "cost"),
    [
        (safe_set.safe_int, "9" * 4000, 4000),
        (safe_set.safe_float, "1" * 5000, 5000),
        (safe_set.safe_str, 10**3000, (10**3000).bit_length() >> 3),
        (safe_set.safe_device, "cpu", 3),
        (safe_set.safe_get_layout, "torch.strided", len("torch.strided")),
        (safe_tensors.safe_rebuild_memory_format, "channels_last", len("channels_last")),
    ],
    ids=["int", "float", "str-of-int", "device", "layout", "memory_format"],
)
def test_each_conversion_charges_what_it_reads(fn: Any, value: Any, cost: int) -> None:
    assert spent(fn, value) == cost


def test_dtype_names_are_charged() -> None:
    assert spent(validate.dtype_from_name, "torch.float16", "here") == len("torch.float16")


def test_a_long_string_parsed_by_every_call_is_refused_by_the_budget() -> None:
    """One memoized 4,000-digit string, parsed again by each 8-byte call: quadratic without a charge."""
    digits = "9" * 4000
    once = program(call(G("builtins", "int"), digits))
    assert zp.loads(as_snapshot(once)) == int(digits)
    to_int = memo_put(G("builtins", "int"), 0)
    calls = [call(to_int, memo_put(digits, 1))] + [call(memo_get(0), memo_get(1)) for _ in range(2000)]
    stream = program(calls)
    assert len(stream) < 40_000  # 15 bytes per call ...
    with pytest.raises(zp.SnapshotError, match="amplification"):  # ... but 4,000 characters read by each
        zp.loads(as_snapshot(stream))


def test_a_long_int_formatted_by_every_call_is_refused_by_the_budget() -> None:
    number = 10**4000 - 1
    to_str = memo_put(G("builtins", "str"), 0)
    calls = [call(to_str, memo_put(number, 1))] + [call(memo_get(0), memo_get(1)) for _ in range(3000)]
    with pytest.raises(zp.SnapshotError, match="amplification"):
        zp.loads(as_snapshot(program(calls)))


@pytest.mark.parametrize("limit", [None, 0, 640])
def test_int_and_str_of_too_many_digits_raise_this_library_s_error(limit: int | None) -> None:
    """Python's own limit raises ValueError (sys.int_info); the safe set enforces 4,300 digits whatever this process
    set (0 disables Python's check), and every failure is an UnsafeArgumentError."""
    old = sys.get_int_max_str_digits()
    if limit is not None:
        sys.set_int_max_str_digits(limit)
    try:
        with pytest.raises(zp.UnsafeArgumentError, match="builtins:int"):
            safe_set.safe_int("9" * 5000)
        with pytest.raises(zp.UnsafeArgumentError, match="builtins:str"):
            safe_set.safe_str(10**5000)
        if limit == 640:  # Python's lower limit, inside the safe set's: its ValueError, converted
            with pytest.raises(zp.UnsafeArgumentError, match="builtins:int"):
                safe_set.safe_int("9" * 1000)
            with pytest.raises(zp.UnsafeArgumentError, match="builtins:str"):
                safe_set.safe_str(10**1000)
        else:
            assert safe_set.safe_int("9" * 4300) == 10**4300 - 1
            assert safe_set.safe_str(10**4299) == "1" + "0" * 4299
    finally:
        sys.set_int_max_str_digits(old)


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (safe_set.safe_complex, (10**400, 0)),
        (safe_set.safe_complex, (0, 10**400)),
        (safe_set.safe_float, (10**400,)),
        (safe_set.safe_int, (float("inf"),)),
        (safe_set.safe_int, (float("nan"),)),
        (safe_set.safe_int, ("12x",)),
        (safe_set.safe_float, ("1.5.5",)),
    ],
)
def test_failed_conversions_are_unsafe_argument_errors(fn: Any, args: tuple[Any, ...]) -> None:
    with pytest.raises(zp.UnsafeArgumentError):
        fn(*args)


# -- walks of plain data -----------------------------------------------------------------------------------------


def wide_tuple_dag(levels: int, width: int) -> tuple[Any, ...]:
    """A stream fragment: t1 = (0,) * width, t(k+1) = (tk,) * width, each level a memo entry: a few bytes per
    element of the stream, width ** levels elements for a walk."""
    op: Any = memo_put(tuple([0] * width), 0)
    for level in range(1, levels):
        op = memo_put(tuple([op] + [memo_get(level - 1)] * (width - 1)), level)
    return op  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["frozenset", "set"])
def test_a_memo_dag_of_wide_tuples_is_refused_before_the_walk(name: str) -> None:
    """1000 ** 8 elements behind a 40 KB stream: the walk (and the hash after it) would never end. Each tuple is
    charged its width as the walk reaches it, so the budget runs out after about a million elements."""
    stream = program(call(G("builtins", name), [wide_tuple_dag(8, 1000)]))
    assert len(stream) < 60_000
    with pytest.raises(zp.SnapshotError, match="amplification"):
        zp.loads(as_snapshot(stream))


def test_the_walk_charges_every_element_it_visits() -> None:
    inner = (1, 2, 3)
    outer = (inner, inner, inner, "abcd", b"xy")
    # the list (2) + outer (5) + inner three times (3 each) + "abcd" (4) + b"xy" (2) + "z" (1)
    assert spent(safe_set.safe_frozenset, [outer, "z"]) == 2 + 5 + 9 + 4 + 2 + 1
    assert spent(safe_set.safe_ordered_dict, [("k", outer)]) == 1 + 2 + 1 + 5 + 9 + 4 + 2


def test_ints_are_charged_their_size_before_they_are_hashed() -> None:
    """Hashing an int reads every digit and is never cached: a set of many references to one huge int is charged
    its size for each."""
    huge = 1 << 80_000
    assert spent(safe_set.safe_set, [huge] * 10) == 10 + 10 * (huge.bit_length() >> 3)
    stream = program(call(G("builtins", "set"), [memo_put(huge, 0)] + [memo_get(0)] * 5000))
    with pytest.raises(zp.SnapshotError, match="amplification"):
        zp.loads(as_snapshot(stream))


def test_distinct_equal_long_strings_in_a_set_are_refused() -> None:
    """Two distinct but equal strings alternate: every insertion compares them byte by byte."""
    a = memo_put("x" * 100_000, 0)
    b = memo_put("x" * 100_000, 1)
    items = [a, b] + [memo_get(i % 2) for i in range(2000)]
    with pytest.raises(zp.SnapshotError, match="amplification"):
        zp.loads(as_snapshot(program(call(G("builtins", "frozenset"), items))))


def test_plain_data_of_real_size_still_loads() -> None:
    """Control: what a protocol-2 pickle of a set or OrderedDict holds loads within the budget."""
    items = [(f"key{i}", i, (i, float(i))) for i in range(2000)]
    assert zp.loads(as_snapshot(program(call(G("builtins", "frozenset"), items)))) == frozenset(items)
    pairs = [(f"k{i}", (i, "v" * 50)) for i in range(2000)]
    assert list(zp.loads(as_snapshot(program(call(G("collections", "OrderedDict"), pairs)))).items()) == pairs


# -- private copies of what a check relied on ----------------------------------------------------------------------


def rewrite_rows(path: Path, dtype: str, payload: bytes, skip: int = 0) -> list[int]:
    """Overwrite, through a file descriptor of its own, the start of every buffer of ``dtype`` (after the first
    ``skip``) in the snapshot at ``path`` with ``payload``; returns the rewritten buffers' indices."""
    header = header_of(path.read_bytes())
    rows = [i for i, row in enumerate(header.buffers) if row.dtype == dtype][skip:]
    fd = os.open(path, os.O_WRONLY)
    try:
        for index in rows:
            start, stop = header.buffer_range(index)
            assert stop - start >= len(payload)
            os.pwrite(fd, payload, start)
    finally:
        os.close(fd)
    return rows


BAD_INDICES = (10**15).to_bytes(8, "little") * 4  # far outside any size


def test_the_mapping_shows_later_writes_to_the_file(tmp_path: Path) -> None:
    """Control: a dense tensor of a restricted load still sees a later write to its file (the mapping is
    MAP_PRIVATE, and the page was never written by this process): the tests below are not vacuous."""
    zp.dump({"ids": torch.arange(8)}, tmp_path / "s.zcp")
    loaded = zp.load(tmp_path / "s.zcp")
    assert rewrite_rows(tmp_path / "s.zcp", "int64", BAD_INDICES)
    assert loaded["ids"][0].item() == 10**15


def test_coo_indices_are_a_private_copy(tmp_path: Path) -> None:
    indices = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    sparse = torch.sparse_coo_tensor(indices, torch.arange(4.0), (4, 4)).coalesce()
    zp.dump({"s": sparse}, tmp_path / "s.zcp")
    loaded = zp.load(tmp_path / "s.zcp")["s"]
    assert rewrite_rows(tmp_path / "s.zcp", "int64", BAD_INDICES)
    assert torch.equal(loaded._indices(), sparse._indices())
    assert torch.equal(loaded.to_dense(), sparse.to_dense())


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr])
def test_compressed_indices_are_private_copies(tmp_path: Path, layout: torch.layout) -> None:
    dense = torch.zeros(4, 4)
    dense[0, 1], dense[2, 3], dense[3, 0] = 1.0, 2.0, 3.0
    sparse = (
        dense.to_sparse(layout=layout, blocksize=(2, 2))
        if layout is torch.sparse_bsr
        else dense.to_sparse(layout=layout)
    )
    zp.dump({"s": sparse}, tmp_path / "s.zcp")
    loaded = zp.load(tmp_path / "s.zcp")["s"]
    assert len(rewrite_rows(tmp_path / "s.zcp", "int64", (10**15).to_bytes(8, "little") * 2)) == 2
    assert torch.equal(loaded.to_dense(), dense)


def test_nested_tensor_metadata_is_a_private_copy(tmp_path: Path) -> None:
    nested = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    zp.dump({"n": nested}, tmp_path / "s.zcp")
    loaded = zp.load(tmp_path / "s.zcp")["n"]
    # sizes, strides and offsets: every int64 buffer now claims 10**15-element components
    assert len(rewrite_rows(tmp_path / "s.zcp", "int64", (10**15).to_bytes(8, "little") * 2)) == 3
    parts = loaded.unbind()
    assert [p.tolist() for p in parts] == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]]


def test_the_copies_are_charged() -> None:
    indices = torch.zeros(2, 1000, dtype=torch.int64)
    values = torch.ones(1000)
    # the indices copied (2000) and the values the check reads (1000)
    assert spent(safe_composite.safe_rebuild_sparse_tensor, torch.sparse_coo, (indices, values, (4, 4))) == 3000


@pytest.mark.parametrize(
    ("sizes", "strides", "offsets"),
    [
        ([[2**62]], [[2**62]], [0]),  # (size - 1) * stride overflows int64
        ([[2]], [[1]], [2**63 - 1]),  # offset + the terms overflows int64
        ([[3]], [[1]], [2]),  # past the end, plainly
    ],
)
def test_nested_components_past_the_buffer_are_refused_without_overflow(
    sizes: list[list[int]], strides: list[list[int]], offsets: list[int]
) -> None:
    with pytest.raises(zp.UnsafeArgumentError, match="reaches past the buffer"):
        safe_composite.safe_rebuild_nested_tensor(
            torch.arange(4.0), torch.tensor(sizes), torch.tensor(strides), torch.tensor(offsets)
        )


def test_meta_index_tensors_are_refused() -> None:
    meta = torch.empty(2, 2, dtype=torch.int64, device="meta")
    with pytest.raises(zp.UnsafeArgumentError, match="meta tensor"):
        safe_composite.safe_rebuild_sparse_tensor(torch.sparse_coo, (meta, torch.ones(2), (2, 2)))
    with pytest.raises(zp.UnsafeArgumentError, match="meta tensor"):
        safe_composite.safe_rebuild_nested_tensor(torch.arange(4.0), meta, torch.ones(2, 2, dtype=torch.int64), meta[0])
