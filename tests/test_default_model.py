"""Greedy parity on the embedded default model (SmolLM2-135M-Instruct), float32.

speculative_generate == autoregressive_generate == HF generate(do_sample=False), batch 1 and 4 with
prompts of different lengths, k = 4, a draft model (the target's first 2 layers: mostly
rejected) and the target itself as draft (always accepted: exercises full accepts); the committed
Medusa heads (two tree shapes), the Hydra heads on the EAGLE-1 head, MTP modules (D = 2, and D = 1 reused for k = 3), the MLP speculator
and the committed EAGLE-1 head growing EAGLE-2 dynamic trees, the committed EAGLE-3 head (chains and trees).
"""
import pytest
import torch

from specref.draft_model import DraftModelConfig, DraftModelProposer, truncated_draft
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import load_default
from specref.ngram import NgramConfig, NgramProposer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]
N_NEW = 20


@pytest.fixture(scope="module")
def default():
    model, tok = load_default()
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                     tokenize=False) for p in PROMPTS]
    enc = tok(texts, return_tensors="pt", padding=True)
    ar = autoregressive_generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=N_NEW, temperature=0)
    return model, tok, enc, ar


def test_autoregressive_equals_hf_generate(default):
    """Both stop at eos (HF's min_new_tokens would suppress eos, so it is not used)."""
    model, tok, enc, _ = default
    eos = model.generation_config.eos_token_id
    ar = autoregressive_generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=N_NEW,
                                 temperature=0, eos_token_id=eos)
    hf = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=N_NEW,
                        do_sample=False, pad_token_id=tok.pad_token_id)[:, enc.input_ids.shape[1]:]
    for b in range(len(PROMPTS)):
        n = int(ar.num_tokens[b])
        assert ar.row(b) == hf[b, :n].tolist()
        assert (hf[b, n:] == tok.pad_token_id).all()  # HF pads the row after its eos


@pytest.mark.parametrize("k", [4])  # k = 1 and 8: the tiny models (test_generate.py)
def test_draft_model_greedy_parity(default, k):
    model, tok, enc, ar = default
    draft = truncated_draft(model, 2)
    out = speculative_generate(model, DraftModelProposer(draft, DraftModelConfig(k=k)), enc.input_ids,
                               enc.attention_mask, max_new_tokens=N_NEW, temperature=0)
    assert torch.equal(out.tokens, ar.tokens)
    # batch 1: the shortest prompt alone
    row = enc.input_ids[0][enc.attention_mask[0].bool()]
    one = speculative_generate(model, DraftModelProposer(draft, DraftModelConfig(k=k)), row,
                               max_new_tokens=N_NEW, temperature=0)
    assert one.row(0) == ar.row(0)


def test_self_draft_and_ngram_parity(default):
    model, tok, enc, ar = default
    # without eos (the model's generation_config sets one: `ar` stops there) every draft is emitted
    full = speculative_generate(model, DraftModelProposer(model, DraftModelConfig(k=4)), enc.input_ids,
                                enc.attention_mask, max_new_tokens=N_NEW, temperature=0, eos_token_id=None)
    assert all(full.row(b)[: int(ar.num_tokens[b])] == ar.row(b) for b in range(len(PROMPTS)))
    assert full.stats.acceptance_rate == 1.0
    ng = speculative_generate(model, NgramProposer(NgramConfig(k=4)), enc.input_ids, enc.attention_mask,
                              max_new_tokens=N_NEW, temperature=0)
    assert torch.equal(ng.tokens, ar.tokens)
    assert ng.stats.num_accepted_tokens > 0  # the repetition prompt is copied


def test_committed_medusa_heads_greedy_parity(default):
    """The committed heads over the tree their file ships and a wide tree: batch 4 with
    ragged prompts equals plain greedy decoding for each; batch 1 (the shipped tree) too."""
    from specref.medusa_heads import MedusaConfig, MedusaProposer, load_medusa

    model, tok, enc, ar = default
    heads = load_medusa(model)
    wide = ((0,), (1,), (2,), (3,), (4,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0))
    for choices in (None, wide):  # (a chain of heads: test_medusa.py, tiny models)
        out = speculative_generate(model, MedusaProposer(heads, MedusaConfig(choices=choices)), enc.input_ids,
                                   enc.attention_mask, max_new_tokens=N_NEW, temperature=0)
        assert torch.equal(out.tokens, ar.tokens), choices
        assert out.stats.num_accepted_tokens > 0
    row = enc.input_ids[2][enc.attention_mask[2].bool()]
    one = speculative_generate(model, MedusaProposer(heads), row, max_new_tokens=N_NEW, temperature=0)
    assert one.row(0) == ar.row(2)


def test_committed_hydra_heads_greedy_parity(default):
    """The committed Hydra heads, whose EAGLE-1 prefix is read from the committed EAGLE-1 file (the
    file references it): the prefix equals that head, and batch 4 with ragged prompts over the tree
    the file ships equals plain greedy decoding, with drafts accepted."""
    from specref.eagle_head import load_eagle
    from specref.medusa_heads import HYDRA_WEIGHTS, MedusaConfig, MedusaProposer, load_medusa

    model, tok, enc, ar = default
    heads = load_medusa(model, HYDRA_WEIGHTS)
    eagle = load_eagle(model)
    assert heads.sequential and heads.prefix_kind == "eagle"
    for (n, q), (m, w) in zip(heads.prefix.named_parameters(), eagle.named_parameters(), strict=True):
        assert n == m and torch.equal(q, w), n
    out = speculative_generate(model, MedusaProposer(heads, MedusaConfig()), enc.input_ids, enc.attention_mask,
                               max_new_tokens=N_NEW, temperature=0)
    assert torch.equal(out.tokens, ar.tokens)
    assert out.stats.num_accepted_tokens > 0


def test_committed_mtp_modules_greedy_parity(default):
    """The committed MTP modules: D = 2 drafting 2 tokens, and module 1 alone reused on its own
    output for k = 3; batch 4 with ragged prompts for both, batch 1 for the reused module."""
    from specref.mtp import MTPConfig, MTPProposer, load_mtp

    model, tok, enc, ar = default
    stack = load_mtp(model)
    for cfg in (MTPConfig(k=2), MTPConfig(k=3, modules=1)):
        out = speculative_generate(model, MTPProposer(stack, cfg), enc.input_ids, enc.attention_mask,
                                   max_new_tokens=N_NEW, temperature=0)
        assert torch.equal(out.tokens, ar.tokens), cfg
        assert out.stats.num_accepted_tokens > 0
    row = enc.input_ids[1][enc.attention_mask[1].bool()]
    one = speculative_generate(model, MTPProposer(stack, MTPConfig(k=3, modules=1)), row, max_new_tokens=N_NEW,
                               temperature=0)
    assert one.row(0) == ar.row(1)


def test_committed_mlp_speculator_greedy_parity(default):
    """The committed MLP speculator: its 3 tied stages as a chain, batch 4 with ragged prompts and batch 1."""
    from specref.mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorProposer, load_mlp_speculator

    model, tok, enc, ar = default
    spec = load_mlp_speculator(model)
    out = speculative_generate(model, MLPSpeculatorProposer(spec, MLPSpeculatorConfig(k=3)), enc.input_ids,
                               enc.attention_mask, max_new_tokens=N_NEW, temperature=0)
    assert torch.equal(out.tokens, ar.tokens) and out.stats.num_accepted_tokens > 0
    row = enc.input_ids[2][enc.attention_mask[2].bool()]
    one = speculative_generate(model, MLPSpeculatorProposer(spec, MLPSpeculatorConfig(k=3)), row,
                               max_new_tokens=N_NEW, temperature=0)
    assert one.row(0) == ar.row(2)


def test_committed_eagle_head_dynamic_tree_greedy_parity(default):
    """EAGLE-2 trees from the committed EAGLE-1 head (the CPU defaults: ragged rows by min_value),
    batch 4 with ragged prompts and batch 1."""
    from specref.eagle_head import load_eagle
    from specref.eagle_tree import Eagle2Proposer

    model, tok, enc, ar = default
    head = load_eagle(model)
    prop = Eagle2Proposer(head)
    out = speculative_generate(model, prop, enc.input_ids, enc.attention_mask, max_new_tokens=N_NEW, temperature=0)
    assert torch.equal(out.tokens, ar.tokens)
    assert out.stats.num_accepted_tokens > 0 and len(set(prop.tree_sizes)) > 1  # accepted; ragged trees
    row = enc.input_ids[0][enc.attention_mask[0].bool()]
    one = speculative_generate(model, Eagle2Proposer(head), row, max_new_tokens=N_NEW, temperature=0)
    assert one.row(0) == ar.row(0)


def test_committed_eagle3_head_greedy_parity(default):
    """The committed EAGLE-3 head (fused layers 2, 15, 27): chains and EAGLE-2 trees, batch 4 with
    ragged prompts; the chain at batch 1."""
    from specref.eagle3 import load_eagle3
    from specref.eagle_head import EagleConfig, EagleProposer
    from specref.eagle_tree import Eagle2Proposer

    model, tok, enc, ar = default
    head = load_eagle3(model)
    out = speculative_generate(model, EagleProposer(head, EagleConfig(k=3)), enc.input_ids, enc.attention_mask,
                               max_new_tokens=N_NEW, temperature=0)
    assert torch.equal(out.tokens, ar.tokens) and out.stats.num_accepted_tokens > 0
    out = speculative_generate(model, Eagle2Proposer(head), enc.input_ids, enc.attention_mask, max_new_tokens=N_NEW,
                               temperature=0)
    assert torch.equal(out.tokens, ar.tokens)
    row = enc.input_ids[3][enc.attention_mask[3].bool()]  # batch 1: the chain (the tree's batch 1 is EAGLE-2's test)
    one = speculative_generate(model, EagleProposer(head, EagleConfig(k=3)), row, max_new_tokens=N_NEW, temperature=0)
    assert one.row(0) == ar.row(3)


def test_processors_greedy_parity_with_transformers(default):
    """repetition_penalty 1.2, no_repeat_ngram_size 3, min_new_tokens 8: batch 4 (ragged) for
    n-gram, the committed EAGLE head and the committed Medusa tree, batch 1 for the
    tree, each equal to transformers' generate with the same processors on each row alone (a
    batched generate's processors would read its left padding as context)."""
    from specref.eagle_head import EagleConfig, EagleProposer, load_eagle
    from specref.medusa_heads import MedusaProposer, load_medusa

    model, tok, enc, _ = default
    procs = dict(repetition_penalty=1.2, no_repeat_ngram_size=3, min_new_tokens=8)
    eos, n = model.generation_config.eos_token_id, 12  # min_new_tokens 8 acts on most of them
    want = []
    for b in range(len(PROMPTS)):
        r = enc.input_ids[b][enc.attention_mask[b].bool()].view(1, -1)
        out = model.generate(input_ids=r, attention_mask=torch.ones_like(r), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id, **procs)[0, r.shape[1]:].tolist()
        want.append(out[: out.index(eos) + 1] if eos in out else out)
    props = {"ngram": lambda: NgramProposer(NgramConfig(k=4)),  # a draft model: tests/hf/test_processors.py
             "eagle": lambda: EagleProposer(load_eagle(model), EagleConfig(k=3)),
             "medusa": lambda: MedusaProposer(load_medusa(model))}
    for name, make in props.items():
        out = speculative_generate(model, make(), enc.input_ids, enc.attention_mask, max_new_tokens=n,
                                   temperature=0, **procs)
        assert [out.row(b) for b in range(len(PROMPTS))] == want, name
    one = speculative_generate(model, props["medusa"](), enc.input_ids[3][enc.attention_mask[3].bool()],
                               max_new_tokens=n, temperature=0, **procs)
    assert one.row(0) == want[3]
