#!/usr/bin/env bash
# deepcompile_zero1 (DeepSpeed #8036) on 2 GPUs, on deepspeed 0.19.1 (bug native, patched variant applies the fix) and 0.19.8
# (fix native, unpatched variant re-introduces the bug): REPEAT runs per variant, then a compact table. Needs under
# .whl/: deepspeed-0.19.1-*.whl (pip wheel --no-deps --no-build-isolation deepspeed==0.19.1 -w .whl),
# deepspeed-0.19.8-*.whl and the hjson/pydantic wheels (docs/validation.md). DeepCompile JIT-builds its native op
# with nvcc on first use (about 30 s per version, kept under /tmp/tex-VERSION).
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/deepcompile.sh [REPEAT [VERSION...]]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0  # otherwise the op build dies parsing the arch list ("invalid literal ... '0a'")
OUT=${OUT:-/tmp/streamrace-deepcompile}; mkdir -p "$OUT"
REPEAT=${1:-10}; shift || true
VERSIONS=${*:-0.19.1 0.19.8}
common=".whl/hjson-*.whl .whl/pydantic*.whl .whl/annotated_types-*.whl .whl/typing_inspection-*.whl .whl/typing_extensions-*.whl"
for v in $VERSIONS; do
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-$v .whl/deepspeed-$v-*.whl $common
done
python3 -c "import importlib.metadata as m; m.version('pytest-streamrace')" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2  # once, as in megatron.sh
nvidia-smi -L
for v in $VERSIONS; do
  echo "== deepspeed $v: deepcompile_zero1, $REPEAT runs per variant"
  start=$SECONDS
  TORCH_EXTENSIONS_DIR=/tmp/tex-$v PYTHONPATH=/tmp/site-$v timeout 290 python3 -m pytest_streamrace.repro \
    deepcompile_zero1 --backend cuda --repeat "$REPEAT" --json "$OUT/deepcompile-$v.json" > "$OUT/deepcompile-$v.log" 2>&1
  echo "exit $?, $((SECONDS - start)) s"; grep -E "^  deepspeed|: (reproduced|clean|inconclusive|error) [0-9]+/|every variant|^error" "$OUT/deepcompile-$v.log"
  grep -B2 -A12 "the run failed" "$OUT/deepcompile-$v.log" | head -40
done
python3 - "$OUT" $VERSIONS <<'PY'
import json, os, statistics, sys
out, versions = sys.argv[1], sys.argv[2:]
print(f"\n{'deepspeed':10} {'variant':10} {'verdicts':24} {'retained/step':>13} {'partition':>10} {'step peak':>10}  (MiB, one rank, median of runs)")
for v in versions:
    path = os.path.join(out, f"deepcompile-{v}.json")
    if not os.path.exists(path):
        print(f"{v:10} no results ({path} missing; see the log)")
        continue
    runs = json.load(open(path))["runs"]
    peaks = {}
    for variant in ("unpatched", "patched"):
        mine = [r for r in runs if r["variant"] == variant]
        verdicts = {}
        for r in mine:
            verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
        text = ", ".join(f"{k} {n}/{len(mine)}" for k, n in verdicts.items()) or "none"
        nums = [r["numeric"][0] for r in mine if r.get("numeric")]
        med = lambda key: statistics.median(n[key] for n in nums) if nums else float("nan")
        peaks[variant] = med("step_peak_mib")
        print(f"{v:10} {variant:10} {text:24} {med('retained_mib'):13.1f} {med('partition_mib'):10.1f} {peaks[variant]:10.1f}")
    print(f"{v:10} step peak unpatched - patched: {peaks['unpatched'] - peaks['patched']:.1f} MiB")
PY
