"""Tests of the oracle's lossless mode (specref/oracle/lossless.py, lossless_selftest.py) and its verdict.

The lossless law asks one question of every rule: do the emitted tokens follow p prefix by prefix?
So SpecInfer, a trie merge, another sibling order and block verification all pass it, and only the
stricter laws (law="specinfer", law="tokenwise") tell them apart. Power: the verdict is INCONCLUSIVE
when the worst depth's detectable TV of the output law is above tv_bound (0.05 by default); the
small runs here assert what they can (FAIL for mutants, not FAIL for correct rules), and one run is
sized to PASS (test_inconclusive_then_pass_with_the_samples_it_asked_for).
"""
import numpy as np
import pytest
import torch

import specref
from specref.oracle.check import check_rejection_sampler
from specref.oracle.cli import oracle_main
from specref.oracle.generator import check_generator
from specref.oracle.lossless import emitted, prefix_table
from specref.oracle.lossless_selftest import (block_verify, ks_uniformity, lossless_self_test, reversed_siblings_tree,
                                              seed_reused_decoder, trie_merge_tree)
from specref.oracle.selftest import MUTANTS
from specref.oracle.toy import MarkovLM, ToyConfig, speculative_sample
from specref.oracle.tree_cases import chain_cases, sequence_cases, shallow, standard_tree_cases
from specref.oracle.tree_check import check_tree_sampler
from specref.oracle.tree_selftest import TREE_MUTANTS

SMALL = tuple(c for c in standard_tree_cases() if c.vocab <= 6)  # V = 5, 6 (duplicates included)


def test_prefix_table_and_emitted_by_hand():
    # a deterministic tree with a repeated sibling: root -> {3, 1, 3}, the second 3 has a child 2;
    # the two nodes with token path (3,) share one p row, keyed by the heap key 0 * V + 1 + 3 = 4
    V = 5
    case = next(c for c in standard_tree_cases() if c.name == "duplicates")
    v = case.variants[0]  # parents (-1, -1, -1), tokens (3, 1, 3)
    keys, table = prefix_table(v, V)
    assert keys.tolist() == [0, 2, 4]  # root, (1,), (3,)
    assert np.allclose(table[2], v.p[1].double().numpy()) and np.allclose(table[2], v.p[3].double().numpy())
    # rows: (m = 0, y = 4) emits [4]; (m = 1, x = 3, y = 0) emits [3, 0]
    E = emitted(np.array([0, 1]), np.array([[-1], [3]]), np.array([4, 0]), 1)
    assert E.tolist() == [[4, -1], [3, 0]]


@pytest.mark.parametrize("fn,siblings", [(specref.verify_tree, "iid"), (trie_merge_tree, "iid"),
                                         (trie_merge_tree, "trie"), (reversed_siblings_tree, "iid")])
def test_lossless_rules_pass_whatever_their_law(fn, siblings):
    cases = None if siblings == "trie" else SMALL
    rep = check_tree_sampler(fn, siblings=siblings, samples=1_500, seed=2, cases=cases)
    assert rep.verdict != "FAIL", rep.summary()
    assert rep.law == "lossless" and rep.draft_law.startswith(siblings)
    assert {t.kind for t in rep.tests} == {"depth"}


def test_stricter_laws_tell_the_rules_apart():
    # SpecInfer's law (siblings in index order, no merge) fails the trie merge (repeated deterministic
    # siblings, and i.i.d. sequences sharing a prefix) and the reversed order; the token-wise law
    # fails block verification, which accepts more
    for fn, sib, cases in ((trie_merge_tree, "iid", SMALL[-1:]), (trie_merge_tree, "trie", sequence_cases()),
                           (reversed_siblings_tree, "iid", SMALL[:1])):
        assert check_tree_sampler(fn, siblings=sib, law="specinfer", samples=1_500, seed=2, cases=cases).verdict == "FAIL"
    assert check_tree_sampler(specref.verify_tree, law="specinfer", samples=1_500, seed=2, cases=SMALL).verdict != "FAIL"
    assert check_rejection_sampler(block_verify, samples=3_000, seed=2).verdict != "FAIL"
    rep = check_rejection_sampler(block_verify, law="tokenwise", samples=3_000, seed=2)
    assert rep.verdict == "FAIL" and rep.law == "tokenwise", rep.summary()


def test_lossless_self_test_rejects_every_mutant(capsys):
    # `python -m specref oracle --self-test --lossless` on the small tree cases: the nine chain mutants,
    # block verification with vLLM-Ascend's product rule and the twelve tree mutants FAIL the lossless law, the correct rules do not, the stricter laws FAIL
    # the other rules
    ok, lines = lossless_self_test(samples=1_000, tree_cases=SMALL, power_samples=0)
    assert ok and lines[-1] == "lossless self-test: PASS", "\n".join(lines)
    for name in list(MUTANTS) + list(TREE_MUTANTS) + ["block_product_rule"]:
        assert any(line.startswith(f"ok  {name} ") and "got FAIL" in line for line in lines), name


def test_inconclusive_then_pass_with_the_samples_it_asked_for():
    # 300 rows per variant cannot detect TV 0.05 at every depth: INCONCLUSIVE (passed False), and the
    # report says how many rows would; the same verifier with that many rows: PASS
    small = check_rejection_sampler(specref.verify_chain, samples=300, seed=3)
    assert small.verdict == "INCONCLUSIVE" and not small.passed and small.detectable_tv > 0.05
    assert "rows per variant needed" in small.summary()
    depths = {name.rsplit(" depth ", 1)[1] for name, _ in small.power if name.startswith("chain/L4 depth ")}
    assert depths == {"0", "1", "2", "3", "4"}  # power stated per depth, not only for the first token
    n4 = [t.n for t in small.tests if t.name.startswith("chain/L4 depth ")]
    assert n4 == sorted(n4, reverse=True) and n4[0] == 300 > n4[-1]  # deeper prefixes see fewer rows
    # a PASS on the full chain cases needs ~160,000 rows per variant (every depth of L4 summed); the
    # same question on the shallow cases (depth <= 1) asks for far fewer, and PASSES with them
    cases = shallow(chain_cases(), 1)
    small = check_rejection_sampler(specref.verify_chain, samples=1_000, seed=3, cases=cases)
    assert small.verdict == "INCONCLUSIVE" and 1_000 < small.samples_needed < 60_000, small.summary()
    big = check_rejection_sampler(specref.verify_chain, samples=small.samples_needed, seed=3, cases=cases)
    assert big.verdict == "PASS" and big.passed and big.detectable_tv <= 0.05, big.summary()


def test_cli_lossless_exit_status(capsys):
    assert oracle_main(["--tree", "--sampler", "specref.oracle.lossless_selftest:trie_merge_tree", "--siblings", "trie",
                        "--samples", "300"]) == 3
    assert "verdict: INCONCLUSIVE (law lossless, drafts trie" in capsys.readouterr().out
    assert oracle_main(["--sampler", "specref.oracle.lossless_selftest:block_verify", "--samples", "25000",
                        "--tv-bound", "0.3"]) == 0
    assert oracle_main(["--tree", "--sampler", "specref.oracle.lossless_selftest:trie_merge_tree", "--siblings", "trie",
                        "--samples", "300", "--law", "specinfer"]) == 1
    with pytest.raises(SystemExit):
        oracle_main(["--sampler", "specref.rejection:verify_chain", "--law", "specinfer"])


def test_seed_reused_across_steps_needs_the_whole_decoder():
    # correct within a step (verify_chain with a fixed seed passes the single-step lossless check),
    # lossy across steps: check_generator on the toy decoder sees it; the correct decoder does not FAIL
    target = MarkovLM.from_config(ToyConfig(vocab=4, order=1, seed=5, sharpness=1.5))
    draft = target.perturb(0.5, seed=6)
    step = lambda d, p, q, *, lengths, generator: specref.verify_chain(d, p, q, lengths=lengths,  # noqa: E731
                                                                      generator=torch.Generator().manual_seed(7))
    assert check_rejection_sampler(step, samples=500, seed=1, cases=chain_cases()[:1]).verdict != "FAIL"
    prompt = torch.tensor([1])
    bad = check_generator(seed_reused_decoder(target, draft, k=2), target, prompt, length=4, samples=6_000)
    assert bad.verdict == "FAIL", bad.summary()
    good = lambda ids, L, gen: speculative_sample(target, draft, ids[0], L, ids.shape[0], 2, generator=gen)[0]  # noqa: E731
    assert check_generator(good, target, prompt, length=4, samples=6_000).verdict != "FAIL"


def test_p_values_of_correct_rules_are_uniform_at_the_tail():
    # every lossless-mode test p-value of the chain and tree references over 8 seeds: never below
    # uniform (one-sided KS; the exact per-prefix tests make the sum conservative) and no excess
    # below 0.05 or 0.01
    good, line = ks_uniformity(runs=8, samples=300, seed=50)
    assert good, line


def test_value_errors():
    for kw, match in ((dict(law="tokenwise"), "law"), (dict(siblings="sorted"), "siblings"),
                      (dict(tv_bound=0.0), "tv_bound"), (dict(siblings="topk", cases=sequence_cases()), "topk")):
        with pytest.raises(ValueError, match=match):
            check_tree_sampler(specref.verify_tree, **kw)
    with pytest.raises(ValueError, match="law"):
        check_rejection_sampler(specref.verify_chain, law="specinfer")
    with pytest.raises(ValueError, match="chain-shaped"):
        check_rejection_sampler(specref.verify_chain, cases=SMALL)
