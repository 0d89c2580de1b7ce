"""Tests of prompt lookup (specref/ngram.py): hand-built cases, a naive reference, the proposer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specref.ngram import NgramConfig, NgramProposer, best_draft_length, propose_ngram, propose_ngram_batch
from specref.proposer import Context, Proposer
from specref.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)


def naive(ctx, min_n, max_n, k, match="earliest"):
    """O(n * T) reference: longest suffix n-gram first; any other occurrence (ending before T)."""
    T = len(ctx)
    for n in range(max_n, min_n - 1, -1):
        if T < n:
            continue
        starts = [s for s in range(T - n) if list(ctx[s:s + n]) == list(ctx[T - n:])]  # s + n <= T - 1
        if starts:
            s = starts[0] if match == "earliest" else starts[-1]
            return list(ctx[s + n:s + n + k])
    return []


def draft(ctx, **kw):
    return propose_ngram(ctx, **kw).tolist()


def test_vllm_docstring_example():
    # [4,2,3] has no earlier occurrence; [2,3] occurs at 1; 3 tokens follow before the context ends
    assert draft([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4) == [4, 2, 3]


def test_hand_built_cases():
    # longest n first: the 3-gram [1,2,3] (-> 8 ...) beats the earlier 2-gram [2,3] (-> 7)
    assert draft([5, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], min_n=2, max_n=3, k=4) == [8, 1, 2, 3]
    # same context with max_n 2: only [2,3] is tried, earliest occurrence at 1 -> 7, 1, 2, 3
    assert draft([5, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], min_n=2, max_n=2, k=4) == [7, 1, 2, 3]
    # earliest vs latest occurrence of [1,2]: at 0 (-> 9) and at 3 (-> 8)
    assert draft([1, 2, 9, 1, 2, 8, 1, 2], min_n=2, max_n=2, k=1) == [9]
    assert draft([1, 2, 9, 1, 2, 8, 1, 2], min_n=2, max_n=2, k=1, match="latest") == [8]
    # an occurrence may overlap the suffix: [7,7,7] at 0 is followed by the last 7 only
    assert draft([7, 7, 7, 7], min_n=2, max_n=3, k=4) == [7]
    # k caps the draft
    assert draft([1, 2, 3, 4, 5, 1, 2], min_n=1, max_n=2, k=2) == [3, 4]


def test_no_match_is_empty():
    # no repeated token at all
    assert draft([1, 2, 3, 4, 5], min_n=1, max_n=3, k=4) == []
    # the last token repeats but min_n 2 needs a repeated bigram
    assert draft([1, 2, 3, 1, 4, 3], min_n=2, max_n=3, k=4) == []
    # context shorter than min_n, a single token, empty context
    assert draft([1], min_n=2, max_n=3, k=4) == []
    assert draft([1], min_n=1, max_n=3, k=4) == []
    assert draft([], min_n=1, max_n=3, k=4) == []
    assert propose_ngram([1, 2, 3], min_n=1, max_n=1, k=3).dtype == np.int64


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    ctx=st.lists(st.integers(0, 3), min_size=0, max_size=60),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 8),
    match=st.sampled_from(["earliest", "latest"]),
)
def test_matches_naive_search(ctx, min_n, extra, k, match):
    # a small vocabulary makes matches (and ties between occurrences) frequent
    max_n = min_n + extra
    assert draft(ctx, min_n=min_n, max_n=max_n, k=k, match=match) == naive(ctx, min_n, max_n, k, match)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.data(), B=st.integers(1, 6), min_n=st.integers(1, 3), k=st.integers(1, 6))
def test_ragged_batch_equals_rows_alone(data, B, min_n, k):
    rows = [data.draw(st.lists(st.integers(0, 2), max_size=40)) for _ in range(B)]
    T = max(len(r) for r in rows) + 3
    # padding beyond each row's length is arbitrary tokens (that would match if read)
    tokens = np.array([r + data.draw(st.lists(st.integers(0, 2), min_size=T - len(r), max_size=T - len(r)))
                       for r in rows])
    lengths = np.array([len(r) for r in rows])
    out, n = propose_ngram_batch(tokens, lengths, min_n=min_n, max_n=min_n + 2, k=k)
    assert out.shape == (B, k) and n.shape == (B,)
    for b, r in enumerate(rows):
        want = naive(r, min_n, min_n + 2, k)
        assert n[b] == len(want) and out[b, : n[b]].tolist() == want
        assert (out[b, n[b]:] == -1).all()


@pytest.mark.parametrize("bad", [dict(min_n=0), dict(min_n=3, max_n=2), dict(k=0), dict(k=-1),
                                 dict(min_n=1.5), dict(match="first"), dict(draft_cost=-0.1),
                                 dict(memory=1.5), dict(prior_accept=1.0)])
def test_bad_config_raises(bad):
    with pytest.raises(ValueError):
        NgramConfig(**bad)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2], min_n=0, max_n=2, k=1)
    with pytest.raises(ValueError, match="max_n"):
        propose_ngram([1, 2], min_n=3, max_n=2, k=1)
    with pytest.raises(ValueError, match="k must"):
        propose_ngram([1, 2], min_n=1, max_n=2, k=0)
    with pytest.raises(ValueError, match="1-D"):
        propose_ngram([[1, 2]], min_n=1, max_n=2, k=1)
    with pytest.raises(ValueError, match="lengths"):
        propose_ngram_batch(np.zeros((2, 3)), np.array([1, 4]), min_n=1, max_n=2, k=1)


def make_ctx(rows, active=None):
    T = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows])  # (B, T)
    lengths = torch.tensor([len(r) for r in rows])  # (B,)
    act = torch.ones(len(rows), dtype=torch.bool) if active is None else torch.tensor(active)
    return Context(tokens=tokens, lengths=lengths, active=act)


def test_proposer_draft():
    prop = NgramProposer(NgramConfig(min_n=2, max_n=3, k=4))
    assert isinstance(prop, Proposer) and prop.k == 4
    rows = [[1, 2, 3, 4, 2, 3],  # docstring example -> [4, 2, 3]
            [1, 2, 3, 4, 5],  # no match -> empty
            [9, 8, 9, 8, 9, 8, 9, 8],  # [8,9,8] at 1 -> [9, 8, 9, 8]
            [5, 6, 5, 6]]  # inactive row -> empty
    ctx = make_ctx(rows, active=[True, True, True, False])
    prop.begin(ctx, GREEDY, None)
    d = prop.propose(ctx, GREEDY, None)
    assert d.q is None and not d.is_tree
    assert d.lengths.tolist() == [3, 0, 4, 0]
    assert d.tokens.tolist() == [[4, 2, 3, -1], [-1] * 4, [9, 8, 9, 8], [-1] * 4]
    # nothing to draft anywhere: a (B, 0) draft
    ctx = make_ctx([[1, 2, 3], [4, 5, 6]])
    d = prop.propose(ctx, GREEDY, None)
    assert d.tokens.shape == (2, 0) and d.lengths.tolist() == [0, 0]


def step(prop, rows, emitted):
    """propose on `rows`, then tell the proposer that `emitted[b]` were committed; return the draft."""
    ctx = make_ctx(rows)
    d = prop.propose(ctx, GREEDY, None)
    for r, e in zip(rows, emitted):
        r.extend(e)
    prop.update(make_ctx(rows), torch.zeros(len(rows), dtype=torch.long))
    return d


def greedy_steps(prop, row, target_next, steps):
    """Simulate greedy verification of one row against a deterministic `target_next(context)`."""
    lens = []
    for _ in range(steps):
        d = prop.propose(make_ctx([row]), GREEDY, None)
        n = int(d.lengths[0])
        lens.append(n)
        acc = 0
        for t in d.tokens[0, :n].tolist():  # accept while the draft equals the target's argmax
            if target_next(row) != t:
                break
            row.append(t)
            acc += 1
        row.append(target_next(row))  # the correction, or the bonus token
        prop.update(make_ctx([row]), torch.tensor([acc]))
    return lens


def test_default_is_stateless():
    # non-adaptive (the default): rejected drafts do not change later drafts
    prop = NgramProposer(NgramConfig(min_n=1, max_n=2, k=3))
    rows = [[1, 2, 3, 4, 1, 2, 3, 4, 1]]
    prop.begin(make_ctx(rows), GREEDY, None)
    for _ in range(5):
        d = step(prop, [list(rows[0])], [[7]])  # always emit 7, never the drafted 2
        assert d.tokens.tolist() == [[2, 3, 4]]


def test_adaptive_stops_and_resumes():
    cfg = NgramConfig(min_n=1, max_n=2, k=4, match="latest", adaptive=True, draft_cost=0.06, memory=0.9)
    prop = NgramProposer(cfg)
    row = [1, 2, 3, 4, 5, 1]
    prop.begin(make_ctx([row]), GREEDY, None)
    fresh = iter(range(100, 10_000))
    # phase 1: after a 1 the target says a never-seen token (the draft "2 3 4 5" is always rejected),
    # after that token it says 1 again
    lens = greedy_steps(prop, row, lambda r: next(fresh) if r[-1] == 1 else 1, 40)
    drafted = [n for n in lens[::2]]  # steps whose context ends in 1 (the others have no match at all)
    assert lens[1::2] == [0] * 20
    assert drafted[0] == 3  # prior a = 0.5, c = 0.06: best k' is 3 (see test_best_draft_length)
    assert drafted == sorted(drafted, reverse=True) and drafted[-1] == 0  # shrinks to no draft at all
    assert prop.acceptance[0] < 0.06
    # phase 2: the target now follows the cycle 1 2 3 4 5; while nothing is drafted the shadow draft
    # is still scored against the one emitted token, so drafting resumes and grows to k
    cycle = {1: 2, 2: 3, 3: 4, 4: 5, 5: 1}
    lens = greedy_steps(prop, row, lambda r: cycle.get(r[-1], 1), 20)
    assert lens[0] == 0 and lens[-1] == 4
    assert prop.acceptance[0] > 0.8


def test_best_draft_length():
    # f(k') = (1 - a^(k'+1)) / ((1 - a)(1 + c k')); a = 0.5, c = 0.06: 1, 1.415, 1.563, 1.589, 1.563
    assert best_draft_length(np.array([0.5]), 4, 0.06).tolist() == [3]
    # a = 0: nothing is ever accepted -> draft nothing; a ~ 1 and free verification -> draft all k
    assert best_draft_length(np.array([0.0, 0.999]), 6, 0.0).tolist() == [0, 6]
    # a = 0.1, c = 0.2: 1.1 / 1.2 < 1 -> no draft
    assert best_draft_length(np.array([0.1]), 5, 0.2).tolist() == [0]


def test_best_draft_length_fixed_block_cost():
    # a = 0.2, c = 0.06: without a fixed cost one token pays (1.2 / 1.06 = 1.13 > 1); a fixed extra
    # cost c0 = 0.25 of any multi-token block makes every draft a loss (1.2 / 1.31, 1.24 / 1.37, ...)
    assert best_draft_length(np.array([0.2]), 5, 0.06).tolist() == [1]
    assert best_draft_length(np.array([0.2]), 5, 0.06, 0.25).tolist() == [0]
    # a = 0.8: worth it either way; the fixed cost, amortised, even favours a longer block
    assert best_draft_length(np.array([0.8]), 8, 0.06).tolist() == [7]
    assert best_draft_length(np.array([0.8]), 8, 0.06, 0.25).tolist() == [8]
    # min_gain: a = 0.2, c = 0.06 gains 13% at best: drafted with a 5% margin, not with a 20% one
    assert best_draft_length(np.array([0.2]), 5, 0.06, 0.0, 0.05).tolist() == [1]
    assert best_draft_length(np.array([0.2]), 5, 0.06, 0.0, 0.2).tolist() == [0]
    with pytest.raises(ValueError):
        NgramConfig(verify_cost_fixed=-0.1)
    with pytest.raises(ValueError):
        NgramConfig(min_gain=float("nan"))
