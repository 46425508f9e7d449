#!/usr/bin/env bash
# Detection in rank processes that other harnesses start, on GPUs (cuda backend, NCCL, one GPU per rank):
#   mptc      PyTorch's MultiProcessTestCase and torch.multiprocessing.spawn, racy/clean twins
#             (scripts/device/harness_cases.py), without and with --streamrace;
#   coalesce  DeepSpeed's own tests/unit/v1/zero/test_zero_coalesce_grad_reduction.py, without and with --streamrace
#             (outcomes compared test by test), then a race planted in a DistributedTest body
#             (scripts/device/ds_planted_race.py: a reused pool, clean test first, racy second);
#   zero      a selection of classes of DeepSpeed's tests/unit/v1/zero/test_zero.py, without and with --streamrace.
# Each part fits one device command (< 10 min); `all` runs them in turn.
# On the lent 2-GPU machine, with the wheels under .whl/ and DeepSpeed's tests under .gpu/ds-tests/tests (from
# DeepSpeed's repository, `git archive <commit> tests`; .gpu/ds-tests/COMMIT names the commit; not committed here):
#   device run (kind nvidia-h200-x2, carry .whl .gpu/ds-tests): bash scripts/device/harnesses.sh mptc|coalesce|zero|all
# MultiProcessTestCase needs expecttest: where .whl/ has no wheel of it, carry the package itself (twenty-second
# session: `cp -r .venv/lib/python3.11/site-packages/expecttest .gpu/site/`, carry .gpu, EXTRA_SITE=.gpu/site).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=4
# DeepSpeed's FusedAdam JIT build (most of test_zero.py) dies parsing the image's arch list ("invalid literal ... '0a'")
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/tex
OUT=${OUT:-/tmp/streamrace-harnesses}; mkdir -p "$OUT"
part=${1:-all}
case "$part" in mptc|coalesce|zero|all) ;; *) echo "harnesses.sh: unknown part '$part' (mptc|coalesce|zero|all)"; exit 2;; esac
REPO=$PWD
DS=$REPO/.gpu/ds-tests/tests
date -u; nvidia-smi -L
# deepspeed 0.19.8, its dependencies and expecttest (MultiProcessTestCase needs it): every wheel but other frameworks
wheels=$(ls .whl/*.whl | grep -v -e '/deepspeed-' -e '/megatron')
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-ds .whl/deepspeed-0.19.8-*.whl $wheels \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site-ds${EXTRA_SITE:+:$(cd "$EXTRA_SITE" && pwd)}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import expecttest" 2>/dev/null || { echo "harnesses.sh: expecttest is missing (its wheel in .whl/, or" \
  "EXTRA_SITE=a folder holding the package)"; exit 2; }
python3 -c "import torch, pytest, deepspeed, expecttest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pytest', pytest.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1
[ -f .gpu/ds-tests/COMMIT ] && echo "DeepSpeed tests from commit $(cat .gpu/ds-tests/COMMIT)"
pt="python3 -m pytest -p no:cacheprovider -p no:randomly"

# outcomes of a junit XML file: one "test outcome" line each
outcomes() {
  python3 - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    kids = {child.tag for child in case}
    outcome = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
    print(f"{case.get('classname')}::{case.get('name')} {outcome}")
EOF
}

# run the same selection without and with --streamrace; print counts and every test whose outcome differs
compare() {  # name, timeout per run, pytest args...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" $pt "$@" -q --color=no --junitxml="$OUT/$name-plain.xml" > "$OUT/$name-plain.log" 2>&1
  echo "$name plain: exit $? in $((SECONDS - start)) s: $(tail -1 "$OUT/$name-plain.log" | sed "s/\x1b\[[0-9;]*m//g")"
  start=$SECONDS
  timeout "$limit" $pt "$@" -q --color=no --streamrace --junitxml="$OUT/$name-streamrace.xml" \
    --streamrace-json "$OUT/$name-races.json" > "$OUT/$name-streamrace.log" 2>&1
  echo "$name --streamrace: exit $? in $((SECONDS - start)) s: $(tail -1 "$OUT/$name-streamrace.log" | sed "s/\x1b\[[0-9;]*m//g")"
  outcomes "$OUT/$name-plain.xml" > "$OUT/$name-plain.txt" 2>/dev/null
  outcomes "$OUT/$name-streamrace.xml" > "$OUT/$name-streamrace.txt" 2>/dev/null
  echo "$name: tests whose outcome differs (plain → --streamrace):"
  join <(sort "$OUT/$name-plain.txt") <(sort "$OUT/$name-streamrace.txt") | awk '$2 != $3 {print "  " $1 ": " $2 " → " $3; n++} END {print "  (" n+0 " differ)"}'
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['races']; print('  races in the JSON:', len(r), sorted({x['test'] for x in r})[:8])" \
    "$OUT/$name-races.json" 2>/dev/null
}

if [ "$part" = mptc ] || [ "$part" = all ]; then
  echo "== MultiProcessTestCase and mp.spawn on NCCL: plain (races silent), then --streamrace (racy twins fail)"
  timeout 200 $pt scripts/device/harness_cases.py -rA --color=no > "$OUT/mptc-plain.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)" "$OUT/mptc-plain.log"; tail -1 "$OUT/mptc-plain.log"
  timeout 300 $pt scripts/device/harness_cases.py -rA --color=no --streamrace --streamrace-json "$OUT/mptc-races.json" \
    > "$OUT/mptc-streamrace.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|^stream race on" "$OUT/mptc-streamrace.log"; tail -1 "$OUT/mptc-streamrace.log"
fi

if [ "$part" = coalesce ] || [ "$part" = all ]; then
  [ -d "$DS/unit" ] || { echo "no DeepSpeed tests under $DS"; exit 2; }
  echo "== DeepSpeed test_zero_coalesce_grad_reduction.py, plain vs --streamrace"
  # 14 of its 49 tests (bit-exact multi-backward ZeRO 1/2/3 with and without CPU offload and fp16, collective counts):
  # the whole file takes longer than one device command allows for two runs
  coalesce_k=${COALESCE_K:-TestCoalesceCorrectness or TestCoalesceFP16 or TestCoalesceCollectiveCount}
  (cd "$DS" && OUT=$OUT compare coalesce 280 unit/v1/zero/test_zero_coalesce_grad_reduction.py -k "$coalesce_k")
  echo "== a race planted in a DistributedTest body (reused pool: clean test, then racy test)"
  cp scripts/device/ds_planted_race.py "$DS/unit/test_streamrace_planted.py"
  (cd "$DS" && timeout 150 $pt unit/test_streamrace_planted.py -rA --color=no --streamrace > "$OUT/planted.log" 2>&1)
  grep -E "^(PASSED|FAILED|ERROR)|^stream race on|seen . times" "$OUT/planted.log" | sed 's/\x1b\[[0-9;]*m//g'
  tail -1 "$OUT/planted.log"
fi

if [ "$part" = zero ] || [ "$part" = all ]; then
  [ -d "$DS/unit" ] || { echo "no DeepSpeed tests under $DS"; exit 2; }
  # 20 of its 99 tests (each starts fresh rank processes: ~10 s a test)
  classes="TestZeroUnbalancedGradients or TestZero3RepeatForwardLoop or TestZeroToFP32 or TestPartitionNcclAlignment"
  classes=${ZERO_K:-$classes or TestZeroFrozenWeights or TestZero3DictFwd}
  echo "== DeepSpeed test_zero.py ($classes), plain vs --streamrace"
  (cd "$DS" && OUT=$OUT compare zero 280 unit/v1/zero/test_zero.py -k "$classes")
fi
