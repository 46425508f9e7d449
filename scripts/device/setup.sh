# Sourced by the device scripts (`. "$(dirname "$0")/setup.sh" NAME`): the environment every GPU run keeps, $OUT
# (default /tmp/streamrace-NAME), the machine and versions printed first, the package installed from this checkout.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tex} TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
OUT=${OUT:-/tmp/streamrace-$1}; mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
date -u; nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import pytest_streamrace.plugin" || exit 1

# The stock stacks on NCCL (DDP, FSDP2, DTensor, DeepSpeed) and DeepSpeed's zero_overlap repro: the verdicts a change to
# the capture must not move (stacks.sh installs the wheels under /tmp/site). LIMIT: the stacks pass's cap (s).
stacks_and_zero_overlap() {
  echo "== stock stacks on NCCL (clean cases clean, racy twins caught)"
  STACKS="tests/stacks/stack_ddp.py tests/stacks/stack_fsdp2.py tests/stacks/stack_dtensor.py tests/stacks/stack_deepspeed.py" \
    LIMIT=${1:-220} OUT="$OUT/stacks" bash scripts/device/stacks.sh 2>&1 | grep -v "^PASSED" | tail -20
  grep -c "^PASSED" "$OUT/stacks/stacks-streamrace.log"
  echo "== deepspeed 0.19.8: zero_overlap on cuda, both variants, 2 runs each"
  PYTHONPATH=/tmp/site timeout 150 python3 -m pytest_streamrace.repro zero_overlap --backend cuda --repeat 2 \
    > "$OUT/zero_overlap.log" 2>&1; echo "exit $?"
  grep -E ": (reproduced|clean|inconclusive|error) [0-9]+/|every variant" "$OUT/zero_overlap.log" | sort | uniq -c
}
