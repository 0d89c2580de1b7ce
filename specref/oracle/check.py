"""The oracle for other implementations: is a rejection sampler lossless? Answered with p-values.

Leviathan et al. 2023 (Algorithm 1, Theorem 3.5) and Chen et al. 2023: given drafts x_j ~ q_j, accept
x_j with probability min(1, p_j(x)/q_j(x)), on the first rejection emit a token from
norm(max(0, p_j - q_j)), after L accepted drafts emit a bonus token from p_{L+1}. With p and q fixed
per position (as here) the result has an exact closed form, tested with chi-square (stats.py):
- pos j: the token emitted at position j, over rows that reached j, is distributed as p_j;
- bonus: the token after all L drafts were accepted is distributed as p_{L+1};
- residual j: the token emitted after rejecting at j is norm(max(0, p_j - q_j));
- length: P(a accepted) = prod_{i<a} alpha_i (1 - alpha_a), alpha_i = sum_x min(p_i, q_i) (a < L);
- joint: (a, y_1..y_m), m = min(a+1, J), P = prod_{i<m} min(p_i, q_i)(y_i) x [last factor].
A deterministic draft (q = None) is q one-hot on the draft token. Rows are independent copies of a
few "variants" (p, q, length) interleaved in one batch, so cross-row leaks also show. Tests are
Bonferroni-corrected; two looks (1/8 of the samples, then all) at alpha/2 each stop a clear failure
early. Plus structural checks: accepted tokens equal the drafts, -1 padding, counts in range.

A sampler's malformed output (None, a wrong shape or count, an exception) fails the check with a
structural error naming the case; it never crashes the check. per_row_generators=True passes one
torch.Generator per row (a list; the plain convention gets row b's) instead of one for the batch.

Left out: whole decoders (check_generator: a whole decoder is not a verifier), typical acceptance. Trees:
tree_check.py. The standard cases live in cases.py, the mutants and the worked transformers example
in selftest.py, the command line in cli.py.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .adapters import APIS, Malformed, adapt, chain_as_tree, check_args  # noqa: F401 (adapt, APIS re-exported)
from .cases import Case, Variant, standard_cases
from .report import VERDICTS, Report, TestResult, check_bound, decide, needed, run_looks  # noqa: F401 (re-exported)
from .stats import chi_square_gof, detectable_tv, joint_index, tv_distance

CHAIN_LAWS = ("lossless", "tokenwise")


# ---------------------------------------------------------------- exact distributions of one variant
def _exact(v: Variant, vocab: int):
    """float64 p rows (L+1, V), effective q (L, V), min(p, q) (L, V), alphas (L,), P(length) (L+1,)."""
    L = v.length
    p = v.p[: L + 1].double().cpu().numpy()  # (L+1, V)
    p = p / p.sum(1, keepdims=True)
    if v.q is None:
        q = np.eye(vocab)[v.drafts[:L].cpu().numpy()]  # (L, V) one-hot
    else:
        q = v.q[:L].double().cpu().numpy()  # (L, V)
        q = q / q.sum(1, keepdims=True)
    m = np.minimum(p[:L], q)  # (L, V)
    alpha = m.sum(1)  # (L,)
    reach = np.concatenate([[1.0], np.cumprod(alpha)])  # (L+1,) P(a >= j)
    stop = np.concatenate([1.0 - alpha, [1.0]])  # (L+1,)
    return p, q, m, alpha, reach * stop


def _joint(p, q, m, alpha, L, vocab, max_cells):
    """Exact probabilities of the joint cells (a, y_1..y_m) and the per-a offsets and widths m."""
    J = max(1, min(L + 1, int(math.floor(math.log(max_cells) / math.log(max(vocab, 2))))))
    probs, widths = [], []
    for a in range(L + 1):  # at most K+1 blocks
        w = min(a + 1, J)
        if a + 1 <= J:
            last = np.maximum(p[a] - q[a], 0.0) if a < L else p[L]  # (V,)
            factors = [m[i] for i in range(a)] + [last]
            scale = 1.0
        else:
            factors = [m[i] for i in range(J)]
            scale = float(np.prod(alpha[J:a])) * ((1.0 - alpha[a]) if a < L else 1.0)
        block = np.ones(1)
        for f in factors:
            block = np.outer(block, f).reshape(-1)  # (V^i,)
        probs.append(block * scale)
        widths.append(w)
    probs = np.concatenate(probs)  # (cells,)
    assert abs(probs.sum() - 1.0) < 1e-8, probs.sum()
    offsets = np.cumsum([0] + [vocab**w for w in widths])[:-1]
    return probs, offsets, widths


def _num_tests(v: Variant) -> int:
    L = v.length
    return 1 if L == 0 else (L + 1) + L + 2  # positions + residuals + length + joint


def _analyse(case: Case, vi: int, toks: np.ndarray, acc: np.ndarray, drafts: np.ndarray,
             threshold: float, max_cells: int):
    """Structural errors and chi-square tests of one variant's rows."""
    v, V, name = case.variants[vi], case.vocab, f"{case.name}/{case.variants[vi].label}"
    L, n = v.length, toks.shape[0]
    errors, tests = [], []
    pos = np.arange(toks.shape[1])  # (K+1,)
    a = acc.astype(np.int64)  # (n,)
    bad = (a < 0) | (a > L)  # (n,)
    ac = np.clip(a, 0, L)  # (n,)
    y_last = toks[np.arange(n), ac]  # (n,)
    wrong_prefix = ((pos[None, :-1] < ac[:, None]) & (toks[:, :-1] != drafts)).any(1)  # (n,)
    wrong_pad = ((pos[None] > ac[:, None]) & (toks != -1)).any(1)  # (n,)
    out_range = (y_last < 0) | (y_last >= V)  # (n,)
    for mask, what in ((bad, f"num_accepted outside [0, {L}]"), (wrong_prefix, "accepted tokens differ from the drafts"),
                       (wrong_pad, "tokens after the emitted ones are not -1"), (out_range, f"emitted token not in [0, {V})")):
        if mask.any():
            r = int(np.flatnonzero(mask)[0])
            errors.append(f"{name}: {int(mask.sum())}/{n} rows: {what} (e.g. num_accepted {int(a[r])}, tokens {toks[r].tolist()})")
    ok = ~(bad | wrong_prefix | wrong_pad | out_range)  # (n,)
    toks, a = toks[ok], a[ok]
    p, q, m, alpha, plen = _exact(v, V)

    def test(label, obs_idx, probs, cell_name):
        if obs_idx.size == 0:
            return
        obs = np.bincount(obs_idx, minlength=probs.size).astype(np.float64)  # (cells,)
        probs = probs / probs.sum()
        g = chi_square_gof(obs, probs)
        worst = tuple((cell_name(c.index), c.expected, c.observed) for c in g.worst_cells)
        det = detectable_tv(g.n, max(2, g.num_cells_used), alpha=threshold, power=0.95)
        tests.append(TestResult(f"{name} {label}", label.split()[0], g.p_value, g.statistic, g.dof, g.n,
                                tv_distance(obs, probs), det, worst))

    for j in range(L + 1):  # pos j (j = L: the bonus)
        label = "bonus" if j == L else f"pos {j + 1}"
        test(label, toks[a >= j, j], p[j], lambda c: f"token {c}")
        if j < L and 1.0 - alpha[j] > 1e-12:
            test(f"residual {j + 1}", toks[a == j, j], np.maximum(p[j] - q[j], 0.0), lambda c: f"token {c}")
    if L > 0:
        test("length", a, plen, lambda c: f"accepted {c}")
        jp, offsets, widths = _joint(p, q, m, alpha, L, V, max_cells)
        idx = np.empty(a.size, dtype=np.int64)  # (n,)
        for aa in range(L + 1):
            sel = a == aa
            idx[sel] = offsets[aa] + joint_index(toks[sel, : widths[aa]], V)

        def joint_name(c):
            aa = int(np.searchsorted(offsets, c, side="right") - 1)
            digits = np.unravel_index(c - offsets[aa], (V,) * widths[aa])
            return f"accepted {aa}, tokens {tuple(int(d) for d in digits)}"
        test("joint", idx, jp, joint_name)
    return errors, tests


# ---------------------------------------------------------------- driving the sampler
def _draw_rows(case: Case, start: int, stop: int, gen: torch.Generator, device):
    """Rows start..stop of the case: variant (b % n_variants), its p, q, length and drafts ~ q."""
    vid = torch.arange(start, stop) % len(case.variants)  # (B,)
    P = torch.stack([v.p for v in case.variants])[vid]  # (B, K+1, V)
    lengths = torch.tensor([v.length for v in case.variants])[vid]  # (B,)
    valid = torch.arange(case.k)[None] < lengths[:, None]  # (B, K)
    if case.variants[0].q is None:
        Q = None
        draft = torch.stack([v.drafts for v in case.variants])[vid]  # (B, K)
    else:
        Q = torch.stack([v.q for v in case.variants])[vid]  # (B, K, V)
        cdf = Q.double().cumsum(-1)  # (B, K, V)
        u = torch.rand(cdf.shape[:-1] + (1,), generator=gen, dtype=torch.float64) * cdf[..., -1:]  # (B, K, 1)
        draft = torch.searchsorted(cdf, u, right=True)[..., 0].clamp(max=case.vocab - 1)  # (B, K)
    draft = torch.where(valid, draft, torch.full_like(draft, -1))  # (B, K)
    to = lambda t: None if t is None else t.to(device)
    return vid.numpy(), to(draft), to(P), to(Q), to(lengths)


def check_rejection_sampler(fn: Callable, *, api: str = "specref", cases: Optional[Sequence[Case]] = None,
                            law: str = "lossless", samples: int = 50_000, alpha: float = 1e-3, seed: int = 0,
                            early_stop: bool = True, max_joint_cells: int = 4096, per_row_generators: bool = False,
                            tv_bound: float = 0.05, device="cpu") -> Report:
    """Run `fn` (see `adapt` for the calling conventions) on `samples` rows per variant of each case
    and test its output. law "lossless" (lossless.py; default cases tree_cases.chain_cases(), chains
    whose p depends on the drafted prefix): the emitted tokens follow p prefix by prefix, so any
    lossless rule passes (block verification too); law "tokenwise" (default cases
    cases.standard_cases(), p fixed per position): the exact law of token-wise verification
    (Leviathan et al.), a stricter question. Verdict PASS / FAIL / INCONCLUSIVE (no failure, but
    the run's detectable TV is above tv_bound)."""
    if law not in CHAIN_LAWS:
        raise ValueError(f"law must be one of {CHAIN_LAWS}, got {law!r}")
    check_args(samples, seed, alpha)
    check_bound(tv_bound)
    if law == "lossless":
        from .tree_cases import TreeCase, chain_cases
        from .tree_check import run_tree_check

        cases = chain_cases() if cases is None else tuple(cases)
        for c in cases:
            if not isinstance(c, TreeCase) or any(v.parents != tuple(range(-1, v.n - 1)) for v in c.variants):
                raise ValueError(f"law='lossless' takes chain-shaped TreeCases (tree_cases.chain_cases), got {c!r:.60}")
        return run_tree_check(chain_as_tree(adapt(fn, api)), cases, "iid", "lossless", samples, alpha, seed,
                              early_stop, max_joint_cells, per_row_generators, tv_bound, device, "sampler")
    check_args(samples, seed, alpha)
    call = adapt(fn, api)
    if cases is None:
        cases = standard_cases()
    looks = [max(1, samples // 8), samples] if early_stop else [samples]
    m = sum(_num_tests(v) for c in cases for v in c.variants)
    threshold = alpha / len(looks) / m

    def draw(ci, case, start, stop):
        s0, s1 = np.random.SeedSequence([seed, ci, start]).generate_state(2)
        gen = torch.Generator().manual_seed(int(s0))
        _, draft, P, Q, lengths = _draw_rows(case, start, stop, gen, device)
        if per_row_generators:  # one generator per row, seeded independently
            gen = [torch.Generator().manual_seed(int(s)) for s in
                   np.random.SeedSequence([seed, ci, start, 1]).generate_state(stop - start)]
        return draft, P, Q, lengths, gen, int(s1), stop - start

    def run(case, drawn):
        draft, P, Q, lengths, gen, s1, n = drawn
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(s1)  # for samplers that use the global CPU RNG
            toks, acc = call(draft, P, Q, lengths, gen)
        if toks.shape != (n, case.k + 1) or acc.shape != (n,):
            raise Malformed(f"tokens of shape {tuple(toks.shape)} and num_accepted of shape {tuple(acc.shape)}, "
                            f"expected {(n, case.k + 1)} and {(n,)}")
        return toks.numpy(), acc.numpy(), draft.cpu().numpy()

    def analyse(ci, case, chunks, thr):
        T, A, D = (np.concatenate(s) for s in zip(*chunks))
        vid = np.arange(T.shape[0]) % len(case.variants)  # (rows * nv,)
        errors, tests, firsts = [], [], []
        for vi in range(len(case.variants)):
            e, t = _analyse(case, vi, T[vid == vi], A[vid == vi], D[vid == vi], thr, max_joint_cells)
            errors += e
            tests += t
            firsts += [t[0].detectable_tv] if t else []  # pos 1 (or the bonus when L = 0)
        return errors, tests, firsts, T.shape[0]

    chunk = lambda case: max(len(case.variants), (2**22 // ((case.k + 1) * case.vocab))  # noqa: E731
                             // len(case.variants) * len(case.variants))
    return run_looks(cases, looks, alpha, threshold, chunk, draw, run, analyse, "sampler", tv_bound, "tokenwise",
                     "topk+iid")
