"""The restricted load's cost model (tags' Note [The cost model], docs/security.md "What a load may cost"):
each attack class end to end through ``zp.loads``, the analysis cache's bound in bytes, and the name checks'
linear cost, counted (never timed). The Python and native twins' agreement on every rule is in
tests/test_native_semantics.py (CASES); random programs in tests/test_analysis_differential.py."""

from __future__ import annotations

import collections
import functools

import pytest

import zerocopy_pickle as zp
from tests.internals import blocklist, semantics, streamcheck, tags
from zerocopy_pickle import native

from .hostile_streams import as_snapshot

BACKENDS = ("python", "native")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    if name == "native":
        try:
            native.build()
        except native.NativeBuildError as e:  # the toolchain check lives in test_native_semantics
            pytest.skip(f"native helpers cannot be built here: {e}")
    semantics.forget()
    return name


def restricted_load(stream: bytes, backend: str) -> object:
    semantics.forget()
    with native.use(backend):
        return zp.loads(as_snapshot(stream))


def dag(k: int, leaf: bytes = b")") -> bytes:
    """t0 = leaf; t_i = (t_{i-1}, t_{i-1}) through the memo: t_k expands to 2**(k+1) - 1 elements."""
    stream = leaf
    for i in range(k):
        stream += b"\x94h" + bytes([i]) + b"\x86"
    return stream


DEFAULTDICT = b"\x8c\x0bcollections\x8c\x0bdefaultdict\x93"


def test_a_top_down_chain_of_defaultdicts_is_refused(backend: str) -> None:
    """d0 = defaultdict(None); d0[0] = d1; then d1, fetched from the memo, gets d1[0] = d2; ...: each is filled
    after it was put into the one above it, so no depth the analysis saw was over 3 (the SIGSEGV attack: freeing
    100,000 of them overflows the C stack). Memo 0 is the class, memo i the defaultdict d_(i-1)."""
    stream = bytearray(DEFAULTDICT + b"\x94N\x85R\x94")
    for i in range(1, 2001):
        stream += b"j" + i.to_bytes(4, "little") + b"K\x00h\x00N\x85R\x94s0"
    stream += b"h\x01."
    with pytest.raises(zp.RestrictedLoadError, match=r"after it was put into another value.*only trusted=True"):
        restricted_load(bytes(stream), backend)


def test_a_bottom_up_chain_of_defaultdicts_is_bounded(backend: str) -> None:
    made = DEFAULTDICT + b"N\x85R"
    stream = made
    for _ in range(tags.MAX_UNPROTECTED_DEPTH):
        stream = made + b"K\x00" + stream + b"s"
    with pytest.raises(zp.SnapshotError, match="frees that type recursively"):
        restricted_load(stream + b".", backend)
    shallow = made
    for _ in range(tags.MAX_UNPROTECTED_DEPTH - 2):
        shallow = made + b"K\x00" + shallow + b"s"
    loaded = restricted_load(shallow + b".", backend)
    assert isinstance(loaded, collections.defaultdict)


def test_a_reference_cycle_is_refused_with_the_way_out(backend: str) -> None:
    cycle: list[object] = []
    cycle.append([cycle])
    data = zp.dumps(cycle)
    with pytest.raises(zp.RestrictedLoadError, match="reference cycle.*only trusted=True"):
        restricted_load_snapshot(data, backend)
    loaded = zp.loads(data, trusted=True)
    assert loaded[0][0] is loaded  # type: ignore[index]


def restricted_load_snapshot(data: bytes, backend: str) -> object:
    semantics.forget()
    with native.use(backend):
        return zp.loads(data)


@pytest.mark.parametrize(
    "shape",
    [
        b"}" + dag(60) + b"Ns.",  # a dict key
        b"(" + dag(60) + b"\x91.",  # a frozenset member
        b"\x8f(" + dag(60) + b"\x90.",  # a set member
        b"(" + dag(60) + b"Nd.",  # a DICT key
    ],
    ids=["setitem", "frozenset", "additems", "dict"],
)
def test_a_memo_dag_is_never_hashed(backend: str, shape: bytes) -> None:
    # 2**61 elements from 300 bytes: hashing it would take longer than the universe has existed.
    with pytest.raises(zp.SnapshotError, match="hash more elements than its budget"):
        restricted_load(shape, backend)


def test_a_memo_dag_that_is_not_hashed_loads(backend: str) -> None:
    loaded = restricted_load(b"]" + dag(60) + b"a.", backend)
    assert isinstance(loaded, list) and isinstance(loaded[0], tuple)


def test_hashing_one_key_again_and_again_is_charged_every_time(backend: str) -> None:
    key = dag(12, b"\x8c\x01x")  # 8191 elements, memo 11 is t_11 (4095); a string leaf: hashed by a secret
    repeats = tags.HASH_FLOOR // 4095 + 10
    stream = b"}" + key + b"Ns" + b"h\x0bNs" * repeats + b"."
    with pytest.raises(zp.SnapshotError, match="hash more elements"):
        restricted_load(stream, backend)
    assert restricted_load(b"}" + key + b"Ns" + b"h\x0bNs" * 100 + b".", backend) is not None


def test_keys_whose_hashes_the_stream_chooses_are_charged_for_collisions(backend: str) -> None:
    # 20,000 ints congruent modulo 2**61 - 1 all hash alike: inserting them compares each with all before it
    # (2 s for 233 KiB of stream, 40 s for a megabyte). Small ints hash to themselves: never charged.
    modulus = (1 << 61) - 1
    keys = b"".join(b"\x8a\x0a" + (5 + i * modulus).to_bytes(10, "little", signed=True) + b"N" for i in range(20_000))
    with pytest.raises(zp.SnapshotError, match="keys whose hashes it can choose.*only trusted=True"):
        restricted_load(b"}(" + keys + b"u.", backend)
    small = b"".join(b"J" + i.to_bytes(4, "little", signed=True) + b"N" for i in range(20_000))
    assert len(restricted_load(b"}(" + small + b"u.", backend)) == 20_000  # type: ignore[arg-type]
    strings = b"".join(b"\x8c\x06" + b"%06d" % i + b"N" for i in range(20_000))
    assert len(restricted_load(b"}(" + strings + b"u.", backend)) == 20_000  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["module", "qualname"])
def test_names_longer_than_the_limit_are_refused(backend: str, where: str) -> None:
    long = "a." * (tags.MAX_NAME_LENGTH // 2) + "b"
    module, qualname = (long, "x") if where == "module" else ("collections", long)
    stream = b"c" + module.encode() + b"\n" + qualname.encode() + b"\n."
    with pytest.raises(zp.SnapshotError, match="characters long"):
        restricted_load(stream, backend)


class _CountingSet(frozenset[str]):
    """A frozenset that counts the characters of every string looked up in it."""

    looked_up = 0

    def __contains__(self, item: object) -> bool:
        type(self).looked_up += len(item) if isinstance(item, str) else 0
        return super().__contains__(item)


def test_the_blocked_module_check_reads_a_bounded_part_of_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = _CountingSet(blocklist.BLOCKED_MODULES)
    monkeypatch.setattr(blocklist, "BLOCKED_MODULES", counting)
    blocklist._module_blocked.cache_clear()
    try:
        for name in ("a." * 500_000, "a" * 1_000_000, "x" + ".a" * 300_000):
            _CountingSet.looked_up = 0
            assert not blocklist._module_blocked(name)
            longest = blocklist._LONGEST_BLOCKED
            assert _CountingSet.looked_up <= longest * longest  # not len(name)**2: one slice per dot, up to `longest`
        assert blocklist._module_blocked("os." + "a." * 100_000 + "b")
        assert blocklist._module_blocked("torch.utils.cpp_extension")
        assert not blocklist._module_blocked("torch.utils.cpp_extensions")
        assert blocklist._module_blocked("torch.utils.cpp_extension.x")
    finally:
        blocklist._module_blocked.cache_clear()


def test_refused_streams_do_not_fill_the_analysis_cache() -> None:
    semantics.forget()
    for n in range(6):
        names = b"".join(b"cm%d\nq%d_%d\n0" % (n, i, n) for i in range(20_000))
        stream = names + b"N."
        with pytest.raises(zp.RestrictedLoadError):
            zp.loads(as_snapshot(stream))
    assert semantics._ANALYSED.nbytes <= semantics.ANALYSIS_CACHE_BYTES


def test_the_digest_cache_is_bounded_in_bytes_and_skips_what_is_too_big() -> None:
    cache: streamcheck.DigestCache[bytes] = streamcheck.DigestCache(max_bytes=10_000, cost=len)
    for i in range(100):
        cache.get(b"stream %d" % i, functools.partial(bytes, 1_000))
    assert cache.nbytes <= 10_000 and 0 < len(cache) < 100
    cache.get(b"big", functools.partial(bytes, 5_000))
    calls = []
    cache.get(b"big", lambda: calls.append(1) or bytes(5_000))  # type: ignore[func-returns-value]
    assert calls == [1]  # over a quarter of the bound: computed again, never kept
