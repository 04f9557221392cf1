"""The ``demo`` command: the cache demo (``examples/cache_scenario.py``) or, with ``--snapshot``, the snapshot demo
(``examples/snapshot_demo.py``), imported from the source checkout this library runs from; an installed package,
which ships no examples, says to run it from a clone."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .exits import EXIT_ERROR


def _examples_checkout() -> Path | None:
    """The source checkout this library is imported from, if it has the ``examples/`` the demos live in (an
    editable install of a clone); None for an installed wheel, which ships no examples."""
    root = Path(__file__).resolve().parents[2]  # <checkout>/zerocopy_pickle/_cli/demo.py
    return root if (root / "examples" / "__init__.py").is_file() else None


def run_demo(args: argparse.Namespace) -> int:
    root = _examples_checkout()
    if root is None:
        print(
            "zerocopy-pickle demo: the demos are the examples/ of a source checkout, which an installed package "
            "does not include; run it from a clone: git clone https://github.com/zerocopy-pickle/zerocopy-pickle "
            "&& cd zerocopy-pickle && make demo",
            file=sys.stderr,
        )
        return EXIT_ERROR
    sys.path.insert(0, str(root))  # first: a package of another project named "examples" must not answer
    if args.snapshot:
        from examples import snapshot_demo

        return snapshot_demo.run(size_mb=args.size_mb, repeat=args.repeat, directory=args.dir)
    from examples import cache_scenario

    return cache_scenario.run_demo(size=args.size, runs=args.repeat, directory=args.dir)
