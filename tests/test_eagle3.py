"""Tests of eagle3.py / training/eagle3.py: the training-time test's mask (hand-built) and its
unroll equal to drafting recomputed step by step, training, greedy parity for chains and EAGLE-2
trees (batched, ragged, each row alone), the whole loop's chi-square at T=1 (chain, sampled q)
and T=0.7 with top-k (tree), weights round trip, errors."""
import pytest
import torch

from _features import feature_data, feature_target
from _stats import power_rows
from specref import oracle
from specref.eagle3 import Eagle3Head, default_layers, load_eagle3, save_eagle3
from specref.eagle_head import EagleConfig, EagleProposer
from specref.eagle_tree import Eagle2Config, Eagle2Proposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.oracle.exact import hf_joint_distribution
from specref.sampling import SamplingConfig
from specref.training.data import Seq, collate
from specref.training.draft import build_token_map
from specref.training.eagle3 import Eagle3Task, Eagle3TrainConfig, attach_layer_features, ttt_mask
from specref.training.loop import TrainConfig, fit, split_heldout
from specref.target import additive_mask

V = 16
LAYERS = (0, 1, 2)  # the tiny target's embeddings, after layer 1, after layer 2 (normed)


@pytest.fixture(scope="module")
def trained():
    """(target, head, history, heldout): 120 steps with a 3-step training-time test."""
    target = feature_target()
    seqs = feature_data(target, 160)
    attach_layer_features(target, seqs, LAYERS)
    train, held = split_heldout(seqs, 0.2, seed=0)
    head = Eagle3Head(target, build_token_map(train, V, 12), layers=LAYERS, seed=0)
    cfg = TrainConfig(steps=120, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=120, seed=0)
    res = fit(Eagle3Task(head, Eagle3TrainConfig(ttt_steps=3, eval_steps=3)), train, held, cfg, progress=False,
              log=lambda s: None)
    return target, head.eval(), res.history, held


def test_ttt_mask_hand_built():
    m = ttt_mask(3, 2, torch.ones(1, 3, dtype=torch.bool))[0].int()  # rows: (block, t); columns the same
    assert m.tolist() == [
        # b0: s0 s1 s2  b1: s0 s1 s2
        [1, 0, 0, 0, 0, 0],  # block 0, t 0: causal over the true pairs
        [1, 1, 0, 0, 0, 0],  # block 0, t 1
        [1, 1, 1, 0, 0, 0],  # block 0, t 2
        [0, 0, 0, 1, 0, 0],  # block 1, t 0: no chain starts before position 0 (unused row: itself)
        [1, 0, 0, 0, 1, 0],  # block 1, t 1: true pairs <= 0, its own draft
        [1, 1, 0, 0, 0, 1],  # block 1, t 2: true pairs <= 1, its own draft
    ]
    pad = ttt_mask(4, 2, torch.tensor([[True, True, False, True]]))[0]  # pair 2 is padding
    assert not pad[3, 2] and pad[3, 3] and pad[3, 1]  # block 0, t 3: the padding key hidden, others seen
    assert not pad[7, 2] and pad[7, 1] and pad[7, 7]  # block 1, t 3: the same; its own draft kept


def test_unroll_equals_drafting_recomputed(trained):
    """Unrolled step j at position t equals the head drafting a chain from scratch: the true pairs
    up to t-j, then j pairs of its own outputs with the true next tokens."""
    target, head, _, held = trained
    batch = collate(held[:2])
    task = Eagle3Task(head, Eagle3TrainConfig(ttt_steps=3))
    with torch.no_grad():
        outs = task.unroll(batch, 3)
        g = head.embed_features(batch.features[:1, :-1])  # (1, T', D)
        x = batch.tokens[:1, 1:]  # (1, T')
        for j in (1, 2):
            for t in (j, 6, 11):
                p0 = t - j  # the chain's last true pair
                f, toks = g[:, : p0 + 1], x[:, : p0 + 1]
                for i in range(j + 1):
                    Q = f.shape[1]
                    pos = torch.arange(Q).view(1, Q)
                    causal = additive_mask(pos.view(1, Q, 1) >= pos.view(1, 1, Q), f.dtype)  # (1, 1, Q, Q)
                    a = head(f, toks, pos, causal)[:, -1:]  # (1, 1, D)
                    if i < j:
                        f = torch.cat([f, a], dim=1)
                        toks = torch.cat([toks, x[:, p0 + i + 1: p0 + i + 2]], dim=1)
                assert torch.allclose(a[0, 0], outs[j][0, t], atol=1e-4), (j, t)


def _unroll_uncached(head, batch, steps):
    """The unroll without the cache: the head rerun over all blocks so far, [step 0 | ... | step j]."""
    B, T = batch.tokens.shape
    Tp = T - 1
    x, full = batch.tokens[:, 1:], ttt_mask(Tp, steps, batch.attention[:, 1:])
    pos = torch.arange(Tp)
    feats, outs = [head.embed_features(batch.features[:, :-1])], []
    for j in range(steps):
        n = (j + 1) * Tp
        f_in = torch.cat(feats, dim=1)  # (B, n, D)
        a = head(f_in, x.repeat(1, j + 1), pos.repeat(j + 1).expand(B, n), additive_mask(full[:, :n, :n], f_in.dtype))
        outs.append(a[:, j * Tp:])
        feats.append(torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1))
    return outs


def test_cached_unroll_equals_rerunning_every_block(trained):
    """The unroll reads earlier blocks' keys from a cache: the same outputs and the same gradients
    as rerunning the head over all blocks (ragged batch: padding rows and keys included)."""
    _, head, _, held = trained
    s, n = held[1], len(held[1].tokens) - 6  # a shorter second row: padding rows and keys
    short = Seq(s.tokens[:n], s.prompt_len, s.topk_ids[: n - s.prompt_len], s.topk_logprobs[: n - s.prompt_len],
                s.features[:n])
    batch = collate([held[0], short, held[2]])
    assert not bool(batch.attention.all())
    task = Eagle3Task(head, Eagle3TrainConfig(ttt_steps=4))
    params = [q for _, q in head.trainable()]
    got = task.unroll(batch, 4)
    want = _unroll_uncached(head, batch, 4)
    for j, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, atol=1e-5), j
    weights = [torch.randn(a.shape, generator=torch.Generator().manual_seed(j)) for j, a in enumerate(got)]
    g_got = torch.autograd.grad(sum((a * w).sum() for a, w in zip(got, weights)), params, allow_unused=True)
    g_want = torch.autograd.grad(sum((a * w).sum() for a, w in zip(want, weights)), params, allow_unused=True)
    assert sum(a is not None for a in g_got) >= 10  # the FC, the decoder layer, the norms
    for p, a, b in zip(params, g_got, g_want):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-4, rtol=1e-4)), p.shape


def test_training_raises_agreement_at_every_step(trained):
    _, _, hist, _ = trained
    first, last = hist[0], hist[-1]
    for j in (1, 2, 3):
        assert last[f"heldout_top1_step{j}"] > first[f"heldout_top1_step{j}"] + 0.15, (j, first, last)
    assert last["heldout_accept"] > first["heldout_accept"] and last["heldout_ce"] < first["heldout_ce"]


CONFIGS = [("chain", EagleConfig(k=3)), ("tree", Eagle2Config(top_k=3, depth=3, total_tokens=6, min_value=0.0))]


def _proposer(head, cfg):
    return EagleProposer(head, cfg) if isinstance(cfg, EagleConfig) else Eagle2Proposer(head, cfg)


@pytest.mark.parametrize("name,cfg", CONFIGS)
def test_greedy_parity_batched(trained, name, cfg):
    target, head, _, _ = trained
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 8]).view(4, 1)).long()  # left padding; row 3: 1 token
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    sp = speculative_generate(target, _proposer(head, cfg), ids, mask, max_new_tokens=20, temperature=0,
                              eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.tokens_per_forward > 1.3, sp.stats  # the trained head is accepted
    for b in range(4):
        one = speculative_generate(target, _proposer(head, cfg), ids[b:b + 1], mask[b:b + 1], max_new_tokens=20,
                                   temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


@pytest.mark.two_threads
@pytest.mark.parametrize("name,temperature,top_k", [("chain", 1.0, 0), ("tree", 0.7, 5)])
def test_whole_loop_lossless(trained, name, temperature, top_k):
    """Joint of the first 3 tokens vs the exact distribution; n from tests/_stats.power_rows (TV
    0.02 detected with probability >= 0.99 at 1e-3). The chain samples its drafts (q passed), the
    tree's siblings are deterministic (q None)."""
    target, head, _, _ = trained
    L, prompt = 3, torch.tensor([3, 1, 4, 1, 5])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k)).numpy()
    n = power_rows(exact)
    cfg = dict(CONFIGS)[name]
    out = speculative_generate(target, _proposer(head, cfg), prompt.expand(n, -1), max_new_tokens=L,
                               temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(3))
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L), exact)
    assert res.p_value > 1e-3, res
    s = out.stats
    assert s.num_accepted_tokens > 2000 and s.tokens_per_forward < 3.0, s


def test_weights_round_trip_and_errors(trained, tmp_path):
    target, head, _, held = trained
    save_eagle3(tmp_path / "e3.safetensors", head, "fp", {"note": "test"})
    with pytest.warns(UserWarning, match="another target"):
        again = load_eagle3(target, tmp_path / "e3.safetensors")
    assert again.layers == LAYERS and torch.equal(again.token_map, head.token_map)
    for (n, a), (_, b) in zip(head.trainable(), again.trainable()):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-2), n  # stored as float16
    names = {n for n, _ in head.trainable()}
    assert {"fuse.weight", "lm_head.weight", "fc.weight"} <= names  # its own LM head is trained
    assert default_layers(30) == (2, 15, 27) and default_layers(2) == (1, 2)
    with pytest.raises(ValueError, match="layers"):
        Eagle3Head(target, head.token_map, layers=(0, 5))
    with pytest.raises(ValueError, match="no EAGLE-3 head|not a specref EAGLE-3"):
        load_eagle3(target, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="Eagle3Head"):
        Eagle3Task(object())
    b = collate(held[:1])
    b.features = b.features[..., :8]
    with pytest.raises(ValueError, match="width"):
        Eagle3Task(head).loss(b)
    for bad in ({"ttt_steps": 0}, {"eval_steps": 0}, {"draft_vocab": 1}, {"heldout_fraction": 1.0}):
        with pytest.raises(ValueError):
            Eagle3TrainConfig(**bad)
    assert EagleProposer(head).hidden_layers == LAYERS  # the proposer asks the target for these


def test_transfer_measure_scores_every_draft_position(trained, tmp_path):
    """training/transfer.py on an EAGLE-3 head: top1_by_depth is the training's held-out
    top1_step{j} (the head fed its own outputs for j-1 positions), top1 is position 1; eagle3_task
    reads the file and its record."""
    from specref.training.transfer import eagle3_task, per_category

    target, head, hist, held = trained
    res = per_category(Eagle3Task(head, Eagle3TrainConfig(eval_steps=3)), held, ["x"] * len(held), batch_size=7)
    last = hist[-1]
    assert res["all"]["top1_by_depth"] == pytest.approx([last[f"heldout_top1_step{j}"] for j in (1, 2, 3)])
    assert res["all"]["top1"] == pytest.approx(last["heldout_top1"]) and res["all"]["accept"] == pytest.approx(
        last["heldout_accept"])
    save_eagle3(tmp_path / "e3.safetensors", head, "fp", {"heldout": {"heldout_top1": 0.25}})
    with pytest.warns(UserWarning, match="another target"):
        task, record = eagle3_task(target, tmp_path / "e3.safetensors")
    assert isinstance(task, Eagle3Task) and task.module.layers == LAYERS and record["heldout"]["heldout_top1"] == 0.25
