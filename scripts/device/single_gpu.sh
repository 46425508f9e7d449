#!/usr/bin/env bash
# What one GPU can check on the cuda backend, in parts that each fit one 10-minute device command:
#   device run (kind nvidia-h100-x1 or nvidia-h200): bash scripts/device/single_gpu.sh compile|syncs|latent
# compile: the compiled twins (tests/compile/cuda_cases.py, a compiled function's first call included) and
#          tests/test_cuda_backend.py — the C++ capture rebuilt from capture.cpp, the models moved to detector/models;
# syncs:   compiled functional collectives (one NCCL rank on one GPU), host-sync read-backs, threads on real streams;
# latent:  scripts/device/latent.sh's cases (latent races hidden by a read-back, cuda backend).
# Logs land in $OUT; each part ends with a compact summary.
set -u
part=${1:-}
case "$part" in compile|syncs|latent) ;; *) echo "single_gpu.sh: unknown part '$part' (compile|syncs|latent)"; exit 2;; esac
. "$(dirname "$0")/setup.sh" single
pt="python3 -m pytest -p no:cacheprovider"
case "$part" in
compile)
  echo "== compiled twins (cuda backend)"
  timeout 420 $pt tests/compile/cuda_cases.py --streamrace --streamrace-backend=cuda -rA --junitxml="$OUT/ours.xml" \
    --streamrace-json "$OUT/races.json" > "$OUT/cases.log" 2>&1; echo "exit $?"; tail -1 "$OUT/cases.log"
  grep -E "^(FAILED|ERROR) " "$OUT/cases.log" | cut -c1-200 | head -20
  echo "== cuda backend unit tests"
  timeout 120 $pt tests/test_cuda_backend.py tests/test_capture.py -q > "$OUT/cuda_backend.log" 2>&1; echo "exit $?"
  tail -3 "$OUT/cuda_backend.log"
  python3 scripts/device/compile_table.py "$OUT/ours.xml" "$OUT/races.json" | tee "$OUT/table.md";;
syncs)
  OUT="$OUT" bash scripts/device/collectives_syncs.sh
  echo "== threads on real streams"
  timeout 180 python3 scripts/device/threads_cuda.py "$OUT/threads"; echo "exit $?";;
latent)
  OUT="$OUT" bash scripts/device/latent.sh;;
esac
