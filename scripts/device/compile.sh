#!/usr/bin/env bash
# Compiled code under --streamrace on the cuda backend. Run on one GPU (nvidia-h100-x1 or
# nvidia-h200):
#   bash scripts/device/compile.sh
# Racy/clean twins of compiled code (Inductor's Triton kernels, a triton_op user kernel, a CUDA-graph replay,
# max-autotune-no-cudagraphs, backward and a compiled-autograd hook), tests/test_cuda_backend.py (stream names), the
# DeepSpeed #8061 hook-stream experiment, and the overhead benchmark with its compiled training step. Logs land in $OUT; a
# compact table closes the output.
# PART=cases (the twins and the hook experiment, ~5 min) or PART=bench (the benchmark, ~5 min) splits it in two runs
# under the 10-minute limit of one device command; default: both.
set -u
. "$(dirname "$0")/setup.sh" compile
pt="python3 -m pytest -p no:cacheprovider"
PART=${PART:-all}
if [ "$PART" != bench ]; then
echo "== compiled cases, ours (cuda backend)"
timeout 420 $pt tests/compile/cuda_cases.py --streamrace --streamrace-backend=cuda -rA --junitxml="$OUT/ours.xml" \
  --streamrace-json "$OUT/races.json" > "$OUT/cases.log" 2>&1; echo "exit $?"; tail -3 "$OUT/cases.log"
grep -E "^(FAILED|ERROR) " "$OUT/cases.log" | cut -c1-200 | head -20
echo "== cuda backend: streams named where Python constructs them (pooled streams, NCCL first)"
timeout 120 $pt tests/test_cuda_backend.py -q > "$OUT/cuda_backend.log" 2>&1; echo "exit $?"; tail -15 "$OUT/cuda_backend.log"
echo "== DeepSpeed #8061: which stream gradient hooks run on"
timeout 180 python3 scripts/device/hook_streams.py 2>&1 | grep -v Warning | tee "$OUT/hook_streams.log" | tail -5
echo "== table"
python3 scripts/device/compile_table.py "$OUT/ours.xml" "$OUT/races.json" | tee "$OUT/table.md"
fi
if [ "$PART" != cases ]; then
echo "== overhead"
timeout 540 python3 benchmarks/overhead.py --steps 30 --model launch-bound --model compiled 2>&1 | tee "$OUT/overhead.log" | tail -5
fi
