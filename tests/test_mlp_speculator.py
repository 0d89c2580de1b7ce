"""Tests of mlp_speculator.py / training/mlp_speculator.py: the stages are the published formula, each
step's draft is the speculator on the newest target state, greedy parity (ragged batch), losslessness of
the whole loop (chi-square against the exact joint, random speculator), batch independence, the
published-format loader on a tiny checkpoint written here, training, the registry's methods, errors."""
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from _features import feature_data, feature_target
from _stats import power_rows
from specref import oracle
from specref.generate import autoregressive_generate, speculative_generate
from specref.mlp_speculator import (MLPSpeculator, MLPSpeculatorConfig, MLPSpeculatorProposer, load_mlp_speculator,
                                    mlp_speculator_info)
from specref.published import load_published_mlp_speculator
from specref.oracle.exact import hf_joint_distribution
from specref.proposer import Context
from specref.sampling import SamplingConfig
from specref.training.data import Seq, collate
from specref.training.loop import TrainConfig, split_heldout
from specref.training.mlp_speculator import (MLPSpeculatorTask, MLPSpeculatorTrainConfig,
                                             run_mlp_speculator_training)

V = 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target, tied 3-stage speculator over 12 of 16 tokens, history, file): 150 steps on 128 sequences."""
    target = feature_target()
    train, held = split_heldout(feature_data(target, 160), 0.2, seed=0)
    path = tmp_path_factory.mktemp("mlp") / "mlp.safetensors"
    cfg = TrainConfig(steps=150, batch_size=16, lr=1e-2, warmup_steps=5, eval_every=150, seed=0)
    spec, res = run_mlp_speculator_training(target, train, held, cfg, MLPSpeculatorTrainConfig(draft_vocab=12),
                                            path, progress=False, log=lambda s: None)
    return target, spec, res.history, path, held


def _random(target, **kw):
    """An untrained speculator over 12 of the 16 tokens (in no order): rarely right, never wrong in law."""
    token_map = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:12]  # (12,)
    return MLPSpeculator(target, 3, token_map=token_map, seed=3, **kw).eval()


def test_stages_are_the_published_formula(trained):
    """Stage i by hand: s_i = GELU(LN_i(P_i s_{i-1} + (w_e / w_s) E_i(x))), LN_i = x / rms(x) * w + b
    (no mean subtracted), s_0 = LN_0(h) / sqrt(2) with scale_input, w_s = 0.5 ** (0.5 / n),
    w_e = sqrt((1 - w_s^2) d / 2); untied stages have their own tensors, tied ones share them."""
    target = trained[0]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 32, generator=g)  # (4, D)
    x = torch.randint(0, V, (4,), generator=g)  # (4,)
    ln = lambda z, w, b: z / z.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w + b  # noqa: E731
    for tie, scale, d in ((False, False, 24), (True, True, 32), (False, True, 0)):
        spec = MLPSpeculator(target, 4, d, tie_weights=tie, scale_input=scale, token_map=torch.arange(12), seed=1)
        with torch.no_grad():
            for m in spec.ln:  # non-trivial LN parameters
                m.weight.normal_(1, 0.2, generator=g), m.bias.normal_(0, 0.2, generator=g)
            w_s = 0.5 ** (0.5 / 4)
            w_e = math.sqrt((1 - w_s ** 2) * (spec.inner_dim / 2))
            s = h / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() / math.sqrt(2) if scale else h  # (4, D)
            assert torch.allclose(spec.start(h), s, atol=1e-6)
            for i in range(4):
                j = 0 if tie else i
                P = spec.proj[min(i, 1) if tie else i].weight
                z = s @ P.T + (w_e / w_s) * spec.emb[j].weight[x]  # (4, d)
                want = torch.nn.functional.gelu(ln(z, spec.ln[j].weight, spec.ln[j].bias))  # (4, d)
                got = spec.stage(i, spec.start(h) if i == 0 else got, x)  # (4, d)
                assert torch.allclose(got, want, atol=1e-5), (tie, scale, i)
                assert torch.allclose(spec.logits(i, got), got @ spec.head[j].weight.T, atol=1e-5)
                s = want
        names = {n for n, _ in spec.trainable()}
        assert ("proj.2.weight" in names) != tie and ("emb.1.weight" in names) != tie and "ln.0.bias" in names
        assert spec.head[0].weight.shape == (12, spec.inner_dim) and spec.proj[0].bias is None


def _reference_draft(target, spec, row, k):
    """The greedy draft recomputed from the committed tokens alone: the target's state at the token
    before the pending one, then the stages on their own argmax."""
    with torch.no_grad():
        h = target.model(input_ids=row[None, :-1]).last_hidden_state[0, -1:]  # (1, D)
        s, x, out = spec.start(h), row[-1:], []
        for j in range(k):
            s = spec.stage(j, s, x)  # (1, d)
            x = spec.token_map[spec.logits(j, s).argmax(-1)]  # (1,)
            out.append(int(x))
    return out


@pytest.mark.parametrize("which", ["trained", "random"])
def test_draft_is_the_speculator_on_the_newest_state(trained, which):
    """Every step of a batched, ragged greedy generation in which row 1 is left out of ctx.active on
    every third step (as hybrid.py does): each drafted row's draft equals the recomputation from its
    committed tokens alone, the left-out row gets an empty draft, the output is the target's greedy one."""
    target, spec = trained[0], trained[1] if which == "trained" else _random(target=trained[0], scale_input=True)
    prop, checked, steps = MLPSpeculatorProposer(spec, MLPSpeculatorConfig(k=3)), [], [0]
    orig = prop.propose

    def propose(ctx, sampling, generator):
        active = ctx.active.clone()
        if steps[0] % 3 == 1:
            active[1] = False
        steps[0] += 1
        d = orig(dataclasses.replace(ctx, active=active), sampling, generator)
        for b in range(ctx.tokens.shape[0]):
            if bool(active[b]):
                assert d.tokens[b].tolist() == _reference_draft(target, spec, ctx.row(b), 3), (b, steps)
                checked.append(b)
            else:
                assert int(d.lengths[b]) == 0
        return d

    prop.propose = propose
    ids = torch.tensor([[0, 0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1], [0, 0, 0, 0, 9, 9, 2]])
    mask = (torch.arange(7) >= torch.tensor([2, 0, 4]).view(3, 1)).long()
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=14, temperature=0)
    assert torch.equal(out.tokens, autoregressive_generate(target, ids, mask, max_new_tokens=14, temperature=0).tokens)
    assert len(checked) >= 10 and checked.count(1) >= 3, checked


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_parity_batched(trained, k):
    """Batch 4, left-padded ragged prompts, eos: token for token the target's greedy output, each row
    alone the same; the trained stages are accepted, stage 2 included."""
    target, spec = trained[0], trained[1]
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(k))  # (4, 9)
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 1]).view(4, 1)).long()  # left padding
    cfg = MLPSpeculatorConfig(k=k)
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    sp = speculative_generate(target, MLPSpeculatorProposer(spec, cfg), ids, mask, max_new_tokens=20,
                              temperature=0, eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.tokens_per_forward > 1.2, sp.stats
    if k > 1:
        assert sp.stats.accepted_per_position[1] > 0, sp.stats
    for b in range(4):
        one = speculative_generate(target, MLPSpeculatorProposer(spec, cfg), ids[b:b + 1], mask[b:b + 1],
                                   max_new_tokens=20, temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


@pytest.mark.two_threads
@pytest.mark.parametrize("case", [
    # (temperature, top_k, which)
    (1.0, 0, "random"),  # plain sampling: 3 untied random stages, q = 0 on the 4 tokens outside Vd
    (0.7, 5, "trained"),  # temperature + top-k on p and q; the trained tied stages (scaled input)
])
def test_whole_loop_lossless(trained, case):
    """k = 3: joint of the first 3 tokens vs the exact distribution, all rows in one batch, sized by
    power_rows (TV 0.02 detected with probability >= 0.99 at 1e-3)."""
    target = trained[0]
    temperature, top_k, which = case
    spec = _random(target) if which == "random" else trained[1]
    L, prompt = 3, torch.tensor([3, 1, 4])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k)).numpy()
    n = power_rows(exact)
    out = speculative_generate(target, MLPSpeculatorProposer(spec, MLPSpeculatorConfig(k=3)), prompt.expand(n, -1),
                               max_new_tokens=L, temperature=temperature, top_k=top_k,
                               generator=torch.Generator().manual_seed(7 + top_k))
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L), exact)
    assert res.p_value > 1e-3, res
    s = out.stats  # accepted drafts, rejections and accepted second drafts, by the thousand
    assert s.num_accepted_tokens > 1000 and s.num_draft_tokens - s.num_accepted_tokens > 1000, s
    assert s.accepted_per_position[1] > 100, s


def test_batch_independence_and_inactive_rows(trained):
    """Sampled, one generator per row: row b of a ragged batch equals row b run alone; a row outside
    ctx.active gets an empty draft and draws no random numbers; q sums to 1 inside the draft vocabulary."""
    target, spec = trained[0], trained[1]
    cfg = MLPSpeculatorConfig(k=3)
    ids = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(4))  # (4, 8)
    mask = (torch.arange(8) >= torch.tensor([0, 2, 5, 1]).view(4, 1)).long()
    gens = lambda rows: [torch.Generator().manual_seed(70 + b) for b in rows]  # noqa: E731
    batch = speculative_generate(target, MLPSpeculatorProposer(spec, cfg), ids, mask, max_new_tokens=16,
                                 temperature=1.0, generator=gens(range(4)))
    for b in range(4):
        one = speculative_generate(target, MLPSpeculatorProposer(spec, cfg), ids[b:b + 1], mask[b:b + 1],
                                   max_new_tokens=16, temperature=1.0, generator=gens([b]))
        assert one.row(0) == batch.row(b)
    prop, g = MLPSpeculatorProposer(spec, cfg), gens(range(3))
    toks = ids[:3]  # (3, 8)
    feats = target.model(input_ids=toks[:, :7]).last_hidden_state  # (3, 7, D)
    ctx = Context(toks, torch.full((3,), 8), torch.tensor([True, False, True]), feats, torch.full((3,), 7))
    prop.begin(ctx, SamplingConfig(1.0), g)
    before = g[1].get_state()
    d = prop.propose(ctx, SamplingConfig(1.0), g)
    assert d.lengths.tolist() == [3, 0, 3] and d.tokens[1].tolist() == [-1] * 3
    assert torch.equal(g[1].get_state(), before) and not torch.equal(g[0].get_state(), gens([0])[0].get_state())
    assert torch.allclose(d.q[0].sum(-1), torch.ones(3)) and float(d.q[0][:, spec.token_map].sum()) == pytest.approx(3)


def _published(spec, tied_copies=False):
    """A tiny checkpoint in the published format, written by hand: config.json's fields as vLLM's
    MLPSpeculatorConfig has them and the tensors under `speculator.` (heads over the whole vocabulary;
    tied stages optionally repeated under every index, as a state_dict of shared modules writes them)."""
    n, d = spec.n_predict, spec.inner_dim
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "vocab_size": V,
              "emb_dim": 32, "inner_dim": d, "n_predict": n, "top_k_tokens_per_head": [5, 4, 3][:n] + [1] * (n - 3),
              "n_candidates": 5, "tie_weights": spec.tie_weights, "scale_input": spec.scale_input}
    sd = {}
    for i in range(n if (tied_copies or not spec.tie_weights) else 1):
        j = 0 if spec.tie_weights else i
        full = torch.zeros(V, d)
        full[spec.token_map] = spec.head[j].weight.detach()  # (V, d)
        sd.update({f"emb.{i}.weight": spec.emb[j].weight, f"head.{i}.weight": full,
                   f"ln.{i}.weight": spec.ln[j].weight, f"ln.{i}.bias": spec.ln[j].bias})
    for i in range(n if (tied_copies or not spec.tie_weights) else 2):
        sd[f"proj.{i}.weight"] = spec.proj[min(i, 1) if spec.tie_weights else i].weight
    return config, {"speculator." + k: v.detach().clone().contiguous() for k, v in sd.items()}


@pytest.mark.parametrize("tie, copies", [(False, False), (True, False), (True, True)])
def test_published_loader_round_trip(trained, tmp_path, tie, copies):
    """The tiny published checkpoint (a folder with config.json + safetensors, or a (config, state dict)
    pair) loads into a speculator equal to the one built in memory, which drafts the same tokens and q."""
    target = trained[0]
    spec = _random(target, tie_weights=tie, scale_input=tie)
    config, sd = _published(spec, copies)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(sd, str(tmp_path / "model.safetensors"))
    drafts = []
    for src in (tmp_path, (config, sd), None):
        s = spec if src is None else load_published_mlp_speculator(target, src, token_map=spec.token_map)
        assert s.arch() == spec.arch()
        for (n, a), (_, b) in zip(spec.named_parameters(), s.named_parameters()):
            assert torch.equal(a, b), n
        prop, rec = MLPSpeculatorProposer(s, MLPSpeculatorConfig(k=3)), []
        orig = prop.propose
        prop.propose = lambda ctx, sm, g: (lambda d: rec.append((d.tokens.clone(), d.q.clone())) or d)(orig(ctx, sm, g))
        speculative_generate(target, prop, torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]]), max_new_tokens=12,
                             temperature=1.0, generator=torch.Generator().manual_seed(1))
        drafts.append(rec)
    for rec in drafts[:-1]:
        assert len(rec) == len(drafts[-1]) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                                   for a, b in zip(rec, drafts[-1]))
    whole = load_published_mlp_speculator(target, (config, sd))  # no token_map: the whole vocabulary
    assert whole.head[0].weight.shape == (V, spec.inner_dim) and torch.equal(whole.token_map, torch.arange(V))


def test_published_loader_errors(trained, tmp_path):
    """A missing, misshaped or foreign tensor, a config of another model: ValueError naming it."""
    target = trained[0]
    config, sd = _published(_random(target))

    def without(name):
        return {k: v for k, v in sd.items() if k != name}

    with pytest.raises(ValueError, match=r"lacks the MLP speculator tensor 'proj\.2\.weight'"):
        load_published_mlp_speculator(target, (config, without("speculator.proj.2.weight")))
    with pytest.raises(ValueError, match=r"lacks the MLP speculator tensor 'ln\.1\.bias'"):
        load_published_mlp_speculator(target, (config, without("speculator.ln.1.bias")))
    with pytest.raises(ValueError, match=r"'head\.0\.weight' has shape \(12, 32\)"):
        load_published_mlp_speculator(target, (config, {**sd, "speculator.head.0.weight": torch.zeros(12, 32)}))
    with pytest.raises(ValueError, match=r"'proj\.1\.weight' has shape \(32, 5\)"):
        load_published_mlp_speculator(target, (config, {**sd, "speculator.proj.1.weight": torch.zeros(32, 5)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'emb\.3\.weight'"):
        load_published_mlp_speculator(target, (config, {**sd, "emb.3.weight": torch.zeros(V, 32)}))
    with pytest.raises(ValueError, match=r"config emb_dim = 64, the target's is 32"):
        load_published_mlp_speculator(target, ({**config, "emb_dim": 64}, sd))
    with pytest.raises(ValueError, match=r"config vocab_size = 17"):
        load_published_mlp_speculator(target, ({**config, "vocab_size": 17}, sd))
    with pytest.raises(ValueError, match="not a folder with config.json"):
        load_published_mlp_speculator(target, tmp_path)


def test_training_lowers_heldout_loss_and_writes_weights(trained, tmp_path):
    """Every stage learns (per-stage metrics in the history); the file round-trips (bf16), its record
    holds the held-out curve; `init` continues a file (its first evaluation is the file's)."""
    target, spec, hist, path, held = trained
    first, last = hist[0], hist[-1]
    assert first["step"] == 0 and last["step"] == 150
    for d in (1, 2, 3):
        assert last[f"heldout_ce_{d}"] < first[f"heldout_ce_{d}"] - 0.2, (d, first, last)
        assert last[f"heldout_top1_{d}"] > first[f"heldout_top1_{d}"] + 0.1, (d, first, last)
    meta = mlp_speculator_info(path)
    assert meta["arch"] == spec.arch() and meta["arch"]["tie_weights"] and meta["arch"]["target_embedding"]
    assert meta["record"]["heldout"]["heldout_top1_3"] == last["heldout_top1_3"] and len(meta["record"]["history"]) == 2
    again = load_mlp_speculator(target, path)
    assert torch.equal(again.token_map, spec.token_map) and not any(n.startswith("emb.") for n, _ in again.trainable())
    for (n, a), (_, b) in zip(spec.trainable(), again.trainable()):
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), n  # stored as bfloat16
    from specref.training.transfer import mlp_speculator_task, per_category

    task, record = mlp_speculator_task(target, path)
    res = per_category(task, held, ["x"] * len(held), batch_size=16)
    assert len(res["all"]["top1_by_depth"]) == 3 and record["heldout"]["heldout_top1"] == last["heldout_top1"]
    train = split_heldout(feature_data(target, 40, seed=1), 0.0, seed=0)[0]
    cfg = TrainConfig(steps=2, batch_size=8, eval_every=2, seed=0)
    more, res = run_mlp_speculator_training(target, train, held, cfg, MLPSpeculatorTrainConfig(draft_vocab=V),
                                            tmp_path / "more.safetensors", init=path, progress=False, log=lambda s: None)
    saved = MLPSpeculatorTask(again).evaluate(collate(held, 512))
    assert res.history[0]["heldout_top1"] == pytest.approx(saved["top1"] / saved["count"], abs=1e-6)
    assert torch.equal(more.token_map, spec.token_map)  # the file's vocabulary, not draft_vocab = V
    assert mlp_speculator_info(tmp_path / "more.safetensors")["record"]["init"]["path"] == path.name


def test_training_positions_are_the_drafting_positions(trained):
    """The task's held-out stage-1 top-1 counts exactly the positions where the proposer's first greedy
    draft (the speculator on the target's state before the pending token and that token) is the
    target's argmax: training teaches the stages what drafting asks of them."""
    target, spec, _, _, held = trained
    seqs = held[:6]
    m = MLPSpeculatorTask(spec).evaluate(collate(seqs, 512))
    hits = count = 0
    for s in seqs:
        for t in range(max(s.prompt_len - 1, spec.n_predict), len(s.tokens) - 1):  # x_t pending
            row = t - (s.prompt_len - 1)  # topk_ids[row]: p(x_{t+1} | x_{<=t})
            hits += _reference_draft(target, spec, s.tokens[: t + 1], 1)[0] == int(s.topk_ids[row, 0])
            count += 1
    assert count == m["count"] and count > 50 and hits == m["top1_1"], (hits, count, m)


def test_registry_methods_and_hybrid_greedy_parity():
    """`mlp_speculator` and `hybrid_mlp_speculator` build on a tiny model (untrained) and reproduce the
    greedy baseline; for a custom model they need a named file."""
    from specref.hybrid import HybridProposer
    from specref.models import tiny_model
    from specref.registry import LEARNED, Registry

    model = tiny_model("llama", vocab_size=64, init_std=0.2)
    reg = Registry(model, kind="tiny", draft_k=2, cost_reps=1)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 9, 9, 4, 1, 2, 3, 9]])  # repeats: n-gram matches
    ar = autoregressive_generate(model, ids, max_new_tokens=16, temperature=0)
    for name in ("mlp_speculator", "hybrid_mlp_speculator"):
        p = reg.proposer(name)
        assert isinstance(p, HybridProposer) == (name == "hybrid_mlp_speculator")
        assert getattr(p, "learned", p).k == 2 and LEARNED[name] == "mlp_speculator" and "MLP speculator" in reg.label(name)
        out = speculative_generate(model, p, ids, max_new_tokens=16, temperature=0)
        assert torch.equal(out.tokens, ar.tokens), name
        if name.startswith("hybrid"):
            assert min(p.source_counts) > 0, p.source_counts  # both sources drafted
    with pytest.raises(ValueError, match="no trained mlp_speculator for this model"):
        Registry(model, kind="custom").proposer("mlp_speculator")


def test_bad_config(trained):
    target, spec = trained[0], trained[1]
    for bad in (dict(k=0), dict(k=2.5), dict(k=True)):
        with pytest.raises(ValueError, match="k must be"):
            MLPSpeculatorConfig(**bad)
    with pytest.raises(ValueError, match=r"k = 4, but the speculator has 3 stage"):
        MLPSpeculatorProposer(spec, MLPSpeculatorConfig(k=4))
    with pytest.raises(ValueError, match="MLPSpeculator"):
        MLPSpeculatorProposer(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="n_predict must be"):
        MLPSpeculator(target, 0)
    with pytest.raises(ValueError, match="inner_dim must be"):
        MLPSpeculator(target, 2, -1)
    with pytest.raises(ValueError, match="tie_weights needs n_predict >= 2"):
        MLPSpeculator(target, 1, tie_weights=True)
    with pytest.raises(ValueError, match="target_embedding needs inner_dim"):
        MLPSpeculator(target, 2, 16, target_embedding=True)
    with pytest.raises(ValueError, match="token_map"):
        MLPSpeculator(target, 2, token_map=torch.tensor([0, V]))
    with pytest.raises(ValueError, match="before begin"):
        MLPSpeculatorProposer(spec).propose(None, SamplingConfig(0.0), None)
    with pytest.raises(ValueError, match="features"):  # run outside speculative_generate: no ctx.hidden
        MLPSpeculatorProposer(spec).begin(Context(torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]),
                                                  torch.tensor([True])), SamplingConfig(0.0), None)
    for bad in (dict(n_predict=0), dict(inner_dim=-1), dict(draft_vocab=1), dict(heldout_fraction=1.0)):
        with pytest.raises(ValueError, match="n_predict|inner_dim|draft_vocab|heldout_fraction"):
            MLPSpeculatorTrainConfig(**bad)
    with pytest.raises(ValueError, match="features"):
        MLPSpeculatorTask(spec).loss(collate([Seq(torch.arange(6), 3)]))
    with pytest.raises(ValueError, match=r"train\[0\] has no features"):
        run_mlp_speculator_training(target, [Seq(torch.arange(6), 3)], [], TrainConfig(steps=1),
                                    MLPSpeculatorTrainConfig(), "unused")
    from specref.picker.costs import measure_speculator_cost

    cost = measure_speculator_cost(target, spec, k=2, reps=3)  # the chain's c per drafted token
    assert cost["k"] == 2 and cost["c"] == pytest.approx(cost["t_chain"] / 2 / cost["t_target"])
    from specref.training.cli import train_main

    with pytest.raises(ValueError, match="--init"):  # eagle continues a head trained on stores only
        train_main(["--method", "eagle", "--init", "x.safetensors"])
