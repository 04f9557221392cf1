"""Internal: where the library keeps its own files on disk: native builds (``native/``) and snapshots fetched from
URLs (``remote/``). Not the model cache, whose server keeps its entries in memory and its socket in a runtime
directory (``ZEROCOPY_PICKLE_CACHE_DIR``, docs/cache.md).

Standard library only: the cache server imports it (through ``remote``) without torch."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "ZEROCOPY_PICKLE_HOME"
"""The root of the library's files; unset or empty: ``$XDG_CACHE_HOME/zerocopy_pickle``, else
``~/.cache/zerocopy_pickle``."""
OLD_HOME_ENV = "ZEROCOPY_PICKLE_CACHE"
"""The earlier name of :data:`HOME_ENV`, still read when it is unset (it read as if it were the model cache's)."""


def home_dir() -> Path:
    """The root of the library's files: ``$ZEROCOPY_PICKLE_HOME``, else ``$ZEROCOPY_PICKLE_CACHE`` (its earlier
    name), else ``$XDG_CACHE_HOME/zerocopy_pickle``, else ``~/.cache/zerocopy_pickle``."""
    explicit = os.environ.get(HOME_ENV) or os.environ.get(OLD_HOME_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "zerocopy_pickle"
