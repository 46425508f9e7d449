"""deepcompile_zero1 on a machine without CUDA: refused in one line by the CLI, skipped under pytest; and the parts
of the installed DeepSpeed (0.19.8) its harness patch relies on. The repro itself runs on GPUs only
(tests/gpu/test_repros_gpu.py)."""

import inspect

import pytest
from repro_cli import repro

pytest.importorskip("deepspeed")


@pytest.mark.parametrize("args, message", [
    ([], "error: deepcompile_zero1 runs only on the cuda backend (this machine has 0 GPUs); it needs CUDA GPUs"),
    (["--backend", "virtual"], "error: deepcompile_zero1 runs only on the cuda backend"),
    (["--backend", "cuda"], "error: deepcompile_zero1 on the cuda backend needs 2 GPUs, this machine has 0"),
])
def test_the_cli_refuses_without_cuda_in_one_line_and_exit_2(args, message):
    out = repro("deepcompile_zero1", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith(message) and out.stderr.count("\n") == 1, out.stderr


def test_show_names_the_fix_and_the_cuda_only_backend():
    out = repro("show", "deepcompile_zero1")
    assert out.returncode == 0
    assert "https://github.com/deepspeedai/DeepSpeed/pull/8036" in out.stdout
    assert "ranks:    2; backends: cuda" in out.stdout
    assert "unpatched  expect reproduced" in out.stdout and "patched    expect clean" in out.stdout


def test_under_pytest_both_variants_are_skipped_with_the_reason(pytester):
    result = pytester.runpytest_subprocess("--pyargs", "pytest_streamrace.repros", "-k", "deepcompile_zero1", "-rs",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["SKIPPED [[]2[]] *deepcompile_zero1 runs on the cuda backend, not virtual"])


def test_the_installed_deepspeed_has_the_fix_and_the_branches_the_harness_reintroduces_the_bug_with():
    from deepspeed.compile import init_z1_and_2
    from pytest_streamrace.repros import deepcompile_zero1 as dc

    assert dc.has_native_fix()  # 0.19.8: the unpatched variant is the harness's
    params = inspect.signature(init_z1_and_2.init_z1_and_2).parameters
    assert list(params)[-2:] == ["schedule", "use_z2"]
    assert [f"{m.__name__}.{a}" for m, a in dc._init_functions()] == ["deepspeed.compile.init_z1_and_2.init_z1_and_2"]
    assert dc._z1_reduce_pass().__name__ == "add_z1_reduce"


def test_removing_the_fix_routes_zero1_through_the_persistent_target_branch_with_the_zero1_pass():
    from deepspeed.compile import init_z1_and_2
    from pytest_streamrace.repros import deepcompile_zero1 as dc

    calls = []
    original = init_z1_and_2.init_z1_and_2
    with dc.deepcompile_fix(fixed=True):  # native on 0.19.8: nothing replaced
        assert init_z1_and_2.init_z1_and_2 is original
    with dc.deepcompile_fix(fixed=False):
        wrapped = init_z1_and_2.init_z1_and_2
        assert wrapped is not original
    assert init_z1_and_2.init_z1_and_2 is original  # restored
    # what the wrapper hands DeepSpeed's init (the init itself builds a CUDA op: run on GPUs by deepcompile.sh)
    without_fix = dc._remove_fix(lambda *args, **kwargs: calls.append((args, kwargs)))
    without_fix("engine", "inductor", "config", {})
    without_fix("engine", "inductor", "config", {}, None, True)
    (args, kwargs), (args2, kwargs2) = calls
    assert kwargs == {"use_z2": True} and args[4][0][1][0].__name__ == "add_z1_reduce"
    assert args2[4:] == (None, True)  # ZeRO-2 is left alone


def test_confirming_it_finds_no_race_to_force_and_leaves_the_verdict_to_its_referee():
    """`--confirm` forces races; this bug's evidence is a buffer's lifetime, which its referee measures itself. A repro
    whose evidence is races still disagrees with its referee when none of them is confirmed."""
    from pytest_streamrace.repro import registry
    from pytest_streamrace.repro.runner import confirmations

    assert registry.get("deepcompile_zero1").relevant is None
    lines, summary = confirmations("reproduced", [], [], races_are_evidence=False)
    assert lines == [] and summary["agrees"] is None
    assert summary["summary"] == "nothing to force: this bug's evidence is not a race; its referee's verdict stands " \
                                 "(reproduced)"
    assert confirmations("reproduced", [], [])[1]["agrees"] is False
    assert confirmations("clean", [], [])[1]["agrees"] is True
