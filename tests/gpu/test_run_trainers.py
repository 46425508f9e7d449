"""`streamrace run` on trainers and launchers nobody here wrote, on 2 GPUs (cuda backend, NCCL):

- torchtitan's trainer (debug model, FSDP2, async checkpointing with pinned memory) under torchrun: with a checkpoint
  interval that is not a multiple of the log frequency, the DCP staging race (docs/upstream/dcp-async-staging.md) on
  both ranks; with the interval aligned to logging, the same pair as a latent race (ordered by logging's read-back);
- the loss curves of torchtitan and of a DeepSpeed ZeRO-3 script, with and without `streamrace run`, identical;
- the ZeRO-3 script under the `deepspeed` launcher: the ZeRO-3 gather race (docs/upstream/zero3-param-gather.md).

Each job runs as a user types it; a failure prints its exit status, its races one a line, and its output's tails.
Needs torchtitan 0.2.2 and DeepSpeed 0.19.8 (wheels and torchtitan's test tokenizer: docs/validation.md)."""

from __future__ import annotations

import pytest
import trainer_jobs as jobs

from pytest_streamrace import env

pytestmark = pytest.mark.gpu(count=2)  # (tests/gpu/conftest.py skips it on a host with fewer GPUs, saying so)

GPUS = len(env.visible_gpus()) >= 2  # a framework's absence is the reason only where the GPUs are there
NO_TORCHTITAN = jobs.torchtitan_missing()
TORCHTITAN = pytest.mark.skipif(GPUS and NO_TORCHTITAN is not None, reason=NO_TORCHTITAN or "")
DEEPSPEED = pytest.mark.skipif(GPUS and not jobs.installed("deepspeed"),
                               reason="deepspeed is not installed (its wheels: docs/validation.md)")
CLAIMS = {
    35: "torchtitan 0.2.2's trainer (debug model, FSDP2 on 2 GPUs, async checkpointing with pinned memory) "
        'under `streamrace run -- torchrun ...`, a checkpoint interval that is not a multiple of the log '
        'frequency: the DCP staging race ([write-up](upstream/dcp-async-staging.md)) on both ranks, read in '
        "torch's `_state_dict_stager.py` on the stager's thread; exit 3",
    36: 'The same with the interval a multiple of the log frequency: the pair listed as latent on both ranks '
        "(ordered by logging's read-back), exit 0; with `--latent fail`, exit 3",
    37: "Loss curves with and without `streamrace run`, as the programs print them: torchtitan's debug model "
        '(seeded, deterministic, 6 steps) and the DeepSpeed ZeRO-3 script (6 steps): identical',
    38: 'A DeepSpeed ZeRO-3 script under the `deepspeed` launcher, under `streamrace run`: the ZeRO-3 gather '
        'race ([write-up](upstream/zero3-param-gather.md)) on both ranks with accumulation 2 and the '
        'throughput timer unsynchronized (exit 3), latent in the stock configuration (exit 0). On CPU '
        '(virtual backend, gloo) the same, in CI: `pytest tests/test_run_deepspeed_launcher.py`',
}
STAGER_FILES = ("_state_dict_stager.py", "staging.py")  # torch DCP: StateDictStager's copy, DefaultStager's thread


@pytest.fixture
def record(request):
    """The gpu-tests conftest's `gpu_result.record(key, value)` where it is there; else numbers go nowhere."""
    try:
        return request.getfixturevalue("gpu_result").record
    except pytest.FixtureLookupError:
        return lambda key, value: None


def _staging_reads(found: list[dict]) -> list[dict]:
    """The races whose later access is DCP's staging copy: the copy's own frame is torch's (no frame is the user's
    on the stager's pool thread)."""
    return [r for r in found
            if r["later"]["frames"] and r["later"]["frames"][0]["file"].rsplit("/", 1)[-1] in STAGER_FILES]


def _titan(folder, *run_args, interval, log_freq, steps=5):
    """A fresh job folder each run: torchtitan resumes from a checkpoint it finds in its dump folder. Two checkpoints a
    run at most: with torch 2.11 the third async one fails in torch's StateDictStager (KeyError: <class 'type'>), with
    or without `streamrace run` (its DefaultStager reuses a stager it closed; the repro dcp_async_staging makes a new
    stager per checkpoint for that reason)."""
    config = jobs.torchtitan_job(folder, interval=interval, log_freq=log_freq, steps=steps)
    path = folder / "races.json"
    command = [*jobs.STREAMRACE_RUN, "--backend", "cuda", "--json", path, *run_args, "--",
               *jobs.torchtitan_command(config)]
    out = jobs.run(command, folder, jobs.environ())
    return out, jobs.races(path), jobs.account(out, path)


@TORCHTITAN
@pytest.mark.validates(35)
def test_torchtitan_checkpoint_off_the_log_steps_reports_the_dcp_staging_race(tmp_path, record):
    """Steps 1-5, logged at 1, 2, 4, checkpointed (staged) at 3: nothing reads a value back between step 3's optimizer
    step and its staging copies. Exit 3; the race on both ranks, its read in torch's stager on the staging thread."""
    out, found, said = _titan(tmp_path / "job", interval=3, log_freq=2)
    assert out.returncode == 3, said
    staged = [r for r in _staging_reads(found) if not r.get("latent")]
    assert {r["rank"] for r in staged} == {0, 1}, said
    assert "read-after-write" in {r["kind"] for r in staged}, said
    assert all(r["later"].get("thread") for r in staged), said  # named on the stager's pool thread
    assert any("torchtitan" in f["file"] for r in staged for f in r["earlier"]["frames"]), said  # the step's write
    record("races", len(staged))
    record("seen", sum(r.get("count", 1) for r in staged))


@TORCHTITAN
@pytest.mark.validates(36)
def test_torchtitan_checkpoint_on_the_log_steps_reports_it_as_latent(tmp_path, record):
    """Steps 1-4, checkpointed (staged) at 2 and 4, both logged: logging's read-back orders each step before its staging
    copies. Exit 0 with the pair listed as latent on both ranks; with `--latent fail` the run fails (exit 3)."""
    out, found, said = _titan(tmp_path / "report", interval=2, log_freq=2, steps=4)
    assert out.returncode == 0, said
    staged = _staging_reads(found)
    assert staged and all(r.get("latent") for r in staged), said
    assert {r["rank"] for r in staged} == {0, 1}, said
    assert "latent races (ordered today only by a host sync" in out.stderr, said  # the closing list
    record("latent", len(staged))
    record("ordered_by", sorted({r["latent"].get("op", "?") for r in staged}))
    failing, _, said = _titan(tmp_path / "fail", "--latent", "fail", interval=2, log_freq=2, steps=4)
    assert failing.returncode == 3, said


@TORCHTITAN
@pytest.mark.validates(37)
def test_torchtitan_loss_curve_is_the_same_under_streamrace_run(tmp_path, record):
    """6 steps logged every step, staged at 3 and 6 (the racy configuration: the race does not touch training), seeded
    and deterministic: each step's loss and grad norm as torchtitan prints them, the same with and without
    `streamrace run` (under --report-only, so that the run's status is the program's)."""
    config = jobs.torchtitan_job(tmp_path / "plain", interval=3, log_freq=1, steps=6, deterministic=True)
    plain = jobs.run(jobs.torchtitan_command(config), config.parent, jobs.environ())
    assert plain.returncode == 0, jobs.account(plain)
    config = jobs.torchtitan_job(tmp_path / "under", interval=3, log_freq=1, steps=6, deterministic=True)  # afresh
    path = config.parent / "races.json"
    under = jobs.run([*jobs.STREAMRACE_RUN, "--backend", "cuda", "--report-only", "--json", path, "--",
                      *jobs.torchtitan_command(config)], config.parent, jobs.environ())
    assert under.returncode == 0, jobs.account(under, path)
    expected = jobs.curve(plain.stdout + plain.stderr, jobs.TITAN_LINE)
    got = jobs.curve(under.stdout + under.stderr, jobs.TITAN_LINE)
    assert sorted(expected) == list(range(1, 7)), jobs.account(plain)
    assert got == expected, f"plain {expected}\nunder streamrace run {got}"
    record("steps", len(got))
    record("losses", [float(v[0]) for v in got.values()])


@DEEPSPEED
@pytest.mark.validates(38)
def test_zero3_under_the_deepspeed_launcher_reports_the_gather_race(tmp_path, record):
    """Accumulation 2, the throughput timer unsynchronized: every step's copy into the partitions and the next
    all-gather's read of them are unordered. Exit 3, the documented pair on both ranks."""
    path = tmp_path / "races.json"
    command = [*jobs.STREAMRACE_RUN, "--backend", "cuda", "--json", path, "--",
               *jobs.zero3_command("--accumulation", "2", "--unsynchronized-timer", "--steps", "4")]
    out = jobs.run(command, tmp_path, jobs.environ(TORCH_CUDA_ARCH_LIST="9.0"))
    said = jobs.account(out, path)
    assert out.returncode == 3, said
    gathers = [r for r in jobs.races(path) if jobs.zero3_gather_race(r) and not r.get("latent")]
    assert {r["rank"] for r in gathers} == {0, 1} and {r["kind"] for r in gathers} == {"read-after-write"}, said
    record("seen", sum(r.get("count", 1) for r in gathers))


@DEEPSPEED
@pytest.mark.validates(38)
def test_zero3_stock_configuration_reports_the_gather_as_latent(tmp_path, record):
    """Accumulation 1 and DeepSpeed's default timers: the same pair, ordered only by the module-trace check's
    `.cpu()` (deepspeed/runtime/zero/utils.py). Exit 0, latent on both ranks."""
    path = tmp_path / "races.json"
    command = [*jobs.STREAMRACE_RUN, "--backend", "cuda", "--json", path, "--", *jobs.zero3_command("--steps", "4")]
    out = jobs.run(command, tmp_path, jobs.environ(TORCH_CUDA_ARCH_LIST="9.0"))
    said = jobs.account(out, path)
    assert out.returncode == 0, said
    found = jobs.races(path)
    assert all(r.get("latent") for r in found), said
    latent = [r for r in found if jobs.zero3_gather_race(r)]
    assert {r["rank"] for r in latent} == {0, 1}, said
    record("latent", len(latent))


@DEEPSPEED
@pytest.mark.validates(37)
def test_zero3_loss_curve_is_the_same_under_streamrace_run(tmp_path, record):
    """The stock configuration's losses (read back once, at the end) with and without `streamrace run`: the same. (Not
    the racy one: there the gather may really read stale partitions, more often the faster the host runs ahead.)"""
    args = ("--steps", "6")
    environ = jobs.environ(TORCH_CUDA_ARCH_LIST="9.0")
    plain = jobs.run(jobs.zero3_command(*args), tmp_path, environ)
    assert plain.returncode == 0, jobs.account(plain)
    under = jobs.run([*jobs.STREAMRACE_RUN, "--backend", "cuda", "--report-only", "--", *jobs.zero3_command(*args)],
                     tmp_path, environ)
    assert under.returncode == 0, jobs.account(under)
    expected, got = jobs.curve(plain.stdout), jobs.curve(under.stdout)
    assert sorted(expected) == list(range(1, 7)), jobs.account(plain)
    assert got == expected, f"plain {expected}\nunder streamrace run {got}"
    record("steps", len(got))
