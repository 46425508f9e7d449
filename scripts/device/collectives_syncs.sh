#!/usr/bin/env bash
# Functional collectives and host syncs on real streams, cuda backend, NCCL on 2 GPUs (nvidia-h200-x2) or one rank on 1:
#   bash scripts/device/collectives_syncs.sh
# 1. compiled graphs with _c10d_functional ops and Inductor's comm reordering: expected 2 passed (clean_*), 2 failed
#    (racy_*), each failure one race on the communication stream;
# 2. host-synchronizing read-backs: expected every clean_* passed and every racy_* failed.
set -u
. "$(dirname "$0")/setup.sh" syncs
echo "== compiled functional collectives (cuda backend, NCCL)"
timeout 300 python3 -m pytest -p no:cacheprovider tests/compile/funcol_cuda_cases.py --streamrace \
  --streamrace-backend=cuda -rA --streamrace-json "$OUT/races.json" > "$OUT/funcol.log" 2>&1; echo "exit $?"
grep -E "^(PASSED|FAILED|ERROR) |stream race|earlier|later" "$OUT/funcol.log" | cut -c1-220 | head -40
echo "== host-synchronizing read-backs (cuda backend)"
timeout 240 python3 -m pytest -p no:cacheprovider scripts/device/host_sync_cases.py --streamrace \
  --streamrace-backend=cuda -rA > "$OUT/host_sync.log" 2>&1; echo "exit $?"
grep -E "^(PASSED|FAILED|ERROR) " "$OUT/host_sync.log" | cut -c1-200
