#!/usr/bin/env bash
# The larger row taken apart (larger_probe.py: wall, CPU, kernel time, runtime calls and
# allocator counters a step, plain / capture floor / cuda, a fresh process each). PART picks:
#   split (default): the larger and launch-bound rows through larger_probe.py, then overhead.py's larger row twice:
#     as it runs, and with every process on the same two cores (taskset);
#   noise: plain and the capture floor, five processes each, then the same with PYTHONHASHSEED=0 and no ASLR (does a
#     process's step time depend on its layout?).
#   device run (one H200): PART=split bash scripts/device/larger_probe.sh
set -u
. "$(dirname "$0")/setup.sh" larger-probe
start=$SECONDS
python3 -c "from pytest_streamrace.detector import capture as c; print('built', c.load() is not None, c.load_trace() is not None)"
nproc; lscpu | grep -E "Model name|NUMA|Thread"
probe="python3 scripts/device/larger_probe.py"
case "${PART:-split}" in
split)
  echo "== probe: larger";       timeout 200 $probe --model larger 2>&1 | grep -v -i warn
  echo "== probe: launch-bound"; timeout 120 $probe --model launch-bound --repeat 1 2>&1 | grep -v -i warn
  echo "== overhead.py larger, as it runs"
  timeout 150 python3 benchmarks/overhead.py --steps 30 --repeat 5 --model larger 2>&1 | grep -v -i warn
  echo "== overhead.py larger, every process on cores 2-3"
  timeout 150 taskset -c 2-3 python3 benchmarks/overhead.py --steps 30 --repeat 5 --model larger 2>&1 | grep -v -i warn;;
noise)
  echo "== default env"
  timeout 170 $probe --model larger --repeat 5 --rounds 10 --modes plain,capture-floor 2>&1 | grep -v -i warn \
    | grep -v "runtime calls"
  echo "== PYTHONHASHSEED=0, no ASLR"
  PYTHONHASHSEED=0 timeout 170 setarch "$(uname -m)" -R $probe --model larger --repeat 5 --rounds 10 \
    --modes plain,capture-floor 2>&1 | grep -v -i warn | grep -v "runtime calls";;
*) echo "larger_probe.sh: unknown PART '${PART}' (split|noise)"; exit 2;;
esac
echo "total: $((SECONDS - start)) s"
