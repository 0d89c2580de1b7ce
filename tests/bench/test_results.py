"""The results document (specref/bench/results.py) rendered from a hand-made bench JSON: no timed run."""
import json

import pytest

from specref.bench import results
from specref.registry import METHODS


def _stats(speedup, tau):
    return dict(questions=2, tokens=100, tok_s=10.0 * speedup, speedup=speedup, tau=tau, identical=True,
                identical_count=2, first_diff=[], peak_mb=100.0, alpha=None, k=None, c=None, v=None,
                predicted=None, acceptance_per_position=None, draft_fraction=None)


def _result(methods, date="2026-01-02 03:04:05 UTC"):
    summ = {m: {"overall": _stats(1.0 + i / 10, 1.0 + i / 5),
                "per_category": {c: _stats(1.0 + i / 10, 1.0 + i / 5) for c in ("writing", "math")}}
            for i, m in enumerate(methods)}
    mach = dict(platform="p", cpu="Fake CPU 9000", cores=4, threads=4, gpu=None, python="3", torch="t",
                transformers="tf", load_avg_start=None, load_avg_end=None)
    cfg = dict(dtype="float32", device="cpu", max_new_tokens=16, temperature=0.0, questions=1, compile=False)
    meta = dict(command="python -m specref bench", date=date, model="fake model", question_file="q.jsonl",
                config=cfg, skipped={}, num_questions=2, machine=mach, labels={m: f"label {m}" for m in methods},
                commit="abc1234")
    return dict(meta=meta, summary=summ)


def _batch():
    meta = dict(command="python -m specref bench --batch-size 1 4", date="d", model="fake model", sizes=[1, 4],
                questions=2, max_new_tokens=16, skipped={}, threads=4, duration_s=60.0, load_avg=None)
    rec = dict(label="ar", tok_s=5.0, speedup=1.0, vs_ar_b1=1.0, idle=None, identical=None)
    return dict(meta=meta, rows={"1": {"ar": rec}, "4": {"ar": dict(rec, tok_s=15.0, vs_ar_b1=3.0)}})


def test_results_document_and_readme_table(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(results, "METHODS", dict(METHODS, brand_new="a method added to the registry"))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result(["ar", "ngram", "eagle", "brand_new"])), encoding="utf-8")
    b.write_text(json.dumps(_result(["ar", "mtp", "eagle"], date="2025-05-05 05:05:05 UTC")), encoding="utf-8")
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps(_batch()), encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n\n{results.METHODS_START}\nold table\n{results.METHODS_END}\n\n## after\n", encoding="utf-8")
    out = tmp_path / "BENCHMARKS.md"
    assert results.main(["--from-json", str(a), str(b), "--batch-json", str(batch), "--out", str(out),
                         "--readme", str(readme), "--bench-dir", str(tmp_path / "plots")]) == 0
    doc = out.read_text(encoding="utf-8")
    assert "Fake CPU 9000" in doc and "commit abc1234" in doc and "python -m specref.bench.results" in doc
    assert "label brand_new" in doc and "label mtp" in doc and "## Batch size" in doc
    assert "| 4 | ar | 15.0 |" in doc
    assert "![speed-up and tau" in doc and (tmp_path / "plots" / "bench.png").exists()
    assert "![overall speed-up" in doc and (tmp_path / "plots" / "overall.png").exists()
    text = readme.read_text(encoding="utf-8")
    assert "old table" not in text and text.startswith("# top") and text.endswith("## after\n")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert list(rows) == [f"`{m}`" for m in results.METHODS]  # every registry method, registry order
    assert "1.20x [1]" in rows["`eagle`"]  # the first file that measured it
    assert "1.10x [2]" in rows["`mtp`"] and "not in this run" in rows["`lookahead`"]
    assert "a method added to the registry" in rows["`brand_new`"]


def test_batch_runs_one_per_b_merge_into_one_table():
    """merge_batch_runs: the rows of runs at different B in B order, 'vs ar B=1' from the B = 1 run,
    the durations summed; runs of other settings are refused."""
    from specref.bench.batch import batch_markdown, merge_batch_runs

    b1, b4 = _batch(), _batch()
    b1["rows"] = {"1": b1["rows"]["1"]}
    b4["rows"] = {"4": dict(b4["rows"]["4"])}
    b4["rows"]["4"]["ar"] = dict(b4["rows"]["4"]["ar"], vs_ar_b1=None)
    b4["meta"] = dict(b4["meta"], command="python -m specref bench --batch-size 4", date="e")
    b4["queues"] = {"4": {}}
    m = merge_batch_runs([b4, b1])
    assert list(m["rows"]) == ["1", "4"] and m["meta"]["sizes"] == [1, 4] and m["meta"]["duration_s"] == 120.0
    assert m["rows"]["4"]["ar"]["vs_ar_b1"] == 3.0 and "--batch-size 4; " in m["meta"]["command"]
    assert "| 4 | ar | 15.0 |" in batch_markdown(m)
    with pytest.raises(ValueError, match="questions"):
        merge_batch_runs([b1, dict(b4, meta=dict(b4["meta"], questions=3))])


def test_readme_without_block_is_an_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no block\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no <!-- methods:start -->"):
        results.splice_readme(readme, "table")


def test_the_run_covers_every_registry_method(tmp_path, monkeypatch):
    """The timed run (not run here: bench_main is replaced) passes every registry method to the bench
    and to the batch bench, then renders what the bench wrote."""
    pytest.importorskip("matplotlib")
    from specref.bench import runner

    calls = []

    def fake_bench(argv):
        calls.append(argv)
        out = tmp_path / "plots"
        methods = argv[argv.index("--methods") + 1:argv.index("--batch-size" if "--batch-size" in argv else "--questions")]
        if "--batch-size" in argv:
            (out / "batch").mkdir(parents=True, exist_ok=True)
            (out / "batch" / "batch.json").write_text(json.dumps(_batch()), encoding="utf-8")
        else:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench.json").write_text(json.dumps(_result(methods)), encoding="utf-8")
        return 0

    monkeypatch.setattr(runner, "bench_main", fake_bench)
    monkeypatch.setattr(results, "METHODS", dict(METHODS, brand_new="a method added to the registry"))
    readme = tmp_path / "README.md"
    readme.write_text(f"{results.METHODS_START}\n{results.METHODS_END}\n", encoding="utf-8")
    args = ["--out", str(tmp_path / "B.md"), "--readme", str(readme), "--bench-dir", str(tmp_path / "plots")]
    monkeypatch.delenv("SPECREF_SPEC_BENCH", raising=False)
    with pytest.raises(ValueError, match="Spec-Bench"):  # the results are Spec-Bench's: never the default workload
        results.main(args)
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"]}) + "\n", encoding="utf-8")
    monkeypatch.setenv("SPECREF_SPEC_BENCH", str(q))
    assert results.main(args) == 0
    single, batch = calls
    assert single[single.index("--question-file") + 1] == str(q) == batch[batch.index("--question-file") + 1]
    assert set(results.METHODS) | {"hf", "hf_pld", "hf_assist"} <= set(single)
    assert set(results.METHODS) <= set(batch) and batch[batch.index("--batch-size") + 1:][:3] == ["1", "4", "16"]
    assert "brand_new" in readme.read_text(encoding="utf-8") and "not in this run" not in readme.read_text(encoding="utf-8")
