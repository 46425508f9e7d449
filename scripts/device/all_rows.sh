#!/usr/bin/env bash
# The cost table's GPU rows (docs/validation.md): benchmarks/overhead.py's four rows side by side in one run (plain, the empty dispatch mode,
# the capture floor, the cuda backend and PyTorch's sanitizer, a process per configuration), on two H200s: the DDP row
# needs a GPU a rank. REPEAT times (default 4) a fresh process per configuration, all of a row's at once, before any
# measures (a process kept for every repeat biased its whole row); in each, 8
# cycles of one round per configuration, each ratio taken against plain's round of the same cycle (a step's time drifts
# by 10-30% over seconds on these hosts: larger_probe.sh). Rows print as they
# are measured (line-buffered all the way), so a run cut short keeps the rows it finished.
# MODELS="launch-bound larger" picks rows. The four rows took 530-590 s with five repeats on H200 pairs, near one device
# command's 600 (each row prints its seconds): on a slower host, split them over two calls (MODELS="launch-bound
# larger", then "DDP compiled").
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/all_rows.sh
set -u
. "$(dirname "$0")/setup.sh" all-rows
start=$SECONDS
python3 -c "from pytest_streamrace.detector import capture as c; print('built: capture', c.load() is not None, \
'trace', c.load_trace() is not None)"  # before the first timed process, not inside it
lscpu | grep -i numa; nvidia-smi topo -m | head -4  # the hosts so far: one NUMA node, so no pinning of processes
rows=()
for model in ${MODELS:-}; do rows+=(--model "$model"); done
echo "== overhead.py: ${MODELS:-the four rows}, ${REPEAT:-4} repeat(s)"
timeout "${LIMIT:-570}" python3 benchmarks/overhead.py --steps 30 --repeat "${REPEAT:-4}" ${rows[@]+"${rows[@]}"} 2>&1 \
  | grep --line-buffered -v -i warn | tee "$OUT/overhead.log"
echo "exit ${PIPESTATUS[0]}; total: $((SECONDS - start)) s"
