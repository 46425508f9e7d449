"""Megatron-core on CPU (frameworks/megatron_cpu.py) and the repro's stream-wait switch (repros/_megatron.py)."""

from __future__ import annotations

import os
import tempfile
from importlib import metadata

import pytest
import torch

from pytest_streamrace.detector.session import Detector
from pytest_streamrace.detector.models.virtual_streams import Stream as VirtualStream
from pytest_streamrace.frameworks.megatron_cpu import megatron_on_virtual_streams, prepare_import


@pytest.fixture
def virtual():
    with Detector(backend="virtual") as detector:
        yield detector


def test_cuda_devices_land_on_cpu_inside_and_nothing_changes_outside(virtual):
    current_device = torch.cuda.current_device
    with megatron_on_virtual_streams():
        assert torch.cuda.current_device() == 0
        made = [torch.zeros(3, device=torch.cuda.current_device()), torch.empty(2, device="cuda:1"),
                torch.ones(2, device=torch.device("cuda")), torch.zeros(2).cuda(), torch.zeros(2).to("cuda"),
                torch.zeros(2).to(0), torch.zeros(2).new_zeros(3, device="cuda")]
        assert [t.device.type for t in made] == ["cpu"] * len(made)
        assert torch.zeros(2, device="meta").device.type == "meta"  # other devices are left alone
        # megatron's optimizers take parameters by their CUDA type name; conversions by name are untouched
        assert [torch.zeros(1, dtype=d).type() for d in (torch.float32, torch.bfloat16, torch.float16)] == [
            "torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor", "torch.cuda.HalfTensor"]
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64
        assert torch.zeros(1).type("torch.DoubleTensor").type() == "torch.cuda.DoubleTensor"
        assert isinstance(torch.cuda.Stream(device=torch.cuda.current_device()), VirtualStream)
    assert torch.cuda.current_device is current_device
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():  # CUDA devices are CUDA again: on a CPU build, an error
        with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
            torch.zeros(1, device="cuda")


def test_needs_an_active_virtual_detector():
    with pytest.raises(RuntimeError, match=r"needs an active Detector\(backend='virtual'\)"):
        with megatron_on_virtual_streams():
            pass


def test_prepare_import_keeps_the_users_extension_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    prepare_import()
    assert os.path.dirname(os.environ["TORCH_EXTENSIONS_DIR"]) == tempfile.gettempdir()
    assert os.path.basename(os.environ["TORCH_EXTENSIONS_DIR"]).startswith("streamrace-torch-extensions-")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    prepare_import()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


# the stream-wait switch, on the installed megatron-core

prepare_import()  # before megatron-core's import-time JIT build, as the repro does
pytest.importorskip("megatron.core", reason="megatron-core is not installed")
from pytest_streamrace.repros import _megatron  # noqa: E402  (the shipped repro's helper; needs megatron-core)


def _call_from(filename: str, line: int, function: str):
    """Call torch.cuda.<function>() from `filename`:`line`, as megatron's code at that line would."""
    scope = {"torch": torch}
    exec(compile("\n" * (line - 1) + f"result = torch.cuda.{function}()", filename, "exec"), scope)
    return scope["result"]


def test_the_installed_waits_are_found_and_read_from_the_code():
    filename, sites = _megatron.wait_sites()
    assert filename.endswith("megatron/core/distributed/param_and_grad_buffer.py")
    assert len(sites) == 2  # start_grad_sync's and finish_grad_sync's
    version = tuple(int(x) for x in metadata.version("megatron-core").split(".")[:2])
    assert _megatron.native_wait() == ("default" if version < (0, 17) else "current")  # 0.17: Megatron-LM #3693


@pytest.mark.parametrize("which", ["default", "current"])
def test_the_switch_redirects_only_the_wait_lines(virtual, which):
    filename, sites = _megatron.wait_sites()
    native = _megatron.native_wait()
    side = torch.cuda.Stream()
    wanted = {"default": torch.cuda.default_stream, "current": torch.cuda.current_stream}
    with torch.cuda.stream(side), _megatron.stream_waits(which):
        for line in sites:
            assert _call_from(filename, line, f"{native}_stream") is wanted[which]()
        # the same call anywhere else, in megatron's file or not, is the real one
        elsewhere = min(sites) - 1
        assert _call_from(filename, elsewhere, f"{native}_stream") is wanted[native]()
        assert getattr(torch.cuda, f"{native}_stream")() is wanted[native]()
    assert side is not torch.cuda.default_stream()


def test_an_unknown_layout_is_one_clear_error(monkeypatch):
    class Bucketless:
        def start_grad_sync(self):
            pass

        def finish_grad_sync(self):
            pass

    monkeypatch.setattr(_megatron, "_bucket_group", lambda: Bucketless)
    with pytest.raises(_megatron.LayoutError, match=r"expected one communication-stream wait in "
                                                   r".*Bucketless\.start_grad_sync, found 0"):
        _megatron.native_wait()


def test_unknown_wait_choice():
    with pytest.raises(ValueError, match="expected one of"):
        with _megatron.stream_waits("side"):
            pass
