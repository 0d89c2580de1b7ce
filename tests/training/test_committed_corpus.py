"""The committed corpus (training/committed_corpus.py): shards round-trip, checksums refuse a
corrupt or missing file by name, parts are checked for evaluation overlap, export feeds the store."""
import json
from pathlib import Path

import pytest
import torch

from specref.training import committed_corpus as cc
from specref.training.data import Seq, iter_sequences, read_shard, write_shard

REPO = Path(__file__).resolve().parents[2]


def _seqs(n, seed=0, vocab=60000):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(5, 40, (1,), generator=g))
        P = int(torch.randint(1, L, (1,), generator=g))
        out.append(Seq(torch.randint(0, vocab, (L,), generator=g), P))
    return out


def _folder(tmp, name, seqs, requests=("Write a poem about the sea and the wind tonight please",),
            fingerprint="abc123"):
    d = tmp / name
    d.mkdir()
    write_shard(d / "shard_00000.safetensors", seqs)
    (d / "requests_00000.json").write_text(json.dumps({"counts": {}, "rows": [
        {"id": i, "category": "self_writing", "instruction": r} for i, r in enumerate(requests)]}))
    (d / "manifest.json").write_text(json.dumps({"format": 1, "seed": 3, "model_fingerprint": fingerprint,
                                                 "settings": {"temperature": 0.0, "max_new_tokens": 128}}))
    return d


def _eval_file(tmp, text="What is the capital city of France and why is it famous among travellers today"):
    p = tmp / "questions.jsonl"
    p.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [text]}) + "\n")
    return p


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.prompt_len == y.prompt_len and torch.equal(x.tokens, y.tokens)


def test_answers_shard_round_trip(tmp_path):
    seqs = _seqs(17)
    rec = cc.write_answers(tmp_path / "a.safetensors.xz", seqs)
    assert rec["sequences"] == 17 and rec["tokens"] == sum(len(s.tokens) for s in seqs)
    assert rec["answer_tokens"] == sum(len(s.tokens) - s.prompt_len for s in seqs)
    _same(cc.read_answers(tmp_path / "a.safetensors.xz"), seqs)
    with pytest.raises(ValueError, match="uint16"):  # a vocabulary this format cannot hold
        cc.write_answers(tmp_path / "b.safetensors.xz", [Seq(torch.tensor([1, 70000]), 1)])


def test_add_verify_iterate_export(tmp_path):
    root = tmp_path / "corpus"
    a, b = _seqs(30, 1), _seqs(11, 2)
    ev = _eval_file(tmp_path)
    cc.add_part(root, _folder(tmp_path, "A", a), "A", [ev], shard_sequences=8)  # 4 shards
    part = cc.add_part(root, _folder(tmp_path, "B", b), "B", [ev])
    assert part["overlap"]["checked_against"][0]["name"] == "questions.jsonl" and part["overlap"]["hits"] == 0
    man = cc.verify(root)
    assert [p["name"] for p in man["parts"]] == ["A", "B"] and man["counts"]["sequences"] == 41
    assert len(man["parts"][0]["files"]) == 5  # 4 answer shards + the requests
    _same(list(cc.iter_corpus(root)), a + b)
    _same(list(cc.iter_corpus(root, parts=["B"])), b)
    half = list(cc.iter_corpus(root, fraction=0.5, seed=1))
    assert 5 < len(half) < 36 and [len(s.tokens) for s in half] == [len(s.tokens) for s in cc.iter_corpus(root, fraction=0.5, seed=1)]
    out = tmp_path / "exported"
    dman = cc.export(root, out, parts=["A"])
    assert dman["model_fingerprint"] == "abc123" and dman["counts"]["sequences"] == 30
    _same(list(iter_sequences(out)), a)  # the store's --distilled reader sees the same sequences
    with pytest.raises(ValueError, match="not empty"):
        cc.export(root, out)


def test_fraction_slices_nest(tmp_path):
    # the data curve scores each sequence once: fraction 1/2 = fraction 1/4 + the slice [1/4, 1/2)
    root = tmp_path / "corpus"
    cc.add_part(root, _folder(tmp_path, "A", _seqs(60, 1)), "A", [_eval_file(tmp_path)], shard_sequences=16)
    key = lambda seqs: sorted(tuple(s.tokens.tolist()) for s in seqs)  # noqa: E731
    quarter = list(cc.iter_corpus(root, fraction=0.25, seed=3))
    slice_ = list(cc.iter_corpus(root, fraction=0.5, seed=3, from_fraction=0.25))
    half = list(cc.iter_corpus(root, fraction=0.5, seed=3))
    assert quarter and slice_ and not set(key(quarter)) & set(key(slice_))
    assert key(quarter + slice_) == key(half)
    dman = cc.export(root, tmp_path / "slice", fraction=0.5, seed=3, from_fraction=0.25)
    assert dman["from_corpus"]["from_fraction"] == 0.25 and dman["counts"]["sequences"] == len(slice_)
    _same(list(iter_sequences(tmp_path / "slice")), slice_)
    for bad in (dict(fraction=0.5, from_fraction=0.5), dict(fraction=0.5, from_fraction=-0.1)):
        with pytest.raises(ValueError, match="from_fraction"):
            next(cc.iter_corpus(root, **bad))
        with pytest.raises(ValueError, match="from_fraction"):
            cc.export(root, tmp_path / "bad", **bad)


def test_corrupt_or_missing_file_is_refused_by_name(tmp_path):
    root = tmp_path / "corpus"
    cc.add_part(root, _folder(tmp_path, "A", _seqs(20, 3)), "A", [_eval_file(tmp_path)], shard_sequences=8)
    shard = root / "parts" / "A" / "answers_00001.safetensors.xz"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="answers_00001.safetensors.xz is corrupt"):
        cc.verify(root)
    with pytest.raises(ValueError, match="answers_00001.safetensors.xz is corrupt"):
        next(cc.iter_corpus(root))
    (root / "parts" / "A" / "requests.jsonl.xz").unlink()
    with pytest.raises(ValueError, match="requests.jsonl.xz is missing"):
        cc.verify(root)


def test_part_refusals(tmp_path):
    root = tmp_path / "corpus"
    ev = _eval_file(tmp_path)
    cc.add_part(root, _folder(tmp_path, "A", _seqs(3)), "A", [ev])
    with pytest.raises(ValueError, match="already has a part 'A'"):
        cc.add_part(root, _folder(tmp_path, "A2", _seqs(3)), "A", [ev])
    with pytest.raises(ValueError, match="written by model other"):
        cc.add_part(root, _folder(tmp_path, "C", _seqs(3), fingerprint="other"), "C", [ev])
    leaked = "Tell me: what is the capital city of France and why is it famous among travellers today?"
    with pytest.raises(ValueError, match="13-gram"):
        cc.add_part(root, _folder(tmp_path, "D", _seqs(3), requests=(leaked,)), "D", [ev])
    with pytest.raises(ValueError, match="eval_files is empty"):
        cc.add_part(root, _folder(tmp_path, "E", _seqs(3)), "E", [])
    assert [p["name"] for p in cc.verify(root)["parts"]] == ["A"]  # nothing refused was written


def test_drop_overlap_leaves_out_what_shares_a_13_gram(tmp_path):
    root, ev = tmp_path / "corpus", _eval_file(tmp_path)
    leaked = "Tell me: what is the capital city of France and why is it famous among travellers today?"

    class Tok:  # decodes the second sequence as a text quoting the evaluation question
        def batch_decode(self, ids, skip_special_tokens=True):
            return [leaked if i == 1 else "an answer about the sea" for i in range(len(ids))]

    seqs = _seqs(3)
    folder = _folder(tmp_path, "A", seqs, requests=("Write a poem about the sea and the wind tonight please", leaked))
    with pytest.raises(ValueError, match="13-gram"):
        cc.add_part(root, folder, "A", [ev], tokenizer=Tok())
    part = cc.add_part(root, folder, "A", [ev], tokenizer=Tok(), drop_overlap=True)
    assert part["overlap"]["dropped"] == {"requests": 1, "sequences": 1} and part["overlap"]["hits"] == 0
    assert part["counts"]["sequences"] == 2 and part["files"][-1]["rows"] == 1
    _same(list(cc.iter_corpus(root)), [seqs[0], seqs[2]])


def test_the_committed_corpus_verifies():
    man = cc.verify(REPO / "corpus")
    assert man["model"]["fingerprint"] == "0c6c5ffa613680e4"  # SmolLM2-135M-Instruct (load_default)
    assert all(p["overlap"]["hits"] == 0 and p["overlap"]["checked_against"] for p in man["parts"])
    first = man["parts"][0]["files"][0]
    seqs = cc.read_answers(REPO / "corpus" / first["path"])
    assert len(seqs) == first["sequences"] and sum(len(s.tokens) for s in seqs) == first["tokens"]


def test_vocab_coverage_counts_answer_tokens_inside_the_draft_vocabulary(tmp_path):
    """`corpus coverage`: the share of answer tokens that the draft vocabulary built from the corpus
    holds, exact on a hand-made corpus: answer tokens 5 (x3), 7 (x2), 9 (x1)."""
    root = tmp_path / "corpus"
    seqs = [Seq(torch.tensor([1, 5, 5, 7]), 1), Seq(torch.tensor([2, 5, 7, 9]), 1)]
    cc.add_part(root, _folder(tmp_path, "A", seqs), "A", [_eval_file(tmp_path)])
    answers = [[5, 7, 9, 11], [5, 5]]  # 6 tokens: 5 x3, 7, 9, 11 (11 never in the corpus)
    cov = cc.vocab_coverage(root, answers, [2, 3, 20], vocab_size=20)
    assert cov == {2: pytest.approx(4 / 6), 3: pytest.approx(5 / 6), 20: 1.0}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"records": {"ar": [{"tokens": a} for a in answers]}}))
    assert cc.bench_answers(bench) == answers
    assert cc.corpus_main(["--root", str(root), "coverage", str(bench), "--sizes", "2", "--vocab-size", "20"]) == 0
    with pytest.raises(ValueError, match="no 'ar' records"):
        bench.write_text(json.dumps({"records": {"ngram": []}}))
        cc.bench_answers(bench)
