"""speculative_generate() and autoregressive_generate(): the one decoding loop of specref.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): each step
  1. draft    - a proposer guesses up to k tokens per row (chain) or a token tree;
  2. verify   - the target scores [last committed token, draft...] in ONE forward;
  3. accept   - rejection.py accepts a prefix (a tree path) and emits one recovered or bonus token
                per row; the row keeps them up to its token budget and its first eos;
  4. roll back - the KV cache keeps the accepted slots; the proposer is told what was accepted.
Before the loop, _prepare reads transformers' conventions, checks every argument and allocates the
context, the output buffers and the target's cache (one _Run); then a prefill opens the first step.
Every emitted token comes out of step 3, so the output is distributed exactly as direct sampling
from the target with the same sampling settings (proven by the chi-square tests), and under greedy
decoding it is token-for-token the target's greedy output. The one exception is opt-in: a proposer
whose `acceptance_rule` is Medusa's typical acceptance (typical.py) trades exactness for accepted
length at T > 0 (greedy stays exact).

The baseline `autoregressive_generate` is the same loop with an empty draft (a block of one token),
on the same cache, forward and sampling code, so a speed ratio between the two measures only
speculation. Batches are ragged: each row keeps its own length in the cache, accepts its own count
and stops on its own (eos inside an accepted run truncates the row there). Counters stay on the
device until the end; the phases are timed on the host clock, and the device is synchronised for
it only with `timing=True` (exact on CUDA then; on CPU the host clock is exact anyway).
Host reads (each one waits for a GPU): a chain step makes two in the loop's own code (counted by
tests/test_host_syncs.py): one of (rows alive, the longest context, the previous step's NaN/inf
check: raised then, naming its step and row) and the chain's width. The cache and the target get
the longest length from the first (no reads of their own); sampling with one generator per row
draws a fixed k + 1 uniforms per row and step. A user's proposer adds its Draft check (checks.py),
a tree its structure checks (tree.py), stop strings and a streamer their own reads.
Logits processors that read the context (repetition penalty, no-repeat n-grams, min_new_tokens,
bad words, presence / frequency penalties, a transformers LogitsProcessorList) are applied to p at
every draft position on that position's own context, draft tokens included (processors.py), which
keeps them lossless. transformers' calling conventions (GenerationConfig, sequences out, streamer,
stop strings) are read at the boundary (hf_generation.py). Left out: beam search and the other
settings hf_generation.resolve() names in its error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from . import checks, rejection, tree, typical
from .hf import generation as hf_generation, processors
from .proposer import Context, Draft
from .sampling import Generators, SamplingConfig, logits_to_probs, make_generators
from .target import Target, device_sync
from .hf.generation import UNSET
from .typical import TypicalAcceptance


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


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # (B, max_new_tokens) long, generated tokens, -1 after a row's end
    num_tokens: torch.Tensor  # (B,) long
    stats: GenerationStats
    sequences: Optional[torch.Tensor] = None  # (B, T + n) with return_sequences: the prompt as passed,
    # then the new tokens padded with pad_token_id (n: the longest row's count), as model.generate

    def row(self, b: int) -> List[int]:
        return self.tokens[b, : int(self.num_tokens[b])].tolist()


class NullProposer:
    """Proposes nothing: the speculative loop becomes plain autoregressive decoding."""

    k = 0

    def begin(self, ctx, sampling, generator) -> None:
        pass

    def propose(self, ctx: Context, sampling, generator) -> Draft:
        return Draft.empty(ctx.tokens.shape[0], ctx.tokens.device)

    def update(self, ctx, num_accepted) -> None:
        pass


@dataclass
class _Block:
    """Step 2's result: the draft as verified and the target's scores of it."""

    tokens: torch.Tensor  # (B, N) draft tokens (tree nodes), -1 padded
    lengths: torch.Tensor  # (B,) draft tokens (nodes) of each row sent to verification
    depth: torch.Tensor  # (B,) the deepest draft position offered (chain: its length)
    parents: Optional[torch.Tensor]  # (B, N) for a tree, None for a chain
    logits: torch.Tensor  # (B, 1+N, V): row i predicts the token after [pending, ..node i-1]
    hidden: Optional[torch.Tensor]  # (B, Q, D_h) the block's target features, or None


@dataclass
class StepResult:
    """Step 3's result, per row: what the rejection step accepted and emitted."""

    emitted: torch.Tensor  # (B, W) accepted drafts then the recovered or bonus token, -1 after
    num_accepted: torch.Tensor  # (B,) drafts (tree: path nodes) accepted, before eos and budget
    path: Optional[torch.Tensor] = None  # (B, W-1) node indices of the accepted tree path, or None


class _Counters:
    """The loop's statistics, accumulated on the device; read once, by `fill`."""

    def __init__(self, device: torch.device):
        self.dev = device
        self.totals = torch.zeros(5, dtype=torch.long, device=device)  # row-steps, emitted, drafts,
        # draft tokens, accepted
        self.drafted = torch.zeros(0, dtype=torch.long, device=device)  # (P,) per draft position
        self.accepted = torch.zeros(0, dtype=torch.long, device=device)  # (P,)
        self.forwards = 0

    def add(self, block: _Block, step: StepResult, active: torch.Tensor, num_emit: torch.Tensor,
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


def _rows_from_prompt(input_ids, attention_mask, vocab: int) -> List[torch.Tensor]:
    """Accept left- or right-padded (B, T) prompts with an attention mask (tensors, or lists of
    ints); one tensor per row."""
    input_ids = checks.as_token_tensor(input_ids, "input_ids")
    if attention_mask is not None:
        attention_mask = checks.as_token_tensor(attention_mask, "attention_mask", mask=True)
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        attention_mask = None if attention_mask is None else attention_mask.view(1, -1)
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must have shape (B, T) with B >= 1, got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    if attention_mask is None or bool(attention_mask.bool().all()):  # no padding: one check
        if input_ids.shape[1] == 0:
            raise ValueError("prompt row 0 is empty: every row needs at least one token")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"prompt has token ids outside [0, {vocab}): min {lo}, max {hi}")
        return list(input_ids.long())
    rows = []
    for b in range(input_ids.shape[0]):
        r = input_ids[b] if attention_mask is None else input_ids[b][attention_mask[b].bool()]
        if r.numel() == 0:
            raise ValueError(f"prompt row {b} is empty: every row needs at least one token")
        if int(r.min()) < 0 or int(r.max()) >= vocab:
            raise ValueError(f"prompt row {b} has token ids outside [0, {vocab}): "
                             f"min {int(r.min())}, max {int(r.max())}")
        rows.append(r.long())
    return rows


def speculative_generate(
    target: Union[Target, torch.nn.Module],
    proposer,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: Optional[int] = UNSET,
    temperature: float = UNSET,
    top_k: int = UNSET,
    top_p: float = UNSET,
    eos_token_id: Union[None, int, Sequence[int]] = UNSET,
    generator: Generators = None,
    seed: Optional[int] = None,
    max_len: Optional[int] = None,
    timing: bool = False,
    generation_config=None,
    logits_processor=None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    stop_strings: Union[None, str, Sequence[str]] = UNSET,
    tokenizer=None,
    streamer=None,
    return_sequences: bool = False,
    pad_token_id: Optional[int] = UNSET,
    **generation_kwargs,
) -> GenerationOutput:
    """Generate up to max_new_tokens per row with speculative decoding.

    target: a HF causal LM or a `Target`. proposer: any object of the Proposer protocol.
    input_ids (B, T) with attention_mask (left or right padding) or (T,). temperature 0 = greedy.
    Not passed: the generation config's value (below), else temperature 1.0, top_k 0 and top_p 1.0
    (off), no eos; eos_token_id=None passed = no eos even if the model's config names one.
    generator: one torch.Generator for the batch or one per row; else `seed` seeds one per row
    (seed, seed+1, ...); with neither, a random seed is drawn from torch's global generator.
    max_len: the target cache's slots per row (default: just enough). timing: synchronise the
    device around each phase so that stats' phase times are exact on CUDA (the bench sets it).

    transformers' conventions (hf_generation.py): `generation_config` and generate-style
    `**generation_kwargs` (do_sample, repetition_penalty, no_repeat_ngram_size, min_new_tokens,
    bad_words_ids, max_length, ...), over the model's own generation_config; the keyword arguments
    above win over both. Unsupported settings (beams, several sequences, ...) are a ValueError.
    logits_processor: a transformers LogitsProcessorList or specref processors (processors.py);
    presence_penalty / frequency_penalty: vLLM's. Every processor is applied losslessly: each draft
    position (tree node) on its own context, draft tokens included. stop_strings (with `tokenizer`):
    a row stops where transformers' StopStringCriteria stops, even inside an accepted run.
    streamer: a transformers streamer (batch 1), fed the prompt and then each step's committed
    tokens. return_sequences: also return `sequences`, prompt + new tokens padded with pad_token_id
    as model.generate returns them. max_time (transformers' MaxTimeCriteria): no step starts once
    the call has run max_time seconds (prefill included); the rows end where they are.
    Returns GenerationOutput(tokens (B, max_new_tokens) -1 padded, num_tokens (B,), stats[, sequences]).
    """
    t_start = time.perf_counter()
    run = _prepare(target, proposer, input_ids, attention_mask, generation_config, generation_kwargs,
                   dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                        max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, logits_processor=logits_processor,
                        stop_strings=stop_strings), generator, seed, max_len, tokenizer, streamer, return_sequences)
    tgt, ctx, cache, sampling, generator, procs = run.tgt, run.ctx, run.cache, run.sampling, run.generator, run.procs
    B, k, K, N, want_h, who, stats = run.B, run.k, run.K, run.max_new_tokens, run.want_h, run.who, GenerationStats()
    if streamer is not None:
        streamer.put(run.rows[0].view(1, -1).cpu())  # as transformers: the prompt first (skip_prompt skips it)
    if N == 0:
        if streamer is not None:
            streamer.end()
        stats.wall_time = time.perf_counter() - t_start
        return _output(run.out_tokens[:, :0], run.n_new, stats, input_ids, return_sequences, run.cfg.pad_token_id)
    counters, clock = _Counters(tgt.device), _clock(timing, tgt.device)
    with tgt.session():  # CPU: packed linears swapped in once for every forward of the loop
        # 0. prefill every prompt token but the last, which opens the first verify block
        t0 = clock()
        pre = tgt.prefill(cache, ctx.tokens[:, :run.P_max - 1], ctx.prompt_lengths - 1, logits=False,
                          hidden_layers=want_h)
        if want_h is not None:
            ctx.hidden, ctx.hidden_len = pre.hidden, ctx.prompt_lengths - 1  # (B, P, D), (B,)
        stats.prefill_time = clock() - t0
        proposer.begin(ctx, sampling, generator)
        step_no = 0
        bad = None  # (0-d bool) the last step's distributions held NaN/inf: raised at the next read
        while True:
            # the step's one device read (the chain's second is its width, in _verify_chain): rows
            # alive, the longest context (the target cache holds one token less), last step's check
            alive, top, failed = torch.stack([ctx.active.any().long(), ctx.lengths.max(),
                                              bad.long() if bad is not None else ctx.lengths.new_zeros(())]).tolist()
            if failed:  # names the model, the row and the step (checks.py)
                checks.finite_or_raise(step_no - 1, who, **bad_at)
            if not alive:
                break
            # 1. draft
            t0 = clock()
            draft = proposer.propose(ctx, sampling, generator)
            if not run.trust:  # a user's proposer: its Draft is checked before the target sees it
                checks.check_draft(draft, who, B, tgt.vocab_size, k)
            if draft.parents is not None:
                checks.check_siblings(draft, who)  # host-side: q paired with the siblings' kind
            t1 = clock()
            # 2. verify: the target scores [pending token, draft] in one forward
            budget = (N - run.n_new - 1).clamp(min=0)  # (B,) the step emits one more token
            pending = ctx.tokens.gather(1, (ctx.lengths - 1).view(B, 1)).view(B)  # (B,)
            verify = _verify_tree if draft.is_tree else _verify_chain
            block = verify(tgt, cache, draft, pending, budget, ctx.active, k, want_h, proposer, top - 1)
            raw = block.logits
            if procs is not None:  # each row of the block on its own path's context (processors.py)
                block.logits = processors.apply_to_block(procs, block.logits, ctx.tokens, ctx.lengths, run.n_new,
                                                         block.tokens, block.parents, block.lengths)
            # 3. accept: rejection.py, then each row's cut at its token budget and first eos
            step, bad_at = _accept(block, draft.q, sampling, generator, run.rule, k + 1, _kinds(draft))
            if procs is not None or sampling.greedy:
                bad_at["logits"] = raw  # NaN has no argmax; processors' -inf is allowed, NaN is not
            bad = torch.stack([_bad(t, name) for name, t in bad_at.items() if t is not None]).any()
            step.emitted.clamp_(max=tgt.vocab_size - 1)  # a NaN step's garbage stays a valid id until raised
            if step.emitted.shape[1] > K + 1:
                raise ValueError(f"the proposer's draft reaches depth {step.emitted.shape[1] - 1}, more "
                                 f"than its k = {k}")
            num_emit, hit_eos = _kept(step, budget, ctx.active, run.eos)  # (B,), (B,)
            if run.stops is not None:  # a stop string completed inside the run ends the row there
                num_emit, stopped = run.stops.first_stop(ctx.tokens, ctx.lengths, step.emitted, num_emit)  # (B,)x2
                hit_eos |= stopped
            t2 = clock()
            stats.draft_time += t1 - t0
            stats.verify_time += t2 - t1

            # 4. roll back: keep the pending token and the accepted drafts; the last emitted is pending
            hidden = _commit(cache, step, num_emit, block.hidden)
            _write(ctx.tokens, ctx.lengths, step.emitted, num_emit)
            _write(run.out_tokens, run.n_new, step.emitted, num_emit)
            accepted = torch.minimum(step.num_accepted, num_emit)  # (B,) accepted drafts emitted
            counters.add(block, step, ctx.active, num_emit, accepted)
            ctx.lengths += num_emit
            run.n_new += num_emit
            if streamer is not None and int(num_emit[0]):
                streamer.put(step.emitted[0, : int(num_emit[0])].cpu())  # the step's committed tokens
            ctx.active &= ~hit_eos & (run.n_new < N)
            if want_h is not None:
                ctx.hidden, ctx.hidden_len = hidden, num_emit  # the committed tokens' features
            proposer.update(ctx, torch.minimum(step.num_accepted, (num_emit - 1).clamp(min=0)))
            step_no += 1
            if run.cfg.max_time is not None and time.perf_counter() - t_start > run.cfg.max_time:
                break  # transformers' MaxTimeCriteria: checked after each step
    counters.fill(stats)
    if streamer is not None:
        streamer.end()
    stats.wall_time = time.perf_counter() - t_start
    return _output(run.out_tokens[:, :N].contiguous(), run.n_new, stats, input_ids, return_sequences,
                   run.cfg.pad_token_id)


@dataclass
class _Run:
    """speculative_generate's preparation, in one object: the resolved settings (transformers'
    conventions read), the checked arguments, the context, the output buffers and the target's cache."""

    tgt: Target
    cfg: hf_generation.Settings  # the resolved generation settings (eos, pad, max_time, ...)
    sampling: SamplingConfig
    procs: Optional[list]  # the logits processors, or None
    stops: Optional[hf_generation.StopStrings]
    k: int  # the proposer's k
    K: int  # the widest step: K drafts + 1 (chain) or depth K + 1 (tree)
    who: str  # the proposer's class name, for errors
    trust: bool  # the library's own proposer: no per-step Draft check
    rule: Optional[TypicalAcceptance]  # None: rejection sampling; Medusa's typical acceptance (lossy)
    want_h: Optional[tuple]  # target layers whose features the proposer reads (EAGLE), or None
    rows: List[torch.Tensor]  # the prompt, one tensor per row
    B: int
    P_max: int  # the longest prompt
    max_new_tokens: int
    eos: torch.Tensor  # (E,)
    generator: Generators
    out_tokens: torch.Tensor  # (B, N + K + 1) -1 padded
    n_new: torch.Tensor  # (B,)
    ctx: Optional[Context] = None  # None (and no cache) when max_new_tokens is 0
    cache: object = None


def _prepare(target, proposer, input_ids, attention_mask, generation_config, generation_kwargs, settings,
             generator, seed, max_len, tokenizer, streamer, return_sequences) -> _Run:
    """Conventions, validation (checks.py: every argument before any allocation or forward) and
    the caches; `settings` holds speculative_generate's sampling keywords as passed."""
    tgt = target if isinstance(target, Target) else Target(target)
    cfg = hf_generation.resolve(tgt.model, generation_config, generation_kwargs, vocab=tgt.vocab_size, **settings)
    procs = cfg.procs if cfg.procs else None
    sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, processors=procs)
    stops = None if cfg.stop_strings is None else hf_generation.StopStrings(tokenizer, cfg.stop_strings)
    k = checks.check_proposer(proposer)
    who = type(proposer).__name__
    trust = checks.trusted(proposer)  # the library's own proposers skip the per-step Draft check
    pv = getattr(proposer, "vocab_size", None)
    if pv is not None and checks.as_int(pv, f"{who}.vocab_size") != tgt.vocab_size:
        raise ValueError(f"draft vocab size {pv} != target vocab size {tgt.vocab_size}: the draft must share "
                         "the target's tokenizer and vocabulary (a padded vocabulary of the same tokenizer: "
                         f"DraftModelProposer(..., vocab_size={tgt.vocab_size}))")
    if max_len is not None:
        max_len = checks.as_int(max_len, "max_len", low=1)
    rule = getattr(proposer, "acceptance_rule", None)  # None: rejection sampling; Medusa's typical (lossy)
    if rule is not None and not isinstance(rule, TypicalAcceptance):
        raise ValueError(f"{who}.acceptance_rule must be None or a TypicalAcceptance, got {type(rule).__name__}")
    want_h = getattr(proposer, "hidden_layers", None)  # features the proposer reads (EAGLE), or None
    if want_h is not None and (not isinstance(want_h, tuple) or not want_h
                               or not all(isinstance(i, int) for i in want_h)):
        raise ValueError(f"proposer.hidden_layers must be a non-empty tuple of layer indices, got {want_h!r}")
    rows = _rows_from_prompt(input_ids, attention_mask, tgt.vocab_size)
    B, dev = len(rows), tgt.device
    if streamer is not None and B != 1:
        raise ValueError(f"a streamer takes one sequence (batch 1, as in transformers), got a batch of {B}")
    eos = torch.tensor(cfg.eos, dtype=torch.long, device=dev)  # (E,)
    generator = checks.generators(generator, B)
    if generator is not None and seed is not None:
        raise ValueError("pass generator or seed, not both (seed would be ignored)")
    if generator is None:
        generator = make_generators(checks.seed_value(seed, B) if seed is not None
                                    else int(torch.randint(0, 2**62, ())), B, dev)
    prompt_len = torch.tensor([len(r) for r in rows], device=dev)  # (B,)
    P_max = int(prompt_len.max())
    max_new_tokens = cfg.max_new_tokens
    if max_new_tokens is None:  # transformers: max_length counts the (padded) prompt
        T_in = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else P_max
        max_new_tokens = max(cfg.max_length - T_in, 0)
    if tgt.max_positions is not None and P_max + max_new_tokens > tgt.max_positions:
        raise ValueError(f"the longest prompt ({P_max} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's {tgt.max_positions} positions")
    K = max(k, 1)  # the widest step: K drafts + 1 (chain) or depth K + 1 (tree)
    T_ctx = P_max + max_new_tokens + K + 1
    if max_len is None:  # compiled graphs are specialised on the cache size: round it up
        max_len = -(-T_ctx // 256) * 256 if tgt.config.compile else T_ctx
    if max_len < T_ctx:
        raise ValueError(f"max_len {max_len} is too small: the longest prompt ({P_max} tokens) + "
                         f"max_new_tokens ({max_new_tokens}) + k + 1 needs {T_ctx}")
    out_tokens = torch.full((B, max_new_tokens + K + 1), -1, dtype=torch.long, device=dev)  # (B, N + K + 1)
    n_new = torch.zeros(B, dtype=torch.long, device=dev)  # (B,)
    if return_sequences and cfg.pad_token_id is None:
        raise ValueError("return_sequences needs pad_token_id (pass it, or set it in the generation_config)")
    run = _Run(tgt, cfg, sampling, procs, stops, k, K, who, trust, rule, want_h, rows, B, P_max, max_new_tokens,
               eos, generator, out_tokens, n_new)
    if max_new_tokens == 0:
        return run
    ctx_tokens = torch.zeros((B, T_ctx), dtype=torch.long, device=dev)  # (B, T)
    for b, r in enumerate(rows):
        ctx_tokens[b, : len(r)] = r.to(dev)
    run.ctx = Context(tokens=ctx_tokens, lengths=prompt_len.clone(),
                      active=torch.ones(B, dtype=torch.bool, device=dev), prompt_lengths=prompt_len)
    run.cache = tgt.new_cache(B, max_len)
    return run


def _clock(timing: bool, dev: torch.device):
    """The phases' host clock; with timing=True it synchronises the device first (exact on CUDA)."""
    def clock() -> float:
        if timing:
            device_sync(dev)
        return time.perf_counter()
    return clock


def _output(tokens, n_new, stats, input_ids, return_sequences: bool, pad: Optional[int]) -> GenerationOutput:
    seqs = None
    if return_sequences:
        ids = checks.as_token_tensor(input_ids, "input_ids")
        seqs = hf_generation.sequences(ids, tokens, n_new, pad)
    return GenerationOutput(tokens, n_new, stats, seqs)


def _verify_chain(tgt, cache, draft, pending, budget, active, k, hidden_layers, proposer,
                  committed_max: int) -> _Block:
    """Score [pending, draft chain] in one forward; drafts are cut to each row's token budget.
    committed_max: the longest row's committed cache length (host-known: no device read)."""
    B, dev = pending.shape[0], pending.device
    lengths = torch.minimum(draft.lengths.to(dev), budget) * active  # (B,)
    K = int(lengths.max()) if B else 0
    pos = torch.arange(K, device=dev)  # (K,)
    d_tok = draft.tokens[:, :K].to(dev)  # (B, K)
    d_tok = torch.where(pos.view(1, K) < lengths.view(B, 1), d_tok, torch.full_like(d_tok, -1))  # (B, K)
    block = torch.cat([pending.unsqueeze(1), d_tok], dim=1)  # (B, K+1)
    out = tgt.verify_chain(cache, block, pad_to=k + 1, hidden_layers=hidden_layers, committed_max=committed_max)
    return _Block(d_tok, lengths, lengths, None, out.logits, out.hidden)  # logits (B, K+1, V)


def _verify_tree(tgt, cache, draft, pending, budget, active, k, hidden_layers, proposer,
                 committed_max: int) -> _Block:
    """Score [pending, tree nodes(, aux tokens)] in one forward with tree attention; the aux
    tokens' logits (lookahead's window) go to proposer.observe()."""
    B, dev = pending.shape[0], pending.device
    lengths = draft.lengths.to(dev) * active  # (B,)
    N = draft.tokens.shape[1] if draft.aux is not None else (int(lengths.max()) if B else 0)
    pos = torch.arange(N, device=dev)  # (N,)
    real = pos.view(1, N) < lengths.view(B, 1)  # (B, N)
    parents = draft.parents if draft.parents is not None else (
        torch.arange(draft.tokens.shape[1], device=dev) - 1).expand(B, -1)  # a chain as a tree
    tok = torch.where(real, draft.tokens[:, :N].to(dev), -1)  # (B, N)
    par = torch.where(real, parents[:, :N].to(dev), -1)  # (B, N)
    anc = tree.ancestor_mask(par, lengths)  # (B, N, N)
    dep = anc.sum(-1) * real  # (B, N) depth = ancestors + itself (tree.depths, without a second mask)
    E = 0 if draft.aux is None else draft.aux.tokens.shape[1]
    anc_blk = torch.zeros(B, 1 + N + E, 1 + N + E, dtype=torch.bool, device=dev)  # (B, Q, Q)
    anc_blk[:, :, 0] = True  # everyone sees the root
    anc_blk[:, 1:1 + N, 1:1 + N] = anc
    dep_blk = torch.cat([dep.new_zeros(B, 1), dep], dim=1)  # (B, 1+N); the root at depth 0 (N may be 0)
    block = torch.cat([pending.unsqueeze(1), tok], dim=1)  # (B, 1+N)
    if E:
        anc_blk[:, 1 + N:] = draft.aux.mask.to(dev)
        dep_blk = torch.cat([dep_blk, draft.aux.depth.to(dev)], dim=1)  # (B, Q)
        block = torch.cat([block, draft.aux.tokens.to(dev)], dim=1)  # (B, Q)
    out = tgt.verify_tree(cache, block, anc_blk, dep_blk, hidden_layers=hidden_layers, committed_max=committed_max,
                          pad_to=1 + k + E)  # compile: every tree of <= k nodes in one graph
    logits = out.logits  # (B, Q, V)
    if E:
        observe = getattr(proposer, "observe", None)
        if observe is not None:
            observe(logits[:, 1 + N:])
        logits = logits[:, :1 + N]  # (B, 1+N, V)
    deepest = dep.max(1).values if N else torch.zeros_like(lengths)  # (B,)
    return _Block(tok, lengths, deepest, par, logits, out.hidden)


def _kinds(draft: Draft):
    """The sibling kinds the tree verifier gets: the Draft's own (checks.check_siblings paired them
    with its q), never guessed. A chain verified as a tree (a chain draft with aux tokens) has one
    child per node, where every kind's rule is the same: "sampled" with a q."""
    if draft.parents is not None:
        return draft.siblings
    return None if draft.q is None else "sampled"


def _accept(block: _Block, q: Optional[torch.Tensor], sampling: SamplingConfig, generator,
            rule: Optional[TypicalAcceptance] = None, draws: Optional[int] = None, siblings=None):
    """The rejection step (rejection.py): greedy exact match, or speculative sampling against p
    (or, when the proposer sets `acceptance_rule`, Medusa's typical acceptance: typical.py, lossy).
    rejection.py runs unchecked (validate=False): the drafts are the library's own or passed
    check_draft. Returns (StepResult, {name: tensor}) the distributions the loop checks for NaN /
    inf at its next device read (checks.finite_or_raise names the row and the step then)."""
    N = block.tokens.shape[1]
    if sampling.greedy:
        if block.parents is None:
            res = rejection.verify_chain_greedy(block.tokens, block.logits, lengths=block.lengths, validate=False)
            return StepResult(res.tokens, res.num_accepted), {}
        res = rejection.verify_tree_greedy(block.tokens, block.parents, block.logits, lengths=block.lengths,
                                           validate=False)
        return StepResult(res.tokens, res.num_accepted, res.path), {}
    p = logits_to_probs(block.logits, sampling)  # (B, 1+N, V)
    q = None if q is None else q[:, :N].to(p)  # (B, N, V)
    seen = {"p": p, "q": q}
    if rule is not None:  # lossy: the draft's q plays no part
        par = block.parents if block.parents is not None else (
            torch.arange(N, device=p.device) - 1).expand(p.shape[0], N)  # a chain as a tree
        res = typical.verify_tree_typical(block.tokens, par, p, rule, lengths=block.lengths, generator=generator,
                                          validate=False)
        return StepResult(res.tokens, res.num_accepted, res.path if block.parents is not None else None), seen
    if block.parents is None:
        res = rejection.verify_chain(block.tokens, p, q, lengths=block.lengths, generator=generator, validate=False,
                                     draws=draws)
        return StepResult(res.tokens, res.num_accepted), seen
    if isinstance(siblings, (list, tuple)):
        siblings = siblings[:N]
    elif isinstance(siblings, torch.Tensor):
        siblings = siblings[..., :N].to(p.device)  # (B, N) or (N,)
    res = rejection.verify_tree(block.tokens, block.parents, p, q, lengths=block.lengths, generator=generator,
                                validate=False, siblings=siblings)
    return StepResult(res.tokens, res.num_accepted, res.path), seen


def _bad(x: torch.Tensor, name: str) -> torch.Tensor:
    """(0-d bool) NaN in the logits (greedy has no argmax then), NaN or inf in p or q."""
    return torch.isnan(x).any() if name == "logits" else (~torch.isfinite(x)).any()


def _kept(step: StepResult, budget: torch.Tensor, active: torch.Tensor, eos: torch.Tensor):
    """Tokens each row keeps of the step: accepted + 1, at most budget + 1, up to its first eos.
    -> (num_emit (B,), hit_eos (B,) bool)."""
    B, W = step.emitted.shape
    num_emit = torch.minimum(step.num_accepted + 1, budget + 1) * active  # (B,)
    if not eos.numel():
        return num_emit, torch.zeros(B, dtype=torch.bool, device=num_emit.device)
    is_eos = (step.emitted.unsqueeze(-1) == eos).any(-1)  # (B, W)
    is_eos &= torch.arange(W, device=num_emit.device).view(1, W) < num_emit.view(B, 1)
    hit = is_eos.any(1)  # (B,)
    first = torch.where(hit, is_eos.float().argmax(1) + 1, num_emit)  # (B,)
    return torch.minimum(num_emit, first), hit


def _commit(cache, step: StepResult, num_emit: torch.Tensor, hidden: Optional[torch.Tensor]):
    """Commit each row's kept slots (a tree path is gathered to contiguous slots first); returns the
    features of the committed tokens, (B, W, D_h) or None."""
    if step.path is None:
        cache.commit(num_emit, validate=False)  # num_emit >= 0 by construction
        return hidden
    B = num_emit.shape[0]
    offsets = torch.cat([torch.zeros_like(step.path[:, :1]), step.path + 1], dim=1)  # (B, D+1) block offsets
    cache.commit_path(offsets, num_emit)
    if hidden is None:
        return None
    idx = offsets.clamp(min=0).unsqueeze(-1).expand(B, offsets.shape[1], hidden.shape[-1])  # (B, D+1, D_h)
    return hidden.gather(1, idx)  # (B, D+1, D_h) the root and the accepted path


def _write(buf: torch.Tensor, start: torch.Tensor, emitted: torch.Tensor, num: torch.Tensor) -> None:
    """buf[b, start[b] + j] = emitted[b, j] for j < num[b], in place (no host sync: a gather-where-
    scatter over all W columns, which the buffers' K + 1 columns of slack keep in range)."""
    B, W = emitted.shape
    j = torch.arange(W, device=buf.device).view(1, W)  # (1, W)
    idx = start.view(B, 1) + j  # (B, W)
    keep = j < num.view(B, 1)  # (B, W)
    buf.scatter_(1, idx, torch.where(keep, emitted, buf.gather(1, idx)))


def autoregressive_generate(
    target: Union[Target, torch.nn.Module],
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> GenerationOutput:
    """Plain decoding, one target forward per token, on the same cache, sampling and processor code
    (every keyword argument of speculative_generate)."""
    return speculative_generate(target, NullProposer(), input_ids, attention_mask, **kwargs)
