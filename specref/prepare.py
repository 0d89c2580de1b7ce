"""Before the loop: one call of speculative_generate read, checked and allocated.

`prepare()` turns what the caller passed into a `Run` (what generate.py's loop works on) and a
`Hooks` (the call's extras, hf/hooks.py), in this order, every check before any allocation or
forward: transformers' conventions read once (hf/generation.resolve: GenerationConfig, generate-
style keyword arguments, the model's own config), the proposer's contract (checks.py: k, the
shared vocabulary, hidden_layers, acceptance_rule), the prompts (left- or right-padded with an
attention mask, or a list of ints), the generators or seed, the token budget against the model's
positions and max_len; then the context (the prompts in a (B, T) buffer), the output buffer and
the target's static KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import checks
from .hf import generation as hf_generation
from .hf.hooks import Hooks
from .proposer import Context
from .sampling import Generators, SamplingConfig, make_generators
from .target import Target
from .typical import TypicalAcceptance

VERIFY_RULES = ("tokenwise", "block", "traversal")  # speculative_generate(verify=...): the lossless rules of step 3


@dataclass
class Run:
    """One prepared call: the settings the loop reads, the context, the output buffers, the cache."""

    target: Target
    proposer: object  # any object of the Proposer protocol (proposer.py)
    sampling: SamplingConfig
    generator: Generators  # one per row (or one for the batch)
    k: int  # the proposer's k: at most k draft tokens (tree nodes) per step
    acceptance_rule: Optional[TypicalAcceptance]  # None: rejection sampling; Medusa's typical (lossy)
    verify: str  # the rule of step 3 at T > 0, one of VERIFY_RULES
    hidden_layers: Optional[tuple]  # target layers whose features the proposer reads (EAGLE), or None
    eos: torch.Tensor  # (E,) eos ids
    max_new_tokens: int
    longest_prompt: int  # tokens in the longest prompt
    out_tokens: torch.Tensor  # (B, max_new_tokens + K + 1) -1 padded, K = max(k, 1)
    num_new: torch.Tensor  # (B,) tokens generated so far
    ctx: Optional[Context] = None  # None (and no cache) when max_new_tokens is 0
    cache: object = None  # the target's static KV cache (kv_rollback.SpecCache)


def prepare(target, proposer, input_ids, attention_mask, generation_config, generation_kwargs, settings,
            generator, seed, max_len, tokenizer, streamer, return_sequences, started: float, verify: str = "tokenwise"):
    """(Run, Hooks) for one call; `settings` holds speculative_generate's sampling keywords as
    passed, `started` the call's start on the host clock (max_time counts from it), `verify` the
    rule of step 3 (VERIFY_RULES; whether the drafts can take it is checked at the first step)."""
    tgt = target if isinstance(target, Target) else Target(target)
    cfg = hf_generation.resolve(tgt.model, generation_config, generation_kwargs, vocab=tgt.vocab_size, **settings)
    procs = cfg.procs if cfg.procs else None
    sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, processors=procs)
    stops = None if cfg.stop_strings is None else hf_generation.StopStrings(tokenizer, cfg.stop_strings)
    k = checks.check_proposer(proposer)
    who = type(proposer).__name__
    trusted = checks.trusted(proposer)  # the library's own proposers skip the per-step Draft check
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
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
    if verify != "tokenwise" and rule is not None:
        raise ValueError(f"verify={verify!r} with {who}.acceptance_rule (typical acceptance, lossy): the lossless "
                         "rules replace rejection sampling, not typical acceptance; use verify='tokenwise'")
    hidden_layers = getattr(proposer, "hidden_layers", None)  # features the proposer reads (EAGLE), or None
    if hidden_layers is not None and (not isinstance(hidden_layers, tuple) or not hidden_layers
                                      or not all(isinstance(i, int) for i in hidden_layers)):
        raise ValueError(f"proposer.hidden_layers must be a non-empty tuple of layer indices, got {hidden_layers!r}")
    rows = checks.prompt_rows(input_ids, attention_mask, tgt.vocab_size)
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
    longest = int(prompt_len.max())
    max_new_tokens = cfg.max_new_tokens
    if max_new_tokens is None:  # transformers: max_length counts the (padded) prompt
        T_in = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else longest
        max_new_tokens = max(cfg.max_length - T_in, 0)
    if tgt.max_positions is not None and longest + max_new_tokens > tgt.max_positions:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's {tgt.max_positions} positions")
    K = max(k, 1)  # the widest step: K drafts + 1 (chain) or depth K + 1 (tree)
    T_ctx = longest + max_new_tokens + K + 1
    if max_len is None:  # compiled graphs are specialised on the cache size: round it up
        max_len = -(-T_ctx // 256) * 256 if tgt.config.compile else T_ctx
    if max_len < T_ctx:
        raise ValueError(f"max_len {max_len} is too small: the longest prompt ({longest} tokens) + "
                         f"max_new_tokens ({max_new_tokens}) + k + 1 needs {T_ctx}")
    out_tokens = torch.full((B, max_new_tokens + K + 1), -1, dtype=torch.long, device=dev)  # (B, max_new + K + 1)
    num_new = torch.zeros(B, dtype=torch.long, device=dev)  # (B,)
    if return_sequences and cfg.pad_token_id is None:
        raise ValueError("return_sequences needs pad_token_id (pass it, or set it in the generation_config)")
    run = Run(tgt, proposer, sampling, generator, k, rule, verify, hidden_layers, eos, max_new_tokens, longest,
              out_tokens, num_new)
    hooks = Hooks(B, tgt.vocab_size, k, who, trusted, sampling.greedy, procs, stops, streamer, cfg.max_time,
                  started, rows[0], input_ids, return_sequences, cfg.pad_token_id)
    if max_new_tokens == 0:
        return run, hooks
    ctx_tokens = torch.zeros((B, T_ctx), dtype=torch.long, device=dev)  # (B, T)
    for b, r in enumerate(rows):
        ctx_tokens[b, : len(r)] = r.to(dev)
    run.ctx = Context(tokens=ctx_tokens, lengths=prompt_len.clone(),
                      active=torch.ones(B, dtype=torch.bool, device=dev), prompt_lengths=prompt_len)
    run.cache = tgt.new_cache(B, max_len)
    return run, hooks
