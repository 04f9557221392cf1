"""Internal: the client side of the cache, the routing of a patched call: a hit loaded from the server's entry, a
miss loaded here and filed (:mod:`filing`) or handed to the server's loader, and the fallback to a direct load.
A call's key and request are :mod:`keys`', the connection to the server :mod:`transport`'s.

A hit is loaded from the server's segments, faster than the plain call; a miss costs the caller the key, one
round trip and a fork on top of the plain call (docs/cache.md, "What a miss costs"); the cache never makes a load
fail. On a miss, and when no server runs yet (``patch_all()`` then starts one in the background without
waiting for it), the caller loads the call itself, exactly as the plain call would, and gets the result at once;
what it loaded is captured into an entry right away (pickled, its untouched checkpoint views referenced, any other
storage copied into a sealed memfd: ``entries.capture``) and sent to the server (a ``put``) by a forked child, or,
where CUDA is initialized, captured in the calling thread and sent by a background thread (:mod:`filing`), so
the next process gets a hit. If the server is dead, slow or broken, or a call cannot be keyed,
:func:`cached_call` calls the original loader directly and warns once per cause.

``ZEROCOPY_PICKLE_CACHE_FILL=background`` has the server's loader load a miss for the next process, at the lowest
CPU priority, while the caller loads it plain and files nothing (no fork: :func:`fill_mode`,
:func:`_fill_in_new_server`); ``=server`` makes misses load in the server's loader instead (the caller waits for it;
the result then never holds the caller's own storages).
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._storage import arena, readahead
from . import checkpoints, entries
from .fields import FileCheck
from .filing import (
    _UNCAPTURABLE,
    _filer,
    _fork_is_safe,
    _is_uncapturable,
    _report_uncapturable,
    _uncapturable_reason,
    _warn_once,
    _warn_uncapturable,
)
from .keys import Request, Uncacheable, describe, register_result
from .messages import EntryReply, Miss
from .protocol import CacheError, send
from .transport import HIT_TIMEOUT, Client, _claim_spawn, _spawn_server, _timeout, start_server_in_background

PREFAULT_ENV = "ZEROCOPY_PICKLE_CACHE_PREFAULT"
INLINE_PREFAULT_BYTES = 16 << 20  # a hit this small populates its pages in the caller (see _Prefaulter)
FILL_ENV = "ZEROCOPY_PICKLE_CACHE_FILL"
MISS_PREFETCH_ENV = "ZEROCOPY_PICKLE_CACHE_MISS_PREFETCH"
"""=1: a miss prefetches the checkpoint files its call will likely read. Off by default: on the development VM a
cold miss of the seed scenario took 1.39x the plain cold call with it (files one after another; 1.60x all at
once), and about 1.1x without it (docs/benchmark.md, "Cold starts")."""

log = logging.getLogger(__name__)


class _Prefaulter:
    """Maps the pages of each entry a hit received into this process's page tables, on a background thread.

    A zero-copy load defers page faults to first use: a forward pass over an SD1.5 pipeline takes about
    900,000 of them. Populating the page tables (``MADV_POPULATE_READ``, no copy: writes still copy on write)
    while the caller unpickles and goes on overlaps that work with the caller's, on another core. One worker
    thread, segments in the order the hits came; ``ZEROCOPY_PICKLE_CACHE_PREFAULT=0`` turns it off.

    A hit of at most :data:`INLINE_PREFAULT_BYTES` is populated in the caller's thread instead (50-100 us per MiB
    on the development VM): on a busy machine the worker thread waited for a core while the caller faulted the
    same pages itself (the small models' touch beside a busy neighbour: 2.83x Overmind's before, 1.20x after).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._supported = True

    def submit(self, mappings: Iterable[Any]) -> None:
        if not self._supported or os.environ.get(PREFAULT_ENV, "1") == "0":
            return
        mappings = list(mappings)
        if sum(len(memory) for memory in mappings) <= INLINE_PREFAULT_BYTES:
            for memory in mappings:
                if not arena.prefault(memory):
                    self._supported = False
                    return
            return
        for memory in mappings:
            self._queue.put(memory)
        with self._lock:
            if not self._started:  # a thread of its own, never joined; started without waiting for it to run
                self._started = True  # (threading.Thread.start waits: milliseconds of a hit on a busy machine)
                _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        while True:
            memory = self._queue.get()
            if self._supported and not arena.prefault(memory):
                self._supported = False  # an older kernel: faults stay where they fall
            del memory


_prefaulter = _Prefaulter()

_state = threading.local()


_NO_SERVER = Miss(True)
"""What :func:`_fetch` answers when no server runs and the caller is to start one once its call has returned."""


def fill_mode() -> str:
    """How misses are filled (:data:`FILL_ENV`): ``caller`` (the default: the caller's result is filed by a
    forked child), ``background`` (the server's loader loads the call itself for the next process, at the lowest
    CPU priority, and the caller files nothing) or ``server`` (the server's loader loads it and the caller
    waits). Anything else means the default."""
    mode = os.environ.get(FILL_ENV, "").strip().lower()
    return mode if mode in ("background", "server") else "caller"


SPAWN_DELAY = 1.0
"""Seconds after its first miss with no server running that a process filling in the background starts one
(or at its exit, if sooner). A server's start costs 0.1-0.2 s of CPU, which beside a busy neighbour comes out of
the caller's loads: a program that loads for longer than 2 s pays at most a tenth, one that is done sooner
nothing."""

_spawner: list[socket.socket] = []
"""This process's end of the socket to the server it started for background fills, until a server answers."""
_handover: list[tuple[dict[str, Any], bytes]] = []
"""The misses to be handed to the server this process is about to start (:func:`_fill_in_new_server`)."""
_handover_lock = threading.Lock()


def _fill_in_new_server(request: Request) -> None:
    """No server answered a miss to be filled in the background: hand it to the server this process starts
    :data:`SPAWN_DELAY` seconds after its first such miss, or at its exit (:func:`_hand_over`), over a socket the
    server serves as its first connection, so that the caller waits for nothing and the server's start does not
    compete with the loads that follow. Never raises: without a server, only the cache goes without."""
    get = dataclasses.replace(request.get, fill=True, background=True)
    with _handover_lock:
        _handover.append((get.encode(), request.payload))
        first = len(_handover) == 1 and not _spawner
    if first:
        with contextlib.suppress(RuntimeError):  # no thread at interpreter shutdown: the exit hands them over
            _thread.start_new_thread(_hand_over_later, ())
    elif _spawner:
        _hand_over()


def _hand_over_later() -> None:
    time.sleep(SPAWN_DELAY)
    _hand_over()


def _hand_over() -> None:
    """Start the server (once) and send it the misses waiting to be handed over."""
    with _handover_lock:
        if not _handover:
            return
        try:
            if not _spawner:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    _spawn_server(reap=True, spawner=theirs)
                except BaseException:
                    ours.close()
                    raise
                finally:
                    theirs.close()
                ours.settimeout(1.0)
                _spawner.append(ours)
            while _handover:  # the server answers each with a Miss, never read: the socket is closed unread
                header, payload = _handover.pop(0)
                send(_spawner[0], header, payload)
        except Exception as e:
            _handover.clear()
            _close_spawner()
            log.info("could not hand misses to a new cache server (%s)", e)


def _close_spawner() -> None:
    while _spawner:
        with contextlib.suppress(OSError):
            _spawner.pop().close()


atexit.register(_close_spawner)  # closed, not collected open (which warns ResourceWarning)
atexit.register(_hand_over)  # before the socket is closed (atexit runs the last registered first)


def cached_call(
    point: str,
    cls: type | None,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    autostart: bool = False,
) -> Any:
    """Serve ``original(*args, **kwargs)`` (called as ``cls.<method>`` when ``cls`` is given) from the cache.

    Calls made while another cached call is running in this thread (a pipeline's own component loads, or a
    direct load after a fallback) go straight to ``original``.
    """
    if getattr(_state, "depth", 0) or os.environ.get("ZEROCOPY_PICKLE_CACHE_LOADER"):
        return original(*args, **kwargs)
    _state.depth = 1
    try:
        _filer.report()  # what earlier filings found they could not capture
        try:
            request = describe(point, cls, args, kwargs)
        except Uncacheable as e:
            _warn_once(f"uncacheable:{point}", str(e))
            return original(*args, **kwargs)
        mode = fill_mode()
        if request.key in _UNCAPTURABLE:  # said once already; nothing to capture, nothing to ask
            return original(*args, **request.kwargs)
        try:
            result = _fetch(request, args, kwargs, autostart=autostart, fill=mode != "server",
                            background=mode == "background")  # fmt: skip
        except CacheError as e:
            _warn_once(f"error:{type(e).__name__}", str(e))
            return original(*args, **kwargs)
        if isinstance(result, Miss) and result.uncacheable is not None:  # a process found it cannot be captured
            _warn_uncapturable(request.get, result.uncacheable)
            return original(*args, **request.kwargs)
        if isinstance(result, Miss):  # load it here, as without the cache; the server gets it afterwards
            log.info("cache miss: %s (loading it here, then filing it)", request.get.describe)
            # With MISS_PREFETCH_ENV, the checkpoints the call will read come in from the disk while the library
            # imports and builds its modules (measured slower than without on the development VM: off by default).
            reading = checkpoints.start(_checkpoints_of(request))
            try:
                value = original(*args, **request.kwargs)
            finally:
                checkpoints.stop(reading)
            if result.filling:  # the server loads the call itself, for the next process: nothing to file here
                register_result(value, request.key)
            elif result is _NO_SERVER and mode == "background":
                _fill_in_new_server(request)
                register_result(value, request.key)
            else:
                _file(request, value, args, kwargs, files=result.files, start=result is _NO_SERVER)
            return value
        log.info("cache hit: %s", request.get.describe)
        register_result(result, request.key)
        return result
    finally:
        _state.depth = 0


def _prefetch_file(fd: int) -> None:
    """Read a hit's checkpoint file into the page cache in the background where it is not there (memfds are
    memory, and files already cached are left alone: :func:`readahead.start` checks)."""
    with contextlib.suppress(OSError):
        readahead.start_file(fd, name=f"a cache entry's file (fd {fd})")


def _checkpoints_of(request: Request) -> list[str]:
    """The checkpoint files among those the request's key was computed from that the call will likely read, when
    :data:`MISS_PREFETCH_ENV` asks for their prefetch."""
    if os.environ.get(MISS_PREFETCH_ENV, "").strip().lower() not in ("1", "on", "true", "yes"):
        return []
    variant = request.kwargs.get("variant")
    checks: list[FileCheck] = request.get.files
    sizes = ((c.path, c.identity.size) for c in checks)
    return checkpoints.likely_read(sizes, variant if isinstance(variant, str) else None)


def _file(
    request: Request,
    value: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    files: bool,
    start: bool = False,
) -> None:
    """File what the caller just loaded as the call's entry, as it is now (changes the caller makes to it later
    stay out of the entry), without making the caller wait (see :class:`filing._Filer`). ``start``: no server answered
    the call; one is started now (by the filing child where it forks), after the load, which a starting server
    (a Python importing the package, on another core or on this one) would have slowed."""
    refs = request.ref_objects + entries.argument_slots(args, kwargs)
    start = start and _claim_spawn()
    fork = _fork_is_safe()
    if start and not fork:
        start = False
        with contextlib.suppress(Exception):
            _spawn_server(reap=True)
    try:
        _filer.file(request, value, refs, files=files, fork=fork, start=start)
    except Exception as e:  # the caller has its result; only the cache goes without
        if not _is_uncapturable(e):
            _warn_once(f"capture:{type(e).__name__}", f"a result cannot be cached ({type(e).__name__}: {e})", "")
            return
        reason = _uncapturable_reason(value, refs, e)
        _warn_uncapturable(request.get, reason)
        _report_uncapturable(request.get, reason)  # one round trip (rare: where a result cannot be captured)
        return
    register_result(value, request.key)


def _fetch(
    request: Request,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    autostart: bool,
    fill: bool = False,
    background: bool = False,
) -> Any:
    """The cached result of the call; with ``fill``, a :class:`Miss` when the caller is to load it (the server
    missed, or none runs yet and one was started); with ``background`` too, the server fills the miss itself."""
    try:
        client = Client()
    except CacheError:
        if not autostart:
            raise
        if fill:  # started after the call returns (see _file): a server's start would compete with the load
            return _NO_SERVER
        start_server_in_background()
        client = Client()
    _close_spawner()  # a server answers: what it started with is no longer needed
    get = dataclasses.replace(request.get, fill=fill, background=fill and background)
    with client:
        header, stream, fds = client.request(
            get, request.payload, timeout=min(_timeout(), HIT_TIMEOUT) if fill else _timeout()
        )
    if header.get("miss"):
        for fd in fds:
            os.close(fd)
        return Miss.decode(header)
    try:
        reply = EntryReply.decode(header, len(fds))
        mappings = entries.map_segments(reply.segments, fds)
        if readahead.switch() != "off":  # ZEROCOPY_PICKLE_PREFETCH=0: as for loads
            for fd in fds:  # checkpoint files no longer in the page cache come in from parallel streams
                _prefetch_file(fd)
    finally:
        for fd in fds:
            os.close(fd)
    _prefaulter.submit(mappings.values())
    refs = request.ref_objects + entries.argument_slots(args, kwargs)
    try:
        return entries.load_entry(stream, reply.buffers, mappings, refs, reply.plugins)
    except CacheError:
        raise
    except Exception as e:
        raise CacheError(f"the cached entry does not load here ({type(e).__name__}: {e})") from e
