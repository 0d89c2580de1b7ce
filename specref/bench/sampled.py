"""The sampled table of BENCHMARKS.md: seeded bench runs at T > 0, one per (verification rule,
seed), side by side: tau and speed-up per method and rule as the mean over seeds with their spread
(max - min), and the acceptance per draft position (mean over seeds).

Input: bench.json files of `python -m specref bench --temperature T --seed S --verify RULE` (the
summary and meta are read; `compact` writes a copy without the per-question records, which is what
benchmarks/sampled/ holds). A rule raises a method's tau beyond noise when its mean gain exceeds the
larger of the two rules' spreads over the seeds; the table says which.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, Tuple


def compact(src: Path, dst: Path) -> None:
    """bench.json without its per-question records (meta and summary only)."""
    d = json.loads(Path(src).read_text(encoding="utf-8"))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps({"meta": d["meta"], "summary": d["summary"]}, indent=1) + "\n", encoding="utf-8")


def _rule(meta: dict, method: str) -> str:
    """The rule `method` ran under (the bench records it per method: ar and methods that cannot take
    the run's rule ran token-wise)."""
    per = meta.get("verify")
    return str(per.get(method, "tokenwise") if isinstance(per, dict) else meta["config"].get("verify", "tokenwise"))


def collect(paths: List[Path]) -> Tuple[Dict[Tuple[str, str], List[dict]], dict]:
    """{(method, rule): [overall summary per seed]} and the first run's meta; ValueError if the runs
    differ in temperature, tokens or questions."""
    out: Dict[Tuple[str, str], List[dict]] = {}
    first = None
    for p in paths:
        d = json.loads(Path(p).read_text(encoding="utf-8"))
        meta = d["meta"]
        key = (meta["config"]["temperature"], meta["config"]["max_new_tokens"], meta["num_questions"])
        if first is None:
            first = (key, meta)
        elif key != first[0]:
            raise ValueError(f"{p}: temperature, tokens or questions {key} differ from the first run's {first[0]}")
        for method, s in d["summary"].items():
            out.setdefault((method, _rule(meta, method)), []).append(s["overall"])
    if first is None:
        raise ValueError("no sampled runs given")
    return out, first[1]


def _spread(xs: List[float]) -> float:
    return max(xs) - min(xs) if xs else 0.0


def sampled_markdown(paths: List[Path], names: List[str]) -> str:
    """The section: its runs named (names[i] for paths[i]), the table, and the verdict per method."""
    runs, meta = collect(paths)
    cfg = meta["config"]
    rules = sorted({r for _, r in runs}, key=lambda r: ("tokenwise", "block", "traversal").index(r))
    methods = list(dict.fromkeys(m for m, _ in runs))
    seeds = len({json.loads(Path(p).read_text(encoding="utf-8"))["meta"]["config"]["seed"] for p in paths})
    lines = [f"## Sampled (temperature {cfg['temperature']}): verification rules side by side", "",
             f"{meta['num_questions']} questions, {cfg['max_new_tokens']} new tokens, {seeds} seeds per rule; each "
             "run its own `python -m specref bench --temperature T --seed S --verify RULE`; mean over seeds, spread = "
             "max - min. Sources: "
             + ", ".join(f"`{n}`" for n in names) + ".", "",
             "| method | rule | tau (mean) | tau spread | speed-up (mean) | speed-up spread | acceptance per position |",
             "|---|---|---|---|---|---|---|"]
    verdict = []
    for m in methods:
        for r in rules:
            xs = runs.get((m, r))
            if not xs:
                continue
            tau, sp = [x["tau"] for x in xs], [x["speedup"] for x in xs]
            acc = [x.get("acceptance_per_position") or [] for x in xs]
            L = max(len(a) for a in acc)
            mean_acc = [statistics.mean([a[i] for a in acc if len(a) > i]) for i in range(L)]
            lines.append(f"| {m} | {r} | {statistics.mean(tau):.3f} | {_spread(tau):.3f} | "
                         f"{statistics.mean(sp):.2f}x | {_spread(sp):.2f} | "
                         + (", ".join(f"{a:.2f}" for a in mean_acc) or "-") + " |")
        base = runs.get((m, "tokenwise"))
        for r in rules:
            other = runs.get((m, r))
            if r == "tokenwise" or not base or not other:
                continue
            t0, t1 = [x["tau"] for x in base], [x["tau"] for x in other]
            gain, noise = statistics.mean(t1) - statistics.mean(t0), max(_spread(t0), _spread(t1))
            verdict.append(f"- {m}: {r} - tokenwise tau {gain:+.3f}, spread {noise:.3f}: "
                           + ("beyond the spread" if gain > noise else "within the spread"))
    return "\n".join(lines + [""] + verdict) + "\n"
