"""`python -m specref bench --pick` (bench/picker_check.py): the picker's predictions beside the bench's
measurements in one run, on a tiny random model (no timing is asserted: only that every number is
produced and consistent); Spearman against scipy's definition on known ranks."""
from __future__ import annotations

import json

import pytest

from specref.bench.picker_check import GROUPS, spearman
from specref.bench.runner import bench_main

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a short poem about the sea."]},
    {"question_id": 2, "category": "rag", "turns": ["Answer from the text: the cat sat on the mat. Where is the cat?"]},
    {"question_id": 3, "category": "translation", "turns": ["Translate: the cat sat on the mat."]},
]


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        spearman([1], [1])
    assert sum(len(c) for c in GROUPS.values()) == 13  # Spec-Bench's 13 categories, once each


def test_bench_pick_end_to_end(tmp_path):
    qfile = tmp_path / "question.jsonl"
    qfile.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    out = tmp_path / "out"
    rc = bench_main(["--model", "tiny", "--question-file", str(qfile), "--methods", "ar", "ngram", "eagle",
                     "hybrid", "--max-new-tokens", "16", "--pick", "--pick-tokens", "12", "--out", str(out),
                     "--markdown", "none", "--no-progress"])
    assert rc == 0
    res = json.loads((out / "picker.json").read_text())
    cmp = res["compare"]
    assert cmp["categories"] == 3 and 0 <= cmp["picks_within"] <= 3
    assert set(cmp["groups"]) == {"multi-turn conversation", "rag", "translation"}
    assert all(-1.0 <= g["spearman"] <= 1.0 for g in cmp["groups"].values())
    assert -1.0 <= cmp["spearman"] <= 1.0
    assert "Spearman of the methods over the workload" in (out / "picker.md").read_text()
    assert set(cmp["overall"]["predicted"]) == {"ar", "ngram", "eagle", "hybrid"}
    assert cmp["median_abs_error"] >= 0 and res["calibration_s"] > 0
    for c, r in cmp["per_category"].items():
        assert r["pick"] in r["measured"] and r["best"] == max(r["measured"], key=r["measured"].get)
    md = (out / "picker.md").read_text()
    assert "Spearman" in md and "median |predicted / measured - 1|" in md
    assert "Calibrated on 3 of 3 prompts (the benched prompts; 3 categories" in md
    assert [r["question_id"] for r in res["sample"]] and res["pick_from"] == "benched" and res["budget_s"] is None
    assert (out / "picker.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_pick_from_workload(tmp_path):
    """--pick-from workload: the picker samples EVERY prompt of the file (here 2 per category, of which
    the bench runs 1), stratified by category within the automatic budget, as `specref pick` would."""
    rows = QUESTIONS + [dict(q, question_id=q["question_id"] + 10, turns=[q["turns"][0] + " Be brief."])
                        for q in QUESTIONS]
    qfile = tmp_path / "question.jsonl"
    qfile.write_text("".join(json.dumps(q) + "\n" for q in rows), encoding="utf-8")
    out = tmp_path / "out"
    rc = bench_main(["--model", "tiny", "--question-file", str(qfile), "--methods", "ar", "ngram", "eagle",
                     "--questions", "1", "--max-new-tokens", "16", "--pick", "--pick-tokens", "12",
                     "--pick-from", "workload", "--out", str(out), "--markdown", "none", "--no-progress"])
    assert rc == 0
    res = json.loads((out / "picker.json").read_text())
    assert res["pick_from"] == "workload" and res["prompts_given"] == 6 and res["budget_s"] >= 30.0
    assert {r["category"] for r in res["sample"]} == {"writing", "rag", "translation"}  # every category seen
    assert {r["question_id"] for r in res["sample"]} <= {1, 2, 3, 11, 12, 13}
    assert res["compare"]["categories"] == 3 and -1.0 <= res["compare"]["spearman"] <= 1.0
    bench = json.loads((out / "bench.json").read_text())
    assert bench["meta"]["num_questions"] == 3


@pytest.mark.parametrize("run", ["specref_workload_benched", "specref_workload_sampled", "spec_bench_dev_benched",
                                 "spec_bench_dev_sampled"])
def test_committed_picker_runs_meet_the_bar(run):
    """The committed `bench --pick` runs (benchmarks/picker_workloads/, two workloads x two runs),
    recomputed from their calibration records by this predict(): Spearman of the methods >= 0.8 and
    median |predicted / measured - 1| <= 10% on each; a change to the prediction that loses it fails here."""
    from pathlib import Path

    from specref.bench.picker_check import recompare

    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "picker_workloads" / run
    cmp = recompare(folder)["compare"]
    assert cmp["spearman"] >= 0.8 and cmp["median_abs_error"] <= 0.10
    assert cmp["categories"] == 13 and set(cmp["overall"]["predicted"]) == {
        "ar", "ngram", "eagle", "eagle2", "eagle3_tree", "medusa", "mtp", "hybrid", "hybrid_eagle2"}
