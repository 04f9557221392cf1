"""The order a parallel run hands tests out in (``tests/conftest.py``): every pytest-xdist worker starts on its
share of the slow tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import _dealt


class _Item:
    def __init__(self, name: str, slow: bool) -> None:
        self.name, self._slow = name, slow

    def get_closest_marker(self, name: str) -> Any:
        return object() if name == "slow" and self._slow else None


def _worksteal_shares(items: list[Any], workers: int) -> list[list[Any]]:
    """The contiguous shares ``--dist worksteal`` first sends its workers (xdist's check_schedule)."""
    shares, pending = [], list(items)
    for worker in range(workers):
        take = len(pending) // (workers - worker)
        shares.append(pending[:take])
        del pending[:take]
    return shares


@pytest.mark.parametrize(
    ("tests", "slow_every", "workers"), [(2557, 8, 4), (100, 3, 4), (10, 1, 3), (7, 2, 1), (9, 1, 4), (5, 100, 4)]
)
def test_every_worker_starts_with_its_share_of_the_slow_tests(tests: int, slow_every: int, workers: int) -> None:
    items = [_Item(f"t{i}", i % slow_every == 0) for i in range(tests)]
    dealt = _dealt(items, workers)  # type: ignore[arg-type]
    assert sorted(i.name for i in dealt) == sorted(i.name for i in items)  # nothing lost, nothing twice
    shares = _worksteal_shares(dealt, workers)
    slow = [len([i for i in share if i._slow]) for share in shares]
    for share, count in zip(shares, slow, strict=True):
        assert count >= max(slow) - 1 or count == len(share)  # dealt evenly, but for a share full of them
        assert all(i._slow for i in share[:count])  # its slow tests first
    # the short tests keep the files' order too
    assert [i for i in dealt if not i._slow] == [i for i in items if not i._slow]
