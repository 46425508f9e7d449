#!/usr/bin/env bash
# The DeepSpeed repros on GPUs (cuda backend, NCCL, numeric referee), on deepspeed 0.19.8 and 0.19.2; run on the lent
# 2-GPU machine with the wheels under .whl/ (see docs/validation.md for how they are made):
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/repros.sh [REPEAT]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/streamrace-repros}; mkdir -p "$OUT"
REPEAT=${1:-20}
common=".whl/hjson-*.whl .whl/pydantic*.whl .whl/annotated_types-*.whl .whl/typing_inspection-*.whl .whl/typing_extensions-*.whl"
for v in 0.19.8 0.19.2; do
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-$v .whl/deepspeed-$v-*.whl $common
done
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
for v in 0.19.8 0.19.2; do
  for repro in zero_overlap zero_bucket_reuse; do
    echo "== deepspeed $v: $repro, $REPEAT runs per variant"
    PYTHONPATH=/tmp/site-$v timeout 280 python3 -m pytest_streamrace.repro $repro --backend cuda --repeat "$REPEAT" \
      --json "$OUT/$repro-$v.json" > "$OUT/$repro-$v.log" 2>&1
    echo "exit $?"; grep -E "^  deepspeed|numbers:|: (reproduced|clean|inconclusive|error) [0-9]+/|every variant" "$OUT/$repro-$v.log" | sort | uniq -c | sort -rn | head -12
  done
done
