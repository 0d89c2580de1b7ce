"""`auto`: the picker's method for the batch size at hand, each step's k from the costs at that size.

The picker (picker.py) calibrates every candidate on the user's prompts at the workload's batch
size B (batch > 1: real runs of B rows, and the verify curve of B rows x W tokens,
calibration.py) and picks the method with the highest predicted speed-up, or "ar" (plain
decoding) when none pays. `auto` then runs that pick, a chain proposer wrapped in batch_k's
BatchKProposer with the measured step costs at B: every step it chooses k in 0..K (K the pick's own
k) maximising the expected tokens per second of the rows decoding now,

    k* = argmax_k  sum_b E_b(k) / (t_v(B, k + 1) + t_d(B, k))   (batch_k.choose_k)

so a batch whose verification has become compute-bound decodes plainly (k = 0) without being told,
and rows that keep rejecting stop paying for drafts; with `threshold`, a row's sampled draft also
ends after its first token of draft probability below it (vLLM's adaptive, confidence-based draft
length; lossless: batch_k.py).

The costs: t_v(B, W) the calibration's measured seconds of B rows x W tokens (B = 1: the
registry's one-row curve, seconds = t_1 v(W)); t_d(B, k) the pick's measured draft seconds per
drafting step in the calibration at B, split per drafted position for a proposer that drafts
only k when asked (`variable_k`: the draft model, EAGLE-1/3's chain, MTP, the MLP speculator) and
the whole step's otherwise (it drafts its full k and is cut).
Left out, said rather than faked: a tree pick (EAGLE-2, Medusa, lookahead, ...) runs as the picker
configured it (its node budget is its own; batch_k prices chains only), so at B where trees lose
the picker's own choice ("ar") is what avoids them; the costs are measured at one context length
(batch_k.measure_step_costs: 128 tokens) and do not follow a growing context; the picker's
prediction of the pick is for the pick at its fixed k, not for the per-step k of `auto` (a bound
from below: the per-step choice includes that k).

    a = build_auto(model, prompts, AutoConfig(batch_size=16))
    out = schedule(model, a.proposer, prompts, batch_size=16, max_new_tokens=128)  # proposer: never None
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..batch_k import BatchKConfig, BatchKProposer, StepCosts
from ..registry import TREES, Registry
from .picker import Recommendation, recommend


@dataclass(frozen=True)
class AutoConfig:
    """Settings of `auto`."""

    batch_size: int = 1  # B: rows per step of the workload (the calibration and the costs are at B)
    temperature: float = 0.0  # the workload's sampling temperature
    max_new_tokens: int = 128  # new tokens per request of the workload
    methods: Optional[tuple] = None  # the candidates (registry names); None: every lossless method
    budget_s: Union[float, str, None] = "auto"  # the calibration's time bound (PickerConfig.budget_s)
    threshold: Optional[float] = None  # BatchKConfig.threshold: a row's sampled draft ends after its
    # first token whose draft probability is below it (None: off)
    progress: bool = False  # the calibration's progress line

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1] or None, got {self.threshold!r}")
        if self.methods is not None and "auto" in self.methods:
            raise ValueError("methods are auto's candidates: 'auto' cannot be one of them")


@dataclass
class Auto:
    """What build_auto() chose: the picked method, its proposer (a NullProposer for "ar": plain
    decoding), the step costs it decides k by (None for "ar" and trees) and the recommendation."""

    method: str
    proposer: object
    costs: Optional[StepCosts]
    recommendation: Recommendation

    def fresh(self, registry: Registry):
        """A new proposer of the same pick (the same costs), for another run; None for "ar"."""
        if self.method == "ar":
            return None
        p = registry.proposer(self.method)
        if self.costs is None:
            return p
        return BatchKProposer(p, BatchKConfig(costs=self.costs, threshold=self.proposer.config.threshold))

    @property
    def label(self) -> str:
        rec = self.recommendation
        how = "plain decoding" if self.method == "ar" else (
            f"{self.method}, k per step in 0..{self.proposer.k} from the costs at B"
            if isinstance(self.proposer, BatchKProposer) else f"{self.method} as configured (a tree)")
        return f"specref auto at B={rec.calibration.config.batch_size}: {how}"


def step_costs(rec: Recommendation, registry: Registry) -> StepCosts:
    """The verify seconds of B rows x W tokens (the calibration's at B > 1, else the registry's
    one-row curve) and the pick's draft seconds per step at B (module docstring)."""
    cal = rec.calibration
    B = cal.config.batch_size
    if cal.step_costs is not None:
        verify = dict(cal.step_costs.verify)
    else:
        vc = registry.verify_costs()
        verify = {B: [vc["t1"] * r for r in vc["ratios"]]}
    K = len(next(iter(verify.values()))) - 1
    recs = [r for r in cal.records if r["method"] == rec.method]
    step = sum(r["draft_s"] for r in recs) / max(sum(r["steps"] for r in recs), 1)  # proposer seconds per step
    drafts = sum(r["drafts"] for r in recs)  # row-steps that drafted
    length = sum(sum(r["drafted_pos"]) for r in recs) / max(drafts, 1)  # a drafting row's mean draft length
    per_pos = step / max(length, 1.0)
    variable = getattr(getattr(rec.proposer, "inner", rec.proposer), "variable_k", False)
    draft = [0.0] + [per_pos * k if variable else step for k in range(1, K + 1)]
    return StepCosts(verify, {B: draft})


def build_auto(model, prompts: Sequence, config: AutoConfig = AutoConfig(),
               registry: Optional[Registry] = None) -> Auto:
    """Calibrate on the prompts (token-id lists) at config.batch_size, pick, and return the pick
    ready to run: a chain wrapped in BatchKProposer with the costs at B, a tree as configured, or
    a NullProposer (plain decoding) when the picker says not to speculate."""
    from ..generate import NullProposer

    if not isinstance(config, AutoConfig):
        raise ValueError(f"config must be an AutoConfig, got {type(config).__name__}")
    reg = registry if registry is not None else Registry(model)
    rec = recommend(model, prompts, methods=config.methods, temperature=config.temperature,
                    batch_size=config.batch_size, max_new_tokens=config.max_new_tokens, budget_s=config.budget_s,
                    registry=reg, progress=config.progress)
    if rec.proposer is None:
        return Auto("ar", NullProposer(), None, rec)
    if rec.method in TREES or rec.proposer.k < 1:
        return Auto(rec.method, rec.proposer, None, rec)
    costs = step_costs(rec, reg)
    return Auto(rec.method, BatchKProposer(rec.proposer, BatchKConfig(costs=costs, threshold=config.threshold)),
                costs, rec)
