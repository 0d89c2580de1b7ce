"""The strategy picker: which method, which k, or none, for a given model, workload and machine.

Leviathan et al. 2023 price a speculative step in target steps (Eq. 1, Theorem 3.8): tokens per
step E = (1 - alpha^(k+1)) / (1 - alpha), cost 1 + c k. On real hardware three more terms decide
(notebook 07): the verify block of W tokens costs v(W) >= 1 target steps, a proposer drafts only on
a fraction f of the steps (prompt lookup: where the context repeats), and the prompt's prefill plus
the proposer's own setup are paid once per request, so few new tokens cannot repay them. The picker
MEASURES each term on a sample of the user's prompts and combines them by the closed form:

calibration (calibration.py): on the user's prompts, greedy: one real answer per prompt and every
method replayed on it (its real loop against a stand-in target: acceptance over the whole answer
at the cost of the proposer alone, the verify forwards priced by the measured curve v(W)); T > 0
or batch > 1: every method run for real on consecutive windows of one generation. Measured per
method: steps s; f = drafting steps / s; P(L >= i) = steps drafting >= i tokens / s; acceptance per
position a_i = accepted at i / reached i (reached_1 = drafting steps, reached_i = min(accepted at
i-1, drafting >= i)); the proposer's setup seconds (its `begin`); the seconds of a step t_step
(draft + verify + the loop's own work); autoregressive t_ar per step and the prompt's prefill.

prediction (`predict`) for N new tokens, per prompt, then the geometric mean over prompts (as the
bench's speed-up is the geometric mean of per-question ratios); at batch B > 1 s counts row-steps
(a step of B rows is B of them), so tau and f are per row, t_step and t_ar are steps of B rows, and
v(W) is the measured curve of B rows x W tokens (calibration.py):

    tau   = 1 + (accepted drafts) / s  = E[N + 1]          (Eq. 1's quantity, measured; with i.i.d.
            acceptance a_l it is 1 + sum_i P(L >= i) prod_{l <= i} a_l)
    T_m   = prefill + setup_m + (N / tau) t_step,m ;   T_ar = prefill + N t_ar
    speed-up = T_ar / T_m

and, for chain methods, the best fixed k: tau(k) = (1-f) + f (1 + sum_{i<=k} prod_{l<=i} a_l) over
t(k) = (1-f) t_ar + f (v(k+1) t_1 + c k t_1 + o), v(W) the measured verify-cost curve
(costs.measure_verify_cost), c the measured draft seconds per drafted token / t_1, o the loop's
seconds per step. The recommendation is the method with the highest predicted speed-up, or
"ar" (do not speculate) when none reaches 1 + min_gain, with the measured reason.

    rec = recommend(model, [prompt_ids, ...], temperature=0.0, max_new_tokens=128, budget_s=30)
    out = speculative_generate(model, rec.proposer, ids) if rec.proposer else autoregressive_generate(model, ids)

Left out: methods outside the registry (transformers' own); the per-depth prediction of trees
(trees are predicted as configured, from their measured acceptance per depth).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from ..registry import Registry
from .calibration import Calibration, PickerConfig, calibrate

__all__ = ["PickerConfig", "Calibration", "calibrate", "predict", "choose", "recommend", "Recommendation",
           "prediction_table", "expected_tokens", "acceptance"]


# ----------------------------------------------------------------------------- prediction


def expected_tokens(drafted_pos: List[int], acc_pos: List[int], steps: int) -> float:
    """tau = E[accepted drafts + 1] per step, measured: 1 + sum_i accepted at i / steps. Under
    i.i.d. acceptance a per position this is 1 + sum_i P(L >= i) a^i (Eq. 1 when L = k); measured
    directly it also holds for mixtures (the hybrid's two sources) and for adaptive lengths, whose
    long drafts come where acceptance is high."""
    if steps <= 0:
        return 1.0
    return 1.0 + sum(acc_pos) / steps


def acceptance(drafted_pos: List[int], acc_pos: List[int]) -> List[float]:
    """a_i = accepted at i / reached i (conditional per-position acceptance)."""
    out = []
    for i, (d, a) in enumerate(zip(drafted_pos, acc_pos)):
        reached = d if i == 0 else min(acc_pos[i - 1], d)
        if reached <= 0:
            break
        out.append(a / reached)
    return out


def _row_steps(r: dict) -> int:
    """(row, step) pairs of a record: batch > 1 counts every row's steps (records without it: batch 1)."""
    return r.get("row_steps") or r["steps"]


def _merge(recs: List[dict]) -> dict:
    """Counters of several runs summed."""
    K = max([len(r["drafted_pos"]) for r in recs] + [0])
    pad = lambda x: list(x) + [0] * (K - len(x))  # noqa: E731
    out = {k: sum(r[k] for r in recs) for k in ("tokens", "steps", "drafts", "draft_s", "verify_s", "begin_s",
                                                  "setup_s", "prefill_s", "wall_s")}
    out["row_steps"] = sum(_row_steps(r) for r in recs)
    out["drafted_pos"] = [sum(v) for v in zip(*[pad(r["drafted_pos"]) for r in recs])] if K else []
    out["acc_pos"] = [sum(v) for v in zip(*[pad(r["acc_pos"]) for r in recs])] if K else []
    return out


def predict(cal: Calibration, max_new_tokens: Optional[int] = None, group: Optional[str] = None) -> Dict[str, dict]:
    """{method: prediction} for N new tokens on the prompts of `group` (None: all): speed-up over
    autoregressive decoding (geometric mean over prompts), tau, the step's cost in autoregressive
    steps, f, acceptance per position, and for chain methods the best fixed k. "ar" is 1.0."""
    N = max_new_tokens or cal.config.max_new_tokens
    recs = [r for r in cal.records if group is None or r["group"] == group]
    if not recs:
        raise ValueError(f"no calibration runs for group {group!r}")
    by = {(r["prompt"], r["method"]): r for r in recs}
    prompts = sorted({r["prompt"] for r in recs})
    out: Dict[str, dict] = {"ar": dict(speedup=1.0, steady=1.0, tau=1.0, cost=1.0, f=0.0, acceptance=[],
                                       k=None, best_k=None, label="autoregressive (no speculation)")}
    t_ar_all = sum(by[(p, "ar")]["t_ar_s"] for p in prompts) / len(prompts)
    t1 = sum(by[(p, "ar")]["t1_s"] for p in prompts) / len(prompts)  # one 1-token target forward
    for m in cal.methods:
        logs, logs_inf = [], []
        for p in prompts:
            r = by[(p, m)]
            tau = expected_tokens(r["drafted_pos"], r["acc_pos"], _row_steps(r))  # per row
            T_ar = r["prefill_s"] + N * r["t_ar_s"]
            T_m = r["prefill_s"] + r["setup_s"] + N / tau * r["step_s"]
            logs.append(math.log(T_ar / T_m))
            logs_inf.append(math.log(tau * r["t_ar_s"] / r["step_s"]))
        pooled = _merge([by[(p, m)] for p in prompts])
        tau = expected_tokens(pooled["drafted_pos"], pooled["acc_pos"], pooled["row_steps"])
        a = acceptance(pooled["drafted_pos"], pooled["acc_pos"])
        f = pooled["drafts"] / max(pooled["row_steps"], 1)  # the share of row-steps that drafted
        t_m = sum(by[(p, m)]["step_s"] * by[(p, m)]["steps"] for p in prompts) / max(pooled["steps"], 1)
        row = dict(speedup=math.exp(sum(logs) / len(logs)), steady=math.exp(sum(logs_inf) / len(logs_inf)),
                   tau=tau, cost=t_m / t_ar_all, f=f, acceptance=a,
                   draft_cost=pooled["draft_s"] / max(pooled["steps"], 1) / t_ar_all,
                   verify_cost=pooled["verify_s"] / max(pooled["steps"], 1) / t_ar_all,
                   setup_s=pooled["setup_s"] / len(prompts), k=by[(prompts[0], m)]["k"], best_k=None,
                   label=cal.labels.get(m, m))
        if m in ("ngram", "draft", "eagle", "mtp", "mlp_speculator") and a:
            row["best_k"] = _best_fixed_k(pooled, a, f, t_ar_all, t1, cal.verify_ratios)
        out[m] = row
    return out


def _best_fixed_k(pooled: dict, a: List[float], f: float, t_ar: float, t1: float, v: List[float]):
    """(k, predicted steady speed-up) maximising tau(k) / t(k) over the k whose a_k was measured."""
    rows = pooled["row_steps"] / max(pooled["steps"], 1)  # rows per step (batch: a step drafts them together)
    c = pooled["draft_s"] * rows / max(sum(pooled["drafted_pos"]), 1)  # seconds per drafted position of a step
    o = max(t_ar - t1, 0.0)  # the loop's own seconds per step
    best, prod, tau_d = (None, 0.0), 1.0, 1.0
    for k in range(1, min(len(a), len(v) - 1) + 1):
        prod *= a[k - 1]
        tau_d += prod
        tau = (1 - f) + f * tau_d
        t = (1 - f) * t_ar + f * (v[k] * t1 + c * k + o)  # v[k] = v(W = k + 1)
        s = tau * t_ar / t
        if s > best[1]:
            best = (k, s)
    return best


# ----------------------------------------------------------------------------- the recommendation


@dataclass
class Recommendation:
    """The picker's answer: method name ("ar": do not speculate), its proposer (None for "ar"), the
    reason, every method's prediction and the calibration behind it."""

    method: str
    proposer: object
    reason: str
    predicted: Dict[str, dict]
    calibration: Calibration

    @property
    def predictions(self) -> Dict[str, float]:
        """{method: predicted speed-up}."""
        return {m: p["speedup"] for m, p in self.predicted.items()}

    @property
    def k(self):
        return self.predicted[self.method]["k"]

    def table(self) -> str:
        return prediction_table(self.predicted, self.method)

    def to_json(self) -> dict:
        cal = self.calibration
        return dict(method=self.method, reason=self.reason, predicted=self.predicted,
                    config=asdict(cal.config), calibration_s=cal.seconds, setup_s=cal.setup_seconds,
                    budget_s=cal.budget_s,
                    prompts_used=cal.prompts_used, prompts_given=cal.prompts_given, verify_ratios=cal.verify_ratios,
                    sample=[dict(prompt=i, category=g) for i, g in cal.sample()])


def choose(pred: Dict[str, dict], cfg: PickerConfig) -> tuple:
    """(method, reason) from predict()'s table."""
    best = max((m for m in pred if m != "ar"), key=lambda m: pred[m]["speedup"], default=None)
    if best is None:
        return "ar", "no candidate method"
    p = pred[best]
    if p["speedup"] >= 1 + cfg.min_gain:
        return best, (f"predicted {p['speedup']:.2f}x: {p['tau']:.2f} tokens per step for a step of "
                      f"{p['cost']:.2f} autoregressive steps")
    if p["steady"] >= 1 + cfg.min_gain:
        why = (f"few new tokens: {best} would pay {p['steady']:.2f}x per step, but its setup "
               f"({p['setup_s']:.2f}s per request) is not repaid in {cfg.max_new_tokens} tokens")
    else:
        extra = []
        if cfg.temperature > 0:
            extra.append(f"sampling at T = {cfg.temperature} (acceptance {_first(p['acceptance'])})")
        if cfg.batch_size > 1:
            extra.append(f"batch {cfg.batch_size} (verify {p['verify_cost']:.2f} autoregressive steps)")
        why = (f"drafts do not pay: the best, {best}, makes {p['tau']:.2f} tokens per step for a step of "
               f"{p['cost']:.2f} autoregressive steps ({p['speedup']:.2f}x)" + (": " + ", ".join(extra) if extra else ""))
    return "ar", "do not speculate - " + why


def _first(a: List[float]) -> str:
    return f"{a[0]:.2f}" if a else "-"


def recommend(model, prompts: Sequence, *, methods: Optional[Sequence[str]] = None, temperature: float = 0.0,
              batch_size: int = 1, max_new_tokens: int = 128, budget_s="auto",
              registry: Optional[Registry] = None, **config) -> Recommendation:
    """Calibrate on the prompts (token-id lists), predict every method, and return the pick with a
    proposer ready for speculative_generate (None: use autoregressive_generate)."""
    cfg = PickerConfig(methods=None if methods is None else tuple(methods), temperature=temperature,
                       batch_size=batch_size, max_new_tokens=max_new_tokens, budget_s=budget_s, **config)
    reg = registry if registry is not None else Registry(model)
    cal = calibrate(model, prompts, cfg, reg)
    pred = predict(cal)
    method, reason = choose(pred, cfg)
    return Recommendation(method, reg.proposer(method), reason, pred, cal)


def prediction_table(pred: Dict[str, dict], picked: Optional[str] = None) -> str:
    """The predictions as a Markdown table (text)."""
    lines = ["| method | predicted speed-up | steady state | tau | step cost | f | acceptance per position | "
             "best fixed k |", "|---|---|---|---|---|---|---|---|"]
    for m, p in sorted(pred.items(), key=lambda kv: -kv[1]["speedup"]):
        acc = " / ".join(f"{x:.2f}" for x in p["acceptance"][:5]) or "-"
        bk = "-" if not p.get("best_k") or p["best_k"][0] is None else f"{p['best_k'][0]} ({p['best_k'][1]:.2f}x)"
        mark = " **(pick)**" if m == picked else ""
        lines.append(f"| {m}{mark} | {p['speedup']:.2f}x | {p['steady']:.2f}x | {p['tau']:.2f} | {p['cost']:.2f} | "
                     f"{p['f']:.2f} | {acc} | {bk} |")
    return "\n".join(lines)


def save(obj: dict, path) -> None:
    """JSON, numbers as they are (the picker's and the comparison's records)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
