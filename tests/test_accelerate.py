"""Targets placed by accelerate: a device map over CPU, with some layers offloaded to disk.

accelerate's hooks move each layer's weights in for its forward (disk offload: from a memory-mapped
file); specref's cache keeps each layer's keys and values where that layer runs. Greedy output must
equal the plain model's token for token, for plain decoding and for speculative decoding (prompt
lookup, a draft model), on a tiny model and on the default model.
"""
import pytest
import torch

from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import tiny_model
from specref.ngram import NgramConfig, NgramProposer


def _dispatch(model, offload_dir, offload_layers):
    from accelerate import dispatch_model

    names = [n for n, _ in model.named_children()]
    inner = [f"model.{n}" for n, _ in model.model.named_children() if n != "layers"]
    layers = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    dm = {n: "cpu" for n in inner + [n for n in names if n != "model"]}
    dm.update({n: ("disk" if i in offload_layers else "cpu") for i, n in enumerate(layers)})
    return dispatch_model(model, device_map=dm, offload_dir=str(offload_dir), main_device="cpu")


@pytest.mark.parametrize("offload", [(), (1, 2)])
def test_dispatched_tiny_target_greedy_parity(tmp_path, offload):
    ref_model = tiny_model("llama", vocab_size=64, num_layers=4, seed=3)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))  # (3, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    ref = autoregressive_generate(ref_model, ids, mask, max_new_tokens=12, temperature=0).tokens
    model = _dispatch(tiny_model("llama", vocab_size=64, num_layers=4, seed=3), tmp_path, offload)
    assert hasattr(model, "hf_device_map")
    if offload:
        assert any(p.device.type == "meta" for p in model.parameters())  # weights really on disk
    draft = tiny_model("llama", vocab_size=64, num_layers=1, seed=4)
    runs = {"ar": autoregressive_generate(model, ids, mask, max_new_tokens=12, temperature=0),
            "ngram": speculative_generate(model, NgramProposer(NgramConfig(k=3, min_n=1)), ids, mask,
                                          max_new_tokens=12, temperature=0),
            "draft": speculative_generate(model, DraftModelProposer(draft, DraftModelConfig(k=3)), ids, mask,
                                          max_new_tokens=12, temperature=0)}
    for name, out in runs.items():
        assert torch.equal(out.tokens, ref), name


def test_dispatched_default_model_greedy_parity(tmp_path):
    from specref.models import load_default

    plain, tok = load_default()
    ids = tok.apply_chat_template([{"role": "user", "content": "Repeat after me: the cat sat on the mat."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = autoregressive_generate(plain, ids, max_new_tokens=16, temperature=0).tokens
    model = _dispatch(load_default()[0], tmp_path, offload_layers=(10, 20))
    assert torch.equal(autoregressive_generate(model, ids, max_new_tokens=16, temperature=0).tokens, ref)
    out = speculative_generate(model, NgramProposer(NgramConfig(k=4, min_n=1)), ids, max_new_tokens=16,
                               temperature=0)
    assert torch.equal(out.tokens, ref)
