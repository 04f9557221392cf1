"""Run cloudpickle's own test suite with every round trip going through zerocopy_pickle.

Usage (from the repository root, in the project's environment, with cloudpickle's test requirements, psutil among
them)::

    git clone --depth 1 https://github.com/cloudpipe/cloudpickle /tmp/cloudpickle
    python tests/external/run_cloudpickle_suite.py /tmp/cloudpickle [extra pytest arguments]

Nothing of cloudpickle is kept in this repository: the script copies the checkout's ``tests`` folder into a
temporary directory, adapts the copy, and runs pytest on its ``cloudpickle_test.py`` against the cloudpickle
*installed* here (the one ``backend="auto"``/``"cloudpickle"`` use). The adaptations (README.md beside this file
says why each is needed):

* ``pickle_depickle`` (the suite's round-trip helper) becomes ``zp.loads(zp.dumps(obj), trusted=True)``;
* the test module's ``pickle`` and ``cloudpickle`` names become proxies whose ``dumps``/``loads`` go through
  zerocopy_pickle (``loads`` of anything that is not a snapshot, and ``dumps`` with a ``buffer_callback``, go to
  the real functions);
* ``testutils.dumps``/``loads`` (what the subprocess echo and worker helpers send across processes) go through
  zerocopy_pickle too, and the child processes see this repository on ``PYTHONPATH``; their timeout grows from 60 s
  to 600 s (each child imports torch);
* three tests that load in a ``python -c`` child with ``pickle.loads``/``cloudpickle.loads`` load with
  ``zerocopy_pickle.loads(..., trusted=True)`` instead;
* the worker memory-leak test measures after a first call (the worker's first load imports torch, ~200 MB);
* cases that cannot apply are skipped with their reason (``-rs`` lists them): see ``NOT_APPLICABLE``.

Set ``ZP_BACKEND`` to ``auto`` (default) or ``cloudpickle`` to choose the dump backend.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NOT_APPLICABLE = {
    "Protocol2CloudPickleTest": "zerocopy_pickle always writes pickle protocol 5: the protocol-2 rerun of every "
    "case is the same run",
    "CloudPickleTest::test_module": "pickles the test module's `pickle` global, which this adapter replaced by a "
    "proxy routing loads through zerocopy_pickle",
}

SHIM = '''
"""Route the suite's round trips through zerocopy_pickle."""
import os
import pickle as _pickle
import types

import cloudpickle as _cloudpickle
import zerocopy_pickle as zp

BACKEND = os.environ.get("ZP_BACKEND", "auto")
MAGIC = zp.dumps(None)[:8]


def dumps(obj, protocol=None, buffer_callback=None):
    if buffer_callback is not None:  # the caller's own out-of-band buffers: not what a snapshot does
        return _cloudpickle.dumps(obj, protocol=protocol, buffer_callback=buffer_callback)
    return zp.dumps(obj, backend=BACKEND)


def loads(data, *args, **kwargs):
    if not args and not kwargs and bytes(data[:8]) == MAGIC:
        return zp.loads(data, trusted=True)
    return _pickle.loads(data, *args, **kwargs)


class _Proxy(types.ModuleType):
    def __init__(self, real, **overrides):
        super().__init__(real.__name__)
        self.__dict__.update(overrides)
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


pickle_proxy = _Proxy(_pickle, loads=loads)
cloudpickle_proxy = _Proxy(_cloudpickle, dumps=dumps, loads=loads)
'''

CONFTEST = f"""
import pytest

NOT_APPLICABLE = {NOT_APPLICABLE!r}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.nodeid.split("::")
        for key, reason in NOT_APPLICABLE.items():
            if key in parts or "::".join(parts[-2:]) == key:  # a whole class, or exactly one test
                item.add_marker(pytest.mark.skip(reason="not applicable: " + reason))
"""

# (file, old text, new text): each must match exactly once, or the checkout is not one this adapter knows.
EDITS = [
    (
        "cloudpickle_test.py",
        "    return pickle.loads(cloudpickle.dumps(obj, protocol=protocol))\n",
        "    return _zp_shim.zp.loads(_zp_shim.zp.dumps(obj, backend=_zp_shim.BACKEND), trusted=True)\n",
    ),
    (
        "cloudpickle_test.py",
        "from .testutils import subprocess_worker\n",
        "from .testutils import subprocess_worker\nfrom . import zp_shim as _zp_shim\n\n"
        "pickle = _zp_shim.pickle_proxy\ncloudpickle = _zp_shim.cloudpickle_proxy\n",
    ),
    (
        "cloudpickle_test.py",
        '"import base64; import pickle; pickle.loads(base64.b32decode(\'"',
        '"import base64, functools, zerocopy_pickle; '
        "functools.partial(zerocopy_pickle.loads, trusted=True)(base64.b32decode('\"",
    ),
    (
        "cloudpickle_test.py",
        '"import base64; from pickle import loads; loads(base64.b32decode(\'"',
        '"import base64, functools, zerocopy_pickle; '
        "loads = functools.partial(zerocopy_pickle.loads, trusted=True); loads(base64.b32decode('\"",
    ),
    (
        "cloudpickle_test.py",
        "            import base64, cloudpickle, logging\n",
        "            import base64, cloudpickle, logging, functools, zerocopy_pickle\n"
        "            cloudpickle.loads = functools.partial(zerocopy_pickle.loads, trusted=True)\n",
    ),
    (
        "cloudpickle_test.py",
        "        with subprocess_worker(protocol={protocol}) as w:\n\n            reference_size = w.memsize()",
        "        with subprocess_worker(protocol={protocol}) as w:\n            w.run(id, 0)  # the first load imports "
        "torch\n            reference_size = w.memsize()",
    ),
    ("testutils.py", "from cloudpickle import dumps\n", "from zp_shim import dumps\n"),
    ("testutils.py", "loads = pickle.loads\n", "from zp_shim import loads\n"),
    (
        "testutils.py",
        '    env["PYTHONPATH"] = pythonpath\n',
        '    env["PYTHONPATH"] = pythonpath + os.pathsep + os.environ.get("PYTHONPATH", "")\n',
    ),
    ("testutils.py", "TIMEOUT = 60\n", "TIMEOUT = 600\n"),
]


def adapt(checkout: Path, into: Path) -> Path:
    """Copy ``checkout``'s tests into ``into`` and apply the edits; return the adapted tests folder."""
    tests = into / "tests"
    shutil.copytree(checkout / "tests", tests)
    for name, old, new in EDITS:
        path = tests / name
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{name}: expected exactly one {old[:60]!r}; is this a cloudpickle checkout I know?")
        path.write_text(text.replace(old, new))
    (tests / "zp_shim.py").write_text(SHIM)
    (into / "conftest.py").write_text(CONFTEST)
    return tests


def main(argv: list[str]) -> int:
    if not argv or not (Path(argv[0]) / "tests" / "cloudpickle_test.py").is_file():
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory(prefix="zp-cloudpickle-") as tmp:
        tests = adapt(Path(argv[0]), Path(tmp))
        paths = [str(REPO), str(tests), str(tests / "cloudpickle_testpkg"), tmp]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "tests/cloudpickle_test.py"]
        return subprocess.call([*command, *argv[1:]], cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
