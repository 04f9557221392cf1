"""Internal: the NumPy value rebuilds: the three functions a stream calls for a NumPy array, scalar or dtype.

Their paths (``zerocopy_pickle.safeglobals:rebuild_ndarray``, ``:rebuild_numpy_scalar``, ``:rebuild_numpy_dtype``)
are written into streams, so this module keeps its name and place: it is part of the format, like
:mod:`zerocopy_pickle.rebuild`. The same functions run in trusted and restricted loads (the safe set,
``zerocopy_pickle._trust.safe_set``, admits them as they are): each checks its arguments first.
"""

from __future__ import annotations

import functools
import math
import pickle
import types
from collections.abc import Mapping
from typing import Any

from .errors import UnsafeArgumentError
from .validate import charge, expect, expect_int_tuple, expect_str, fail

# Note [NumPy values]: ZeroCopyPickler reduces exact ``numpy.ndarray``s, NumPy scalars and dtypes of a numeric
# dtype to the three rebuilds below, so its streams never name NumPy's pickle machinery (``_reconstruct``,
# ``_frombuffer``, ``scalar``, ``dtype`` + BUILD, ``ndarray.__setstate__``). The same functions run in trusted
# and restricted loads and are in the safe set: numeric arrays are data, like tensors, and need no ``allow=``.
# A dtype comes from a fixed table keyed by its exact ``dtype.str`` (``"<f8"``, ``">i4"``, ``"|b1"``,
# ``"<M8[ns]"``), or for fixed-width strings (``"<U5"``, ``"|S5"``) made from a kind and a parsed width, never
# from ``numpy.dtype(<stream string>)``. Object, structured/void, long double and datetime64/timedelta64 with a
# multiplier (``"<M8[10s]"``) or generic unit are not accepted: the pickler leaves those to NumPy's own
# reduction, which only trusted=True loads.

_NUMPY_KINDS = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
_NUMPY_TIME_UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")
MAX_NUMPY_DTYPE_NAME = 12
"""Longest dtype name accepted (``"<m8[ms]"`` is 7 characters, ``"<U1048576"`` 10): longer names are refused
unread."""
_ONLY_TRUSTED_NUMPY = (
    "only NumPy's numeric dtypes (bool, int8..int64, uint8..uint64, float16/32/64, complex64/128, either byte "
    "order, datetime64/timedelta64 of one plain unit) and fixed-width str_/bytes_ load restricted; only "
    "trusted=True loads other dtypes (object, structured, long double)"
)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - torch's CPU wheels bring NumPy
        raise UnsafeArgumentError(f"the snapshot holds NumPy values, and NumPy is not installed here: {e}") from e
    return numpy


@functools.cache
def numpy_dtypes() -> Mapping[str, Any]:
    """The dtypes the NumPy rebuilds accept, by their exact ``dtype.str``."""
    np = _numpy()
    names = []
    for kind in _NUMPY_KINDS:
        names.extend(["|" + kind] if kind[1:] == "1" else ["<" + kind, ">" + kind])
    for unit in _NUMPY_TIME_UNITS:
        names.extend(f"{order}{kind}8[{unit}]" for kind in "Mm" for order in "<>")
    table = {}
    for name in names:
        dtype = np.dtype(name)
        assert dtype.str == name, (dtype.str, name)
        table[name] = dtype
    return types.MappingProxyType(table)


MAX_NUMPY_STRING_LENGTH = 1 << 20
"""Longest fixed-width NumPy string dtype (``"<U1048576"``, ``"|S1048576"``) the rebuilds accept."""


@functools.lru_cache(maxsize=256)
def _string_dtype(name: str) -> Any:
    """A fixed-width ``str_`` (``"<U5"``, ``">U5"``) or ``bytes_`` (``"|S5"``) dtype, or None: its width is parsed
    here as decimal digits and the dtype made from a kind and a validated int, never from the stream's string."""
    if name[:2] in ("<U", ">U", "|S"):
        digits = name[2:]
        if digits.isascii() and digits.isdigit() and digits[0] != "0" and len(digits) <= 7:
            width = int(digits)
            if width <= MAX_NUMPY_STRING_LENGTH:
                dtype = _numpy().dtype((_numpy().str_ if name[1] == "U" else _numpy().bytes_, width))
                return dtype.newbyteorder(name[0]) if name[1] == "U" else dtype
    return None


def _numpy_dtype(name: Any, where: str) -> Any:
    expect_str(name, where, "dtype", max_len=MAX_NUMPY_DTYPE_NAME)
    charge(len(name), where)
    dtype = numpy_dtypes().get(name)
    if dtype is None:
        dtype = _string_dtype(name)
    if dtype is None:
        fail(where, f"dtype {name!r} is not one a restricted load rebuilds: {_ONLY_TRUSTED_NUMPY}")
    return dtype


def numpy_dtype_known(dtype: Any) -> bool:
    """Whether the rebuilds accept ``dtype`` (a NumPy dtype): what the pickler reduces to them."""
    name = dtype.str
    if dtype.fields is not None or dtype.subdtype is not None or len(name) > MAX_NUMPY_DTYPE_NAME:
        return False
    return name in numpy_dtypes() or _string_dtype(name) == dtype


def rebuild_numpy_dtype(name: Any) -> Any:
    """A NumPy dtype by its exact ``dtype.str`` (``"<f8"``), from a fixed table (:data:`numpy_dtypes`).

    Raises:
        UnsafeArgumentError: ``name`` is not a str of the table (object, structured, string dtypes...).
    """
    return _numpy_dtype(name, "zerocopy_pickle.safeglobals:rebuild_numpy_dtype")


def rebuild_numpy_scalar(dtype: Any, data: Any) -> Any:
    """A NumPy scalar (``numpy.float64(0.91)``) of a table dtype from exactly ``itemsize`` bytes.

    Raises:
        UnsafeArgumentError: ``dtype`` is not in the table, ``data`` is not bytes of exactly its itemsize.
    """
    where = "zerocopy_pickle.safeglobals:rebuild_numpy_scalar"
    dt = _numpy_dtype(dtype, where)
    expect(data, bytes, where, "data")
    if len(data) != dt.itemsize:
        fail(where, f"data is {len(data)} bytes, but a {dtype} scalar is {dt.itemsize}")
    charge(len(data), where)
    return _numpy().frombuffer(data, dtype=dt)[0]


_NUMPY_BUFFERS = (memoryview, bytes, bytearray, pickle.PickleBuffer)


def rebuild_ndarray(buffer: Any, dtype: Any, shape: Any, order: Any) -> Any:
    """A NumPy array over ``buffer`` (out of band: a view of the snapshot's mapping, no copy).

    ``buffer`` must hold exactly ``prod(shape) * itemsize`` bytes, laid out in ``order`` (``"C"`` or ``"F"``):
    no view reads past its buffer, none is larger than it (no strides travel; a non-contiguous array is
    written as a C-ordered copy). The array is writable when the buffer is (a snapshot's mapping is private
    copy-on-write, as for tensors), read-only over ``bytes``.

    Raises:
        UnsafeArgumentError: a buffer of another type, not contiguous or of another size; a dtype not in the
            table; a shape that is not a tuple of at most MAX_DIMS ints in [0, 2**62]; an order not "C"/"F".
    """
    where = "zerocopy_pickle.safeglobals:rebuild_ndarray"
    dt = _numpy_dtype(dtype, where)
    size = expect_int_tuple(shape, where, "shape")
    charge(len(size) + 1, where)
    if type(order) is not str or order not in ("C", "F"):
        fail(where, f"order must be 'C' or 'F', not {order!r:.40}")
    expect(buffer, _NUMPY_BUFFERS, where, "buffer")
    try:
        view = memoryview(buffer).cast("B")
    except (TypeError, ValueError, BufferError) as e:
        fail(where, f"the buffer is not a contiguous byte buffer: {e}")
    numel = math.prod(size)
    if numel * dt.itemsize != view.nbytes:
        fail(
            where,
            f"shape {size} of {dtype} needs {numel * dt.itemsize} bytes, but the buffer holds {view.nbytes}",
        )
    np = _numpy()
    try:
        return np.ndarray(size, dtype=dt, buffer=view, order=order)
    except (ValueError, TypeError) as e:
        fail(where, f"numpy refused the array: {e}")
