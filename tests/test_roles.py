"""The process role, decided once from the environment and the config: who writes the session's files."""

import pytest

from pytest_streamrace import roles

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("args, environ, kind, writes", [
    ((), {}, roles.SESSION, True),
    (("-n", "2"), {}, roles.XDIST_CONTROLLER, True),
    ((), {"STREAMRACE_RANK_SPEC": "{}"}, roles.RANK_CHILD, False),
    ((), {**TORCHRUN, "RANK": "0"}, roles.TORCHRUN_RANK, True),
    ((), {**TORCHRUN, "RANK": "1"}, roles.TORCHRUN_RANK, False),
])
def test_one_process_of_a_run_writes_the_session_files(pytester, args, environ, kind, writes):
    role = roles.decide(pytester.parseconfig(*args), environ)
    assert (role.kind, role.writes_session_files) == (kind, writes)
    assert role.speaks_for_torchrun is (kind != roles.TORCHRUN_RANK or writes)


def test_an_xdist_worker_writes_nothing_and_a_followed_child_is_marked(pytester):
    config = pytester.parseconfig()
    config.workerinput = {"workerid": "gw0"}  # what xdist sets on a worker's config
    role = roles.decide(config, {"STREAMRACE_SUBPROCESS": '{"dir": "/tmp/x"}'})
    assert (role.kind, role.writes_session_files, role.followed) == (roles.XDIST_WORKER, False, True)
    assert not roles.decide(config, {"STREAMRACE_SUBPROCESS": "0"}).followed  # the opt-out


def test_the_role_is_decided_once_per_session(pytester, monkeypatch):
    config = pytester.parseconfig()
    first = roles.of(config)
    monkeypatch.setenv("STREAMRACE_RANK_SPEC", "{}")
    assert roles.of(config) is first
