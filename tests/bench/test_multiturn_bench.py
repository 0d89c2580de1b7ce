"""The bench's second turns (`python -m specref bench --turns 2 --answers FILE`; bench/multiturn.py,
runner.py): the prompts [user turn 1, stored first answer, user turn 2] through the chat template,
the run end to end on a tiny model, SuffixDecoding's cold global trees and their recorded memory,
and the refusals (answers of another question file, --turns 2 without answers or with batches)."""
from __future__ import annotations

import json

import pytest

from specref import workloads
from specref.bench.methods import load_model
from specref.bench.multiturn import multiturn_main, prompt_of, second_turn_file, second_turn_questions
from specref.bench.report import START, markers
from specref.bench.runner import BenchConfig, bench_main
from specref.suffix_tree import NODE_BYTES, SuffixCache

CONVERSATIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write two lines about the sea.",
                                                         "Rewrite your previous response in five words."]},
    {"question_id": 90, "category": "qa", "turns": ["One turn only: not a conversation."]},
    {"question_id": 101, "category": "math", "turns": ["What is 12 times 3?", "Now explain it to a child."]},
]


@pytest.fixture
def files(tmp_path):
    q, a = tmp_path / "question.jsonl", tmp_path / "answers.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS), encoding="utf-8")
    workloads.write_first_answers(a, q, {81: "The sea is wide. The sea is deep.", 101: "12 times 3 is 36."}, "stub", 8)
    return q, a


@pytest.fixture
def tiny_default(monkeypatch):
    """load_default swapped for a tiny random Llama with the default model's tokenizer (its chat template)."""
    from transformers import AutoTokenizer

    from specref import models

    tok = AutoTokenizer.from_pretrained(models.cached_folder(models.default_gguf_path()))

    def load(**kw):
        model = models.tiny_model(vocab_size=len(tok), hidden_size=32, num_layers=2, seed=0)
        for cfg in (model.config, model.generation_config):
            cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
        return model, tok

    monkeypatch.setattr(models, "load_default", load)
    return tok


def test_second_turn_prompts_through_the_chat_template(files, tiny_default, tmp_path):
    q, _ = files
    out = tmp_path / "greedy.jsonl"
    assert multiturn_main(["--question-file", str(q), "--out", str(out), "--max-new-tokens", "4"]) == 0
    meta, answers = workloads.load_first_answers(out)
    assert set(answers) == {81, 101} and meta["max_new_tokens"] == 4 and meta["decoding"] == "greedy"
    assert meta["questions"]["sha256"] == workloads.sha256_of(q)
    rows = second_turn_questions(second_turn_file(str(q), str(out)), str(out), None, None)
    assert [r["question_id"] for r in rows] == [81, 101]
    _, encode, _, _ = load_model(BenchConfig(model="default"))
    for r in rows:
        ids = encode(prompt_of(r))
        assert ids == list(tiny_default.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"])
        text = tiny_default.decode(ids)
        t1, t2 = (c["turns"] for c in CONVERSATIONS if c["question_id"] == r["question_id"]).__next__()
        a = answers[r["question_id"]]
        assert text.index(t1) < text.index("assistant\n" + a) < text.index(t2)  # the answer as the assistant's turn
        assert ids[:len(encode(t1)) - 3] == encode(t1)[:-3]  # the same start as the first turn's prompt
    assert prompt_of({"turns": ["first", "second"]}) == "first"  # a first-turn question: its first turn


def test_tiny_model_encodes_every_turn(files):
    q, a = files
    _, encode, _, _ = load_model(BenchConfig(model="tiny"))
    rows = second_turn_questions(q, a, ("math",), 1)
    assert [r["question_id"] for r in rows] == [101]
    ids = encode(prompt_of(rows[0]))
    turns = [encode(m["content"]) for m in rows[0]["messages"]]  # [1] + the turn's first 40 bytes each
    assert ids == turns[0] + turns[1] + turns[2] and encode("x") == [1, 2 + ord("x") % 94]


def test_bench_second_turns_end_to_end(files, tmp_path):
    q, a = files
    out, md = tmp_path / "out", tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\n{START}\nthe first turns' section\n<!-- bench:end -->\n", encoding="utf-8")
    rc = bench_main(["--model", "tiny", "--question-file", str(q), "--turns", "2", "--answers", str(a),
                     "--questions", "all", "--max-new-tokens", "4", "--methods", "ar", "ngram", "suffix",
                     "suffix_tree", "hybrid_suffix", "--out", str(out), "--markdown", str(md), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    meta = res["meta"]
    assert meta["config"]["turns"] == 2 and meta["config"]["answers"] == "answers.jsonl"
    assert meta["answers"]["sha256"] == workloads.sha256_of(a) and meta["answers"]["model"] == "stub"
    assert "answers.jsonl" in meta["command"] and str(tmp_path) not in json.dumps(meta)  # no path of this machine
    _, encode, _, _ = load_model(BenchConfig(model="tiny"))
    prompts = [len(encode(prompt_of(r))) for r in second_turn_questions(q, a, None, None)]
    for name, recs in res["records"].items():
        assert [r["question_id"] for r in recs] == [81, 101] and [r["prompt_tokens"] for r in recs] == prompts
        assert all(r["n"] == 4 for r in recs) and res["summary"][name]["overall"]["identical"] is True
    sc = meta["suffix_cache"]
    assert sc["start"] == "cold" and sc["order"] == "file order"
    assert set(sc["memory"]) == {"suffix", "suffix_tree", "hybrid_suffix"}
    for m in sc["memory"].values():  # emptied after the warm-up: the two questions' outputs only
        assert m["requests"] == 2 and m["tokens"] == 2 * 4 and m["evicted"] == 0
        assert m["nodes"] > 0 and m["bytes"] == m["nodes"] * NODE_BYTES
    text = md.read_text()
    start, end = markers(meta)
    assert "the first turns' section" in text and start in text and end in text and start != START
    assert start == "<!-- bench-turn2:question.jsonl:T=0:start -->"  # one section per question file and temperature
    assert "started cold" in text and "`suffix_tree`:" in text and "second turn through the chat template" in text


def test_refusals(files, tmp_path, capsys):
    q, a = files
    other = tmp_path / "other.jsonl"
    other.write_text(q.read_text() + json.dumps({"question_id": 7, "category": "qa", "turns": ["a", "b"]}) + "\n")
    base = ["--model", "tiny", "--max-new-tokens", "2", "--no-progress", "--out", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="answers to another question file"):
        bench_main(base + ["--question-file", str(other), "--turns", "2", "--answers", str(a)])
    with pytest.raises(ValueError, match="go together"):
        bench_main(base + ["--question-file", str(q), "--turns", "2"])
    with pytest.raises(ValueError, match="go together"):
        bench_main(base + ["--question-file", str(q), "--answers", str(a)])
    with pytest.raises(ValueError, match="batch size 1 only"):
        bench_main(base + ["--question-file", str(q), "--turns", "2", "--answers", str(a), "--batch-size", "1", "2"])
    with pytest.raises(ValueError, match="does not exist"):
        bench_main(base + ["--question-file", str(q), "--turns", "2", "--answers", str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    assert "Left out: second turns" not in capsys.readouterr().out


def test_question_file_from_the_answers(tmp_path, monkeypatch):
    """Without --question-file: the shipped set when the answers are its, else Spec-Bench's file."""
    mine = tmp_path / "mine.jsonl"
    workloads.write_first_answers(mine, workloads.MULTITURN, {}, "stub", 8)
    assert second_turn_file(None, str(mine)) == workloads.MULTITURN
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps(CONVERSATIONS[0]) + "\n")
    theirs = tmp_path / "theirs.jsonl"
    workloads.write_first_answers(theirs, q, {}, "stub", 8)
    monkeypatch.setenv(workloads.SPEC_BENCH_ENV, str(q))
    assert second_turn_file(None, str(theirs)) == q
    monkeypatch.delenv(workloads.SPEC_BENCH_ENV)
    with pytest.raises(ValueError, match="Spec-Bench"):
        second_turn_file(None, str(theirs))


def test_cache_memory():
    cache = SuffixCache(max_depth=4, max_requests=1, max_nodes=None)
    assert cache.memory() == dict(nodes=0, tokens=0, requests=0, evicted=0, bytes=0)
    for seq in ([1, 2, 3], [4, 5]):
        cache.extend(cache.start(), seq)
        cache.evict()
    m = cache.memory()  # the first request evicted (one request cached): [4, 5] holds 4-5, 4 and 5
    assert m == dict(nodes=3, tokens=2, requests=1, evicted=1, bytes=3 * NODE_BYTES)
