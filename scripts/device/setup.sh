# GPU host setup, sourced from anywhere in the checkout before the GPU validation:
#   . scripts/device/setup.sh && python3 -m pytest -m gpu tests/gpu          (docs/validation.md)
# Sets the environment every GPU run keeps (NCCL without NVLink multicast, JIT caches, the GPU's arch for DeepSpeed's
# and megatron-core's builds), OUT (default /tmp/streamrace-gpu: the results file and logs), prints the machine,
# installs this checkout, and installs each carried wheel of .whl/ where tests/gpu finds it (--framework-sites): a
# DeepSpeed or megatron-core version in a folder of its own under /tmp/streamrace-sites (deepspeed-0.19.8, ...), so
# that one session tries several; every other wheel (their dependencies, expecttest) under common/.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tex} TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
# DeepSpeed's JIT builds die parsing the image's default arch list ("invalid literal ... '0a'"): this GPU's only
TORCH_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
export TORCH_CUDA_ARCH_LIST OUT=${OUT:-/tmp/streamrace-gpu}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || return 1
date -u; nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
pipt() { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$@" 2>&1 | grep -v WARNING | tail -1; }
common=()
for wheel in .whl/*.whl; do
  [ -e "$wheel" ] || continue
  name=$(basename "$wheel"); dist=${name%%-*}; version=${name#*-}; version=${version%%-*}
  case "$dist" in
    deepspeed) pipt "/tmp/streamrace-sites/deepspeed-$version" "$wheel";;
    megatron_core) pipt "/tmp/streamrace-sites/megatron-core-$version" "$wheel";;
    *) common+=("$wheel");;
  esac
done
[ ${#common[@]} -gt 0 ] && pipt /tmp/streamrace-sites/common "${common[@]}"
ls /tmp/streamrace-sites 2>/dev/null | tr '\n' ' '; echo
python3 -c "import pytest_streamrace.plugin" || return 1
