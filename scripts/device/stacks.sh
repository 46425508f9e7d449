#!/usr/bin/env bash
# The stock-stack suite (tests/stacks) on GPUs — cuda backend, NCCL, one GPU per rank — under --streamrace; with
# `plain`, without the plugin (each item starts NCCL, ~8-10 s: the two passes do not fit one 10-minute command); with
# `regress`, the corpus and the repros (DeepSpeed's and Megatron's) again (nothing may regress; the overhead is
# all_rows.sh's). On the lent 2-GPU machine, with the wheels under .whl/ (docs/validation.md says how they are made):
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/stacks.sh [plain|regress]
# STACKS=... picks stack modules (default: all of tests/stacks/stack_*.py); LIMIT=... caps a stacks pass (s, default 540).
set -u
part=${1:-streamrace}
case "$part" in streamrace|plain|regress) ;; *) echo "stacks.sh: unknown part '$part' (plain|regress)"; exit 2;; esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/tex  # megatron-core 0.15.2 builds an extension at import
OUT=${OUT:-/tmp/streamrace-stacks}; mkdir -p "$OUT"
date -u; nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, pytest, deepspeed, megatron.core as mc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pytest', pytest.__version__, 'deepspeed', deepspeed.__version__, 'megatron-core', mc.__version__)" 2>&1 | tail -1
pt="python3 -m pytest -p no:cacheprovider"
stacks=${STACKS:-tests/stacks/stack_*.py}
start=$SECONDS
case "$part" in
plain)
  echo "== stacks, plain (every case runs on NCCL without the plugin's checks)"
  timeout ${LIMIT:-540} $pt $stacks -q -p no:randomly > "$OUT/stacks-plain.log" 2>&1; tail -2 "$OUT/stacks-plain.log"
  echo "stacks: $((SECONDS - start)) s"; exit 0;;
streamrace)
  echo "== stacks under --streamrace (cuda backend): clean cases must pass clean, racy twins must be caught"
  timeout ${LIMIT:-540} $pt $stacks --streamrace -rA -q -p no:randomly --streamrace-json "$OUT/stacks-races.json" \
    > "$OUT/stacks-streamrace.log" 2>&1
  grep -E "^(PASSED|FAILED|SKIPPED|ERROR)" "$OUT/stacks-streamrace.log"; tail -1 "$OUT/stacks-streamrace.log"
  echo "stacks: $((SECONDS - start)) s"; exit 0;;
esac
echo "== corpus, ours (cuda backend)"
$pt tests/corpus/corpus_cases.py --streamrace --streamrace-backend=cuda --junitxml="$OUT/ours.xml" -q \
  > "$OUT/corpus-ours.log" 2>&1; tail -1 "$OUT/corpus-ours.log"
python3 scripts/device/corpus_table.py "$OUT/ours.xml" | tail -3
for repro in zero_overlap zero_bucket_reuse zero3_param_gather; do
  echo "== deepspeed: $repro, 3 runs per variant"
  timeout 200 python3 -m pytest_streamrace.repro $repro --backend cuda --repeat 3 > "$OUT/$repro.log" 2>&1
  echo "exit $?"; grep -E ": (reproduced|clean|inconclusive|error) [0-9]+/|every variant" "$OUT/$repro.log" | sort | uniq -c
done
echo "== megatron-core 0.15.2: megatron_instances, 3 runs per variant"
timeout 200 python3 -m pytest_streamrace.repro megatron_instances --backend cuda --steps 3 --repeat 3 \
  > "$OUT/megatron_instances.log" 2>&1
echo "exit $?"; grep -E "^megatron_instances/(unpatched|patched): |every variant" "$OUT/megatron_instances.log" | grep -v " — "
echo "total: $((SECONDS - start)) s"
