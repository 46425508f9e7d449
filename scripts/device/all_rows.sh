#!/usr/bin/env bash
# Issue 23's "done when": benchmarks/overhead.py's four rows side by side in one run (plain, the empty dispatch mode,
# the capture floor, the cuda backend and PyTorch's sanitizer, a process per configuration), on two H200s: the DDP row
# needs a GPU a rank. Every configuration REPEAT times (default 5), interleaved; each row's slowdown is the median of
# its repeats' ratios. Each configuration's process starts, builds and compiles once and serves every repeat, so
# repeats cost seconds; a row's configurations start together, before any measures. Rows print as
# they are measured (line-buffered all the way), so a run cut short keeps the rows it finished. (Twenty-first session:
# with a process per measurement, three repeats did not finish in 570 s and the pipe held back every row.)
# MODELS="launch-bound larger" picks rows.
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/all_rows.sh
set -u
. "$(dirname "$0")/setup.sh" all-rows
start=$SECONDS
python3 -c "from pytest_streamrace.detector import capture as c; print('built: capture', c.load() is not None, \
'trace', c.load_trace() is not None)"  # before the first timed process, not inside it
rows=()
for model in ${MODELS:-}; do rows+=(--model "$model"); done
echo "== overhead.py: ${MODELS:-the four rows}, ${REPEAT:-5} repeat(s)"
timeout "${LIMIT:-500}" python3 benchmarks/overhead.py --steps 30 --repeat "${REPEAT:-5}" ${rows[@]+"${rows[@]}"} 2>&1 \
  | grep --line-buffered -v -i warn | tee "$OUT/overhead.log"
echo "exit ${PIPESTATUS[0]}; total: $((SECONDS - start)) s"
