"""The numeric referee: exact comparison of a forced run with its reference, naming the first differing parameter;
NaN poisoning of collective inputs turns a stale read into NaN."""

import math

import pytest
import torch

from pytest_streamrace.forcing.referee import referee


def step(config):
    """A tiny training step; config "perturbed" corrupts one gradient element of the second layer's weight."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    m(torch.ones(4, 3)).sum().backward()
    if config == "perturbed":
        m[1].weight.grad[0, 0] += 1e-3
    if config == "nan":
        m[0].bias.grad[1] = math.nan
    return m


def test_identical_runs_are_bit_identical():
    verdict = referee(step, "plain", "plain")
    assert verdict and verdict.identical and verdict.compared == 4
    assert str(verdict) == "referee: bit-identical (4 tensors)"


def test_a_difference_names_the_first_parameter_and_its_error():
    verdict = referee(step, "perturbed", "plain")
    assert not verdict
    assert verdict.first_difference == "1.weight"
    reference = step("plain")[1].weight.grad
    assert verdict.max_rel_error == pytest.approx(1e-3 / reference.abs().max().item(), rel=1e-3)
    assert str(verdict).startswith("referee: forced run differs from reference: max relative error ")
    assert "first difference in 1.weight" in str(verdict)


def test_nan_is_reported_by_name():
    verdict = referee(step, "nan", "plain")
    assert verdict.nonfinite == ["0.bias"] and verdict.first_difference == "0.bias"
    assert "NaN/Inf in 0.bias" in str(verdict)


def test_params_and_mappings_are_compared_too():
    assert referee(lambda c: {"w": torch.full((2,), c)}, 1.0, 1.0, compare_what="params")
    verdict = referee(lambda c: {"w": torch.full((2,), c)} if c else {"v": torch.ones(1)}, 1.0, 0.0)
    assert verdict.missing == ["v", "w"] and not verdict


def test_bad_step_result_and_mode_are_one_line_errors():
    with pytest.raises(TypeError, match="must return a torch.nn.Module or a mapping name -> tensor, got int"):
        referee(lambda c: 3, 0, 0)
    with pytest.raises(ValueError, match="referee compares 'grads' or 'params', got 'loss'"):
        referee(step, 0, 0, compare_what="loss")


POISON = """
import tempfile
import torch, torch.distributed as dist
from pytest_streamrace.forcing.referee import poisoned_collective_inputs, referee

def step(stale):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    m(torch.ones(4, 3)).sum().backward()
    bucket = torch.cat([p.grad.view(-1) for p in m.parameters()])
    reduced = torch.empty_like(bucket)
    dist.reduce_scatter_tensor(reduced, bucket)
    source = bucket if stale else reduced  # the bug: reading the communication buffer, not the result
    at = 0
    for p in m.parameters():
        p.grad.copy_(source[at:at + p.numel()].view_as(p.grad))
        at += p.numel()
    return m

def test_stale_read_is_invisible_without_poison():
    assert referee(step, True, False)

def test_stale_read_shows_as_nan_with_poison():
    with poisoned_collective_inputs():
        verdict = referee(step, True, False)
    assert not verdict and verdict.nonfinite == ["weight", "bias"] and verdict.first_difference == "weight"

def test_correct_reads_stay_identical_with_poison():
    with poisoned_collective_inputs():
        assert referee(step, False, False)
"""


def test_poisoned_collective_inputs_turn_stale_reads_into_nan(pytester):
    pytester.makepyfile(test_poison=POISON)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore::FutureWarning")
    result.assert_outcomes(passed=3)
