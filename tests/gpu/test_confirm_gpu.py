"""--streamrace-confirm on real streams (cuda backend): the twins of tests/test_confirm.py, the race corpus, and an
async NCCL collective's buffer read before wait() on 2 GPUs, each race held back by a sleep kernel on its stream."""

import pytest
import torch

import test_confirm as twins

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_each_race_is_forced_on_real_streams(pytester):
    twins.check_cases(pytester, *twins.run_cases(pytester, "cuda"))


def test_every_racy_case_of_the_corpus_is_confirmed_or_shown_benign_on_real_streams(pytester):
    twins.check_corpus(pytester, "cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_collective_read_before_wait_is_confirmed_on_nccl(pytester):
    twins.check_collective(pytester, "cuda")
