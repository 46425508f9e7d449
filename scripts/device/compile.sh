#!/usr/bin/env bash
# GPU part of issue 13: compiled code under --streamrace on the cuda backend. Run on one GPU (nvidia-h100-x1 or
# nvidia-h200):
#   bash scripts/device/compile.sh
# Racy/clean twins of compiled code (Inductor's Triton kernels, a triton_op user kernel, a CUDA-graph replay,
# max-autotune-no-cudagraphs, backward and a compiled-autograd hook), the #8061 hook-stream experiment, and the
# overhead benchmark with its compiled training step. Logs land in $OUT; a compact table closes the output.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/tex TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
OUT=${OUT:-/tmp/streamrace-compile}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
date -u; nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import pytest_streamrace.plugin" || exit 1
pt="python3 -m pytest -p no:cacheprovider"
echo "== compiled cases, ours (cuda backend)"
timeout 420 $pt tests/compile/cuda_cases.py --streamrace --streamrace-backend=cuda -rA --junitxml="$OUT/ours.xml" \
  --streamrace-json "$OUT/races.json" > "$OUT/cases.log" 2>&1; echo "exit $?"; tail -3 "$OUT/cases.log"
echo "== #8061: which stream gradient hooks run on"
timeout 180 python3 scripts/device/hook_streams.py 2>&1 | grep -v Warning | tee "$OUT/hook_streams.log" | tail -5
echo "== overhead"
timeout 420 python3 benchmarks/overhead.py --steps 30 2>&1 | tee "$OUT/overhead.log" | tail -5
echo "== table"
python3 - "$OUT/ours.xml" "$OUT/races.json" <<'PY' | tee "$OUT/table.md"
import json, sys, xml.etree.ElementTree as ET
cases = {}
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name = tc.get("name")  # test_racy[functional]
    kind, case = name.split("[")[0].replace("test_", ""), name.split("[")[1].rstrip("]")
    bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
    skip = tc.find("skipped") is not None
    cases.setdefault(case, {})[kind] = "skip" if skip else ("FAIL" if bad is not None else "ok")
    if bad is not None:
        cases[case][kind + "_why"] = (bad.get("message") or "")[:90].replace("\n", " ")
try:
    races = json.load(open(sys.argv[2]))["races"]
except Exception:
    races = []
ops = {}
for r in races:
    case = r["test"].split("[")[-1].rstrip("]")
    ops.setdefault(case, set()).add(r["earlier"]["op"])
print("| case | racy twin | clean twin | racing writer ops |")
print("|---|---|---|---|")
for case, got in cases.items():
    print(f"| {case} | {got.get('racy', '-')} | {got.get('clean', '-')} | {', '.join(sorted(ops.get(case, ())))[:80]} |")
    for k in ("racy_why", "clean_why"):
        if k in got:
            print(f"|   {k} | {got[k]} | | |")
PY
