"""What an oracle check answers: the Report with its verdict (PASS, FAIL, INCONCLUSIVE), the tests
behind it, and the sequential driver shared by the chain and tree checks (check.py, tree_check.py,
generator.py): looks at growing sample sizes, stopping at the first failure.

A verdict is FAIL on a structural error or a p-value below the per-test threshold; PASS when no test
fails and the run detects a TV deviation of tv_bound with 95% power; INCONCLUSIVE when it cannot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Tuple

from .adapters import Malformed
from .stats import TvResult

@dataclass(frozen=True)
class TestResult:
    name: str  # "<case>/<variant> <test>"
    kind: str  # "pos", "residual", "bonus", "length" or "joint"
    p_value: float
    statistic: float
    dof: int
    n: int  # samples in this test
    tv: TvResult  # empirical TV to the exact distribution, with its confidence interval
    detectable_tv: float  # TV this test detects with 95% power at the per-test threshold
    worst: Tuple[Tuple[str, float, float], ...]  # (cell, expected, observed), worst first


VERDICTS = ("PASS", "FAIL", "INCONCLUSIVE")


@dataclass(frozen=True)
class Report:
    passed: bool  # verdict == "PASS": no failure and the run had the power (detectable_tv <= tv_bound)
    alpha: float  # family-wise significance of the whole check
    threshold: float  # per-test significance (alpha split over looks and tests)
    tests: Tuple[TestResult, ...]
    errors: Tuple[str, ...]  # structural failures (each alone fails the check)
    samples: int  # sampler rows drawn in total
    detectable_tv: float  # worst over variants of the pos-1 test's 95%-power detectable TV
    stopped_early: bool
    verdict: str = ""  # PASS, FAIL (an error or a p-value below threshold) or INCONCLUSIVE (no failure, too little power)
    tv_bound: float = 0.05  # the largest detectable_tv a PASS allows
    law: str = ""  # the question asked: "lossless", "specinfer" (trees) or "tokenwise" (chains); "" for other checks
    draft_law: str = ""  # how the drafts were drawn: "topk", "iid", "without", "trie" (lossless and specinfer checks)
    power: Tuple[Tuple[str, float], ...] = ()  # (test, detectable TV of the output law) per depth and per step (lossless law)
    samples_needed: int = 0  # rows per variant that would bring detectable_tv to tv_bound (0: already there)

    @property
    def failures(self) -> Tuple[TestResult, ...]:
        return tuple(t for t in self.tests if t.p_value < self.threshold)

    def summary(self, top: int = 5) -> str:
        fails = sorted(self.failures, key=lambda t: t.p_value)
        verdict = self.verdict or ("PASS" if self.passed else "FAIL")
        if not self.tests and self.alpha == 0.0:  # an exact check (check_greedy_verifier)
            return "\n".join([f"verdict: {verdict} (exact comparison, {self.samples} rows)"]
                             + [f"error: {e}" for e in self.errors[:top]])
        asked = f"law {self.law}, drafts {self.draft_law}, " if self.law else ""
        where = "the output law of a step, depths summed" if self.power else "first position, worst variant"
        lines = [
            f"verdict: {verdict} ({asked}alpha {self.alpha:g}, per-test {self.threshold:.2e}, "
            f"{len(self.tests)} tests, {self.samples} samples{', stopped early' if self.stopped_early else ''})",
            f"smallest TV deviation detectable with 95% power ({where}): {self.detectable_tv:.4f} (bound {self.tv_bound:g})",
        ]
        if verdict == "INCONCLUSIVE":
            lines.append(f"too little power for TV {self.tv_bound:g}: about {self.samples_needed} rows per variant needed")
        for name, det in sorted(self.power, key=lambda t: -t[1])[:top]:
            lines.append(f"power {name}: detectable TV {det:.4f}")
        lines += [f"error: {e}" for e in self.errors[:top]]
        shown = fails[:top] or sorted(self.tests, key=lambda t: t.p_value)[:1]
        for t in shown:
            cells = "; ".join(f"{c}: expected {e:.1f} observed {o:.0f}" for c, e, o in t.worst[:3])
            lines.append(f"{'FAIL' if t in fails else 'min p'} {t.name}: p={t.p_value:.3g} chi2={t.statistic:.1f} "
                         f"dof={t.dof} n={t.n} TV={t.tv.tv:.4f} [{t.tv.lower:.4f}, {t.tv.upper:.4f}] | {cells}")
        return "\n".join(lines)


def decide(errors, tests, threshold: float, detectable: float, tv_bound: float) -> str:
    """FAIL on a structural error or a p-value below threshold (whatever the power); else PASS when
    the run detects a TV deviation of tv_bound with 95% power, INCONCLUSIVE when it cannot."""
    if errors or any(t.p_value < threshold for t in tests):
        return "FAIL"
    return "PASS" if detectable <= tv_bound else "INCONCLUSIVE"


def needed(samples: int, detectable: float, tv_bound: float) -> int:
    """Rows per variant at which detectable_tv (which scales as 1/sqrt(rows)) reaches tv_bound."""
    if not math.isfinite(detectable) or detectable <= tv_bound:
        return 0
    return int(math.ceil(samples * (detectable / tv_bound) ** 2))


MARGIN = 1.5  # projected rows x this: more rows also reach prefixes this run never saw (untested mass
#               the projection cannot know); from 1,000 rows the chain cases needed 1.43x the bare projection


def projected(rows: int, projections, tv_bound: float, most: float = 1e4) -> int:
    """Rows per variant at which every projection f -> detectable TV at f x rows (the same prefixes,
    f times the rows each: lossless.depth_claim) reaches tv_bound, times MARGIN; by bisection on f in
    [1, most] (rows x most when even that is not enough: the untested share or pooled mass does not
    shrink)."""
    worst = lambda f: max(p(f) for p in projections)  # noqa: E731
    if worst(most) > tv_bound:
        return int(math.ceil(rows * most))
    lo, hi = 1.0, most
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if worst(mid) <= tv_bound else (mid, hi)
    return int(math.ceil(rows * hi * MARGIN))


def check_bound(tv_bound) -> None:
    if isinstance(tv_bound, bool) or not isinstance(tv_bound, (int, float)) or not 0.0 < tv_bound <= 0.5:
        raise ValueError(f"tv_bound must be in (0, 0.5], got {tv_bound!r}")


def run_looks(cases, looks, alpha: float, threshold: float, chunk_rows: Callable, draw: Callable,
              run: Callable, analyse: Callable, what: str, tv_bound: float = 0.05, law: str = "",
              draft_law: str = "") -> Report:
    """The sequential driver of the chain and tree checks: per look, more rows of every case in
    chunks (earlier chunks kept), drawn by `draw(ci, case, start, stop)` and put through the
    implementation by `run(case, drawn) -> chunk` (raise Malformed for a bad output); a case whose
    output is malformed, or whose implementation raises, is one structural error and is not
    analysed further; `analyse(ci, case, chunks, threshold) -> (errors, tests, first tests'
    detectable TVs, rows)`; a detectable TV may come as (test name, TV): a per-depth power line.
    Stops after the first look with a failure. The verdict: `decide`."""
    store = [[] for _ in cases]  # per case: its chunks
    broken = {}  # case -> its structural error
    done = 0
    for li, rows in enumerate(looks):
        errors, tests, firsts, total = [], [], [], 0
        for ci, case in enumerate(cases):
            nv, chunk = len(case.variants), chunk_rows(case)
            for start in range(done * nv, rows * nv, chunk):
                if ci in broken:
                    break
                drawn = draw(ci, case, start, min(rows * nv, start + chunk))
                try:
                    store[ci].append(run(case, drawn))
                except Malformed as e:
                    broken[ci] = f"{case.name}: malformed output: {e}"
                except Exception as e:  # the implementation crashed on this case
                    broken[ci] = f"{case.name}: the {what} raised {type(e).__name__}: {e}"
            if ci in broken:
                errors.append(broken[ci])
                continue
            e, t, f, n = analyse(ci, case, store[ci], threshold)
            errors, tests, firsts, total = errors + e, tests + t, firsts + f, total + n
        done = rows
        power = tuple(f[:2] for f in firsts if isinstance(f, tuple))
        det = max([f[1] if isinstance(f, tuple) else f for f in firsts], default=math.inf)
        verdict = decide(errors, tests, threshold, det, tv_bound)
        if verdict == "FAIL" or li == len(looks) - 1:
            projections = [f[2] for f in firsts if isinstance(f, tuple) and len(f) > 2]
            more = (projected(rows, projections, tv_bound) if projections and det > tv_bound
                    else needed(rows, det, tv_bound))
            return Report(verdict == "PASS", alpha, threshold, tuple(tests), tuple(errors), total, det,
                          li < len(looks) - 1, verdict, tv_bound, law, draft_law, power, more)
    raise AssertionError("unreachable")
