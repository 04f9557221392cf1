"""Internal: ``python -m zerocopy_pickle.cache serve ...``: the same as ``zerocopy-pickle serve ...`` (the
cache's own commands, :mod:`zerocopy_pickle.cache.cli`)."""

import sys

from .isolation import clean_sys_path

clean_sys_path()  # before importing anything more: nothing from the directory this was started in

from .cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
