#!/usr/bin/env bash
# Stream hints on a GPU: torch's own AccumulateGrad stream-mismatch warning (TORCH_WARN_ONCE) reported for every test
# that triggers it in one pytest process, not only the first. One GPU is enough:
#   device run (kind nvidia-h200 or nvidia-h100-x1): bash scripts/device/hints.sh
# Expected: both tests listed under "streamrace hints" as "(torch warning)".
set -u
OUT=${OUT:-/tmp/streamrace-hints}; mkdir -p "$OUT"
python3 -m pip show pytest-streamrace >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
work=$(mktemp -d)
cat > "$work/test_two_mismatches.py" <<'PY'
import torch

def bound_backward():
    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        node = p.expand_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad (and its hooks) bound to `side`
    (p * 2).sum().backward()
    torch.cuda.synchronize()
    del node

def test_first():
    bound_backward()

def test_second():
    bound_backward()
PY
cd "$work" && python3 -m pytest -p no:cacheprovider --streamrace --streamrace-backend=cuda test_two_mismatches.py 2>&1 \
  | tee "$OUT/hints.log" | sed -n '/streamrace hints/,$p'
