"""Lossless verifiers that follow other laws than SpecInfer's, and the lossless mode's self-test.

- `block_verify`: block verification (Sun et al. 2025, "Block verification accelerates speculative
  decoding", Algorithm 2) for chains, the library's public rule (specref.rejection.verify_chain_block,
  block_verify.py). Lossless, and it accepts at least as much as token-wise verification: it fails the
  token-wise law. `block_product_rule` is a mutant of it: the last i with prod min(1, p_j/q_j) >= prod
  eta_j (lossy).
- `specref.rejection.verify_tree_traversal`: traversal verification (Weng et al. 2025, traversal.py) on
  the sampled cases (siblings drawn without replacement; it refuses top-k trees): lossless, and not
  SpecInfer's law below the root's children.
- `trie_merge_tree`: SpecInfer's rule on the trie of the drafted token paths (tree_selftest.reference_tree
  with merge=True), as EAGLE's evaluate_posterior does for repeated siblings: lossless, not SpecInfer's law.
- `reversed_siblings_tree`: SpecInfer's rule trying siblings in reverse index order.
- `seed_reused_decoder`: a whole decoder (toy.speculative_sample) whose verifier is correct within a step but
  draws the same uniforms at every step; only check_generator sees it.
`lossless_self_test` runs them with the chain and tree mutants under law="lossless", and checks that the
per-test p-values of correct verifiers over repeated seeds are not below uniform (one-sided KS, at the tail
too), and the per-prefix test's exact null tail at the per-test threshold (tail_calibration).
"""
from __future__ import annotations

import functools
from typing import Callable, List, Tuple

import numpy as np
import torch

from ..rejection import ChainResult, verify_chain, verify_chain_block, verify_tree, verify_tree_traversal
from ..sampling import sample_from_probs, uniforms
from .check import check_rejection_sampler
from .selftest import MUTANTS, failure_reason, mutant, reference_chain
from .lossless import MIN_EXPECTED
from .stats import null_tail
from .tree_cases import POWER_SAMPLES, chain_cases, sequence_cases, shallow, standard_tree_cases
from .tree_check import check_tree_sampler
from .tree_selftest import DRAWN_WITHOUT, TREE_MUTANTS, reference_tree, reference_tree_without, tree_mutant


block_verify = verify_chain_block  # the self-test's name of the public rule (the CLI's --sampler path)
CALIBRATION = 2.0  # the per-prefix test's exact null tail at the per-test threshold stays below this x nominal


def block_product_rule(draft, p, q=None, *, lengths=None, generator=None) -> ChainResult:
    """The block-verification mutant (vLLM-Ascend's before its fix): tau = the last i with
    prod_{j<=i} min(1, p_j/q_j) >= prod_{j<=i} eta_j instead of Sun et al.'s eta_i < h_i (lossy for
    L >= 2; token-wise verification for L = 1), then block verification's final token. Draft (B, K)
    -1 padded, p (B, K+1, V), q (B, K, V) or None; eta (B, K+1) from one generator, the last for y."""
    B, K = draft.shape
    V = p.shape[-1]
    lengths = torch.full((B,), K, dtype=torch.long) if lengths is None else torch.as_tensor(lengths).long()  # (B,)
    rows = torch.arange(B)  # (B,)
    x = draft.clamp(min=0)  # (B, K)
    P = p.double()  # (B, K+1, V)
    Q = torch.nn.functional.one_hot(x, V).double() if q is None else q.double()  # (B, K, V)
    eta = uniforms((K + 1,), B, generator, p.device).double()  # (B, K+1): eta_1..eta_K, then the final draw
    w = torch.ones(B, dtype=torch.float64)  # (B,) p_0
    ws = [w]  # p_0..p_K
    tau = torch.zeros(B, dtype=torch.long)  # (B,)
    ratio_prod, eta_prod = torch.ones(B, dtype=torch.float64), torch.ones(B, dtype=torch.float64)
    for i in range(1, K + 1):
        px, qx = P[rows, i - 1, x[:, i - 1]], Q[rows, i - 1, x[:, i - 1]]  # (B,), (B,)
        ratio = torch.where(qx > 0, torch.clamp(px / qx.clamp(min=1e-300), max=1.0), torch.zeros_like(px))  # (B,)
        w = torch.where(qx > 0, torch.clamp(w * px / qx.clamp(min=1e-300), max=1.0), torch.zeros_like(w))  # (B,) p_i
        ws.append(w)
        ratio_prod, eta_prod = ratio_prod * ratio, eta_prod * eta[:, i - 1]
        tau = torch.where((i <= lengths) & (qx > 0) & (ratio_prod >= eta_prod), i, tau)
    wt = torch.stack(ws, 1)[rows, tau]  # (B,) p_tau
    p_t = P[rows, tau]  # (B, V)
    q_t = Q[rows, tau.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_t)  # (B, V)
    res = (wt[:, None] * p_t - q_t).clamp(min=0)  # (B, V)
    res = torch.where(res.sum(1, keepdim=True) > 0, res, p_t)  # (B, V)
    dist = torch.where((tau == lengths)[:, None], p_t, res)  # (B, V)
    y = sample_from_probs((dist / dist.sum(1, keepdim=True)).float(), eta[:, K].float())  # (B,)
    tokens = torch.full((B, K + 1), -1, dtype=torch.long)  # (B, K+1)
    tokens[:, :K] = torch.where(torch.arange(K)[None] < tau[:, None], draft, -1)
    tokens[rows, tau] = y
    return ChainResult(tokens, tau)


def drawn_cases(cases):
    """The cases whose siblings are drawn from a q (the top-k cases left out): traversal verification's."""
    return tuple(c for c in cases if c.variants[0].tokens is None)


TRAVERSAL = "specref.rejection.verify_tree_traversal"


def trie_merge_tree(tokens, parents, p, q=None, *, lengths=None, generator=None):
    """SpecInfer's rule on the trie of the token paths (reference_tree, merge=True)."""
    return reference_tree(tokens, parents, p, q, lengths=lengths, generator=generator, merge=True)


@functools.lru_cache(maxsize=256)
def _reversed_order(parents: Tuple[int, ...]) -> List[int]:
    """A topological order of the nodes with every node's children in reverse index order (old indices)."""
    order, frontier = [], [-1]
    while frontier:
        kids = [c for par in frontier for c in reversed(range(len(parents))) if parents[c] == par]
        order += kids
        frontier = kids
    return order


def reversed_siblings_tree(tokens, parents, p, q=None, *, lengths=None, generator=None):
    """SpecInfer's rule with siblings tried in reverse index order (nodes renumbered, path mapped back)."""
    B, N = tokens.shape
    lengths = torch.full((B,), N, dtype=torch.long) if lengths is None else torch.as_tensor(lengths).long()  # (B,)
    perm = torch.arange(N)[None].repeat(B, 1)  # (B, N) new index -> old index
    for b in range(B):
        n = int(lengths[b])
        perm[b, :n] = torch.tensor(_reversed_order(tuple(parents[b, :n].tolist())), dtype=torch.long)
    inv = torch.argsort(perm, 1)  # (B, N) old index -> new index
    par_old = parents.gather(1, perm)  # (B, N)
    par_new = torch.where(par_old >= 0, inv.gather(1, par_old.clamp(min=0)), -1)  # (B, N)
    p_new = torch.cat([p[:, :1], p[:, 1:].gather(1, perm[..., None].expand(-1, -1, p.shape[-1]))], 1)  # (B, N+1, V)
    q_new = None if q is None else q.gather(1, perm[..., None].expand(-1, -1, q.shape[-1]))  # (B, N, V)
    out = reference_tree(tokens.gather(1, perm), par_new, p_new, q_new, lengths=lengths, generator=generator)
    path = torch.where(out.path >= 0, perm.gather(1, out.path.clamp(min=0)), -1)  # (B, N)
    return type(out)(out.tokens, path, out.num_accepted)


def seed_reused_decoder(target, draft, k: int = 2, seed: int = 1234) -> Callable:
    """A whole decoder over toy LMs (check_generator convention) whose verifier is verify_chain with
    the same seed at every step: correct within a step, lossy across steps."""
    from .toy import speculative_sample

    def verify(d, p, q, *, lengths, generator):
        return verify_chain(d, p, q, lengths=lengths, generator=torch.Generator().manual_seed(seed))

    def fn(ids, L, gen):
        return speculative_sample(target, draft, ids[0], L, ids.shape[0], k, generator=gen, verify=verify)[0]
    return fn


def lossless_self_test(samples: int = 4000, seed: int = 0, ks_runs: int = 0, tree_cases=None,
                       power_samples: int = POWER_SAMPLES) -> Tuple[bool, List[str]]:
    """law="lossless": every correct verifier (whatever its law) must not FAIL, every mutant must FAIL;
    the power mutants (power_mutants.py, classes a-c) must not PASS; law="specinfer" / "tokenwise"
    must FAIL the trie merge, the reversed order and block verification. power_samples > 0: every
    correct verifier must PASS (not merely not FAIL) on the shallow cases (tree_cases.shallow, depth
    <= 1; the trie drafts: sequences of 2 at twice the rows) at power_samples rows per variant,
    where the honest power statement allows it.
    ks_runs > 0: per-test p-values of the correct references over ks_runs seeds uniform (ks_uniformity),
    and the per-prefix test's exact null tail at the per-test threshold (calibration).
    tree_cases: the cases of the iid / without tree runs (default standard_tree_cases())."""
    tc = dict(samples=samples, seed=seed, cases=tree_cases)
    from .power_mutants import POWER_MUTANTS, chain_mutant, tree_mutant as power_tree_mutant
    from .selftest import verdict_line

    chain_ok = [("specref.rejection.verify_chain", verify_chain), ("reference_chain", reference_chain),
                ("specref.rejection.verify_chain_block", verify_chain_block)]
    tree_ok = [("specref.rejection.verify_tree", verify_tree, "iid"), ("reference_tree", reference_tree, "iid"),
               ("reference_tree_without", reference_tree_without, "without"), ("trie_merge_tree", trie_merge_tree, "iid"),
               ("trie_merge_tree (trie drafts)", trie_merge_tree, "trie"),
               ("reversed_siblings_tree", reversed_siblings_tree, "iid")]
    runs = [(n, lambda f=f: check_rejection_sampler(f, samples=samples, seed=seed), True) for n, f in chain_ok]
    runs += [(m, lambda m=m: check_rejection_sampler(mutant(m), samples=samples, seed=seed), False) for m in MUTANTS]
    runs += [("block_product_rule", lambda: check_rejection_sampler(block_product_rule, samples=samples, seed=seed), False)]
    runs += [(n, lambda f=f, s=s: check_tree_sampler(f, siblings=s, **{**tc, "cases": None if s == "trie" else tree_cases}), True)
             for n, f, s in tree_ok]
    runs += [(m, lambda m=m: check_tree_sampler(tree_mutant(m), siblings="without" if m in DRAWN_WITHOUT else "iid", **tc),
              False) for m in TREE_MUTANTS]
    drawn = drawn_cases(standard_tree_cases() if tree_cases is None else tree_cases)  # traversal refuses top-k trees
    runs += [(TRAVERSAL, lambda: check_tree_sampler(verify_tree_traversal, siblings="without", **{**tc, "cases": drawn}), True)]
    stricter = [("block_verify (tokenwise law)", lambda: check_rejection_sampler(block_verify, law="tokenwise", samples=samples, seed=seed)),
                ("trie_merge_tree (specinfer law)", lambda: check_tree_sampler(trie_merge_tree, law="specinfer", **tc)),
                ("trie_merge_tree (specinfer law, trie drafts)",
                 lambda: check_tree_sampler(trie_merge_tree, law="specinfer", siblings="trie", samples=samples, seed=seed)),
                ("reversed_siblings_tree (specinfer law)", lambda: check_tree_sampler(reversed_siblings_tree, law="specinfer", **tc))]
    ok, lines = True, []
    for name, run, correct in runs + [(n, r, False) for n, r in stricter]:
        rep = run()
        good = (rep.verdict != "FAIL") if correct else (rep.verdict == "FAIL")
        ok &= good
        lines.append(verdict_line(name, rep.verdict != "FAIL", correct, f"{rep.verdict}, {rep.samples} samples; "
                                  f"{failure_reason(rep)}"))
    hiding = [(f"{m} (chain)", lambda m=m: check_rejection_sampler(chain_mutant(m), samples=samples, seed=seed))
              for m in POWER_MUTANTS]
    hiding += [(f"{m} (tree)", lambda m=m: check_tree_sampler(power_tree_mutant(m), **tc)) for m in POWER_MUTANTS]
    for name, run in hiding:  # lossy where the power is thin: FAIL or INCONCLUSIVE, never PASS
        rep = run()
        good = rep.verdict != "PASS"
        ok &= good
        lines.append(f"{'ok ' if good else 'BAD'} {name:32s} expected not PASS, got {rep.verdict}; {rep.samples} samples; "
                     f"detectable {rep.detectable_tv:.3f}; {failure_reason(rep)}")
    if power_samples:
        cs, ts = shallow(chain_cases(), 1), shallow(standard_tree_cases() if tree_cases is None else tree_cases, 1)
        powered = [(n, lambda f=f: check_rejection_sampler(f, samples=power_samples, seed=seed, cases=cs)) for n, f in chain_ok]
        powered += [(n, lambda f=f, s=s: check_tree_sampler(f, siblings=s, samples=power_samples, seed=seed, cases=ts))
                    for n, f, s in tree_ok if s != "trie"]
        powered += [(n, lambda f=f: check_tree_sampler(f, siblings="trie", samples=2 * power_samples, seed=seed,
                                                       cases=shallow(sequence_cases(), 2)))  # sequences of 2
                    for n, f, s in tree_ok if s == "trie"]
        powered += [(TRAVERSAL, lambda: check_tree_sampler(verify_tree_traversal, siblings="without", samples=power_samples,
                                                           seed=seed, cases=drawn_cases(ts)))]
        for name, run in powered:  # correct, with the power: PASS
            rep = run()
            good = rep.verdict == "PASS"
            ok &= good
            lines.append(f"{'ok ' if good else 'BAD'} {name + ' (powered)':32s} expected PASS, got {rep.verdict}; "
                         f"{rep.samples} samples, detectable {rep.detectable_tv:.3f}; {failure_reason(rep)}")
    if ks_runs:
        good, line = ks_uniformity(ks_runs, samples, seed + 1000)
        ok &= good
        lines.append(line)
        good, line = tail_calibration()
        ok &= good
        lines.append(line)
    lines.append(f"lossless self-test: {'PASS' if ok else 'FAIL'}")
    return ok, lines


def ks_uniformity(runs: int, samples: int, seed: int) -> Tuple[bool, str]:
    """Every lossless-mode test p-value (dof > 0) of reference_tree and reference_chain over `runs` seeds:
    never smaller than uniform (one-sided KS: no excess of small p-values anywhere), and the shares
    below 0.05 and 0.01 within the binomial rate (the tail the verdict uses). One-sided: the exact
    per-prefix tests (binomial, discrete) make the summed test conservative, p-values above uniform."""
    from scipy import stats

    pv = []
    for r in range(runs):
        for rep in (check_tree_sampler(reference_tree, samples=samples, seed=seed + r, early_stop=False),
                    check_rejection_sampler(reference_chain, samples=samples, seed=seed + r, early_stop=False)):
            pv += [t.p_value for t in rep.tests if t.dof > 0]
    p_ks = stats.kstest(pv, "uniform", alternative="greater").pvalue  # H1: the p-values' CDF above uniform's
    lows = [(a, sum(p < a for p in pv)) for a in (0.05, 0.01)]
    p_tail = min(stats.binomtest(k, len(pv), a, alternative="greater").pvalue for a, k in lows)
    good = p_ks > 1e-3 and p_tail > 1e-3
    return good, (f"{'ok ' if good else 'BAD'} lossless p-values of the references over {runs} seeds: one-sided KS p "
                  f"{p_ks:.3g} over {len(pv)}; {lows[0][1]} below 0.05, {lows[1][1]} below 0.01 (binomial p {p_tail:.3g})")


def tail_calibration(thresholds=(2e-5, 7.5e-6), sizes=(10, 25, 40, 60, 200, 1000)) -> Tuple[bool, str]:
    """The per-prefix test (stats.gof_test) at the per-test thresholds of the chain and tree checks:
    its exact null tail (stats.null_tail, every grouped outcome enumerated) on the skewed tables the
    cases produce (a near one-hot p, a dominant cell over small ones, a filtered p) at every size
    from MIN_ROWS up, at most CALIBRATION x nominal."""
    tables = [np.array(t) for t in ([0.997, 0.001, 0.001, 0.001], [0.996, 0.001, 0.001, 0.001, 0.001],
                                    [0.9, 0.05, 0.05], [0.98, 0.01, 0.01], [0.8, 0.15, 0.05], [0.6, 0.3, 0.1],
                                    [0.5, 0.25, 0.25], [0.4, 0.3, 0.3])]
    worst = (0.0, None)
    for p in tables:
        for n in sizes:
            for thr in thresholds:
                try:
                    r = null_tail(p, n, thr, min_expected=MIN_EXPECTED) / thr
                except ValueError:  # more than three groups at this size: not enumerated
                    continue
                worst = max(worst, (r, (p.tolist(), n, thr)), key=lambda w: w[0])
    good = worst[0] <= CALIBRATION
    return good, (f"{'ok ' if good else 'BAD'} exact null tail of the per-prefix test at the per-test threshold: "
                  f"at most {worst[0]:.2f}x nominal (worst p {worst[1][0]}, n {worst[1][1]}, threshold {worst[1][2]:g}; "
                  f"bound {CALIBRATION:g}x)")
