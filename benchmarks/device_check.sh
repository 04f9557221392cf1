#!/usr/bin/env bash
# The GPU checks of docs/devices.md as one prepared run, for a machine with a CUDA device (the device tool's
# H200 in this project's workplace; any CUDA machine with torch, pytest and numpy elsewhere):
#   1. the CUDA tests (tests/test_transfer_cuda.py) and the fake-device ones (tests/test_transfer.py);
#   2. benchmarks/device.py: with diffusers importable, on the SD1.5-sized pipeline it builds in /tmp/zcp-sd15
#      (about 5 GB of disk, a minute or two), parts 1, 2 and 3; without it, on --synthetic 5.5 (parts 1 and 3).
#      Part 3 loads the snapshot with a cold page cache (about a minute more), from $ZCP_SCRATCH or .zcp-scratch
#      in this checkout (a disk: its pages can be evicted), removed afterwards.
# Nothing is installed: the package runs from this checkout (PYTHONPATH). Logs and results go to $OUT (the
# device tool's folder that comes back) or /tmp/zcp-device-check.
#
#   bash benchmarks/device_check.sh            # about 6 minutes on an H200 with the pipeline, 3 without
#
# Without diffusers on that machine, carry it as wheels (the device tool's README, "pip download"):
#   diffusers==0.42.1 importlib_metadata  (the rest of what it needs is usually there)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
out="${OUT:-/tmp/zcp-device-check}"
mkdir -p "$out"
python3 - <<'PY' 2>&1 | tee "$out/machine.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    print(i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory // 2**20, "MiB")
PY
status=0
tests=(tests/test_transfer.py tests/test_transfer_cuda.py)
if python3 -c "import hypothesis" 2>/dev/null; then
    tests+=(tests/test_transfer_cold.py)  # the cold reads on the fake device (property tests need hypothesis)
fi
python3 -m pytest -q -p no:cacheprovider -rs "${tests[@]}" 2>&1 | tee "$out/tests.log" || status=1
if python3 -c "import diffusers" 2>/dev/null; then
    source=(--models /tmp/zcp-sd15)
else
    echo "diffusers is not importable: part 1 on a synthetic graph, no part 2" | tee "$out/bench.log"
    source=(--synthetic 5.5)
fi
# Part 3 (cold page cache) needs the snapshot on a disk whose pages can be evicted: the checkout's folder, not a
# tmpfs /tmp. It evicts with fadvise (and, as root, drop_caches) and says so if the file stayed cached.
scratch="${ZCP_SCRATCH:-$PWD/.zcp-scratch}"
python3 benchmarks/device.py "${source[@]}" --repeat 3 --scratch "$scratch" --json "$out/device.json" 2>&1 \
    | tee -a "$out/bench.log" || status=1
rm -rf "$scratch"
exit $status
