#!/usr/bin/env bash
# The cost table's single-GPU rows as docs/validation.md measures them (benchmarks/overhead.py: a process per configuration, side by
# side with plain, the empty dispatch mode, the capture floor and PyTorch's sanitizer), then the launch-bound and
# larger rows in paired rounds (benchmarks/paired_overhead.py), which a slower or busier host moves less.
#   device run (kind nvidia-h200): bash scripts/device/single_rows.sh [compiled]
# compiled: the compiled row alone, paired (a fresh compile under each configuration) and overhead.py twice.
set -u
. "$(dirname "$0")/setup.sh" single-rows
start=$SECONDS
if [ "${1:-}" = compiled ]; then
  echo "== paired (compiled, cuda)"
  timeout 300 python3 benchmarks/paired_overhead.py --backend cuda --rounds 5 --model compiled 2>&1 | grep -v -i warn \
    | tail -6
  echo "== overhead.py: compiled, twice"
  timeout 240 python3 benchmarks/overhead.py --steps 30 --repeat 2 --model compiled 2>&1 | grep -v -i warn | tail -3
  echo "total: $((SECONDS - start)) s"
  exit 0
fi
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
