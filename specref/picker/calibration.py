"""The picker's measurements (picker.py predicts from them): a short calibration on the user's prompts.

Greedy, batch 1 (`Replay`): per prompt a few real autoregressive steps (the target's one-token
forward t_1 and the loop's time per step at this context), then ONE real answer by a fast lossless
method (n-gram, else EAGLE: the greedy answer is the target's whatever the method) for as long as
`replay_tokens` autoregressive steps would take (transformers' max_time; at most max_new_tokens
tokens), with the target's features captured: the answer is long where the lead decodes fast,
which is where prompt lookup matches more as the answer goes on (a copy-heavy prompt's later
tokens decide its speed-up); then every candidate method REPLAYED on that
answer: its own loop runs for real (proposer, acceptance, rollback) against a stand-in target that
puts all mass on the answer's next token and returns the recorded features, so the method's
acceptance is measured on the answer at the cost of its proposer alone (each replay for at most
`REPLAY_SHARE` of the answer's time: the lookups cover all of it, a learned draft its start). A step's verify
forward is priced by the real loop's own forwards: every verify of the real answer and of a few
real autoregressive steps is timed, and `fit_verify_curve` fits seconds = t_1(prompt) v(W) to them
(alternating medians; widths never seen keep the shape of costs.measure_verify_cost's curve, scaled),
so the price of a replayed step is its proposer's and loop's measured time plus t_1 v(W) at the
widths it asked for. Exact for greedy decoding: a block row off the answer follows a mismatch,
which ends the step before that row's token matters. Lookahead reads the target's logits on its
own Jacobi window, so it runs for real (calib_tokens // 3 new tokens).

At batch B > 1 the verify curve v(W) is that of B rows x W tokens (batch_k.measure_step_costs,
kept in `step_costs` for `auto`, picker/auto.py): once the block is compute-bound a wider block
costs more, which the best fixed k and the choice between speculating and not then see.

T > 0 or batch > 1 (`_windows_all`): every method runs for real, each on the next `calib_tokens`
tokens of one generation (windows in an order rotated per batch, so every method is measured
early and late in the answers), all from ONE prefill per prompt (`SharedPrefill` copies the
saved cache and prefills only the new tokens).

Per (prompt, method) record: steps, drafts, drafted / accepted per position, the proposer's setup
(its `begin`), seconds per step (step_s), the autoregressive step t_ar_s, the prompt's prefill.
"""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch

from ..registry import METHODS, Registry, check_method
from .costs import fit_verify_curve
from .replay import Capture, Replay, SharedPrefill, Timed, clock_verifies, layer_union


@dataclass(frozen=True)
class PickerConfig:
    """Settings of one calibration and its prediction."""

    methods: Optional[tuple] = None  # candidates (registry names); None: every lossless method this
    # model has (medusa_typical, lossy at T > 0, only when named)
    temperature: float = 0.0  # the workload's sampling temperature (0 = greedy)
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 1  # rows per generate call of the workload
    max_new_tokens: int = 128  # new tokens per request of the workload (what is predicted)
    calib_tokens: int = 12  # new tokens per measured window (T > 0, batch > 1, lookahead)
    replay_tokens: int = 56  # greedy, batch 1: the one real answer per prompt that every method is
    # replayed on runs for as long as this many autoregressive steps take (at most max_new_tokens
    # tokens): a prompt the lead method decodes fast gets a longer answer
    max_prompts: Optional[int] = None  # most prompts sampled (None: as many as budget_s allows)
    budget_s: Union[float, str, None] = "auto"  # calibration time bound in seconds; "auto": follows the
    # workload (budget_for); None: every prompt; at least one
    min_gain: float = 0.05  # speculate only where the predicted speed-up is at least 1 + min_gain
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_new_tokens", "calib_tokens", "replay_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.max_prompts is not None and (not isinstance(self.max_prompts, int) or self.max_prompts < 1):
            raise ValueError(f"max_prompts must be None or an int >= 1, got {self.max_prompts!r}")
        if self.budget_s not in (None, "auto") and not (isinstance(self.budget_s, (int, float))
                                                        and not isinstance(self.budget_s, bool) and self.budget_s > 0):
            raise ValueError(f"budget_s must be a number > 0, 'auto' or None, got {self.budget_s!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.min_gain, (int, float)) and self.min_gain >= 0):
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain!r}")
        if self.methods is not None:
            if isinstance(self.methods, str) or not len(self.methods):
                raise ValueError(f"methods must be a non-empty sequence of names, got {self.methods!r}")
            for m in self.methods:
                check_method(m)


# ----------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """What calibrate() measured: one record per (prompt batch, method)."""

    config: PickerConfig
    methods: List[str]
    labels: Dict[str, str]
    records: List[dict] = field(default_factory=list)  # prompt, group, method and the counters
    verify_ratios: List[float] = field(default_factory=list)  # v(W) for W = 1, 2, ... (batch > 1: of B rows)
    step_costs: Optional[object] = None  # batch > 1: batch_k.StepCosts, seconds of B rows x W tokens
    seconds: float = 0.0  # the calibration's wall time (its runs; the registry's setup excluded)
    setup_seconds: float = 0.0  # loading weights and measuring costs (shared with any later use)
    prompts_used: int = 0
    prompts_given: int = 0
    budget_s: Optional[float] = None  # the bound calibration ran under (budget_for when "auto")
    min_prompts: int = 1  # prompts run whatever the budget ("auto": one per category)
    order: List[tuple] = field(default_factory=list)  # (index in the given prompts, group) in sample order;
    # a record's "prompt" is its position here

    def sample(self) -> List[tuple]:
        """(index in the given prompts, group) of every prompt calibration used, in order."""
        return list(self.order[: self.prompts_used])


BUDGET_SHARE, BUDGET_MIN_S, BUDGET_MAX_S = 0.05, 30.0, 600.0


def budget_for(n_prompts: int, max_new_tokens: int, t1: float, batch_size: int = 1) -> float:
    """budget_s="auto": a share of the workload's expected autoregressive decoding time, clamped:
    BUDGET_SHARE x (n_prompts / batch_size batches x max_new_tokens steps x t1, the measured
    one-token forward) within [BUDGET_MIN_S, BUDGET_MAX_S]; calibration also runs at least one
    prompt of every category whatever the budget. A number given by the user is used as it is."""
    expected = -(-n_prompts // batch_size) * max_new_tokens * t1
    return min(BUDGET_MAX_S, max(BUDGET_MIN_S, BUDGET_SHARE * expected))


def sample_order(prompts: Sequence[Sequence[int]], groups: Sequence[str], seed: int) -> List[int]:
    """The order calibration takes the prompts in, so that a budget that stops early has still seen
    the whole workload: seeded (random.Random(seed)), round-robin over the groups (categories; the
    groups' order shuffled), and within a group alternating between its longer and its shorter half
    (each half shuffled), so long and short prompts are both represented."""
    rng = random.Random(seed)
    by_group: Dict[str, List[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    queues = []
    for g in sorted(by_group):
        idx = sorted(by_group[g], key=lambda i: (len(prompts[i]), i))
        short, long = idx[: len(idx) // 2], idx[len(idx) // 2:]
        rng.shuffle(short)
        rng.shuffle(long)
        queue = [x for pair in zip(long, short) for x in pair] + long[len(short):]
        queues.append(queue)
    rng.shuffle(queues)
    order = []
    for r in range(max((len(q) for q in queues), default=0)):
        order += [q[r] for q in queues if r < len(q)]
    return order


def _batches(prompts: List[List[int]], groups: List[str], B: int):
    for i in range(0, len(prompts), B):
        yield i // B, groups[i], [list(r) for r in prompts[i:i + B]]


def _left_padded(rows: List[List[int]]):
    """(ids (b, T) left-padded with 0, mask (b, T))."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids, mask


def _check_prompts(prompts, groups) -> tuple:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("the picker needs at least one prompt (a list of token-id lists)")
    out = []
    for i, p in enumerate(prompts):
        p = p.view(-1).tolist() if isinstance(p, torch.Tensor) else p
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(x, int) and x >= 0 for x in p):
            raise ValueError(f"prompt {i} must be a non-empty list of token ids >= 0")
        out.append(list(p))
    groups = list(groups) if groups is not None else ["all"] * len(out)
    if len(groups) != len(out):
        raise ValueError(f"{len(groups)} groups for {len(out)} prompts")
    return out, groups


def calibrate(model, prompts: Sequence, config: PickerConfig = PickerConfig(), registry: Optional[Registry] = None,
              groups: Optional[Sequence[str]] = None) -> Calibration:
    """Short runs of every candidate method on the prompts (token-id lists), sharing one prefill per
    prompt; groups: a label per prompt (e.g. its task category) for predict(..., group=)."""
    prompts, groups = _check_prompts(prompts, groups)
    order = sample_order(prompts, groups, config.seed)  # stratified by group, long and short, seeded
    prompts, groups = [prompts[i] for i in order], [groups[i] for i in order]
    t_setup = time.perf_counter()
    reg = registry if registry is not None else Registry(model)
    target = reg.target
    names, labels = [], {}
    for m in (config.methods or tuple(n for n in METHODS if n != "medusa_typical")):
        if m == "ar":
            continue
        try:
            labels[m] = reg.label(m)
            names.append(m)
        except (ImportError, ValueError, FileNotFoundError) as e:
            if config.methods is not None:  # asked for by name: say why it cannot run
                raise ValueError(f"method {m!r} cannot run on this model: {e}") from e
    vc = reg.verify_costs()
    v = vc["ratios"]
    step_costs = None
    if config.batch_size > 1:  # the verify curve of B rows (batch_k.py): compute-bound blocks cost more
        from ..batch_k import measure_step_costs

        step_costs = measure_step_costs(target, [config.batch_size], len(v) - 1, reps=3)
        tb = step_costs.verify[config.batch_size]
        v = [x / tb[0] for x in tb]  # v_B(W) = t_B(W) / t_B(1)
    shared = SharedPrefill(target, layer_union(getattr(reg.proposer(m), "hidden_layers", None) for m in names))
    cal = Calibration(config=config, methods=names, labels=labels, verify_ratios=list(v), step_costs=step_costs,
                      setup_seconds=time.perf_counter() - t_setup, prompts_given=len(prompts),
                      order=[(i, groups[j]) for j, i in enumerate(order)],
                      budget_s=budget_for(len(prompts), config.max_new_tokens, vc.get("t1", 0.0), config.batch_size)
                      if config.budget_s == "auto" else config.budget_s,
                      min_prompts=len(set(groups)) if config.budget_s == "auto" else 1)
    gen = dict(max_new_tokens=config.calib_tokens, temperature=config.temperature, top_k=config.top_k,
               top_p=config.top_p, timing=True)  # eos: the model's generation_config
    t0 = time.perf_counter()
    if config.temperature == 0 and config.batch_size == 1:
        _replay_all(cal, reg, target, shared, names, prompts, groups, config, t0)
    else:
        _windows_all(cal, reg, target, shared, names, prompts, groups, config, t0, gen)
    if config.progress:
        print(file=sys.stderr)
    cal.seconds = time.perf_counter() - t0
    return cal


def _windows_all(cal, reg, target, shared, names, prompts, groups, config, t0, gen) -> None:
    """T > 0 or batch > 1: every method measured for real, in consecutive windows of calib_tokens
    new tokens of one generation (the order rotated per batch: every method early and late)."""
    from ..generate import autoregressive_generate, speculative_generate

    tgt = shared.wrap()
    batches = list(_batches(prompts, groups, config.batch_size))
    limit = len(batches) if config.max_prompts is None else -(-config.max_prompts // config.batch_size)
    order = ["ar"] + names
    dev = target.device
    for j, (i, group, rows) in enumerate(batches[:limit]):
        elapsed = time.perf_counter() - t0
        if j >= -(-cal.min_prompts // config.batch_size) and cal.budget_s is not None \
                and elapsed * (j + 1) / j > cal.budget_s:
            break  # the next batch would end past the budget
        if config.progress:
            print(f"\rcalibrating: batch {j + 1}/{limit}, {len(order)} methods, {elapsed:.0f}s",
                  end="", file=sys.stderr, flush=True)
        # the prompt's own prefill, timed once (every window below extends it)
        P = [len(r) for r in rows]
        pre_tok = torch.zeros(len(rows), max(P), dtype=torch.long)  # (b, T) right-padded, as generate.py
        for b, r in enumerate(rows):
            pre_tok[b, : len(r) - 1] = torch.tensor(r[:-1])
        shared.state = None
        tp = time.perf_counter()
        shared.prefill(target.new_cache(len(rows), max(P) + 1), pre_tok.to(dev),
                       torch.tensor([n - 1 for n in P], device=dev), logits=False)
        prefill_s = time.perf_counter() - tp
        # consecutive windows of one generation, one method each, the order rotated per batch, so
        # that every method is measured early and late in the answers
        r0 = j % len(order)
        for w, m in enumerate(order[r0:] + order[:r0]):
            ids, mask = _left_padded(rows)
            offset = len(rows[0]) - P[0]
            seed = config.seed + 1000 * i + w
            if m == "ar":
                out, begin_s = autoregressive_generate(tgt, ids.to(dev), mask.to(dev), seed=seed, **gen), 0.0
                k = None
            else:
                p = Timed(reg.proposer(m))
                out = speculative_generate(tgt, p.proposer, ids.to(dev), mask.to(dev), seed=seed, **gen)
                begin_s, k = p.begin_s, int(getattr(p.proposer, "k", 0))
            s = out.stats
            ctx = sum(len(r) for r in rows)
            cal.records.append(dict(
                prompt=i, group=group, method=m, offset=offset, tokens=int(out.num_tokens.sum()),
                steps=s.target_forwards, row_steps=s.num_row_steps, drafts=s.num_drafts,
                drafted_pos=list(s.drafted_per_position),
                acc_pos=list(s.accepted_per_position), draft_s=s.draft_time, verify_s=s.verify_time,
                begin_s=begin_s, setup_s=begin_s * sum(P) / ctx, replay_s=0.0, run_prefill_s=s.prefill_time,
                prefill_s=prefill_s, wall_s=s.wall_time, k=k))
            if bool((out.num_tokens < config.calib_tokens).any()):  # an answer ended: start again
                rows = [list(r) for r in prompts[i * config.batch_size: i * config.batch_size + len(rows)]]
            else:
                for b in range(len(rows)):
                    rows[b] += out.row(b)
        cal.prompts_used += len(rows)
        mine = [r for r in cal.records if r["prompt"] == i]
        ar = next(r for r in mine if r["method"] == "ar")
        t_ar, t1 = _step_seconds(ar), ar["verify_s"] / max(ar["steps"], 1)
        for r in mine:
            r.update(mode="real", step_s=_step_seconds(r), t_ar_s=t_ar, t1_s=t1)


# A replay's cost is its proposer's alone: prompt lookup replays a whole answer in a fraction of a
# target forward, a learned draft pays a forward of its own per drafted token. Each replay stops
# after this share of the answer's time budget, so the lookups see the whole answer (where their
# matches grow) and the learned drafts, whose acceptance does not grow along the answer, its start.
REPLAY_SHARE = 1 / 6


def _replay_all(cal, reg, target, shared, names, prompts, groups, config, t0) -> None:
    """Greedy, batch 1: per prompt 2 real autoregressive steps (t_ar), ONE real generation by a fast
    lossless method for the time of replay_tokens autoregressive steps (its features captured),
    then every method replayed on that answer (Replay) for at most REPLAY_SHARE of that time: its
    acceptance on the answer at the cost of its proposer alone.
    Every real verify forward is timed: fit_verify_curve turns them into the target's one-token
    forward t1 at each prompt's context and the verify-cost curve v(W) of the real loop, which
    price the replayed steps. Lookahead reads the target's logits on its own window, so it runs
    for real on calib_tokens // 3 tokens."""
    from ..generate import autoregressive_generate, speculative_generate

    tgt = shared.wrap()
    lead = "hybrid" if "hybrid" in names else "ngram"
    dev, D = target.device, int(target.model.config.hidden_size)
    limit = len(prompts) if config.max_prompts is None else min(config.max_prompts, len(prompts))
    points: Dict[int, List[tuple]] = {}
    for j in range(limit):
        elapsed = time.perf_counter() - t0
        if j >= -(-cal.min_prompts // config.batch_size) and cal.budget_s is not None \
                and elapsed * (j + 1) / j > cal.budget_s:
            break
        if config.progress:
            print(f"\rcalibrating: prompt {j + 1}/{limit}, {len(names) + 1} methods, {elapsed:.0f}s",
                  end="", file=sys.stderr, flush=True)
        prompt, group = prompts[j], groups[j]
        ids = torch.tensor([prompt], device=dev)  # (1, P)
        shared.state = None
        points[j] = log = []
        timed = shared.wrap()
        clock_verifies(timed, log)
        # the prompt's prefill (shared by every run below) and 2 real autoregressive steps: t_ar here
        ar = autoregressive_generate(timed, ids, max_new_tokens=2, temperature=0.0, timing=True, seed=config.seed)
        prefill_s = ar.stats.prefill_time
        t_ar = (ar.stats.wall_time - prefill_s) / max(ar.stats.target_forwards, 1)
        # the real answer, for as long as replay_tokens autoregressive steps take: a prompt the lead
        # decodes fast (one that copies) gets more tokens, and with them the later part of its
        # answer, where prompt lookup matches more
        lp = reg.proposer(lead)
        N = config.max_new_tokens
        cap = Capture(lp, shared.hidden_layers, len(prompt) + N + 2, D, target.dtype, dev) \
            if shared.hidden_layers is not None else None
        out = speculative_generate(timed, cap or lp, ids, max_new_tokens=N, max_time=config.replay_tokens * t_ar,
                                   temperature=0.0, timing=True, seed=config.seed)
        y = out.row(0)
        z = torch.tensor(prompt + y, device=dev)  # (P + n,)
        feats = cap.feats[: z.shape[0] - 1] if cap is not None else None
        cap_s = REPLAY_SHARE * config.replay_tokens * t_ar  # each replay's time: equal per method, not tokens
        for m in ["ar"] + names:
            p = Timed(reg.proposer(m)) if m != "ar" else None
            if m == "lookahead":
                o = speculative_generate(tgt, p.proposer, ids, max_new_tokens=max(config.calib_tokens // 3, 4),
                                         temperature=0.0, timing=True, seed=config.seed)
                s = o.stats
                rec = dict(mode="real", widths=[], run_prefill_s=s.prefill_time,
                           step_s=max(s.wall_time - s.prefill_time - p.begin_s, 1e-9) / max(s.target_forwards, 1))
            else:
                rp = Replay(target, z, feats, shared.hidden_layers)
                o = (autoregressive_generate(rp, ids, max_new_tokens=len(y), temperature=0.0, timing=True,
                                             max_time=cap_s)
                     if p is None else speculative_generate(rp, p.proposer, ids, max_new_tokens=len(y),
                                                            temperature=0.0, timing=True, max_time=cap_s))
                s = o.stats
                if o.row(0) != y[: len(o.row(0))]:
                    raise RuntimeError(f"replay of {m} left the trajectory (a bug in the picker's replay)")
                begin = p.begin_s if p is not None else 0.0
                rec = dict(mode="replay", widths=list(rp.widths), run_prefill_s=0.0,
                           loop_s=max(s.wall_time - rp.seconds - begin, 0.0) / max(s.target_forwards, 1))
            cal.records.append(dict(
                rec, prompt=j, group=group, method=m, offset=0, tokens=int(o.num_tokens.sum()),
                steps=s.target_forwards, drafts=s.num_drafts, drafted_pos=list(s.drafted_per_position),
                acc_pos=list(s.accepted_per_position), draft_s=s.draft_time, verify_s=s.verify_time,
                begin_s=p.begin_s if p is not None else 0.0, setup_s=p.begin_s if p is not None else 0.0,
                prefill_s=prefill_s, wall_s=s.wall_time, k=None if p is None else int(getattr(p.proposer, "k", 0))))
        cal.prompts_used += 1
    # price the replayed steps with the real loop's verify forwards
    t1, ratio = fit_verify_curve(points, cal.verify_ratios)
    cal.verify_ratios = [ratio(W) for W in range(1, max(len(cal.verify_ratios), 12) + 1)]
    for r in cal.records:
        r["t1_s"] = t1[r["prompt"]]
        if r["mode"] == "replay":
            r["step_s"] = r["loop_s"] + t1[r["prompt"]] * sum(ratio(W) for W in r["widths"]) / max(len(r["widths"]), 1)
    for r in cal.records:
        ar = next(a for a in cal.records if a["prompt"] == r["prompt"] and a["method"] == "ar")
        r["t_ar_s"] = ar["step_s"]


def _step_seconds(r: dict) -> float:
    """Seconds of one step: the run's wall time less its (shared) prefill and the proposer's setup."""
    return max(r["wall_s"] - r["run_prefill_s"] - r["begin_s"], 1e-9) / max(r["steps"], 1)
