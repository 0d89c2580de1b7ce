"""Tests of training/store/ and corpus.py: shards round-trip, resumption, labels = the target's p,
features = attach_features', the whole pipeline trains, the 13-gram contamination filter."""
import json
import re
from dataclasses import replace

import pytest
import torch

from specref.training import contamination, corpus
from specref.training.store import build as store_build
from specref.training.contamination import word_ngrams
from specref.training.corpus import Doc, Source, encode, overlap_filter, token_source
from specref.training.data import Seq
from specref.training.store import (StoreConfig, build_store, iter_store, pack, read_store_shard, store_shards,
                                    store_split, stores_split, write_store_shard)

V = 64


from test_training import _target  # the same frozen V = 64 target


def _sources(n=60, seed=0):
    """Two token sources: random 'prompts' (4-8 tokens) + 'texts' (10-50 tokens), weights 2 : 1."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        P, R = int(torch.randint(4, 9, (1,), generator=g)), int(torch.randint(10, 51, (1,), generator=g))
        rows.append((torch.randint(0, V, (P + R,), generator=g).tolist(), P))
    return [token_source("a", rows[: 2 * n // 3], weight=2.0), token_source("b", rows[2 * n // 3:], weight=1.0)]


CFG = StoreConfig(tokens=1200, max_len=48, batch_tokens=256, shard_tokens=400, topk=8, layers=("final", 1))


def test_shard_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    seqs, feats = [], {"final": [], 3: []}
    for L, P in ((10, 3), (5, 1), (30, 12)):  # (length, prompt_len)
        seqs.append(Seq(torch.randint(0, 50000, (L,), generator=g), P, torch.randint(0, 50000, (L - P, 4), generator=g),
                        torch.randn(L - P, 4, generator=g).half().float()))
        feats["final"].append(torch.randn(L, 6, generator=g).half())
        feats[3].append(torch.randn(L, 6, generator=g).half())
    path = tmp_path / "shard_00000.safetensors"
    write_store_shard(path, seqs, [11, 22, 2 ** 59], [0, 1, 0], feats)
    back, dids, sids = read_store_shard(path, ("final", 3), with_ids=True)
    assert dids == [11, 22, 2 ** 59] and sids == [0, 1, 0]
    for i, (a, b) in enumerate(zip(seqs, back)):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
        assert torch.equal(b.features, torch.cat([feats["final"][i], feats[3][i]], -1))  # layers concatenated
    only3 = read_store_shard(path, (3,))
    assert torch.equal(only3[2].features, feats[3][2]) and read_store_shard(path, ())[0].features is None
    with pytest.raises(ValueError, match="layers"):
        read_store_shard(path, (5,))
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_labels_and_features_are_the_targets(tmp_path):
    target = _target()
    build_store(target, None, _sources(), tmp_path, CFG, progress=False)
    seqs = list(iter_store(tmp_path, layers=("final", 1)))
    assert sum(len(s.tokens) for s in seqs) >= CFG.tokens
    same_as_corpus = total = 0
    for s in seqs:
        P, L = s.prompt_len, len(s.tokens)
        out = target(input_ids=s.tokens[None], output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0].float(), -1)[P - 1: L - 1]  # (R, V): p predicting tokens[P:]
        vals, ids = logp.topk(CFG.topk, -1)  # (R, K)
        # the label is the target's top-k, not the corpus's next token (that would be ids = tokens[P:], logp 0)
        assert torch.equal(s.topk_ids[:, 0], ids[:, 0])
        assert torch.allclose(s.topk_logprobs, vals, atol=5e-3)  # float16 storage
        same_as_corpus += int((ids[:, 0] == s.tokens[P:]).sum())
        total += L - P
        # features: the final normed state (attach_features') and hidden_states[1], unpadded
        last = target.model(input_ids=s.tokens[None]).last_hidden_state[0]  # (L, D)
        D = last.shape[-1]
        assert torch.allclose(s.features[:, :D].float(), last, atol=1e-2, rtol=1e-2)
        assert torch.allclose(s.features[:, D:].float(), out.hidden_states[1][0], atol=1e-2, rtol=1e-2)
    assert same_as_corpus < 0.2 * total  # random text: the two labels differ, so the check discriminates
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["counts"]["sequences"] == len(seqs) and man["settings"]["topk"] == CFG.topk
    assert [s["name"] for s in man["sources"]] == ["a", "b"] and man["model_fingerprint"]


def _contents(path):
    """A shard's tensors (as bytes) and metadata (safetensors writes metadata keys in any order)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}


def test_resume_skips_finished_shards(tmp_path, monkeypatch):
    target = _target()
    build_store(target, None, _sources(), tmp_path, CFG, progress=False)
    paths = store_shards(tmp_path)
    assert len(paths) >= 3
    before = {p.name: _contents(p) for p in paths}
    calls = []
    real = store_build.score
    monkeypatch.setattr(store_build, "score", lambda *a, **k: calls.append(1) or real(*a, **k))
    build_store(target, None, _sources(), tmp_path, CFG, progress=False)
    assert calls == []  # everything was done: no forward at all
    paths[1].unlink()
    man = build_store(target, None, _sources(), tmp_path, CFG, progress=False)
    assert calls and {p.name: _contents(p) for p in store_shards(tmp_path)} == before  # only shard 1, same tensors
    assert man["this_run"]["tokens"] == man["shards"][paths[1].name]["tokens"]
    bigger = build_store(target, None, _sources(), tmp_path, replace(CFG, tokens=2000),
                         progress=False)  # --tokens larger: extends, keeps the old shards
    assert bigger["counts"]["shards"] > len(paths) and all(_contents(p) == before[p.name] for p in paths)
    with pytest.raises(ValueError, match="other settings"):
        build_store(target, None, _sources(), tmp_path, replace(CFG, topk=4), progress=False)


def test_pipeline_trains_draft_and_eagle_on_the_store(tmp_path):
    from specref.draft_model import load_trained_draft
    from specref.eagle_head import EagleHead, eagle_info, load_eagle, save_eagle
    from specref.training.cli import train_main
    from specref.training.data import collate
    from specref.training.draft import DraftDistillTask, DraftTrainConfig, run_draft_store_training
    from specref.training.eagle import EagleTask, EagleTrainConfig, run_eagle_store_training
    from specref.training.loop import TrainConfig
    from specref.weights import fingerprint

    target = _target()
    cfg = replace(CFG, tokens=3000, layers=("final",))
    build_store(target, None, _sources(120, seed=1), tmp_path, cfg, progress=False)
    train, held = store_split(tmp_path, heldout_fraction=0.2, seed=0)
    assert len(held) >= 5 and len(train) >= 40
    assert store_split(tmp_path, heldout_fraction=0.2, seed=0)[1][0].tokens.equal(held[0].tokens)  # deterministic
    assert sum(1 for _ in iter_store(tmp_path, split="heldout", heldout_fraction=0.2)) == len(held)
    tcfg = TrainConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=4, eval_every=40, max_len=48, seed=0)
    torch.manual_seed(0)
    # the draft on the store's stored top-k, through the command's function (`train --store`), read
    # without features as the command reads it
    lean = store_split(tmp_path, layers=(), heldout_fraction=0.2, seed=0)
    assert lean[0][0].features is None and lean[0][0].topk_ids.equal(train[0].topk_ids)
    rec = run_draft_store_training(target, *lean, tcfg, DraftTrainConfig(num_layers=1, draft_vocab=48),
                                   tmp_path / "draft.safetensors")
    first, last = rec["history"][0], rec["history"][-1]
    assert last["heldout_loss"] < first["heldout_loss"] - 0.05, (first, last)
    draft, token_map = load_trained_draft(target, tmp_path / "draft.safetensors")
    again = DraftDistillTask(draft, token_map, V, "kl").evaluate(collate(held, 48))
    assert again["loss"] / again["count"] == pytest.approx(last["heldout_loss"], rel=1e-2)  # fp16 file
    # EAGLE-1 on the store, through the command's function (`train --method eagle --store`)
    rec = run_eagle_store_training(target, train, held, replace(tcfg, steps=20, eval_every=20),
                                   EagleTrainConfig(draft_vocab=V), tmp_path / "eagle.safetensors")
    first, last = rec["history"][0], rec["history"][-1]
    assert last["heldout_reg"] < first["heldout_reg"] and last["heldout_accept"] > first["heldout_accept"]
    head = load_eagle(target, tmp_path / "eagle.safetensors")
    assert eagle_info(tmp_path / "eagle.safetensors")["record"]["heldout"]["heldout_top1"] == last["heldout_top1"]
    assert EagleTask(head).evaluate(collate(held[:4], 48))["count"] > 0
    # `train --method eagle --store S --init FILE`: training continues from that head (its first
    # evaluation is the saved head's, its draft vocabulary kept); a fresh head starts elsewhere
    tm = torch.arange(0, V, 2)  # another vocabulary than the store's: must not be rebuilt
    save_eagle(tmp_path / "init.safetensors", EagleHead(target, tm, seed=3, current_token=True), fingerprint(target),
               {"heldout": {}})
    saved = EagleTask(load_eagle(target, tmp_path / "init.safetensors")).evaluate(collate(held, 48))
    more = run_eagle_store_training(target, train, held, replace(tcfg, steps=10, eval_every=10),
                                    EagleTrainConfig(draft_vocab=V), tmp_path / "more.safetensors",
                                    init=tmp_path / "init.safetensors")
    assert more["history"][0]["heldout_top1"] == pytest.approx(saved["top1"] / saved["count"], abs=1e-6)
    assert more["history"][0]["heldout_top1"] != pytest.approx(first["heldout_top1"], abs=1e-6)
    assert more["init"]["path"] == "init.safetensors"  # by name: a record names no machine path
    assert load_eagle(target, tmp_path / "more.safetensors").token_map.equal(tm)
    # the record states the head it trained (the file's inputs and vocabulary), not the flags' defaults
    assert (more["eagle"]["current_token"], more["eagle"]["draft_vocab"], more["eagle"]["layers"]) == (True, tm.numel(), 1)
    assert load_eagle(target, tmp_path / "more.safetensors").current_token
    with pytest.raises(ValueError, match="--init"):
        train_main(["--method", "eagle", "--init", str(tmp_path / "init.safetensors")])


def test_several_stores_train_together(tmp_path):
    from specref.models import tiny_model

    target, cfg = _target(), replace(CFG, layers=("final",))
    build_store(target, None, _sources(40, seed=1), tmp_path / "a", cfg, progress=False)
    build_store(target, None, _sources(40, seed=2), tmp_path / "b", cfg, progress=False)
    both = stores_split([tmp_path / "a", tmp_path / "b"], heldout_fraction=0.2)
    parts = [store_split(tmp_path / x, heldout_fraction=0.2) for x in "ab"]
    for j in (0, 1):  # train, heldout: a's then b's, each split as alone
        want = parts[0][j] + parts[1][j]
        assert len(both[j]) == len(want) and all(x.tokens.equal(y.tokens) and x.features.equal(y.features)
                                                 for x, y in zip(both[j], want))
    other = tiny_model("llama", vocab_size=V, num_layers=2, seed=4)
    build_store(other, None, _sources(40, seed=3), tmp_path / "c", cfg, progress=False)
    with pytest.raises(ValueError, match="different models"):
        stores_split([tmp_path / "a", tmp_path / "c"])


def test_overlap_filter_removes_a_document_quoting_a_dev_question():
    dev = contamination.eval_files()  # Spec-Bench's development split through $SPECREF_SPEC_BENCH (CI sets it)
    if not dev:
        pytest.skip("no development questions: set SPECREF_SPEC_BENCH to Spec-Bench's question.jsonl")
    q = json.loads(open(dev[0], encoding="utf-8").readline())["turns"][0]
    words = re.findall(r"\w+", q)  # the filter's words
    assert len(words) >= 14
    grams = contamination.dev_ngrams(dev)
    quote = "As asked: " + " ".join(words[:13]) + " thanks"  # 13 words of the question
    quoting = Doc("s", "quote", (("user", "Please help."), ("assistant", quote)))
    twelve = Doc("s", "twelve", (("user", "Hi."), ("assistant", " ".join(words[:12]) + " zebra")))  # 12 words: kept
    clean = Doc("s", "clean", (("user", "Explain lists."), ("assistant", "A list is a mutable sequence.")))
    src = overlap_filter(Source("s", "test", "test", [quoting, twelve, clean]), grams)
    assert [d.key for d in src.docs] == ["twelve", "clean"]
    assert src.overlap["documents_before"] == 1 and src.overlap["documents_after"] == 0
    assert src.overlap["removed"] == ["quote"]
    assert word_ngrams("A b, c!", 2) == {("a", "b"), ("b", "c")}  # lower-cased \w+ words


class _ChatTok:
    """A character-level ChatML stand-in for a tokenizer: apply_chat_template only."""

    def apply_chat_template(self, msgs, add_generation_prompt=False, tokenize=True, return_dict=True):
        s = "".join(f"<{m['role']}>{m['content']}|" for m in msgs) + ("<assistant>" if add_generation_prompt else "")
        return {"input_ids": [ord(c) % V for c in s]}


def test_encode_labels_start_at_the_assistant_turn():
    doc = Doc("s", "k", (("user", "ab"), ("assistant", "cde"), ("user", "f"), ("assistant", "g")))
    ids, p = encode(doc, _ChatTok())
    text = "<user>ab|<assistant>cde|<user>f|<assistant>g|"
    assert ids == [ord(c) % V for c in text]
    assert p == len("<user>ab|<assistant>")  # first labelled token: the assistant's 'c'
    assert encode(doc, _ChatTok(), label="all")[1] == 1
    assert encode(Doc("s", "t", tokens=(1, 2, 3, 4), prompt_len=2), None) == ([1, 2, 3, 4], 2)


def test_pack_respects_the_token_budget():
    lengths = [5, 40, 12, 33, 7, 40, 1]
    batches = pack(lengths, 80)
    assert sorted(sum(batches, [])) == list(range(7))
    assert all(len(b) * max(lengths[i] for i in b) <= 80 for b in batches)
    assert batches[0] == [1, 5]  # longest first: two of 40


def _passage_sources():
    """An English documentation source and a Debian-Reference-like one (keys 'lang:...')."""
    en = [Doc("python-docs", f"d{i}", (("user", "Explain."), ("assistant", f"Paragraph {i} about lists and "
                                                                          f"tuples, " * 12 + "\n\nMore text.")))
          for i in range(5)]
    xx = [Doc("debian-reference", f"{lang}:{i}#0", (("user", "Erkläre."),
                                                      ("assistant", f"Satz {i} über Pakete und apt. " * 10)))
          for i, lang in enumerate(("de", "fr", "es"))]
    return [Source("python-docs", "test", "test", en), Source("debian-reference", "test", "test", xx)]


def test_passage_requests_quote_real_text_and_drop_dev_overlap():
    srcs = _passage_sources()
    rows, counts = corpus.passage_requests(srcs, 24, seed=1)
    assert len(rows) == 24 and counts["requests"] == 24 and counts["dev_overlap"] == 0
    assert [(r["name"], r["licence"]) for r in counts["sources"]] == [("python-docs", "test"),
                                                                     ("debian-reference", "test")]
    assert rows == corpus.passage_requests(srcs, 24, seed=1)[0]  # deterministic
    cats = [c for c, _, _ in corpus.PASSAGE_REQUESTS]
    assert [r["category"] for r in rows] == ["real_" + cats[i % len(cats)] for i in range(24)]
    en = {d.messages[1][1][:60] for d in srcs[0].docs}
    xx = {d.messages[1][1][:60]: d.key[:2] for d in srcs[1].docs}
    for i, r in enumerate(rows):  # every request quotes one real passage; "xx" ones a foreign one, named
        _, kind, tpl = corpus.PASSAGE_REQUESTS[i % len(corpus.PASSAGE_REQUESTS)]
        hit_en = [p for p in en if p in r["instruction"]]
        hit_xx = [p for p in xx if p in r["instruction"]]
        assert len(hit_en) + len(hit_xx) == 1, r
        if kind == "xx":
            assert hit_xx and "English" in r["instruction"]
            if "{l}" in tpl:
                assert corpus.LANG_NAMES[xx[hit_xx[0]]] in r["instruction"]
        else:
            assert hit_en
    # a request sharing a 13-gram with the development questions is dropped and counted
    grams = word_ngrams(srcs[0].docs[2].messages[1][1])
    rows2, counts2 = corpus.passage_requests(srcs, 24, seed=1, grams=grams)
    assert len(rows2) == 24 and counts2["dev_overlap"] > 0
    assert not any(grams & word_ngrams(r["instruction"]) for r in rows2)
    with pytest.raises(ValueError, match="non-English"):
        corpus.passage_requests(srcs[:1], 4)
