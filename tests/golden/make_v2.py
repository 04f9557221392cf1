"""Writes tests/golden/v2.zcp: a format-v2 snapshot (checksums and an HMAC signature) that every later reader
must still load and verify. Run once when format v2 was introduced; test_golden.py pins its SHA-256.

    .venv/bin/python tests/golden/make_v2.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import zerocopy_pickle as zp

KEY = b"zerocopy_pickle golden v2 key"


def golden_object() -> dict[str, object]:
    """The same contents as the v1 golden file."""
    spec = importlib.util.spec_from_file_location("make_v1", Path(__file__).with_name("make_v1.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.golden_object()  # type: ignore[no-any-return]


if __name__ == "__main__":
    out = Path(__file__).with_name("v2.zcp")
    zp.dump(golden_object(), out, key=KEY)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
