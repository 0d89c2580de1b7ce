"""What a call adds around the decoding loop, behind one object the loop calls at fixed points.

generate.py's loop is the paper's four steps (draft, verify, accept, commit). Everything else a
call asks for, transformers' conventions and the checks of what a user passes, lives here, each
piece at one named point of a step:

  on_start, on_end   the streamer (batch 1, as transformers): the prompt first, end() at the end
  on_draft           a user proposer's Draft checked before the target sees it (checks.check_draft);
                     every tree's sibling kinds paired with its q (checks.check_siblings)
  on_scores          logits processors applied to the verify block, each row on its own path's
                     context, draft tokens included, which keeps them lossless (processors.py)
  on_accept          the step's distributions checked for NaN / inf on the device; the flag is read
                     with the next step's one device read (nan_flag), and on_read raises then,
                     naming the model, the row and the step (checks.finite_or_raise)
  on_emit            stop strings: a row ends where transformers' StopStringCriteria ends it, even
                     inside an accepted run (generation.StopStrings)
  on_commit          the streamer gets the step's committed tokens
  should_stop        max_time (transformers' MaxTimeCriteria): no step starts after it has passed
  sequences          the output as model.generate returns it (return_sequences)

Without a streamer, stop strings, processors or a user's proposer, each point is a no-op and costs
no device read; the NaN check costs none of its own (its flag rides on the loop's read).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from .. import checks
from . import generation, processors
from .generation import StopStrings


@dataclass
class Hooks:
    """One call's extras (module docstring) and the state they carry between steps."""

    batch: int  # B
    vocab: int  # V, the target's vocabulary
    k: int  # the proposer's k: a draft deeper than max(k, 1) is an error
    who: str  # the proposer's class name, for errors
    trusted: bool  # the library's own proposer (checks.trusted): no per-step Draft check
    greedy: bool  # temperature 0: the logits themselves are checked for NaN (no argmax then)
    procs: Optional[processors.Processors]  # the logits processors, or None
    stops: Optional[StopStrings]  # the stop strings, or None
    streamer: object  # a transformers streamer, or None
    max_time: Optional[float]  # seconds after `started` when no further step starts, or None
    started: float  # time.perf_counter() when the call began
    prompt: torch.Tensor  # (T0,) row 0's prompt, for the streamer
    input_ids: object  # the prompt as passed, for sequences
    return_sequences: bool
    pad_token_id: Optional[int]
    step: int = 0  # steps accepted so far
    nan: Optional[torch.Tensor] = None  # (0-d bool) the last step's distributions held NaN / inf
    seen: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # ... these distributions
    raw: Optional[torch.Tensor] = None  # (B, 1+N, V) the block's logits before the processors

    def on_start(self) -> None:
        if self.streamer is not None:
            self.streamer.put(self.prompt.view(1, -1).cpu())  # as transformers: the prompt first

    def on_end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def nan_flag(self, like: torch.Tensor) -> torch.Tensor:
        """(0-d long) the last step's NaN / inf flag, for the loop's one device read."""
        return self.nan.long() if self.nan is not None else like.new_zeros(())

    def on_read(self, failed: int) -> None:
        """Raise for the last step's NaN / inf (read by the loop), naming the row and the step."""
        if failed:
            checks.finite_or_raise(self.step - 1, self.who, **self.seen)

    def on_draft(self, draft):
        """The Draft of a proposer that is not entirely specref's own, checked (a few host reads);
        the sibling kinds of every tree draft, host-side."""
        if not self.trusted:
            checks.check_draft(draft, self.who, self.batch, self.vocab, self.k)
        if draft.parents is not None:
            checks.check_siblings(draft, self.who)
        return draft

    def on_scores(self, block, ctx, num_new: torch.Tensor) -> torch.Tensor:
        """The block's logits (B, 1+N, V) after the processors, each row on its own path's context."""
        self.raw = block.logits
        if self.procs is None:
            return block.logits
        return processors.apply_to_block(self.procs, block.logits, ctx.tokens, ctx.lengths, num_new,
                                         block.tokens, block.parents, block.lengths)

    def on_accept(self, step, seen: Dict[str, Optional[torch.Tensor]]):
        """The step's distributions `seen` (p, q) checked for NaN / inf on the device (raised by the
        next on_read); the emitted ids kept valid until then; a draft deeper than k refused."""
        if self.procs is not None or self.greedy:
            seen["logits"] = self.raw  # NaN has no argmax; processors' -inf is allowed, NaN is not
        self.seen = seen
        self.nan = torch.stack([_bad(t, name) for name, t in seen.items() if t is not None]).any()
        step.emitted.clamp_(max=self.vocab - 1)  # a NaN step's garbage stays a valid id until raised
        if step.emitted.shape[1] > max(self.k, 1) + 1:
            raise ValueError(f"the proposer's draft reaches depth {step.emitted.shape[1] - 1}, more "
                             f"than its k = {self.k}")
        self.step += 1
        return step

    def on_emit(self, ctx, step, num_emit: torch.Tensor, ended: torch.Tensor):
        """(num_emit (B,), ended (B,)): a stop string completed inside the run ends the row there."""
        if self.stops is None:
            return num_emit, ended
        num_emit, stopped = self.stops.first_stop(ctx.tokens, ctx.lengths, step.emitted, num_emit)  # (B,) x2
        return num_emit, ended | stopped

    def on_commit(self, emitted: torch.Tensor, num_emit: torch.Tensor) -> None:
        if self.streamer is not None and int(num_emit[0]):
            self.streamer.put(emitted[0, : int(num_emit[0])].cpu())  # the step's committed tokens

    def should_stop(self) -> bool:
        """transformers' MaxTimeCriteria, checked after each step on the host clock."""
        return self.max_time is not None and time.perf_counter() - self.started > self.max_time

    def sequences(self, tokens: torch.Tensor, num_tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, T + n) prompt + new tokens padded with pad_token_id with return_sequences, else None."""
        if not self.return_sequences:
            return None
        return generation.sequences(checks.as_token_tensor(self.input_ids, "input_ids"), tokens, num_tokens,
                                    self.pad_token_id)


def _bad(x: torch.Tensor, name: str) -> torch.Tensor:
    """(0-d bool) NaN in the logits (greedy has no argmax then), NaN or inf in p or q."""
    return torch.isnan(x).any() if name == "logits" else (~torch.isfinite(x)).any()
