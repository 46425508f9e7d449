#!/usr/bin/env bash
# The virtual model's nodes bound by autograd number before a backward (node_streams.cpp) and
# the virtual backend's ops through the kernel entry. The extension rebuilt against this machine's torch (its
# custom-Function node handle differs from torch 2.13's), then the virtual model's tests (GradientEdge roots included)
# and the cuda unit tests (the capture's shared code), on one GPU.
#   device run (one H200): bash scripts/device/node_binding.sh
set -u
. "$(dirname "$0")/setup.sh" node-binding
start=$SECONDS
python3 -c "from pytest_streamrace.detector import capture as c; e = c.load(); print('built:', e is not None, c.failure() if e is None else '')"
timeout 300 python3 -m pytest -p no:cacheprovider tests/test_virtual.py tests/test_cuda_backend.py tests/test_capture.py \
  -q -n 0 > "$OUT/unit.log" 2>&1
echo "exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/unit.log" | head; tail -1 "$OUT/unit.log"
echo "total: $((SECONDS - start)) s"
