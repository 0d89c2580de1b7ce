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
    first_token_time: float = 0.0  # time to first token (TTFT): the call's start to the end of the
    # first step, which emits every row's first token (a scheduler: the mean over its requests)
    row_latency: List[float] = field(default_factory=list)  # per row (a scheduler: per request): the
    # call's start to the end of the step that emitted its last token, seconds
    row_first_token: List[float] = field(default_factory=list)  # per row (request): the call's start
    # to the end of the step that emitted its first token (a queued request's wait included)
    row_tokens: List[int] = field(default_factory=list)  # per row (request): tokens emitted
    idle_row_steps: int = 0  # (row, step) pairs with no request in the row while requests waited
    finished_row_steps: int = 0  # (row, step) pairs with no request in the row, none waiting (a
    # static batch: every row-step after a row ended, until the batch's last row ends)

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
        """End to end: every emitted token over the whole call (prefill included)."""
        return self.num_emitted_tokens / max(self.wall_time, 1e-9)

    @property
    def decode_time(self) -> float:
        """The call less its prefills (the loop's steps and what runs between them)."""
        return max(self.wall_time - self.prefill_time, 0.0)

    @property
    def decode_tokens_per_second(self) -> float:
        """Decoding alone: every emitted token over the call's time outside its prefills."""
        return self.num_emitted_tokens / max(self.decode_time, 1e-9)

    @property
    def time_per_output_token(self) -> List[float]:
        """TPOT per row (request): (last token's time - first token's time) / (tokens - 1); 0.0 for a
        row of fewer than two tokens."""
        return [(end - first) / (n - 1) if n > 1 else 0.0
                for end, first, n in zip(self.row_latency, self.row_first_token, self.row_tokens)]

    @property
    def idle_fraction(self) -> float:
        """Row-steps with no request in the row while requests waited, over all row-steps."""
        total = self.num_row_steps + self.idle_row_steps + self.finished_row_steps
        return self.idle_row_steps / max(total, 1)



class Counters:
    """The loop's statistics, accumulated on the device; read once, by `fill`."""

    def __init__(self, device: torch.device):
        self.dev = device
        self.totals = torch.zeros(5, dtype=torch.long, device=device)  # row-steps, emitted, drafts,
        # draft tokens, accepted
        self.drafted = torch.zeros(0, dtype=torch.long, device=device)  # (P,) per draft position
        self.accepted = torch.zeros(0, dtype=torch.long, device=device)  # (P,)
        self.forwards = 0
        self.marks: List[float] = []  # host clock after each of the loop's reads: marks[0] after the
        # prefill, marks[s + 1] once step s is done (the read waits for the device: exact on CUDA too)
        self.end_step = None  # (B,) long: the step in which a row ended, -1 while it runs

    def mark(self, t: float) -> None:
        """The host clock right after the loop's device read (step len(marks) - 1 is then done)."""
        self.marks.append(t)

    def ended(self, rows: torch.Tensor) -> None:
        """rows (B,) bool ended in the step just counted (self.forwards - 1)."""
        if self.end_step is None:
            self.end_step = torch.full(rows.shape, -1, dtype=torch.long, device=self.dev)
        self.end_step = torch.where(rows & (self.end_step < 0), self.forwards - 1, self.end_step)

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

    def fill_rows(self, stats: GenerationStats, num_new: torch.Tensor, started: float) -> None:
        """One batch's per-row times (every row's first token comes out of step 0) and its finished
        rows' idle row-steps; `started` the call's start on the host clock."""
        B = int(num_new.shape[0])
        stats.row_tokens = num_new.tolist()
        stats.finished_row_steps = self.forwards * B - stats.num_row_steps
        if self.forwards == 0 or len(self.marks) < 2:
            stats.row_first_token = stats.row_latency = [0.0] * B
            return
        end = self.end_step if self.end_step is not None else torch.full((B,), -1, dtype=torch.long)
        end = end.tolist()
        last = len(self.marks) - 2  # the last step whose end was marked
        stats.first_token_time = self.marks[1] - started
        stats.row_first_token = [stats.first_token_time] * B
        stats.row_latency = [self.marks[min(e if e >= 0 else last, last) + 1] - started for e in end]
