"""batch_k.py: k chosen from the costs at the batch's size (k = 0 when verification is
compute-bound), a row's draft cut at its first unconfident token; greedy parity. The chi-square of
steps whose k changes per step and per row: tests/test_scheduler.py::test_refilled_rows_lossless."""
import numpy as np
import pytest
import torch

from specref.batch_k import BatchKConfig, BatchKProposer, StepCosts, choose_k, measure_step_costs
from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import perturbed_copy, tiny_model
from specref.proposer import Draft
from specref.scheduler import Request, schedule


def test_choose_k_from_the_costs():
    a = np.full(8, 0.7)  # 8 rows accepting 70%: E(k) = 1, 1.7, 2.19, 2.53
    flat = StepCosts({8: [1.0, 1.0, 1.0, 1.0]})  # memory-bound: a wider block costs nothing more
    assert choose_k(flat, a, 3) == 3
    bound = StepCosts({8: [1.0, 2.0, 3.0, 4.0]})  # compute-bound: cost grows with the block
    assert choose_k(bound, a, 3) == 0  # plain decoding wins
    mid = StepCosts({8: [1.0, 1.2, 1.8, 2.4]})  # 1.7 / 1.2 = 1.42 > 2.19 / 1.8 = 1.22
    assert choose_k(mid, a, 3) == 1
    assert choose_k(mid, np.full(8, 0.1), 3) == 0  # rows that reject: no drafts
    by_b = StepCosts({1: [1.0, 1.0, 1.0], 64: [10.0, 20.0, 30.0]})  # small batches memory-, large compute-bound
    assert choose_k(by_b, np.full(2, 0.7), 2) == 2 and choose_k(by_b, np.full(64, 0.7), 2) == 0
    assert by_b.step(32, 1) == pytest.approx(1.0 + (20.0 - 1.0) * 31 / 63)  # interpolated in B
    assert choose_k(flat, np.zeros(0), 3) == 0
    with pytest.raises(ValueError, match="threshold"):
        BatchKProposer(DraftModelProposer(tiny_model("llama", vocab_size=16, seed=1)), BatchKConfig(threshold=0.0))


class _Fixed:
    """Drafts the same 3 tokens with the given q rows for every row (a hand-built draft)."""

    k = 3

    def __init__(self, q):
        self.q = q  # (B, 3, V)

    def begin(self, ctx, sampling, generator):
        pass

    def propose(self, ctx, sampling, generator):
        B = ctx.tokens.shape[0]
        return Draft(tokens=torch.tensor([[1, 2, 3]] * B), lengths=torch.full((B,), 3), q=self.q)

    def update(self, ctx, num_accepted):
        pass


def test_threshold_cuts_after_the_first_unconfident_token():
    V = 5
    q = torch.full((3, 3, V), 0.1)
    q[0, :, [1, 2, 3]] = torch.tensor([0.9, 0.9, 0.9])  # row 0: every token confident: all 3 kept
    q[1, :, [1, 2, 3]] = torch.tensor([0.9, 0.2, 0.9])  # row 1: x_2 unconfident: kept, x_3 cut
    q[2, :, [1, 2, 3]] = torch.tensor([0.3, 0.9, 0.9])  # row 2: x_1 unconfident: only x_1
    prop = BatchKProposer(_Fixed(q), BatchKConfig(threshold=0.5))
    from specref.proposer import Context
    ctx = Context(tokens=torch.zeros(3, 8, dtype=torch.long), lengths=torch.full((3,), 2),
                  active=torch.ones(3, dtype=torch.bool))
    prop.begin(ctx, None, None)
    d = prop.propose(ctx, None, None)
    assert d.lengths.tolist() == [3, 2, 1]
    assert d.tokens.tolist() == [[1, 2, 3], [1, 2, -1], [1, -1, -1]]
    prop.update(ctx, torch.tensor([3, 1, 0]))
    assert prop.acc.rate[0] > prop.acc.rate[1] > prop.acc.rate[2]  # per-row acceptance tracked


def test_greedy_token_exact_with_k_changing_per_step():
    target = tiny_model("llama", vocab_size=16, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    draft = perturbed_copy(target, 0.3, seed=0)
    by_b = StepCosts({1: [1.0, 1.0, 1.0, 1.0], 3: [3.0, 5.0, 7.0, 9.0]})  # 3 rows: k = 0; fewer: k = 3
    g = torch.Generator().manual_seed(2)
    reqs = [Request(torch.randint(0, 16, (int(n),), generator=g).tolist(), max_new_tokens=int(m))
            for n, m in zip(torch.randint(1, 8, (7,), generator=g), torch.randint(2, 12, (7,), generator=g))]
    ref = [autoregressive_generate(target, torch.tensor(r.prompt), max_new_tokens=r.max_new_tokens,
                                   temperature=0).row(0) for r in reqs]
    prop = BatchKProposer(DraftModelProposer(draft, DraftModelConfig(k=3)), BatchKConfig(costs=by_b))
    out = schedule(target, prop, reqs, batch_size=3, temperature=0)
    assert out.tokens == ref
    assert out.stats.idle_row_steps == 0
    assert prop.ks[0] == 0 and max(prop.ks) > 0  # plain steps while 3 rows decode, drafts in the tail
    ids = torch.tensor([reqs[0].prompt])
    one = speculative_generate(target, BatchKProposer(DraftModelProposer(draft, DraftModelConfig(k=3)),
                                                      BatchKConfig(costs=by_b)), ids, max_new_tokens=8, temperature=0)
    assert one.row(0) == autoregressive_generate(target, ids, max_new_tokens=8, temperature=0).row(0)
    assert one.stats.num_drafts > 0


def test_measure_step_costs():
    target = tiny_model("llama", vocab_size=16, seed=11)
    draft = tiny_model("llama", vocab_size=16, seed=12, num_layers=1)
    c = measure_step_costs(target, [1, 4], 2, proposer_factory=lambda k: DraftModelProposer(
        draft, DraftModelConfig(k=k)), cache_len=16, reps=2)
    assert sorted(c.verify) == [1, 4] and all(len(v) == 3 and min(v) > 0 for v in c.verify.values())
    assert all(len(d) == 3 and d[0] == 0.0 and min(d[1:]) > 0 for d in c.draft.values())
    assert c.step(4, 2) > c.step(4, 0) > 0
