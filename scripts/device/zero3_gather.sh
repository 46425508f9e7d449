#!/usr/bin/env bash
# Forces the ZeRO-3 all-gather race the detector reported in DeepSpeed's own test_2_param_groups
# (docs/upstream/zero3-param-gather.md): a sleep before the step's partition copy, stale-weight forwards counted per variant.
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/zero3_gather.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
date -u; nvidia-smi -L
wheels=$(ls .whl/*.whl | grep -v -e '/deepspeed-' -e '/megatron')
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-ds .whl/deepspeed-0.19.8-*.whl $wheels \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site-ds
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1
OUT=${OUT:-/tmp/streamrace-zero3}; mkdir -p "$OUT"
timeout 240 torchrun --nproc_per_node 2 scripts/device/zero3_gather.py > "$OUT/zero3.log" 2>&1; echo "exit $?"
grep -E "stale forwards|Error" "$OUT/zero3.log" | head -40
