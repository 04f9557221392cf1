"""Internal: a dump before it is written: the object graph pickled with the chosen backend (falling back from the
C pickler to dill under ``backend="auto"``), laid out as a snapshot (:class:`Prepared`), and, when pickling
fails, the diagnosis: which object of the graph fails and where (:mod:`.locate`, walking the graph with the
pickler's own :meth:`~zerocopy_pickle._core.pickler.ZeroCopyPickler.reduction`, so the path it names is the one
pickle took), and when a snapshot only ``trusted=True`` will load, the warning that says which objects make it so.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import pickle
import platform
import warnings
from collections.abc import Callable
from typing import IO, Any

import torch

from .._registry.preparation import check_offloaded, dump_reductions, refuse_offloaded_modules
from .._registry.registry import Registry
from .._storage import format, integrity, progress, writes
from .._trust.restricted import scan_stream
from .._version import __version__
from ..errors import ArgumentError, DumpError, TrustedOnlyWarning, Unpicklable
from . import locate
from .pickler import ZeroCopyPickler, dill_pickler

BACKENDS = ("auto", "pickle", "cloudpickle", "dill")
_PICKLE_ERRORS = (
    pickle.PicklingError,
    TypeError,
    AttributeError,
    ValueError,
    BufferError,
    RuntimeError,
    RecursionError,
)
# RuntimeError: torch's C reducers refuse some objects that way; RecursionError: graphs nested too deeply.


def _refused_by_pickle(error: BaseException) -> bool:
    """Whether ``error`` is pickle (or a backend, or a builtin type's C reducer) refusing an object, rather than code of
    the object graph failing: a ``__reduce__``, ``__reduce_ex__``, ``__getstate__`` or a registered reducer that
    raised. Only the first becomes a :class:`DumpError`; the second reaches the caller as itself, as it does
    from ``pickle.dumps`` (``except ValueError`` keeps matching).

    Told apart by where it was raised: pickle's refusals (``PicklingError``, ``cannot pickle 'X' object``,
    ``Can't pickle local object``) are raised in C (the pickler, or a builtin type's ``__reduce_ex__``) or by
    pickle, copyreg, the backends or this library; an error whose traceback passes through any other module's code
    (the object's own ``__getstate__``, a registered reducer, the standard library's and torch's reducers alike)
    came from the graph's code, and pickle would let it propagate.
    """
    if isinstance(error, (pickle.PicklingError, RecursionError)):
        return True
    if not isinstance(error, _PICKLE_ERRORS):
        return False
    if isinstance(error, TypeError) and str(error).startswith("cannot pickle"):  # object.__reduce_ex__'s refusal
        return True
    tb = error.__traceback__
    while tb is not None:
        if not _is_machinery(tb.tb_frame.f_globals.get("__name__")):
            return False
        tb = tb.tb_next
    return True


_MACHINERY = frozenset({"pickle", "_pickle", "copyreg", "_compat_pickle", "cloudpickle", "dill", "zerocopy_pickle"})


def _is_machinery(module: object) -> bool:
    return isinstance(module, str) and module.partition(".")[0] in _MACHINERY


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _make_pickler(
    backend: str,
    file: IO[bytes],
    callback: Callable[[pickle.PickleBuffer], Any],
    registry: Registry | None = None,
    offloaded: str = "copy",
) -> Any:
    if backend == "dill":
        pickler: Any = dill_pickler(file, buffer_callback=callback, registry=registry)
    else:
        by_value = backend == "cloudpickle" or (backend == "auto" and _importable("cloudpickle"))
        pickler = ZeroCopyPickler(file, buffer_callback=callback, by_value=by_value, registry=registry)
    # accelerate's offloaded weights, copied in or refused (the table is the one the pickler read at __init__).
    pickler.dispatch_table.update(dump_reductions(offloaded))
    return pickler


class Prepared:
    """A pickled object graph, laid out and ready to write: the pieces reference the storages' memory."""

    __slots__ = ("_encode", "_pending", "backend", "body", "by_value", "layout", "offloaded", "pieces", "views")

    def __init__(
        self,
        obj: object,
        backend: str,
        checksums: bool,
        key: bytes | str | None,
        registry: Registry | None = None,
        *,
        for_file: bool = False,
        offloaded: str = "copy",
    ) -> None:
        if backend not in BACKENDS:
            raise ArgumentError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")
        self.offloaded = offloaded
        if check_offloaded(offloaded) == "refuse":
            refuse_offloaded_modules(obj)  # names the submodule (model.layers.3.mlp) before anything is pickled
        # auto: the C pickler (with cloudpickle's by-value reductions for functions and classes that need
        # them, object by object); if that fails, the whole graph again with dill.
        attempts = [backend] if backend != "auto" else ["auto", *(["dill"] if _importable("dill") else [])]
        first_error: BaseException | None = None
        for attempt in attempts:
            stream = io.BytesIO()
            views: list[memoryview] = []

            def collect(buffer: pickle.PickleBuffer, views: list[memoryview] = views) -> bool:
                views.append(buffer.raw())
                return False  # out of band

            pickler = _make_pickler(attempt, stream, collect, registry, offloaded)
            try:
                pickler.dump(obj)
            except Unpicklable as e:  # a reducer refused for good: no other backend is worth a try
                raise _dump_error(obj, attempt, e, registry, offloaded) from e
            except Exception as e:
                if not _refused_by_pickle(e):  # the graph's own code failed: the caller gets its exception
                    _note_path(obj, attempt, e, registry, offloaded)
                    raise
                first_error = first_error or e
                continue
            finally:
                pickler.clear_memo()  # release what the memo holds now, not whenever a cycle is collected
            self.backend = attempt
            self.by_value: tuple[list[object], int] | None = None if attempt == "dill" else pickler.pickled_by_value
            break
        else:
            assert first_error is not None
            raise _dump_error(obj, backend, first_error, registry, offloaded) from first_error
        body = stream.getbuffer()
        stream_sum = integrity.checksum(body) if checksums or key is not None else None
        signer = None if key is None else functools.partial(integrity.sign, key, stream=body)
        producer = {
            "zerocopy_pickle": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "backend": "dill" if attempt == "dill" else "pickle" + ("+cloudpickle" if pickler._by_value else ""),
        }

        def encode(buffer_sums: tuple[str, ...]) -> format.Layout:
            sums = None if stream_sum is None else format.Checksums(format.CHECKSUM_ALGORITHM, stream_sum, buffer_sums)
            specs, plugins = pickler.buffer_specs, pickler.plugins_used
            return format.encode(body.nbytes, specs, plugins=plugins, checksums=sums, sign=signer, producer=producer)

        self._encode, self.body, self.views = encode, body, views
        # for_file: the buffers' checksums are computed as they are written (write_file); until then, stand-ins.
        self._pending = pending = for_file and stream_sum is not None
        self.layout = encode((integrity.PENDING,) * len(views) if pending else tuple(map(integrity.checksum, views)))
        if for_file:
            self.pieces = []
            return
        layout = self.layout
        pieces: list[writes.Piece] = [layout.prefix, body]
        pieces += format.padded_pieces(
            views,
            [layout.data_offset + offset for offset in layout.buffer_offsets],
            cursor=layout.stream_offset + body.nbytes,
            end=layout.total_nbytes,
        )
        self.pieces = pieces

    def write_file(self, fd: int, desc: str) -> None:
        """Write the snapshot into an empty regular file (made with ``for_file=True``): its final size first,
        then the buffers, checksummed on the way (one pass over their memory), then the header that records
        those checksums, and the stream. Gaps are left to read as zeros. A progress bar (``desc``) counts every
        byte but the gaps', where :func:`progress.bar` shows one."""
        layout = self.layout
        writes.preallocate(fd, layout.total_nbytes)
        offsets = [layout.data_offset + offset for offset in layout.buffer_offsets]
        placed = list(zip(offsets, self.views, strict=True))
        nbytes = len(layout.prefix) + self.body.nbytes + sum(view.nbytes for view in self.views)
        with progress.bar(nbytes, desc) as report:
            if not self._pending:  # no checksums to record
                integrity.write_buffers(fd, placed, progress=report)
            else:
                layout = self._encode(integrity.write_checksummed(fd, placed, progress=report))
                if (layout.data_offset, layout.buffer_offsets) != (
                    self.layout.data_offset,
                    self.layout.buffer_offsets,
                ):
                    raise AssertionError("the header changed length once its checksums were filled in")
            writes.write_placed(fd, [(0, layout.prefix), (layout.stream_offset, self.body)], progress=report)


def _note_path(
    obj: object, backend: str, error: BaseException, registry: Registry | None, offloaded: str = "copy"
) -> None:
    """Add where in the graph ``error`` was raised to its notes (Python 3.11+), when it can be found."""
    add_note = getattr(error, "add_note", None)
    if add_note is None or isinstance(error, MemoryError):  # no second pass over the graph without memory
        return

    def try_dump(candidate: object) -> BaseException | None:
        try:
            _make_pickler(backend, io.BytesIO(), _discard, registry, offloaded).dump(candidate)
        except Exception as e:
            return e
        return None

    try:
        failure = locate.locate_failure(obj, try_dump, reduce=_reduction(backend, registry, offloaded))
    except Exception:  # the search itself failed: the error stands without a path
        return
    if failure is not None:
        what = getattr(failure.obj, "__qualname__", None) or type(failure.obj).__qualname__
        add_note(f"(raised by zerocopy_pickle.dump while pickling {what} at {failure.path})")


def _discard(buffer: pickle.PickleBuffer) -> bool:
    return False


def _reduction(backend: str, registry: Registry | None, offloaded: str) -> Callable[[Any], Any]:
    """How the dump's pickler reduces an object: the reduction of a pickler of the same configuration."""
    reduction: Callable[[Any], Any] = _make_pickler(backend, io.BytesIO(), _discard, registry, offloaded).reduction
    return reduction


def _dump_error(
    obj: object, backend: str, error: BaseException, registry: Registry | None = None, offloaded: str = "copy"
) -> DumpError:
    """A DumpError that names the object that cannot be pickled, its path in the graph, and what to do."""
    if isinstance(error, RecursionError):
        return DumpError(
            f"cannot pickle {type(obj).__name__}: the object graph is nested too deeply for pickle (deep recursion: "
            f"{error}); raise sys.setrecursionlimit or flatten the structure"
        )
    pickler_backend = backend

    def try_dump(candidate: object) -> BaseException | None:
        try:
            _make_pickler(pickler_backend, io.BytesIO(), _discard, registry, offloaded).dump(candidate)
        except _PICKLE_ERRORS as e:
            return e
        return None

    failure = locate.locate_failure(obj, try_dump, reduce=_reduction(backend, registry, offloaded))
    if failure is None:  # pickles piecewise but not as a whole: report the whole
        return DumpError(f"cannot pickle {type(obj).__name__} (backend {backend!r}): {error}", path="obj")
    culprit = failure.obj
    what = getattr(culprit, "__qualname__", None) or type(culprit).__qualname__
    if isinstance(failure.error, Unpicklable):
        return DumpError(f"cannot pickle {what} at {failure.path}: {failure.error}", path=failure.path)
    if callable(culprit) and backend == "pickle":
        hint = "pass backend='auto' (or 'cloudpickle') to pickle functions and classes by value"
    elif backend == "auto":
        tried = "pickle and cloudpickle" + (", then dill" if _importable("dill") else " (dill is not installed)")
        hint = (
            f"no backend could pickle it ({tried}); drop it from the object, or register a reducer for "
            f"{type(culprit).__module__}:{type(culprit).__qualname__} with zerocopy_pickle.register_reducer"
        )
    else:
        hint = "try backend='auto', or register a reducer for its type with zerocopy_pickle.register_reducer"
    return DumpError(
        f"cannot pickle {what} at {failure.path} (backend {backend!r}): {failure.error}. {hint}",
        path=failure.path,
    )


def warn_if_trusted_only(obj: object, prepared: Prepared, registry: Registry | None) -> None:
    """Warn (:class:`TrustedOnlyWarning`, once per dump) when only a trusted load can load what was just
    pickled, naming where each object pickled by value sits in the graph and what would make the snapshot
    restricted-loadable. :func:`freeze` does not warn: its snapshots load trusted."""
    if prepared.by_value is None:  # dill: what it pickled by value shows only in the stream
        if any(module.partition(".")[0] == "dill" for module, _ in scan_stream(prepared.body)):
            warnings.warn(
                "this snapshot was pickled with the dill backend, and its stream calls dill's own functions (code "
                "or objects pickled by value): only zerocopy_pickle.load(..., trusted=True) loads it; dump with the "
                "default backend to find out which objects need it",
                TrustedOnlyWarning,
                stacklevel=3,
            )
        return
    objects, count = prepared.by_value
    if not count:
        return
    from .._console import printable  # here, not at import: importing the library imports no console code

    paths = locate.paths_to(obj, objects, reduce=_reduction(prepared.backend, registry, prepared.offloaded))
    shown = "; ".join(
        f"{printable(paths.get(id(o), 'somewhere in the graph'))} = {_describe_by_value(o)}" for o in objects
    )
    more = f" (and {count - len(objects)} more)" if count > len(objects) else ""
    warnings.warn(
        f"this snapshot holds {count} function(s) or class(es) pickled by value: {shown}{more}. A restricted load "
        f"refuses them (loading them runs their code): only zerocopy_pickle.load(..., trusted=True) loads this "
        f"snapshot. To make it restricted-loadable, define them at module level (importable by name) or remove "
        f"them before dumping (hooks: the module's _forward_hooks / _forward_pre_hooks)",
        TrustedOnlyWarning,
        stacklevel=3,
    )


def _describe_by_value(obj: object) -> str:
    kind = "class" if isinstance(obj, type) else "function"
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
    from .._console import printable

    return f"{kind} {printable(name)[:120]}"
