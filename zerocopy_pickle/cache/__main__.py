"""``python -m zerocopy_pickle.cache serve ...``: the same as ``zerocopy-pickle serve ...``."""

import sys

from ..cli import main

sys.exit(main(sys.argv[1:]))
