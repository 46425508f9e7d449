"""Threads on real streams (cuda backend): tests/test_threads.py's user-thread cases, which take the
device from `streamrace_device`, run on a GPU under --streamrace. Prints one line per case and exits non-zero if a
racy case passed or a clean one failed. Run by scripts/device/single_gpu.sh:

    python scripts/device/threads_cuda.py OUTDIR
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RACY = re.compile(r"without_stream_wait|started_before_the_test|serves_a_later_test")


def main(out: str) -> int:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_threads import USER_THREADS

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "test_user_threads_cuda.py")
    with open(path, "w") as f:
        f.write(USER_THREADS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", path, "--streamrace",
                          "--streamrace-backend=cuda", "-rA", "-q"], capture_output=True, text=True, cwd=out)
    with open(os.path.join(out, "threads_cuda.log"), "w") as f:
        f.write(run.stdout + run.stderr)
    wrong = 0
    for outcome, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", run.stdout, re.M):
        expected = "FAILED" if RACY.search(name) else "PASSED"
        wrong += outcome != expected
        print(f"{name:55} {outcome:7} expected {expected}{'' if outcome == expected else '  <-- WRONG'}")
    print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/streamrace-threads"))
