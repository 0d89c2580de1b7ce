"""check_generator: passes specref's decoders, fails a wrong one, on the toy LM and a tiny HF model."""
import pytest
import torch

from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import perturbed_copy, tiny_model
from specref.oracle.generator import check_generator
from specref.sampling import SamplingConfig, logits_to_probs, sample
from specref.oracle.toy import MarkovLM, ToyConfig


def test_toy_direct_sampling_passes_and_greedy_as_sampling_fails():
    lm = MarkovLM.from_config(ToyConfig(vocab=6, order=1, seed=3))
    s = SamplingConfig(1.0)

    def direct(ids, L, gen):  # correct: sample token by token from the exact conditionals
        T = ids.shape[1]
        for i in range(L):
            p = lm.next_probs(ids, torch.full((ids.shape[0],), T + i), s)  # (n, V)
            ids = torch.cat([ids, sample(p, gen).view(-1, 1)], 1)
        return ids[:, T:]

    def argmax_first(ids, L, gen):  # wrong: the first token is greedy
        out = direct(ids, L, gen)
        p = lm.next_probs(ids, torch.full((ids.shape[0],), ids.shape[1]), s)
        out[:, 0] = p.argmax(-1)
        return out

    ok = check_generator(direct, lm, torch.tensor([1, 2]), length=3, samples=20_000)
    assert ok.passed, ok.summary()
    bad = check_generator(argmax_first, lm, torch.tensor([1, 2]), length=3, samples=20_000)
    assert not bad.passed and "FAIL" in bad.summary()


def test_hf_speculative_generate_passes_and_shape_errors_fail():
    V = 16
    target = tiny_model("llama", vocab_size=V, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    draft = perturbed_copy(target, 0.3, seed=0)
    s = SamplingConfig(0.8)

    def spec(ids, L, gen):
        return speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=2)), ids,
                                    max_new_tokens=L, temperature=0.8, generator=gen).tokens

    rep = check_generator(spec, target, torch.tensor([3, 1, 4]), length=2, samples=20_000, sampling=s)
    assert rep.passed, rep.summary()
    assert rep.detectable_tv < 0.1
    short = check_generator(lambda ids, L, gen: ids[:, :0], target, torch.tensor([3, 1, 4]), length=2,
                            samples=100, sampling=s)
    assert not short.passed and short.errors
    with pytest.raises(ValueError):
        check_generator(spec, target, torch.tensor([3]), length=0)
