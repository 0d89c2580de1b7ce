"""Known-wrong samplers the oracle must reject, and the transformers adapter.

The correct sampler is Leviathan et al. 2023, Algorithm 1 (accept x with min(1, p(x)/q(x)), on the
first rejection sample norm(max(0, p - q)), else a bonus token from p_{L+1}). `reference_chain`
implements it vectorised with switchable mistakes; each mistake is a bug seen in the wild or a
plausible slip. `hf_speculative_sampling` wraps transformers' `_speculative_sampling` (the
acceptance step of its assisted generation when sampling) in the oracle's plain convention.

generator: one torch.Generator for the batch or a list of one per row. Trees and greedy
verification: tree_selftest.py.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import torch

from .check import check_rejection_sampler

MUTANTS = {  # name: the mistake
    "no_residual": "on rejection, sample from p instead of norm(max(0, p - q))",
    "unnormalised_residual": "inverse-CDF on max(0, p - q) without dividing by its sum (overflow -> last token)",
    "inverted_ratio": "accept with min(1, q(x)/p(x))",
    "ignore_q": "accept with probability p(x), ignoring q",
    "abs_residual": "residual |p - q| instead of max(0, p - q)",
    "bonus_last_row": "bonus token from p[K] (the padded last row) instead of p[L] for ragged rows",
    "prefix_sum": "num_accepted counts every accepted position, not the accepted prefix",
    "shared_uniform": "one uniform draw shared by every row of the batch",
    "residual_argmax": "take the argmax of the residual instead of sampling it",
}


def reference_chain(draft: torch.Tensor, p: torch.Tensor, q: Optional[torch.Tensor], *,
                    lengths: Optional[torch.Tensor] = None, generator=None,
                    mistake: Optional[str] = None):
    """Speculative sampling for B ragged rows; draft (B, K) -1 padded, p (B, K+1, V), q (B, K, V) or None."""
    if mistake is not None and mistake not in MUTANTS:
        raise ValueError(f"mistake must be one of {sorted(MUTANTS)} or None, got {mistake!r}")
    B, K = draft.shape
    V = p.shape[-1]
    lengths = torch.full((B,), K, dtype=torch.long) if lengths is None else lengths.long()  # (B,)
    rows = torch.arange(B)  # (B,)
    nu = 1 if mistake == "shared_uniform" else B
    if isinstance(generator, (list, tuple)):  # one generator per row: row b draws from generator b alone
        u = torch.stack([torch.rand(K + 1, generator=g, dtype=torch.float64) for g in generator[:nu]])  # (nu, K+1)
        u = u.expand(B, K + 1) if nu == 1 else u  # (B, K+1)
    else:
        u = torch.rand(nu, K + 1, generator=generator, dtype=torch.float64).expand(B, K + 1)  # (B, K+1)
    x = draft.clamp(min=0)  # (B, K)
    qe = q if q is not None else torch.nn.functional.one_hot(x, V).to(p.dtype)  # (B, K, V)
    px = p[:, :K].gather(-1, x[..., None])[..., 0].double()  # (B, K)
    qx = qe.gather(-1, x[..., None])[..., 0].double()  # (B, K)
    if mistake == "inverted_ratio":
        accept = u[:, :K] * px < qx  # u < q/p
    elif mistake == "ignore_q":
        accept = u[:, :K] < px
    else:
        accept = (u[:, :K] * qx < px) & (qx > 0)  # u < min(1, p/q); a token q cannot draft is rejected
    accept &= torch.arange(K)[None] < lengths[:, None]  # (B, K)
    a = accept.sum(1) if mistake == "prefix_sum" else accept.long().cumprod(1).sum(1)  # (B,)
    a = torch.minimum(a, lengths)  # (B,)
    p_a = p[rows, a].double()  # (B, V) the row after the accepted prefix
    if K > 0:
        q_a = qe[rows, a.clamp(max=K - 1)].double()  # (B, V)
        res = (p_a - q_a).abs() if mistake == "abs_residual" else (p_a - q_a).clamp(min=0)  # (B, V)
        if mistake == "no_residual":
            res = p_a
        res = torch.where(res.sum(1, keepdim=True) > 0, res, p_a)  # p == q: rejection has prob 0
    else:
        res = p_a
    bonus_row = p[:, K].double() if mistake == "bonus_last_row" else p_a  # (B, V)
    dist = torch.where((a == lengths)[:, None], bonus_row, res)  # (B, V)
    cdf = dist.cumsum(1)  # (B, V)
    if mistake == "residual_argmax":
        y = torch.where(a == lengths, torch.searchsorted(cdf, u[:, K:] * cdf[:, -1:], right=True)[:, 0],
                        res.argmax(1))  # (B,)
    elif mistake == "unnormalised_residual":
        y = torch.where(a == lengths, torch.searchsorted(cdf, u[:, K:] * cdf[:, -1:], right=True)[:, 0],
                        torch.searchsorted(res.cumsum(1), u[:, K:].contiguous(), right=True)[:, 0])  # (B,)
    else:
        y = torch.searchsorted(cdf, u[:, K:] * cdf[:, -1:], right=True)[:, 0]  # (B,)
    y = y.clamp(max=V - 1)  # (B,)
    tokens = torch.full((B, K + 1), -1, dtype=torch.long)  # (B, K+1)
    keep = torch.arange(K)[None] < a[:, None]  # (B, K)
    tokens[:, :K] = torch.where(keep, draft, tokens[:, :K])
    tokens[rows, a] = y
    return SimpleNamespace(tokens=tokens, num_accepted=a)


def mutant(name: str) -> Callable:
    """The reference sampler with one mistake, in the specref convention."""
    def fn(draft, p, q, *, lengths=None, generator=None):
        return reference_chain(draft, p, q, lengths=lengths, generator=generator, mistake=name)
    fn.__name__ = f"mutant_{name}"
    return fn


def reference_vllm(draft_token_ids, num_draft_tokens, draft_probs, target_logits, generator):
    """reference_chain in the vLLM-style convention (flattened ragged drafts, logits with bonus rows)."""
    B, V = len(num_draft_tokens), target_logits.shape[-1]
    lengths = torch.tensor(num_draft_tokens, dtype=torch.long)  # (B,)
    K = int(lengths.max()) if B else 0
    pos = torch.arange(K + 1)  # (K+1,)
    draft = torch.full((B, K), -1, dtype=torch.long)  # (B, K)
    draft[pos[:K] < lengths[:, None]] = draft_token_ids
    p = torch.full((B, K + 1, V), 1.0 / V)  # (B, K+1, V), unused rows uniform
    p[pos < lengths[:, None] + 1] = torch.softmax(target_logits.float(), -1)
    q = None
    if draft_probs is not None:
        q = torch.full((B, K, V), 1.0 / V)  # (B, K, V)
        q[pos[:K] < lengths[:, None]] = draft_probs.float()
    return reference_chain(draft, p, q, lengths=lengths, generator=generator).tokens  # (B, K+1)


def reference_plain(p, q, draft, generator):
    """reference_chain on one row, in the plain convention."""
    out = reference_chain(draft[None], p[None], None if q is None else q[None], generator=generator)
    return out.tokens[0, : int(out.num_accepted[0]) + 1]  # (a+1,)


def hf_speculative_sampling(p, q, draft, generator):
    """transformers' `_speculative_sampling` (generation/utils.py) in the plain convention.

    It takes logits (we pass log p and log q: softmax restores them), batch size 1, and draws from
    the global torch RNG, which we seed from `generator` on every call. q None is passed as one-hot
    logits. With no draft tokens transformers never calls it (its loop samples p directly), so we do
    that here.
    """
    from transformers.generation.utils import _speculative_sampling

    torch.default_generator.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))  # CPU RNG
    L, V = draft.numel(), p.shape[-1]
    if L == 0:
        return torch.multinomial(p[0], 1)  # (1,)
    qq = q if q is not None else torch.nn.functional.one_hot(draft, V).float()  # (L, V)
    valid, _ = _speculative_sampling(draft[None], torch.log(qq)[None], L, torch.log(p)[None])
    return valid[0]  # (a+1,)


def false_alarms(fn: Callable, *, api: str = "specref", runs: int = 20, samples: int = 2000,
                 alpha: float = 0.2, seed: int = 1000, cases=None) -> Tuple[int, List[float]]:
    """Failures of `runs` independent checks of a correct sampler (expected <= alpha * runs), and
    the p-values of every variant's first-position test (i.i.d. uniform under the null)."""
    fails, pos1 = 0, []
    for r in range(runs):
        rep = check_rejection_sampler(fn, api=api, law="tokenwise", samples=samples, alpha=alpha, seed=seed + r,
                                      early_stop=False, cases=cases)
        fails += rep.verdict == "FAIL"
        pos1 += [t.p_value for t in rep.tests if t.name.endswith(" pos 1") and t.dof > 0]  # dof 0: p is 1
    return fails, pos1


def self_test(samples: int = 20_000, alpha: float = 1e-3, seed: int = 0, false_alarm_runs: int = 20) -> Tuple[bool, List[str]]:
    """Under the token-wise law: every mutant must FAIL, no correct sampler FAIL (PASS or, on a run too
    small for the power, INCONCLUSIVE); then the false-alarm rate of the reference. The lossless law:
    lossless_selftest.lossless_self_test."""
    correct = [("reference_chain", reference_chain, "specref", samples),
               ("reference_vllm", reference_vllm, "vllm", samples),
               ("reference_plain", reference_plain, "plain", max(8, samples // 20))]
    try:
        from ..rejection import verify_chain
        correct.insert(0, ("specref.rejection.verify_chain", verify_chain, "specref", samples))
    except ImportError:
        pass
    ok, lines = True, []
    for name, fn, api, n in correct + [(m, mutant(m), "specref", samples) for m in MUTANTS]:
        rep = check_rejection_sampler(fn, api=api, law="tokenwise", samples=n, alpha=alpha, seed=seed)
        expect = name not in MUTANTS
        ok &= (rep.verdict != "FAIL") == expect
        lines.append(verdict_line(name, rep.verdict != "FAIL", expect, f"{rep.verdict}, {rep.samples} samples; "
                                  f"{failure_reason(rep)}"))
    if false_alarm_runs:
        fails, pos1 = false_alarms(reference_chain, runs=false_alarm_runs, alpha=0.2, seed=seed + 1000)
        good, line = false_alarm_verdict("reference_chain", fails, false_alarm_runs, 0.2, pos1, "pos-1")
        ok &= good
        lines.append(line)
    lines.append(f"self-test: {'PASS' if ok else 'FAIL'}")
    return ok, lines


def failure_reason(rep) -> str:
    """A report's first structural error, else its smallest p-value and the test's name."""
    if rep.errors:
        return rep.errors[0]
    return "min p {:.2g} ({})".format(*min(((t.p_value, t.name) for t in rep.tests), default=(1.0, "-")))


def verdict_line(name: str, passed: bool, expect: bool, detail: str) -> str:
    """One self-test line: ok when the check's verdict is the expected one (passed: not FAIL)."""
    return (f"{'ok ' if passed == expect else 'BAD'} {name:32s} expected {'PASS' if expect else 'FAIL'}, "
            f"got {'PASS' if passed else 'FAIL'}; {detail}")


def false_alarm_verdict(name: str, fails: int, runs: int, alpha: float, pvals, what: str) -> Tuple[bool, str]:
    """A correct sampler's failures over `runs` checks at level alpha must not exceed the binomial
    rate, and its first tests' p-values must be uniform (KS); -> (good, the self-test line)."""
    from scipy import stats

    p_rate = stats.binomtest(fails, runs, alpha, alternative="greater").pvalue
    p_unif = stats.kstest(pvals, "uniform").pvalue
    good = p_rate > 1e-3 and p_unif > 1e-3
    return good, (f"{'ok ' if good else 'BAD'} false alarms of {name} at alpha {alpha}: {fails}/{runs} "
                  f"(binomial p {p_rate:.3g}); {what} p-values uniform: KS p {p_unif:.3g} over {len(pvals)}")


# module-level names for the CLI: --sampler specref.oracle.selftest:mutant_no_residual
for _name in MUTANTS:
    globals()[f"mutant_{_name}"] = mutant(_name)
