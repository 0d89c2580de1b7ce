"""Context-reading logits processors through the loop: greedy parity with transformers' generate,
chi-square against the exact joint with the processor applied along each path, and the mutant."""
import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from _stats import power_sample_size
from specref import oracle
from specref.hf import processors
from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.eagle_head import EagleConfig, EagleHead, EagleProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.medusa_heads import MedusaConfig, MedusaHeads, MedusaProposer
from specref.models import perturbed_copy, tiny_model
from specref.ngram import NgramConfig, NgramProposer
from specref.oracle.exact import hf_joint_distribution
from specref.sampling import SamplingConfig
from test_tree_generate import SHAPES, BigramTreeProposer, bigram_table

ALPHA = 1e-3
PROCS = dict(repetition_penalty=1.2, no_repeat_ngram_size=3, min_new_tokens=6)


def _prompts(V, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(0, V, (n,), generator=g)  # a repeated token or two: the
        ids[b, T - 1] = ids[b, T - n]  # penalty and the n-gram ban bite from the first step
        mask[b, T - n:] = 1
    return ids, mask


def _hf_rows(model, ids, mask, n, eos):
    """transformers' greedy output of each row ALONE (its processors read a batch's left padding as
    context; specref's rows never see padding), cut after the row's first eos."""
    rows = []
    for b in range(ids.shape[0]):
        r = ids[b][mask[b].bool()].view(1, -1)
        out = model.generate(input_ids=r, attention_mask=torch.ones_like(r), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, **PROCS)[0, r.shape[1]:].tolist()
        rows.append(out[: out.index(eos) + 1] if eos in out else out)
    return rows


def _proposers(target):
    torch.manual_seed(0)
    V = target.config.vocab_size
    return {
        "draft": lambda: DraftModelProposer(perturbed_copy(target, 0.3, seed=1), DraftModelConfig(k=3)),
        "ngram": lambda: NgramProposer(NgramConfig(k=4, min_n=1)),
        "eagle": lambda: EagleProposer(EagleHead(target, torch.arange(V), seed=0), EagleConfig(k=3)),
        "medusa_tree": lambda: MedusaProposer(MedusaHeads(target, 2), MedusaConfig(choices=[[0], [1], [0, 0], [1, 0]])),
        "bigram_tree": lambda: BigramTreeProposer(bigram_table(target, V), SHAPES["mixed"], sampled=False),
    }


def test_greedy_parity_with_transformers_processors():
    """repetition_penalty 1.2, no_repeat_ngram_size 3, min_new_tokens 6; batch 1 and 4 ragged:
    every proposer's greedy output equals transformers' generate with the same processors."""
    V, n = 48, 24
    target = tiny_model("llama", vocab_size=V, seed=3)
    ids, mask = _prompts(V, [9, 4, 12, 6], seed=2)
    free = autoregressive_generate(target, ids, mask, max_new_tokens=n, temperature=0)
    eos = free.row(0)[2]  # a token greedy decoding emits early: min_new_tokens has work to do
    want = _hf_rows(target, ids, mask, n, eos)
    assert any(eos in r and r.index(eos) >= PROCS["min_new_tokens"] for r in want) or all(len(r) == n for r in want)
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=n, temperature=0, eos_token_id=eos, **PROCS)
    assert [ar.row(b) for b in range(4)] == want
    for name, make in _proposers(target).items():
        sp = speculative_generate(target, make(), ids, mask, max_new_tokens=n, temperature=0, eos_token_id=eos,
                                  **PROCS)
        assert [sp.row(b) for b in range(4)] == want, name
        one = speculative_generate(target, make(), ids[1:2], mask[1:2], max_new_tokens=n, temperature=0,
                                   eos_token_id=eos, **PROCS)
        assert one.row(0) == want[1], name
        if name in ("draft", "eagle", "bigram_tree"):  # (untrained Medusa heads are never right)
            assert sp.stats.num_accepted_tokens > 0, name  # drafts were accepted under the processors


def test_path_contexts_give_each_node_its_own_path():
    ctx = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])  # (2, 5)
    L = torch.tensor([3, 2])
    toks = torch.tensor([[10, 11, 12, 13], [20, 21, -1, -1]])
    par = torch.tensor([[-1, -1, 0, 2], [-1, 0, -1, -1]])  # row 0: r->{10, 11}, 10->12->13
    t, lens, new = processors.path_contexts(ctx, L, torch.tensor([1, 0]), toks, par, torch.tensor([4, 2]))
    rows = [t[m, :lens[m]].tolist() for m in range(10)]
    assert rows[:5] == [[5, 6, 7], [5, 6, 7, 10], [5, 6, 7, 11], [5, 6, 7, 10, 12], [5, 6, 7, 10, 12, 13]]
    assert rows[5:8] == [[8, 9], [8, 9, 20], [8, 9, 20, 21]]
    assert rows[8:] == [[8, 9], [8, 9]]  # padding nodes: the committed context
    assert new.tolist() == [1, 2, 2, 3, 4, 0, 1, 2, 0, 0]


def test_processors_match_transformers_on_one_row():
    """Each specref processor equals its transformers counterpart on unpadded rows."""
    from transformers import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                              NoRepeatNGramLogitsProcessor)

    g = torch.Generator().manual_seed(0)
    V = 12
    for T in (1, 2, 3, 7, 15):
        ids = torch.randint(0, 4, (3, T), generator=g)  # few distinct tokens: repeats and n-gram hits
        logits = torch.randn(3, V, generator=g)
        lens = torch.full((3,), T)
        new = torch.full((3,), max(T - 2, 0))
        pairs = [
            (processors.RepetitionPenalty(1.3), RepetitionPenaltyLogitsProcessor(1.3)),
            (processors.NoRepeatNGram(2), NoRepeatNGramLogitsProcessor(2)),
            (processors.NoRepeatNGram(3), NoRepeatNGramLogitsProcessor(3)),
            (processors.BadWords(((3,), (1, 2), (0, 1, 2))), NoBadWordsLogitsProcessor([[3], [1, 2], [0, 1, 2]], eos_token_id=9)),
            (processors.MinNewTokens(4, (5, 6)), MinNewTokensLengthLogitsProcessor(2, 4, [5, 6])),
        ]
        pad = torch.cat([ids, torch.full((3, 4), 99)], 1)  # positions past the length are never read
        for ours, theirs in pairs:
            a = ours(pad, lens, new, logits.clone())
            b = theirs(ids, logits.clone())
            assert torch.equal(a, b), (type(ours).__name__, T)


def _joint(out, V, L):
    toks = out.tokens[:, :L].numpy()
    assert (toks >= 0).all()
    return oracle.counts(oracle.joint_index(toks, V), V ** L)


def _stat_target():
    target = tiny_model("llama", vocab_size=16, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    return target, perturbed_copy(target, 0.3, seed=0)


PROMPT = torch.tensor([3, 1, 4, 1, 5])


def _exact(target, L, penalty):
    """The exact joint with transformers' own RepetitionPenaltyLogitsProcessor applied on every
    path (prompt + x_<i): the ground truth does not share specref's processor code."""
    return hf_joint_distribution(target, PROMPT, L, SamplingConfig(1.0),
                                 processor=RepetitionPenaltyLogitsProcessor(penalty)).numpy()


@pytest.mark.two_threads
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_whole_loop_lossless_with_repetition_penalty(kind):
    """T = 1, repetition_penalty 1.5 (strong: the joint moves by TV 0.2 from the plain one), joint
    of 2 tokens, 50,000 rows; power asserted (TV 0.02 detected with prob >= 0.99 at 1e-3)."""
    V, L, n, pen = 16, 2, 50_000, 1.5
    target, draft = _stat_target()
    exact = _exact(target, L, pen)
    assert power_sample_size(exact, n) <= n
    prop = (DraftModelProposer(draft, DraftModelConfig(k=2)) if kind == "chain"
            else BigramTreeProposer(bigram_table(target, V), SHAPES["mixed"], sampled=True))
    out = speculative_generate(target, prop, PROMPT.expand(n, -1), max_new_tokens=L, temperature=1.0,
                               repetition_penalty=pen, generator=torch.Generator().manual_seed(7 if kind == "chain" else 8))
    assert out.stats.num_accepted_tokens / out.stats.num_drafts > 0.15  # accepted drafts per row-step
    res = oracle.chi_square_gof(_joint(out, V, L), exact)
    assert res.p_value > ALPHA, res


def test_penalty_on_the_committed_context_only_is_rejected(monkeypatch):
    """The mutant that penalises every block row on the context WITHOUT the draft tokens (the
    mistake the module docstring warns of) fails the same test (at 20,000 rows: p < 1e-12)."""
    V, L, n, pen = 16, 2, 20_000, 1.5
    target, draft = _stat_target()
    exact = _exact(target, L, pen)

    def committed_only(procs, logits, ctx_tokens, ctx_len, num_new, tokens, parents, lengths):
        B, Q, Vl = logits.shape
        rows = procs(ctx_tokens, ctx_len, num_new, logits[:, 0])  # (B, V) row 0's context only...
        same = procs(ctx_tokens.repeat_interleave(Q, 0), ctx_len.repeat_interleave(Q), num_new.repeat_interleave(Q),
                     logits.reshape(B * Q, Vl))  # ...for every row of the block
        assert torch.equal(same.view(B, Q, Vl)[:, 0], rows)
        return same.view(B, Q, Vl)

    monkeypatch.setattr(processors, "apply_to_block", committed_only)
    out = speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=2)), PROMPT.expand(n, -1),
                               max_new_tokens=L, temperature=1.0, repetition_penalty=pen,
                               generator=torch.Generator().manual_seed(7))
    res = oracle.chi_square_gof(_joint(out, V, L), exact)
    assert res.p_value < ALPHA, res


def test_a_transformers_processor_list_is_applied_per_path():
    """A user's LogitsProcessorList gives what the built-in processor gives (greedy, a tree)."""
    V = 48
    target = tiny_model("llama", vocab_size=V, seed=3)
    ids, mask = _prompts(V, [7, 3], seed=4)
    mk = lambda: BigramTreeProposer(bigram_table(target, V), SHAPES["mixed"], sampled=False)
    a = speculative_generate(target, mk(), ids, mask, max_new_tokens=16, temperature=0, repetition_penalty=1.4)
    b = speculative_generate(target, mk(), ids, mask, max_new_tokens=16, temperature=0,
                             logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.4)]))
    assert torch.equal(a.tokens, b.tokens)
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=16, temperature=0,
                                 logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.4)]))
    assert torch.equal(b.tokens, ar.tokens) and b.stats.num_accepted_tokens > 0
    plain = speculative_generate(target, mk(), ids, mask, max_new_tokens=16, temperature=0)
    assert not torch.equal(a.tokens, plain.tokens)  # the penalty changed the output


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    """vLLM's rule: logit -= frequency * count + presence * [count > 0], counts over the row's
    generated tokens (the prompt does not count), checked against a loop over the row."""
    g = torch.Generator().manual_seed(1)
    V, M, T = 9, 4, 10
    tokens = torch.randint(0, 5, (M, T), generator=g)
    lengths, new = torch.tensor([10, 7, 3, 1]), torch.tensor([4, 7, 0, 1])
    logits = torch.randn(M, V, generator=g)
    got = processors.PresenceFrequencyPenalty(0.5, 0.25)(tokens, lengths, new, logits)
    for m in range(M):
        gen = tokens[m, lengths[m] - new[m]: lengths[m]].tolist()
        want = logits[m].clone()
        for v in set(gen):
            want[v] -= 0.25 * gen.count(v) + 0.5
        assert torch.allclose(got[m], want), m
    # through the loop: greedy with a large presence penalty never repeats a generated token
    target = tiny_model("llama", vocab_size=48, seed=3)
    out = autoregressive_generate(target, torch.tensor([[1, 2, 3]]), max_new_tokens=20, temperature=0,
                                  presence_penalty=100.0)
    assert len(set(out.row(0))) == 20
