"""Internal: where the server and the loader look for modules and files: never in the directory they were started from.

Python puts the directory it was started from first on ``sys.path`` (the working directory for ``python -m``,
the script's directory, ``''`` for ``-c``), ahead of the standard library and site-packages. A server started
on demand by the first client inherits that client's working directory; its loader then serves every project
of the user, so a ``diffusers.py`` (or ``json.py``) lying in that folder would run inside it for everyone. So:

* the server and the zygote are started with their working directory set to the private runtime directory
  (what Python puts first is then a directory only this user can write to);
* they remove from ``sys.path`` the entry Python put first and every relative entry before importing anything
  model-related (:func:`clean_sys_path`; explicit ``PYTHONPATH`` entries stay);
* the working directory the server was started for (the first client's) travels in :data:`WORKDIR_ENV`, and
  a loader child changes into it only to run the call, so relative checkpoint paths resolve as they always did:
  against that directory. Imports no longer depend on it (no ``''`` entry).

Only the standard library here: the server imports this.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

WORKDIR_ENV = "ZEROCOPY_PICKLE_CACHE_WORKDIR"
SPAWNER_ENV = "ZEROCOPY_PICKLE_CACHE_SPAWNER_FD"
"""The fd of a socket to the client that started the server, which serves it as its first connection: the
misses that client had while the server started (background fills) arrive on it."""
"""Internal: the directory relative paths of requests resolve against (set by whoever starts a server)."""

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the zerocopy_pickle package


def _real(entry: str) -> str:
    return os.path.realpath(entry) if entry else ""


def cleaned_path(path: list[str]) -> list[str]:
    """``path`` (a ``sys.path``) without the entry Python put first for where it was started, unless that entry
    is also named in ``PYTHONPATH``, and without relative entries (``''`` is the working directory, whatever it
    is when an import happens)."""
    explicit = {_real(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)}
    starts = {""}
    with contextlib.suppress(OSError):
        starts.add(_real(os.getcwd()))
    if sys.argv and sys.argv[0] not in ("", "-c", "-m"):
        starts.add(_real(os.path.dirname(os.path.abspath(sys.argv[0]))))
    out = list(path)
    safe = getattr(sys.flags, "safe_path", False) or sys.flags.isolated  # -P / -I: Python put nothing first
    if out and not safe and _real(out[0]) in starts and _real(out[0]) not in explicit:
        del out[0]
    return [entry for entry in out if entry and os.path.isabs(entry)]


def clean_sys_path() -> None:
    """Apply :func:`cleaned_path` to this process's ``sys.path`` (idempotent)."""
    sys.path[:] = cleaned_path(sys.path)


def child_environment(env: dict[str, str], *, cleaned: bool) -> dict[str, str]:
    """``env`` for a server or loader process started in the runtime directory: ``PYTHONPATH`` gains the
    directory this ``zerocopy_pickle`` was imported from if only the start directory made it importable here
    (a source checkout used as the working directory), so the child imports the same code.

    Args:
        cleaned: whether this process's ``sys.path`` was already cleaned (the server) or not (a client).
    """
    here = sys.path if cleaned else cleaned_path(sys.path)
    if str(_PACKAGE_ROOT) in {_real(p) for p in here}:
        return env
    existing = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": os.pathsep.join([str(_PACKAGE_ROOT), *([existing] if existing else [])])}
