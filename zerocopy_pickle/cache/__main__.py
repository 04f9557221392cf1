"""Internal: ``python -m zerocopy_pickle.cache serve ...``: the same as ``zerocopy-pickle serve ...`` (the
cache's own commands, :mod:`zerocopy_pickle.cache.cli`)."""

import sys

from .isolation import clean_sys_path

clean_sys_path()  # before importing anything more: nothing from the directory this was started in

from .._console import configure_logging, quiet_third_party  # noqa: E402
from .cli import main  # noqa: E402

# This entry runs the servers that patch_all() and the demo start, with their output sent to a server.log: INFO
# there says when each started (and where) and stopped, without the third-party noise of its loader's imports.
configure_logging(1)
quiet_third_party()
sys.exit(main(sys.argv[1:]))
