"""Internal: ``zerocopy-pickle``, the command line (``docs/cli.md`` documents every command, its output and its
JSON).

zerocopy-pickle [-v | -q] inspect FILE [--json] [--buffers N] [--verify]
zerocopy-pickle [-v | -q] scan FILE [--json] [--allow MODULE:QUALNAME ...]
zerocopy-pickle [-v | -q] convert IN OUT [--trusted] [--fsync]
zerocopy-pickle [-v | -q] native [--build [--force]] [--json]
zerocopy-pickle [-v | -q] demo [--size tiny|sd15] [--repeat N] [--dir DIR] [--snapshot [--size-mb N]]
zerocopy-pickle [-v | -q] serve [--max-bytes N] [--persist DIR] | status [--json] | stop | clear
zerocopy-pickle --version

Every command exits with one of the ``EXIT_*`` statuses of ``exits`` (documented in ``--help``), and reports an
expected failure (an error of :mod:`zerocopy_pickle.errors`, an ``OSError``) as one line
``zerocopy-pickle CMD: error: ...`` on stderr, without a traceback; with ``--json`` it also prints
``{"error": ..., "exit_code": ...}`` on stdout. ``-v``/``-q`` set the level of the ``zerocopy_pickle`` logger
(:mod:`zerocopy_pickle._console`, which also filters known third-party noise); only the command line configures
logging, never the library.

Snapshot modules (and torch) are imported inside the commands that need them: ``serve`` (the model cache's
server, whose commands are :mod:`zerocopy_pickle.cache.cli`'s) must not import torch.

Layers inside (lowest first; each imports only those before it): ``exits`` < ``convert`` | ``demo`` |
``inspection`` | ``native`` (one command family each) < ``parser`` (every command's options and help, and
``main``) < ``__main__`` (``python -m zerocopy_pickle._cli``).
"""

from .parser import main as main  # the console script, zerocopy_pickle._cli:main (pyproject.toml)
