"""The workload shipped with specref (specref/data/workload.jsonl; workloads.py): what the bench runs
when no Spec-Bench file is given. It is labelled as such, matches its manifest, and shares no word
13-gram with the training corpus, the training prompts or (when given) the development split."""
import json
import lzma
from pathlib import Path

import pytest

from specref import workloads
from specref.bench.runner import load_questions
from specref.training.corpus import eval_files, word_ngrams

REPO = Path(__file__).resolve().parents[1]


def test_the_default_workload_matches_its_manifest():
    man = workloads.manifest()
    rows = [json.loads(line) for line in open(workloads.DEFAULT_WORKLOAD, encoding="utf-8")]
    assert man["sha256"] == workloads.sha256_of(workloads.DEFAULT_WORKLOAD) and man["rows"] == len(rows)
    cats = {r["category"] for r in rows}
    assert len(cats) == 13 and man["categories"] == {c: sum(r["category"] == c for r in rows) for c in cats}
    assert all(s["licence"] and s["from"] for s in man["quoted_sources"]) and "NOT Spec-Bench" in man["what"]
    assert len(load_questions(workloads.DEFAULT_WORKLOAD, None, 1)) == 13


def test_the_bench_falls_back_to_it_and_says_so(monkeypatch, tmp_path):
    monkeypatch.delenv(workloads.SPEC_BENCH_ENV, raising=False)
    assert workloads.question_file() == workloads.DEFAULT_WORKLOAD
    desc = workloads.describe(workloads.question_file())
    assert desc["name"] == "specref-workload" and desc["default"] and "NOT Spec-Bench" in workloads.label(desc)
    with pytest.raises(ValueError, match="hemingkx/Spec-Bench"):  # asked for Spec-Bench, none given
        workloads.spec_bench_file()
    with pytest.raises(ValueError, match="does not exist.*Spec-Bench"):
        workloads.spec_bench_file(str(tmp_path / "missing.jsonl"))
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"]}) + "\n")
    monkeypatch.setenv(workloads.SPEC_BENCH_ENV, str(tmp_path))  # a folder holding question.jsonl
    assert workloads.question_file() == q and workloads.describe(q)["name"] == "question.jsonl"


def _grams(texts):
    out = set()
    for t in texts:
        out |= word_ngrams(t)
    return out


def test_the_workload_shares_no_13_gram_with_training_text():
    wl = _grams(json.loads(line)["turns"][0] for line in open(workloads.DEFAULT_WORKLOAD, encoding="utf-8"))
    instr = [json.dumps(json.loads(line)) for line in open(REPO / "specref" / "data" / "instructions.jsonl")]
    requests = []
    for p in sorted((REPO / "corpus" / "parts").glob("*/requests.jsonl.xz")):
        requests += [json.loads(line)["instruction"] for line in lzma.decompress(p.read_bytes()).decode().splitlines()
                     if line.strip()]
    assert requests and wl.isdisjoint(_grams(instr)) and wl.isdisjoint(_grams(requests))


def test_the_workload_shares_no_13_gram_with_the_development_split():
    dev = eval_files()
    if not dev:
        pytest.skip("no development questions: set SPECREF_SPEC_BENCH to Spec-Bench's question.jsonl")
    wl = _grams(json.loads(line)["turns"][0] for line in open(workloads.DEFAULT_WORKLOAD, encoding="utf-8"))
    turns = [t for line in open(dev[0], encoding="utf-8") if line.strip() for t in json.loads(line)["turns"]]
    assert wl.isdisjoint(_grams(turns))
