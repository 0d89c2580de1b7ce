"""Trained proposer files (specref/weights): round trip, format and mismatch errors, fingerprints."""
import json

import pytest
import torch

from specref.models import tiny_model
from specref.weights import fingerprint, load_tensors, load_token_map, save_weights, weights_info


def test_round_trip_and_errors(tmp_path):
    path = tmp_path / "w" / "head.safetensors"
    tensors = {"a.weight": torch.randn(3, 4), "token_map": torch.tensor([5, 2, 9], dtype=torch.int32)}
    save_weights(path, tensors, {"format": "specref-test-1", "record": '{"steps": 3}'})
    info = weights_info(path, "specref-test-1", "test head", "make one")
    assert info["record"] == {"steps": 3} and info["format"] == "specref-test-1"
    assert load_token_map(path).tolist() == [5, 2, 9]
    dst = {"a.weight": torch.zeros(3, 4, dtype=torch.float64)}  # converted to the parameter's dtype
    load_tensors(path, dst, "test head")
    assert torch.equal(dst["a.weight"], tensors["a.weight"].double())
    with pytest.raises(ValueError, match="missing"):
        load_tensors(path, {"a.weight": torch.zeros(3, 4), "b": torch.zeros(1)}, "test head")
    with pytest.raises(ValueError, match="format"):
        weights_info(path, "specref-other-1", "other head", "make one")
    with pytest.raises(ValueError, match="make one"):
        weights_info(tmp_path / "none.safetensors", "specref-test-1", "test head", "make one")


def test_fingerprint_tells_models_apart():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert fingerprint(a) == fingerprint(tiny_model("llama", seed=0))
    assert fingerprint(a) != fingerprint(b) and len(fingerprint(a)) == 16


def test_other_target_warning_names_a_precision_change():
    """A file made for the fp32 model warns on its bf16 copy (the fingerprint hashes exact values),
    and the warning says that another precision is a possible reason; no warning on the fp32 model."""
    import warnings

    from specref.weights import warn_if_other_target

    m = tiny_model("llama", seed=0)
    meta = {"target_fingerprint": fingerprint(m)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_other_target("f.safetensors", meta, m)  # same model: silent
    with pytest.warns(UserWarning, match="another precision \\(this one is bfloat16"):
        warn_if_other_target("f.safetensors", meta, tiny_model("llama", seed=0).to(torch.bfloat16))
    with pytest.warns(UserWarning, match="another target") as rec:
        warn_if_other_target("f.safetensors", meta, tiny_model("llama", seed=1))
    assert "precision" not in str(rec[0].message)  # another fp32 model: no precision hint


def test_int8_storage_round_trip(tmp_path):
    """compact() stores 2-D matrices as int8 rows + fp16 scales; load_tensors dequantises them to
    within half a quantisation step per row, and leaves 1-D tensors and the token map exact."""
    from specref.weights import SCALE, compact

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scales
    path = tmp_path / "head.safetensors"
    save_weights(path, {"w": w.half(), "b": torch.randn(5, generator=g).half(),
                        "token_map": torch.arange(4, dtype=torch.int32)}, {"format": "specref-test-1"})
    size16 = path.stat().st_size
    compact(path)
    assert path.stat().st_size < 0.75 * size16
    assert weights_info(path, "specref-test-1", "test head", "")["storage"] == "int8"
    from safetensors.torch import load_file

    raw = load_file(str(path))
    assert raw["w"].dtype == torch.int8 and raw["w" + SCALE].shape == (64,)
    dst = {"w": torch.zeros(64, 256), "b": torch.zeros(5)}
    load_tensors(path, dst, "test head")
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((dst["w"] - w).abs() <= 0.51 * step + 1e-3 * w.abs()).all()
    assert torch.equal(dst["b"], raw["b"].float()) and load_token_map(path).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="already int8"):
        compact(path)


def test_int4_storage_round_trip(tmp_path):
    """compact(bits=4) packs two 4-bit values per byte with an fp16 scale per group of 64 columns of
    a row; load_tensors dequantises them to within half a step of each group; a matrix whose columns
    do not split into groups is stored as int8 rows; an int8 file compacts to int4 (not back)."""
    from safetensors.torch import load_file

    from specref.weights import GROUP, SCALE, SCALE4, compact, dequantise, read_weights, to_int4

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scales
    w[3, 64:128] *= 50  # one group far larger than the rest of its row
    odd = torch.randn(8, 96, generator=g)  # 96 % 64 != 0
    tensors = {"w": w.half(), "odd": odd.half(), "b": torch.randn(5, generator=g).half(),
               "token_map": torch.arange(4, dtype=torch.int32)}
    p16, p8, p4, p84 = (tmp_path / f"h{x}.safetensors" for x in ("16", "8", "4", "84"))
    for p in (p16, p8, p4):
        save_weights(p, tensors, {"format": "specref-test-1"})
    compact(p8)
    compact(p4, bits=4)
    assert p4.stat().st_size < 0.6 * p8.stat().st_size
    info = weights_info(p4, "specref-test-1", "test head", "")
    assert info["storage"] == "int4" and info["int4_group"] == str(GROUP) == "64"
    raw = load_file(str(p4))
    assert raw["w"].dtype == torch.uint8 and raw["w"].shape == (64, 128) and raw["w" + SCALE4].shape == (64, 4)
    assert raw["odd"].dtype == torch.int8 and raw["odd" + SCALE].shape == (8,)
    dst = {"w": torch.zeros(64, 256), "odd": torch.zeros(8, 96), "b": torch.zeros(5)}
    load_tensors(p4, dst, "test head")
    w16 = w.half().float()
    step = (w16.reshape(64, 4, 64).abs().amax(-1) / 7).repeat_interleave(64, dim=1)  # (64, 256)
    err = (dst["w"] - w16).abs()
    assert (err <= 0.51 * step + 1e-3 * w16.abs()).all() and err.max() > 0
    assert err[3, :64].max() < 0.05 * err[3, 64:128].max()  # the large group does not coarsen its row
    assert ((dst["odd"] - odd.half().float()).abs() <= 0.51 * odd.half().float().abs().amax(1, keepdim=True) / 127
            + 1e-3).all()
    assert torch.equal(dst["b"], tensors["b"].float()) and load_token_map(p4).tolist() == [0, 1, 2, 3]
    q = dequantise(to_int4({"x": torch.tensor([[7.0, -7.0, 3.0, 0.6]])}, group=4))["x"]  # the nibble order
    assert q.tolist() == [[7.0, -7.0, 3.0, 1.0]]
    compact(p8, p84, bits=4)  # int8 -> int4: the int8 file's rounding is added to int4's
    again = {"w": torch.zeros(64, 256), "odd": torch.zeros(8, 96), "b": torch.zeros(5)}
    load_tensors(p84, again, "test head")
    step8 = w16.abs().amax(1, keepdim=True) / 127  # the int8 file's row step, (64, 1)
    assert ((again["w"] - w16).abs() <= 0.52 * step + 0.51 * step8 + 1e-3 * w16.abs()).all()
    p32 = tmp_path / "h32.safetensors"
    compact(p16, p32, bits=4, group=32)  # finer groups: more scales, a smaller error
    assert load_file(str(p32))["w" + SCALE4].shape == (64, 8) and read_weights(p32)[1]["int4_group"] == "32"
    fine = {"w": torch.zeros(64, 256), "odd": torch.zeros(8, 96), "b": torch.zeros(5)}
    load_tensors(p32, fine, "test head")
    assert (fine["w"] - w16).abs().mean() < (dst["w"] - w16).abs().mean()
    for p, bits, msg in ((p4, 4, "already int4"), (p4, 8, "already int4"), (p16, 3, "bits")):
        with pytest.raises(ValueError, match=msg):
            compact(p, tmp_path / "x.safetensors", bits=bits)
    with pytest.raises(ValueError, match="group"):
        to_int4(tensors, group=3)


def test_int4_for_named_matrices_only(tmp_path):
    """compact(int4=NAMES) stores the named matrices as int4 and every other matrix as int8 rows
    (storage int8+int4, the names in the metadata); from an int8 file the other matrices keep their
    int8 bytes; a name that is not a groupable 2-D matrix, bits=4 with names, or a second compact
    is a ValueError."""
    from safetensors.torch import load_file

    from specref.weights import SCALE, SCALE4, compact, read_weights

    g = torch.Generator().manual_seed(1)
    w, v, odd = torch.randn(32, 128, generator=g), torch.randn(16, 64, generator=g), torch.randn(8, 96, generator=g)
    tensors = {"w": w.half(), "v": v.half(), "odd": odd.half(), "b": torch.randn(5, generator=g).half()}
    p16, p8, pm, pm8 = (tmp_path / f"{x}.safetensors" for x in ("h16", "h8", "mix", "mix8"))
    for p in (p16, p8):
        save_weights(p, tensors, {"format": "specref-test-1"})
    compact(p8)
    compact(p16, pm, int4=["w"])
    compact(p8, pm8, int4=["w"])
    raw, raw8, raw_m8 = load_file(str(pm)), load_file(str(p8)), load_file(str(pm8))
    assert raw["w"].dtype == torch.uint8 and raw["w" + SCALE4].shape == (32, 2) and "w" + SCALE not in raw
    assert raw["v"].dtype == torch.int8 and raw["odd"].dtype == torch.int8 and raw["v" + SCALE].shape == (16,)
    for n in ("v", "v" + SCALE, "odd", "odd" + SCALE):  # from int8: the other matrices' bytes unchanged
        assert torch.equal(raw_m8[n], raw8[n])
    meta = read_weights(pm)[1]
    assert meta["storage"] == "int8+int4" and json.loads(meta["int4_tensors"]) == ["w"] and meta["int4_group"] == "64"
    assert pm.stat().st_size < p8.stat().st_size
    dst = {"w": torch.zeros(32, 128), "v": torch.zeros(16, 64), "odd": torch.zeros(8, 96), "b": torch.zeros(5)}
    load_tensors(pm, dst, "test head")
    w16 = w.half().float()
    step4 = (w16.reshape(32, 2, 64).abs().amax(-1) / 7).repeat_interleave(64, dim=1)  # (32, 128)
    assert ((dst["w"] - w16).abs() <= 0.51 * step4 + 1e-3 * w16.abs()).all()
    v16 = v.half().float()
    err_v = (dst["v"] - v16).abs()
    assert (err_v <= 0.51 * v16.abs().amax(1, keepdim=True) / 127 + 1e-3).all() and err_v.max() > 0
    for kwargs, msg in (({"int4": ["odd"]}, "groups of 64"), ({"int4": ["b"]}, "2-D matrix"),
                        ({"int4": ["nope"]}, "nope"), ({"int4": []}, "non-empty"),
                        ({"int4": ["w"], "bits": 4}, "bits=8")):
        with pytest.raises(ValueError, match=msg):
            compact(p16, tmp_path / "x.safetensors", **kwargs)
    with pytest.raises(ValueError, match="already int8\\+int4"):
        compact(pm, tmp_path / "y.safetensors", int4=["v"])


def test_xz_files_read_as_the_plain_ones(tmp_path):
    """A name ending in .xz is written xz-compressed and read back to the same tensors and
    metadata as the plain file; compact(--out X.xz) writes the int8 file compressed; the committed
    files are such .xz files; a damaged .xz is a ValueError naming it."""
    import lzma

    from specref.weights import FOLDER, compact, copy_weights, read_weights

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(64, 96, generator=g).half(), "token_map": torch.arange(7, dtype=torch.int32)}
    meta = {"format": "specref-test-1", "record": '{"steps": 4}'}
    plain, packed = tmp_path / "h.safetensors", tmp_path / "h.safetensors.xz"
    save_weights(plain, tensors, meta)
    save_weights(packed, tensors, meta)
    from safetensors.torch import load

    inner = load(lzma.decompress(packed.read_bytes()))  # an xz stream of safetensors bytes
    assert all(torch.equal(inner[n], tensors[n]) for n in tensors)
    got, got_meta = read_weights(packed)
    assert got_meta == meta and set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)
    assert weights_info(packed, "specref-test-1", "test head", "")["record"] == {"steps": 4}
    assert load_token_map(packed).tolist() == list(range(7))
    small = tmp_path / "h8.safetensors.xz"
    compact(plain, small)
    assert read_weights(small, names=())[1]["storage"] == "int8"
    a, b = {"w": torch.zeros(64, 96)}, {"w": torch.zeros(64, 96)}
    compact(plain)  # in place, uncompressed: the same int8 values
    assert small.stat().st_size < plain.stat().st_size
    load_tensors(small, a, "test head")
    load_tensors(plain, b, "test head")
    assert torch.equal(a["w"], b["w"])
    copied = tmp_path / "copy.safetensors.xz"
    copy_weights(plain, copied)  # what a training run's --export NAME.safetensors.xz does
    assert read_weights(copied)[1]["storage"] == "int8" and lzma.decompress(copied.read_bytes())[:8]
    committed = sorted(p.name for p in FOLDER.glob("*.safetensors*"))
    assert committed and all(n.endswith(".safetensors.xz") for n in committed), committed
    bad = tmp_path / "bad.safetensors.xz"
    bad.write_bytes(packed.read_bytes()[:-40])
    with pytest.raises(ValueError, match="bad.safetensors.xz"):
        read_weights(bad)


def test_tensors_by_reference_to_another_file(tmp_path):
    """compact(ref=(PREFIX, FILE)) drops the tensors under PREFIX and references FILE, whose tensors
    they are (a 16-bit copy of an int8 file links); reading the file puts FILE's tensors back, found
    beside it; linking trained-away or other-named tensors, a changed or missing FILE, are ValueErrors
    naming them; copy_weights keeps the reference."""
    from specref.weights import compact, copy_weights, dequantise, read_weights, tensor_names

    g = torch.Generator().manual_seed(2)
    head = {"fc.weight": torch.randn(16, 64, generator=g).half(), "norm.weight": torch.rand(16, generator=g).half(),
            "token_map": torch.arange(5, dtype=torch.int32)}
    ref = tmp_path / "eagle.safetensors.xz"
    save_weights(ref, head, {"format": "specref-eagle-1"})
    compact(ref)  # the referenced file is int8, as the committed ones are
    ref_t = dequantise(read_weights(ref)[0])
    frozen = {"prefix." + n: t.half() for n, t in ref_t.items() if n != "token_map"}  # a 16-bit copy of it
    own = {"inputs.0.weight": torch.randn(16, 32, generator=g).half(), "token_map": torch.arange(5, dtype=torch.int32)}
    src = tmp_path / "hydra16.safetensors"
    save_weights(src, {**own, **frozen}, {"format": "specref-medusa-1"})
    out = tmp_path / "hydra.safetensors.xz"
    compact(src, out, ref=("prefix.", str(ref)))
    raw, meta = read_weights(out, resolve_refs=False)
    assert not any(n.startswith("prefix.") for n in raw) and meta["storage"] == "int8"
    assert json.loads(meta["tensor_refs"])["prefix."]["file"] == "eagle.safetensors.xz"
    got = dequantise(read_weights(out)[0])
    for n, t in ref_t.items():  # the referenced file's own values, not the 16-bit copy's
        if n != "token_map":
            assert torch.equal(got["prefix." + n], t)
    assert read_weights(out, ["prefix.norm.weight"])[0].keys() == {"prefix.norm.weight"}
    assert sorted(tensor_names(out)) == sorted(read_weights(out)[0])
    dst = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in got.items() if n != "token_map"}
    load_tensors(out, dst, "test heads")  # every parameter, the referenced ones included
    assert torch.equal(dst["prefix.fc.weight"], ref_t["fc.weight"])
    copy_weights(out, tmp_path / "copy.safetensors")
    assert "tensor_refs" in read_weights(tmp_path / "copy.safetensors", ())[1]
    # refused: a prefix that training moved, names that differ, a second reference
    moved = dict(frozen, **{"prefix.fc.weight": frozen["prefix.fc.weight"] + 0.01})
    save_weights(tmp_path / "moved.safetensors", {**own, **moved}, {"format": "specref-medusa-1"})
    with pytest.raises(ValueError, match="prefix.fc.weight is not eagle.safetensors.xz's fc.weight"):
        compact(tmp_path / "moved.safetensors", tmp_path / "m.safetensors", ref=("prefix.", str(ref)))
    with pytest.raises(ValueError, match="only in the file: \\['0.weight'\\]"):
        compact(src, tmp_path / "n.safetensors", ref=("inputs.", str(ref)))
    with pytest.raises(ValueError, match="already references"):
        compact(out, tmp_path / "o.safetensors", ref=("prefix.", str(ref)))
    # refused at reading: the referenced file changed, or is not there
    save_weights(ref, {**head, "norm.weight": torch.zeros(16).half()}, {"format": "specref-eagle-1"})
    with pytest.raises(ValueError, match="holds other tensors: it changed after the link"):
        read_weights(out)
    ref.unlink()
    with pytest.raises(ValueError, match="neither beside it nor among the committed weights"):
        read_weights(out)
    assert read_weights(out, ["inputs.0.weight"])[0].keys() == {"inputs.0.weight"}  # its own tensors still read
