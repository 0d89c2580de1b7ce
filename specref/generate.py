"""speculative_generate() and autoregressive_generate(): the one decoding loop of specref.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): each step
  1. draft   - a proposer guesses up to k tokens per row (chain) or a token tree;
  2. verify  - the target scores [last committed token, draft...] in ONE forward;
  3. accept  - rejection.py accepts a prefix and emits one recovered or bonus token per row;
  4. roll back - the KV cache keeps the accepted slots; the proposer is told what was accepted.
Every emitted token comes out of step 3, so the output is distributed exactly as direct sampling
from the target with the same sampling settings (proven by the chi-square tests), and under greedy
decoding it is token-for-token the target's greedy output.

The baseline `autoregressive_generate` is the same loop with an empty draft (a block of one token),
on the same cache, forward and sampling code, so a speed ratio between the two measures only
speculation. Batches are ragged: each row keeps its own length in the cache, accepts its own count
and stops on its own (eos inside an accepted run truncates the row there).
Left out: beam search, repetition penalties and other logits processors (they would have to be
applied identically to p and, if sampled, q).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from . import rejection, tree
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig, logits_to_probs, make_generators
from .target import Target


@dataclass
class GenerationStats:
    """Counters as vLLM reports them, plus target forwards and timings (seconds)."""

    num_drafts: int = 0  # row-steps that verified a non-empty draft
    num_draft_tokens: int = 0  # draft tokens (or tree nodes) sent to verification
    num_accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_position: List[int] = field(default_factory=list)  # accepted count at draft position i
    drafted_per_position: List[int] = field(default_factory=list)  # drafts offered at position i
    num_row_steps: int = 0  # (row, step) pairs in which a row was active
    num_emitted_tokens: int = 0  # tokens emitted (all rows)
    target_forwards: int = 0  # verify forwards (the prefill is not counted)
    wall_time: float = 0.0  # whole call
    prefill_time: float = 0.0
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


def _rows_from_prompt(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      vocab: int) -> List[torch.Tensor]:
    """Accept left- or right-padded (B, T) prompts with an attention mask; one tensor per row."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError("input_ids must be an integer torch.Tensor of shape (B, T) or (T,)")
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speculative_generate(
    target: Union[Target, torch.nn.Module],
    proposer,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    generator: Generators = None,
    seed: Optional[int] = None,
    max_len: Optional[int] = None,
) -> GenerationOutput:
    """Generate up to max_new_tokens per row with speculative decoding.

    target: a HF causal LM or a `Target`. proposer: any object of the Proposer protocol.
    input_ids (B, T) with attention_mask (left or right padding) or (T,). temperature 0 = greedy.
    generator: one torch.Generator for the batch or one per row; else `seed` seeds one per row
    (seed, seed+1, ...); with neither, a random seed is drawn from torch's global generator.
    Returns GenerationOutput(tokens (B, max_new_tokens) -1 padded, num_tokens (B,), stats).
    """
    t_start = time.perf_counter()
    tgt = target if isinstance(target, Target) else Target(target)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    k = int(getattr(proposer, "k", 0))
    if k < 0:
        raise ValueError(f"proposer.k must be >= 0, got {k}")
    pv = getattr(proposer, "vocab_size", None)
    if pv is not None and int(pv) != tgt.vocab_size:
        raise ValueError(f"draft vocab size {pv} != target vocab size {tgt.vocab_size}: "
                         "the draft must share the target's tokenizer and vocabulary")
    want_h = getattr(proposer, "hidden_layers", None)  # features the proposer reads (EAGLE), or None
    if want_h is not None and (not isinstance(want_h, tuple) or not want_h
                               or not all(isinstance(i, int) for i in want_h)):
        raise ValueError(f"proposer.hidden_layers must be a non-empty tuple of layer indices, got {want_h!r}")
    rows = _rows_from_prompt(input_ids, attention_mask, tgt.vocab_size)
    B, dev = len(rows), tgt.device
    eos = torch.tensor([] if eos_token_id is None else
                       ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)),
                       dtype=torch.long, device=dev)  # (E,)
    if generator is None:
        generator = make_generators(seed if seed is not None else int(torch.randint(0, 2**62, ())),
                                    B, dev)
    stats = GenerationStats()
    prompt_len = torch.tensor([len(r) for r in rows], device=dev)  # (B,)
    T_ctx = int(prompt_len.max()) + max_new_tokens + max(k, 1) + 1
    if max_len is None:  # compiled graphs are specialised on the cache size: round it up
        max_len = -(-T_ctx // 256) * 256 if tgt.config.compile else T_ctx
    if max_len < T_ctx:
        raise ValueError(f"max_len {max_len} is too small: the longest prompt ({int(prompt_len.max())} "
                         f"tokens) + max_new_tokens ({max_new_tokens}) + k + 1 needs {T_ctx}")
    out_tokens = torch.full((B, max_new_tokens), -1, dtype=torch.long, device=dev)  # (B, N)
    n_new = torch.zeros(B, dtype=torch.long, device=dev)  # (B,)
    if max_new_tokens == 0:
        stats.wall_time = time.perf_counter() - t_start
        return GenerationOutput(out_tokens, n_new, stats)

    ctx_tokens = torch.zeros((B, T_ctx), dtype=torch.long, device=dev)  # (B, T)
    for b, r in enumerate(rows):
        ctx_tokens[b, : len(r)] = r.to(dev)
    ctx = Context(tokens=ctx_tokens, lengths=prompt_len.clone(), active=torch.ones(B, dtype=torch.bool, device=dev))
    cache = tgt.new_cache(B, max_len)

    with tgt.session():  # CPU: packed linears swapped in once for every forward of the loop
        # 0. prefill every prompt token but the last, which opens the first verify block
        t0 = time.perf_counter()
        P = int(prompt_len.max()) - 1
        pre = tgt.prefill(cache, ctx_tokens[:, :P], prompt_len - 1, logits=False, hidden_layers=want_h)
        if want_h is not None:
            ctx.hidden, ctx.hidden_len = pre.hidden, prompt_len - 1  # (B, P, D), (B,)
        _sync(dev)
        stats.prefill_time = time.perf_counter() - t0
        proposer.begin(ctx, sampling, generator)
        ar_B = torch.arange(B, device=dev)  # (B,)

        while bool(ctx.active.any()):
            # 1. draft
            t0 = time.perf_counter()
            draft = proposer.propose(ctx, sampling, generator)
            _sync(dev)
            t1 = time.perf_counter()
            stats.draft_time += t1 - t0
            budget = (max_new_tokens - n_new - 1).clamp(min=0)  # (B,) the step emits one more token
            pending = ctx_tokens[ar_B, ctx.lengths - 1]  # (B,)

            # 2. verify and 3. accept
            if draft.is_tree:
                emitted, n_acc, path, lengths, depth_of, hidden = _verify_tree(
                    tgt, cache, draft, pending, ctx.active, sampling, generator, proposer, want_h)
            else:
                lengths = torch.minimum(draft.lengths.to(dev), budget) * ctx.active  # (B,)
                emitted, n_acc, hidden = _verify_chain(tgt, cache, draft, pending, lengths, sampling,
                                                       generator, k, want_h)
                path, depth_of = None, None
            W = emitted.shape[1]  # K+1 (chain) or D+1 (tree)
            num_emit = torch.minimum(n_acc + 1, budget + 1) * ctx.active  # (B,)
            if eos.numel():
                is_eos = (emitted.unsqueeze(-1) == eos).any(-1)  # (B, K+1)
                is_eos &= torch.arange(W, device=dev).view(1, -1) < num_emit.view(B, 1)
                first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, num_emit)  # (B,)
                num_emit = torch.minimum(num_emit, first)
                hit_eos = is_eos.any(1)  # (B,)
            else:
                hit_eos = torch.zeros(B, dtype=torch.bool, device=dev)
            _sync(dev)
            stats.verify_time += time.perf_counter() - t1

            # 4. roll back: keep the pending token and the accepted drafts; the last emitted is pending
            if path is None:
                cache.commit(num_emit)
            else:  # block offsets of the root and the accepted nodes, gathered to contiguous slots
                offsets = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)  # (B, D+1)
                cache.commit_path(offsets, num_emit)
                if hidden is not None:  # features of the root and the accepted path
                    hidden = hidden.gather(1, offsets.clamp(min=0).unsqueeze(-1).expand(
                        B, offsets.shape[1], hidden.shape[-1]))  # (B, D+1, D_h)
            j = torch.arange(W, device=dev).view(1, -1)  # (1, W)
            write = j < num_emit.view(B, 1)  # (B, W)
            r_idx = ar_B.view(B, 1).expand(B, W)[write]  # (E,) emitted tokens of all rows, flat
            ctx_tokens[r_idx, (ctx.lengths.view(B, 1) + j).expand(B, W)[write]] = emitted[write]
            out_tokens[r_idx, (n_new.view(B, 1) + j).expand(B, W)[write]] = emitted[write]
            was_active = ctx.active.clone()
            ctx.lengths += num_emit
            n_new += num_emit
            ctx.active &= ~hit_eos & (n_new < max_new_tokens)
            if want_h is not None:
                ctx.hidden, ctx.hidden_len = hidden, num_emit  # the committed tokens' features
            proposer.update(ctx, torch.minimum(n_acc, (num_emit - 1).clamp(min=0)))

            stats.target_forwards += 1
            n_rows = int(was_active.sum())
            stats.num_row_steps += n_rows
            stats.num_emitted_tokens += int(num_emit.sum())
            stats.num_drafts += int((lengths > 0).sum())
            stats.num_draft_tokens += int(lengths.sum())
            stats.num_accepted_tokens += int((n_acc * was_active).sum())
            # acceptance per draft position (chain) or per depth (tree)
            acc = (n_acc * was_active)  # (B,)
            if depth_of is None:
                K = int(lengths.max()) if B else 0
                drafted = (torch.arange(K, device=dev).view(1, K) < lengths.view(B, 1)).sum(0)  # (K,)
            else:
                K = int(depth_of.max()) if depth_of.numel() else 0
                deepest = depth_of.max(1).values if depth_of.shape[1] else torch.zeros_like(acc)  # (B,)
                drafted = (torch.arange(K, device=dev).view(1, K) < deepest.view(B, 1)).sum(0)  # (K,) trees that deep
            accepted = (torch.arange(K, device=dev).view(1, K) < acc.view(B, 1)).sum(0)  # (K,)
            while len(stats.drafted_per_position) < K:
                stats.drafted_per_position.append(0)
                stats.accepted_per_position.append(0)
            for i, (d_i, a_i) in enumerate(zip(drafted.tolist(), accepted.tolist())):
                stats.drafted_per_position[i] += d_i
                stats.accepted_per_position[i] += a_i
    stats.wall_time = time.perf_counter() - t_start
    return GenerationOutput(out_tokens, n_new, stats)


def _verify_chain(tgt, cache, draft, pending, lengths, sampling, generator, k_max, hidden_layers=None):
    """Score [pending, draft chain] in one forward and run the rejection step.

    -> emitted (B, K+1), accepted (B,), hidden states (B, K+1, D) or None."""
    B, dev = pending.shape[0], pending.device
    K = int(lengths.max()) if B else 0
    pos = torch.arange(K, device=dev)  # (K,)
    d_tok = draft.tokens[:, :K].to(dev)  # (B, K)
    d_tok = torch.where(pos.view(1, K) < lengths.view(B, 1), d_tok, torch.full_like(d_tok, -1))  # (B, K)
    block = torch.cat([pending.unsqueeze(1), d_tok], dim=1)  # (B, K+1)
    out = tgt.verify_chain(cache, block, pad_to=k_max + 1, hidden_layers=hidden_layers)
    logits = out.logits  # (B, K+1, V)
    if sampling.greedy:
        res = rejection.verify_chain_greedy(d_tok, logits, lengths=lengths)
    else:
        p = logits_to_probs(logits, sampling)  # (B, K+1, V)
        q = None if draft.q is None else draft.q[:, :K].to(p)  # (B, K, V)
        res = rejection.verify_chain(d_tok, p, q, lengths=lengths, generator=generator)
    return res.tokens, res.num_accepted, out.hidden


def _verify_tree(tgt, cache, draft, pending, active, sampling, generator, proposer, hidden_layers=None):
    """Score [pending, tree nodes] in one forward (tree attention) and run recursive rejection.

    -> emitted (B, D+1), accepted (B,), path (B, D) node indices, node lengths (B,), depth (B, N),
    hidden states of the block (B, 1+N(+E), D) or None."""
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
    dep = tree.depths(par, lengths)  # (B, N)
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
    out = tgt.verify_tree(cache, block, anc_blk, dep_blk, hidden_layers=hidden_layers)
    logits = out.logits  # (B, Q, V)
    if E:
        observe = getattr(proposer, "observe", None)
        if observe is not None:
            observe(logits[:, 1 + N:])
        logits = logits[:, :1 + N]  # (B, 1+N, V)
    if sampling.greedy:
        res = rejection.verify_tree_greedy(tok, par, logits, lengths=lengths)
    else:
        p = logits_to_probs(logits, sampling)  # (B, 1+N, V)
        q = None if draft.q is None else draft.q[:, :N].to(p)  # (B, N, V)
        res = rejection.verify_tree(tok, par, p, q, lengths=lengths, generator=generator)
    return res.tokens, res.num_accepted, res.path, lengths, dep, out.hidden


def autoregressive_generate(
    target: Union[Target, torch.nn.Module],
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    generator: Generators = None,
    seed: Optional[int] = None,
    max_len: Optional[int] = None,
) -> GenerationOutput:
    """Plain decoding, one target forward per token, on the same cache and sampling code."""
    return speculative_generate(target, NullProposer(), input_ids, attention_mask,
                                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, eos_token_id=eos_token_id, generator=generator,
                                seed=seed, max_len=max_len)
