"""The draft model: near the end of the model's position window (with the EAGLE head), and drafts
whose vocabulary is a padded superset or a subset of the target's.

Both proposers give their own caches room for rows that sit out steps (the proposer protocol's
rule for rows outside ctx.active) and catch up later in one block; that room is slots, not
positions. A context whose positions fit the model's window must run wherever plain decoding does.
"""
import pytest
import torch

from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.eagle_head import EagleConfig, EagleHead, EagleProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import tiny_model


def test_contexts_past_half_the_position_window():
    # 64 positions; a 30-token prompt + 20 new tokens + k: every position < 64, but twice the context
    # is not (the draft's cache used to be refused at 2T + k + 2 > max_position_embeddings)
    target = tiny_model("llama", vocab_size=48, seed=3, max_positions=64)
    draft = tiny_model("llama", vocab_size=48, seed=4, num_layers=1, max_positions=64)
    ids = torch.randint(0, 48, (2, 30), generator=torch.Generator().manual_seed(0))  # (2, 30)
    ar = autoregressive_generate(target, ids, max_new_tokens=20, temperature=0)
    head = EagleHead(target, torch.arange(0, 48, 2))
    for prop in (DraftModelProposer(draft, DraftModelConfig(k=4)), EagleProposer(head, EagleConfig(k=3))):
        sp = speculative_generate(target, prop, ids, max_new_tokens=20, temperature=0)
        assert torch.equal(sp.tokens, ar.tokens), type(prop).__name__


def _padded_draft(target, rows):
    """A perturbed copy of the target whose vocabulary has `rows` rows: padding rows added (with
    large logits, so a draft that scored them would propose ids the target does not have) or the
    last rows dropped."""
    from specref.models import perturbed_copy

    d = perturbed_copy(target, 0.3, seed=0)
    V = target.config.vocab_size
    d.resize_token_embeddings(rows, mean_resizing=False)
    if rows > V:
        with torch.no_grad():
            w = d.get_output_embeddings().weight  # (rows, D)
            w[V:] = 3 * w[:rows - V] + 1.0
    return d


@pytest.mark.two_threads
@pytest.mark.parametrize("rows", [20, 12])  # a padded superset and a subset of the target's 16 ids
def test_padded_vocabulary_draft(rows):
    import numpy as np

    from _stats import power_rows
    from specref import oracle
    from specref.models import tiny_model
    from specref.oracle.exact import hf_joint_distribution
    from specref.sampling import SamplingConfig

    V, L = 16, 3
    target = tiny_model("llama", vocab_size=V, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    draft = _padded_draft(target, rows)
    with pytest.raises(ValueError, match="vocab size"):  # without the declaration: refused, as before
        speculative_generate(target, DraftModelProposer(draft), torch.tensor([[1, 2]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="differ by more than padding"):
        DraftModelProposer(draft, vocab_size=rows + 300)
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(1))  # (3, 6)
    ar = autoregressive_generate(target, ids, max_new_tokens=12, temperature=0)
    sp = speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=3), vocab_size=V), ids,
                              max_new_tokens=12, temperature=0)
    assert torch.equal(sp.tokens, ar.tokens) and sp.stats.num_accepted_tokens > 0
    # sampled drafts with q over the target's 16 ids: the joint of 3 tokens against the exact one
    prompt = torch.tensor([3, 1, 4, 1, 5])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(1.0)).numpy()
    n = power_rows(exact)  # the fewest rows with power 0.99 against TV 0.02
    out = speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=2), vocab_size=V),
                               prompt.expand(n, -1), max_new_tokens=L, temperature=1.0,
                               generator=torch.Generator().manual_seed(rows))
    toks = out.tokens[:, :L].numpy()
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(toks, V), V ** L), exact)
    assert 0.2 < out.stats.acceptance_rate < 0.95 and np.all(toks < V)
    assert res.p_value > 1e-3, res
