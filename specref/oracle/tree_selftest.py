"""Known-wrong tree verifiers the tree oracle must reject, and references in every convention.

`reference_tree` is SpecInfer's multi-step speculative sampling (Miao et al. 2024), one loop over
the nodes in index order, vectorised over rows, with i.i.d. (replacement=True) or Sequoia's
without-replacement siblings (Chen et al. 2024: q loses each rejected token, renormalised), and
switchable mistakes (TREE_MUTANTS), each a bug seen in the wild or a plausible slip. Greedy mutants
(GREEDY_MUTANTS) wrap specref's verify_tree_greedy. `tree_self_test` runs them all: every mutant
must fail, every correct verifier pass, and the false-alarm rate of the reference at alpha 0.2
must be consistent with alpha over repeated seeds.

Left out: mutants of the eagle/plain adapters themselves (they share the checked core).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..rejection import TreeResult, verify_tree, verify_tree_greedy
from ..sampling import sample_from_probs, uniforms
from .selftest import failure_reason, false_alarm_verdict, verdict_line
from .tree_cases import POWER_SAMPLES, shallow, standard_tree_cases
from .tree_check import check_tree_sampler
from .tree_greedy import check_greedy_verifier

TREE_MUTANTS = {  # name: the mistake
    "no_renorm": "siblings not renormalised after a rejection: the next is tested against the residual's old total",
    "residual_from_p": "on a rejection the residual is taken from p at the node, not from the running residual",
    "q_for_deterministic": "deterministic siblings verified as if sampled from a q (a uniform placeholder)",
    "iid_as_without": "i.i.d. siblings verified as if drawn without replacement (q loses each rejected token)",
    "bonus_wrong_node": "the bonus after a leaf drawn from p one row off (p[i] instead of p[1 + i])",
    "final_from_p": "after every child is rejected, the final token drawn from p at the node, not the residual",
    "without_as_iid": "siblings drawn without replacement verified as i.i.d. (checked with siblings='without')",
    "uniform_per_depth": "one uniform reused across the siblings of a node (indexed by depth, not by node)",
    "uniform_across_rows": "one row's uniforms reused by every row of the batch",
    "test_after_accept": "siblings still tested after one is accepted (a later accepted sibling replaces it)",
    "ignore_lengths": "lengths ignored: padding nodes (token -1, parent -1) verified as children of the root",
    "interior_row_off": "after accepting an interior node, its children verified against p one row off (p[i])",
}
DRAWN_WITHOUT = ("without_as_iid",)  # mutants the self-test runs on siblings drawn without replacement
GREEDY_MUTANTS = {
    "greedy_first_match": "follows the first matching child only (misses a deeper path under a repeated sibling)",
    "greedy_bonus_at_parent": "the final token is the argmax at the parent of the path's last node",
}


def reference_tree(tokens, parents, p, q=None, *, lengths=None, generator=None, replacement: bool = True,
                   mistake: Optional[str] = None, merge: bool = False) -> TreeResult:
    """Tree verification of B ragged rows: tokens/parents (B, N), p (B, N+1, V), q (B, N, V) or None.
    merge=True: a trie merge (EAGLE's evaluate_posterior): the children of an accepted node are the
    children of every node with its token path, tried in index order (lossless, not SpecInfer's law)."""
    if mistake is not None and mistake not in TREE_MUTANTS:
        raise ValueError(f"mistake must be one of {sorted(TREE_MUTANTS)} or None, got {mistake!r}")
    B, N = tokens.shape
    V = p.shape[-1]
    lengths = (tokens >= 0).long().cumprod(1).sum(1) if lengths is None else torch.as_tensor(lengths).long()  # (B,)
    valid = torch.arange(N)[None] < lengths[:, None]  # (B, N)
    if mistake == "ignore_lengths":
        valid, lengths = torch.ones_like(valid), torch.full_like(lengths, N)
    u = uniforms((N + 1,), B, generator, p.device).double()  # (B, N+1)
    if mistake == "uniform_across_rows":
        u = u[:1].expand(B, N + 1)  # (B, N+1)
    has_kids = (valid[:, None, :] & (parents[:, None, :] == torch.arange(N)[None, :, None])).any(2)  # (B, N)
    sib = torch.full((B,), -2, dtype=torch.long)  # (B,) test_after_accept: the node whose children are still tried
    key = torch.zeros(B, N + 1, dtype=torch.long)  # (B, 1+N) merge: the token path's key of the root and each node
    for i in range(N):
        key[:, 1 + i] = key.gather(1, 1 + parents[:, i:i + 1])[:, 0] * (V + 1) + 1 + tokens[:, i].clamp(min=0)
    rows = torch.arange(B)  # (B,)
    P = p.double()
    cur = torch.full((B,), -1, dtype=torch.long)  # (B,) current node, -1 the root
    r, mass = P[:, 0].clone(), torch.ones(B, dtype=torch.float64)  # (B, V) residual, unnormalised, its total
    qcur, fresh = torch.zeros(B, V, dtype=torch.float64), torch.ones(B, dtype=torch.bool)  # without replacement
    r_sib, m_sib = r, mass  # test_after_accept: the residual of `sib`
    path = torch.full((B, N), -1, dtype=torch.long)  # (B, N)
    n_acc = torch.zeros(B, dtype=torch.long)  # (B,)
    for i in range(N):  # nodes in index order: siblings in order, children after their parent
        if mistake == "test_after_accept":  # a later sibling of the accepted node: back to their parent's residual
            late = valid[:, i] & (parents[:, i] == sib) & (parents[:, i] != cur)  # (B,)
            saved = (r, mass, cur, n_acc)
            r, mass = torch.where(late[:, None], r_sib, r), torch.where(late, m_sib, mass)
            cur, n_acc = torch.where(late, sib, cur), n_acc - late.long()
        r_before, m_before, par_before = r, mass, cur
        ui = u[rows, n_acc] if mistake == "uniform_per_depth" else u[:, i]  # (B,)
        cand = valid[:, i] & (parents[:, i] == cur)  # (B,)
        if merge:  # a child of any node with the current node's token path
            cand = valid[:, i] & (key.gather(1, 1 + parents[:, i:i + 1])[:, 0] == key[rows, 1 + cur])
        x = tokens[:, i].clamp(min=0)  # (B,)
        rx = r[rows, x]  # (B,)
        p_node = P[rows, 1 + cur]  # (B, V) fresh p at the current node
        if q is None and mistake != "q_for_deterministic":  # q one-hot: accept with r(x) / mass
            accept = cand & (ui * mass < rx)
            base = p_node if mistake == "residual_from_p" else r
            nxt = base.scatter(1, x[:, None], 0.0)  # (B, V)
        else:
            qi = torch.full((B, V), 1.0 / V, dtype=torch.float64) if q is None else q[:, i].double()  # (B, V)
            if not replacement or mistake == "iid_as_without":
                qi = torch.where(fresh[:, None], qi, qcur)  # (B, V) q without the rejected siblings' tokens
            qx = qi[rows, x]  # (B,)
            accept = cand & (qx > 0) & (ui * qx * mass < rx)
            if mistake == "residual_from_p":
                nxt = (p_node - qi).clamp(min=0)  # (B, V)
            else:
                nxt = (r - mass[:, None] * qi).clamp(min=0)  # (B, V) mass * max(0, r/mass - q)
            q_wo = qi.scatter(1, x[:, None], 0.0)  # (B, V)
            q_wo = q_wo / q_wo.sum(1, keepdim=True).clamp(min=1e-300)
            rej = cand & ~accept
            qcur = torch.where(rej[:, None], q_wo, qcur)
            fresh = fresh & ~rej
        nm = nxt.sum(1)  # (B,)
        upd = cand & ~accept & (nm > 0)  # an empty residual keeps r (a rejection of probability 0)
        r = torch.where(upd[:, None], nxt, r)
        if mistake != "no_renorm":
            mass = torch.where(upd, nm, mass)
        path[rows, n_acc.clamp(max=max(N - 1, 0))] = torch.where(accept, i, path[rows, n_acc.clamp(max=max(N - 1, 0))])
        n_acc += accept.long()
        cur = torch.where(accept, i, cur)
        row_at = 1 + cur - (has_kids[:, i] & (mistake == "interior_row_off")).long()  # (B,)
        r = torch.where(accept[:, None], P[rows, row_at], r)
        mass = torch.where(accept, torch.ones_like(mass), mass)
        fresh = fresh | accept
        if mistake == "test_after_accept":
            back = late & ~accept  # a late sibling rejected: keep the parent's new residual, restore the path
            r_sib, m_sib = torch.where(back[:, None], r, r_sib), torch.where(back, mass, m_sib)
            r, mass = torch.where(back[:, None], saved[0], r), torch.where(back, saved[1], mass)
            cur, n_acc = torch.where(back, saved[2], cur), torch.where(back, saved[3], n_acc)
            first = accept & ~late  # an ordinary acceptance: its later siblings will be tried too
            sib = torch.where(first, par_before, sib)
            r_sib, m_sib = torch.where(first[:, None], r_before, r_sib), torch.where(first, m_before, m_sib)
    leaf = ~(valid & (parents == cur[:, None])).any(1)  # (B,) the current node has no children
    if mistake == "final_from_p":
        r = P[rows, 1 + cur]
    if mistake == "bonus_wrong_node":
        r = torch.where((leaf & (cur >= 0))[:, None], P[rows, cur.clamp(min=0)], r)
    last = sample_from_probs(r.float(), u[rows, lengths].float())  # (B,)
    if merge:  # the accepted nodes may hang under different copies of a path: report the end node's own ancestors
        node = path[rows, (n_acc - 1).clamp(min=0)]  # (B,)
        for j in range(N - 1, -1, -1):
            at = j < n_acc  # (B,)
            path[:, j] = torch.where(at, node, path[:, j])
            node = torch.where(at, parents[rows, node.clamp(min=0)], node)
    out = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1) if N else path  # (B, N)
    out = torch.cat([out, torch.full((B, 1), -1, dtype=torch.long)], 1)  # (B, N+1)
    out.scatter_(1, n_acc[:, None], last[:, None])
    return TreeResult(out, path, n_acc)


def tree_mutant(name: str) -> Callable:
    """reference_tree with one mistake, in the specref convention."""
    def fn(tokens, parents, p, q, *, lengths=None, generator=None):
        return reference_tree(tokens, parents, p, q, lengths=lengths, generator=generator, mistake=name)
    fn.__name__ = f"tree_mutant_{name}"
    return fn


def reference_tree_without(tokens, parents, p, q, *, lengths=None, generator=None):
    """reference_tree for siblings drawn without replacement (check with siblings="without")."""
    return reference_tree(tokens, parents, p, q, lengths=lengths, generator=generator, replacement=False)


def reference_tree_plain(tokens, parents, p, q, generator, mistake: Optional[str] = None):
    """reference_tree on one row, in the plain convention: -> (path, last)."""
    out = reference_tree(tokens[None], parents[None], p[None], None if q is None else q[None], generator=generator,
                         mistake=mistake)
    m = int(out.num_accepted[0])
    return out.path[0, :m], int(out.tokens[0, m])


def reference_tree_eagle(candidates, retrieve_indices, logits, draft_probs, generator, mistake: Optional[str] = None):
    """reference_tree in the retrieve-indices convention: rebuilds (tokens, parents, p, q) from the
    layout, verifies, and names the first row holding the accepted path."""
    P, W = retrieve_indices.shape
    n = int(retrieve_indices.max())
    tokens, parents = torch.full((n,), -1, dtype=torch.long), torch.full((n,), -1, dtype=torch.long)
    p = torch.zeros(n + 1, logits.shape[-1])  # (n+1, V)
    q = None if draft_probs is None else torch.zeros(n, logits.shape[-1])  # (n, V)
    for row in range(P):
        for j in range(W):
            f = int(retrieve_indices[row, j])
            if f < 0:
                break
            p[f] = torch.softmax(logits[row, j].float(), -1)
            if j:
                tokens[f - 1], parents[f - 1] = candidates[row, j], int(retrieve_indices[row, j - 1]) - 1
                if q is not None:
                    q[f - 1] = draft_probs[row, j]
    path, last = reference_tree_plain(tokens, parents, p, q, generator, mistake)
    want = [0] + [1 + int(i) for i in path]
    best = next(r for r in range(P) if retrieve_indices[r, : len(want)].tolist() == want)
    return best, len(path), last


def greedy_mutant(name: str) -> Callable:
    """verify_tree_greedy with one mistake (GREEDY_MUTANTS), in the specref convention."""
    def fn(tokens, parents, logits, *, lengths=None):
        out = verify_tree_greedy(tokens, parents, logits, lengths=lengths)
        a = logits.argmax(-1)  # (B, N+1)
        B, N = tokens.shape
        toks, path, m = out.tokens.clone(), out.path.clone(), out.num_accepted.clone()
        for b in range(B):
            if name == "greedy_first_match":  # walk down, taking the first child that matches
                cur, pt = -1, []
                while True:
                    kids = [i for i in range(int(lengths[b])) if int(parents[b, i]) == cur and int(tokens[b, i]) == int(a[b, cur + 1])]
                    if not kids:
                        break
                    cur = kids[0]
                    pt.append(cur)
                m[b] = len(pt)
                path[b] = -1
                toks[b] = -1
                path[b, : len(pt)] = torch.tensor(pt, dtype=torch.long)
                toks[b, : len(pt)] = tokens[b, pt]
                toks[b, len(pt)] = a[b, cur + 1]
            elif int(m[b]) > 0:  # greedy_bonus_at_parent
                end = int(path[b, int(m[b]) - 1])
                toks[b, int(m[b])] = a[b, int(parents[b, end]) + 1]
        return TreeResult(toks, path, m)
    fn.__name__ = name
    return fn


def false_alarms_tree(fn: Callable, *, runs: int = 20, samples: int = 400, alpha: float = 0.2, seed: int = 1000,
                      cases=None) -> Tuple[int, List[float]]:
    """Failures of `runs` independent checks of a correct verifier (expected <= alpha * runs) and the
    p-values of every variant's first-token test (i.i.d. uniform under the null, up to discreteness)."""
    fails, first = 0, []
    for r in range(runs):
        rep = check_tree_sampler(fn, law="specinfer", samples=samples, alpha=alpha, seed=seed + r, early_stop=False,
                                 cases=cases)
        fails += rep.verdict == "FAIL"
        first += [t.p_value for t in rep.tests if t.name.endswith(" first") and t.dof > 0]
    return fails, first


def tree_self_test(samples: int = 4000, seed: int = 0, false_alarm_runs: int = 20,
                   power_samples: int = POWER_SAMPLES) -> Tuple[bool, List[str]]:
    """Under SpecInfer's law: every tree and greedy mutant must FAIL, no correct verifier FAIL, and
    (power_samples > 0) the batched correct verifiers PASS on the depth-1 small cases at power_samples
    rows per variant; then the false-alarm rate. The lossless law: lossless_selftest.lossless_self_test."""
    small = tuple(c for c in standard_tree_cases() if c.vocab <= 6)
    runs = [("specref.rejection.verify_tree", verify_tree, "specref", "iid", samples, None),
            ("reference_tree", reference_tree, "specref", "iid", samples, None),
            ("reference_tree_without", reference_tree_without, "specref", "without", samples, None),
            ("reference_tree_plain", reference_tree_plain, "plain", "iid", max(8, samples // 20), small),
            ("reference_tree_eagle", reference_tree_eagle, "eagle", "iid", max(8, samples // 40), small)]
    runs += [(m, tree_mutant(m), "specref", "without" if m in DRAWN_WITHOUT else "iid", samples, None) for m in TREE_MUTANTS]
    ok, lines = True, []
    for name, fn, api, sib, n, cases in runs:
        rep = check_tree_sampler(fn, api=api, siblings=sib, law="specinfer", samples=n, seed=seed, cases=cases)
        expect = name not in TREE_MUTANTS
        ok &= (rep.verdict != "FAIL") == expect
        lines.append(verdict_line(name, rep.verdict != "FAIL", expect, f"{rep.verdict}, {rep.samples} samples; "
                                  f"{failure_reason(rep)}"))
    for name, fn in [("specref.rejection.verify_tree_greedy", verify_tree_greedy)] + [(m, greedy_mutant(m)) for m in GREEDY_MUTANTS]:
        rep = check_greedy_verifier(fn, samples=max(8, samples // 10), seed=seed)
        expect = name not in GREEDY_MUTANTS
        ok &= rep.passed == expect
        lines.append(verdict_line(name, rep.passed, expect,
                                  f"{rep.samples} rows; {rep.errors[0] if rep.errors else 'exact'}"))
    powered = (("specref.rejection.verify_tree", verify_tree, "iid"), ("reference_tree", reference_tree, "iid"),
               ("reference_tree_without", reference_tree_without, "without")) if power_samples else ()
    for name, fn, sib in powered:  # with the power: PASS
        rep = check_tree_sampler(fn, siblings=sib, law="specinfer", samples=power_samples, seed=seed,
                                 cases=shallow(small, 1))
        good = rep.verdict == "PASS"
        ok &= good
        lines.append(f"{'ok ' if good else 'BAD'} {name + ' (powered)':32s} expected PASS, got {rep.verdict}; "
                     f"{rep.samples} samples, detectable {rep.detectable_tv:.3f}; {failure_reason(rep)}")
    if false_alarm_runs:
        fails, first = false_alarms_tree(reference_tree, runs=false_alarm_runs, seed=seed + 1000, cases=small)
        good, line = false_alarm_verdict("reference_tree", fails, false_alarm_runs, 0.2, first, "first-token")
        ok &= good
        lines.append(line)
    lines.append(f"tree self-test: {'PASS' if ok else 'FAIL'}")
    return ok, lines


# module-level names for the CLI: --sampler specref.oracle.tree_selftest:tree_mutant_no_renorm
for _name in TREE_MUTANTS:
    globals()[f"tree_mutant_{_name}"] = tree_mutant(_name)
