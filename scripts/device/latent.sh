#!/usr/bin/env bash
# Latent races on real streams, cuda backend, one GPU:
#   device run (kind nvidia-h200 or nvidia-h100-x1): bash scripts/device/latent.sh
# Cases, each a test under --streamrace --streamrace-backend=cuda:
#   item / cpu / nonzero: produced on a side stream, read back there, then used on the default stream with no wait
#                         -> a latent race each, named ".item()" / ".cpu() / .to('cpu') / ..." (or "copy_ to host
#                         memory", whichever op the capture ends first) / "nonzero": the op the sync callback came from;
#                         "an implicit host sync" would mean the naming failed (a bug to report)
#   wait_stream / synchronize / event_synchronize: the same with a device-side wait or an explicit sync -> clean
#   timer: an explicit torch.cuda.synchronize() in timer.py; with incidental-sync:timer.py -> latent, named
#          "torch.cuda.synchronize() (incidental)"; without the rule -> clean
#   real: no read-back at all -> a race (not latent)
# Expected (printed at the end from the JSON): report mode passes all but test_real; fail mode also fails item, cpu,
# nonzero; "latent" ops as above; no latent record for the clean cases.
set -u
OUT=${OUT:-/tmp/streamrace-latent}; mkdir -p "$OUT"
python3 -m pip show pytest-streamrace >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
work=$(mktemp -d)
cat > "$work/timer.py" <<'PY'
import torch

def time_step():
    torch.cuda.synchronize()  # a framework timer's sync
PY
cat > "$work/test_latent_gpu.py" <<'PY'
import pytest, torch
from timer import time_step

def produced():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is still busy when the host moves on
        x = torch.ones(1 << 20, device="cuda") * 2
    return side, x

@pytest.mark.parametrize("read_back", ["item", "cpu", "nonzero"])
def test_read_back(read_back):
    side, x = produced()
    with torch.cuda.stream(side):
        {"item": lambda: x.sum().item(), "cpu": lambda: x.cpu(), "nonzero": lambda: x.nonzero()}[read_back]()
    x.add_(1)  # latent: ordered only by the read-back

@pytest.mark.parametrize("how", ["wait_stream", "synchronize", "event_synchronize"])
def test_clean(how):
    side, x = produced()
    with torch.cuda.stream(side):
        x.sum().item()
        event = torch.cuda.Event()
        event.record()
    if how == "wait_stream":
        torch.cuda.current_stream().wait_stream(side)
    elif how == "synchronize":
        torch.cuda.synchronize()
    else:
        event.synchronize()
    x.add_(1)

def test_timer():
    side, x = produced()
    time_step()
    x.add_(1)

def test_real():
    side, x = produced()
    x.add_(1)
PY
echo "incidental-sync:timer.py" > "$work/s.supp"
cd "$work"
run() {  # name, args...
  local name=$1; shift
  python3 -m pytest -p no:cacheprovider --streamrace --streamrace-backend=cuda -rA --streamrace-json "$OUT/$name.json" \
    --streamrace-trace "$OUT/$name.trace.json" "$@" test_latent_gpu.py > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -E "^(PASSED|FAILED)|^streamrace:" "$OUT/$name.log"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["races"]:
    latent = r.get("latent")
    print(f"  {r['test'].split('::')[1]:34} {'latent ' if latent else ''}{r['kind']:18} "
          f"{r['earlier']['stream'][:28]:28} -> {r['later']['stream'][:20]:20} "
          f"{'hidden by ' + latent['op'] + ' at ' + latent['at'] if latent else ''}")
PY
}
run report
run fail --streamrace-latent=fail
run incidental --streamrace-suppress s.supp
run off --streamrace-latent=off
