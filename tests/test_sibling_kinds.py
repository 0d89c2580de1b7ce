"""Sibling kinds (proposer.Draft.siblings, rejection.verify_tree): every tree draft is verified by the
rule that matches how its siblings were drawn, and the label is never guessed.

- a q without a kind, a mixed tree without per-node kinds, a merged tree of sampled sequences with
  its q, a library proposer whose drafting method a user overrode: each refused with a ValueError
  naming the field, or verified by the right rule;
- siblings drawn without replacement (Gumbel-top-k, Sequoia) pass the oracle's lossless check under
  their own kind and FAIL it labelled "sampled" (the same draws); merged i.i.d. sequences
  (tree.tree_from_sequences with q) pass under "without", fail under "sampled";
- mixed trees (top-k levels and sampled levels; hybrid.py's one-hot and sampled siblings) pass with
  per-node kinds; labelled "sampled" throughout, the top-k nodes' q makes them FAIL;
- the exact two-sibling numbers of docs/sibling_kinds.md.
Oracle runs: the small cases (V = 5, 6) and tree_cases.mixed_cases; a PASS asserts the power for TV
0.05 in the output law (every depth of a step summed), on their shallow variants (depth 1; the
merge: sequences of 2) at 30,000-60,000 rows per variant; a FAIL 1,500 rows (6,000 for the merge,
lossy by TV ~0.03 there).
"""
import numpy as np
import pytest
import torch

from specref import checks
from specref.eagle_head import EagleConfig, EagleHead, EagleProposer
from specref.eagle_tree import Eagle2Proposer
from specref.generate import speculative_generate
from specref.models import tiny_model
from specref.mtp import MTPProposer
from specref.oracle.tree_cases import TreeCase, TreeVariant, sequence_cases, shallow, standard_tree_cases
from specref.oracle.tree_check import check_tree_sampler
from specref.proposer import Draft
from specref.rejection import verify_tree
from specref.tree import tree_from_sequences

V = 5
SMALL = tuple(c for c in standard_tree_cases() if c.vocab <= 6)
SAMPLED_SMALL = tuple(c for c in SMALL if c.variants[0].tokens is None)


def _uniform(*shape):
    return torch.full(shape + (V,), 1.0 / V)


# ---------------------------------------------------------------- refusals naming the field

def test_verify_tree_refuses_a_q_without_a_kind():
    tok, par = torch.tensor([[1, 2]]), torch.tensor([[-1, -1]])
    with pytest.raises(ValueError, match="siblings"):
        verify_tree(tok, par, _uniform(1, 3), _uniform(1, 2))
    # q=None is itself the deterministic kind; every named kind with a q runs
    assert verify_tree(tok, par, _uniform(1, 3)).num_accepted.shape == (1,)
    for kind in ("sampled", "without"):
        assert verify_tree(tok, par, _uniform(1, 3), _uniform(1, 2), siblings=kind).num_accepted.shape == (1,)
    from specref.rejection import SIBLING_KINDS
    assert SIBLING_KINDS == ("deterministic", "sampled", "without")
    for bad in ("iid", "topk", 3, ["sampled"]):  # an unknown name; a per-node list of the wrong length
        with pytest.raises(ValueError, match="siblings"):
            verify_tree(tok, par, _uniform(1, 3), _uniform(1, 2), siblings=bad)
    with pytest.raises(ValueError, match="siblings"):  # a sampled node needs its q
        verify_tree(tok, par, _uniform(1, 3), None, siblings=["deterministic", "sampled"])


def _mixed_draft():
    """Root -> top-1 of a head (node 0, q row zero: it has none) and a sample (node 1)."""
    q = _uniform(1, 2)
    q[0, 0] = 0.0
    return torch.tensor([[1, 2]]), torch.tensor([[-1, -1]]), q


def test_mixed_tree_needs_per_node_kinds():
    tok, par, q = _mixed_draft()
    with pytest.raises(ValueError, match="siblings"):  # one label for a tree whose node 0 has no q
        verify_tree(tok, par, _uniform(1, 3), q, siblings="sampled")
    for kinds in (["deterministic", "sampled"], torch.tensor([0, 1]), torch.tensor([[0, 1]])):
        assert verify_tree(tok, par, _uniform(1, 3), q, siblings=kinds).num_accepted.shape == (1,)

    class Mixed:  # a user's proposer drafting that tree with one label
        k = 2

        def __init__(self, siblings):
            self.siblings = siblings

        def begin(self, *a):
            pass

        def update(self, *a):
            pass

        def propose(self, ctx, sampling, generator):
            B = ctx.tokens.shape[0]
            qq = torch.zeros(B, 2, 16)
            qq[:, 1] = 1.0 / 16
            return Draft(tokens=torch.tensor([[1, 2]] * B), lengths=torch.full((B,), 2) * ctx.active, q=qq,
                         parents=torch.tensor([[-1, -1]] * B), siblings=self.siblings)

    target = tiny_model("llama", vocab_size=16, seed=3)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with pytest.raises(ValueError, match="Draft.siblings"):
        speculative_generate(target, Mixed("sampled"), ids, max_new_tokens=4, temperature=1.0, seed=0)
    out = speculative_generate(target, Mixed(["deterministic", "sampled"]), ids, max_new_tokens=4, temperature=1.0,
                               seed=0)
    assert out.num_tokens.tolist() == [4]


def test_tree_from_sequences_with_q_keeps_them_verifiable():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(1, 3, 2, V, generator=g), -1)  # (B, S, L, V)
    q[0, 1, 0] = q[0, 0, 0]  # every sequence draws its first token from the root's q
    q[0, 2, 0] = q[0, 0, 0]
    q[0, 1, 1] = q[0, 0, 1]  # sequences 0 and 1 share the prefix (1,): one q after it
    t = tree_from_sequences([[[1, 2], [1, 3], [4]]], q=q)
    assert t.tokens.tolist() == [[1, 2, 3, 4]] and t.parents.tolist() == [[-1, 0, 0, -1]]
    assert t.siblings == "without"  # distinct siblings in order of first appearance
    assert torch.equal(t.q[0, 0], q[0, 0, 0]) and torch.equal(t.q[0, 2], q[0, 1, 1])
    assert torch.equal(t.q[0, 3], q[0, 0, 0])
    bad = q.clone()
    bad[0, 1, 1] = torch.softmax(torch.randn(V, generator=g), -1)  # two q's after the same prefix
    with pytest.raises(ValueError, match="q"):
        tree_from_sequences([[[1, 2], [1, 3], [4]]], q=bad)
    assert tree_from_sequences([[[1, 2], [1, 3]]]).tokens.tolist() == [[1, 2, 3]]  # without q: as before


def _head(target):
    return EagleHead(target, torch.arange(0, 12), seed=1)


@pytest.mark.parametrize("base", [EagleProposer, Eagle2Proposer, MTPProposer])
def test_a_subclass_overriding_a_drafting_method_is_not_trusted(base):
    class Sub(base):
        def _propose(self, ctx, sampling, generator):
            return super()._propose(ctx, sampling, generator)

    class Plain(base):  # a user's subclass that changes nothing: still the library's drafts
        pass

    assert checks.trusted(base.__new__(base)) and checks.trusted(Plain.__new__(Plain))
    assert not checks.trusted(Sub.__new__(Sub))
    patched = base.__new__(base)
    patched._propose = lambda *a: None  # a drafting method replaced on the instance
    assert not checks.trusted(patched)


def test_every_library_proposer_is_trusted():
    from specref.draft_model import DraftModelProposer, truncated_draft
    from specref.generate import NullProposer
    from specref.hybrid import HybridProposer
    from specref.lookahead import LookaheadProposer
    from specref.medusa_heads import MedusaHeads, MedusaProposer
    from specref.mtp import MTPStack
    from specref.ngram import NgramProposer

    for cls in (DraftModelProposer, EagleProposer, Eagle2Proposer, HybridProposer, LookaheadProposer, MedusaProposer,
                MTPProposer, NgramProposer, NullProposer):
        assert checks.trusted(cls.__new__(cls)), cls.__name__

    target = tiny_model("llama", vocab_size=16, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    built = [NgramProposer(), LookaheadProposer(), EagleProposer(_head(target)), Eagle2Proposer(_head(target)),
             DraftModelProposer(truncated_draft(target, 1)), MedusaProposer(MedusaHeads(target)),
             MTPProposer(MTPStack(target)), HybridProposer(NgramProposer(), EagleProposer(_head(target)))]
    for prop in built:  # built as a user builds them: what they hold keeps them the library's
        assert checks.trusted(prop), type(prop).__name__

    class Users:  # a user's own proposer: never trusted, nor a library proposer holding it as a part
        k = 1

        def begin(self, *a):
            pass

        def propose(self, *a):
            return None

        def update(self, *a):
            pass
    assert not checks.trusted(Users()) and not checks.trusted(HybridProposer(NgramProposer(), Users()))


def test_an_overridden_propose_hook_gets_the_per_step_draft_check():
    target = tiny_model("llama", vocab_size=16, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)

    class OutOfVocab(EagleProposer):
        def _propose(self, ctx, sampling, generator):
            d = super()._propose(ctx, sampling, generator)
            return Draft(tokens=d.tokens.clamp(max=0) + 99, lengths=d.lengths, q=d.q)  # id 99 >= V

    with pytest.raises(ValueError, match=r"Draft.tokens\[0, 0\] = 99"):
        speculative_generate(target, OutOfVocab(_head(target), EagleConfig(k=2)), torch.tensor([[3, 1, 4, 1, 5]]),
                             max_new_tokens=4, temperature=1.0, seed=0)


# ---------------------------------------------------------------- the rule for each kind, by the oracle

def _labelled(kind):
    """verify_tree with a fixed label, whatever the oracle says about the draws."""
    def fn(tokens, parents, p, q, *, lengths, generator, siblings=None):
        return verify_tree(tokens, parents, p, q, lengths=lengths, generator=generator, siblings=kind)
    return fn


def test_without_replacement_siblings_pass_under_their_kind_and_fail_as_sampled():
    # a PASS needs the power for TV 0.05 in the output law, every depth of a step summed: on the
    # depth-1 trees (the fan of 4 siblings drawn without replacement) 30,000 rows per variant give it
    rep = check_tree_sampler(verify_tree, siblings="without", samples=30_000, seed=2, cases=shallow(SAMPLED_SMALL, 1))
    assert rep.verdict == "PASS", rep.summary()
    bad = check_tree_sampler(_labelled("sampled"), siblings="without", samples=1_500, seed=2, cases=SAMPLED_SMALL)
    assert bad.verdict == "FAIL", bad.summary()
    # the stricter question: the exact law of Sequoia's rule in index order (tree_exact.py, mode
    # "without"), the one the oracle's references implement: no failure at 3,000 rows per variant
    exact = check_tree_sampler(verify_tree, siblings="without", law="specinfer", samples=3_000, seed=5,
                               cases=SAMPLED_SMALL)
    assert exact.verdict != "FAIL", exact.summary()
    # and the other way round: i.i.d. siblings labelled "without" are lossy too
    assert check_tree_sampler(_labelled("without"), siblings="iid", samples=1_500, seed=2,
                              cases=SAMPLED_SMALL).verdict == "FAIL"


def _merged(kind):
    """The trie law's k i.i.d. sequences (chains from the root), merged by tree_from_sequences with
    their q, verified as `kind` (None: the kind tree_from_sequences returns); the path is mapped
    back to nodes of the sequences (the sequence that created the end node)."""
    def fn(tokens, parents, p, q, *, lengths, generator):
        B, N = tokens.shape
        seqs, qs, made = [], [], []  # per row: sequences, their q rows, (sequence, position) of each node
        for b in range(B):
            n, row, qrow, ids = int(lengths[b]), [], [], []
            for i in range(n):
                if int(parents[b, i]) < 0:
                    row.append([]), qrow.append([]), ids.append([])
                row[-1].append(int(tokens[b, i])), qrow[-1].append(q[b, i]), ids[-1].append(i)
            seqs.append(row), qs.append([torch.stack(r) if r else torch.zeros(0, p.shape[-1]) for r in qrow])
            made.append(ids)
        t = tree_from_sequences(seqs, q=qs, pad_to=N)
        M = t.tokens.shape[1]
        pm = torch.full((B, M + 1, p.shape[-1]), 1.0 / p.shape[-1])  # (B, M+1, V) p at each merged node
        back = torch.full((B, M), -1, dtype=torch.long)  # (B, M) an original node with the same path
        for b in range(B):
            pm[b, 0] = p[b, 0]
            key = {}  # token path -> original node
            for ids in made[b]:
                path = ()
                for i in ids:
                    path += (int(tokens[b, i]),)
                    key.setdefault(path, i)
            paths = [()]
            for j in range(int(t.lengths[b])):
                paths.append(paths[int(t.parents[b, j]) + 1] + (int(t.tokens[b, j]),))
                back[b, j] = key[paths[-1]]
                pm[b, 1 + j] = p[b, 1 + back[b, j]]
        out = verify_tree(t.tokens, t.parents, pm, t.q, lengths=t.lengths, generator=generator,
                          siblings=kind or t.siblings)
        path = torch.full(tuple(out.path.shape), -1, dtype=torch.long)  # (B, D) nodes of the original tree
        for b in range(B):  # the end node's own ancestors in the original tree
            m = int(out.num_accepted[b])
            node = int(back[b, out.path[b, m - 1]]) if m else -1
            for d in range(m - 1, -1, -1):
                path[b, d] = node
                node = int(parents[b, node])
        return out.tokens, path, out.num_accepted
    return fn


def test_merged_iid_sequences_pass_as_without_and_fail_as_sampled():
    rep = check_tree_sampler(_merged(None), siblings="trie", samples=60_000, seed=2,
                             cases=shallow(sequence_cases(), 2))  # sequences of 2
    assert rep.verdict == "PASS", rep.summary()  # 60,000 rows per variant give the power for TV 0.05
    # labelled "sampled": two draws from q = (0.3, 0.6, 0.1) merged, p = (0.5, 0, 0.5) at the root; the
    # first token's law is (0.6, 0, 0.4) (TV 0.1, _first_token_law). On sequence_cases() the
    # deviation is TV ~0.03 (6,000 rows per variant find it)
    p = torch.tensor([[0.5, 0.0, 0.5]] + [[1 / 3] * 3] * 3)  # (4, 3) p at the root, then after each token
    q = torch.tensor([[0.3, 0.6, 0.1]])  # (1, 3) q at the root
    sharp = TreeCase("two draws", 3, 2, (TreeVariant((-1, -1), None, p, q, "k = 2"),))
    assert check_tree_sampler(_merged("sampled"), siblings="trie", samples=1_500, seed=2,
                              cases=(sharp,)).verdict == "FAIL"
    assert np.allclose(_first_token_law(np.array([0.5, 0, 0.5]), np.array([0.3, 0.6, 0.1]), "trie", "sampled"),
                       [0.6, 0.0, 0.4])


@pytest.mark.parametrize("draws", ["iid", "without"])
def test_mixed_trees_pass_with_per_node_kinds_and_fail_with_one_label(draws):
    from specref.oracle.tree_cases import mixed_cases
    # per-node kinds from the oracle (top-k nodes "deterministic", the rest the draws' kind)
    rep = check_tree_sampler(verify_tree, siblings=draws, samples=30_000, seed=3, cases=shallow(mixed_cases(), 1))
    assert rep.verdict == "PASS", rep.summary()  # the top-1 node beside two samples: power for TV 0.05
    # one label, "sampled", with the q the top-k nodes were ranked by: lossy
    def one_label(tokens, parents, p, q, *, lengths, generator, siblings):
        return verify_tree(tokens, parents, p, q, lengths=lengths, generator=generator, siblings="sampled")
    assert check_tree_sampler(one_label, siblings=draws, samples=1_500, seed=3,
                              cases=mixed_cases()).verdict == "FAIL"


def test_hybrid_tree_siblings_one_hot_and_sampled_pass_as_sampled():
    from specref.oracle.tree_cases import mixed_cases
    # HybridConfig(mode="tree"): an n-gram node (q one-hot) beside a sampled node from another q,
    # one label "sampled" (each sibling an independent draw from its own q row): lossless. A
    # verifier without a `siblings` parameter gets q one-hot on the oracle's deterministic nodes.
    rep = check_tree_sampler(lambda tokens, parents, p, q, *, lengths, generator: verify_tree(
        tokens, parents, p, q, lengths=lengths, generator=generator, siblings="sampled"),
        siblings="iid", samples=30_000, seed=4, cases=shallow(mixed_cases(), 1))
    assert rep.verdict == "PASS", rep.summary()


# ---------------------------------------------------------------- the numbers of docs/sibling_kinds.md

def _first_token_law(p, q, draw, rule, k=2):
    """Exact law of the first emitted token of a root with k siblings drawn by `draw` ("topk",
    "iid", "without", "trie": the distinct first tokens of k i.i.d. draws), verified by verify_tree's
    `rule`: enumerated over every draw, the rule's acceptance probabilities computed in closed form."""
    from itertools import product

    V = len(p)
    law = np.zeros(V)
    if draw == "topk":
        outcomes = [(tuple(int(i) for i in np.argsort(-q, kind="stable")[:k]), 1.0)]
    else:
        outcomes = []
        for xs in product(range(V), repeat=k):
            w, avail = 1.0, q.copy()
            for x in xs:
                w *= avail[x] / avail.sum() if avail.sum() > 0 else 0.0
                if draw == "without":
                    avail = avail.copy()
                    avail[x] = 0.0
            if w > 0:
                if draw == "trie":
                    xs = tuple(dict.fromkeys(xs))
                outcomes.append((xs, w))
    for xs, w in outcomes:
        r, reach, qc = p.copy(), 1.0, q.copy()
        for x in xs:
            qx = np.eye(V)[x] if rule == "deterministic" else qc / qc.sum()
            a = min(1.0, r[x] / qx[x]) if qx[x] > 0 else 0.0
            law[x] += w * reach * a
            reach *= 1 - a
            nxt = np.maximum(r - qx, 0.0)
            r = nxt / nxt.sum() if nxt.sum() > 0 else r
            if rule == "without":
                qc = qc.copy()
                qc[x] = 0.0
        law += w * reach * r
    return law


def test_the_exact_two_sibling_numbers_of_the_docs():
    p, q = np.array([0.2, 0.8, 0.0]), np.array([0.1, 0.1, 0.8])
    for draw, right in (("topk", "deterministic"), ("iid", "sampled"), ("without", "without"), ("trie", "without")):
        assert np.allclose(_first_token_law(p, q, draw, right), p), draw  # the right rule: p exactly
    # top-2 of q = tokens (2, 0), labelled "sampled": 2 rejected (p = 0), then 0 tested against the
    # residual (0.125, 0.875, 0) with min(1, 0.125 / 0.1) = 1: token 0 always, P 1.0 instead of 0.2
    assert np.allclose(_first_token_law(p, q, "topk", "sampled"), [1.0, 0.0, 0.0])
    # two distinct samples (without replacement) labelled "sampled": P(0) = 0.5, TV 0.3
    assert np.allclose(_first_token_law(p, q, "without", "sampled"), [0.5, 0.5, 0.0])
    # two i.i.d. samples merged into a trie (a repeat dropped) labelled "sampled": P(0) = 0.26, TV 0.06
    assert np.allclose(_first_token_law(p, q, "trie", "sampled"), [0.26, 0.74, 0.0])
    # and the other way round: two i.i.d. samples labelled "without": P(0) = 0.28 instead of 0.2
    p2, q2 = np.array([0.2, 0.1, 0.7]), np.array([0.1, 0.4, 0.5])
    assert np.allclose(_first_token_law(p2, q2, "iid", "sampled"), p2)
    assert np.allclose(_first_token_law(p2, q2, "iid", "without"), [0.28, 0.1, 0.62])
