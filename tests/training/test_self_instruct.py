"""Tests of training/self_instruct.py: the user-turn prefix, the filters, resumption, the stage in distill."""
import json

import pytest

from specref.models import tiny_model
from specref.training import self_instruct as si
from specref.training.contamination import word_ngrams


class _Tok:
    """A stand-in tokenizer: ids are bytes + 2 (0 pad, 1 end of turn), a visible chat template."""
    eos_token_id = 1
    pad_token_id = 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, return_dict=False):
        text = "".join(f"<{m['role'][0]}>{m['content']}<e>" for m in messages) + ("<a>" if add_generation_prompt else "")
        if tokenize:
            return {"input_ids": self(text[-60:])["input_ids"]}
        return text

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + b % 94 for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"w{i} " for i in ids if i > 1)


def _model():
    m = tiny_model("llama", vocab_size=96, num_layers=1, seed=0, init_std=0.2, logit_scale=2.0)
    m.generation_config.eos_token_id = 1
    return m


def test_user_prefix_cuts_at_the_users_text():
    tok = _Tok()
    ids = si.user_prefix(tok, "The user asks a riddle.")
    assert ids == tok("<s>The user asks a riddle.<e><u>")["input_ids"]

    class Hiding(_Tok):
        def apply_chat_template(self, messages, **kw):
            return "<u>[redacted]<e>"

    with pytest.raises(ValueError, match="verbatim"):
        si.user_prefix(Hiding(), "x")


def test_hints_cover_every_kind_and_are_deterministic():
    h = si.hints(2 * len(si.KINDS), seed=1)
    assert [c for c, _ in h[: len(si.KINDS)]] == sorted(si.KINDS)
    assert all(any(x in text for x in si.KINDS[c]) and "The topic is" in text for c, text in h)
    assert si.hints(30, seed=1)[:5] == h[:5] and si.hints(30, seed=2) != si.hints(30, seed=1)


def test_requests_are_filtered_and_resume(tmp_path):
    model, tok = _model(), _Tok()
    cfg = si.SelfInstructConfig(num_requests=6, max_new_tokens=48, batch_size=8, chunk=16, min_chars=12)
    rows = si.write_requests(model, tok, tmp_path / "a", cfg, progress=False)
    counts = si.filter_counts(tmp_path / "a")
    kept = sum(len(json.loads(p.read_text())["rows"]) for p in sorted((tmp_path / "a").glob("requests_*.json")))
    assert len(rows) == 6 and kept >= 6
    assert counts["sampled"] == counts["truncated"] + counts["short"] + counts["duplicate"] + counts["dev_overlap"] + kept
    assert counts["truncated"] > 0  # a random model often runs past 48 tokens: those are dropped, not cut
    assert len({r["instruction"] for r in rows}) == 6 and all(len(r["instruction"]) >= 12 for r in rows)
    assert all(r["category"].startswith("self_") for r in rows)
    # resuming: the chunks written stay as they are, more requests only add chunks
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("requests_*.json")}
    more = si.write_requests(model, tok, tmp_path / "a", si.SelfInstructConfig(
        num_requests=kept + 3, max_new_tokens=48, batch_size=8, chunk=16, min_chars=12), progress=False)
    assert more[:6] == rows and len(more) == kept + 3
    assert all((tmp_path / "a" / n).stat().st_mtime_ns == t for n, t in stamps.items())
    # the development split's 13-grams: a request sharing one is dropped and counted
    grams = word_ngrams(rows[0]["instruction"])
    assert grams  # long enough to hold a 13-gram
    again = si.write_requests(model, tok, tmp_path / "b", cfg, dev_grams=grams, progress=False)
    assert rows[0]["instruction"] not in [r["instruction"] for r in again]
    assert si.filter_counts(tmp_path / "b")["dev_overlap"] >= 1 and si.filter_counts(tmp_path / "b")["dev_checked"]


def test_distill_answers_the_requests(tmp_path):
    from specref.training.data import DistillConfig, iter_sequences, shard_paths
    from specref.training.self_instruct import distill

    model, tok = _model(), _Tok()
    inst = tmp_path / "inst.jsonl"
    inst.write_text("".join(json.dumps({"id": i, "category": "qa", "instruction": f"question {i}?"}) + "\n"
                            for i in range(3)))
    cfg = DistillConfig(max_new_tokens=20, batch_size=8, shard_size=4, topk=4, self_instruct=5)
    with pytest.raises(ValueError, match="self_instruct"):
        DistillConfig(self_instruct=-1)
    from specref.training import data
    with pytest.raises(ValueError, match="self_instruct.distill"):  # the requests are not made there
        data.distill(model, tok, tmp_path / "x", cfg, instructions_path=inst, progress=False)
    man = distill(model, tok, tmp_path / "d", cfg, instructions_path=inst, progress=False)
    names = [p.name for p in shard_paths(tmp_path / "d")]
    assert names == ["shard_00000.safetensors", "shard_s00000.safetensors", "shard_s00001.safetensors"]
    assert man["self_instruct"]["requests"] == 5 and sum(man["self_instruct"]["per_category"].values()) == 5
    seqs = list(iter_sequences(tmp_path / "d"))
    assert len(seqs) == 8 and all(q.topk_ids is not None for q in seqs)
    req = [r for p in sorted((tmp_path / "d").glob("requests_*.json")) for r in json.loads(p.read_text())["rows"]][:5]
    # each self-instruct sequence's prompt is its request through the chat template
    prompts = sorted(tuple(q.tokens[: q.prompt_len].tolist()) for q in seqs[3:])
    want = sorted(tuple(tok.apply_chat_template([{"role": "user", "content": r["instruction"]}], tokenize=True,
                                                add_generation_prompt=True, return_dict=True)["input_ids"]) for r in req)
    assert prompts == want


def test_request_chunk_sets_the_request_batch(tmp_path):
    """request_chunk: requests sampled per chunk file (the request batch's bound); None keeps the
    committed parts' rule min(256, max(batch_size, 2 * self_instruct))."""
    from specref.training.data import DistillConfig, read_manifest
    from specref.training.self_instruct import distill

    model, tok = _model(), _Tok()
    inst = tmp_path / "inst.jsonl"
    inst.write_text(json.dumps({"id": 0, "category": "qa", "instruction": "question?"}) + "\n")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="request_chunk"):
            DistillConfig(request_chunk=bad)
    sampled = {}
    for name, chunk in (("default", None), ("narrow", 4)):
        cfg = DistillConfig(max_new_tokens=8, batch_size=4, shard_size=4, topk=0, self_instruct=5,
                            request_chunk=chunk)
        distill(model, tok, tmp_path / name, cfg, instructions_path=inst, progress=False, evals=[])
        files = sorted((tmp_path / name).glob("requests_*.json"))
        sampled[name] = {json.loads(p.read_text())["counts"]["sampled"] for p in files}
        assert read_manifest(tmp_path / name)["settings"]["request_chunk"] == chunk
    assert sampled == {"default": {min(256, max(4, 2 * 5))}, "narrow": {4}}


def test_a_model_that_never_ends_a_request_is_refused(tmp_path, monkeypatch):
    import specref.generate

    class Out:  # every sampled request runs to max_new_tokens without the end-of-turn token
        def row(self, j):
            return [5, 6, 7]

    monkeypatch.setattr(specref.generate, "autoregressive_generate", lambda *a, **k: Out())
    cfg = si.SelfInstructConfig(num_requests=2, max_new_tokens=3, batch_size=8, chunk=8)
    with pytest.raises(ValueError, match="end-of-turn"):
        si.write_requests(_model(), _Tok(), tmp_path, cfg, progress=False)
    assert not list(tmp_path.glob("requests_*.json"))  # nothing half-written


def test_data_command_writes_and_scores_self_distilled_answers(tmp_path, monkeypatch):
    """`python -m specref data --sources --distilled F --self-instruct N`: one command writes F (the
    target's requests and answers, in the model's dtype) and scores it into the store."""
    import specref.models
    from specref.training import contamination, store
    from specref.training.data import iter_sequences, read_manifest

    model, tok = _model(), _Tok()
    monkeypatch.setattr(specref.models, "load_default", lambda dtype=None, device="cpu": (model.to(dtype), tok))
    monkeypatch.setattr(contamination, "dev_ngrams", lambda *a, **k: set())
    with pytest.raises(ValueError, match="--distilled"):
        store.data_main(["--sources", "--self-instruct", "4", "--out", str(tmp_path / "s")])
    args = ["--sources", "--distilled", str(tmp_path / "d"), "--self-instruct", "6", "--passage-prompts", "2",
            "--max-new-tokens", "70", "--gen-batch-size", "4", "--out", str(tmp_path / "s"), "--max-len", "64",
            "--batch-tokens", "256", "--shard-tokens", "200", "--topk", "4", "--dtype", "bfloat16",
            "--request-chunk", "4"]
    with pytest.raises(ValueError, match="--distill-only"):  # nothing to write: a mistake, said
        store.data_main(["--sources", "--distilled", str(tmp_path / "d"), "--distill-only"])
    assert store.data_main(args + ["--distill-only"]) == 0  # the folder alone (a GPU run that grows the corpus)
    assert read_manifest(tmp_path / "d")["counts"]["sequences"] == 8 and not (tmp_path / "s").exists()
    assert store.data_main(args) == 0  # the same folder, finished, then scored
    man = read_manifest(tmp_path / "d")
    assert man["self_instruct"]["requests"] == 6 and man["dtype"] == "torch.bfloat16"
    assert man["settings"]["topk"] == 0 and man["settings"]["num_instructions"] == 0
    assert man["settings"]["request_chunk"] == 4 and {json.loads(p.read_text())["counts"]["sampled"]
                                                      for p in (tmp_path / "d").glob("requests_*.json")} == {4}
    seqs = list(iter_sequences(tmp_path / "d"))
    assert len(seqs) == 8 and man["counts"]["sequences"] == 8  # 6 requests + 2 passage prompts
    scored = list(store.iter_store(tmp_path / "s", layers=()))
    assert sorted(tuple(q.tokens.tolist()) for q in scored) == sorted(tuple(q.tokens.tolist()[:64]) for q in seqs)
    smf = store.read_store_manifest(tmp_path / "s")
    assert [s["name"] for s in smf["sources"]] == ["distilled"]
