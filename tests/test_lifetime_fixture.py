"""The buffer_lifetimes fixture as users run it: through pytest, in a subprocess, on CPU tensors."""

import textwrap

TRAINING = textwrap.dedent("""
    import pytest
    import torch


    class Trainer:
        '''Keeps its gradient buffer until the next backward when `leak` is set: the bug the fixture must catch.'''

        def __init__(self, leak):
            self.leak = leak
            self.kept = None
            self.weight = torch.zeros(256)

        def backward(self):
            grads = torch.ones(256)
            if self.leak:
                self.kept = grads
            return grads

        def step(self, grads):
            self.weight -= 0.1 * grads
""")


def test_a_retained_buffer_fails_the_call_with_its_report_and_a_released_one_passes(pytester):
    pytester.makepyfile(TRAINING + textwrap.dedent("""
        @pytest.mark.parametrize("leak", [True, False], ids=["leaky", "tidy"])
        def test_step(buffer_lifetimes, leak):
            trainer = Trainer(leak)
            buffer_lifetimes.at_call(trainer, "backward")
            for _ in range(3):
                grads = trainer.backward()
                buffer_lifetimes.track(grads, "gradient buffer", by="backward")  # gone by the next backward
                trainer.step(grads)
                del grads
            buffer_lifetimes.phase("backward")
    """))
    result = pytester.runpytest_subprocess("-rA")
    result.assert_outcomes(passed=1, failed=1)  # failed in the call: no teardown error
    result.stdout.fnmatch_lines([
        "*_ test_step[[]leaky[]] _*",
        "buffer lifetimes: 3 buffer(s), 3.0 KiB, outlived the phase that should have released them:",
        "  gradient buffer: 1.0 KiB (storage of float32[[]256[]] on cpu) still alive at 'backward' (#2)*",
        "      registered at test_a_retained_buffer_fails*.py:* in test_step",
        "  gradient buffer: 1.0 KiB * still alive at 'backward' (#3)*",
        "  gradient buffer: 1.0 KiB * still alive at 'backward' (#4)*",
    ])
    result.stdout.fnmatch_lines(["*- buffer lifetimes -*", "peak memory per phase (live tracked storages):",
                                 "  start * 0 B", "  backward * 1.0 KiB",
                                 "  after backward * 1.0 KiB"])
    result.stdout.fnmatch_lines(["FAILED *test_step[[]leaky[]]*", "*1 failed, 1 passed*"])


def test_a_phase_that_never_comes_fails_the_test(pytester):
    pytester.makepyfile(TRAINING + textwrap.dedent("""
        def test_misspelt_phase(buffer_lifetimes):
            trainer = Trainer(leak=False)
            buffer_lifetimes.at_call(trainer, "step", phase="optimizer.step")
            grads = trainer.backward()
            buffer_lifetimes.track(grads, "gradient buffer", by="optimiser.step")
            trainer.step(grads)
    """))
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "buffer lifetimes: 1 buffer(s) were never checked — their phase never came (phases marked: "
        "'optimizer.step', 'after optimizer.step'):",
        "  gradient buffer: due by 'optimiser.step', registered at *:* in test_misspelt_phase",
    ])


def test_a_test_that_fails_anyway_keeps_its_own_error_and_gets_the_lifetime_report_as_a_section(pytester):
    pytester.makepyfile(TRAINING + textwrap.dedent("""
        def test_fails(buffer_lifetimes):
            kept = torch.zeros(8)
            buffer_lifetimes.track(kept, "kept", by="end")
            buffer_lifetimes.phase("end")
            assert 1 == 2, "the test's own failure"
    """))
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: the test's own failure*",
                                 "*- buffer lifetimes: outlived buffers -*", "  kept: 32 B *still alive at 'end'*"])


def test_the_fixture_works_in_each_rank_of_a_distributed_test(pytester):
    pytester.makepyfile(TRAINING + textwrap.dedent("""
        @pytest.mark.distributed(world_size=2)
        def test_ranks(buffer_lifetimes, rank):
            trainer = Trainer(leak=rank == 1)
            grads = trainer.backward()
            buffer_lifetimes.track(grads, f"rank {rank} gradient buffer", by="end of step")
            trainer.step(grads)
            del grads
            buffer_lifetimes.phase("end of step")
    """))
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 gradient buffer: 1.0 KiB * still alive at 'end of step'*"])
    result.stdout.no_fnmatch_line("*rank 0 gradient buffer*still alive*")
