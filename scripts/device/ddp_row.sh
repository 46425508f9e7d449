#!/usr/bin/env bash
# The 2-rank DDP row on the cuda backend after a change to what the detector does in Python per step (seventeenth
# session: the GPU trace's event records and waits, and the c10d ops, queued in order with the captured ops, no Python
# at issue): the cuda unit tests; the row paired, with the events in Python beside it in the same rounds; where rank
# 0's detector time goes by thread; the stock stacks on NCCL and the zero_overlap repro, whose verdicts must not move.
# OVERHEAD=1 adds overhead.py's DDP row (a process per configuration, as the issue measures it).
# With the wheels under .whl/ (docs/gpu-validation.md says how):
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
echo "== stock stacks on NCCL (clean cases clean, racy twins caught)"
STACKS="tests/stacks/stack_ddp.py tests/stacks/stack_fsdp2.py tests/stacks/stack_dtensor.py tests/stacks/stack_deepspeed.py" \
  LIMIT=220 OUT="$OUT/stacks" bash scripts/device/stacks.sh 2>&1 | grep -v "^PASSED" | tail -20
grep -c "^PASSED" "$OUT/stacks/stacks-streamrace.log"
echo "== deepspeed 0.19.8: zero_overlap on cuda, both variants, 2 runs each"
PYTHONPATH=/tmp/site timeout 150 python3 -m pytest_streamrace.repro zero_overlap --backend cuda --repeat 2 \
  > "$OUT/zero_overlap.log" 2>&1; echo "exit $?"
grep -E ": (reproduced|clean|inconclusive|error) [0-9]+/|every variant" "$OUT/zero_overlap.log" | sort | uniq -c
if [ -n "${OVERHEAD:-}" ]; then
  echo "== overhead.py, the DDP row as the issue measures it (own process per configuration)"
  timeout 200 python3 benchmarks/overhead.py --model DDP --steps 30 --repeat 5 2>&1 | tee "$OUT/overhead.log" | tail -6
fi
echo "total: $((SECONDS - start)) s"
