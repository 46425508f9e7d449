"""Peak memory per phase: the span from one phase mark to the next is a segment, labelled by the mark that opened it.

On a CUDA device the peak is the caching allocator's ``max_memory_allocated``, reset at every mark, so each segment
gets its own peak over everything the process allocated. On CPU there is no allocator statistic to read, so the
peak is the bytes of the checker's live tracked storages, sampled at every mark and registration — the part of the
footprint the test said it cares about.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Segment:
    phase: str  # the mark that opened it ("start" before the first)
    occurrence: int  # 1 for the first time this phase was marked
    peak_bytes: int = 0


class PhasePeaks:
    def __init__(self, device, live_bytes):
        """device: a torch.device (CUDA: allocator statistics) or None/cpu (tracked bytes, from `live_bytes()`)."""
        import torch

        self._cuda = device is not None and torch.device(device).type == "cuda"
        self._device = torch.device(device) if self._cuda else None
        self._live_bytes = live_bytes
        self.segments: list[Segment] = [Segment("start", 1)]
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        self.sample()

    @property
    def source(self) -> str:
        return "torch.cuda.max_memory_allocated" if self._cuda else "live tracked storages"

    def sample(self) -> None:
        """Fold the memory in use now (and, on CUDA, the allocator's peak since the last mark) into the segment."""
        if self._cuda:
            import torch

            now = torch.cuda.max_memory_allocated(self._device)
        else:
            now = self._live_bytes()
        current = self.segments[-1]
        current.peak_bytes = max(current.peak_bytes, now)

    def mark(self, phase: str, occurrence: int) -> None:
        """Close the current segment and open one labelled `phase`."""
        self.sample()
        self.segments.append(Segment(phase, occurrence))
        if self._cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self._device)
        self.sample()

    def by_phase(self) -> dict[str, int]:
        """Each phase's largest segment peak, in the order phases were first marked."""
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.phase] = max(out.get(s.phase, 0), s.peak_bytes)
        return out
