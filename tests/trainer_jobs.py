"""Training jobs nobody here wrote, run under ``streamrace run`` as users run them: a DeepSpeed ZeRO-3 script
under the ``deepspeed`` launcher, torchtitan's trainer under torchrun. Shared by tests/test_run_deepspeed_launcher.py
(CPU) and tests/gpu/test_run_trainers.py (2 GPUs), so that a failure prints the same account of what the job did."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "tests" / "gpu" / "assets"
ZERO3 = ASSETS / "zero3_train.py"
DATASETS_STAND_IN = ASSETS / "datasets_stand_in"  # where Hugging Face `datasets` cannot be installed (pyarrow's size)
# torchtitan's test tokenizer, from its repository at the release's tag (not in its wheel): see docs/validation.md
TORCHTITAN_TOKENIZER = REPO / ".whl" / "torchtitan-assets" / "tokenizer"
TORCHTITAN_VERSION = "0.2.2"  # the release of torch 2.11's time: its checkpointer stages through DefaultStager

STREAMRACE_RUN = [sys.executable, "-m", "pytest_streamrace", "run"]  # the command, with this interpreter
# where scripts/device/setup.sh installs the wheels carried to a GPU host: a folder per DeepSpeed version, the rest in
# common/ (torchtitan and its dependencies among them)
SITES = Path("/tmp/streamrace-sites")
SITE_FOLDERS = ("deepspeed-0.19.8", "common")
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_launcher() -> list[str]:
    """The ``deepspeed`` console script of this interpreter's DeepSpeed (its runner module where none is found)."""
    beside = Path(sys.executable).with_name("deepspeed")
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def site_paths() -> list[str]:
    return [str(SITES / name) for name in SITE_FOLDERS if (SITES / name).is_dir()]


def installed(package: str) -> bool:
    """Importable here, or installed where setup.sh puts the carried wheels (the jobs get those folders)."""
    return importlib.util.find_spec(package) is not None or any((Path(p) / package).is_dir() for p in site_paths())


def environ(**extra: str) -> dict:
    """This process's environment for a job: unbuffered, one thread a rank on CPU, NCCL without multicast (the lent
    hosts), the carried wheels' folders on PYTHONPATH, and the `datasets` stand-in where the real one is missing."""
    env = {**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.setdefault("OMP_NUM_THREADS", "1")
    paths = site_paths() + ([] if installed("datasets") else [str(DATASETS_STAND_IN)])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def run(command: list[str], cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """The job to its end, in a process group of its own. One that outlives `timeout` gets SIGTERM (`streamrace run`
    and the launchers pass it on to their ranks, and the report is still written), SIGKILL for the whole group 30 s
    later, and comes back with status 124 and what it printed: no rank is left holding a GPU for the next job."""
    proc = subprocess.Popen([str(c) for c in command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        for signo, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, signo)
            except ProcessLookupError:
                pass
            try:
                stdout, stderr = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            stdout, stderr = "", ""
        return subprocess.CompletedProcess(proc.args, 124, stdout, f"{stderr}\n[timed out after {timeout:g} s]")


def races(path: Path) -> list[dict]:
    return json.loads(path.read_text())["races"] if path.exists() else []


def summary(race: dict) -> str:
    """One line a race: rank, kind, latent or not, and each side's op, stream and innermost reported frame."""
    def side(access):
        frame = access["frames"][0] if access["frames"] else {"file": "?", "line": 0, "function": "?"}
        thread = f" thread {access['thread']['name']}" if access.get("thread") else ""
        return (f"{access['op']} on {access['stream']}{thread} at {frame['file'].rsplit('/', 1)[-1]}:{frame['line']} "
                f"({frame['function']})")
    latent = f" latent({race['latent'].get('op')})" if race.get("latent") else ""
    return f"rank {race.get('rank')} {race['kind']}{latent}: {side(race['earlier'])} -> {side(race['later'])}"


def account(out: subprocess.CompletedProcess, json_path: Path | None = None) -> str:
    """What a failing assertion shows: the status, the races of the JSON one a line, both streams' tails."""
    found = races(json_path) if json_path is not None else []
    lines = [f"exit status {out.returncode}; {len(found)} races in the JSON"] + [summary(r) for r in found[:20]]
    return "\n".join(lines + ["--- stdout (tail)", out.stdout[-3000:], "--- stderr (tail)", out.stderr[-8000:]])


def in_frames(access: dict, function: str, file: str) -> bool:
    return any(f["function"] == function and f["file"].endswith(file) for f in access["frames"])


def zero3_gather_race(race: dict) -> bool:
    """The documented pair (docs/upstream/zero3-param-gather.md): the step's copy into a partition, then the next
    all-gather's read of it."""
    return (in_frames(race["earlier"], "_reassign_or_swap_out_partitioned_parameters", "zero/stage3.py")
            and in_frames(race["later"], "_all_gather_dtype", "zero/partition_parameters.py"))


def zero3_command(*script_args: str) -> list[str]:
    """``deepspeed --num_gpus 2 --master_port P zero3_train.py ARGS`` (on CPU, the launcher starts 2 ranks as well)."""
    return [*deepspeed_launcher(), "--num_gpus", "2", "--master_port", str(free_port()), str(ZERO3), *script_args]


STEP_LINE = re.compile(r"step\s+(\d+) loss (\S+)")  # zero3_train.py's lines
TITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)")  # torchtitan's metrics line


def curve(text: str, pattern: re.Pattern = STEP_LINE) -> dict[int, tuple[str, ...]]:
    """Step -> the values printed for it (as printed: compared exactly). Every rank printing a step must agree."""
    seen: dict[int, set] = {}
    for match in pattern.finditer(re.sub(r"\x1b\[[0-9;]*m", "", text)):
        seen.setdefault(int(match.group(1)), set()).add(match.groups()[1:])
    assert all(len(v) == 1 for v in seen.values()), f"ranks printed different values for one step: {seen}"
    return {step: values.pop() for step, values in sorted(seen.items())}


# torchtitan's debug model (llama3 "debugmodel": 6 layers, dim 256, its test tokenizer), FSDP2 over the 2 GPUs
# (data_parallel_shard_degree -1), checkpoints staged through DCP's DefaultStager (async_with_pinned_mem), seeded (and
# deterministic where asked: torch's deterministic algorithms, as torchtitan's own loss comparisons run), no activation
# checkpointing or compile: the smallest job that reaches the staging race.
TORCHTITAN_CONFIG = """
[job]
dump_folder = "{dump}"
description = "torchtitan debug model under streamrace run"

[metrics]
log_freq = {log_freq}
disable_color_printing = true

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "{tokenizer}"

[optimizer]
name = "AdamW"
lr = 8e-4

[lr_scheduler]
warmup_steps = 2

[training]
local_batch_size = 2
seq_len = 256
steps = {steps}
dataset = "c4_test"
dataset_path = "{data}"

[parallelism]
data_parallel_shard_degree = -1

[checkpoint]
enable = true
folder = "checkpoint"
interval = {interval}
async_mode = "async_with_pinned_mem"
last_save_model_only = false

[activation_checkpoint]
mode = "none"

[debug]
seed = 42
deterministic = {deterministic}
"""

WORDS = ("the a of to and in is it that for on with as was at by be this from or have an are not but one all which "
         "model train step loss stream race wait copy gather write read device memory host kernel buffer tensor "
         "rank shard").split()


def torchtitan_job(folder: Path, *, interval: int, log_freq: int, steps: int, deterministic: bool = False) -> Path:
    """A job folder: a small text corpus (JSON lines, as torchtitan's c4_test), and the config; its path."""
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(data / "data.json", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(40)) + "."}) + "\n")
    config = folder / "job.toml"
    config.write_text(TORCHTITAN_CONFIG.format(dump=folder / "outputs", log_freq=log_freq, steps=steps,
                                               interval=interval, tokenizer=TORCHTITAN_TOKENIZER, data=data,
                                               deterministic=str(deterministic).lower()))
    return config


def torchtitan_command(config: Path) -> list[str]:
    """``torchrun --standalone --nproc_per_node 2 -m torchtitan.train --job.config_file CONFIG``, as its
    run_train.sh starts it (torchrun as ``python -m torch.distributed.run``: this interpreter)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "torchtitan.train", "--job.config_file", str(config)]


def torchtitan_missing() -> str | None:
    """Why torchtitan's job cannot run here, or None."""
    if not installed("torchtitan"):
        return f"torchtitan is not installed (torchtitan=={TORCHTITAN_VERSION} and its wheels: docs/validation.md)"
    if not (TORCHTITAN_TOKENIZER / "tokenizer.json").exists():
        return f"torchtitan's test tokenizer is not in {TORCHTITAN_TOKENIZER} (docs/validation.md says how)"
    return None
