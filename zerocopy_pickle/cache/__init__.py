"""The model cache: after the first call, ``from_pretrained`` (and ``torch.load``, ``load_file``) of any process
of this user gets the model from shared memory in milliseconds.

    from zerocopy_pickle import cache
    cache.patch_all()          # before or after importing diffusers / transformers
    pipe = StableDiffusionControlNetPipeline.from_pretrained(path, vae=vae, controlnet=[a, b])

A server (``zerocopy-pickle serve``, or started on demand) holds each result as segments in sealed memfds;
clients receive them over a private Unix socket and load them copy-on-write, zero-copy. On a miss (or before
any server runs: ``patch_all()`` starts one in the background) the caller loads the call itself, exactly as
without the cache, and hands the result to the server afterwards, from a forked child. Keys fingerprint local
files, so a changed checkpoint is a miss; cached objects passed as arguments travel as references. A hit is
faster than the plain call, a miss costs more than it (the key, a round trip, a fork and the page faults that
follow it: 10-30 ms in a process that imported transformers), and the cache never makes a load fail. See
``docs/cache.md``.

This namespace is the cache's public API; its submodules are internal. Packages declare more patch points
through the entry-point group ``zerocopy_pickle.cache_patch_points`` (``docs/cache.md``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .protocol import CacheError, runtime_dir, socket_path

if TYPE_CHECKING:
    from .filing import CacheWarning
    from .keys import cached_key
    from .patch import patch_all, patched_points, unpatch_all
    from .points import DEFAULT_PATCH_POINTS
    from .transport import Client, start_server_in_background

# The client side imports torch; the server must not (it would cost it a second and hundreds of MiB): PEP 562.
_LAZY = {
    "CacheWarning": "filing",
    "cached_key": "keys",
    **dict.fromkeys(("Client", "start_server_in_background"), "transport"),
    "DEFAULT_PATCH_POINTS": "points",
    **dict.fromkeys(("patch_all", "patched_points", "unpatch_all"), "patch"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zerocopy_pickle.cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_PATCH_POINTS",
    "CacheError",
    "CacheWarning",
    "Client",
    "cached_key",
    "clear",
    "patch_all",
    "patched_points",
    "runtime_dir",
    "serve",
    "socket_path",
    "start_server_in_background",
    "status",
    "stop",
    "unpatch_all",
]


def _flush() -> None:
    """Wait until the results this process loaded itself reached the server (see ``filing._Filer``)."""
    import sys

    filing = sys.modules.get(f"{__name__}.filing")
    if filing is not None:
        filing._filer.drain()


def status() -> dict[str, Any]:
    """The running server's entries, sizes, hits and misses (after this process's own results reached it).

    Raises:
        CacheError: no server is running.

    Examples:
        ```python
        from zerocopy_pickle import cache

        info = cache.status()  # what `zerocopy-pickle status --json` prints
        ```
    """
    from .messages import StatusReply, StatusRequest
    from .transport import Client

    _flush()
    with Client() as client:
        reply, _, _ = client.request(StatusRequest())
    return StatusReply.decode(reply).status


def clear() -> int:
    """Drop every entry of the running server; return how many there were."""
    from .messages import Clear, Cleared
    from .transport import Client

    _flush()
    with Client() as client:
        reply, _, _ = client.request(Clear())
    return Cleared.decode(reply).cleared


def stop() -> None:
    """Stop the running server."""
    from .messages import Stop
    from .transport import Client

    with Client() as client:
        client.request(Stop())


def serve(**kwargs: Any) -> None:
    """Run a server in this process until stopped (see :func:`zerocopy_pickle.cache.server.serve`)."""
    from .server import serve as run

    run(**kwargs)
