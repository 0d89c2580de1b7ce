"""Tests of specref.published: tiny checkpoints written here in the published EAGLE-1/2, EAGLE-3 and
Medusa layouts (names, shapes, config fields as their authors ship them) load onto specref's head
classes; drafts equal those of the same weights set through specref's own names (mapping); greedy
parity with plain decoding (chains, EAGLE-2 trees, Medusa trees); the whole loop's chi-square at
T > 0; refusals (pickle, another target, unknown tensors)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from _features import V, feature_target
from _stats import power_rows
from specref import oracle
from specref.eagle3 import Eagle3Head
from specref.eagle_head import EagleConfig, EagleHead, EagleProposer
from specref.eagle_tree import Eagle2Config, Eagle2Proposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.medusa_heads import MedusaConfig, MedusaHeads, MedusaProposer
from specref.oracle.exact import hf_joint_distribution
from specref.published import (PublishedEagle3Head, load_published_eagle, load_published_eagle3,
                               load_published_medusa)
from specref.sampling import SamplingConfig
from specref.target import additive_mask

DRAFT_VOCAB = [0, 1, 2, 3, 5, 6, 8, 9, 10, 12, 13, 15]  # EAGLE-3's draft vocabulary (target ids)
AUX = [0, 1, 1]  # EAGLE-3: the states entering these target layers (a 2-layer target)


@pytest.fixture(scope="module")
def target():
    return feature_target()


def _rand(shape, g, std=0.3):
    return torch.randn(shape, generator=g) * std


def _layer_tensors(target, prefix, g, in_dim, input_norm):
    """A Llama decoder layer's published tensors: q/k/v read `in_dim` features."""
    out = {}
    for n, p in target.model.layers[-1].named_parameters():
        if n == "input_layernorm.weight" and not input_norm:
            continue
        shape = list(p.shape)
        if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj") and n.endswith("weight"):
            shape[1] = in_dim
        out[prefix + n] = 1 + _rand(shape, g, 0.1) if "norm" in n else _rand(shape, g)
    return out


def _config(target, **extra):
    c = target.config
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            **extra}


def write_eagle(target, folder, seed=0):
    """SafeAILab's EAGLE-1/2 layout: fc (bias), layers.0.* without input_layernorm, embed_tokens."""
    g, D = torch.Generator().manual_seed(seed), target.config.hidden_size
    t = {"fc.weight": _rand((D, 2 * D), g), "fc.bias": _rand((D,), g),
         "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
         **_layer_tensors(target, "layers.0.", g, D, input_norm=False)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_config(target, bias=True)))
    return t


def write_eagle3(target, folder, seed=1):
    """SafeAILab's EAGLE-3 layout: fc (3D -> D), midlayer.* (2D-wide q/k/v, hidden_norm), norm,
    lm_head over the draft vocabulary, d2t / t2d."""
    g, D = torch.Generator().manual_seed(seed), target.config.hidden_size
    vd = torch.tensor(DRAFT_VOCAB)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vd] = True
    t = {"fc.weight": _rand((D, 3 * D), g), "norm.weight": 1 + _rand((D,), g, 0.1),
         "lm_head.weight": _rand((len(DRAFT_VOCAB), D), g, 1.0), "d2t": vd - torch.arange(len(vd)), "t2d": t2d,
         "midlayer.hidden_norm.weight": 1 + _rand((D,), g, 0.1),
         **_layer_tensors(target, "midlayer.", g, 2 * D, input_norm=True)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_config(
        target, draft_vocab_size=len(DRAFT_VOCAB), eagle_config={"eagle_aux_hidden_state_layer_ids": AUX})))
    return t


def write_medusa(target, folder, heads=3, seed=2):
    """FasterDecoding's layout: medusa_head.{i}.0.linear.* ResBlock, medusa_head.{i}.1.weight LM head."""
    g, D = torch.Generator().manual_seed(seed), target.config.hidden_size
    t = {}
    for i in range(heads):
        t[f"medusa_head.{i}.0.linear.weight"] = _rand((D, D), g)
        t[f"medusa_head.{i}.0.linear.bias"] = _rand((D,), g)
        t[f"medusa_head.{i}.1.weight"] = target.lm_head.weight.detach().clone() + _rand((V, D), g, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "medusa_lm_head.safetensors"))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": "tiny"}))
    return t


def _set(module, tensors):
    with torch.no_grad():
        params = dict(module.named_parameters())
        for n, t in tensors.items():
            params[n].copy_(t)


def own_eagle(target, t):
    """The same EAGLE-1/2 weights set through EagleHead's own names, its absent norms identities."""
    head = EagleHead(target, torch.arange(V))
    head.norm_e = head.norm_f = head.norm = head.layer.input_layernorm = torch.nn.Identity()
    _set(head, {("layer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): v
                for n, v in t.items() if n != "embed_tokens.weight"})
    return head.eval()


def own_medusa(target, t, heads=3):
    m = MedusaHeads(target, heads, None, num_layers=1, own_lm_head=True)
    _set(m, {(f"blocks.{n.split('.')[1]}.0.linear.{n.split('.')[-1]}" if ".linear." in n
              else f"lm_heads.{n.split('.')[1]}.weight"): v for n, v in t.items()})
    return m.eval()


def test_eagle_mapping_drafts_equal(target, tmp_path):
    t = write_eagle(target, tmp_path / "e")
    loaded, own = load_published_eagle(target, tmp_path / "e"), own_eagle(target, t)
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(0))
    runs = [speculative_generate(target, EagleProposer(h, EagleConfig(k=3)), ids, max_new_tokens=12,
                                 temperature=1.0, generator=torch.Generator().manual_seed(5)) for h in (loaded, own)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert runs[0].stats.num_draft_tokens == runs[1].stats.num_draft_tokens
    assert runs[0].stats.num_accepted_tokens == runs[1].stats.num_accepted_tokens


def test_medusa_mapping_drafts_equal(target, tmp_path):
    t = write_medusa(target, tmp_path / "m")
    loaded, own = load_published_medusa(target, tmp_path / "m"), own_medusa(target, t)
    h = torch.randn(4, target.config.hidden_size)
    assert torch.equal(loaded(h), own(h))
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(0))
    a, b = (speculative_generate(target, MedusaProposer(m), ids, max_new_tokens=12, temperature=0)
            for m in (loaded, own))
    assert torch.equal(a.tokens, b.tokens) and a.stats.num_accepted_tokens == b.stats.num_accepted_tokens


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _ref_layer(target, t, pre, x, residual, pos):
    """A Llama decoder layer by the formula (no cache, causal): attention over x (its q/k/v read
    x's width), residual `residual`, post-attention norm, SwiGLU MLP. -> (1, Q, D)"""
    c, Q = target.config, x.shape[1]
    H, KV, D = c.num_attention_heads, c.num_key_value_heads, c.hidden_size
    hd = D // H
    q = (x @ t[pre + "self_attn.q_proj.weight"].T).view(1, Q, H, hd).transpose(1, 2)
    k = (x @ t[pre + "self_attn.k_proj.weight"].T).view(1, Q, KV, hd).transpose(1, 2)
    v = (x @ t[pre + "self_attn.v_proj.weight"].T).view(1, Q, KV, hd).transpose(1, 2)
    cos, sin = target.model.rotary_emb(residual, position_ids=pos)

    def rot(z):
        z1, z2 = z[..., : hd // 2], z[..., hd // 2:]
        return z * cos[:, None] + torch.cat([-z2, z1], -1) * sin[:, None]

    q, k = rot(q), rot(k).repeat_interleave(H // KV, 1)
    causal = pos.view(Q, 1) >= pos.view(1, Q)  # (Q, Q)
    att = torch.softmax((q @ k.transpose(-1, -2)) / hd ** 0.5 + torch.where(causal, 0.0, -1e9), -1)
    o = (att @ v.repeat_interleave(H // KV, 1)).transpose(1, 2).reshape(1, Q, H * hd)
    h = residual + o @ t[pre + "self_attn.o_proj.weight"].T
    m = _rms(h, t[pre + "post_attention_layernorm.weight"], c.rms_norm_eps)
    return h + (torch.nn.functional.silu(m @ t[pre + "mlp.gate_proj.weight"].T)
                * (m @ t[pre + "mlp.up_proj.weight"].T)) @ t[pre + "mlp.down_proj.weight"].T


def _step_inputs(target, width, Q=5):
    feats = torch.randn(1, Q, width, generator=torch.Generator().manual_seed(3))
    toks = torch.randint(0, V, (1, Q), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(Q).view(1, Q)
    mask = additive_mask((pos.view(Q, 1) >= pos.view(1, Q)).view(1, Q, Q), feats.dtype)  # (1, 1, Q, Q)
    return feats, toks, pos, mask


def test_eagle_mapping_matches_published_layer(target, tmp_path):
    """EAGLE-1/2 by the published formula: f^ = Layer(fc([e; f])) with no input norm, no final
    norm; logits = the target's LM head of f^."""
    t = write_eagle(target, tmp_path / "e")
    head = load_published_eagle(target, tmp_path / "e")
    feats, toks, pos, mask = _step_inputs(target, target.config.hidden_size)
    with torch.no_grad():
        g = torch.cat([target.model.embed_tokens(toks), feats], -1) @ t["fc.weight"].T + t["fc.bias"]  # (1, Q, D)
        ref = _ref_layer(target, t, "layers.0.", g, g, pos)
        f_hat = head(feats, toks, pos, mask)
        assert torch.allclose(f_hat, ref, atol=1e-4)
        assert torch.allclose(head.logits(f_hat), target.lm_head(ref), atol=1e-4)


def test_eagle3_mapping_matches_published_layer(target, tmp_path):
    """The head's step recomputed from the published tensors by the published formula: fused g,
    attention over [Norm(e); Norm(g)] with residual g, MLP; logits from norm(a); draft ids via d2t."""
    t = write_eagle3(target, tmp_path / "e3")
    head = load_published_eagle3(target, tmp_path / "e3")
    assert isinstance(head, PublishedEagle3Head) and isinstance(head, Eagle3Head) and head.layers == tuple(AUX)
    assert head.token_map.tolist() == DRAFT_VOCAB
    eps = target.config.rms_norm_eps
    feats, toks, pos, mask = _step_inputs(target, 3 * target.config.hidden_size)
    with torch.no_grad():
        g = feats @ t["fc.weight"].T  # (1, Q, D)
        assert torch.allclose(head.embed_features(feats), g, atol=1e-5)
        a = head(g, toks, pos, mask)  # (1, Q, D)
        x = torch.cat([_rms(target.model.embed_tokens(toks), t["midlayer.input_layernorm.weight"], eps),
                       _rms(g, t["midlayer.hidden_norm.weight"], eps)], -1)  # (1, Q, 2D)
        assert torch.allclose(a, _ref_layer(target, t, "midlayer.", x, g, pos), atol=1e-4)
        assert torch.allclose(head.logits(a), _rms(a, t["norm.weight"], eps) @ t["lm_head.weight"].T, atol=1e-4)


def _loaded(kind, target, folder):
    if kind == "eagle":
        write_eagle(target, folder)
        return load_published_eagle(target, folder)
    if kind == "eagle3":
        write_eagle3(target, folder)
        return load_published_eagle3(target, folder)
    write_medusa(target, folder)
    return load_published_medusa(target, folder)


def _proposer(kind, head, tree=False, small=False):
    if kind == "medusa":
        return MedusaProposer(head, MedusaConfig(choices=((0,), (1,), (0, 0))) if small else MedusaConfig())
    if tree:
        return Eagle2Proposer(head, Eagle2Config())
    return EagleProposer(head, EagleConfig(k=3))


@pytest.mark.parametrize("kind,tree", [("eagle", False), ("eagle", True), ("eagle3", False), ("eagle3", True),
                                       ("medusa", True)])
def test_greedy_parity(target, tmp_path, kind, tree):
    head = _loaded(kind, target, tmp_path / kind)
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 1]).view(4, 1)).long()  # left padding
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=16, temperature=0, eos_token_id=7)
    sp = speculative_generate(target, _proposer(kind, head, tree), ids, mask, max_new_tokens=16, temperature=0,
                              eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.num_accepted_tokens > 0, sp.stats


@pytest.mark.parametrize("kind,temperature,top_k", [("eagle", 1.0, 0), ("eagle3", 0.7, 5), ("medusa", 1.0, 0)])
def test_whole_loop_lossless(target, tmp_path, kind, temperature, top_k):
    """Joint of the first 3 tokens vs the exact distribution (power as tests/_stats.power_rows)."""
    head = _loaded(kind, target, tmp_path / kind)
    L, prompt = 3, torch.tensor([3, 1, 4, 1, 5])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k)).numpy()
    n = power_rows(exact)
    out = speculative_generate(target, _proposer(kind, head, small=True), prompt.expand(n, -1), max_new_tokens=L,
                               temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(7))
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L), exact)
    assert res.p_value > 1e-3, res
    s = out.stats
    assert s.num_accepted_tokens > 500 and s.num_draft_tokens - s.num_accepted_tokens > 500, s


def test_refusals(target, tmp_path):
    write_eagle(target, tmp_path / "e")
    torch.save({"fc.weight": torch.zeros(2)}, tmp_path / "p.bin")
    with pytest.raises(ValueError, match="does not match the EAGLE-1/2 head layout"):  # read weights-only
        load_published_eagle(target, tmp_path / "p.bin")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    (tmp_path / "e" / "config.json").write_text(json.dumps({**cfg, "hidden_size": 4096, "vocab_size": 128256}))
    with pytest.raises(ValueError, match=r"another target: hidden_size 4096 .*vocab_size 128256"):
        load_published_eagle(target, tmp_path / "e")
    t = write_eagle(target, tmp_path / "u")
    save_file({**t, "layers.1.mlp.up_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "u" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unknown tensors \['layers.1.mlp.up_proj.weight'\]"):
        load_published_eagle(target, tmp_path / "u")
    write_medusa(target, tmp_path / "m")
    t = {"medusa_head.0.0.linear.weight": torch.zeros(8, 8), "medusa_head.0.0.linear.bias": torch.zeros(8),
         "medusa_head.0.1.weight": torch.zeros(V + 4, 8)}
    save_file(t, str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    (tmp_path / "m" / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match=f"vocab_size {V + 4}"):
        load_published_medusa(target, tmp_path / "m")


@pytest.mark.parametrize("kind,method", [("eagle", "eagle2"), ("eagle3", "eagle3"), ("medusa", "medusa")])
def test_registry_takes_folders(target, tmp_path, kind, method):
    """`--weights KIND=FOLDER` (CLI and bench pass it as Registry weights) builds the method on the head."""
    from specref.registry import Registry, weights_item

    _loaded(kind, target, tmp_path / kind)
    assert weights_item(f"{kind}={tmp_path / kind}") == (kind, str(tmp_path / kind))
    reg = Registry(target, kind="custom", weights={kind: str(tmp_path / kind)}, cost_reps=1)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    sp = speculative_generate(target, reg.proposer(method), ids, max_new_tokens=8, temperature=0)
    assert torch.equal(sp.tokens, autoregressive_generate(target, ids, max_new_tokens=8, temperature=0).tokens)
