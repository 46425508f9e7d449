#!/usr/bin/env bash
# Forcing turns stock DeepSpeed 0.19.2 ZeRO-2 (bit-identical) and megatron-core 0.15.2 DDP
# (nDOI=2, 0/N wrong iterations) wrong, over >= 10 repeats each. Run on a 2-GPU machine (nvidia-h200-x2):
#   bash scripts/device/forcing.sh            (REPEATS=10 by default)
# Needs wheels under .whl/ (see ../shared/notes/gpu-recipes.md): .whl/deepspeed-0.19.2-*.whl,
# .whl/{hjson,pydantic,pydantic_core,annotated_types,typing_inspection,typing_extensions}*.whl, .whl/megatron_core-0.15.2-*.whl.
# Logs and the tables land in $OUT; docs/validation.md lists the results.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/tex
OUT=${OUT:-/tmp/streamrace-forcing}; mkdir -p "$OUT"
REPEATS=${REPEATS:-10}
cd "$(dirname "$0")/../.."
shopt -s nullglob
ds=(.whl/deepspeed-0.19.2-*.whl); mc=(.whl/megatron_core-0.15.2-*.whl)
deps=(.whl/hjson*.whl .whl/pydantic*.whl .whl/annotated*.whl .whl/typing*.whl)
if [ ${#ds[@]} -eq 0 ] || [ ${#mc[@]} -eq 0 ] || [ ${#deps[@]} -lt 4 ]; then
  echo "forcing.sh: missing wheels under .whl/ (need deepspeed-0.19.2, megatron_core-0.15.2, hjson," \
       "pydantic, pydantic-core, annotated-types, typing-*); see ../shared/notes/gpu-recipes.md" >&2
  exit 2
fi
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@" >/dev/null 2>&1; }
pipi /tmp/site192 "${ds[@]}" "${deps[@]}" || { echo "forcing.sh: installing deepspeed 0.19.2 failed" >&2; exit 2; }
pipi /tmp/mc0152 "${mc[@]}" || { echo "forcing.sh: installing megatron-core 0.15.2 failed" >&2; exit 2; }
date -u; nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
drive() {  # drive <site> <port> <framework>
  PYTHONPATH="$PWD:$1" timeout 280 torchrun --nproc_per_node 2 --master_port "$2" \
    scripts/device/forcing_frameworks.py "$3" --repeats "$REPEATS" > "$OUT/$3.log" 2>&1
  echo "== $3 (exit $?)"; sed -n '/^RESULT/,$p' "$OUT/$3.log" | grep -E '^(RESULT|\||cycles)' \
    || grep -E 'Error|error|Traceback' "$OUT/$3.log" | head -8
}
drive /tmp/site192 29611 deepspeed | tee "$OUT/tables.md"
drive /tmp/mc0152 29612 megatron | tee -a "$OUT/tables.md"
