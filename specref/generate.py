"""speculative_generate() and autoregressive_generate(): the one decoding loop of specref.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): each step
  1. draft    - a proposer guesses up to k tokens per row (chain) or a token tree;
  2. verify   - the target scores [last committed token, draft...] in ONE forward;
  3. accept   - rejection.py accepts a prefix (a tree path) and emits one recovered or bonus token
                per row; the row keeps them up to its token budget and its first eos;
  4. commit   - the KV cache keeps the accepted slots and rolls back the rest; the proposer is told
                what was accepted.
Before the loop, prepare.py reads transformers' conventions, checks every argument and allocates
(a Run); a prefill opens the first step. What a call adds around the four steps (streamer, stop
strings, max_time, NaN check, logits processors, user-draft checks, sequences) is one Hooks object
(hf/hooks.py) called at fixed points. Every emitted token comes out of step 3, so the output is
distributed exactly as sampling from the target with the same settings (the chi-square tests), and
under greedy decoding it is token-for-token the target's greedy output. The one exception is
opt-in: a proposer whose `acceptance_rule` is Medusa's typical acceptance (typical.py) trades
exactness for accepted length at T > 0 (greedy stays exact).

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
every draft position on that position's own context, draft tokens included (hf/processors.py),
which keeps them lossless. Left out: beam search and the other settings hf/generation.resolve()
names in its error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from . import rejection, tree, typical
from .counters import Counters, GenerationStats
from .hf.generation import UNSET
from .hf.hooks import Hooks
from .prepare import Run, prepare
from .proposer import Context, Draft
from .sampling import Generators, logits_to_probs
from .target import Target, device_sync


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

    def reset_rows(self, ctx, rows, hidden=None) -> None:
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
    verify: str = "tokenwise",
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

    transformers' conventions (hf/generation.py): `generation_config` and generate-style
    `**generation_kwargs` (do_sample, repetition_penalty, no_repeat_ngram_size, min_new_tokens,
    bad_words_ids, max_length, ...), over the model's own generation_config; the keyword arguments
    above win over both. Unsupported settings (beams, several sequences, ...) are a ValueError.
    logits_processor: a transformers LogitsProcessorList or specref processors (hf/processors.py);
    presence_penalty / frequency_penalty: vLLM's. Every processor is applied losslessly: each draft
    position (tree node) on its own context, draft tokens included. stop_strings (with `tokenizer`):
    a row stops where transformers' StopStringCriteria stops, even inside an accepted run.
    streamer: a transformers streamer (batch 1), fed the prompt and then each step's committed
    tokens. return_sequences: also return `sequences`, prompt + new tokens padded with pad_token_id
    as model.generate returns them. max_time (transformers' MaxTimeCriteria): no step starts once
    the call has run max_time seconds (prefill included); the rows end where they are.
    verify: the rule of step 3 at T > 0 (VERIFY_RULES; every one lossless): "tokenwise" (Leviathan et
    al.; SpecInfer's recursive rejection for trees), "block" (chains: Sun et al.'s block verification,
    block_verify.py; a deterministic chain, q None, stays token-wise: block gains nothing there) or
    "traversal" (trees of siblings drawn without replacement: Weng et al.'s traversal verification,
    traversal.py). A rule the draft cannot take (block on a tree, traversal on a chain or on other
    sibling kinds) is a ValueError naming verify. Greedy decoding is exact match under every rule.
    Returns GenerationOutput(tokens (B, max_new_tokens) -1 padded, num_tokens (B,), stats[, sequences]).
    """
    t_start = time.perf_counter()
    run, hooks = prepare(target, proposer, input_ids, attention_mask, generation_config, generation_kwargs,
                         dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                              max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                              logits_processor=logits_processor, stop_strings=stop_strings),
                         generator, seed, max_len, tokenizer, streamer, return_sequences, t_start, verify)
    stats = GenerationStats()
    hooks.on_start()
    if run.max_new_tokens > 0:
        counters = _decode(run, hooks, stats, _clock(timing, run.target.device))
        counters.fill_rows(stats, run.num_new, t_start)  # TTFT, per-row latency, finished rows' idle steps
    hooks.on_end()
    stats.wall_time = time.perf_counter() - t_start
    tokens = run.out_tokens[:, :run.max_new_tokens].contiguous()  # (B, max_new_tokens)
    return GenerationOutput(tokens, run.num_new, stats, hooks.sequences(tokens, run.num_new))


def _decode(run: Run, hooks: Hooks, stats: GenerationStats, clock, refill=None) -> Counters:
    """The loop: a prefill, then steps 1-4 until every row has ended (or max_time has passed).
    refill (scheduler.py): called after each step's read with (the read's values, active (B,) and
    num_new (B,) as lists) -> (alive, longest) once the free rows took waiting requests."""
    ctx, proposer, counters = run.ctx, run.proposer, Counters(run.target.device)
    with run.target.session():  # CPU: packed linears swapped in once for every forward of the loop
        t0 = clock()
        _prefill(run)  # 0. every prompt token but the last, which opens the first verify block
        stats.prefill_time = clock() - t0
        proposer.begin(ctx, run.sampling, run.generator)
        while True:
            # the step's one device read: rows alive, the longest context, the last step's NaN check
            # (with a scheduler, also each row's state: which rows are free and what they emitted)
            read = torch.stack([ctx.active.any().long(), ctx.lengths.max(), hooks.nan_flag(ctx.lengths)])
            vals = (read if refill is None else torch.cat([read, ctx.active.long(), run.num_new])).tolist()
            counters.mark(time.perf_counter())  # the read waited for the device: the last step is done
            alive, longest, failed = vals[:3]
            hooks.on_read(failed)  # the last step's NaN / inf raised, naming its row and step
            if refill is not None:
                alive, longest = refill(alive, longest, vals[3:])  # free rows take waiting requests
            if not alive:
                break
            # 1. draft: up to k tokens per row, or a token tree
            t0 = clock()
            draft = hooks.on_draft(proposer.propose(ctx, run.sampling, run.generator))
            t1 = clock()
            # 2. verify: the target scores [pending token, draft] in one forward
            budget = (run.max_new_tokens - run.num_new - 1).clamp(min=0)  # (B,) the step emits one more
            block = _verify(run, draft, budget, committed_max=longest - 1)  # the cache: one token less
            block.logits = hooks.on_scores(block, ctx, run.num_new)  # logits processors, per path
            # 3. accept: rejection.py, then each row's cut at its budget, first eos and stop string
            step = hooks.on_accept(*_accept(block, draft, run))
            num_emit, ended = hooks.on_emit(ctx, step, *_kept(step, budget, ctx.active, run.eos))  # (B,) x2
            t2 = clock()
            stats.draft_time += t1 - t0
            stats.verify_time += t2 - t1
            # 4. commit: keep the pending token and the accepted drafts, roll back the rest
            _commit(run, step, block, num_emit, ended, counters)
            hooks.on_commit(step.emitted, num_emit)  # the streamer
            proposer.update(ctx, torch.minimum(step.num_accepted, (num_emit - 1).clamp(min=0)))
            if hooks.should_stop():  # max_time
                break
    counters.fill(stats)
    return counters


def _prefill(run: Run) -> None:
    """0. Prefill every prompt token but the last into the cache (and the features the proposer
    reads); each row's last prompt token is the first step's pending token."""
    ctx = run.ctx
    pre = run.target.prefill(run.cache, ctx.tokens[:, :run.longest_prompt - 1], ctx.prompt_lengths - 1,
                             logits=False, hidden_layers=run.hidden_layers)
    if run.hidden_layers is not None:
        ctx.hidden, ctx.hidden_len = pre.hidden, ctx.prompt_lengths - 1  # (B, P, D), (B,)


def _clock(timing: bool, dev: torch.device):
    """The phases' host clock; with timing=True it synchronises the device first (exact on CUDA)."""
    def clock() -> float:
        if timing:
            device_sync(dev)
        return time.perf_counter()
    return clock


def _verify(run: Run, draft: Draft, budget: torch.Tensor, committed_max: int) -> _Block:
    """2. The target scores [pending token, draft] in one forward. budget (B,): drafts a row may
    still emit; committed_max: the longest row's committed cache length (host-known: no read)."""
    ctx = run.ctx
    B = ctx.lengths.shape[0]
    pending = ctx.tokens.gather(1, (ctx.lengths - 1).view(B, 1)).view(B)  # (B,) the last token, not yet cached
    verify = _verify_tree if draft.is_tree else _verify_chain
    return verify(run, draft, pending, budget, committed_max)


def _verify_chain(run: Run, draft: Draft, pending: torch.Tensor, budget: torch.Tensor, committed_max: int) -> _Block:
    """Score [pending, draft chain] in one forward; drafts are cut to each row's token budget."""
    B, dev = pending.shape[0], pending.device
    lengths = torch.minimum(draft.lengths.to(dev), budget) * run.ctx.active  # (B,)
    K = int(lengths.max()) if B else 0
    pos = torch.arange(K, device=dev)  # (K,)
    d_tok = draft.tokens[:, :K].to(dev)  # (B, K)
    d_tok = torch.where(pos.view(1, K) < lengths.view(B, 1), d_tok, torch.full_like(d_tok, -1))  # (B, K)
    block = torch.cat([pending.unsqueeze(1), d_tok], dim=1)  # (B, K+1)
    out = run.target.verify_chain(run.cache, block, pad_to=run.k + 1, hidden_layers=run.hidden_layers,
                                  committed_max=committed_max)
    return _Block(d_tok, lengths, lengths, None, out.logits, out.hidden)  # logits (B, K+1, V)


def _verify_tree(run: Run, draft: Draft, pending: torch.Tensor, budget: torch.Tensor, committed_max: int) -> _Block:
    """Score [pending, tree nodes(, aux tokens)] in one forward with tree attention; the aux
    tokens' logits (lookahead's window) go to proposer.observe(). (A tree's budget is applied
    when the step is kept: _kept.)"""
    B, dev = pending.shape[0], pending.device
    lengths = draft.lengths.to(dev) * run.ctx.active  # (B,)
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
    out = run.target.verify_tree(run.cache, block, anc_blk, dep_blk, hidden_layers=run.hidden_layers,
                                 committed_max=committed_max, pad_to=1 + run.k + E)  # compile: one graph
    logits = out.logits  # (B, Q, V)
    if E:
        observe = getattr(run.proposer, "observe", None)
        if observe is not None:
            observe(logits[:, 1 + N:])
        logits = logits[:, :1 + N]  # (B, 1+N, V)
    deepest = dep.max(1).values if N else torch.zeros_like(lengths)  # (B,)
    return _Block(tok, lengths, deepest, par, logits, out.hidden)


def _accept(block: _Block, draft: Draft, run: Run):
    """3. The rejection step (rejection.py): greedy exact match, or speculative sampling against p by
    the run's rule (run.verify: token-wise, block or traversal; or, when the proposer sets
    `acceptance_rule`, Medusa's typical acceptance: typical.py, lossy).
    rejection.py runs unchecked (validate=False): the drafts are the library's own or passed
    check_draft. With one generator per row each row draws a fixed k + 1 uniforms (a chain).
    Returns (StepResult, {name: tensor}) the distributions the hooks check for NaN / inf."""
    N, sampling, generator, rule = block.tokens.shape[1], run.sampling, run.generator, run.acceptance_rule
    _check_rule(run, draft)
    if sampling.greedy:  # every lossless rule is exact match here
        if block.parents is None:
            res = rejection.verify_chain_greedy(block.tokens, block.logits, lengths=block.lengths, validate=False)
            return StepResult(res.tokens, res.num_accepted), {}
        res = rejection.verify_tree_greedy(block.tokens, block.parents, block.logits, lengths=block.lengths,
                                           validate=False)
        return StepResult(res.tokens, res.num_accepted, res.path), {}
    p = logits_to_probs(block.logits, sampling)  # (B, 1+N, V)
    q = None if draft.q is None else draft.q[:, :N].to(p)  # (B, N, V)
    seen = {"p": p, "q": q}
    if rule is not None:  # lossy: the draft's q plays no part
        par = block.parents if block.parents is not None else (
            torch.arange(N, device=p.device) - 1).expand(p.shape[0], N)  # a chain as a tree
        res = typical.verify_tree_typical(block.tokens, par, p, rule, lengths=block.lengths, generator=generator,
                                          validate=False)
        return StepResult(res.tokens, res.num_accepted, res.path if block.parents is not None else None), seen
    if block.parents is None:  # block verification gains nothing for a deterministic chain (q None)
        rule_fn = rejection.verify_chain_block if run.verify == "block" and q is not None else rejection.verify_chain
        res = rule_fn(block.tokens, p, q, lengths=block.lengths, generator=generator, validate=False, draws=run.k + 1)
        return StepResult(res.tokens, res.num_accepted), seen
    # the Draft's own sibling kinds (checks.check_siblings paired them with its q), never guessed; a chain
    # verified as a tree (with aux tokens) has one child per node, where every rule is "sampled"'s
    siblings = draft.siblings if draft.parents is not None else (None if q is None else "sampled")
    if isinstance(siblings, (list, tuple)):
        siblings = siblings[:N]
    elif isinstance(siblings, torch.Tensor):
        siblings = siblings[..., :N].to(p.device)  # (B, N) or (N,)
    rule_fn = rejection.verify_tree_traversal if run.verify == "traversal" else rejection.verify_tree
    res = rule_fn(block.tokens, block.parents, p, q, lengths=block.lengths, generator=generator, validate=False,
                  siblings=siblings)
    return StepResult(res.tokens, res.num_accepted, res.path), seen


def _check_rule(run: Run, draft: Draft) -> None:
    """ValueError naming verify when the draft cannot take the run's rule: block verification judges
    one chain, traversal verification a tree whose siblings were drawn without replacement (at T > 0;
    greedy decoding is exact match under every rule, whatever the siblings' kind)."""
    if run.verify == "tokenwise":
        return
    who = type(run.proposer).__name__
    if run.verify == "block" and draft.is_tree:
        raise ValueError(f"verify='block' verifies chains, but {who} drafted a tree: use verify='tokenwise', or "
                         "verify='traversal' for siblings drawn without replacement")
    if run.verify == "traversal":
        if not draft.is_tree or draft.parents is None:
            raise ValueError(f"verify='traversal' verifies trees, but {who} drafted a chain: use verify='block' "
                             "(its rule on a chain) or 'tokenwise'")
        if run.sampling.greedy:  # exact match under every rule: the drafts' kind plays no part
            return
        kinds = draft.siblings if draft.q is not None else "deterministic"
        if isinstance(kinds, torch.Tensor):
            kinds = kinds.unique().tolist()
        kinds = [tree.SIBLING_KINDS[k] if isinstance(k, int) else k for k in
                 (kinds if isinstance(kinds, (list, tuple)) else [kinds])]
        if any(k != "without" for k in kinds):
            raise ValueError(f"verify='traversal' covers siblings drawn without replacement (Draft.siblings="
                             f"'without'), but {who} drafts siblings={sorted(set(kinds))}: use verify='tokenwise'")


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


def _commit(run: Run, step: StepResult, block: _Block, num_emit: torch.Tensor, ended: torch.Tensor,
            counters: Counters) -> None:
    """4. Keep num_emit (B,) tokens per row: the cache keeps the pending token and the accepted
    drafts (rolls back the rest), the context and the output get the tokens (the last one is the next
    step's pending token), and a row ends at its eos or stop string (ended (B,)) or its budget."""
    ctx = run.ctx
    hidden = _commit_cache(run.cache, step, num_emit, block.hidden)
    _write(ctx.tokens, ctx.lengths, step.emitted, num_emit)
    _write(run.out_tokens, run.num_new, step.emitted, num_emit)
    counters.add(block, step, ctx.active, num_emit, torch.minimum(step.num_accepted, num_emit))  # accepted kept
    ctx.lengths += num_emit
    run.num_new += num_emit
    was = ctx.active.clone()
    ctx.active &= ~ended & (run.num_new < run.max_new_tokens)  # max_new_tokens: an int or (B,) per row
    counters.ended(was & ~ctx.active)
    if run.hidden_layers is not None:
        ctx.hidden, ctx.hidden_len = hidden, num_emit  # the committed tokens' features


def _commit_cache(cache, step: StepResult, num_emit: torch.Tensor, hidden: Optional[torch.Tensor]):
    """Commit each row's kept slots (a tree path is gathered to contiguous slots first); returns the
    features of the committed tokens, (B, W, D_h) or None."""
    if step.path is None:
        cache.commit(num_emit, validate=False)  # num_emit >= 0 by construction
        return hidden
    B = num_emit.shape[0]
    root = step.path.new_zeros(B, 1)  # (B, 1) the pending token, kept in every row (also when no node was drafted)
    offsets = torch.cat([root, step.path + 1], dim=1)  # (B, D+1) block offsets
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
