"""Coverage-guided fuzzing (atheris / libFuzzer) of the snapshot reader, the stream check and restricted loads.

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/fuzz_snapshot.py -max_total_time=600 -timeout=10 fuzz/corpus

Each input is turned into a snapshot in one of four ways (raw bytes; a seed snapshot with bytes overwritten;
a pickle stream wrapped in a valid header; a stream of the cost model's hostile corpus,
``tests/test_fuzz.py``'s COST_MODEL_STREAMS, with bytes overwritten or inserted, in a valid header) and loaded
restricted. Loading it must succeed or raise a
``zerocopy_pickle.ZeroCopyPickleError``; any other exception, a crash or a timeout is a finding.
The bounded property-based version of this harness runs in CI (tests/test_fuzz.py).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import atheris
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.* and the package

with atheris.instrument_imports(include=["zerocopy_pickle"]):
    import zerocopy_pickle as zp
    import zerocopy_pickle._storage.decoding  # the header reader every load runs: instrumented too
    from zerocopy_pickle._storage import format as fmt

from tests.test_fuzz import COST_MODEL_STREAMS

HOSTILE = [COST_MODEL_STREAMS[name] for name in sorted(COST_MODEL_STREAMS)]
SEEDS = [
    zp.dumps({"w": torch.arange(16.0), "nested": [1, "two", (3.0, None)], "tied": None}),
    zp.dumps(torch.nn.Linear(3, 2)),
    zp.dumps({"sparse": torch.eye(3).to_sparse(), "half": torch.ones(4, dtype=torch.float16)}),
]


def wrap(stream: bytes) -> bytes:
    layout = fmt.encode(len(stream), [])
    return layout.prefix + stream + bytes(layout.data_offset - layout.stream_offset - len(stream))


def one_input(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    mode = provider.ConsumeIntInRange(0, 3)
    if mode == 0:
        blob = provider.ConsumeBytes(provider.remaining_bytes())
    elif mode == 1:
        seed = bytearray(SEEDS[provider.ConsumeIntInRange(0, len(SEEDS) - 1)])
        for _ in range(provider.ConsumeIntInRange(1, 8)):
            if not provider.remaining_bytes():
                break
            seed[provider.ConsumeIntInRange(0, len(seed) - 1)] = provider.ConsumeInt(1) & 0xFF
        blob = bytes(seed[: provider.ConsumeIntInRange(0, len(seed))])
    elif mode == 2:
        blob = wrap(provider.ConsumeBytes(provider.remaining_bytes()))
    else:
        stream = bytearray(HOSTILE[provider.ConsumeIntInRange(0, len(HOSTILE) - 1)])
        for _ in range(provider.ConsumeIntInRange(0, 6)):
            if not provider.remaining_bytes():
                break
            at = provider.ConsumeIntInRange(0, len(stream) - 1)
            if provider.ConsumeBool():
                stream[at] = provider.ConsumeInt(1) & 0xFF
            else:
                stream[at:at] = provider.ConsumeBytes(provider.ConsumeIntInRange(1, 4))
        blob = wrap(bytes(stream[: provider.ConsumeIntInRange(0, len(stream))]))
    with contextlib.suppress(zp.ZeroCopyPickleError):
        zp.loads(blob, allow=["torch.nn.modules.linear:Linear"])


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
