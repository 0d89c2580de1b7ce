"""The whole loop: greedy parity, lossless sampling (chi-square vs exact), batch independence, errors."""
import zlib

import numpy as np
import pytest
import torch

from _devices import DEVICES
from _stats import power_rows, power_sample_size
from specref import oracle
from specref.draft_model import DraftModelConfig, DraftModelProposer, truncated_draft
from specref.oracle.exact import hf_joint_distribution
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import perturbed_copy, tiny_model
from specref.sampling import SamplingConfig

ALPHA = 1e-3
N_ROWS = 80_000  # rows per whole-loop chi-square run (one batch); power asserted in each test


def _stat_pair():
    """A peaked V=16 target whose context matters, and a perturbed copy as the draft (accepted
    56-81% of the time in these cases: rejections and full accepts both occur)."""
    target = tiny_model("llama", vocab_size=16, seed=11, init_std=0.2, logit_scale=4.0,
                        num_heads=2, num_kv_heads=1)
    return target, perturbed_copy(target, 0.3, seed=0)


def _prompts(vocab, lengths, seed=0):
    """Left-padded prompts of different lengths + attention mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, T - n:] = 1
    return ids, mask


def _hf_greedy(model, ids, mask, n):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.devices
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_tiny(arch, device):
    target = tiny_model(arch, vocab_size=96, seed=1).to(device)
    drafts = {
        "other": tiny_model(arch, vocab_size=96, seed=2, num_layers=1).to(device),  # mostly rejected
        "self": target,  # always accepted: exercises full accepts and the bonus token
        "trunc": truncated_draft(target, 1),
    }
    for lengths in ([7], [3, 9, 5, 12]):
        ids, mask = (t.to(device) for t in _prompts(96, lengths, seed=len(lengths)))
        n = 20
        ar = autoregressive_generate(target, ids, mask, max_new_tokens=n, temperature=0)
        hf = _hf_greedy(target, ids, mask, n)
        assert torch.equal(ar.tokens, hf), "autoregressive_generate != HF generate"
        for name, d in drafts.items():
            for k in (1, 4, 8):
                sp = speculative_generate(target, DraftModelProposer(d, DraftModelConfig(k=k)), ids, mask,
                                          max_new_tokens=n, temperature=0)
                assert torch.equal(sp.tokens, ar.tokens), (arch, name, k, lengths)
                if name == "self":
                    assert sp.stats.acceptance_rate == 1.0


def test_batch_independence_and_eos():
    target = tiny_model("llama", vocab_size=64, seed=5)
    draft = tiny_model("llama", vocab_size=64, seed=6, num_layers=1)
    ids, mask = _prompts(64, [4, 10, 6], seed=3)
    full = speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=3)), ids, mask,
                                max_new_tokens=16, temperature=0)
    for b in range(3):
        alone = speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=3)),
                                     ids[b][mask[b].bool()], max_new_tokens=16, temperature=0)
        assert alone.row(0) == full.row(b)
    # eos: stop each row at its first eos, even inside an accepted run
    eos = full.row(1)[5]
    cut = speculative_generate(target, DraftModelProposer(target, DraftModelConfig(k=4)), ids, mask,
                               max_new_tokens=16, temperature=0, eos_token_id=eos)
    for b in range(3):
        row = full.row(b)
        stop = row.index(eos) + 1 if eos in row else len(row)
        assert cut.row(b) == row[:stop]
        assert (cut.tokens[b, stop:] == -1).all()


class _Oracle:
    """Drafts the next k tokens of a known greedy continuation `cont` of the prompt (length P):
    every draft is accepted. As a chain, or as the same chain written as a tree."""

    def __init__(self, cont, P, k, tree=False):
        self.cont, self.P, self.k, self.tree = cont, P, k, tree

    def begin(self, ctx, sampling, generator):
        pass

    def propose(self, ctx, sampling, generator):
        from specref.proposer import Draft

        i = int(ctx.lengths[0]) - self.P  # tokens emitted so far
        toks = torch.tensor([self.cont[i:i + self.k]])  # (1, k)
        n = torch.tensor([toks.shape[1]])  # (1,)
        if not self.tree:
            return Draft(tokens=toks, lengths=n)
        return Draft(tokens=toks, lengths=n, parents=torch.arange(toks.shape[1]).view(1, -1) - 1)

    def update(self, ctx, num_accepted):
        pass


@pytest.mark.parametrize("tree", [False, True])
def test_accepted_counts_stop_at_eos_and_the_token_budget(tree):
    # every draft is right, so a step accepts all k; but tokens past an eos or the budget are not
    # emitted, and neither are they counted as accepted (num_accepted_tokens <= emitted tokens)
    target = tiny_model("llama", vocab_size=64, seed=5)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))  # (1, 6)
    cont = autoregressive_generate(target, ids, max_new_tokens=12, temperature=0).row(0)
    eos = next(t for i, t in enumerate(cont) if i >= 1 and t not in cont[:i])  # first new token at >= 1
    stop = cont.index(eos) + 1
    cut = speculative_generate(target, _Oracle(cont, 6, 4, tree), ids, max_new_tokens=12, temperature=0,
                               eos_token_id=eos)
    assert cut.row(0) == cont[:stop]
    s = cut.stats
    assert s.num_accepted_tokens == s.num_emitted_tokens == stop  # every emitted token was a draft
    assert s.num_accepted_tokens == sum(s.accepted_per_position)
    short = speculative_generate(target, _Oracle(cont, 6, 4, tree), ids, max_new_tokens=3, temperature=0)
    assert short.row(0) == cont[:3]
    assert short.stats.num_accepted_tokens <= 3 and sum(short.stats.accepted_per_position) <= 3


def _joint_counts(out, V, L):
    toks = out.tokens[:, :L].cpu().numpy()
    assert (toks >= 0).all()
    return oracle.counts(oracle.joint_index(toks, V), V ** L)


@pytest.mark.two_threads
@pytest.mark.parametrize("case", [
    # (temperature, top_k, top_p, greedy draft, k)
    (1.0, 0, 1.0, False, 2),  # plain sampling, sampled draft with q
    (0.7, 5, 1.0, False, 3),  # temperature + top-k applied to p and q
    (1.0, 0, 0.9, True, 2),  # top-p, deterministic (argmax) draft: q = None
    (0.7, 5, 1.0, True, 1),  # temperature + top-k, deterministic draft
])
def test_whole_loop_lossless(case):
    """Joint of the first 3 tokens from speculative_generate vs the exact distribution (V = 16).

    One batch of n rows, the fewest (in steps of 5,000, at most 80,000) for which the sample size
    that detects a TV deviation of 0.02 with probability >= 0.99 at 1e-3 (on the partition the test
    uses after pooling) is <= n: 75,000 for T = 1, 50,000 with top-k, 40,000 with top-p.
    """
    temperature, top_k, top_p, greedy_draft, k = case
    V, L = 16, 3
    target, draft = _stat_pair()
    prompt = torch.tensor([3, 1, 4, 1, 5])
    s = SamplingConfig(temperature, top_k, top_p)
    exact = hf_joint_distribution(target, prompt, L, s).numpy()
    n = power_rows(exact, N_ROWS)
    prop = DraftModelProposer(draft, DraftModelConfig(k=k, greedy_draft=greedy_draft))
    out = speculative_generate(target, prop, prompt.expand(n, -1), max_new_tokens=L,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               generator=torch.Generator().manual_seed(zlib.crc32(repr(case).encode())))  # not hash(): salted per process
    res = oracle.chi_square_gof(_joint_counts(out, V, L), exact)
    assert 0.3 < out.stats.acceptance_rate < 0.95  # the draft is neither useless nor the target
    assert res.p_value > ALPHA, res


@pytest.mark.devices
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [
    # (temperature, top_k, top_p, greedy draft, k)
    (1.0, 0, 1.0, False, 2),  # plain sampling, sampled draft with q
    (0.7, 5, 1.0, True, 3),  # temperature + top-k, deterministic draft
])
def test_whole_loop_lossless_in_low_precision(case, dtype, device):
    """The loop with a bf16 / fp16 target and draft (bf16 linears packed for oneDNN where the CPU
    supports it): the joint of the first 3 tokens against the exact joint of the same low-precision
    model (its own p; sampling and rejection run in float32). Power as test_whole_loop_lossless."""
    temperature, top_k, top_p, greedy_draft, k = case
    V, L = 16, 3
    target, draft = _stat_pair()
    target, draft = target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype)
    assert {p.dtype for p in target.parameters()} == {dtype}
    prompt = torch.tensor([3, 1, 4, 1, 5], device=device)
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k, top_p)).numpy()
    n = power_rows(exact, N_ROWS)
    prop = DraftModelProposer(draft, DraftModelConfig(k=k, greedy_draft=greedy_draft))
    out = speculative_generate(target, prop, prompt.expand(n, -1), max_new_tokens=L,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               generator=torch.Generator().manual_seed(zlib.crc32(repr((case, str(dtype))).encode())))
    res = oracle.chi_square_gof(_joint_counts(out, V, L), exact)
    assert 0.3 < out.stats.acceptance_rate < 0.95
    assert res.p_value > ALPHA, res


def test_whole_loop_catches_a_wrong_verifier(monkeypatch):
    """The same test fails when the rejection step ignores q (accepts every draft token); 25,000
    rows are plenty for a deviation this large (p ~ 0 at 80,000 before)."""
    from specref import rejection

    V, L, n = 16, 3, 25_000
    target, draft = _stat_pair()
    prompt = torch.tensor([3, 1, 4, 1, 5])
    s = SamplingConfig(1.0)
    exact = hf_joint_distribution(target, prompt, L, s).numpy()

    def accept_all(draft_tokens, p, q=None, *, lengths=None, generator=None, validate=True, draws=None):
        B, K = draft_tokens.shape
        lengths = (draft_tokens >= 0).sum(1) if lengths is None else lengths
        bonus = torch.multinomial(p[torch.arange(B), lengths], 1, generator=torch.Generator().manual_seed(0))
        toks = torch.cat([draft_tokens, torch.full((B, 1), -1)], 1)
        toks[torch.arange(B), lengths] = bonus[:, 0]
        return rejection.ChainResult(tokens=toks, num_accepted=lengths)

    monkeypatch.setattr(rejection, "verify_chain", accept_all)
    out = speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=2)),
                               prompt.expand(n, -1), max_new_tokens=L, temperature=1.0, seed=0)
    assert oracle.chi_square_gof(_joint_counts(out, V, L), exact).p_value < ALPHA


@pytest.mark.two_threads
def test_autoregressive_sampling_lossless():
    V, L = 16, 3
    target = tiny_model("qwen2", vocab_size=V, seed=4, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    prompt = torch.tensor([2, 7])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(0.8, 0, 0.95)).numpy()
    n = power_rows(exact, N_ROWS)
    out = autoregressive_generate(target, prompt.expand(n, -1), max_new_tokens=L, temperature=0.8,
                                  top_p=0.95, generator=torch.Generator().manual_seed(1))
    assert oracle.chi_square_gof(_joint_counts(out, V, L), exact).p_value > ALPHA


def test_seeded_rows_reproduce():
    target = tiny_model("llama", vocab_size=64, seed=5)
    draft = tiny_model("llama", vocab_size=64, seed=6, num_layers=1)
    ids, mask = _prompts(64, [4, 10], seed=3)
    a = speculative_generate(target, DraftModelProposer(draft), ids, mask, max_new_tokens=12, seed=7)
    b = speculative_generate(target, DraftModelProposer(draft), ids, mask, max_new_tokens=12, seed=7)
    assert torch.equal(a.tokens, b.tokens)
    # row 1 alone with its own generator (seed 7 + 1) reproduces row 1 of the batch
    c = speculative_generate(target, DraftModelProposer(draft), ids[1][mask[1].bool()],
                             max_new_tokens=12, generator=[torch.Generator().manual_seed(8)])
    assert c.row(0) == a.row(1)


def test_bad_input_raises():
    target = tiny_model("llama", vocab_size=64, seed=5)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="vocab"):
        speculative_generate(target, DraftModelProposer(tiny_model("llama", vocab_size=32)), ids,
                             max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        autoregressive_generate(target, ids, torch.zeros_like(ids), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        autoregressive_generate(target, ids, max_new_tokens=-1)
    with pytest.raises(ValueError, match="k must be"):
        DraftModelConfig(k=0)
    with pytest.raises(ValueError, match="max_len"):
        autoregressive_generate(target, ids, max_new_tokens=8, max_len=6)
    with pytest.raises(ValueError, match="outside"):
        autoregressive_generate(target, torch.tensor([[1, 64]]), max_new_tokens=2)
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match="causal"):
        autoregressive_generate(bert, ids, max_new_tokens=2)
    assert autoregressive_generate(target, ids, max_new_tokens=0).tokens.shape == (1, 0)


def test_the_loop_files_export_what_the_loop_uses():
    # generate.py's preparation and counters live beside it (prepare.py, counters.py); the public
    # GenerationStats is the counters' class
    from specref import GenerationStats, counters, prepare
    assert counters.GenerationStats is GenerationStats
    assert callable(prepare.prepare) and "max_new_tokens" in prepare.Run.__dataclass_fields__
