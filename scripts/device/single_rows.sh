#!/usr/bin/env bash
# Issue 23's single-GPU rows as the issue measures them (benchmarks/overhead.py: a process per configuration, side by
# side with plain, the empty dispatch mode, the capture floor and PyTorch's sanitizer), then the launch-bound and
# larger rows in paired rounds (benchmarks/paired_overhead.py), which a slower or busier host moves less.
#   device run (kind nvidia-h200): bash scripts/device/single_rows.sh
set -u
. "$(dirname "$0")/setup.sh" single-rows
start=$SECONDS
echo "== overhead.py: launch-bound, larger, compiled"
timeout 330 python3 benchmarks/overhead.py --steps 30 --model launch-bound --model larger --model compiled \
  > "$OUT/overhead.log" 2>&1; echo "exit $?"
grep -v -i "warn" "$OUT/overhead.log" | tail -5
for model in launch-bound larger; do
  echo "== paired ($model, cuda)"
  timeout 120 python3 benchmarks/paired_overhead.py --backend cuda --rounds 5 --model $model 2>&1 | grep -v -i warn \
    | tail -9
done
echo "total: $((SECONDS - start)) s"
