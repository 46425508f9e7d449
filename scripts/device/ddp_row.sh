#!/usr/bin/env bash
# The 2-rank DDP row on the cuda backend after a change to what the detector does in Python per step (seventeenth
# session: the GPU trace's event records and waits, and the c10d ops, queued in order with the captured ops, no Python
# at issue): the cuda unit tests; the row paired, with the events in Python beside it in the same rounds; where rank
# 0's detector time goes by thread; the stock stacks on NCCL and the zero_overlap repro, whose verdicts must not move.
# OVERHEAD=1 adds overhead.py's DDP row (a process per configuration, as the issue measures it).
# With the wheels under .whl/ (docs/validation.md says how):
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/ddp_row.sh
set -u
. "$(dirname "$0")/setup.sh" ddp
pt="python3 -m pytest -p no:cacheprovider"
start=$SECONDS
echo "== cuda unit tests (the capture rebuilt against this torch)"
timeout 200 $pt tests/test_cuda_backend.py tests/test_capture.py -q -n 0 > "$OUT/unit.log" 2>&1
echo "exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/unit.log" | head; tail -1 "$OUT/unit.log"
echo "== the DDP row, paired (NCCL, a process a rank)"
timeout 200 python3 benchmarks/paired_overhead.py --model ddp --backend cuda --rounds "${ROUNDS:-6}"; echo "exit $?"
echo "== where rank 0's detector time goes per step, by thread (timers)"
STEPS=100 timeout 150 python3 scripts/device/ddp_thread_times.py cuda 2>&1 | grep -v "Warning" | head -24
stacks_and_zero_overlap 220
if [ -n "${OVERHEAD:-}" ]; then
  echo "== overhead.py, the DDP row as the issue measures it (own process per configuration)"
  timeout 200 python3 benchmarks/overhead.py --model DDP --steps 30 --repeat 5 2>&1 | tee "$OUT/overhead.log" | tail -6
fi
echo "total: $((SECONDS - start)) s"
