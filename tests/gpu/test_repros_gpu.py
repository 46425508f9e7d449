"""The repros on GPUs (cuda backend, NCCL, numeric referee against a run without the overlap), as
`python -m pytest_streamrace.repro NAME --backend cuda --repeat N` runs them: the unpatched variant reproduced and
the patched one clean in every run, on the framework versions on both sides of each fix. N is `--gpu-repeat`."""

import statistics

import pytest
from gpu_support import extensions_dir, framework_env, repro, verdicts

CLAIMS = {
    13: "The repros on GPUs, numeric referee against a run without the overlap",
    14: "The DeepSpeed repros, repeated (`--gpu-repeat N` runs of each variant), with the referee's numbers",
    15: "`megatron_instances`, repeated, on 2 ranks and, where the host has 4 GPUs, on 4",
    16: "`deepcompile_zero1` (DeepSpeed #8036, a buffer kept past its phase)",
}


def _numbers(data: dict, variant: str, key: str) -> list[float]:
    return [n[key] for r in data["runs"] if r["variant"] == variant for n in r.get("numeric") or [] if key in n]


def _every_run_expected(data: dict, runs: int, gpu_result) -> None:
    unpatched, patched = verdicts(data, "unpatched"), verdicts(data, "patched")
    gpu_result.record("runs", runs)
    gpu_result.record("unpatched", ", ".join(f"{k} {n}/{runs}" for k, n in unpatched.items()))
    gpu_result.record("patched", ", ".join(f"{k} {n}/{runs}" for k, n in patched.items()))
    assert unpatched == {"reproduced": runs} and patched == {"clean": runs}, data["output"][-4000:]
    assert data["returncode"] == 0


DEEPSPEED = [pytest.param("0.19.8", name, marks=pytest.mark.validates(13, 14)) for name in ("zero_overlap",
                                                                                            "zero_bucket_reuse")]
DEEPSPEED += [pytest.param("0.19.2", name, marks=pytest.mark.validates(14)) for name in ("zero_overlap",
                                                                                         "zero_bucket_reuse")]
DEEPSPEED += [pytest.param("0.19.8", "zero3_param_gather", marks=pytest.mark.validates(13))]


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("version, name", DEEPSPEED)
def test_deepspeed_repro_unpatched_reproduced_patched_clean(request, tmp_path, version, name, gpu_repeat, gpu_result):
    env = framework_env(request.config, deepspeed=version)
    data = repro(name, "--repeat", str(gpu_repeat), config=request.config, timeout=600, env=env,
                 json_path=tmp_path / "runs.json")
    gpu_result.record("deepspeed", version)
    _every_run_expected(data, gpu_repeat, gpu_result)
    wrong, exact = _numbers(data, "unpatched", "max_rel_err"), _numbers(data, "patched", "max_rel_err")
    if wrong:
        gpu_result.record("unpatched max relative error", [min(wrong), max(wrong)])
    if exact and name != "zero3_param_gather":
        assert max(exact) == 0.0, exact  # patched: bit-identical to the reference
        gpu_result.record("patched", f"clean {gpu_repeat}/{gpu_repeat}, bit-identical to the reference")


MEGATRON = [pytest.param("0.15.2", 2, marks=[pytest.mark.validates(13, 15), pytest.mark.gpu(count=2)]),
            pytest.param("0.19.2", 2, marks=[pytest.mark.validates(15), pytest.mark.gpu(count=2)]),
            pytest.param("0.15.2", 4, marks=[pytest.mark.validates(15), pytest.mark.gpu(count=4)]),
            pytest.param("0.19.2", 4, marks=[pytest.mark.validates(15), pytest.mark.gpu(count=4)])]


@pytest.mark.parametrize("version, ranks", MEGATRON)
def test_megatron_instances_unpatched_reproduced_patched_clean(request, tmp_path, version, ranks, gpu_repeat,
                                                               gpu_result):
    env = framework_env(request.config, megatron_core=version)
    env["TORCH_EXTENSIONS_DIR"] = extensions_dir("megatron-core", version)  # it JIT-builds an extension at import
    data = repro("megatron_instances", "--world-size", str(ranks), "--steps", "3", "--repeat", str(gpu_repeat),
                 config=request.config, timeout=600, env=env, json_path=tmp_path / "runs.json")
    gpu_result.record("megatron-core", version)
    gpu_result.record("ranks", ranks)
    _every_run_expected(data, gpu_repeat, gpu_result)
    assert all(n == 0 for n in _numbers(data, "patched", "wrong_iterations"))
    worst = _numbers(data, "patched", "worst_rel_err")
    if worst:
        gpu_result.record("patched worst relative error", max(worst))


@pytest.mark.gpu(count=2)
@pytest.mark.validates(16)
@pytest.mark.parametrize("version", ["0.19.1", "0.19.8"])
def test_deepcompile_zero1_keeps_a_gradient_partition_past_the_step(request, tmp_path, version, gpu_repeat,
                                                                   gpu_result):
    env = framework_env(request.config, deepspeed=version)
    env["TORCH_EXTENSIONS_DIR"] = extensions_dir("deepspeed", version)  # DeepCompile's native op
    data = repro("deepcompile_zero1", "--repeat", str(gpu_repeat), config=request.config, timeout=600, env=env,
                 json_path=tmp_path / "runs.json")
    gpu_result.record("deepspeed", version)
    _every_run_expected(data, gpu_repeat, gpu_result)
    peak = {v: statistics.median(_numbers(data, v, "step_peak_mib")) for v in ("unpatched", "patched")}
    partition = statistics.median(_numbers(data, "unpatched", "partition_mib"))
    gpu_result.record("step peak unpatched - patched (MiB)", round(peak["unpatched"] - peak["patched"], 1))
    gpu_result.record("bf16 gradient partition (MiB)", partition)
    assert peak["unpatched"] > peak["patched"]
