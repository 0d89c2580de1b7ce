"""Tests of the pre-packed CPU linears (specref/backends/cpu_linear.py) and of the verify-cost fit (specref/picker/costs.py)."""
from __future__ import annotations

import pytest
import torch

from specref.backends.cpu_linear import PackedLinears, packable_dtypes, packing_available
from specref.picker.costs import measure_verify_cost
from specref.generate import autoregressive_generate
from specref.models import tiny_model
from specref.target import Target, TargetConfig

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


def test_packed_matches_plain_and_restores_the_model():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80)
    packed = PackedLinears(torch.nn.Sequential(lin))
    assert len(packed) == 1
    with torch.no_grad():
        for shape in [(1, 48), (2, 48), (3, 5, 48), (7, 48)]:
            x = torch.randn(*shape)
            ref = lin(x)
            with packed.active():
                got = lin(x)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert "forward" not in lin.__dict__  # the module is left as it was


@pytest.mark.parametrize("dtype", packable_dtypes())
def test_rows_do_not_depend_on_how_many_are_computed_together(dtype):
    """The packed kernel gives a row the same bits alone (autoregressive step) as inside a block
    (verify), for the default model's linear shapes, in every dtype this CPU packs. (On AVX-512 a
    one-row 1536 -> 576 product takes another kernel: the packing computes it as a block of two.)"""
    torch.manual_seed(0)
    for n_in, n_out in [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 4096)]:
        lin = torch.nn.Linear(n_in, n_out, bias=False).to(dtype)
        x = torch.randn(11, n_in).to(dtype)
        with torch.no_grad(), PackedLinears(torch.nn.Sequential(lin)).active():
            block = lin(x)  # (11, out)
            alone = torch.cat([lin(x[j: j + 1]) for j in range(11)])  # (11, out)
            pair = lin(x[3:5])  # (2, out)
        assert torch.equal(alone, block) and torch.equal(pair, block[3:5])


def test_nested_active_swaps_once():
    lin = torch.nn.Linear(16, 16)
    packed = PackedLinears(torch.nn.Sequential(lin))
    with packed.active():
        f = lin.__dict__["forward"]
        with packed.active():
            assert lin.__dict__["forward"] is f
        assert lin.__dict__["forward"] is f  # still active after the inner exit
    assert "forward" not in lin.__dict__


def test_shared_layers_stay_packed_while_another_packing_leaves():
    """truncated_draft shares the target's layers: the draft's packing entering and leaving inside
    the target's session must not restore the target's layers to F.linear."""
    from specref.draft_model import truncated_draft

    m = tiny_model("llama", vocab_size=64, seed=0)
    d = truncated_draft(m, 1)
    pt, pd = PackedLinears.of(m), PackedLinears.of(d)
    shared = m.model.layers[0].mlp.up_proj
    with pt.active():
        f = shared.__dict__["forward"]
        with pd.active():
            pass
        assert shared.__dict__.get("forward") is f
    assert "forward" not in shared.__dict__
    with pd.active():  # the other way round
        g = shared.__dict__["forward"]
        with pt.active():
            assert shared.__dict__["forward"] is g
        assert shared.__dict__.get("forward") is g
    assert "forward" not in shared.__dict__


def test_repacks_after_an_in_place_weight_change():
    lin = torch.nn.Linear(16, 16, bias=False)
    packed = PackedLinears(torch.nn.Sequential(lin))
    x = torch.randn(4, 16)
    with torch.no_grad():
        lin.weight.mul_(2.0)
        with packed.active():
            got = lin(x)
    torch.testing.assert_close(got, x @ lin.weight.detach().T, rtol=1e-5, atol=1e-5)


def test_autograd_falls_back_to_the_plain_kernel():
    lin = torch.nn.Linear(16, 8)
    packed = PackedLinears(torch.nn.Sequential(lin))
    x = torch.randn(3, 16, requires_grad=True)
    with packed.active():
        lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_target_greedy_identical_with_and_without_packing():
    m = tiny_model("llama", vocab_size=128, seed=3, init_std=0.2, logit_scale=2.0)
    prompt = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    a = autoregressive_generate(Target(m), prompt, max_new_tokens=12, temperature=0)
    b = autoregressive_generate(Target(m, TargetConfig(pack_linears=False)), prompt, max_new_tokens=12,
                                temperature=0)
    assert Target(m).packed is not None and Target(m, TargetConfig(pack_linears=False)).packed is None
    assert torch.equal(a.tokens, b.tokens)
    with pytest.raises(ValueError):
        Target(m, TargetConfig(pack_linears=True, compile=True))


def test_measure_verify_cost_fits_the_model():
    m = tiny_model("llama", vocab_size=128, seed=3)
    vc = measure_verify_cost(Target(m), 4, cache_len=16, reps=3)
    assert len(vc["ratios"]) == 5 and vc["ratios"][0] == 1.0
    assert vc["c"] >= 0 and vc["c0"] >= 0 and vc["t1"] > 0
    with pytest.raises(ValueError):
        measure_verify_cost(Target(m), 0)


def test_one_packing_per_model_shared_by_targets():
    import gc
    import weakref

    m = tiny_model("llama", vocab_size=64, seed=1)
    assert Target(m).packed is Target(m).packed
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None  # the cache does not keep the model alive


def test_low_precision_linears_are_packed_where_the_cpu_supports_them():
    """A bf16 model's linears are packed exactly when oneDNN has a bf16 path on this CPU (AVX-512
    BF16 here), and the packed kernel agrees with F.linear to bf16 rounding."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        lin = torch.nn.Linear(64, 48).to(dtype)
        packed = PackedLinears(torch.nn.Sequential(lin))
        assert len(packed) == (1 if dtype in packable_dtypes() else 0), dtype
        x = torch.randn(5, 64).to(dtype)
        with torch.no_grad(), packed.active():
            got = lin(x)
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, lin.weight, lin.bias).float(),
                                   rtol=2e-2, atol=2e-2)
