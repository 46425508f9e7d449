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
