"""Tests of mtp.py / training/mtp.py: training, the modules' cache dance against a recomputation from
scratch, greedy parity, losslessness of the whole loop (chi-square against the exact joint), batch
independence, the native DeepSeek-V3-layout loader, weights round trip, errors."""
import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from _stats import power_sample_size
from _features import feature_data, feature_target
from specref import oracle
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import tiny_model
from specref.mtp import MTPConfig, MTPProposer, MTPStack, load_mtp, mtp_info
from specref.published.native import load_native_mtp
from specref.oracle.exact import hf_joint_distribution
from specref.proposer import Context
from specref.sampling import SamplingConfig
from specref.training.data import Seq, collate
from specref.training.loop import TrainConfig, split_heldout
from specref.training.mtp import MTPTask, MTPTrainConfig, run_mtp_training

V = 16


_target, _data = feature_target, feature_data  # tests/_features.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target, 2-module stack, history, weights file): 120 steps on 128 sequences, 12 of 16 tokens drafted."""
    target = _target()
    train, held = split_heldout(_data(target, 160), 0.2, seed=0)
    path = tmp_path_factory.mktemp("mtp") / "mtp.safetensors"
    cfg = TrainConfig(steps=120, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=120, seed=0)
    stack, res = run_mtp_training(target, train, held, cfg, MTPTrainConfig(num_modules=2, draft_vocab=12), path,
                                  progress=False, log=lambda s: None)
    return target, stack, res.history, path


def test_training_lowers_heldout_loss_and_writes_weights(trained):
    target, stack, hist, path = trained
    first, last = hist[0], hist[-1]
    assert first["step"] == 0 and last["step"] == 120
    assert last["heldout_loss"] < first["heldout_loss"] - 0.3, (first, last)
    for d in (1, 2):  # every depth learns; its per-depth metrics are reported
        assert last[f"heldout_ce_{d}"] < first[f"heldout_ce_{d}"] - 0.2, (d, first, last)
        assert last[f"heldout_top1_{d}"] > first[f"heldout_top1_{d}"] + 0.15, (d, first, last)
        assert 0 <= last[f"heldout_accept_{d}"] <= 1 and last[f"heldout_accept_{d}"] > first[f"heldout_accept_{d}"]
    meta = mtp_info(path)  # the file: fingerprint, module count, held-out numbers
    assert meta["num_modules"] == "2" and meta["record"]["heldout"]["heldout_top1_2"] == last["heldout_top1_2"]
    again = load_mtp(target, path)  # no warning: trained for this target
    assert again.num_modules == 2 and torch.equal(again.token_map, stack.token_map)
    for (n, a), (_, b) in zip(stack.trainable(), again.trainable()):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-2), n  # stored as float16
    assert {n for n, _ in stack.trainable()} >= {"layers.1.eh_proj.weight", "layers.0.block.mlp.up_proj.weight",
                                                 "layers.1.norm.weight", "layers.0.enorm.weight"}
    assert not stack.lm_head.weight.requires_grad  # the target's LM head rows stay frozen (shared)
    with pytest.warns(UserWarning, match="another target"):
        load_mtp(tiny_model("llama", vocab_size=V, seed=3, num_heads=2, num_kv_heads=1), path)


def test_transfer_measure_scores_every_depth(trained):
    """training/transfer.py on MTP modules: module d's top-1 is the training's held-out top1_d; the
    file's record gives the held-out depth-1 number the table prints as (a)."""
    from specref.training.transfer import mtp_task, per_category

    target, stack, hist, path = trained
    _, held = split_heldout(_data(target, 160), 0.2, seed=0)  # the fixture's held-out part
    res = per_category(MTPTask(stack), held, ["x"] * len(held), batch_size=16)
    last = hist[-1]
    assert res["all"]["top1_by_depth"] == pytest.approx([last["heldout_top1_1"], last["heldout_top1_2"]])
    assert res["all"]["top1"] == pytest.approx(last["heldout_top1"]) and res["all"]["accept"] == pytest.approx(
        last["heldout_accept_1"])
    task, record = mtp_task(target, path)
    assert record["heldout"]["heldout_top1"] == last["heldout_top1"] and task.module.num_modules == 2


def test_module_is_the_reports_formula(trained):
    """Module d by hand: h' = eh_proj [enorm(Emb(t_{i+d})); hnorm(h^{d-1}_i)] (the released weights'
    order), h^d = block(h'), logits = the shared LM head rows token_map over shared_head.norm(h^d)."""
    target, stack, _, _ = trained
    rms = lambda x, w: w * x / x.pow(2).mean(-1, keepdim=True).add(target.config.rms_norm_eps).sqrt()  # noqa: E731
    h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))  # (2, 5, D)
    x = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(1))  # (2, 5)
    pos = torch.arange(5).expand(2, 5)  # (2, 5)
    mask = torch.where(pos.view(2, 1, 5, 1) >= pos.view(2, 1, 1, 5), 0.0, float("-inf"))  # (2, 1, 5, 5)
    with torch.no_grad():
        for d, m in enumerate(stack.layers):
            e = target.model.embed_tokens(x)  # (2, 5, D)
            g = torch.cat([rms(e, m.enorm.weight), rms(h, m.hnorm.weight)], -1) @ m.eh_proj.weight.T  # (2, 5, D)
            pe = target.model.rotary_emb(g, position_ids=pos)
            want = m.block(g, attention_mask=mask, position_ids=pos, position_embeddings=pe)  # (2, 5, D)
            got = stack(d, h, x, pos, mask)  # (2, 5, D)
            assert torch.allclose(got, want, atol=1e-5), d
            logits = rms(got, m.norm.weight) @ target.lm_head.weight[stack.token_map].T  # (2, 5, Vd)
            assert torch.allclose(stack.logits(d, got), logits, atol=1e-4), d
    assert stack.layers[0].eh_proj.bias is None and not torch.equal(stack.layers[0].eh_proj.weight,
                                                                    stack.layers[1].eh_proj.weight)


def _run(stack, d, h, x, c):
    """Module d over a whole sequence, no cache, causal; c (1, Q) the tokens before x's."""
    Q = x.shape[1]
    pos = torch.arange(Q).view(1, Q)  # (1, Q)
    mask = torch.where(pos.view(1, 1, Q, 1) >= pos.view(1, 1, 1, Q), 0.0, float("-inf"))  # (1, 1, Q, Q)
    return stack(d, h, x, pos, mask, cur_tokens=c)  # (1, Q, D)


def _reference_draft(target, stack, row, k, D):
    """The greedy draft recomputed from the committed tokens alone: module d over positions 0..L-2 with
    tokens x_{i+d} (drafts past the context) and the tokens before them x_{i+d-1}, then module D
    extended on its own outputs."""
    with torch.no_grad():
        L, seq, drafts = row.numel(), row.tolist(), []
        h = target.model(input_ids=row[None, :-1]).last_hidden_state  # (1, L-1, D) h^0
        for d in range(1, D + 1):
            h_in, x = h, torch.tensor(seq + drafts)[d: d + L - 1].view(1, -1)  # (1, L-1, D), (1, L-1)
            c = torch.tensor(seq + drafts)[d - 1: d + L - 2].view(1, -1)  # (1, L-1)
            h = _run(stack, d - 1, h_in, x, c)  # (1, L-1, D) h^d
            drafts.append(int(stack.token_map[stack.logits(d - 1, h[0, -1]).argmax()]))
        for _ in range(D, k):
            h_in = torch.cat([h_in, h[:, -1:]], dim=1)  # module D's own output stands in for h^{D-1}
            c = torch.cat([c, x[:, -1:]], dim=1)
            x = torch.cat([x, torch.tensor([[drafts[-1]]])], dim=1)
            h = _run(stack, D - 1, h_in, x, c)
            drafts.append(int(stack.token_map[stack.logits(D - 1, h[0, -1]).argmax()]))
    return drafts


def _current(target, path, seed=2):
    """The trained file's modules with a current-token input whose columns are random (not zero)."""
    stack = load_mtp(target, path, current_token=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in stack.layers:
            m.eh_proj.weight[:, 2 * stack.hidden_size:].normal_(0, 0.1, generator=g)
    return stack


def test_current_token_modules_start_as_the_file_and_round_trip(trained, tmp_path):
    """current_token: loaded from a two-input file with the third input's columns added, the modules
    compute what the file's compute; with those columns non-zero, module d is
    eh_proj [enorm(Emb(t_{i+d})); hnorm(h); cnorm(Emb(t_{i+d-1}))] by hand; training reads the token
    before each input token, continues such a file with or without the flag and records the shape."""
    target, stack, _, path = trained
    cur, plain = load_mtp(target, path, current_token=True), load_mtp(target, path)
    assert cur.current_token and not plain.current_token and cur.layers[1].eh_proj.in_features == 3 * 32
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 32, generator=g)  # (2, 5, D)
    x, c = torch.randint(0, V, (2, 5), generator=g), torch.randint(0, V, (2, 5), generator=g)  # (2, 5) each
    pos = torch.arange(5).expand(2, 5)  # (2, 5)
    mask = torch.where(pos.view(2, 1, 5, 1) >= pos.view(2, 1, 1, 5), 0.0, float("-inf"))  # (2, 1, 5, 5)
    rms = lambda x, w: w * x / x.pow(2).mean(-1, keepdim=True).add(target.config.rms_norm_eps).sqrt()  # noqa: E731
    emb = target.model.embed_tokens
    with torch.no_grad():
        for d in range(2):
            assert torch.allclose(cur(d, h, x, pos, mask, cur_tokens=c), plain(d, h, x, pos, mask), atol=1e-6), d
        cur = _current(target, path)
        for d, m in enumerate(cur.layers):
            gin = torch.cat([rms(emb(x), m.enorm.weight), rms(h, m.hnorm.weight), rms(emb(c), m.cnorm.weight)], -1)
            want = m.block(gin @ m.eh_proj.weight.T, attention_mask=mask, position_ids=pos,
                           position_embeddings=target.model.rotary_emb(h, position_ids=pos))  # (2, 5, D)
            got = cur(d, h, x, pos, mask, cur_tokens=c)
            assert torch.allclose(got, want, atol=1e-5), d
            assert not torch.allclose(got, plain(d, h, x, pos, mask), atol=1e-3), d
    with pytest.raises(ValueError, match="cur_tokens"):
        cur(0, h, x, pos, mask)
    with pytest.raises(ValueError, match="current_token"):
        MTPStack(target, num_modules=1, current_token=1)
    # training: module d (0-based) reads t_{i+d+1} and, as its third input, t_{i+d}
    train, held = split_heldout(_data(target, 40), 0.25, seed=0)
    task = MTPTask(cur)
    batch = collate(train[:8])
    with torch.no_grad():
        seen = []
        orig = cur.forward
        cur.forward = lambda d, hp, t, p, m, cache=None, cur_tokens=None: seen.append((d, t, cur_tokens)) or orig(
            d, hp, t, p, m, cache, cur_tokens)
        task.loss(batch)
        del cur.forward
    T = batch.tokens.shape[1]
    for d, t, ct in seen:
        assert torch.equal(t, batch.tokens[:, d + 1:]) and torch.equal(ct, batch.tokens[:, d:T - 1]), d
    assert len(seen) == 2
    cfg = TrainConfig(steps=3, batch_size=8, lr=1e-3, warmup_steps=1, eval_every=3, seed=0)
    run_mtp_training(target, train, held, cfg, MTPTrainConfig(current_token=True), tmp_path / "c.safetensors",
                     progress=False, log=lambda s: None, init=path)
    assert mtp_info(tmp_path / "c.safetensors")["record"]["mtp"]["current_token"] is True
    again, _ = run_mtp_training(target, train, held, cfg, MTPTrainConfig(), tmp_path / "c2.safetensors",
                                progress=False, log=lambda s: None, init=tmp_path / "c.safetensors")
    assert again.current_token and mtp_info(tmp_path / "c2.safetensors")["record"]["mtp"]["current_token"] is True
    with pytest.raises(ValueError, match="third input"):
        load_mtp(target, tmp_path / "c.safetensors", current_token=False)
    with pytest.raises(ValueError, match="current_token"):
        MTPTrainConfig(current_token="yes")


@pytest.mark.parametrize("current", [False, True])
def test_modules_from_an_eagle_head(trained, tmp_path, current):
    """mtp_from_eagle: module 1 computes the EAGLE-1 head's logits on the same inputs (exactly once the
    FC bias, which MTP's projection lacks, is zero); every module starts as the head; training
    starts from a head's file given as --init; a two-layer head or another kind is refused."""
    from specref.eagle_head import EagleHead, save_eagle
    from specref.training import mtp_from_eagle

    target, stack, _, _ = trained
    head = EagleHead(target, stack.token_map, seed=4, current_token=current).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, q in head.trainable():  # a head whose every weight matters (current_token's columns too)
            q.add_(torch.randn(q.shape, generator=g) * 0.05)
    h = torch.randn(2, 6, 32, generator=g)  # (2, 6, D)
    x, c = torch.randint(0, V, (2, 6), generator=g), torch.randint(0, V, (2, 6), generator=g)  # (2, 6) each
    pos = torch.arange(6).expand(2, 6)  # (2, 6)
    mask = torch.where(pos.view(2, 1, 6, 1) >= pos.view(2, 1, 1, 6), 0.0, float("-inf"))  # (2, 1, 6, 6)
    kw = {"cur_tokens": c} if current else {}
    with torch.no_grad():
        m = mtp_from_eagle(target, head, num_modules=2)
        assert m.current_token == current and torch.equal(m.token_map, head.token_map)
        biased = head.logits(head(h, x, pos, mask, **kw))  # (2, 6, Vd)
        got = m.logits(0, m(0, h, x, pos, mask, cur_tokens=c))
        assert not torch.allclose(got, biased, atol=1e-4)  # the bias is dropped
        head.fc.bias.zero_()
        assert torch.allclose(m.logits(0, m(0, h, x, pos, mask, cur_tokens=c)), head.logits(head(h, x, pos, mask, **kw)),
                              atol=1e-5)
        assert torch.equal(m.layers[1].eh_proj.weight, head.fc.weight)
        assert torch.equal(m.layers[1].block.mlp.up_proj.weight, head.layer.mlp.up_proj.weight)
    save_eagle(tmp_path / "head.safetensors", head, "fp", {"note": "test"})
    train, held = split_heldout(_data(target, 40), 0.25, seed=0)
    cfg = TrainConfig(steps=2, batch_size=8, lr=1e-3, warmup_steps=1, eval_every=2, seed=0)
    with pytest.warns(UserWarning, match="another target"):
        out, _ = run_mtp_training(target, train, held, cfg, MTPTrainConfig(num_modules=2), tmp_path / "m.safetensors",
                                  progress=False, log=lambda s: None, init=tmp_path / "head.safetensors")
    rec = mtp_info(tmp_path / "m.safetensors")["record"]
    assert rec["init_from"] == "eagle" and rec["mtp"]["current_token"] == current and out.num_modules == 2
    with pytest.raises(ValueError, match="one decoder layer"):
        mtp_from_eagle(target, EagleHead(target, stack.token_map, extra_layers=1))
    with pytest.raises(ValueError, match="EAGLE-1"):
        mtp_from_eagle(target, stack)


@pytest.mark.parametrize("which, modules, k", [("trained", 1, 3), ("trained", 2, 3), ("random", 3, 4),
                                               ("current", 1, 3), ("current", 2, 4)])
def test_draft_equals_recomputation_from_scratch(trained, which, modules, k):
    """Every step of a batched, ragged greedy generation in which row 1 is left out of ctx.active on
    every third step (as hybrid.py does): each drafted row's draft equals the recomputation from its
    committed tokens alone (catch-up, speculative blocks and roll-back are right; a current_token
    stack's third input too: the committed token, then the drafts), the left-out row gets an empty
    draft, and the output is the target's greedy output."""
    target, stack, _, path = trained
    stack = {"trained": stack, "random": MTPStack(target, num_modules=3, seed=5).eval(),
             "current": _current(target, path)}[which]
    prop = MTPProposer(stack, MTPConfig(k=k, modules=modules))
    checked, steps, orig = [], [0], prop.propose

    def propose(ctx, sampling, generator):
        active = ctx.active.clone()
        if steps[0] % 3 == 1:
            active[1] = False
        steps[0] += 1
        d = orig(dataclasses.replace(ctx, active=active), sampling, generator)
        for b in range(ctx.tokens.shape[0]):
            if bool(active[b]):
                assert d.tokens[b].tolist() == _reference_draft(target, stack, ctx.row(b), k, modules), (b, steps)
                checked.append(b)
            else:
                assert int(d.lengths[b]) == 0
        return d

    prop.propose = propose
    ids = torch.tensor([[0, 0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1], [0, 0, 0, 0, 9, 9, 2]])
    mask = (torch.arange(7) >= torch.tensor([2, 0, 4]).view(3, 1)).long()
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=14, temperature=0)
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=14, temperature=0)
    assert torch.equal(out.tokens, ar.tokens)
    assert len(checked) >= 10 and checked.count(1) >= 3, checked
    if which != "random":  # runs of 2+ accepted drafts (catch-up blocks of 3+) and rejections occurred
        assert out.stats.accepted_per_position[1] > 0 and out.stats.acceptance_rate < 0.95, out.stats


@pytest.mark.parametrize("modules, k", [(1, 3), (2, 3), (3, 4)])
def test_one_module_forward_per_drafted_token(trained, modules, k):
    """A step costs k module forwards, one per drafted token: module d's catch-up on its new true
    positions and its speculative block share one forward (they were two before)."""
    target, stack, _, _ = trained
    stack = stack if modules <= stack.num_modules else MTPStack(target, num_modules=modules, seed=5).eval()
    calls = []
    hook = stack.register_forward_hook(lambda mod, args, out: calls.append(args[0]))
    prop, per_step = MTPProposer(stack, MTPConfig(k=k, modules=modules)), []
    orig = prop.propose

    def propose(ctx, sampling, generator):
        n = len(calls)
        d = orig(ctx, sampling, generator)
        per_step.append(calls[n:])
        return d

    prop.propose = propose
    ids = torch.tensor([[0, 0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1]])
    mask = (torch.arange(7) >= torch.tensor([2, 0]).view(2, 1)).long()
    try:
        out = speculative_generate(target, prop, ids, mask, max_new_tokens=12, temperature=0)
    finally:
        hook.remove()
    assert torch.equal(out.tokens, autoregressive_generate(target, ids, mask, max_new_tokens=12, temperature=0).tokens)
    assert len(per_step) >= 3
    want = list(range(modules)) + [modules - 1] * (k - modules)  # module d for depth d, then module D
    assert all(step == want for step in per_step), per_step


@pytest.mark.parametrize("modules, k", [(1, 1), (2, 2), (1, 3), (2, 3)])
def test_greedy_parity_batched(trained, modules, k):
    """Batch 4, left-padded ragged prompts, eos: token for token the target's greedy output, and each
    row alone (batch 1) the same; the trained modules are accepted, depth 2 included."""
    target, stack, _, _ = trained
    g = torch.Generator().manual_seed(k + 10 * modules)
    ids = torch.randint(0, V, (4, 9), generator=g)  # (4, 9)
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 1]).view(4, 1)).long()  # left padding
    cfg = MTPConfig(k=k, modules=modules)
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    sp = speculative_generate(target, MTPProposer(stack, cfg), ids, mask, max_new_tokens=20, temperature=0,
                              eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.tokens_per_forward > 1.2, sp.stats
    if k > 1:
        assert sp.stats.accepted_per_position[1] > 0, sp.stats
    for b in range(4):
        one = speculative_generate(target, MTPProposer(stack, cfg), ids[b:b + 1], mask[b:b + 1], max_new_tokens=20,
                                   temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


@pytest.mark.two_threads
@pytest.mark.parametrize("case", [
    # (temperature, top_k, modules, k, rows)
    (1.0, 0, 2, 2, 70_000),  # plain sampling: depth 2 drafted by module 2 (q = 0 on the 4 tokens outside Vd)
    (0.7, 5, 1, 2, 50_000),  # temperature + top-k on p and q; depth 2 by module 1 reused on its own output
])
def test_whole_loop_lossless(trained, case):
    """Joint of the first 3 tokens vs the exact distribution, all rows in one batch; power: the sample
    size detecting a TV deviation of 0.02 with probability >= 0.99 at 1e-3 is asserted <= rows."""
    target, stack, _, _ = trained
    temperature, top_k, modules, k, n = case
    L, prompt = 3, torch.tensor([3, 1, 4])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k)).numpy()
    assert power_sample_size(exact, n) <= n
    out = speculative_generate(target, MTPProposer(stack, MTPConfig(k=k, modules=modules)), prompt.expand(n, -1),
                               max_new_tokens=L, temperature=temperature, top_k=top_k,
                               generator=torch.Generator().manual_seed(k + 10 * top_k))
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L), exact)
    assert res.p_value > 1e-3, res
    s = out.stats  # thousands of accepted drafts, of rejections, and of accepted second drafts
    assert s.num_accepted_tokens > 2000 and s.num_draft_tokens - s.num_accepted_tokens > 2000, s
    assert s.accepted_per_position[1] > 1000, s


def test_batch_independence_and_inactive_rows(trained):
    """Sampled, one generator per row: row b of a ragged batch equals row b run alone; a row outside
    ctx.active gets an empty draft and draws no random numbers."""
    target, stack, _, _ = trained
    cfg = MTPConfig(k=3, modules=2)
    ids = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(4))  # (4, 8)
    mask = (torch.arange(8) >= torch.tensor([0, 2, 5, 1]).view(4, 1)).long()
    gens = lambda rows: [torch.Generator().manual_seed(70 + b) for b in rows]  # noqa: E731
    batch = speculative_generate(target, MTPProposer(stack, cfg), ids, mask, max_new_tokens=16, temperature=1.0,
                                 generator=gens(range(4)))
    for b in range(4):
        one = speculative_generate(target, MTPProposer(stack, cfg), ids[b:b + 1], mask[b:b + 1], max_new_tokens=16,
                                   temperature=1.0, generator=gens([b]))
        assert one.row(0) == batch.row(b)
    prop, g = MTPProposer(stack, cfg), gens(range(3))
    toks = ids[:3]  # (3, 8)
    feats = target.model(input_ids=toks[:, :7]).last_hidden_state  # (3, 7, D)
    ctx = Context(toks, torch.full((3,), 8), torch.tensor([True, False, True]), feats, torch.full((3,), 7))
    prop.begin(ctx, SamplingConfig(1.0), g)
    before = g[1].get_state()
    d = prop.propose(ctx, SamplingConfig(1.0), g)
    assert d.lengths.tolist() == [3, 0, 3] and d.tokens[1].tolist() == [-1] * 3
    assert torch.equal(g[1].get_state(), before) and not torch.equal(g[0].get_state(), gens([0])[0].get_state())
    assert torch.allclose(d.q[0].sum(-1), torch.ones(3)) and float(d.q[0][:, stack.token_map].sum()) == pytest.approx(3)


def _native_checkpoint(target, stack):
    """A whole tiny checkpoint in the DeepSeek-V3 layout, written by hand: the target's tensors, then
    module j as model.layers.<num_hidden_layers + j> (enorm, hnorm, eh_proj, shared_head, block)."""
    sd = {n: t.clone() for n, t in target.state_dict().items()}
    N = target.config.num_hidden_layers
    for j, m in enumerate(stack.layers):
        pre = f"model.layers.{N + j}."
        sd.update({pre + "enorm.weight": m.enorm.weight, pre + "hnorm.weight": m.hnorm.weight,
                   pre + "eh_proj.weight": m.eh_proj.weight, pre + "shared_head.norm.weight": m.norm.weight,
                   pre + "shared_head.head.weight": target.lm_head.weight, pre + "embed_tokens.weight":
                   target.model.embed_tokens.weight})
        sd.update({pre + n: t for n, t in m.block.state_dict().items()})
    return {n: t.detach().clone().contiguous() for n, t in sd.items()}


def test_native_loader_round_trip(trained, tmp_path):
    """The tiny DeepSeek-V3-layout checkpoint (a safetensors file, a folder, a state dict) loads into
    modules equal to the ones built in memory, which draft exactly the same tokens and q."""
    target, stack, _, _ = trained
    sd = _native_checkpoint(target, stack)
    save_file(sd, str(tmp_path / "model.safetensors"))
    drafts = []
    for src in (tmp_path / "model.safetensors", tmp_path, sd, None):
        s = stack if src is None else load_native_mtp(target, src, token_map=stack.token_map)
        assert s.num_modules == 2
        for (n, a), (_, b) in zip(stack.trainable(), s.trainable()):
            assert torch.equal(a, b), n
        prop, rec = MTPProposer(s, MTPConfig(k=3, modules=2)), []
        orig = prop.propose
        prop.propose = lambda ctx, sm, g: (lambda d: rec.append((d.tokens.clone(), d.q.clone())) or d)(orig(ctx, sm, g))
        speculative_generate(target, prop, torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]]), max_new_tokens=12,
                             temperature=1.0, generator=torch.Generator().manual_seed(1))
        drafts.append(rec)
    for rec in drafts[:-1]:
        assert len(rec) == len(drafts[-1]) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                                   for a, b in zip(rec, drafts[-1]))
    assert load_native_mtp(target, sd, num_modules=1).num_modules == 1


def test_native_loader_errors(trained, tmp_path):
    """A missing or misshaped MTP tensor, a foreign one, or none at all: ValueError naming it."""
    target, stack, _, _ = trained
    sd = _native_checkpoint(target, stack)

    def broken(**change):
        out = dict(sd)
        for name, t in change.items():
            name = "model.layers." + name.replace("__", ".")
            if t is None:
                del out[name]
            else:
                out[name] = t
        return out

    with pytest.raises(ValueError, match=r"lacks the MTP tensor 'model\.layers\.2\.eh_proj\.weight'"):
        load_native_mtp(target, broken(**{"2__eh_proj__weight": None}))
    with pytest.raises(ValueError, match=r"lacks the MTP tensor 'model\.layers\.3\.self_attn\.k_proj\.weight'"):
        load_native_mtp(target, broken(**{"3__self_attn__k_proj__weight": None}))
    with pytest.raises(ValueError, match=r"lacks the MTP tensor 'model\.layers\.2\.shared_head\.head\.weight'"):
        load_native_mtp(target, broken(**{"2__shared_head__head__weight": None}))
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.hnorm\.weight' has shape \(31,\)"):
        load_native_mtp(target, broken(**{"2__hnorm__weight": torch.ones(31)}))
    with pytest.raises(ValueError, match=r"'model\.layers\.3\.mlp\.down_proj\.weight' has shape \(32, 5\)"):
        load_native_mtp(target, broken(**{"3__mlp__down_proj__weight": torch.zeros(32, 5)}))
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.shared_head\.head\.weight' has shape \(8, 32\)"):
        load_native_mtp(target, broken(**{"2__shared_head__head__weight": torch.zeros(8, 32)}))
    with pytest.raises(ValueError, match=r"unexpected MTP tensor 'model\.layers\.2\.mlp\.experts\.0\.weight'"):
        load_native_mtp(target, broken(**{"2__mlp__experts__0__weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"no MTP layer.*model\.layers\.2\."):
        load_native_mtp(target, {n: t for n, t in sd.items() if not n.startswith(("model.layers.2", "model.layers.3"))})
    with pytest.raises(ValueError, match=r"num_modules = 3, but the checkpoint has 2"):
        load_native_mtp(target, sd, num_modules=3)
    with pytest.raises(ValueError, match="neither a state dict"):
        load_native_mtp(target, tmp_path / "missing.safetensors")
    with pytest.warns(UserWarning, match=r"model\.layers\.2\.shared_head\.head\.weight differs"):
        load_native_mtp(target, broken(**{"2__shared_head__head__weight": torch.zeros(V, 32)}))


def test_bench_method():
    """The bench's `mtp` method: untrained modules on the tiny model reproduce the greedy baseline; for
    the default model without a committed file it is skipped with the reason."""
    from specref.bench.methods import build_methods, load_model
    from specref.bench.runner import BenchConfig
    from specref.mtp import WEIGHTS
    from specref.target import Target

    cfg = BenchConfig(methods=("mtp",), model="tiny", max_new_tokens=12, progress=False)
    model, encode, eos, _ = load_model(cfg)
    methods, skipped = build_methods(cfg, model, eos, Target(model))
    assert [m.name for m in methods] == ["ar", "mtp"] and not skipped and methods[1].k == 3
    ids = torch.tensor([encode("Hello there, MTP")])  # (1, T)
    assert methods[1].run(ids, 128, 0)["tokens"] == methods[0].run(ids, 128, 0)["tokens"]
    if not WEIGHTS.is_file():
        _, skipped = build_methods(dataclasses.replace(cfg, model="default"), model, eos, Target(model))
        assert "no trained MTP modules" in skipped["mtp"] and "train --method mtp" in skipped["mtp"]


def test_bad_config(trained):
    target, stack, _, _ = trained
    for bad in (dict(k=0), dict(k=2.5), dict(k=True), dict(modules=0), dict(modules="2")):
        with pytest.raises(ValueError, match="k must be|modules must be"):
            MTPConfig(**bad)
    assert MTPConfig(k=np.int64(2), modules=torch.tensor(1)) == MTPConfig(k=2, modules=1)
    with pytest.raises(ValueError, match="MTPStack"):
        MTPProposer(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"modules = 3, but the stack has 2"):
        MTPProposer(stack, MTPConfig(modules=3))
    with pytest.raises(ValueError, match="num_modules must be"):
        MTPStack(target, num_modules=0)
    with pytest.raises(ValueError, match="token_map"):
        MTPStack(target, torch.tensor([0, V]))
    with pytest.raises(ValueError, match="Llama-family"):
        MTPStack(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="before begin"):
        MTPProposer(stack).propose(None, SamplingConfig(0.0), None)
    for bad in (dict(num_modules=0), dict(draft_vocab=1), dict(lam=0.0), dict(heldout_fraction=1.0)):
        with pytest.raises(ValueError, match="num_modules|draft_vocab|lam|heldout_fraction"):
            MTPTrainConfig(**bad)
    with pytest.raises(ValueError, match="features"):
        MTPTask(stack).loss(collate([Seq(torch.arange(6), 3)]))
    with pytest.raises(ValueError, match=r"train_seqs\[0\] has no features"):
        run_mtp_training(target, [Seq(torch.arange(6), 3)], [], TrainConfig(steps=1), MTPTrainConfig(), "unused")
    with pytest.raises(ValueError, match="features"):  # run outside speculative_generate: no ctx.hidden
        MTPProposer(stack).begin(Context(torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]),
                                         torch.tensor([True])), SamplingConfig(0.0), None)
