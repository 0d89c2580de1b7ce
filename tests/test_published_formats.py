"""Tests of the published-head conventions beyond the tensor names (specref.published.files,
.rotary, .eagle, .medusa), each rebuilt here from its description in the authors' code, not from
that code: the head's own RoPE (base rope_theta or 10000, linear / dynamic scaling), the draft
layer's own attention shape, `bias` false with an fc.bias in the file, weights-only pickles (and a
malicious one refused before it runs), sharded checkpoints, Medusa's head count from the file,
shared ResBlocks and the version-2 layout. The parity with the authors' own code is measured
outside the repository (docs/published_heads.md)."""
import builtins
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from _features import V, feature_target
from specref.published import eagle as published_eagle
from specref.published import files, load_published_eagle, load_published_eagle3, load_published_medusa
from specref.published import medusa as published_medusa
from specref.published.rotary import HeadRotary, rope_settings
from test_published import _step_inputs, write_eagle, write_eagle3, write_medusa


@pytest.fixture(scope="module")
def target():
    return feature_target()


def _f_hat(head, target):
    feats, toks, pos, mask = _step_inputs(target, head.feature_size, Q=12)
    with torch.no_grad():
        return head(head.embed_features(feats), toks, pos, mask)


def test_rotary_formula():
    """cos/sin over [t' inv_freq; t' inv_freq], inv_freq_i = base^(-2i/d); linear: t' = t / s;
    dynamic: base (s L / M - (s - 1))^(d / (d - 2)) past M positions."""
    pos = torch.tensor([[0, 1, 5, 9]])
    x = torch.zeros(1, 4, 8)
    for rot, base, t in ((HeadRotary(8, 500000.0), 500000.0, pos.float()),
                         (HeadRotary(8, scaling="linear", factor=2.0), 10000.0, pos.float() / 2),
                         (HeadRotary(8, scaling="dynamic", factor=2.0, max_positions=4),
                          10000.0 * (2.0 * 10 / 4 - 1) ** (8 / 6), pos.float())):
        cos, sin = rot(x, pos)
        inv = torch.tensor([base ** (-2 * i / 8) for i in range(4)])
        ang = t[..., None] * inv
        assert torch.allclose(cos, torch.cat([ang, ang], -1).cos(), atol=1e-6)
        assert torch.allclose(sin, torch.cat([ang, ang], -1).sin(), atol=1e-6)
    assert rope_settings({}, "h", 8)[0] == 10000.0  # no rope_theta: the authors' default base
    assert rope_settings({"rope_theta": 5e5}, "h", 8)[0] == 5e5
    assert rope_settings({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}, "h", 8)[:3] == \
        (10000.0, "linear", 4.0)  # the authors' linear class is built without rope_theta
    with pytest.raises(ValueError, match="rope_scaling"):
        rope_settings({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "h", 8)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_head_rope_is_the_heads_not_the_targets(tmp_path, kind):
    """The same head file on two targets that differ only in rope_theta drafts the same f^ (the
    head's config has no theta: base 10000); the target's rotary in its place drafts otherwise."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    t1, t2 = feature_target(), feature_target()
    t2.config.rope_parameters = {"rope_theta": 500000.0, "rope_type": "default"}  # Llama-3's theta
    t2.model.rotary_emb = LlamaRotaryEmbedding(t2.config)
    write = write_eagle if kind == "eagle" else write_eagle3
    load = load_published_eagle if kind == "eagle" else load_published_eagle3
    write(t1, tmp_path / "h")
    with pytest.warns(UserWarning, match="rotary embedding"):
        h2 = load(t2, tmp_path / "h")
    h1 = load(t1, tmp_path / "h")
    assert torch.allclose(_f_hat(h1, t1), _f_hat(h2, t2), atol=1e-5)
    h2._shared = (h2._shared[0], t2.model.rotary_emb)  # what specref did before: the target's RoPE
    assert (_f_hat(h2, t2) - _f_hat(h1, t1)).abs().max() > 1e-3


def test_own_attention_shape_bias_and_qkv_bias(target, tmp_path):
    """A draft layer shaped by the head's config (4 heads, 4 key/value heads, intermediate 24 on a
    2-head target), qkv_bias, and bias false with an fc.bias in the file (dropped, warned)."""
    D = target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    cfg = {"hidden_size": D, "vocab_size": V, "num_attention_heads": 4, "num_key_value_heads": 4,
           "intermediate_size": 24, "num_hidden_layers": 1, "bias": False, "qkv_bias": True}
    t = {"fc.weight": torch.randn(D, 2 * D, generator=g) * 0.3, "fc.bias": torch.randn(D, generator=g)}
    for n, shape in (("q_proj", (D, D)), ("k_proj", (D, D)), ("v_proj", (D, D)), ("o_proj", (D, D))):
        t[f"layers.0.self_attn.{n}.weight"] = torch.randn(shape, generator=g) * 0.3
        if n != "o_proj":
            t[f"layers.0.self_attn.{n}.bias"] = torch.randn(D, generator=g) * 0.3
    for n, shape in (("gate_proj", (24, D)), ("up_proj", (24, D)), ("down_proj", (D, 24))):
        t[f"layers.0.mlp.{n}.weight"] = torch.randn(shape, generator=g) * 0.3
    t["layers.0.post_attention_layernorm.weight"] = torch.ones(D)
    (tmp_path / "h").mkdir()
    save_file(t, str(tmp_path / "h" / "model.safetensors"))
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="fc.bias"):
        head = load_published_eagle(target, tmp_path / "h")
    attn = head.layer.self_attn
    assert head.fc.bias is None and attn.head_dim == D // 4 and attn.k_proj.bias is not None
    assert attn.o_proj.bias is None and head.layer.mlp.up_proj.weight.shape == (24, D)
    feats, toks, pos, mask = _step_inputs(target, D)
    with torch.no_grad():  # by the formula: fc without bias, 4-head attention with q/k/v biases
        x = torch.cat([target.model.embed_tokens(toks), feats], -1) @ t["fc.weight"].T  # (1, Q, D)
        Q, hd = x.shape[1], D // 4
        rot = HeadRotary(hd)
        cos, sin = rot(x, pos)

        def proj(n):
            return (x @ t[f"layers.0.self_attn.{n}.weight"].T + t[f"layers.0.self_attn.{n}.bias"]).view(
                1, Q, 4, hd).transpose(1, 2)

        def rope(z):
            return z * cos[:, None] + torch.cat([-z[..., hd // 2:], z[..., : hd // 2]], -1) * sin[:, None]

        q, k, v = rope(proj("q_proj")), rope(proj("k_proj")), proj("v_proj")
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)
        h = x + (att @ v).transpose(1, 2).reshape(1, Q, D) @ t["layers.0.self_attn.o_proj.weight"].T
        eps = 1e-6  # the authors' default rms_norm_eps where the config states none
        m = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ref = h + (torch.nn.functional.silu(m @ t["layers.0.mlp.gate_proj.weight"].T)
                   * (m @ t["layers.0.mlp.up_proj.weight"].T)) @ t["layers.0.mlp.down_proj.weight"].T
        assert torch.allclose(head(feats, toks, pos, mask), ref, atol=1e-5)


def test_pickles_and_shards_load_as_safetensors(target, tmp_path):
    """pytorch_model.bin (a torch.save of the state dict) and a two-shard index load the same head."""
    t = write_eagle(target, tmp_path / "st")
    (tmp_path / "bin").mkdir()
    torch.save(t, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    (tmp_path / "sh").mkdir()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in shards.items():
        save_file({n: t[n] for n in ns}, str(tmp_path / "sh" / f))
    (tmp_path / "sh" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    (tmp_path / "sh" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    ref = _f_hat(load_published_eagle(target, tmp_path / "st"), target)
    for src in (tmp_path / "bin", tmp_path / "bin" / "pytorch_model.bin", tmp_path / "sh",
                tmp_path / "sh" / "model.safetensors.index.json"):
        assert torch.equal(_f_hat(load_published_eagle(target, src), target), ref)
    assert files.is_published(tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "sh" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="names shard"):
        load_published_eagle(target, tmp_path / "sh")


class _Payload:
    def __reduce__(self):  # unpickling this runs exec(...): what a malicious checkpoint does
        return (exec, ("import builtins; builtins.specref_pickle_ran = True",))


def test_malicious_pickle_is_refused_and_runs_nothing(target, tmp_path):
    write_eagle(target, tmp_path / "e")
    sd = dict(files.load_weights(tmp_path / "e" / "model.safetensors"))
    sd["fc.weight"] = _Payload()
    (tmp_path / "e" / "model.safetensors").unlink()
    torch.save(sd, tmp_path / "e" / "pytorch_model.bin")
    assert not hasattr(builtins, "specref_pickle_ran")
    with pytest.raises(ValueError, match=r"pytorch_model.bin is refused: it is not a weights-only PyTorch pickle"):
        load_published_eagle(target, tmp_path / "e")
    assert not hasattr(builtins, "specref_pickle_ran")
    torch.save(["not", "a", "state dict"], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state dict of named tensors"):
        files.load_pickle(tmp_path / "list.pt")


def _resblocks(tensors, i, layers):
    return [(tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"]) for j in range(layers)]


def _medusa_ref(h, blocks, lm):
    for w, b in blocks:
        h = h + torch.nn.functional.silu(h @ w.T + b)
    return h @ lm.T


def test_medusa_head_count_shared_blocks_and_version_2(target, tmp_path):
    """Five heads in the file, two in the config: five used, warned. `[ResBlock] * 2` written by
    torch.save (one storage under two names) loads as the shared block twice. Version 2: the
    target's LM head over the ResBlocks' output."""
    D = target.config.hidden_size
    t = {n[len("medusa_head."):]: v for n, v in write_medusa(target, tmp_path / "m", heads=5).items()}
    (tmp_path / "m" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.warns(UserWarning, match="the file holds 5 heads"):
        heads = load_published_medusa(target, tmp_path / "m")
    h = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert heads.num_heads == 5
        for i in range(5):
            assert torch.allclose(heads(h)[:, i], _medusa_ref(h, _resblocks(t, i, 1), t[f"{i}.1.weight"]), atol=1e-5)
    g = torch.Generator().manual_seed(2)
    sd = {}
    for i in range(2):
        w, b = torch.randn(D, D, generator=g) * 0.3, torch.randn(D, generator=g) * 0.3
        sd.update({f"{i}.0.linear.weight": w, f"{i}.0.linear.bias": b, f"{i}.1.linear.weight": w,
                   f"{i}.1.linear.bias": b, f"{i}.2.weight": torch.randn(V, D, generator=g)})
    (tmp_path / "s").mkdir()
    torch.save(sd, tmp_path / "s" / "medusa_lm_head.pt")
    assert sd["0.0.linear.weight"].data_ptr() == sd["0.1.linear.weight"].data_ptr()
    (tmp_path / "s" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2}))
    shared = load_published_medusa(target, tmp_path / "s")
    with torch.no_grad():
        for i in range(2):
            assert torch.allclose(shared(h)[:, i], _medusa_ref(h, _resblocks(sd, i, 2), sd[f"{i}.2.weight"]), atol=1e-5)
    v2 = {k: v for k, v in sd.items() if "linear" in k}
    (tmp_path / "v2").mkdir()
    torch.save(v2, tmp_path / "v2" / "medusa_lm_head.pt")
    (tmp_path / "v2" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2,
                                                             "version": "2"}))
    heads2 = load_published_medusa(target, tmp_path / "v2")
    with torch.no_grad():
        for i in range(2):
            want = _medusa_ref(h, _resblocks(sd, i, 2), target.lm_head.weight)
            assert torch.allclose(heads2(h)[:, i], want, atol=1e-5)
    (tmp_path / "v2" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2,
                                                             "version": "1"}))
    with pytest.raises(ValueError, match="version-2 layout"):
        load_published_medusa(target, tmp_path / "v2")
    (tmp_path / "v2" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 3}))
    with pytest.raises(ValueError, match="medusa_num_layers 3"):
        published_medusa.load_published_medusa(target, tmp_path / "v2")


def test_head_embedding_from_the_file_where_it_differs(target, tmp_path):
    t = write_eagle(target, tmp_path / "e")
    t["embed_tokens.weight"] = t["embed_tokens.weight"] + 0.5
    save_file(t, str(tmp_path / "e" / "model.safetensors"))
    with pytest.warns(UserWarning, match="embed_tokens differ"):
        head = published_eagle.load_published_eagle(target, tmp_path / "e")
    assert torch.equal(head._shared[0].weight, t["embed_tokens.weight"])
    feats, toks, pos, mask = _step_inputs(target, target.config.hidden_size)
    assert head(feats, toks, pos, mask).shape == feats.shape
