"""The results document: BENCHMARKS.md and the README's methods table from ONE bench run.

    SPECREF_SPEC_BENCH=PATH/TO/question.jsonl python -m specref.bench.results --out BENCHMARKS.md --readme README.md

runs the bench (runner.py) over every method of specref/registry.py's METHODS (a new method joins
by itself) plus transformers' baselines, then the batch bench (batch.py) at the batch sizes given,
and writes: the JSON and plots under benchmarks/results/, BENCHMARKS.md (a header naming the
machine, commit and date, how it was measured, the tables, the plots) and the methods table of
README.md (between METHODS_START and METHODS_END; the rest of the README is left alone). It is a
timed run: make it on a quiet machine, and again whenever the trained weights change.

`--batch-json X.json` renders a committed batch run (its command and date shown) instead of running
the batch bench. `--from-json A.json [B.json ...]` skips the run and renders committed bench
JSON files instead: a method takes its row from the first file that measured it, and every table
names the file (and the commit that added it) each row comes from.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..registry import METHODS
from .batch import batch_markdown
from .report import _category_table, overall_table, plot

REPO = Path(__file__).resolve().parents[2]
METHODS_START, METHODS_END = "<!-- methods:start -->", "<!-- methods:end -->"
BASELINES = {"hf": "transformers `generate`", "hf_pld": "transformers prompt lookup",
             "hf_assist": "transformers assisted generation (the trained draft)"}

# name -> (paper, class, lossless, notebook); a registry method missing here still gets its row
INFO: Dict[str, Tuple[str, str, str, str]] = {
    "ar": ("-", "`autoregressive_generate`", "exact", "02"),
    "ngram": ("Saxena 2023 (prompt lookup)", "`NgramProposer`", "lossless", "06"),
    "lookahead": ("Fu et al. 2024", "`LookaheadProposer`", "lossless", "06"),
    "draft": ("Leviathan et al. 2023; Chen et al. 2023", "`DraftModelProposer`", "lossless", "05"),
    "eagle": ("Li et al. 2024 (EAGLE)", "`EagleProposer`", "lossless", "11"),
    "eagle2": ("Li et al. 2024 (EAGLE-2)", "`Eagle2Proposer`", "lossless", "11"),
    "eagle2_sampled": ("EAGLE-2 tree, siblings without replacement (for Weng et al. 2025)", "`Eagle2SampledProposer`",
                       "lossless", "-"),
    "eagle3": ("Li et al. 2025 (EAGLE-3)", "`EagleProposer` + `Eagle3Head`", "lossless", "11"),
    "eagle3_tree": ("Li et al. 2025 (EAGLE-3), EAGLE-2 tree", "`Eagle2Proposer`", "lossless", "11"),
    "hybrid": ("prompt lookup + EAGLE", "`HybridProposer`", "lossless", "10"),
    "hybrid_tree": ("prompt lookup + EAGLE, one tree", "`HybridProposer`", "lossless", "10"),
    "hybrid_draft": ("prompt lookup + draft model", "`HybridProposer`", "lossless", "10"),
    "hybrid_eagle2": ("prompt lookup + EAGLE-2", "`HybridProposer`", "lossless", "10"),
    "hybrid_eagle3": ("prompt lookup + EAGLE-3", "`HybridProposer`", "lossless", "10"),
    "medusa": ("Cai et al. 2024 (Medusa)", "`MedusaProposer`", "lossless", "09"),
    "medusa_typical": ("Cai et al. 2024 (typical acceptance)", "`MedusaProposer`", "**lossy** at T > 0", "09"),
    "hybrid_medusa": ("prompt lookup + Medusa", "`HybridProposer`", "lossless", "09"),
    "hydra": ("Ankner et al. 2024 (Hydra)", "`MedusaProposer`", "lossless", "09"),
    "hybrid_hydra": ("prompt lookup + Hydra", "`HybridProposer`", "lossless", "09"),
    "mtp": ("Gloeckle et al. 2024; DeepSeek-V3 (MTP)", "`MTPProposer`", "lossless", "11"),
    "mlp_speculator": ("Wertheimer et al. 2024 (MLP speculator)", "`MLPSpeculatorProposer`", "lossless", "-"),
    "hybrid_mlp_speculator": ("prompt lookup + MLP speculator", "`HybridProposer`", "lossless", "-"),
    "suffix": ("Oliaro et al. 2025 (SuffixDecoding)", "`SuffixProposer`", "lossless", "-"),
    "suffix_tree": ("Oliaro et al. 2025 (SuffixDecoding), tree", "`SuffixProposer`", "lossless", "-"),
    "hybrid_suffix": ("SuffixDecoding + EAGLE (ArcticInference's rule)", "`HybridProposer`", "lossless", "-"),
}


def bench_methods() -> List[str]:
    """Every registry method, then transformers' baselines (the bench's order)."""
    return list(METHODS) + [m for m in BASELINES if m not in METHODS]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_runs(paths: List[Path], commit: Optional[str] = None) -> List[dict]:
    """Each JSON as {"path", "commit", "result"}; commit: the one given (a fresh run: HEAD), the one
    the JSON records, or the commit that last added or changed the file."""
    runs = []
    for p in paths:
        result = json.loads(Path(p).read_text(encoding="utf-8"))
        commit = commit or result["meta"].get("commit") or _git(
            "log", "-1", "--diff-filter=AM", "--format=%h", "--", str(p))
        runs.append(dict(path=Path(p), commit=commit or "uncommitted", result=result))
    turns = {r["result"]["meta"]["config"].get("turns", 1) for r in runs}
    if turns - {1}:  # this document is the first turns' (a second-turn run has its own bench --markdown section)
        raise ValueError("the results document renders first-turn runs only; a --turns 2 run writes its own "
                         "section with `python -m specref bench --turns 2 ... --markdown FILE`")
    return runs


def merge(runs: List[dict]) -> Tuple[dict, Dict[str, int]]:
    """One result whose summary holds, per method (registry order), the row of the first run that
    measured it; and {method: index of its run}. Methods no run measured are left out."""
    summary, labels, source = {}, {}, {}
    for m in ["ar"] + [m for m in bench_methods() if m != "ar"]:
        for i, run in enumerate(runs):
            if m in run["result"]["summary"]:
                summary[m], source[m] = run["result"]["summary"][m], i
                labels[m] = run["result"]["meta"]["labels"].get(m, m)
                break
    meta = dict(runs[0]["result"]["meta"], labels=labels)
    return dict(meta=meta, summary=summary), source


def _rel(p: Path, base: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(base.resolve()))
    except ValueError:
        return Path(p).name


def _sources(runs: List[dict], source: Dict[str, int]) -> List[str]:
    out = []
    for i, run in enumerate(runs):
        meth = [m for m, j in source.items() if j == i]
        if meth:
            meta = run["result"]["meta"]
            out.append(f"[{i + 1}] `{_rel(run['path'], REPO)}` (commit {run['commit']}, {meta['date']}, "
                       f"{meta['num_questions']} questions, temperature {meta['config']['temperature']}): "
                       + ", ".join(meth))
    return out


def methods_table(runs: List[dict]) -> str:
    """The README's methods table: method, paper, class, lossless, speed-up and tau, notebook."""
    merged, source = merge(runs)
    mark = len(runs) > 1
    lines = [METHODS_START, "| method | paper | class | lossless | speed-up | tau | notebook |",
             "|---|---|---|---|---|---|---|"]
    for m in [m for m in METHODS] + [m for m in BASELINES]:
        paper, cls, loss, nb = INFO.get(m, (METHODS.get(m, m), "-", "-", "-"))
        if m in BASELINES and m not in merged["summary"]:
            continue
        if m in merged["summary"]:
            o = merged["summary"][m]["overall"]
            sp, tau = f"{o['speedup']:.2f}x", f"{o['tau']:.2f}"
            sp += f" [{source[m] + 1}]" if mark else ""
        else:
            sp, tau = "not in this run", "-"
        if m in BASELINES:
            paper, cls, loss, nb = BASELINES[m], "-", "exact", "-"
        lines.append(f"| `{m}` | {paper} | {cls} | {loss} | {sp} | {tau} | {nb} |")
    lines += ["", "Speed-up: geometric mean over questions of tokens/s against `ar` in the same run; tau: tokens "
              "per target forward. From: " + "; ".join(_sources(runs, source)) + ".", METHODS_END]
    return "\n".join(lines)


def benchmarks_markdown(runs: List[dict], batch: Optional[dict], png: Optional[str], commit: str, date: str,
                        overall_png: Optional[str] = None, batch_file: Optional[str] = None,
                        sampled: Optional[str] = None) -> str:
    """The whole BENCHMARKS.md."""
    merged, source = merge(runs)
    meta, mach, cfg = merged["meta"], merged["meta"]["machine"], merged["meta"]["config"]
    gpu = f", GPU {mach['gpu']}" if mach.get("gpu") else ""
    parts = ["# Benchmarks", "",
             "Every method of `specref/registry.py` on the development split of Spec-Bench, regenerated by "
             "one command (a timed run: on a quiet machine, and again whenever the trained weights change):", "",
             "```bash", "SPECREF_SPEC_BENCH=PATH/TO/spec_bench/question.jsonl \\",
             "    python -m specref.bench.results --out BENCHMARKS.md --readme README.md", "```", "",
             f"- Written {date} at commit {commit}.",
             f"- Machine: {mach['cpu']}, {mach['cores']} cores, torch threads {mach['threads']}{gpu}; "
             f"Python {mach['python']}, torch {mach['torch']}, transformers {mach['transformers']}.",
             f"- Model: {meta['model']}, {cfg['dtype']}, device {cfg['device']}; {cfg['max_new_tokens']} new "
             f"tokens; temperature {cfg['temperature']}; first turn of each question through the chat template.",
             "- Measured: every method runs on a question before any runs on the next (order rotated per "
             "question), after one untimed warm-up call each; speed-up is the geometric mean over questions of "
             "tokens/s over `ar` on the same question; tau is tokens per target forward. Definitions of alpha, "
             "k, c, v and the prediction: `specref/bench/report.py`.",
             "- Sources: " + "; ".join(_sources(runs, source)) + ".",
             "- The experiments behind these numbers, and older results: [docs/experiments/](docs/experiments/README.md).",
             "", "## Overall", ""]
    if overall_png:
        parts += [f"![overall speed-up and tau per method]({overall_png})", ""]
    parts += [overall_table(merged), "",
             "## Speed-up over `ar` per category", "", _category_table(merged, "speedup", "{:.2f}x"), "",
             "## Tokens per target forward (tau) per category", "", _category_table(merged, "tau", "{:.2f}"), ""]
    if png:
        parts += [f"![speed-up and tau per method and category]({png})", ""]
    if batch is not None:
        if batch_file:
            parts += [f"The batch table below is earlier committed run(s), `{batch_file}`, rendered with "
                      "`--batch-json`; its command and date are stated with it.", ""]
        parts += ["\n".join(line for line in batch_markdown(batch).splitlines() if not line.startswith("<!--")), ""]
    if sampled:
        parts += [sampled]
    return "\n".join(parts)


def plot_overall(result: dict, png: Path) -> None:
    """One horizontal bar per method: the overall speed-up over `ar`, tau written beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])[::-1]
    o = [result["summary"][m]["overall"] for m in names]
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(names) + 1))
    ax.barh(names, [x["speedup"] for x in o], color=["tab:gray" if m in BASELINES else "tab:blue" for m in names])
    for i, x in enumerate(o):
        ax.text(x["speedup"] + 0.02, i, f"{x['speedup']:.2f}x  tau {x['tau']:.2f}", va="center", fontsize=8)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed-up over specref autoregressive (geometric mean over questions)")
    ax.set_xlim(0, max(x["speedup"] for x in o) * 1.35)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def splice_readme(readme: Path, table: str) -> None:
    """Replace the README's METHODS_START..METHODS_END block (ValueError when it has none)."""
    text = readme.read_text(encoding="utf-8")
    if METHODS_START not in text or METHODS_END not in text:
        raise ValueError(f"{readme} has no {METHODS_START} ... {METHODS_END} block")
    i, j = text.index(METHODS_START), text.index(METHODS_END) + len(METHODS_END)
    readme.write_text(text[:i] + table + text[j:], encoding="utf-8")


def _run(a) -> Tuple[List[Path], Optional[Path]]:
    """The timed run: the bench over every method, then the batch bench; returns the JSON paths."""
    from .runner import bench_main

    from ..workloads import spec_bench_file

    out = Path(a.bench_dir)
    common = ["--max-new-tokens", str(a.max_new_tokens), "--no-progress", "--markdown", "none",
              "--question-file", str(spec_bench_file(a.question_file)),  # the results are Spec-Bench's
              "--out", str(out)] + (["--threads", str(a.threads)] if a.threads else [])
    bench_main(["--methods", *bench_methods(), "--questions", a.questions] + common)
    batch = None
    if a.batch_json:  # committed batch runs are rendered instead of a new one (their commands and dates shown)
        return [out / "bench.json"], [Path(p) for p in a.batch_json]
    if a.batch_size and a.batch_size != [1]:
        methods = a.batch_methods or list(METHODS) + ["hf"]
        bench_main(["--methods", *methods, "--batch-size", *map(str, a.batch_size),
                    "--questions", a.batch_questions] + common)
        batch = out / "batch" / "batch.json"
    return [out / "bench.json"], batch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specref.bench.results", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "BENCHMARKS.md"), help="the results document to write")
    ap.add_argument("--readme", default=str(REPO / "README.md"),
                    help="README whose methods table is replaced ('none': skip)")
    ap.add_argument("--bench-dir", default=str(REPO / "benchmarks" / "results"), help="folder of the JSON and plots")
    ap.add_argument("--question-file", default=None, help="Spec-Bench's question.jsonl (default: $SPECREF_SPEC_BENCH)")
    ap.add_argument("--questions", default="1", help="questions per category, or 'all'")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--batch-questions", default="2", help="questions per category of the batch table")
    ap.add_argument("--batch-methods", nargs="+", default=None,
                    help="methods of the batch table (default: every registry method and transformers' generate)")
    ap.add_argument("--from-json", nargs="+", default=None, help="render these bench JSON files; no run")
    ap.add_argument("--sampled-json", nargs="+", default=None,
                    help="seeded runs at T > 0 (bench.json, one per verification rule and seed; benchmarks/sampled/) "
                         "rendered as the sampled table (sampled.py)")
    ap.add_argument("--batch-json", nargs="+", default=None, help="render this batch.json (its own run, named "
                    "with its command and date) instead of running the batch bench; several: runs of one "
                    "setting at different B, merged (batch.merge_batch_runs)")
    a = ap.parse_args(argv)
    commit = _git("rev-parse", "--short", "HEAD")
    if a.from_json:
        paths, batch_path = [Path(p) for p in a.from_json], [Path(p) for p in a.batch_json] if a.batch_json else None
    else:
        paths, batch_path = _run(a)
    batch_path = [batch_path] if isinstance(batch_path, Path) else batch_path  # a new run's, or the files given
    for p in paths + (batch_path or []):
        if not p.exists():
            raise ValueError(f"bench JSON {str(p)!r} does not exist")
    runs = load_runs(paths, None if a.from_json else commit)
    batch = None
    if batch_path:
        from .batch import merge_batch_runs

        batch = [json.loads(p.read_text(encoding="utf-8")) for p in batch_path]
        batch = batch[0] if len(batch) == 1 else merge_batch_runs(batch)
    out = Path(a.out)
    png = Path(a.bench_dir) / "bench.png"
    merged, _ = merge(runs)
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(merged, png)
    plot_overall(merged, png.with_name("overall.png"))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sampled = None
    if a.sampled_json:
        from .sampled import sampled_markdown

        sampled = sampled_markdown([Path(p) for p in a.sampled_json], [_rel(Path(p), REPO) for p in a.sampled_json])
    out.write_text(benchmarks_markdown(runs, batch, _rel(png, out.parent), commit, date,
                                        _rel(png.with_name("overall.png"), out.parent),
                                        batch_file=a.batch_json and ", ".join(_rel(Path(p), REPO)
                                                                              for p in a.batch_json),
                                        sampled=sampled), encoding="utf-8")
    if a.readme != "none":
        splice_readme(Path(a.readme), methods_table(runs))
    print(f"wrote {out}, {png}" + ("" if a.readme == "none" else f", the methods table of {a.readme}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
