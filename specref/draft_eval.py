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

import json
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def spec_bench_questions(path=SPEC_BENCH, per_category: Optional[int] = 2) -> List[dict]:
    """The first `per_category` questions of every category, in file order (None: all)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Spec-Bench questions not found at {path}")
    rows, seen = [], {}
    for line in open(path, encoding="utf-8"):
        r = json.loads(line)
        n = seen.get(r["category"], 0)
        if per_category is None or n < per_category:
            rows.append(r)
            seen[r["category"]] = n + 1
    return rows


@torch.no_grad()
def _median_block_times(t, widths: List[int], cache_len: int, reps: int, warmup: int) -> Dict[int, float]:
    """Median seconds of a verify forward of a random block of each width (1 row), on a cache
    holding `cache_len` tokens; widths interleaved within each round, `warmup` rounds untimed."""
    cache = t.new_cache(1, cache_len + max(widths) + 2)
    g = torch.Generator().manual_seed(0)
    hi = min(1000, t.vocab_size)
    t.prefill(cache, torch.randint(0, hi, (1, cache_len), generator=g).to(t.device),
              torch.tensor([cache_len], device=t.device), logits=False)
    times: Dict[int, List[float]] = {w: [] for w in widths}
    for i in range(warmup + reps):
        for w in widths:
            blk = torch.randint(0, hi, (1, w), generator=g).to(t.device)  # (1, w)
            a = time.perf_counter()
            t.verify_chain(cache, blk)
            if i >= warmup:
                times[w].append(time.perf_counter() - a)
            cache.commit(torch.zeros(1, dtype=torch.long, device=t.device))  # keep the cache length
    return {w: statistics.median(ts) for w, ts in times.items()}


def measure_cost(target, draft, cache_len: int = 200, reps: int = 15) -> Dict[str, float]:
    """Median seconds of one 1-token forward of the target and of the draft; c = their ratio."""
    from .target import Target

    times = {}
    for name, m in (("target", target), ("draft", draft)):
        t = m if isinstance(m, Target) else Target(m, name=name)
        times[name] = _median_block_times(t, [1], cache_len, reps, warmup=2)[1]
    return {"t_target": times["target"], "t_draft": times["draft"], "c": times["draft"] / times["target"]}


def measure_verify_cost(target, k: int, cache_len: int = 200, reps: int = 9) -> Dict[str, float]:
    """Fit the verify-cost model cost(W) = 1 + c0 [W > 1] + c (W - 1) of a block of W tokens,
    relative to a 1-token forward, from median timings of W = 1..k+1 on a `cache_len` cache
    (widths interleaved within each repetition, so drifting machine load hits them alike).
    Returns {"c": c, "c0": c0, "t1": seconds of a 1-token forward, "ratios": [cost(W) for W]}.
    The adaptive n-gram proposer takes c as draft_cost and c0 as verify_cost_fixed.
    Under compile (TargetConfig.compile) generate.py pads every drafted block to k+1 tokens, so a
    block costs the same whatever its length: only W = 1 and k+1 are timed (two graphs, not k+1),
    c = 0 and c0 = cost(k+1) - 1."""
    from .target import Target

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t = target if isinstance(target, Target) else Target(target)
    if t.config.compile:
        med = _median_block_times(t, [1, k + 1], cache_len, reps, warmup=1)
        r = med[k + 1] / med[1]
        return {"c": 0.0, "c0": max(r - 1.0, 0.0), "t1": med[1], "ratios": [1.0] + [r] * k}
    widths = list(range(1, k + 2))
    med = _median_block_times(t, widths, cache_len, reps, warmup=1)
    t1 = med[1]
    ratios = [med[w] / t1 for w in widths]
    if k == 1:
        return {"c": 0.0, "c0": max(ratios[1] - 1.0, 0.0), "t1": t1, "ratios": ratios}
    x = torch.tensor([w - 1.0 for w in widths[1:]], dtype=torch.float64)  # extra tokens, W >= 2
    y = torch.tensor(ratios[1:], dtype=torch.float64) - 1.0
    c = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    c = max(c, 0.0)
    c0 = max(float((y - c * x).mean()), 0.0)
    return {"c": c, "c0": c0, "t1": t1, "ratios": ratios}


def measure_draft(target, tokenizer, draft, token_map, *, questions=SPEC_BENCH, per_category: int = 2,
                  max_new_tokens: int = 128, k: Optional[int] = None, alpha: Optional[float] = None,
                  progress: bool = True) -> dict:
    """Side-by-side greedy runs; returns per-category and overall tau, speed-up and parity."""
    from tqdm.auto import tqdm

    from .distill_data import chat_prompt_ids
    from .draft_model import DraftModelConfig, DraftModelProposer
    from .generate import autoregressive_generate, speculative_generate
    from .target import Target
    from .theory import optimal_k, speedup

    tgt = target if isinstance(target, Target) else Target(target)
    cost = measure_cost(tgt, draft)
    if k is None:
        if alpha is None:
            raise ValueError("pass k, or alpha (the draft's acceptance rate) to choose k by the closed form")
        k = optimal_k(float(alpha), cost["c"])
    eos = getattr(target.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    V = tgt.vocab_size
    rows = spec_bench_questions(questions, per_category)

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
