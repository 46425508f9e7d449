#!/usr/bin/env bash
# Issue 23's "done when": benchmarks/overhead.py's four rows side by side in one run (plain, the empty dispatch mode,
# the capture floor, the cuda backend and PyTorch's sanitizer, a process per configuration), on two H200s: the DDP row
# needs a GPU a rank. Every configuration REPEAT times (default 3), interleaved; each row's slowdown is the median of
# its repeats' ratios. The script prints each row as it is measured, so a run cut short keeps the rows it finished.
#   device run (kind nvidia-h200-x2, carry .whl): bash scripts/device/all_rows.sh
set -u
. "$(dirname "$0")/setup.sh" all-rows
start=$SECONDS
python3 -c "from pytest_streamrace.detector import capture as c; print('built: capture', c.load() is not None, \
'trace', c.load_trace() is not None)"  # before the first timed process, not inside it
echo "== overhead.py: the four rows, ${REPEAT:-3} repeats"
timeout "${LIMIT:-570}" python3 benchmarks/overhead.py --steps 30 --repeat "${REPEAT:-3}" 2>&1 | grep -v -i warn \
  | tee "$OUT/overhead.log"
echo "exit ${PIPESTATUS[0]}; total: $((SECONDS - start)) s"
