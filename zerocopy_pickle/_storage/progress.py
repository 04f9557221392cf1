"""Internal: progress bars for long copies (dumps, conversions, cache fills, downloads), on a terminal only.

:func:`bar` decides once per operation whether a bar is worth showing: only when ``sys.stderr`` is a terminal,
the operation moves at least :data:`THRESHOLD` bytes (``$ZEROCOPY_PICKLE_PROGRESS_MIN``), and
``$ZEROCOPY_PICKLE_PROGRESS`` is not ``0``. Then it yields a tqdm bar's ``update`` (tqdm is imported only then);
otherwise it yields ``None``, and the writers it is passed to (:func:`zerocopy_pickle._storage.writes.write_placed` and
friends take ``progress=``) skip even the call: a dump without a bar runs exactly the code it ran before bars
existed. Writers report per window or write call (a MiB or more), never per byte.

A bar goes to stderr and nowhere else, so a pipeline's stdout and a log file (stderr redirected: not a
terminal) never see one; a forked filing child of the cache has its stderr in ``fill.log`` and shows none.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from ..errors import ArgumentError

ENV = "ZEROCOPY_PICKLE_PROGRESS"
"""``0`` (or ``off``): never show a bar. Unset, empty or ``auto``: show one on a terminal above the threshold."""

MIN_ENV = "ZEROCOPY_PICKLE_PROGRESS_MIN"
"""The threshold, as a size: ``64M``, ``1G``, ``1000000`` (binary units; default :data:`THRESHOLD`)."""

THRESHOLD = 256 << 20
"""Operations that move fewer bytes show no bar: at several GB/s they are over before a bar could be read."""

Report = Callable[[int], object]
"""What :func:`bar` yields when it shows a bar: call it with the bytes just moved."""

_MODES = {"": True, "auto": True, "0": False, "off": False}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _enabled() -> bool:
    value = os.environ.get(ENV, "")
    try:
        return _MODES[value.strip().lower()]
    except KeyError:
        raise ArgumentError(
            f"{ENV}={value!r}: expected 0 or off (no progress bars), or unset / auto (a bar on a terminal for "
            f"operations of at least {MIN_ENV} bytes)"
        ) from None


def _threshold() -> int:
    value = os.environ.get(MIN_ENV)
    if value is None or not value.strip():
        return THRESHOLD
    number = value.strip().lower().removesuffix("ib").removesuffix("b")
    unit = number[-1] if number and number[-1] in _UNITS else ""
    try:
        nbytes = int(float(number[: len(number) - len(unit)]) * _UNITS[unit])
    except (ValueError, OverflowError):
        nbytes = -1
    if nbytes < 0:
        raise ArgumentError(f"{MIN_ENV}={value!r}: expected a size like 64M, 1G or 1000000")
    return nbytes


def _on_terminal() -> bool:
    stream = sys.stderr  # None under pythonw; a replacement object may lack isatty or have a closed file
    try:
        return stream is not None and bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def bar(nbytes: int, desc: str) -> Iterator[Report | None]:
    """A progress bar for an operation that moves ``nbytes`` bytes, or ``None`` where none is shown.

    Args:
        nbytes: the bytes the operation will report in total.
        desc: what the bar says it is doing (``"dump model.zcp"``).

    Yields:
        The bar's ``update(nbytes)``, to call after each window or write; ``None`` where no bar is shown (not a
        terminal, below the threshold, turned off, or tqdm missing).

    Raises:
        ArgumentError: ``$ZEROCOPY_PICKLE_PROGRESS`` or ``$ZEROCOPY_PICKLE_PROGRESS_MIN`` is malformed.
    """
    # The environment is read first, so a malformed value fails the same way on a terminal and off it.
    if not _enabled() or nbytes < _threshold() or not _on_terminal():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency, but a missing bar must never fail the copy it would have shown
        yield None
        return
    # A terminal of unknown size (a pseudo-terminal nobody sized reports 0x0: `docker exec -t`, some CI runners)
    # gets no bar at all from tqdm, which hides bars below the screen's last row: tell it 80x24. A sized one is
    # followed as it is resized.
    sized = min(_size()) > 0
    with tqdm(
        total=nbytes,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        dynamic_ncols=sized,
        ncols=None if sized else 80,
        nrows=None if sized else 24,
    ) as shown:
        yield shown.update


def _size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, ValueError, OSError):  # no fd behind sys.stderr (a stand-in object), or not a tty
        return (0, 0)
    return size.columns, size.lines
