"""The draft model and the EAGLE head near the end of the model's position window.

Both proposers give their own caches room for rows that sit out steps (the proposer protocol's
rule for rows outside ctx.active) and catch up later in one block; that room is slots, not
positions. A context whose positions fit the model's window must run wherever plain decoding does.
"""
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
