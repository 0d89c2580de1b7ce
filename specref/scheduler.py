"""A request queue over the decoding loop: a finished row takes the next waiting request.

`speculative_generate` decodes one batch: a row that ends early idles until the batch's last row
ends, and the next batch waits for all of them (static batching). `schedule()` keeps B rows busy
(continuous batching, Yu et al. 2022, Orca's iteration-level scheduling, here at the granularity
of one speculative step): before every step, each row whose request has ended hands its tokens
back and takes the next waiting request, whose prompt is prefilled alone into that row's slots of
the static KV cache (its own length; the other rows are untouched: kv_rollback.write_rows), and
the proposer forgets the row (`reset_rows`, proposer.py). The step itself is generate.py's loop,
unchanged: the same draft, verify, accept and commit on the same cache; the scheduler is a
callback at the loop's one device read (it reads which rows ended and what they emitted there).

Randomness is per request: request i samples with its own generator (`generator[i]`, or seeded
`seed + i`), which moves into whichever row serves it, so a request's output does not depend on B,
on the other requests or on the refill order (each row draws a fixed k + 1 uniforms per step from
its own generator: rejection.py). With seed s and B >= N it is speculative_generate's output with
seed s. Lossless as the loop is: every emitted token comes out of the rejection step against the
target's p for that row's context (the chi-square of refilled rows: tests/test_scheduler.py).

A proposer without `reset_rows` (one whose per-row state the library cannot reset alone: a head
that reads the target's features) is scheduled in static batches instead (refill="batch"): the
loop waits until every row has ended, prefills the next B requests together and calls begin()
again, as a new call would. The stats count the idle row-steps (a row with no request while
requests wait: 0 with per-row refill) and the finished rows' row-steps (none waiting).
Left out: requests arriving while the loop runs (every request is queued at the call's start),
preemption, chunked prefill, prefix sharing between requests, beams, return_sequences.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from . import checks
from .counters import GenerationStats
from .generate import _clock, _decode
from .hf.generation import UNSET
from .prepare import prepare
from .sampling import make_generators
from .target import Target

Streamer = Callable[[int, List[int], bool], None]  # (request index, its new tokens, finished)


@dataclass(frozen=True)
class Request:
    """One request: its prompt, and optionally its own token budget and generator."""

    prompt: Sequence[int]  # token ids (a list, or a 1-D tensor)
    max_new_tokens: Optional[int] = None  # None: the call's max_new_tokens
    generator: Optional[torch.Generator] = None  # None: seeded seed + i (i: the request's index)


@dataclass
class ScheduleOutput:
    """Every request's tokens in request order, and the call's counters (row_* lists per request)."""

    tokens: List[List[int]]  # per request: its generated tokens
    stats: GenerationStats = field(default_factory=GenerationStats)

    def row(self, i: int) -> List[int]:
        return self.tokens[i]


def schedule(target, proposer, requests, *, batch_size: int, max_new_tokens: Optional[int] = UNSET,
             refill: str = "row", generator=None, seed: Optional[int] = None, streamer: Optional[Streamer] = None,
             max_len: Optional[int] = None, timing: bool = False, **kwargs) -> ScheduleOutput:
    """Decode every request with B = batch_size rows, a finished row taking the next request.

    requests: `Request`s or prompts (lists of ids, 1-D tensors). refill: "row" (a finished row takes
    the next request at once; needs the proposer's `reset_rows`, else "batch" is used) or "batch"
    (static batches of B requests, each waiting for its slowest row). generator: one
    torch.Generator per request (a list), or `seed` (request i: seed + i); a Request's own generator
    wins. streamer: called (i, new_tokens, finished) once per step with request i's committed tokens,
    and once with finished=True. Every other keyword (temperature, top_k, top_p, eos_token_id,
    logits processors, stop_strings with tokenizer, generation_config, ...) is speculative_generate's,
    shared by every request. Returns ScheduleOutput(tokens per request in request order, stats).
    """
    t_start = time.perf_counter()
    tgt = target if isinstance(target, Target) else Target(target)
    reqs = [r if isinstance(r, Request) else Request(r) for r in requests]
    if not reqs:
        raise ValueError("requests is empty: pass at least one prompt")
    if refill not in ("row", "batch"):
        raise ValueError(f"refill must be 'row' or 'batch', got {refill!r}")
    B = min(checks.as_int(batch_size, "batch_size", low=1), len(reqs))
    for key in ("streamer", "return_sequences", "input_ids", "attention_mask"):
        if key in kwargs:
            raise ValueError(f"schedule() takes no {key!r} (per-request streaming: streamer=callable)")
    gens = _generators(reqs, generator, seed, tgt.device)
    if max_new_tokens is not UNSET:
        kwargs["max_new_tokens"] = max_new_tokens
    per_row = refill == "row" and callable(getattr(proposer, "reset_rows", None))
    sched = _Scheduler(tgt, proposer, reqs, gens, B, per_row, streamer, kwargs, max_len, timing, t_start)
    return sched.run()


def _generators(reqs: List[Request], generator, seed, dev) -> list:
    """One generator per request: the Request's, else generator[i], else seeded seed + i."""
    N = len(reqs)
    if generator is not None and seed is not None:
        raise ValueError("pass generator or seed, not both (seed would be ignored)")
    if generator is not None:
        if isinstance(generator, torch.Generator):
            raise ValueError("schedule() needs one generator per request (a list of them) or a seed: one "
                             "shared generator would make a request's output depend on the others")
        gens = checks.generators(list(generator), N)
    else:
        base = checks.seed_value(seed, N) if seed is not None else int(torch.randint(0, 2**62, ()))
        gens = make_generators(base, N, dev)
    return [r.generator if r.generator is not None else g for r, g in zip(reqs, gens)]


class _Scheduler:
    """The queue, the row <-> request map and the per-request results of one schedule() call."""

    def __init__(self, tgt, proposer, reqs, gens, B, per_row, streamer, kwargs, max_len, timing, t_start):
        self.tgt, self.proposer, self.reqs, self.gens, self.B = tgt, proposer, reqs, gens, B
        self.per_row, self.streamer, self.t_start = per_row, streamer, t_start
        self.clock = _clock(timing, tgt.device)
        bad = [i for i, r in enumerate(reqs) if len(r.prompt) == 0]
        if bad:
            raise ValueError(f"requests[{bad[0]}] has an empty prompt: every request needs at least one token")
        self.prompts = [checks.as_token_tensor(r.prompt, f"requests[{i}].prompt").view(-1).long()
                        for i, r in enumerate(reqs)]
        V = tgt.vocab_size
        out = [i for i, p in enumerate(self.prompts) if int(p.min()) < 0 or int(p.max()) >= V]
        if out:
            raise ValueError(f"requests[{out[0]}].prompt has token ids outside [0, {V})")
        self.kwargs, self.max_len = kwargs, max_len
        N = len(reqs)
        self.tokens: List[Optional[List[int]]] = [None] * N
        self.first = [0.0] * N  # seconds from the start to the request's first token
        self.last = [0.0] * N  # ... to its last token
        self.streamed = [0] * N
        self.row_req = [-1] * B  # the request each row serves (-1: none)
        self.next = 0  # the next waiting request
        self.idle = self.finished = 0
        self.stats = GenerationStats()

    # -- setup: the first B requests through prepare(), the buffers widened for every request -------
    def run(self) -> "ScheduleOutput":
        N = len(self.reqs)
        budgets = [self._budget(i) for i in range(N)]
        lens = [int(p.numel()) for p in self.prompts]
        for i in range(N):
            if budgets[i] == 0:
                self.tokens[i] = []  # nothing to generate: never queued
        self.queue = [i for i in range(N) if budgets[i] > 0]
        if not self.queue:
            return self._output()
        B = self.B = min(self.B, len(self.queue))
        first = self.queue[:B]
        T = max(lens[i] for i in first)
        ids = torch.zeros(B, T, dtype=torch.long)  # (B, T) left-padded
        mask = torch.zeros(B, T, dtype=torch.long)  # (B, T)
        for b, i in enumerate(first):
            ids[b, T - lens[i]:], mask[b, T - lens[i]:] = self.prompts[i], 1
        k = checks.check_proposer(self.proposer)
        longest, most = max(lens), max(budgets)
        if self.tgt.max_positions is not None:
            over = [i for i in range(N) if lens[i] + budgets[i] > self.tgt.max_positions]
            if over:
                i = over[0]
                raise ValueError(f"requests[{i}]: its prompt ({lens[i]} tokens) + max_new_tokens ({budgets[i]}) "
                                 f"exceeds the model's {self.tgt.max_positions} positions")
        T_ctx = longest + most + max(k, 1) + 1
        max_len = self.max_len if self.max_len is not None else (
            -(-T_ctx // 256) * 256 if self.tgt.config.compile else T_ctx)
        if max_len < T_ctx:
            raise ValueError(f"max_len {max_len} is too small: the longest prompt ({longest} tokens) + "
                             f"max_new_tokens ({most}) + k + 1 needs {T_ctx}")
        kw = dict(self.kwargs)
        kw["max_new_tokens"] = most
        config, tokenizer = kw.pop("generation_config", None), kw.pop("tokenizer", None)
        verify = kw.pop("verify", "tokenwise")  # speculative_generate's verification rule
        settings = _settings(kw)  # what is left in kw: generate-style keywords (do_sample, ...)
        run, hooks = prepare(self.tgt, self.proposer, ids, mask, config, kw, settings,
                             [self.gens[i] for i in first], None, max_len, tokenizer, None, False, self.t_start,
                             verify)
        self.run_, self.budgets = run, budgets
        dev = self.tgt.device
        ctx = run.ctx
        if ctx.tokens.shape[1] < T_ctx:  # room for the longest request (before begin() sizes by it)
            ctx.tokens = torch.cat([ctx.tokens, ctx.tokens.new_zeros(B, T_ctx - ctx.tokens.shape[1])], 1)  # (B, T)
        W = run.out_tokens.shape[1]
        run.max_new_tokens = torch.tensor([budgets[i] for i in first], device=dev)  # (B,) per row
        run.generator = [self.gens[i] for i in first]
        self.row_req = list(first)
        self.next = B  # the next waiting request: queue[next]
        self.spare = torch.Generator(device=dev).manual_seed(0)  # drawn from by rows with no request
        self.W = W
        counters = _decode(run, hooks, self.stats, self.clock, refill=self._refill)
        self._harvest([b for b in range(B) if self.row_req[b] >= 0], counters.marks[-1] - self.t_start)
        return self._output()

    def _budget(self, i: int) -> int:
        r = self.reqs[i]
        if r.max_new_tokens is not None:
            return checks.as_int(r.max_new_tokens, f"requests[{i}].max_new_tokens", low=0)
        n = self.kwargs.get("max_new_tokens", UNSET)
        if n is UNSET or n is None:
            raise ValueError("schedule() needs max_new_tokens (the call's, or each Request's)")
        return checks.as_int(n, "max_new_tokens", low=0)

    # -- the loop's callback: before every step ------------------------------------------------------
    def _refill(self, alive: int, longest: int, rows: list):
        """rows: active (B,) then num_new (B,) as read by the loop. -> (alive, longest) after refill."""
        B, now = self.B, time.perf_counter() - self.t_start  # the loop's read has just waited for the step
        active, num_new = rows[:B], rows[B:]
        done, streaming = [], []
        for b, i in enumerate(self.row_req):
            if i < 0:
                continue
            if num_new[b] > 0 and self.streamed[i] == 0 and self.first[i] == 0.0:
                self.first[i] = now
            if num_new[b] > self.streamed[i]:
                streaming.append(b)
            if not active[b]:
                done.append(b)
        if streaming and self.streamer is not None:
            out = self.run_.out_tokens[streaming].tolist()
            for b, toks in zip(streaming, out):
                i = self.row_req[b]
                self.streamer(i, toks[self.streamed[i]:num_new[b]], False)
        for b in streaming:
            self.streamed[self.row_req[b]] = num_new[b]
        self._harvest(done, now)
        free = [b for b in range(B) if self.row_req[b] < 0]
        waiting = self.next < len(self.queue)
        if waiting and free and (self.per_row or len(free) == B):
            alive, longest = self._place(free[: len(self.queue) - self.next], alive, longest)
            free = [b for b in range(B) if self.row_req[b] < 0]
            waiting = self.next < len(self.queue)
        if alive:  # the step about to run: rows without a request
            if waiting:
                self.idle += len(free)
            else:
                self.finished += len(free)
        return alive, longest

    def _harvest(self, rows: List[int], now: float) -> None:
        """Rows whose request ended: its tokens out, the row free."""
        if not rows:
            return
        run = self.run_
        n = run.num_new[rows].tolist()
        out = run.out_tokens[rows].tolist()
        for b, toks, m in zip(rows, out, n):
            i = self.row_req[b]
            self.tokens[i] = toks[:m]
            self.last[i] = now
            if m and self.first[i] == 0.0:
                self.first[i] = now
            if self.streamer is not None:
                if m > self.streamed[i]:
                    self.streamer(i, toks[self.streamed[i]:m], False)
                self.streamer(i, [], True)
            self.streamed[i] = m
            self.row_req[b] = -1
            run.generator[b] = self.spare

    def _place(self, rows: List[int], alive: int, longest: int):
        """The next len(rows) requests into `rows`: context, budget, generator, the prefill of each
        prompt but its last token into the row's cache slots, the proposer's reset (per row) or
        begin (a static batch)."""
        run, ctx, dev = self.run_, self.run_.ctx, self.tgt.device
        t0 = self.clock()
        J = self.queue[self.next: self.next + len(rows)]
        self.next += len(rows)
        R = torch.tensor(rows, device=dev)  # (R,)
        P = torch.tensor([int(self.prompts[j].numel()) for j in J], device=dev)  # (R,)
        Pm = int(P.max())
        toks = torch.zeros(len(rows), ctx.tokens.shape[1], dtype=torch.long, device=dev)  # (R, T)
        for r, j in enumerate(J):
            toks[r, : self.prompts[j].numel()] = self.prompts[j].to(dev)
        ctx.tokens[R] = toks
        ctx.lengths[R] = P
        ctx.prompt_lengths[R] = P
        ctx.active[R] = True
        run.num_new[R] = 0
        run.out_tokens[R] = -1
        run.max_new_tokens[R] = torch.tensor([self.budgets[j] for j in J], device=dev)
        for b, j in zip(rows, J):
            self.row_req[b] = j
            run.generator[b] = self.gens[j]
        hidden = None
        tmp = self.tgt.new_cache(len(rows), max(Pm - 1, 1))
        if Pm > 1:  # prompts of one token have nothing to prefill (their token opens the first block)
            pre = self.tgt.prefill(tmp, toks[:, :Pm - 1], P - 1, logits=False, hidden_layers=run.hidden_layers)
            hidden = pre.hidden  # (R, Pm - 1, D) or None
        run.cache.write_rows(R, tmp)
        if self.per_row:
            if run.hidden_layers is not None and ctx.hidden_len is not None:
                ctx.hidden_len[R] = 0  # the new rows' features go to reset_rows, not to ctx.hidden
            self.proposer.reset_rows(ctx, R, hidden)
        else:  # a static batch: every row is new (rows past the last request stay ended)
            if run.hidden_layers is not None:
                if hidden is None:  # prompts of one token: no feature yet (a zero-width block, as generate's prefill)
                    hidden = ctx.hidden.new_zeros((len(rows), 0, ctx.hidden.shape[-1]))  # (R, 0, D)
                ctx.hidden = hidden if len(rows) == self.B else _pad_rows(hidden, R, self.B)
                ctx.hidden_len = (ctx.prompt_lengths - 1) * ctx.active
            self.proposer.begin(ctx, run.sampling, run.generator)
        self.stats.prefill_time += self.clock() - t0
        return 1, max(longest, Pm)

    def _output(self) -> ScheduleOutput:
        s = self.stats
        s.wall_time = time.perf_counter() - self.t_start
        self.tokens = [[] if t is None else t for t in self.tokens]  # max_time: requests never started
        s.row_tokens = [len(t) for t in self.tokens]
        s.row_first_token, s.row_latency = self.first, self.last
        s.first_token_time = sum(self.first) / max(len(self.first), 1)
        s.idle_row_steps, s.finished_row_steps = self.idle, self.finished
        return ScheduleOutput(list(self.tokens), s)


def _pad_rows(hidden: Optional[torch.Tensor], rows: torch.Tensor, B: int) -> Optional[torch.Tensor]:
    """(R, P, D) features of rows `rows` as (B, P, D), zero elsewhere (rows with no request)."""
    if hidden is None:
        return None
    full = hidden.new_zeros((B, *hidden.shape[1:]))  # (B, P, D)
    full[rows] = hidden
    return full


def _settings(kw: dict) -> dict:
    """speculative_generate's sampling keywords out of kw (the rest are generate-style extras)."""
    names = ("temperature", "top_k", "top_p", "eos_token_id", "max_new_tokens", "pad_token_id",
             "presence_penalty", "frequency_penalty", "logits_processor", "stop_strings")
    out = {n: kw.pop(n, UNSET) for n in names}
    for n in ("presence_penalty", "frequency_penalty"):
        out[n] = 0.0 if out[n] is UNSET else out[n]
    if out["logits_processor"] is UNSET:
        out["logits_processor"] = None
    return out
