#!/usr/bin/env bash
# The cuda backend's per-step cost on one GPU, paired rounds in one process (benchmarks/paired_overhead.py), where
# the time goes (benchmarks/profile_step.py), and the cuda unit tests the capture's changes could break.
#   device run (kind nvidia-h200): bash scripts/device/paired.sh
set -u
. "$(dirname "$0")/setup.sh" paired
for model in launch-bound larger; do
  echo "== paired overhead (cuda, $model)"
  timeout 200 python3 benchmarks/paired_overhead.py --backend cuda --rounds 9 --model $model; echo "exit $?"
done
echo "== profile (cuda)"
timeout 120 python3 benchmarks/profile_step.py --backend cuda --top 15; echo "exit $?"
echo "== cuda backend unit tests"
timeout 150 python3 -m pytest -p no:cacheprovider tests/test_cuda_backend.py tests/test_capture.py -q > "$OUT/unit.log" 2>&1
echo "exit $?"; tail -3 "$OUT/unit.log"; grep -E "^(FAILED|ERROR)" "$OUT/unit.log" | head
