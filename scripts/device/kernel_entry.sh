#!/usr/bin/env bash
# The cuda backend's ops through the capture's kernel entry (detector/kernel_entry.cpp) instead of
# RecordFunction callbacks: what it could have broken, then what it costs. PART picks:
#   verdicts (default): the cuda unit tests; the corpus on the cuda backend; the stock stacks on NCCL; the zero_overlap
#     repro. Nothing may move.
#   repros: zero_bucket_reuse, zero3_param_gather (DeepSpeed 0.19.8) and megatron_instances (megatron-core 0.15.2),
#     two runs per variant.
#   paired: the launch-bound and DDP rows in paired rounds, RecordFunction's own cost beside the capture floor.
# With the wheels under .whl/ (docs/validation.md says how):
#   device run (kind nvidia-h200-x2, carry .whl): PART=verdicts bash scripts/device/kernel_entry.sh
set -u
. "$(dirname "$0")/setup.sh" kernel-entry
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
pt="python3 -m pytest -p no:cacheprovider"
start=$SECONDS
case "${PART:-verdicts}" in
verdicts)
  echo "== cuda unit tests (the capture rebuilt against this torch)"
  timeout 200 $pt tests/test_cuda_backend.py tests/test_capture.py -q -n 0 > "$OUT/unit.log" 2>&1
  echo "exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/unit.log" | head; tail -1 "$OUT/unit.log"
  echo "== corpus on the cuda backend"
  PYTHONPATH=/tmp/site timeout 150 $pt tests/corpus/corpus_cases.py --streamrace --streamrace-backend=cuda \
    --junitxml="$OUT/corpus.xml" -q > "$OUT/corpus.log" 2>&1; tail -1 "$OUT/corpus.log"
  python3 scripts/device/corpus_table.py "$OUT/corpus.xml" | tail -3
  stacks_and_zero_overlap 200;;
repros)
  for repro in zero_bucket_reuse zero3_param_gather; do
    echo "== deepspeed: $repro, 2 runs per variant"
    PYTHONPATH=/tmp/site timeout 170 python3 -m pytest_streamrace.repro $repro --backend cuda --repeat 2 \
      > "$OUT/$repro.log" 2>&1
    echo "exit $?"; grep -E ": (reproduced|clean|inconclusive|error) [0-9]+/|every variant" "$OUT/$repro.log" | sort | uniq -c
  done
  echo "== megatron-core 0.15.2: megatron_instances, 2 runs per variant"
  PYTHONPATH=/tmp/site timeout 170 python3 -m pytest_streamrace.repro megatron_instances --backend cuda --steps 3 \
    --repeat 2 > "$OUT/megatron_instances.log" 2>&1
  echo "exit $?"; grep -E "^megatron_instances/(unpatched|patched): |every variant" "$OUT/megatron_instances.log" | grep -v " — ";;
paired)
  echo "== launch-bound, paired"
  timeout 150 python3 benchmarks/paired_overhead.py --backend cuda --rounds 5 2>&1 | grep -v -i warn
  echo "== DDP, paired (NCCL, a process a rank)"
  timeout 200 python3 benchmarks/paired_overhead.py --model ddp --backend cuda --rounds 6 2>&1 | grep -v -i warn;;
*) echo "kernel_entry.sh: unknown PART '${PART}' (verdicts|repros|paired)"; exit 2;;
esac
echo "total: $((SECONDS - start)) s"
