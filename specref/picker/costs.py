"""Measured costs: what the closed forms of theory.py need from the machine at hand.

Leviathan et al. 2023 (Theorem 3.8) price a speculative step as 1 + c k target steps: c is the
cost of one drafted token relative to one target forward. On real hardware the verify block is not
free either: a block of W tokens costs v(W) >= 1 target steps (on CPUs the kernels of one-row and
multi-row matrix products differ; on GPUs a small block costs about one step). This module times
both on the device the model lives on: `measure_verify_cost` fits v(W) = 1 + c0 [W > 1] + c (W - 1),
`measure_cost` gives a draft model's c, `median_block_times` the raw medians, and
`measure_head_cost` (EAGLE), `measure_heads_cost` (Medusa / Hydra) and `measure_speculator_cost`
(MLP speculator) the c of a learned proposer's own step. Timings synchronise the device
(`device_sync`), so they are exact on CUDA too. Left out: costs at batch > 1, the draft's catch-up blocks.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional

import torch

from ..backends.cpu_linear import packed
from ..eagle_head import EagleHead, EagleProposer
from ..kv_rollback import SpecCache
from ..medusa_heads import MedusaHeads
from ..medusa_prefix import prefix_step
from ..mlp_speculator import MLPSpeculator
from ..target import Target, device_sync


@torch.no_grad()
def median_block_times(t, widths: List[int], cache_len: int, reps: int, warmup: int) -> Dict[int, float]:
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
            device_sync(t.device)
            a = time.perf_counter()
            t.verify_chain(cache, blk)
            device_sync(t.device)
            if i >= warmup:
                times[w].append(time.perf_counter() - a)
            cache.commit(torch.zeros(1, dtype=torch.long, device=t.device))  # keep the cache length
    return {w: statistics.median(ts) for w, ts in times.items()}


def measure_cost(target, draft, cache_len: int = 200, reps: int = 15) -> Dict[str, float]:
    """Median seconds of one 1-token forward of the target and of the draft; c = their ratio."""
    times = {}
    for name, m in (("target", target), ("draft", draft)):
        t = m if isinstance(m, Target) else Target(m, name=name)
        times[name] = median_block_times(t, [1], cache_len, reps, warmup=2)[1]
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
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t = target if isinstance(target, Target) else Target(target)
    if t.config.compile:
        med = median_block_times(t, [1, k + 1], cache_len, reps, warmup=1)
        r = med[k + 1] / med[1]
        return {"c": 0.0, "c0": max(r - 1.0, 0.0), "t1": med[1], "ratios": [1.0] + [r] * k}
    widths = list(range(1, k + 2))
    med = median_block_times(t, widths, cache_len, reps, warmup=1)
    t1 = med[1]
    return {**fit_verify_cost([med[w] / t1 for w in widths]), "t1": t1}


def fit_verify_cost(ratios: List[float], k: Optional[int] = None) -> Dict[str, float]:
    """c and c0 of cost(W) = 1 + c0 [W > 1] + c (W - 1) fitted (least squares, both >= 0) to the
    ratios cost(W) for W = 1..k+1 (default: all of them). Returns {"c", "c0", "ratios"}."""
    ratios = list(ratios[: (len(ratios) if k is None else k + 1)])
    if len(ratios) < 2:
        raise ValueError(f"need cost ratios for W = 1 and 2 at least, got {len(ratios)}")
    if len(ratios) == 2:
        return {"c": 0.0, "c0": max(ratios[1] - 1.0, 0.0), "ratios": ratios}
    x = torch.tensor([w - 1.0 for w in range(2, len(ratios) + 1)], dtype=torch.float64)  # extra tokens, W >= 2
    y = torch.tensor(ratios[1:], dtype=torch.float64) - 1.0
    c = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    c = max(c, 0.0)
    c0 = max(float((y - c * x).mean()), 0.0)
    return {"c": c, "c0": c0, "ratios": ratios}


def verify_ratio(v: List[float], W: int) -> float:
    """v(W) from the measured curve (W = 1..len(v)), extended linearly past its end."""
    if W <= len(v):
        return v[W - 1]
    slope = (v[-1] - v[1]) / max(len(v) - 2, 1) if len(v) > 2 else 0.0
    return v[-1] + slope * (W - len(v))


def fit_verify_curve(points: Dict[int, List[tuple]], prior: List[float], rounds: int = 5) -> tuple:
    """Robust fit of seconds = t1_p v(W) to the real verify forwards of every prompt p (points:
    {p: [(W, seconds), ...]}), v(1) = 1: alternating medians, started from the synthetic curve
    `prior`. Widths never seen keep the prior's shape, scaled to the fitted widths. Returns
    ({p: t1_p}, v as a function of W)."""
    v: Dict[int, float] = {}
    ratio = lambda W: v.get(W, verify_ratio(prior, W) * scale)  # noqa: E731
    scale = 1.0
    t1 = {}
    for _ in range(rounds):
        t1 = {p: statistics.median(s / ratio(W) for W, s in pts) for p, pts in points.items() if pts}
        byw: Dict[int, List[float]] = {}
        for p, pts in points.items():
            for W, s in pts:
                byw.setdefault(W, []).append(s / t1[p])
        v = {W: statistics.median(xs) for W, xs in byw.items() if len(xs) >= 5}
        one = v.get(1, 1.0)
        v = {W: x / one for W, x in v.items()}
        t1 = {p: t * one for p, t in t1.items()}
        seen = [W for W in v if W > 1]
        scale = statistics.median(v[W] / verify_ratio(prior, W) for W in seen) if seen else 1.0
    return t1, ratio


# ----------------------------------------------------------------------------- the proposers' own step


@torch.no_grad()
def measure_head_cost(target, head: EagleHead, cache_len: int = 200, reps: int = 15) -> dict:
    """Median seconds of one drafting step of the head (one pair on a `cache_len` cache + its LM
    head) and of a 1-token target forward; c = their ratio (the closed form's draft cost)."""
    tgt = target if isinstance(target, Target) else Target(target)
    t_target = median_block_times(tgt, [1], cache_len, reps, warmup=2)[1]
    prop = EagleProposer(head)
    dev = head.fc.weight.device
    prop.cache = SpecCache(head.num_layers, 1, cache_len + 2, dev)
    D = head.hidden_size
    feats = torch.randn(1, cache_len, D, device=dev, dtype=head.fc.weight.dtype)  # (1, T, D)
    zeros = torch.zeros(1, cache_len, dtype=torch.long, device=dev)  # (1, T)
    prop._forward(feats, zeros, zeros)
    prop.cache.commit(torch.full((1,), cache_len, device=dev))
    times = []
    with packed(prop.packed):
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            zero = torch.zeros(1, 1, dtype=torch.long, device=dev)  # (1, 1)
            f_hat = prop._forward(feats[:, :1], zero, zero)  # (1, 1, D)
            head.logits(f_hat).argmax(-1)
            device_sync(dev)
            times.append(time.perf_counter() - t0)
    t_head = sorted(times[2:])[reps // 2]
    return {"t_target": t_target, "t_draft": t_head, "c": t_head / t_target}


@torch.no_grad()
def measure_heads_cost(target, heads: MedusaHeads, depth: Optional[int] = None, reps: int = 21) -> dict:
    """Median seconds of the heads' step (one row, `depth` heads + top-k) and of a 1-token target
    forward on a 200-token cache; c = their ratio."""
    tgt = target if isinstance(target, Target) else Target(target)
    t_target = median_block_times(tgt, [1], 200, 15, warmup=2)[1]
    w = heads.lm_heads[0].weight
    h = torch.randn(1, heads.hidden_size, device=w.device, dtype=w.dtype)  # (1, D)
    n = heads.num_heads if depth is None else depth
    tokens = torch.zeros(1, n, dtype=torch.long, device=w.device) if heads.sequential else None  # (1, n): one path
    cache, Q = None, 2  # the prefix layer: Q newly committed states on a 200-state cache per step
    if heads.prefix is not None:
        cache = SpecCache(heads.prefix_layers, 1, 200 + Q + 1, w.device)
        prefill = torch.randn(1, 200, heads.hidden_size, device=w.device, dtype=w.dtype)  # (1, 200, D)
        prefix_step(heads, cache, prefill, torch.full((1,), 200))
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        if cache is not None:
            h = prefix_step(heads, cache, h[:, None].expand(1, Q, heads.hidden_size), torch.full((1,), Q))[:, -1]
            cache.rollback_to(cache.lengths - Q)
        heads(h, heads=depth, tokens=tokens).topk(4, dim=-1)
        device_sync(w.device)
        times.append(time.perf_counter() - t0)
    t_heads = sorted(times[2:])[reps // 2]
    return {"t_target": t_target, "t_draft": t_heads, "c": t_heads / t_target}


@torch.no_grad()
def measure_speculator_cost(target, speculator: MLPSpeculator, k: Optional[int] = None, reps: int = 31,
                            cache_len: int = 200) -> dict:
    """Median seconds of a k-token chain (one row, stages 1..k with argmax) and of a 1-token target
    forward on a `cache_len` cache, timed alternately in each repetition (a loaded machine slows both
    alike); c = the chain's seconds per drafted token over the target forward's."""
    k = speculator.n_predict if k is None else k
    tgt = target if isinstance(target, Target) else Target(target)
    cache = tgt.new_cache(1, cache_len + 2)
    g = torch.Generator().manual_seed(0)
    hi = min(1000, tgt.vocab_size)
    tgt.prefill(cache, torch.randint(0, hi, (1, cache_len), generator=g).to(tgt.device),
                torch.tensor([cache_len], device=tgt.device), logits=False)
    w = speculator.proj[0].weight
    h = torch.randn(1, speculator.emb_dim, device=w.device, dtype=w.dtype)  # (1, D)
    x0 = torch.zeros(1, dtype=torch.long, device=w.device)  # (1,)
    t_target, t_chain = [], []
    for _ in range(reps + 2):
        blk = torch.randint(0, hi, (1, 1), generator=g).to(tgt.device)  # (1, 1)
        device_sync(tgt.device)
        t0 = time.perf_counter()
        tgt.verify_chain(cache, blk)  # written at the same slot every time: never committed
        device_sync(tgt.device)
        t1 = time.perf_counter()
        s, x = speculator.start(h), x0
        for j in range(k):
            s = speculator.stage(j, s, x)  # (1, d)
            x = speculator.token_map[speculator.logits(j, s).argmax(-1)]  # (1,)
        device_sync(w.device)
        t_target.append(t1 - t0)
        t_chain.append(time.perf_counter() - t1)
    med = lambda v: sorted(v[2:])[reps // 2]  # noqa: E731
    return {"t_target": med(t_target), "t_chain": med(t_chain), "k": k, "c": med(t_chain) / k / med(t_target)}
