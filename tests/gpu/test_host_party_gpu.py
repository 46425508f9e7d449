"""The host as a party on real streams: pinned memory and non_blocking copies (tests/stacks/stack_pinned_memory.py) on
one GPU, plain and under `--streamrace`, and the clean twins again under `--streamrace-latent=fail`."""

import pytest
from gpu_support import stack_twins

CLAIMS = {
    55: "The host as a party on real streams: a device-to-host copy read before the sync, a staging buffer rewritten "
        "while a copy may read it, a side stream's copy read after syncing the default stream, a prefetcher without "
        "its events caught; their clean twins, the prefetcher with events and a `DataLoader(pin_memory=True)` loop "
        "clean, also under `--streamrace-latent=fail`",
}


@pytest.mark.gpu(count=1)
@pytest.mark.validates(55)
@pytest.mark.parametrize("latent", ["report", "fail"])
def test_pinned_memory_twins_on_real_streams(latent, gpu_result, tmp_path):
    stack_twins("pinned_memory", gpu_result, tmp_path, {}, log=f"host-party-{latent}",
                extra=[f"--streamrace-latent={latent}"])
