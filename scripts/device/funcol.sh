#!/usr/bin/env bash
# GPU part of issue 21 (functional collectives): compiled graphs with _c10d_functional ops and Inductor's comm
# reordering, under the cuda backend on 2 GPUs with NCCL (nvidia-h200-x2):
#   bash scripts/device/funcol.sh
# Expected: 2 passed (clean_*), 2 failed (racy_*), each failure one race on the communication stream; then the CPU
# twins of tests/test_functional_collectives.py on the cuda backend's machine for comparison.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/tex TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
OUT=${OUT:-/tmp/streamrace-funcol}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
date -u; nvidia-smi -L
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import pytest_streamrace.plugin" || exit 1
echo "== compiled functional collectives (cuda backend, NCCL)"
timeout 480 python3 -m pytest -p no:cacheprovider tests/compile/funcol_cuda_cases.py --streamrace \
  --streamrace-backend=cuda -rA --streamrace-json "$OUT/races.json" > "$OUT/funcol.log" 2>&1; echo "exit $?"
grep -E "^(PASSED|FAILED|ERROR) |stream race|earlier|later" "$OUT/funcol.log" | cut -c1-220 | head -40
