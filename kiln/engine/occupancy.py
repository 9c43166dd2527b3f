"""How full the KV cache got: the most sequences that ran in one step with their whole context in
the cache, and the blocks held then. `kiln bench` reports it beside the memory plan's count of
sequences that fit, so a plan (a windowed layer group holding only its window) is checked
against what the scheduler really ran at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Occupancy:
    peak_sequences: int = 0
    """The most requests that sampled in one step: every token of each (its whole prompt, its
    outputs so far) was in the cache together."""
    blocks_at_peak: int = 0
    """The most pool blocks held in a step that ran peak_sequences."""
    peak_running: int = 0
    """The most requests in the running batch after a schedule (some part-way through their
    prompts)."""
    peak_blocks: int = 0
    """The most pool blocks held after a schedule."""

    def record(self, sampling: int, running: int, blocks: int) -> None:
        """One schedule: requests sampling in it, requests running, pool blocks held."""
        if sampling > self.peak_sequences:
            self.peak_sequences, self.blocks_at_peak = sampling, blocks
        elif sampling == self.peak_sequences and blocks > self.blocks_at_peak:
            self.blocks_at_peak = blocks
        if running > self.peak_running:
            self.peak_running = running
        if blocks > self.peak_blocks:
            self.peak_blocks = blocks
