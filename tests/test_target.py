"""Target wrapper: torch.compile parity and graph reuse, architectures, unsupported models."""
import pytest
import torch
from _devices import DEVICES

from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import tiny_model
from specref.target import Target, TargetConfig


def _compiled_tiny(device, rows):
    """A tiny model, prompts (rows, 9), its compiled Target, and dynamo's counters, reset."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = tiny_model("llama", vocab_size=64, seed=1).to(device)
    ids = torch.randint(0, 64, (rows, 9), generator=torch.Generator().manual_seed(0)).to(device)  # (rows, 9)
    return m, ids, Target(m, TargetConfig(compile=True)), counters


@pytest.mark.devices
@pytest.mark.parametrize("device", DEVICES)
def test_compile_matches_eager_and_reuses_one_graph(device):
    """compile=True: identical greedy tokens; calls with other prompt lengths reuse the graph
    (blocks padded to k+1, cache size rounded up). On CUDA: mode="reduce-overhead" (CUDA graphs)."""
    m, ids, tc, counters = _compiled_tiny(device, rows=2)
    for cut in (9, 6):
        ref = autoregressive_generate(m, ids[:, :cut], max_new_tokens=10, temperature=0)
        out = speculative_generate(tc, DraftModelProposer(m, DraftModelConfig(k=3)), ids[:, :cut],
                                   max_new_tokens=10, temperature=0)
        assert torch.equal(out.tokens, ref.tokens)
    assert counters["stats"]["unique_graphs"] == 1
    if device != "cpu":
        return
    # on CPU the weights are frozen into the graph: changing them afterwards is an error, not stale output
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    with pytest.raises(ValueError, match="froze"):
        autoregressive_generate(tc, ids, max_new_tokens=2, temperature=0)


class _RandomTrees:
    """Trees of a random size (1..k nodes per row, ragged), random parents and random tokens each
    step: deterministic siblings, q = None. Mostly rejected; greedy output must not depend on them."""

    def __init__(self, k, vocab, seed):
        self.k, self.vocab, self.g = k, vocab, torch.Generator().manual_seed(seed)

    def begin(self, ctx, sampling, generator):
        pass

    def propose(self, ctx, sampling, generator):
        from specref.proposer import Draft

        B, k = ctx.tokens.shape[0], self.k
        lengths = torch.randint(1, k + 1, (B,), generator=self.g)  # (B,)
        tokens = torch.randint(0, self.vocab, (B, k), generator=self.g)  # (B, k)
        parents = torch.stack([torch.randint(-1, i, (B,), generator=self.g) if i else torch.full((B,), -1)
                               for i in range(k)], dim=1)  # (B, k): parent index < own index
        real = torch.arange(k).view(1, k) < lengths.view(B, 1)  # (B, k)
        dev = ctx.tokens.device
        return Draft(tokens=torch.where(real, tokens, -1).to(dev), lengths=lengths.to(dev),
                     parents=torch.where(real, parents, -1).to(dev), siblings="deterministic")

    def update(self, ctx, num_accepted):
        pass


@pytest.mark.devices
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_trees_of_any_size_share_one_graph(device):
    """compile=True pads every tree to the proposer's node budget (1 + k positions): ragged trees of
    1..k nodes, at two prompt lengths, run in one compiled graph (every step drafts, so no one-token
    block is compiled), with greedy output equal to eager decoding. Seen failing without the padding
    (4 graphs)."""
    m, ids, tc, counters = _compiled_tiny(device, rows=3)
    for cut in (9, 5):
        ref = autoregressive_generate(m, ids[:, :cut], max_new_tokens=12, temperature=0)
        out = speculative_generate(tc, _RandomTrees(5, 64, seed=cut), ids[:, :cut], max_new_tokens=12,
                                   temperature=0)
        assert torch.equal(out.tokens, ref.tokens)
        assert out.stats.target_forwards > 3  # several steps, trees of several sizes
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma", "phi3", "olmo", "granite", "smollm3",
                                  "starcoder2", "gpt_neox", "gpt2"])
def test_more_architectures_greedy_parity(arch):
    """Decoder-only architectures beyond Llama/Qwen2 (tested in test_generate.py)."""
    m = tiny_model(arch, vocab_size=64, seed=3)
    d = tiny_model(arch, vocab_size=64, seed=4, num_layers=1)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                     do_sample=False, pad_token_id=0)[:, 7:]
    ar = autoregressive_generate(m, ids, mask, max_new_tokens=8, temperature=0)
    sp = speculative_generate(m, DraftModelProposer(d, DraftModelConfig(k=3)), ids, mask,
                              max_new_tokens=8, temperature=0)
    assert torch.equal(ar.tokens, ref)
    assert torch.equal(sp.tokens, ref)


def test_unsupported_models_raise():
    with pytest.raises(ValueError, match="sliding"):
        Target(tiny_model("gemma3_text", vocab_size=64))
    with pytest.raises(ValueError, match="causal"):
        Target(torch.nn.Linear(2, 2))
    # the window bounds positions, not slots: a cache may be longer (a draft's catch-up room), a
    # generation whose tokens would pass the model's 512 positions may not
    m = tiny_model("llama", vocab_size=64)
    assert Target(m).new_cache(1, 10_000).max_len == 10_000
    with pytest.raises(ValueError, match="512 positions"):
        autoregressive_generate(m, torch.zeros(1, 500, dtype=torch.long), max_new_tokens=13, temperature=0)
    autoregressive_generate(m, torch.zeros(1, 500, dtype=torch.long), max_new_tokens=12, temperature=0)
