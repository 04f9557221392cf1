"""``python -m zerocopy_pickle._cli ...``: the same as ``zerocopy-pickle ...``."""

import sys

from .parser import main

sys.exit(main())
