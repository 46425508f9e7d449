"""Slowdown of a training step under ``--streamrace``'s detector, against plain eager (and, on a GPU, against
PyTorch's CUDA stream sanitizer on the same step).

    python benchmarks/overhead.py            # CPU: virtual backend; GPU: cuda backend and TORCH_CUDA_SANITIZER

Each configuration runs in its own process (the sanitizer cannot be switched off once on); a row's processes start
together and, once all are ready, measure one round at a time in turn (`--cycles` turns), each against plain's round
of the same turn; each repeat starts fresh ones. Prints a table of ms per step and the slowdown against plain.
"empty-mode" is a TorchDispatchMode that only calls through: the cost of entering Python for every op, the floor for
any tool built on one (PyTorch's sanitizer is; the virtual backend's fallback is). "capture-floor" is the C++ op capture
alone (``detector/capture.py``, through its kernel entry, as the detector takes it): records dropped each step unread.
The compiled model's forward runs under torch.compile (Inductor) and compiles under the detector; tools built on a
plain dispatch mode make dynamo skip compiling, so they get no number there (nan).

    python benchmarks/overhead.py --latent   # the latent view's cost: --streamrace-latent=report against off
    python benchmarks/overhead.py --repeat 3 # fresh processes 3 times: steadier slowdowns
    python benchmarks/overhead.py --model DDP --under run   # also under `streamrace run`, beside --streamrace

With ``--under run`` a configuration "run" joins the row: plain's processes (one a rank), each started by
``streamrace run --backend B --``, whose followed process runs the detector the command gives every process of a
program; its slowdown prints beside the in-process detector's (``--streamrace``'s), and then the two compared
("run vs in-process", 1.00x where the command adds nothing to a step).

On two GPUs (after ``. scripts/device/setup.sh``), ``python benchmarks/overhead.py --steps 30 --repeat 3`` re-runs the
four GPU rows of docs/validation.md's cost table.

With ``--latent`` every step reads its loss back (``loss.item()``, as logging does: the implicit sync that splits the
latent view's clocks from the normal ones), and the detector runs twice: latent races kept (report, the default) and
not (``-latent-off``: every sync counts, one view).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MODELS = {  # name: (width, depth, batch, ranks, torch.compile'd); ranks > 1: DistributedDataParallel, a process a rank
    "launch-bound MLP (8x64, batch 8)": (64, 8, 8, 1, False),
    "larger MLP (4x2048, batch 256)": (2048, 4, 256, 1, False),
    "DDP MLP (8x512, batch 32, 2 ranks)": (512, 8, 32, 2, False),
    "compiled MLP (8x64, batch 8, inductor)": (64, 8, 8, 1, True),
}
# A dispatch mode without ignore_compile_internals makes dynamo skip compiling (the step would run eager): no number.
NOT_COMPILED_UNDER = ("empty-mode", "sanitizer")
OPTIONAL = ("capture-floor", "sanitizer")  # a row goes on without them (no compiler; the sanitizer raised): nan


LATENT_OFF = "-latent-off"  # a detector mode's suffix: Detector(latent=False), i.e. --streamrace-latent=off
RUN = "run"  # plain's worker started under `streamrace run`: the detector of a followed process


def _print(value) -> None:
    print(json.dumps(value), flush=True)


def serve(model_name: str, mode: str, steps: int, rank: int = 0, store: str = "", read_back: bool = False,
          requests=sys.stdin, answer=_print) -> None:
    """One configuration in this process: built, compiled and warmed up (answers "ready"), then one measurement per
    line read from `requests`, its ms a step answered (printed as a JSON line). The "ready" lets main() start a row's
    configurations together and measure none until all have started (`measure_once`)."""
    import torch

    width, depth, batch, ranks, compiled = MODELS[model_name]
    cuda = torch.cuda.is_available()
    if compiled and mode in NOT_COMPILED_UNDER:
        answer("ready")
        for _ in requests:
            answer(float("nan"))
        return
    if ranks > 1:  # one GPU a rank (nccl) where there are enough, else gloo on CPU
        import torch.distributed as dist

        cuda = cuda and torch.cuda.device_count() >= ranks
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=ranks)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    if ranks > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    forward = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward(x).pow(2).mean()
        loss.backward()
        opt.step()
        if read_back:
            loss.item()

    def measure(after_step=lambda: None) -> None:
        """Warm up (the first time: compile), say so, then per request (its number of rounds) the median of that many
        rounds of `steps` steps, after 3 warm-up steps of its own (the process sat idle while the others measured)."""
        for _ in range(3):
            step()
            after_step()
        answer("ready")
        for request in requests:
            for _ in range(3):
                step()
                after_step()
            rounds = []
            for _ in range(int(request)):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                    after_step()
                if cuda:
                    torch.cuda.synchronize()
                rounds.append((time.perf_counter() - start) / steps * 1e3)
            answer(statistics.median(rounds))

    if mode == "plain":
        return measure()
    if mode == "empty-mode":  # the floor of any TorchDispatchMode-based tool: entering Python for every op
        from torch.utils._python_dispatch import TorchDispatchMode

        class Empty(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Empty():
            return measure()
    if mode == "capture-floor":  # the cuda backend's C++ op capture alone: records dropped unread each step
        from paired_overhead import capture_alone

        extension = capture_alone(cuda)
        try:
            return measure(after_step=extension.discard)
        finally:
            extension.disable()
    if mode == "sanitizer":
        from torch.cuda._sanitizer import enable_cuda_sanitizer

        enable_cuda_sanitizer()
        return measure()
    from pytest_streamrace.detector.session import Detector

    with Detector(backend=mode.removesuffix(LATENT_OFF), latent=not mode.endswith(LATENT_OFF)) as detector:
        measure()
    if detector.races:  # a stock step is correct: a report here is a false positive, never a number to print
        raise SystemExit(f"{mode}: {len(detector.races)} races reported on a correct step")


def step_time(model_name: str, mode: str, steps: int, rank: int = 0, store: str = "", read_back: bool = False) -> float:
    """One measurement in this process, as `serve` makes it (3 + 3 warm-up steps, then 5 rounds of `steps`)."""
    answers = []
    serve(model_name, mode, steps, rank, store, read_back, requests=["5"], answer=answers.append)
    return answers[-1]


class Configuration:
    """One configuration's process (one a rank), serving measurements on request; rank 0's answer is the result.
    Its stderr goes to a file: a pipe nobody reads would fill with a compile's warnings and stop it. A worker that
    gives no answer within `answer_within` seconds (a start with its compile, or one measurement) is hung: its
    threads' stacks go to that file (faulthandler, on SIGUSR1), it is killed, and the failure says which rank."""

    answer_within = 600.0

    def __init__(self, model: str, mode: str, steps: int, latent: bool, tmp: str, backend: str = "virtual"):
        self.mode = mode
        self.failure: str | None = None  # close()'s answer, once closed
        self.hung: list[int] = []  # the ranks that gave no answer in time
        ranks = MODELS[model][3]
        command = [sys.executable, __file__, "--steps", str(steps), "--worker", model,
                   "plain" if mode == RUN else mode] + (["--latent"] if latent else [])
        if mode == RUN:  # a race on the correct step exits 3 there, which close() reports as this row's failure
            command = [sys.executable, "-m", "pytest_streamrace", "run", "--backend", backend, "--", *command]
        from paired_overhead import rank_env

        env = rank_env() if ranks > 1 else None
        name = f"{tmp}/{mode}"
        self.errors = [open(f"{name}.{r}.err", "w+") for r in range(ranks)]
        self.procs = [subprocess.Popen(command + (["--rank", str(r), "--store", f"{name}.store"] if ranks > 1 else []),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors[r],
                                       text=True, env=env) for r in range(ranks)]

    def ready(self) -> None:
        """Waits for its "ready": built, compiled and warmed up."""
        self._answers()

    def _answers(self) -> list:
        answers = []
        for rank, proc in enumerate(self.procs):
            watchdog = threading.Timer(self.answer_within, self._hang_up, (rank,))
            watchdog.daemon = True
            watchdog.start()
            try:
                while True:  # the next JSON line: anything else a library prints to stdout is passed over
                    line = proc.stdout.readline()
                    if not line:
                        raise RuntimeError(self.close() or f"{self.mode}: the worker ended without an answer")
                    try:
                        answers.append(json.loads(line))
                        break
                    except ValueError:
                        continue
            finally:
                watchdog.cancel()
            if self.hung:  # the answer came as the watchdog went off: too late all the same
                raise RuntimeError(self.close())
        return answers

    def _hang_up(self, rank: int) -> None:
        """The watchdog: rank `rank` gave no answer in time. Every rank still running (one may be waiting on another
        in a collective) writes its stacks to its stderr file, and then all are killed, which ends the read."""
        alive = [proc for proc in self.procs if proc.poll() is None]
        self.hung = [self.procs.index(proc) for proc in alive] or [rank]
        for proc in alive:
            proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)  # faulthandler writes the stacks from its signal handler, at once
        for proc in alive:
            proc.kill()

    def measure(self, rounds: int) -> float:
        for proc in self.procs:
            proc.stdin.write(f"{rounds}\n")
            proc.stdin.flush()
        return self._answers()[0]

    def close(self) -> str:
        """Ends the processes: "" where all exited cleanly, else each failed rank's stderr tail. Once."""
        if self.failure is not None:
            return self.failure
        failure = ""
        for rank, (proc, err) in enumerate(zip(self.procs, self.errors)):
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            err.seek(0)
            text = err.read()
            err.close()
            if proc.returncode != 0 or rank in self.hung:
                why = f"no answer in {self.answer_within:g} s" if rank in self.hung else f"exit {proc.returncode}"
                failure += f"{self.mode} failed (rank {rank}: {why}):\n{text[-3000:]}\n"
        self.failure = failure.rstrip("\n")
        return self.failure


def measure_once(model: str, order: list, args, runs: dict, backend: str = "virtual") -> str:
    """One repeat of a row: a fresh process for each configuration (a process a rank), all started at once and waited
    for before any measures, then `args.cycles` cycles, each measuring every configuration once (one round of
    `args.steps` steps), in `order` rotated a place each cycle; the sanitizer, ten times slower than the rest, once
    after them (three rounds). Appends the repeat's list of measurements to each `runs[mode]` (nan for an optional one
    that failed).

    Fresh processes each repeat: where a process landed (its core, its memory, its GPU context) biases all its numbers
    alike, so a process kept for every repeat biased a whole row (a 2xH200 run read one row's capture floor at 1.02x,
    then 1.14x on the next machine). Short cycles: on the GPU hosts a step's time drifts by 10-30% over seconds (plain
    processes run one after another read 1.08-1.48 ms a larger step, each steady within itself), so a configuration is
    compared with plain measured just before or after it, not seconds apart. Returns the failure that fails the row,
    or ""."""
    cycled = [mode for mode in order if mode != "sanitizer"]
    with tempfile.TemporaryDirectory() as tmp:
        started = {mode: Configuration(model, mode, args.steps, args.latent, tmp, backend) for mode in order}
        ready: dict[str, Configuration] = {}
        for mode in order:
            runs[mode].append([])
        try:
            for mode, configuration in started.items():
                try:
                    configuration.ready()
                    ready[mode] = configuration
                except RuntimeError as exc:
                    if mode not in OPTIONAL:
                        return str(exc)
                    print(f"{model}: {exc}", file=sys.stderr)
            plan = [(cycled[c % len(cycled):] + cycled[:c % len(cycled)], 1) for c in range(args.cycles)]
            plan += [(["sanitizer"], 3)] if "sanitizer" in order else []
            for modes, rounds in plan:
                for mode in modes:
                    try:
                        runs[mode][-1].append(ready[mode].measure(rounds) if mode in ready else float("nan"))
                    except RuntimeError as exc:  # the worker ended mid-run
                        if mode not in OPTIONAL:
                            return str(exc)
                        print(f"{model}: {exc}", file=sys.stderr)
                        ready.pop(mode)
                        runs[mode][-1].append(float("nan"))
        finally:
            closed = [c.close() for c in started.values()]  # a race on a correct step fails its worker's exit
        return "\n".join(f for f in closed if f)


def slowdown(runs: dict, mode: str, base: str = "plain") -> str:
    """`mode`'s slowdown against `base`: the median of its ratios to `base` in the same cycle (for the sanitizer, to
    its repeat's median `base`), over every cycle of every repeat; then the range of the repeats' own medians (how
    far one repeat, the single run a reader might otherwise trust, strays from it)."""
    every, per_repeat = [], []
    for measured, bases in zip(runs[mode], runs[base]):
        if len(measured) == len(bases):
            ratios = [m / b for m, b in zip(measured, bases)]
        else:
            ratios = [m / statistics.median(bases) for m in measured]
        every += ratios
        per_repeat.append(statistics.median(ratios))
    per_repeat.sort()
    spread = f" [{per_repeat[0]:.2f}-{per_repeat[-1]:.2f}]" if len(per_repeat) > 1 else ""
    return f"{statistics.median(every):.2f}x{spread}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--model", action="append", default=[], metavar="TEXT",
                        help="only the rows whose name contains TEXT (repeatable)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="start every configuration's process N times (ms: medians; slowdowns: the median of "
                             "every cycle's ratio, then [lowest-highest] of the repeats' medians)")
    parser.add_argument("--cycles", type=int, default=8, metavar="N",
                        help="measurements of each configuration a repeat, interleaved one round at a time")
    parser.add_argument("--latent", action="store_true",
                        help="read the loss back every step and compare --streamrace-latent=report against off")
    parser.add_argument("--under", choices=[RUN], action="append", default=[],
                        help="also measure plain's worker under `streamrace run` (a 'run' column beside the "
                             "detector's)")
    args = parser.parse_args()
    if args.repeat < 1 or args.cycles < 1:
        parser.error("--repeat and --cycles must be at least 1")
    if args.worker:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # Configuration's watchdog asks a hung worker
        serve(args.worker[0], args.worker[1], args.steps, args.rank, args.store, args.latent)
        return 0

    import torch

    from pytest_streamrace.detector import capture

    capture.load()  # built (or found cached) here, so that no timed process spends its first rounds compiling it
    if torch.cuda.is_available():
        capture.load_trace()
    backend = "cuda" if torch.cuda.is_available() else "virtual"
    if args.latent:
        modes = ["plain", backend + LATENT_OFF, backend]
    else:
        modes = ["plain", "empty-mode", "capture-floor"] + ([backend, "sanitizer"] if backend == "cuda"
                                                            else [backend])
    modes += [RUN] if RUN in args.under else []
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"torch {torch.__version__} on {where}; {args.repeat} repeat(s) of {args.cycles} cycles, a round of "
          f"{args.steps} steps each"
          + ("; loss.item() every step, latent view off vs report" if args.latent else ""))
    print(f"{'model':36} " + " ".join(f"{m + ' ms':>14}" for m in modes) + "  slowdown vs plain")
    gpus = torch.cuda.device_count()
    for model in MODELS:
        if args.model and not any(text in model for text in args.model):
            continue
        if gpus and MODELS[model][3] > gpus:  # gloo on the CPU would measure another program than the GPU rows
            print(f"{model:36} skipped: {MODELS[model][3]} ranks need as many GPUs, this machine has {gpus}")
            continue
        runs: dict[str, list[list[float]]] = {mode: [] for mode in modes}  # a list of measurements a repeat
        began = time.monotonic()
        for rep in range(args.repeat):
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]  # each repeat starts elsewhere
            failure = measure_once(model, order, args, runs, backend)
            if failure:
                print(f"{model}: {failure}", file=sys.stderr)
                return 1
        ms = {mode: statistics.median(sum(values, [])) for mode, values in runs.items()}
        slow = ", ".join(f"{m} {slowdown(runs, m)}" for m in modes[1:])
        if args.latent:
            slow += f"; latent view {slowdown(runs, backend, backend + LATENT_OFF)}"
        if RUN in modes:
            slow += f"; run vs in-process {slowdown(runs, RUN, backend)}"
        took = f" ({time.monotonic() - began:.0f} s)"
        print(f"{model:36} " + " ".join(f"{ms[m]:14.3f}" for m in modes) + f"  {slow}{took}", flush=True)  # as it comes
    return 0


if __name__ == "__main__":
    sys.exit(main())
