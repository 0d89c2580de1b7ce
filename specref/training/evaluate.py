"""Measure a trained draft: tokens per target forward and wall-clock speed-up on Spec-Bench.

Leviathan et al. 2023, Theorem 3.8: the expected walltime improvement of k drafts per step is
(1 - alpha^(k+1)) / ((1 - alpha)(1 + c k)); theory.optimal_k picks k from alpha (here: the draft's
held-out top-1 agreement, the greedy acceptance rate) and c (one draft forward over one target
forward, timed here on a 200-token cache). Then speculative_generate with the draft and
autoregressive_generate run side by side, question by question (alternating which goes first),
greedy, on the first turn of Spec-Bench questions (Xia et al. 2024) with the chat template, and
every pair is checked token for token (greedy parity). Left out: batch > 1, sampled decoding.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..bench.runner import load_questions
from ..picker.costs import measure_cost
from ..draft_model import DraftModelConfig, DraftModelProposer
from ..generate import autoregressive_generate, speculative_generate
from ..target import Target
from ..theory import optimal_k, speedup
from ..workloads import spec_bench_file
from .data import chat_prompt_ids


def measure_draft(target, tokenizer, draft, token_map, *, questions=None, per_category: int = 2,
                  max_new_tokens: int = 128, k: Optional[int] = None, alpha: Optional[float] = None,
                  progress: bool = True) -> dict:
    """Side-by-side greedy runs; returns per-category and overall tau, speed-up and parity.
    questions: a Spec-Bench-format JSONL (default: found as the bench finds it)."""
    from tqdm.auto import tqdm

    tgt = target if isinstance(target, Target) else Target(target)
    cost = measure_cost(tgt, draft)
    if k is None:
        if alpha is None:
            raise ValueError("pass k, or alpha (the draft's acceptance rate) to choose k by the closed form")
        k = optimal_k(float(alpha), cost["c"])
    eos = getattr(target.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    V = tgt.vocab_size
    rows = load_questions(spec_bench_file(questions), None, per_category)

    def run(which, ids):
        if which == "ar":
            return autoregressive_generate(tgt, ids, max_new_tokens=max_new_tokens, temperature=0.0,
                                           eos_token_id=eos)
        prop = DraftModelProposer(draft, DraftModelConfig(k=k), token_map=token_map, vocab_size=V)
        return speculative_generate(tgt, prop, ids, max_new_tokens=max_new_tokens, temperature=0.0,
                                    eos_token_id=eos)

    warm = torch.tensor([chat_prompt_ids(tokenizer, "Hello!")], device=tgt.device)
    run("ar", warm), run("spec", warm)
    cats: Dict[str, dict] = {}
    for i, r in enumerate(tqdm(rows, desc="spec-bench", disable=not progress)):
        ids = torch.tensor([chat_prompt_ids(tokenizer, r["turns"][0])], device=tgt.device)  # (1, T)
        order = ("ar", "spec") if i % 2 == 0 else ("spec", "ar")
        outs = {w: run(w, ids) for w in order}
        a, s = outs["ar"], outs["spec"]
        c = cats.setdefault(r["category"], dict(n=0, ar_s=0.0, spec_s=0.0, tokens=0, steps=0, forwards=0,
                                                drafted=0, accepted=0, parity=True))
        c["n"] += 1
        c["ar_s"] += a.stats.wall_time
        c["spec_s"] += s.stats.wall_time
        c["tokens"] += int(s.num_tokens.sum())
        c["steps"] += s.stats.num_row_steps
        c["forwards"] += s.stats.target_forwards
        c["drafted"] += s.stats.num_draft_tokens
        c["accepted"] += s.stats.num_accepted_tokens
        c["parity"] &= a.row(0) == s.row(0)
    total = {key: sum(c[key] for c in cats.values()) for key in
             ("n", "ar_s", "spec_s", "tokens", "steps", "forwards", "drafted", "accepted")}
    total["parity"] = all(c["parity"] for c in cats.values())
    for c in list(cats.values()) + [total]:
        c["tau"] = c["tokens"] / max(c["steps"], 1)
        c["speedup"] = c["ar_s"] / max(c["spec_s"], 1e-9)
        c["acceptance"] = c["accepted"] / max(c["drafted"], 1)
    predicted = speedup(float(alpha), k, cost["c"]) if alpha is not None else None
    return {"k": k, "alpha": alpha, "cost": cost, "predicted_speedup": predicted, "per_category": cats,
            "overall": total, "parity": total["parity"], "per_category_questions": per_category,
            "max_new_tokens": max_new_tokens}


def to_markdown(res: dict) -> str:
    """The measurement as a Markdown table (one row per category, then all)."""
    cost = res["cost"]
    alpha = "n/a" if res["alpha"] is None else f"{res['alpha']:.3f}"
    pred = "n/a" if res["predicted_speedup"] is None else f"{res['predicted_speedup']:.2f}x"
    lines = [f"k = {res['k']} (closed form from alpha = {alpha}, "
             f"c = {cost['c']:.3f}: draft forward {cost['t_draft'] * 1e3:.1f} ms, target forward "
             f"{cost['t_target'] * 1e3:.1f} ms); predicted speed-up "
             f"{pred}; "
             f"{res['per_category_questions']} questions per category, {res['max_new_tokens']} new tokens, greedy",
             "",
             "| category | questions | tokens | tau (tokens / target forward) | acceptance | AR s | spec s | speed-up | greedy parity |",
             "|---|---|---|---|---|---|---|---|---|"]
    items = list(sorted(res["per_category"].items())) + [("**all**", res["overall"])]
    for name, c in items:
        lines.append(f"| {name} | {c['n']} | {c['tokens']} | {c['tau']:.2f} | {c['acceptance']:.2f} | "
                     f"{c['ar_s']:.1f} | {c['spec_s']:.1f} | {c['speedup']:.2f}x | {'yes' if c['parity'] else 'NO'} |")
    return "\n".join(lines)
