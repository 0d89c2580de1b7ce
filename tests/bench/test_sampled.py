"""bench/sampled.py: the sampled table of BENCHMARKS.md from seeded runs, one per rule and seed."""
import json

import pytest

from specref.bench.sampled import collect, compact, sampled_markdown


def _run(path, rule, seed, taus, temperature=0.7):
    meta = {"config": {"temperature": temperature, "max_new_tokens": 16, "seed": seed, "verify": rule},
            "num_questions": 2, "verify": {"ar": "tokenwise", "eagle": rule}}
    summary = {m: {"overall": {"tau": t, "speedup": 1.0 + t / 10, "acceptance_per_position": [t / 2, t / 4]}}
               for m, t in taus.items()}
    path.write_text(json.dumps({"meta": meta, "summary": summary, "records": {"eagle": [{"n": 1}]}}))
    return path


def test_table_and_verdicts(tmp_path):
    ps = [_run(tmp_path / f"t{s}.json", "tokenwise", s, {"ar": 1.0, "eagle": 1.5 + s / 100}) for s in range(3)]
    ps += [_run(tmp_path / f"b{s}.json", "block", s, {"ar": 1.0, "eagle": 1.6 + s / 100}) for s in range(3)]
    runs, _ = collect(ps)
    assert len(runs[("ar", "tokenwise")]) == 6 and len(runs[("eagle", "block")]) == 3  # ar never runs block
    md = sampled_markdown(ps, [p.name for p in ps])
    assert "| eagle | block | 1.610 | 0.020 |" in md and "3 seeds per rule" in md
    assert "- eagle: block - tokenwise tau +0.100, spread 0.020: beyond the spread" in md
    close = [_run(tmp_path / f"c{s}.json", "block", s, {"eagle": 1.505 + s / 100}) for s in range(3)]
    assert "within the spread" in sampled_markdown(ps[:3] + close, ["x"] * 6)
    compact(ps[0], tmp_path / "c" / "t0.json")
    assert set(json.loads((tmp_path / "c" / "t0.json").read_text())) == {"meta", "summary"}
    with pytest.raises(ValueError, match="differ from the first run"):
        collect([ps[0], _run(tmp_path / "hot.json", "block", 0, {"eagle": 1.5}, temperature=1.0)])
