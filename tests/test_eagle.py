"""Tests of eagle_head.py / training/eagle.py: training, the head's cache dance, greedy parity,
losslessness of the whole loop (chi-square against the exact joint), weights round trip, errors."""
import pytest
import torch

from _stats import power_rows
from _features import trained_eagle
from specref import oracle
from specref.training.data import Seq, collate
from specref.eagle_head import EagleConfig, EagleHead, EagleProposer, load_eagle, save_eagle
from specref.training.eagle import EagleTask
from specref.oracle.exact import hf_joint_distribution
from specref.generate import autoregressive_generate, speculative_generate
from specref.sampling import SamplingConfig

V = 16


@pytest.fixture(scope="module")
def trained():
    """(target, head, training history), shared with test_eagle_tree.py (tests/_features.py)."""
    return trained_eagle()


def test_training_reduces_regression_and_raises_agreement(trained):
    _, _, hist = trained
    first, last = hist[0], hist[-1]
    assert first["step"] == 0 and last["step"] == 120
    assert last["heldout_reg"] < first["heldout_reg"] - 0.05, (first, last)
    assert last["heldout_top1"] > first["heldout_top1"] + 0.2, (first, last)
    assert last["heldout_top1_step2"] > first["heldout_top1_step2"], (first, last)
    assert 0 <= last["heldout_accept"] <= 1 and last["heldout_accept"] > first["heldout_accept"]


def _reference_draft(target, head, row, k):
    """The greedy draft recomputed from scratch, no cache: the target's features of row[:-1], the head
    over every pair (f_t, x_{t+1}), then k steps each re-running the head over all pairs so far."""
    with torch.no_grad():
        f = target.model(input_ids=row[None, :-1]).last_hidden_state  # (1, L-1, D)
        x, c = row[None, 1:], row[None, :-1]  # (1, L-1) each: x_{t+1} and x_t of every pair
        out = []
        for _ in range(k):
            Q = x.shape[1]
            pos = torch.arange(Q).view(1, Q)  # (1, Q)
            mask = torch.where(pos.view(1, 1, Q, 1) >= pos.view(1, 1, 1, Q), 0.0, float("-inf"))  # (1, 1, Q, Q)
            f_hat = head(f, x, pos, mask, **({"cur_tokens": c} if head.current_token else {}))  # (1, Q, D)
            tok = head.token_map[head.logits(f_hat[0, -1]).argmax()]
            out.append(int(tok))
            f = torch.cat([f, f_hat[:, -1:]], dim=1)  # (1, Q+1, D)
            c = torch.cat([c, x[:, -1:]], dim=1)  # (1, Q+1)
            x = torch.cat([x, tok.view(1, 1)], dim=1)  # (1, Q+1)
    return out


def _checked_chain(target, head, k):
    """(an EagleProposer whose every greedy draft is asserted equal to _reference_draft, the rows
    checked so far)."""
    prop = EagleProposer(head, EagleConfig(k=k))
    checked, orig = [], prop.propose

    def propose(ctx, sampling, generator):
        d = orig(ctx, sampling, generator)
        for b in range(ctx.tokens.shape[0]):
            if bool(ctx.active[b]):
                assert d.tokens[b].tolist() == _reference_draft(target, head, ctx.row(b), k)
                checked.append(b)
        return d

    prop.propose = propose
    return prop, checked


def test_draft_equals_recomputation_from_scratch(trained):
    """Every step of a batched, ragged greedy generation: the cached head drafts exactly what the
    head drafts when recomputed from the committed tokens alone (catch-up and roll-back are right)."""
    target, head, _ = trained
    prop, checked = _checked_chain(target, head, 3)
    ids = torch.tensor([[0, 0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1], [0, 0, 0, 0, 9, 9, 2]])
    mask = (torch.arange(7) >= torch.tensor([2, 0, 4]).view(3, 1)).long()
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=14, temperature=0)
    # accepted runs of 2+ drafts (catch-up blocks of 3+ pairs) and rejections both occurred
    assert len(checked) >= 12 and out.stats.accepted_per_position[1] > 0, out.stats
    assert out.stats.acceptance_rate < 0.9, out.stats


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_parity_batched(trained, k):
    target, head, _ = trained
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, V, (4, 9), generator=g)
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 1]).view(4, 1)).long()  # left padding
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    sp = speculative_generate(target, EagleProposer(head, EagleConfig(k=k)), ids, mask, max_new_tokens=20,
                              temperature=0, eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.tokens_per_forward > 1.2, sp.stats  # the trained head is accepted
    for b in range(4):  # a row alone drafts and emits the same as in the batch
        one = speculative_generate(target, EagleProposer(head, EagleConfig(k=k)), ids[b:b + 1], mask[b:b + 1],
                                   max_new_tokens=20, temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


@pytest.mark.parametrize("cost", [0.0, 0.05, 0.6])
def test_adaptive_draft_length(trained, cost):
    """adaptive=True: rows draft 1..k tokens by the closed form on their own acceptance; greedy parity
    holds (in a batch and row alone), free drafts keep k, costly ones fall to 1, and sampled rows
    reproduce alone what they emit in a batch."""
    target, head, _ = trained
    cfg = EagleConfig(k=4, adaptive=True, draft_cost=cost, verify_cost_fixed=0.0)
    ids = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(3))
    ar = autoregressive_generate(target, ids, max_new_tokens=24, temperature=0)
    prop, lengths = EagleProposer(head, cfg), []
    orig = prop.propose
    prop.propose = lambda ctx, s, g: (lambda d: lengths.extend(d.lengths[ctx.active].tolist()) or d)(orig(ctx, s, g))
    sp = speculative_generate(target, prop, ids, max_new_tokens=24, temperature=0)
    assert torch.equal(ar.tokens, sp.tokens)
    if cost == 0.0:
        assert set(lengths) == {4}  # free drafts: always the longest
    elif cost == 0.6:
        assert set(lengths) == {1}  # a draft token costs more than it can return: the minimum, 1
    else:
        assert 4 in lengths and min(lengths) < 4, lengths  # lengths adapt per row and step
    for b in range(3):  # greedy: a row alone drafts and emits the same as in the batch
        one = speculative_generate(target, EagleProposer(head, cfg), ids[b:b + 1], max_new_tokens=24,
                                   temperature=0)
        assert one.row(0) == sp.row(b)
    # sampled, one generator per row: rows draft different lengths, yet each reproduces alone
    gens = lambda rows: [torch.Generator().manual_seed(50 + b) for b in rows]  # noqa: E731
    batch = speculative_generate(target, EagleProposer(head, cfg), ids, max_new_tokens=24, temperature=1.0,
                                 generator=gens(range(3)))
    for b in range(3):
        one = speculative_generate(target, EagleProposer(head, cfg), ids[b:b + 1], max_new_tokens=24,
                                   temperature=1.0, generator=gens([b]))
        assert one.row(0) == batch.row(b)


@pytest.mark.two_threads
@pytest.mark.parametrize("case", [
    # (temperature, top_k, greedy draft, k, adaptive)
    (1.0, 0, False, 3, False),  # plain sampling, sampled draft with q (reduced vocabulary: q = 0 on 4 tokens)
    (0.7, 5, False, 2, False),  # temperature + top-k applied to p and q
    (1.0, 0, True, 2, False),  # deterministic (argmax) draft: q = None
    (1.0, 0, False, 4, True),  # adaptive (ragged) draft lengths, sampled draft
])
def test_whole_loop_lossless(trained, case):
    """Joint of the first 3 tokens vs the exact distribution, n rows in one batch; power: n is the
    fewest rows (steps of 5,000, at most 80,000) whose sample size detecting a TV deviation of 0.02
    with probability >= 0.99 at 1e-3 is <= n (tests/_stats.power_rows)."""
    target, head, _ = trained
    temperature, top_k, greedy_draft, k, adaptive = case
    L = 3
    prompt = torch.tensor([3, 1, 4, 1, 5])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k)).numpy()
    n = power_rows(exact)
    prop = EagleProposer(head, EagleConfig(k=k, greedy_draft=greedy_draft, adaptive=adaptive, draft_cost=0.05))
    out = speculative_generate(target, prop, prompt.expand(n, -1), max_new_tokens=L, temperature=temperature,
                               top_k=top_k, generator=torch.Generator().manual_seed(k + 10 * top_k))
    toks = out.tokens[:, :L].numpy()
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(toks, V), V ** L), exact)
    assert res.p_value > 1e-3, res
    s = out.stats  # thousands of accepted drafts and of rejections
    assert s.num_accepted_tokens > 2000 and s.num_draft_tokens - s.num_accepted_tokens > 2000, s


def test_weights_round_trip_and_errors(trained, tmp_path):
    target, head, _ = trained
    save_eagle(tmp_path / "e.safetensors", head, "fp", {"note": "test"})
    with pytest.warns(UserWarning, match="another target"):
        again = load_eagle(target, tmp_path / "e.safetensors")
    assert torch.equal(again.token_map, head.token_map)
    for (n, a), (_, b) in zip(head.trainable(), again.trainable()):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-2), n  # stored as float16
    assert {n for n, _ in head.trainable()} >= {"fc.weight", "layer.mlp.up_proj.weight", "norm.weight"}
    assert not head.lm_head.weight.requires_grad  # the target's LM head rows stay frozen
    with pytest.raises(ValueError, match="not a specref EAGLE head|no EAGLE head"):
        load_eagle(target, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="EagleHead"):
        EagleProposer(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="k must be"):
        EagleConfig(k=0)
    with pytest.raises(ValueError, match="token_map"):
        EagleHead(target, torch.tensor([0, V]))
    with pytest.raises(ValueError, match="features"):
        EagleTask(head).loss(collate([Seq(torch.arange(6), 3)]))
    prop = EagleProposer(head)
    with pytest.raises(ValueError, match="before begin"):
        prop.propose(None, SamplingConfig(0.0), None)


def test_deeper_head_starts_as_the_file_and_drafts_exactly(trained, tmp_path):
    """extra_layers: a head loaded from a one-layer file with one identity layer added computes what
    the file's head computes; once that layer is non-zero, its cached drafting (one cache layer per
    decoder layer) equals recomputation from scratch, greedy decoding stays the target's, and the
    file round-trips with its depth."""
    from specref.eagle_head import extra_layers_in

    target, head, _ = trained
    save_eagle(tmp_path / "one.safetensors", head, "fp", {"note": "test"})
    with pytest.warns(UserWarning, match="another target"):
        deep = load_eagle(target, tmp_path / "one.safetensors", extra_layers=1)
    assert deep.num_layers == 2 and head.num_layers == 1
    g = torch.Generator().manual_seed(0)
    f, x = torch.randn(2, 6, head.hidden_size, generator=g), torch.randint(0, V, (2, 6), generator=g)
    pos = torch.arange(6).expand(2, 6)
    mask = torch.where(pos.view(2, 1, 6, 1) >= pos.view(2, 1, 1, 6), 0.0, float("-inf"))
    with torch.no_grad():
        assert torch.allclose(deep(f, x, pos, mask), load_eagle(target, tmp_path / "one.safetensors")(f, x, pos, mask))
        for n, p in deep.extra.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        assert not torch.allclose(deep(f, x, pos, mask), head(f, x, pos, mask), atol=1e-3)
    prop, checked = _checked_chain(target, deep, 3)
    ids = torch.tensor([[0, 0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1]])
    mask2 = (torch.arange(7) >= torch.tensor([2, 0]).view(2, 1)).long()
    sp = speculative_generate(target, prop, ids, mask2, max_new_tokens=12, temperature=0)
    ar = autoregressive_generate(target, ids, mask2, max_new_tokens=12, temperature=0)
    assert len(checked) >= 6 and torch.equal(ar.tokens, sp.tokens)
    save_eagle(tmp_path / "two.safetensors", deep, "fp", {"note": "test"})
    assert extra_layers_in(tmp_path / "two.safetensors") == 1
    with pytest.warns(UserWarning, match="another target"):
        again = load_eagle(target, tmp_path / "two.safetensors")
    assert again.num_layers == 2
    with pytest.raises(ValueError, match="extra layers"), pytest.warns(UserWarning, match="another target"):
        load_eagle(target, tmp_path / "two.safetensors", extra_layers=0)
    with pytest.raises(ValueError, match="extra_layers"):
        EagleHead(target, head.token_map, extra_layers=-1)


def test_current_token_head_starts_as_the_file_and_drafts_exactly(trained, tmp_path):
    """current_token: a head loaded from a two-input file with e(x_t)'s FC columns added computes what
    the file's head computes; once those columns are non-zero, the chain's cached drafting (x_t of
    every pair: the committed token, then the previous draft) equals recomputation from scratch,
    chain and EAGLE-2 tree decode greedily as the target, and the file round-trips with its input."""
    from specref.eagle_tree import Eagle2Config, Eagle2Proposer

    target, head, _ = trained
    save_eagle(tmp_path / "two.safetensors", head, "fp", {"note": "test"})
    with pytest.warns(UserWarning, match="another target"):
        cur = load_eagle(target, tmp_path / "two.safetensors", current_token=True)
    assert cur.current_token and not head.current_token and cur.fc.in_features == 3 * head.hidden_size
    g = torch.Generator().manual_seed(1)
    f, x = torch.randn(2, 6, head.hidden_size, generator=g), torch.randint(0, V, (2, 6), generator=g)
    c = torch.randint(0, V, (2, 6), generator=g)
    pos = torch.arange(6).expand(2, 6)
    mask = torch.where(pos.view(2, 1, 6, 1) >= pos.view(2, 1, 1, 6), 0.0, float("-inf"))
    with pytest.warns(UserWarning, match="another target"):
        plain = load_eagle(target, tmp_path / "two.safetensors")  # the same float16-stored weights
    with torch.no_grad():
        assert torch.allclose(cur(f, x, pos, mask, cur_tokens=c), plain(f, x, pos, mask), atol=1e-6)
        cur.fc.weight[:, 2 * head.hidden_size:].normal_(0, 0.3, generator=g)
        assert not torch.allclose(cur(f, x, pos, mask, cur_tokens=c), head(f, x, pos, mask), atol=1e-3)
    with pytest.raises(ValueError, match="cur_tokens"):
        cur(f, x, pos, mask)
    prop, checked = _checked_chain(target, cur, 3)
    ids = torch.tensor([[0, 0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1], [0, 0, 0, 0, 9, 9, 2]])
    mask3 = (torch.arange(7) >= torch.tensor([2, 0, 4]).view(3, 1)).long()
    ar = autoregressive_generate(target, ids, mask3, max_new_tokens=14, temperature=0)
    sp = speculative_generate(target, prop, ids, mask3, max_new_tokens=14, temperature=0)
    assert len(checked) >= 9 and torch.equal(ar.tokens, sp.tokens)
    assert sp.stats.accepted_per_position[1] > 0, sp.stats
    tree = speculative_generate(target, Eagle2Proposer(cur, Eagle2Config(top_k=2, depth=3, total_tokens=6)), ids,
                                mask3, max_new_tokens=14, temperature=0)
    assert torch.equal(ar.tokens, tree.tokens)
    save_eagle(tmp_path / "three.safetensors", cur, "fp", {"note": "test"})
    with pytest.warns(UserWarning, match="another target"):
        again = load_eagle(target, tmp_path / "three.safetensors")
    assert again.current_token and torch.allclose(again.fc.weight, cur.fc.weight, atol=1e-3, rtol=1e-2)
    with pytest.raises(ValueError, match="current_token head"), pytest.warns(UserWarning, match="another target"):
        load_eagle(target, tmp_path / "three.safetensors", current_token=False)
    with pytest.raises(ValueError, match="current_token"):
        EagleHead(target, head.token_map, current_token=1)


def test_copy_positions_are_the_prompts_bigrams_per_row():
    """training/eagle.copy_positions: a scored pair is a copy when (x_{t+1}, label) is a bigram of its
    own row's prompt (transfer.py's copy / new split of agreement)."""
    from specref.training.eagle import copy_positions

    a = Seq(torch.tensor([5, 6, 7, 5, 8, 6, 9, 5, 8]), 5)  # pairs t = 3..6 score x_5..x_8
    b = Seq(torch.tensor([1, 2, 3, 1, 2, 4, 5, 8]), 3)  # pairs t = 1..6 score x_3..x_7; (5, 8) is a's bigram
    batch = collate([a, b])
    labels = torch.cat([a.tokens[5:], b.tokens[3:]])  # greedy labels: the tokens themselves
    assert copy_positions(batch, labels).tolist() == [False, False, False, True] + [False, True, False, False, False]
