#!/usr/bin/env bash
# The megatron_instances repro (Megatron-LM #3670) on GPUs (cuda backend, NCCL, numeric referee) on megatron-core 0.15.2 (the bug
# native; the harness applies the fix) and 0.19.2 (the fix native; the harness re-introduces the bug), world size 2,
# and 4 when there are 4 GPUs. Expected: every line "unpatched: reproduced N/N" and "patched: clean N/N".
#   device run (kind nvidia-h200-x2 or nvidia-h200-x4, carry .whl): bash scripts/device/megatron.sh [REPEAT [VERSION...]]
# Default: both versions, every world size the GPUs allow. WORLD_SIZES="4" (say) runs only those; to split the work
# over calls or GPU pairs, e.g. CUDA_VISIBLE_DEVICES=2,3 bash scripts/device/megatron.sh 20 0.19.2.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# megatron-core JIT-builds a small CUDA extension when imported: one cache per version (two copies of this script
# may run at once on separate GPU pairs), this GPU's arch only
export TORCH_CUDA_ARCH_LIST=9.0
OUT=${OUT:-/tmp/streamrace-megatron}; mkdir -p "$OUT"
REPEAT=${1:-20}; shift || true
VERSIONS=${*:-0.15.2 0.19.2}
for v in $VERSIONS; do  # einops is in the image
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-$v .whl/megatron_core-$v-*.whl
done
# installed once (the plugin's entry point); skipped when an earlier command or a parallel copy already did it
python3 -c "import importlib.metadata as m; m.version('pytest-streamrace')" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
SIZES=2; [ "$GPUS" -ge 4 ] && SIZES="2 4"
SIZES=${WORLD_SIZES:-$SIZES}
echo "== $GPUS GPUs (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}); megatron-core $VERSIONS; world sizes: $SIZES;" \
  "$REPEAT runs per variant, 3 iterations each"
for v in $VERSIONS; do
  for ws in $SIZES; do
    log="$OUT/megatron-$v-ws$ws.log"
    start=$SECONDS
    TORCH_EXTENSIONS_DIR=/tmp/streamrace-torch-ext-$v PYTHONPATH=/tmp/site-$v timeout 280 python3 -m \
      pytest_streamrace.repro megatron_instances --backend cuda \
      --world-size "$ws" --steps 3 --repeat "$REPEAT" --json "$OUT/megatron-$v-ws$ws.json" > "$log" 2>&1
    rc=$?
    echo "-- megatron-core $v, $ws ranks: exit $rc, $((SECONDS - start)) s"
    grep -E "^megatron_instances/(unpatched|patched): |^error:|every variant" "$log" | grep -v " — "
    grep -E "numbers:" "$log" | sed 's/, "worst_rel_err": [^,}]*//' | sort | uniq -c | sort -rn | head -4
    [ "$rc" -ne 0 ] && tail -15 "$log"
  done
done
