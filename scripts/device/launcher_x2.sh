#!/usr/bin/env bash
# The launcher and the test harness on a 2-GPU machine (NCCL, one GPU a rank), after changes to how rank processes
# and pytester's sessions start (the shared fork server, its warm-up ordering, warm sessions); with the wheels under
# .whl/ (docs/validation.md says how they are made):
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/launcher_x2.sh
# Then the repro CLI's two variants in one process on cuda (both launches from one fork server), and the compiled
# twins with the cuda unit tests (single_gpu.sh compile: the capture rebuilt against this machine's torch).
set -u
. "$(dirname "$0")/setup.sh" launcher
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
pt="python3 -m pytest -p no:cacheprovider"
start=$SECONDS
echo "== launcher on NCCL, torchrun sessions, warm sessions"
# the NCCL tests without xdist: a pytester session inherits its worker's PYTEST_XDIST_WORKER, and the launcher splits
# the GPUs between the workers that names (with 4 workers on 2 GPUs, none for some: gloo)
timeout 200 $pt tests/test_launcher_gpu.py tests/test_torchrun.py -q -rfE -n 0 > "$OUT/launcher-nccl.log" 2>&1
echo "exit $?"; grep -E "^(FAILED|ERROR) " "$OUT/launcher-nccl.log" | cut -c1-200; tail -1 "$OUT/launcher-nccl.log"
timeout 200 $pt tests/test_launcher.py tests/test_warm_sessions.py -q -rfE -n 4 > "$OUT/launcher.log" 2>&1
echo "exit $?"; grep -E "^(FAILED|ERROR) " "$OUT/launcher.log" | cut -c1-200; tail -1 "$OUT/launcher.log"
echo "launcher tests: $((SECONDS - start)) s"
echo "== deepspeed 0.19.8: zero_overlap on cuda, both variants in one process, 3 runs each"
s=$SECONDS
PYTHONPATH=/tmp/site timeout 200 python3 -m pytest_streamrace.repro zero_overlap --backend cuda --repeat 3 \
  > "$OUT/zero_overlap.log" 2>&1; echo "exit $?"
grep -E ": (reproduced|clean|inconclusive|error) [0-9]+/|every variant" "$OUT/zero_overlap.log" | sort | uniq -c
echo "zero_overlap: $((SECONDS - s)) s"
echo "== compiled twins and cuda unit tests"
OUT="$OUT/compile" bash scripts/device/single_gpu.sh compile 2>&1 | grep -v "^Successfully\|^ *$" | tail -20
echo "total: $((SECONDS - start)) s"
