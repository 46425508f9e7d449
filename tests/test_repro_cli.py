"""`python -m pytest_streamrace.repro`: listing, describing, third-party repros, and one-line errors (exit 2)."""

import textwrap

import pytest
from repro_cli import repro


def test_list_shows_the_shipped_repros():
    out = repro("list")
    assert out.returncode == 0
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert {"zero_overlap", "zero_bucket_reuse"} <= set(names)


def test_show_describes_variants_and_references():
    out = repro("show", "zero_overlap")
    assert out.returncode == 0
    assert "github.com/deepspeedai/DeepSpeed/pull/8080" in out.stdout
    assert "unpatched  expect reproduced" in out.stdout and "patched    expect clean" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["nosuch"], "error: unknown repro 'nosuch'; available: "),
    (["show"], "error: show needs a repro name"),
    (["zero_overlap", "--variant", "sideways"], "error: argument --variant: invalid choice: 'sideways'"),
    (["zero_overlap", "--repeat", "0"], "error: argument --repeat: expected a positive whole number, got '0'"),
    (["zero_overlap", "--backend", "cuda"], "error: zero_overlap on the cuda backend needs 2 GPUs, this machine has 0"),
    ([], "error: the following arguments are required: command"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = repro(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith(message) and out.stderr.count("\n") == 1, out.stderr


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """A repro package registered through the entry-point group, as a third party would ship one."""
    (tmp_path / "acme_repro.py").write_text(textwrap.dedent("""
        from pytest_streamrace.repro.spec import Framework, Repro, Variant
        REPRO = Repro(name="acme_race", title="ACME trainer race", description="d", references=("x",),
                      affected="acme < 2", fixed="acme >= 2", framework=Framework("acme-trainer-not-installed"),
                      variants=(Variant("unpatched", "reproduced", "u"), Variant("patched", "clean", "p")),
                      run=lambda ctx: None)
    """))
    info = tmp_path / "acme_repro-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-repro\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest_streamrace.repros]\nacme = acme_repro\n")
    import os
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_third_party_repro_is_listed_and_a_missing_framework_says_how_to_install(third_party):
    listed = repro("list", env=third_party)
    assert "acme_race            ACME trainer race" in listed.stdout
    out = repro("acme_race", env=third_party)
    assert out.returncode == 2
    assert out.stderr == "error: acme-trainer-not-installed is not installed (pip install acme-trainer-not-installed)\n"
