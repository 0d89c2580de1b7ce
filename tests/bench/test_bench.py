"""The benchmark end to end on a tiny random model and a tiny Spec-Bench-format question file.

No timing is asserted (speed never goes into a test): only that every output is produced, the
numbers are consistent with each other, the BENCHMARKS.md splice keeps other sections, and the
specref greedy methods reproduce the baseline token for token.
"""
from __future__ import annotations

import json

import pytest

from specref.bench.methods import ALL_METHODS
from specref.bench.runner import bench_main, find_question_file, load_questions
from specref.bench.report import END, START, first_difference, overall_table, splice

QUESTIONS = [  # Spec-Bench format: question_id, category, turns (only the first turn is used)
    {"question_id": 2, "category": "writing", "turns": ["Write a short poem about the sea.", "Again."]},
    {"question_id": 4, "category": "writing", "turns": ["Describe a marketplace."]},
    {"question_id": 6, "category": "summarization", "turns": ["Summarize: the cat sat on the mat. "
                                                               "The cat sat on the mat again."]},
    {"question_id": 8, "category": "coding", "turns": ["def f(x): return x + 1  # explain f"]},
]
OTHER = "## Trained draft\n\nnumbers of another engineer\n"


@pytest.fixture
def qfile(tmp_path):
    p = tmp_path / "question.jsonl"
    p.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    return p


def test_question_selection(qfile, monkeypatch):
    rows = load_questions(qfile, None, 1)  # the first question of each category, in file order
    assert [r["question_id"] for r in rows] == [2, 6, 8]
    rows = load_questions(qfile, ("writing",), None)  # all of one category
    assert [r["question_id"] for r in rows] == [2, 4]
    with pytest.raises(ValueError, match="unknown categories"):
        load_questions(qfile, ("poetry",), 1)
    monkeypatch.setenv("SPECREF_SPEC_BENCH", str(qfile.parent))  # a folder holding question.jsonl
    assert find_question_file() == qfile


def test_splice_keeps_other_sections(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n" + OTHER, encoding="utf-8")
    splice(md, f"{START}\nfirst\n{END}")  # appended after the other section
    splice(md, f"{START}\nsecond\n{END}")  # replaced in place
    text = md.read_text()
    assert OTHER in text and "second" in text and "first" not in text
    assert text.count(START) == 1 and text.count(END) == 1


def test_bench_end_to_end(qfile, tmp_path):
    out, md = tmp_path / "out", tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n" + OTHER, encoding="utf-8")
    rc = bench_main(["--model", "tiny", "--question-file", str(qfile), "--questions", "1",
                     "--max-new-tokens", "24", "--out", str(out), "--markdown", str(md), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert OTHER in text and START in text and END in text and "bench.png" in text
    summ = res["summary"]
    # every method of the tiny setup ran (lookahead only once specref.lookahead exists)
    expected = set(ALL_METHODS) - {"lookahead", "ar_fp32"}  # ar, hf, ngram, draft, eagle, eagle2, eagle3, ... hf_assist
    assert expected <= set(summ) and set(summ) | set(res["meta"]["skipped"]) == set(ALL_METHODS)
    assert set(summ["ar"]["per_category"]) == {"writing", "summarization", "coding"}
    for name, s in summ.items():
        recs = res["records"][name]
        assert len(recs) == 3 and all(r["n"] == len(r["tokens"]) for r in recs)
        assert s["overall"]["tokens"] == sum(r["n"] for r in recs)
        assert s["overall"]["tau"] >= 1.0 - 1e-9  # every forward emits at least one token
        if res["meta"]["specref"][name]:  # specref greedy methods reproduce the baseline exactly
            assert s["overall"]["identical"] is True, name
    assert summ["ar"]["overall"]["identical"] is True and summ["ar"]["overall"]["tau"] == 1.0
    assert summ["draft"]["overall"]["alpha"] is not None and summ["draft"]["overall"]["k"] > 0
    assert all(0.0 <= a <= 1.0 for a in summ["ngram"]["overall"]["acceptance_per_position"] or [])


def test_bad_arguments(qfile):
    with pytest.raises(ValueError, match="unknown methods"):
        bench_main(["--model", "tiny", "--question-file", str(qfile), "--methods", "medusa9"])
    with pytest.raises(ValueError, match="--questions"):
        bench_main(["--model", "tiny", "--question-file", str(qfile), "--questions", "zero"])
    with pytest.raises(ValueError, match="--weights does not apply"):
        bench_main(["--model", "tiny", "--question-file", str(qfile), "--weights", f"eagle={qfile}"])
    with pytest.raises(SystemExit):  # argparse: KIND=PATH with an existing file
        bench_main(["--question-file", str(qfile), "--weights", "eagle=/no/such/file"])


def test_batch_bench_end_to_end(qfile, tmp_path):
    # batch sizes 1, 2 and 4 over 4 ragged prompts: every specref method reproduces the baseline's
    # rows at every batch size; the batch-1-only transformers methods are skipped for B > 1
    out, md = tmp_path / "out", tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n" + OTHER, encoding="utf-8")
    rc = bench_main(["--model", "tiny", "--question-file", str(qfile), "--questions", "all",
                     "--methods", "ar", "hf", "ngram", "draft", "hf_pld", "--batch-size", "1", "2", "4",
                     "--max-new-tokens", "12", "--out", str(out), "--markdown", str(md), "--no-progress", "--refill"])
    assert rc == 0
    res = json.loads((out / "batch" / "batch.json").read_text())
    assert list(res["queues"]) == ["2", "4"]
    for B, per in res["queues"].items():  # every question as one queue: greedy rows identical to ar's
        for name in ("ar", "ngram", "draft"):
            for refill in ("batch", "row"):
                rec = per[f"{name}/{refill}"]
                assert rec["identical"] is True and rec["tokens"] == 4 * 12, (B, name, refill)
                assert rec["ttft"] > 0 and rec["tpot"] > 0 and rec["dec_tok_s"] >= rec["tok_s"]
            assert per[f"{name}/row"]["idle"] == 0.0  # no row idles while questions wait
    assert res["rows"]["4"]["ar"]["ttft"] > 0 and res["rows"]["4"]["ar"]["dec_tok_s"] > 0
    assert list(res["rows"]) == ["1", "2", "4"]
    assert "hf_pld" in res["rows"]["1"] and "hf_pld" not in res["rows"]["4"]
    for B, per in res["rows"].items():
        assert per["ar"]["tokens"] == 4 * 12  # no eos in the tiny model: every row runs to the budget
        for name in ("ngram", "draft"):
            assert per[name]["identical"] is True, (B, name)
            assert per[name]["tokens"] == per["ar"]["tokens"]
        assert 0.0 <= per["ar"]["idle"] < 1.0
    text = md.read_text()
    assert OTHER in text and "## Batch size" in text and "| 4 | specref n-gram" in text and "| refill |" in text
    with pytest.raises(ValueError, match="batch-size"):
        bench_main(["--model", "tiny", "--question-file", str(qfile), "--batch-size", "4", "2"])


def test_low_precision_run_against_float32(qfile, tmp_path):
    """--dtype bfloat16 (--attn eager) with ar_fp32: the float32 copy runs as a method (not a
    specref method: its greedy output may differ), each ratio is also given against it; ar_fp32 is
    skipped (with its reason) in a float32 run."""
    out = tmp_path / "out"
    rc = bench_main(["--model", "tiny", "--dtype", "bfloat16", "--attn", "eager", "--methods", "ar", "ar_fp32",
                     "ngram", "--question-file", str(qfile), "--questions", "1", "--max-new-tokens", "24",
                     "--out", str(out), "--markdown", "none", "--no-progress"])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert set(res["summary"]) == {"ar", "ar_fp32", "ngram"} and not res["meta"]["specref"]["ar_fp32"]
    assert res["meta"]["config"]["attn"] == "eager"
    for name, recs in res["records"].items():
        for r in recs:  # None where identical, else the index of the first token that differs
            assert (r["first_diff"] is None) == r["identical"]
            if not r["identical"]:
                base = next(b for b in res["records"]["ar"] if b["question_id"] == r["question_id"])
                i = r["first_diff"]
                assert r["tokens"][:i] == base["tokens"][:i] and r["tokens"][i:i + 1] != base["tokens"][i:i + 1]
    assert "| vs float32 ar |" in overall_table(res)
    rc = bench_main(["--model", "tiny", "--methods", "ar", "ar_fp32", "--question-file", str(qfile),
                     "--questions", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "o2"),
                     "--markdown", "none", "--no-progress"])
    res = json.loads((tmp_path / "o2" / "bench.json").read_text())
    assert rc == 0 and "ar_fp32" in res["meta"]["skipped"] and set(res["summary"]) == {"ar"}


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1  # the second token differs
    assert first_difference([7], [1, 2]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early (eos): at the shorter's end


def test_batch_bench_runs_auto(qfile, tmp_path):
    """`auto` (picker/auto.py) as a bench method at B = 1 and 2, as queues too, with repeats: greedy
    rows identical to ar's, each row naming the pick among the other methods named."""
    out = tmp_path / "out"
    rc = bench_main(["--model", "tiny", "--question-file", str(qfile), "--questions", "all",
                     "--methods", "ar", "auto", "ngram", "--batch-size", "1", "2", "--repeats", "2",
                     "--max-new-tokens", "8", "--out", str(out), "--markdown", "none", "--no-progress", "--refill"])
    assert rc == 0
    res = json.loads((out / "batch" / "batch.json").read_text())
    assert res["meta"]["repeats"] == 2
    for B, per in res["rows"].items():
        assert per["auto"]["identical"] is True and per["auto"]["pick"] in ("ar", "ngram"), B
        assert len(per["auto"]["repeats"]) == 2 and per["auto"]["tok_s"] > 0
    rec = res["queues"]["2"]["auto/row"]
    assert rec["identical"] is True and rec["idle"] == 0.0 and rec["pick"] in ("ar", "ngram")
    with pytest.raises(ValueError, match="repeats"):
        bench_main(["--model", "tiny", "--question-file", str(qfile), "--repeats", "0"])
