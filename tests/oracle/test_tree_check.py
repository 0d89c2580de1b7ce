"""Tests of the tree oracle (specref/oracle/tree_*.py) and the greedy tree oracle.

Power (family-wise alpha 1e-3 over 2 looks and ~190 tests: per-test ~2.6e-6; noncentral
chi-square, oracle.detectable_tv): at 3,000 rows per variant the first-token test of every variant
detects a TV deviation of 0.07 with 95% power (the worst variant); the mutants deviate
by TV 0.1-0.6 on some test and are caught at the first look (1/8 of the rows), see
test_tree_self_test_rejects_every_mutant. The false-alarm test measures the rate at alpha 0.2.
"""
import numpy as np
import pytest
import torch
from scipy import stats

import specref
from specref.oracle.cli import oracle_main
from specref.oracle.tree_adapters import retrieve_layout
from specref.oracle.tree_cases import depths, standard_tree_cases
from specref.oracle.tree_check import check_tree_sampler as _check
from specref.oracle.tree_exact import exact_cells, local_law
from specref.oracle.tree_greedy import check_greedy_verifier
from specref.oracle.tree_selftest import (GREEDY_MUTANTS, TREE_MUTANTS, false_alarms_tree, greedy_mutant, reference_tree,
                                          reference_tree_eagle, reference_tree_plain, reference_tree_without, tree_mutant)

CASES = standard_tree_cases()
SMALL = tuple(c for c in CASES if c.vocab <= 6)  # V = 5, 6: full joint tests, fast one-row conventions


def check_tree_sampler(fn, **kw):
    """These tests ask SpecInfer's law (the lossless law: test_lossless.py)."""
    return _check(fn, **{"law": "specinfer", **kw})


# ---------------------------------------------------------------- the exact law

def test_local_law_by_hand():
    # p = [0.5, 0.3, 0.2]; deterministic siblings 0 then 1: accept 0 w.p. 0.5; else r = [0, .6, .4]:
    # accept 1 w.p. 0.5 * 0.6 = 0.3; else the final token is 2 (r = [0, 0, 1]) w.p. 0.2
    acc, fin = local_law(np.array([[0.5, 0.3, 0.2]]), None, [0, 1], "fixed")
    assert np.allclose(acc[0, 0], [0.5, 0, 0]) and np.allclose(acc[0, 1], [0, 0.3, 0]) and np.allclose(fin, [[0, 0, 0.2]])
    # a repeated deterministic sibling is never accepted (its mass is gone)
    acc, _ = local_law(np.array([[0.5, 0.3, 0.2]]), None, [0, 0], "fixed")
    assert np.allclose(acc[0, 1], 0)
    # i.i.d. from q = [0.25, 0.25, 0.5]: P(accept first with x) = min(p, q) = [.25, .25, .2] (beta 0.3);
    # r1 = norm(max(0, p - q)) = [0.25, 0.05, 0] / 0.3; second: 0.3 * min(q, r1)
    p, q = np.array([[0.5, 0.3, 0.2]]), np.array([[0.25, 0.25, 0.5]])
    acc, fin = local_law(p, q, 2, "iid")
    r1 = np.array([0.25, 0.05, 0.0]) / 0.3
    assert np.allclose(acc[0, 0], [0.25, 0.25, 0.2]) and np.allclose(acc[0, 1], 0.3 * np.minimum(q[0], r1))
    assert np.isclose(acc.sum() + fin.sum(), 1.0)
    # without replacement: after rejecting token 2 (prob 0.5 - 0.2 = 0.3), the second sibling is
    # drawn from q without 2 = [0.5, 0.5] and tested against r1: min([.5, .5], r1) * 0.3
    acc, fin = local_law(p, q, 2, "without")
    assert np.allclose(acc[0, 1], 0.3 * np.minimum([0.5, 0.5, 0.0], r1))
    assert np.isclose(acc.sum() + fin.sum(), 1.0)


@pytest.mark.parametrize("mode", ["iid", "without"])
def test_exact_law_is_lossless(mode):
    # the recursive-rejection law must be lossless: the first emitted token is p at the root and,
    # for sampled trees (p a function of the token path), the second token, completed by the target
    # where the step stopped after one, is p at the first one.
    for case in CASES:
        V = case.vocab
        for v in case.variants:
            m = "fixed" if v.tokens is not None else mode
            c = exact_cells(v, V, m)
            first = np.where(c.m >= 1, c.x[:, 0], c.y) if c.x.shape[1] else c.y
            p0 = v.p[0].double().numpy()
            assert np.allclose(np.bincount(first, weights=c.prob, minlength=V), p0 / p0.sum(), atol=1e-9), (case.name, v.label)
            if m != "fixed" and c.x.shape[1]:
                P = v.p.double().numpy()
                P = P / P.sum(1, keepdims=True)
                joint = np.zeros((V, V))
                two = c.m >= 1
                sec = np.where(c.m >= 2, c.x[:, min(1, c.x.shape[1] - 1)], c.y)
                np.add.at(joint, (first[two], sec[two]), c.prob[two])
                stop = np.bincount(first[~two], weights=c.prob[~two], minlength=V)  # (V,) stopped after one token
                joint += stop[:, None] * P[1: 1 + V]  # ... completed by the target: row 1 + a is the path (a,)
                assert np.allclose(joint, (p0 / p0.sum())[:, None] * P[1: 1 + V], atol=1e-9), (case.name, v.label)


def test_cases_cover_the_issue():
    shapes = [v.parents for c in CASES for v in c.variants]
    assert max(max(depths(s), default=0) for s in shapes) == 4 and min(max(depths(s), default=0) for s in shapes) == 0
    widths = [max([sum(1 for x in s if x == par) for par in set(s)], default=0) for s in shapes]
    assert set(widths) >= {0, 1, 2, 3, 4}
    assert any(c.variants[0].tokens is None for c in CASES) and any(c.variants[0].tokens is not None for c in CASES)
    assert any(len({v.n for v in c.variants}) > 1 for c in CASES)  # ragged rows in one batch
    assert "duplicates" not in [c.name for c in standard_tree_cases(duplicates=False)]


# ---------------------------------------------------------------- verifiers that must pass

def test_specref_verify_tree_passes_through_the_public_api():
    rep = specref.check_tree_sampler(specref.verify_tree, law="specinfer", samples=3_000, seed=1)
    assert rep.verdict == "INCONCLUSIVE" and not rep.passed, rep.summary()  # detects TV 0.07 > bound 0.05
    assert specref.check_tree_sampler(specref.verify_tree, law="specinfer", samples=3_000, seed=1, tv_bound=0.08).passed
    assert not rep.errors and not rep.stopped_early and rep.samples == 3_000 * sum(len(c.variants) for c in CASES)
    assert {t.kind for t in rep.tests} == {"pos", "length", "node", "final", "joint"}
    assert 0.06 < rep.detectable_tv < 0.08  # the power statement of this file's docstring
    for t in rep.tests:
        assert t.tv.lower <= t.tv.tv <= t.tv.upper


def test_without_replacement_convention():
    # Sequoia's verifier passes when the siblings are drawn without replacement, and so does
    # specref's verify_tree told their kind (the adapter passes siblings="without"); the i.i.d. rule
    # on the same draws does not (its residual is wrong for such siblings): the kind matters
    assert check_tree_sampler(reference_tree_without, siblings="without", samples=1_500, seed=2, cases=SMALL).verdict != "FAIL"
    assert check_tree_sampler(specref.verify_tree, siblings="without", samples=1_500, seed=2, cases=SMALL).verdict != "FAIL"
    as_iid = lambda t, pa, p, q, *, lengths, generator: specref.verify_tree(  # noqa: E731
        t, pa, p, q, lengths=lengths, generator=generator, siblings=None if q is None else "sampled")
    assert check_tree_sampler(as_iid, siblings="without", samples=1_500, seed=2, cases=SMALL).verdict == "FAIL"


def test_one_row_conventions_and_per_row_generators():
    assert check_tree_sampler(reference_tree_plain, api="plain", samples=120, seed=3, cases=SMALL).verdict != "FAIL"
    assert check_tree_sampler(reference_tree_eagle, api="eagle", samples=80, seed=3, cases=SMALL).verdict != "FAIL"
    assert check_tree_sampler(specref.verify_tree, samples=300, seed=3, cases=SMALL, per_row_generators=True).verdict != "FAIL"
    # the eagle adapter does not hide a mistake
    mutant = lambda c, r, lg, dq, g: reference_tree_eagle(c, r, lg, dq, g, mistake="final_from_p")
    assert check_tree_sampler(mutant, api="eagle", samples=80, seed=3, cases=SMALL).verdict == "FAIL"


def test_retrieve_layout_by_hand():
    # root -> {0: 7, 1: 8}; 0 -> {2: 9}: paths [root, 0, 2] and [root, 1]; flat index 1 + node
    cand, ret = retrieve_layout([7, 8, 9], [-1, -1, 0])
    assert ret.tolist() == [[0, 1, 3], [0, 2, -1]]
    assert cand.tolist() == [[0, 7, 9], [0, 8, -1]]
    cand, ret = retrieve_layout([], [])
    assert ret.tolist() == [[0]] and cand.tolist() == [[0]]


# ---------------------------------------------------------------- mutants, false alarms

def test_tree_self_test_rejects_every_mutant(capsys):
    # `python -m specref oracle --self-test --tree`: the six tree mutants and two greedy mutants fail,
    # every correct verifier (specref's verify_tree / verify_tree_greedy, the references in three
    # conventions, the without-replacement reference) passes
    assert oracle_main(["--self-test", "--tree", "--samples", "1000", "--false-alarm-runs", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "tree self-test: PASS"
    for name in list(TREE_MUTANTS) + list(GREEDY_MUTANTS):
        assert any(line.startswith(f"ok  {name} ") and "expected FAIL, got FAIL" in line for line in lines), name
    for name in ("specref.rejection.verify_tree", "specref.rejection.verify_tree_greedy", "reference_tree_eagle"):
        assert any(line.startswith(f"ok  {name} ") and "expected PASS, got PASS" in line for line in lines), name


def test_tree_false_alarm_rate_consistent_with_alpha():
    # 20 independent checks of the correct reference at family-wise alpha 0.2 on the small cases:
    # failures within what alpha allows (one-sided binomial at 1e-3); first-token p-values uniform (KS)
    fails, first = false_alarms_tree(reference_tree, runs=20, samples=300, alpha=0.2, seed=100, cases=SMALL)
    assert stats.binomtest(fails, 20, 0.2, alternative="greater").pvalue > 1e-3, fails
    assert len(first) >= 20 * 12
    assert stats.kstest(first, "uniform").pvalue > 1e-3


# ---------------------------------------------------------------- greedy

def test_greedy_verifier_check():
    assert specref.check_greedy_verifier(specref.verify_tree_greedy, samples=500).passed

    def plain(tokens, parents, logits):  # the plain and eagle conventions, on verify_tree_greedy
        out = specref.verify_tree_greedy(tokens[None], parents[None], logits[None])
        m = int(out.num_accepted[0])
        return out.path[0, :m], int(out.tokens[0, m])
    assert check_greedy_verifier(plain, api="plain", samples=300).passed

    def eagle(cand, ret, logits):  # EAGLE's greedy rule: the longest prefix of a row matching the argmax
        match = (cand[:, 1:] == logits[:, :-1].argmax(-1)).long().cumprod(1).sum(1)
        best = int(match.argmax())
        return best, int(match[best]), int(logits[best, int(match[best])].argmax())
    assert check_greedy_verifier(eagle, api="eagle", samples=300).passed
    for name, what in (("greedy_first_match", "not the longest path"), ("greedy_bonus_at_parent", "final token is not")):
        rep = check_greedy_verifier(greedy_mutant(name), samples=300)
        assert rep.verdict == "FAIL" and any(what in e and e.startswith("greedy/") for e in rep.errors), rep.errors


# ---------------------------------------------------------------- bad input -> failed check, never a crash

def _row_bad(kind):
    def fn(tokens, parents, p, q, generator):
        path, last = reference_tree_plain(tokens, parents, p, q, generator)
        if kind == "none":
            return None
        if kind == "vocab":
            return path, p.shape[-1] + 3
        if kind == "not_a_path":  # a node that is not a child of the root first
            return torch.tensor([len(tokens) - 1] if len(tokens) and parents[-1] >= 0 else [], dtype=torch.long), last
        if kind == "float":
            return path.float(), last
        return path, last
    return fn


@pytest.mark.parametrize("kind,what", [("none", "malformed output"), ("vocab", "not in [0,"),
                                       ("not_a_path", "not a root-to-node path"), ("float", "integer")])
def test_bad_output_is_a_failed_check(kind, what):
    rep = check_tree_sampler(_row_bad(kind), api="plain", samples=16, seed=0, cases=SMALL[:1], early_stop=False)
    assert rep.verdict == "FAIL" and rep.errors and any(what in e for e in rep.errors), rep.errors
    assert all(e.startswith("sampled") for e in rep.errors)  # each names the case


def test_bad_batched_output_is_a_failed_check():
    def wrong_tokens(tokens, parents, p, q, *, lengths, generator, siblings):  # reports a token other than the node's
        out = specref.verify_tree(tokens, parents, p, q, lengths=lengths, generator=generator, siblings=siblings)
        toks = out.tokens.clone()
        toks[:, 0] = torch.where(out.num_accepted > 0, (toks[:, 0] + 1) % p.shape[-1], toks[:, 0])
        return toks, out.path, out.num_accepted
    bad = {"shape": lambda *a, **k: (torch.zeros(3, 2, dtype=torch.long),) * 2 + (torch.zeros(3, dtype=torch.long),),
           "raises": lambda *a, **k: 1 / 0, "tokens": wrong_tokens}
    for name, fn in bad.items():
        rep = check_tree_sampler(fn, samples=16, seed=0, cases=SMALL[:1], early_stop=False)
        assert rep.verdict == "FAIL" and rep.errors[0].startswith("sampled:"), (name, rep.errors)
    assert "ZeroDivisionError" in check_tree_sampler(bad["raises"], samples=8, cases=SMALL[:1]).errors[0]
    # eagle: a best_candidate that is not a row
    rep = check_tree_sampler(lambda c, r, lg, dq, g: (99, 0, 0), api="eagle", samples=8, cases=SMALL[:1])
    assert rep.verdict == "FAIL" and "not a path of retrieve_indices" in rep.errors[0]
    rep = check_greedy_verifier(lambda *a, **k: None, samples=8)
    assert rep.verdict == "FAIL" and rep.errors[0].startswith("greedy/V2: malformed")


def test_value_errors():
    for kw, match in ((dict(api="sglang"), "api"), (dict(samples=4), "samples"), (dict(samples=1.5), "samples"),
                      (dict(seed=-1), "seed"), (dict(seed="3"), "seed"), (dict(alpha=2.0), "alpha"),
                      (dict(siblings="both"), "siblings")):
        with pytest.raises(ValueError, match=match):
            check_tree_sampler(specref.verify_tree, **kw)
    with pytest.raises(ValueError, match="api"):
        check_greedy_verifier(specref.verify_tree_greedy, api="vllm")
    with pytest.raises(ValueError, match="mistake"):
        reference_tree(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), -1), torch.ones(1, 2, 2) / 2, mistake="typo")
    with pytest.raises(ValueError, match="mode"):
        exact_cells(CASES[0].variants[0], CASES[0].vocab, "fixed")


def test_cli_tree(capsys):
    assert oracle_main(["--tree", "--sampler", "specref.rejection:verify_tree", "--samples", "400"]) == 3
    assert "verdict: INCONCLUSIVE (law lossless" in capsys.readouterr().out
    assert oracle_main(["--tree", "--sampler", "specref.rejection:verify_tree", "--samples", "400", "--law", "specinfer",
                        "--tv-bound", "0.5"]) == 0
    assert "verdict: PASS (law specinfer" in capsys.readouterr().out
    assert oracle_main(["--tree", "--sampler", "specref.oracle.tree_selftest:tree_mutant_no_renorm", "--samples", "400"]) == 1
    assert "verdict: FAIL" in capsys.readouterr().out
    assert oracle_main(["--greedy", "--sampler", "specref.rejection:verify_tree_greedy", "--samples", "100"]) == 0
    assert "exact comparison" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        oracle_main(["--tree", "--sampler", "specref.rejection:verify_tree", "--api", "vllm"])
