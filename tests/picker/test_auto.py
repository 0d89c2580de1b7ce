"""picker/auto.py: `auto` builds on a tiny model at B = 1 and B = 4 and is greedy token-exact against
`ar` (speculative_generate and the request queue); its costs are the calibration's at B; a pick of
"ar" runs plain decoding; the bench runs `auto` as a method."""
import pytest
import torch

from specref.batch_k import BatchKProposer, StepCosts, choose_k
from specref.generate import NullProposer, autoregressive_generate, speculative_generate
from specref.models import tiny_model
from specref.picker.auto import AutoConfig, build_auto
from specref.registry import Registry
from specref.scheduler import schedule

V = 64
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4, 3], [20, 21, 22, 23, 20, 21]]


@pytest.fixture(scope="module")
def reg():
    model = tiny_model("llama", vocab_size=V, seed=3, num_heads=2, num_kv_heads=1)
    return Registry(model, kind="tiny", cost_reps=1)


@pytest.mark.parametrize("B", [1, 4])
def test_auto_builds_and_is_greedy_token_exact(reg, B):
    cfg = AutoConfig(batch_size=B, max_new_tokens=8, methods=("ngram", "eagle"), budget_s=None)
    a = build_auto(reg.model, PROMPTS, cfg, reg)
    assert a.method in ("ar", "ngram", "eagle")
    assert a.recommendation.calibration.config.batch_size == B
    if a.method == "ar":
        assert isinstance(a.proposer, NullProposer) and a.fresh(reg) is None and a.costs is None
    else:
        assert isinstance(a.proposer, BatchKProposer) and B in a.costs.verify
    ids = torch.tensor(PROMPTS[0])[None]
    for run in range(2):  # the proposer auto built, then a fresh one of the same pick
        p = a.proposer if run == 0 else (a.fresh(reg) or NullProposer())
        out = speculative_generate(reg.target, p, ids, max_new_tokens=12, temperature=0)
        assert out.row(0) == autoregressive_generate(reg.target, ids, max_new_tokens=12, temperature=0).row(0)
    refs = [autoregressive_generate(reg.target, torch.tensor(p)[None], max_new_tokens=10, temperature=0).row(0)
            for p in PROMPTS]
    out = schedule(reg.target, a.fresh(reg) or NullProposer(), PROMPTS + PROMPTS[:2], batch_size=B,
                   max_new_tokens=10, temperature=0)
    assert out.tokens == refs + refs[:2]
    assert out.stats.idle_row_steps == 0


def test_auto_takes_the_costs_at_b_and_can_pick_plain_decoding(reg):
    """At B > 1 the calibration measures the verify curve of B rows (its ratios are the picker's
    v(W)); a step-cost table where verification is compute-bound makes every step plain decoding."""
    cal_b = build_auto(reg.model, PROMPTS, AutoConfig(batch_size=4, max_new_tokens=8, methods=("ngram",),
                                                      budget_s=None), reg).recommendation.calibration
    assert cal_b.step_costs is not None and list(cal_b.step_costs.verify) == [4]
    t = cal_b.step_costs.verify[4]
    assert cal_b.verify_ratios == pytest.approx([x / t[0] for x in t])
    bound = StepCosts({4: [1.0, 2.0, 3.0, 4.0]})  # compute-bound: k = 0 whatever the acceptance
    import numpy as np
    assert choose_k(bound, np.full(4, 0.9), 3) == 0
    with pytest.raises(ValueError, match="auto"):
        AutoConfig(methods=("auto",))
    with pytest.raises(ValueError, match="batch_size"):
        AutoConfig(batch_size=0)
