#!/usr/bin/env bash
# GPU validation of the launcher's NCCL path and the detector's cuda backend; run on the lent 2-GPU machine:
#   device run (kind nvidia-h200-x2): bash scripts/device/validate.sh
# Logs and tables land in $OUT; docs/validation.md lists the results.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/streamrace-validate}; mkdir -p "$OUT"
date -u; nvidia-smi -L
python3 -c "import torch, pytest, xdist; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pytest', pytest.__version__, 'xdist', xdist.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import pytest_streamrace.plugin" || exit 1
pt="python3 -m pytest -p no:cacheprovider"
echo "== launcher on NCCL"; $pt tests/test_launcher_gpu.py tests/test_torchrun.py -v -n 0 2>&1 | tee "$OUT/launcher.log" | tail -15
echo "== corpus, ours (cuda backend)"
$pt tests/corpus/corpus_cases.py --streamrace --streamrace-backend=cuda --junitxml="$OUT/ours.xml" -q \
  --streamrace-json "$OUT/corpus-races.json" 2>&1 > "$OUT/corpus-ours.log" | tail -3; tail -3 "$OUT/corpus-ours.log"
echo "== corpus, PyTorch sanitizer"
TORCH_CUDA_SANITIZER=1 $pt tests/corpus/corpus_cases.py --junitxml="$OUT/sanitizer.xml" -q > "$OUT/corpus-sanitizer.log" 2>&1
tail -3 "$OUT/corpus-sanitizer.log"
python3 scripts/device/corpus_table.py "$OUT/ours.xml" "$OUT/sanitizer.xml" | tee "$OUT/corpus-table.md"
echo "== overhead"; timeout 300 python3 benchmarks/overhead.py 2>&1 | tee "$OUT/overhead.log"
