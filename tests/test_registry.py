"""registry.py: every method by name, built for a tiny model; weights a user names; clear errors."""
import pytest
import torch

from specref.eagle_head import EagleHead, EagleProposer, save_eagle
from specref.models import tiny_model
from specref.registry import METHODS, Registry, check_method
from specref.weights import fingerprint


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=64, init_std=0.2)


def test_every_method_builds(model):
    reg = Registry(model, kind="tiny", draft_k=2)
    for name in METHODS:
        p = reg.proposer(name)
        assert (p is None) == (name == "ar")
        if p is not None:
            assert p.k >= 1
        assert isinstance(reg.label(name), str) and reg.label(name)
    assert reg.proposer("ngram") is not reg.proposer("ngram")  # a fresh proposer per call
    assert reg.ngram_config() is reg.ngram_config()  # costs measured once


def test_bad_names_and_kinds(model):
    with pytest.raises(ValueError, match="unknown method 'eagle9'; valid: ar, ngram"):
        check_method("eagle9")
    with pytest.raises(ValueError, match="kind must be"):
        Registry(model, kind="huge")
    with pytest.raises(ValueError, match="weights keys"):
        Registry(model, kind="custom", weights={"eagle9": "x"})


def test_custom_model_needs_named_weights(model, tmp_path):
    reg = Registry(model, kind="custom")
    assert reg.proposer("ngram") is not None  # no weights needed
    for name in ("eagle", "eagle2", "eagle3", "eagle3_tree", "draft", "medusa", "mtp", "hybrid"):
        with pytest.raises(ValueError, match="no trained .* for this model: pass weights"):
            reg.proposer(name)
    head = EagleHead(model, torch.arange(0, 64, 2))
    torch.nn.init.normal_(head.fc.weight, std=0.05)
    path = tmp_path / "eagle.safetensors"
    save_eagle(path, head, fingerprint(model), {"note": "test"}, dtype=torch.float32)
    p = Registry(model, kind="custom", weights={"eagle": str(path)}).proposer("eagle")
    assert isinstance(p, EagleProposer) and torch.equal(p.head.fc.weight, head.fc.weight)
    from specref.medusa_heads import MedusaHeads, save_medusa

    for sequential in (False, True):  # hydra: a file of sequential heads; a Medusa file is refused by name
        save_medusa(tmp_path / "m.safetensors", MedusaHeads(model, 3, torch.arange(0, 64, 2), sequential=sequential),
                    fingerprint(model), {})
        reg = Registry(model, kind="custom", weights={"hydra": str(tmp_path / "m.safetensors")})
        if sequential:
            assert reg.proposer("hydra").heads.sequential and reg.proposer("hybrid_hydra").k >= 1
        else:
            with pytest.raises(ValueError, match="holds Medusa heads, not sequential"):
                reg.proposer("hydra")


def test_fit_verify_cost():
    from specref.picker.costs import fit_verify_cost

    ratios = [1.0] + [1.0 + 0.2 + 0.05 * (w - 1) for w in range(2, 12)]  # c0 0.2, c 0.05
    fit = fit_verify_cost(ratios)
    assert fit["c"] == pytest.approx(0.05) and fit["c0"] == pytest.approx(0.2)
    assert fit_verify_cost(ratios, 3)["ratios"] == ratios[:4]
    assert fit_verify_cost([1.0, 1.3])["c0"] == pytest.approx(0.3)
    with pytest.raises(ValueError):
        fit_verify_cost([1.0])
