"""What the cuda detector does in Python on each step of overhead.py's 2-rank DDP row (NCCL, one GPU a rank): rank 0
runs under cProfile; the functions called at least once a step are printed by their own time. The per-op path is C++,
so what shows here is what the row pays in Python: modelled c10d ops, stream/event calls, the drain.

    device run (kind nvidia-h200-x2): . scripts/device/setup.sh ddp; python3 scripts/device/ddp_python_calls.py [MODE]
"""
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile

MODEL = "DDP MLP (8x512, batch 32, 2 ranks)"
STEPS = int(os.environ.get("STEPS", "100"))
CALLS_A_RUN = 6 + 5 * STEPS  # overhead.py's warm-ups and rounds

if len(sys.argv) > 2 and sys.argv[1] == "--rank":
    rank, store, mode = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    sys.path.insert(0, "benchmarks")
    from overhead import step_time

    if rank:
        step_time(MODEL, mode, STEPS, rank, store)
        sys.exit(0)
    profile = cProfile.Profile()
    ms = profile.runcall(step_time, MODEL, mode, STEPS, rank, store)
    print(f"{mode}: {ms:.3f} ms a step (under cProfile)")
    stats = pstats.Stats(profile)
    rows = [(tt, nc, func) for func, (cc, nc, tt, ct, callers) in stats.stats.items() if nc >= CALLS_A_RUN]
    rows.sort(reverse=True)
    total = sum(tt for tt, _, _ in rows)
    print(f"functions called at least once a step: {len(rows)}, their own time {total / CALLS_A_RUN * 1e3:.3f} ms a step")
    for tt, nc, (file, line, name) in rows[:40]:
        print(f"{nc / CALLS_A_RUN:8.1f}/step {tt / CALLS_A_RUN * 1e3:8.4f} ms/step  {name}  {os.path.relpath(file)}:{line}")
    sys.exit(0)

mode = sys.argv[1] if len(sys.argv) > 1 else "cuda"
with tempfile.TemporaryDirectory() as tmp:
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), f"{tmp}/store", mode]) for r in range(2)]
    sys.exit(max(p.wait(timeout=500) for p in procs))
