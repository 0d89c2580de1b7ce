"""What a call of speculative_generate reports, and the counters the loop keeps on the device.

`GenerationStats` holds the counters as vLLM reports them (drafts, draft tokens, accepted tokens,
per draft position), specref's own (row-steps, emitted tokens, target forwards: tau = emitted
tokens per row per forward) and the phases' times. The loop adds to `Counters` once per step
without reading anything back (the totals stay on the device), and `fill` reads them once, at the
end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch


@dataclass
class GenerationStats:
    """Counters as vLLM reports them, plus target forwards and timings (seconds)."""

    num_drafts: int = 0  # row-steps that verified a non-empty draft
    num_draft_tokens: int = 0  # draft tokens (or tree nodes) sent to verification
    num_accepted_tokens: int = 0  # accepted draft tokens that were emitted (not past an eos or the budget)
    accepted_per_position: List[int] = field(default_factory=list)  # accepted count at draft position i
    drafted_per_position: List[int] = field(default_factory=list)  # drafts offered at position i
    num_row_steps: int = 0  # (row, step) pairs in which a row was active
    num_emitted_tokens: int = 0  # tokens emitted (all rows)
    target_forwards: int = 0  # verify forwards (the prefill is not counted)
    wall_time: float = 0.0  # whole call
    prefill_time: float = 0.0  # the phases, host clock (device-exact with timing=True)
    draft_time: float = 0.0  # time inside the proposer
    verify_time: float = 0.0  # target forwards + rejection step

    @property
    def tokens_per_forward(self) -> float:
        """Mean tokens emitted per row per target forward (tau; 1.0 for autoregressive decoding)."""
        return self.num_emitted_tokens / max(self.num_row_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def acceptance_per_position(self) -> List[float]:
        return [a / max(d, 1) for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.num_emitted_tokens / max(self.wall_time, 1e-9)



class Counters:
    """The loop's statistics, accumulated on the device; read once, by `fill`."""

    def __init__(self, device: torch.device):
        self.dev = device
        self.totals = torch.zeros(5, dtype=torch.long, device=device)  # row-steps, emitted, drafts,
        # draft tokens, accepted
        self.drafted = torch.zeros(0, dtype=torch.long, device=device)  # (P,) per draft position
        self.accepted = torch.zeros(0, dtype=torch.long, device=device)  # (P,)
        self.forwards = 0

    def add(self, block, step, active: torch.Tensor, num_emit: torch.Tensor,
            accepted: torch.Tensor) -> None:
        """One step: rows active, tokens emitted, drafts verified, accepted drafts emitted (B,) each;
        per draft position i: rows offering it (depth > i) and accepting it (accepted > i)."""
        self.forwards += 1
        self.totals += torch.stack([active.sum(), num_emit.sum(), (block.lengths > 0).sum(),
                                    block.lengths.sum(), accepted.sum()])
        P = step.emitted.shape[1] - 1  # the deepest position verified this step (host-known)
        if P > self.drafted.numel():
            grow = torch.zeros(P - self.drafted.numel(), dtype=torch.long, device=self.dev)
            self.drafted, self.accepted = torch.cat([self.drafted, grow]), torch.cat([self.accepted, grow])
        i = torch.arange(P, device=self.dev).view(1, P)  # (1, P)
        self.drafted[:P] += (i < block.depth.view(-1, 1)).sum(0)
        self.accepted[:P] += (i < accepted.view(-1, 1)).sum(0)

    def fill(self, stats: GenerationStats) -> None:
        (stats.num_row_steps, stats.num_emitted_tokens, stats.num_drafts, stats.num_draft_tokens,
         stats.num_accepted_tokens) = self.totals.tolist()
        stats.drafted_per_position = self.drafted.tolist()
        stats.accepted_per_position = self.accepted.tolist()
        stats.target_forwards = self.forwards
