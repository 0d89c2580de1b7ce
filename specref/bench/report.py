"""Numbers, tables and plot of the benchmark (runner.py): per method, per category and overall.

Definitions (Leviathan et al. 2023 symbols; runner.py's docstring says how each is measured):
  speed-up   geometric mean over questions of tok/s(method) / tok/s(ar), the same question;
  tau        tokens emitted / target forwards (the prefill of our methods emits nothing and is not
             counted; transformers' first forward is its prefill and emits the first token);
  alpha      sum_i accepted_i / sum_i reached_i, reached_0 = drafts, reached_i = min(accepted_{i-1},
             drafted_i): the per-token acceptance of the i.i.d. model (exact for fixed-length chains);
  k          mean draft length (tree: depth) of the steps that drafted; f the fraction that drafted;
  c          draft time / (drafted positions x one `ar` target forward);
  v          the method's mean verify forward / one `ar` target forward;
  predicted  ((1-f) + f E) / ((1-f) + f (1 + c k)), E = (1 - alpha^(k+1)) / (1 - alpha) (Eq. 1 and
             Theorem 3.8 with real-valued k): predicts from alpha and c alone, leaving v out.
Left out: confidence intervals (one run; re-run for spread).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Dict, List, Optional

from ..suffix_tree import NODE_BYTES

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def markers(meta: dict) -> tuple:
    """The (start, end) comments of a run's Markdown section: one section for first turns, one per
    question file and temperature for second turns (so a multi-turn run never replaces the
    single-turn tables, nor a greedy run a sampled one)."""
    if meta["config"].get("turns", 1) == 1:
        return START, END
    name = f"{meta['question_file']}:T={meta['config']['temperature']:g}"
    return f"<!-- bench-turn2:{name}:start -->", f"<!-- bench-turn2:{name}:end -->"


def _turn_note(meta: dict) -> str:
    """Which turn ran: the first, or the second after the stored greedy first answers."""
    a = meta.get("answers")
    if meta["config"].get("turns", 1) == 1 or not a:
        return "first turn through the chat template"
    return (f"second turn through the chat template: [user turn 1, the stored greedy first answer, user turn 2], "
            f"the first answers from `{a['name']}` (sha256 {a['sha256'][:12]}; {a['model']}, {a['decoding']}, "
            f"at most {a['max_new_tokens']} tokens), the same context for every method")


def suffix_notes(meta: dict) -> List[str]:
    """SuffixDecoding's global trees: how they started and how large they ended (older results: none)."""
    sc = meta.get("suffix_cache")
    if not sc:
        return []
    out = [f"- SuffixDecoding: each method's global tree started {sc['start']} (emptied after the warm-up) and saw "
           f"the requests in {sc['order']}, one request per question; at the end of the run:"]
    for name, m in sc["memory"].items():
        out.append(f"  - `{name}`: {m['nodes']:,} nodes, {m['bytes'] / 2**20:.1f} MiB (nodes x {NODE_BYTES} bytes, measured), "
                   f"{m['tokens']:,} tokens of {m['requests']} requests cached, {m['evicted']} evicted.")
    return out


def first_difference(tokens: List[int], base: List[int]) -> Optional[int]:
    """Index of the first token where a greedy output departs from the baseline's (a length
    difference counts at the shorter one's end); None if they are equal."""
    if tokens == base:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, base)) if a != b), min(len(tokens), len(base)))


def _group(recs: List[dict], base: List[dict]) -> dict:
    """Aggregate the records of one method over a set of questions (base: the ar records)."""
    rate = [r["n"] / max(r["wall"], 1e-9) for r in recs]
    ratio = [(r["n"] / max(r["wall"], 1e-9)) / max(b["n"] / max(b["wall"], 1e-9), 1e-9)
             for r, b in zip(recs, base)]
    ident = [r.get("identical") for r in recs]
    out = dict(questions=len(recs), tokens=sum(r["n"] for r in recs),
               tok_s=statistics.median(rate), speedup=math.exp(statistics.fmean(math.log(x) for x in ratio)),
               tau=sum(r["n"] for r in recs) / max(sum(r["forwards"] for r in recs), 1),
               identical=None if None in ident else all(ident), identical_count=sum(bool(x) for x in ident),
               first_diff=[r["first_diff"] for r in recs if r.get("first_diff") is not None],  # greedy
               peak_mb=max(r["peak_mb"] for r in recs), alpha=None, k=None, c=None, v=None,
               predicted=None, acceptance_per_position=None, draft_fraction=None)
    if "verify_time" not in recs[0]:  # transformers methods: no internal counters
        return out
    t_fwd = sum(b["verify_time"] for b in base) / max(sum(b["forwards"] for b in base), 1)
    out["v"] = sum(r["verify_time"] for r in recs) / max(sum(r["forwards"] for r in recs), 1) / t_fwd
    drafts = sum(r["drafts"] for r in recs)
    if drafts == 0:
        return out
    K = max(len(r["drafted_pos"]) for r in recs)
    acc = [sum(r["acc_pos"][i] for r in recs if i < len(r["acc_pos"])) for i in range(K)]
    dr = [sum(r["drafted_pos"][i] for r in recs if i < len(r["drafted_pos"])) for i in range(K)]
    reached = [dr[0]] + [min(acc[i - 1], dr[i]) for i in range(1, K)]
    alpha = sum(acc) / max(sum(reached), 1)
    f = drafts / max(sum(r["forwards"] for r in recs), 1)
    k = sum(dr) / drafts
    c = sum(r["draft_time"] for r in recs) / max(sum(dr), 1) / t_fwd
    E = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    out.update(alpha=alpha, k=k, c=c, draft_fraction=f,
               predicted=((1 - f) + f * E) / ((1 - f) + f * (1 + c * k)),
               acceptance_per_position=[a / max(d, 1) for a, d in zip(acc, dr)])
    return out


def summarize(records: Dict[str, List[dict]], names: List[str]) -> dict:
    """{method: {"overall": stats, "per_category": {category: stats}}}, categories in first-seen order."""
    base = records["ar"]
    cats = list(dict.fromkeys(r["category"] for r in base))
    out = {}
    for m in names:
        recs = records[m]
        per = {c: _group([r for r in recs if r["category"] == c], [b for b in base if b["category"] == c])
               for c in cats}
        out[m] = {"overall": _group(recs, base), "per_category": per}
    return out


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _ident(s):
    if s["identical"] is None:
        return "n/a (sampled)"
    if s["identical"]:
        return "yes"
    first = sorted(s.get("first_diff") or [])
    at = f"; first diff at token {first[len(first) // 2]} (median)" if first else ""
    return f"**NO** ({s['identical_count']}/{s['questions']}{at})"


def overall_table(result: dict) -> str:
    meta, summ = result["meta"], result["summary"]
    # a low-precision run with ar_fp32: each ratio also against float32 decoding (geometric means over
    # the same questions, so speed-up / speed-up(ar_fp32) is the mean ratio to ar_fp32 per question)
    fp32 = summ["ar_fp32"]["overall"]["speedup"] if "ar_fp32" in summ else None
    lines = ["| method | tok/s (median) | speed-up vs ar |" + (" vs float32 ar |" if fp32 else "")
             + " tau | alpha | k | c | v | predicted | greedy identical | peak MB |",
             "|---|---|---|" + ("---|" if fp32 else "") + "---|---|---|---|---|---|---|---|"]
    for m, s in summ.items():
        o = s["overall"]
        vs = f" {o['speedup'] / fp32:.2f}x |" if fp32 else ""
        lines.append(f"| {meta['labels'][m]} | {o['tok_s']:.1f} | {o['speedup']:.2f}x |{vs} {o['tau']:.2f} | "
                     f"{_f(o['alpha'])} | {_f(o['k'], '{:.1f}')} | {_f(o['c'], '{:.3f}')} | {_f(o['v'])} | "
                     f"{_f(o['predicted'], '{:.2f}x')} | {_ident(o)} | {o['peak_mb']:.0f} |")
    return "\n".join(lines)


def _category_table(result: dict, key: str, fmt: str) -> str:
    summ = result["summary"]
    cats = list(next(iter(summ.values()))["per_category"])
    lines = ["| method | " + " | ".join(cats) + " | **all** |", "|---" * (len(cats) + 2) + "|"]
    for m, s in summ.items():
        cells = [fmt.format(s["per_category"][c][key]) for c in cats] + [fmt.format(s["overall"][key])]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean_load(result: dict) -> str:
    loads = [r["load1"] for recs in result["records"].values() for r in recs if r.get("load1") is not None]
    return f"{statistics.fmean(loads):.2f}" if loads else "n/a"



def _workload_note(meta: dict) -> str:
    """The workload's sha256, and that the default one is not Spec-Bench (older results: nothing)."""
    w = meta.get("workload")
    if not w:
        return ""
    return f" (sha256 {w['sha256'][:12]}" + ("; the workload shipped with specref, NOT Spec-Bench)" if w.get("default") else ")")

def markdown(result: dict, png: Optional[Path], md_dir: Path) -> str:
    meta, summ = result["meta"], result["summary"]
    mach, cfg = meta["machine"], meta["config"]
    la = lambda v: "n/a" if v is None else ", ".join(f"{x:.2f}" for x in v)  # noqa: E731
    hf = summ.get("hf", {}).get("overall")
    turn2 = cfg.get("turns", 1) == 2
    title = f"Second turns of {meta['question_file']}, T = {cfg['temperature']:g}" if turn2 else "Spec-Bench"
    parts = [markers(meta)[0], f"## {title}: every method side by side", "",
             f"Regenerate with `{meta['command']}` (`--questions all` for the whole split).", "",
             f"- Date: {meta['date']}; run took {meta['duration_s'] / 60:.1f} min.",
             f"- Machine: {mach['cpu']}, {mach['cores']} cores, torch threads {mach['threads']}"
             + (f", GPU {mach['gpu']}" if mach["gpu"] else "") + f"; {mach['platform']}.",
             f"- Load average (1, 5, 15 min) at start: {la(mach['load_avg_start'])}; at end: "
             f"{la(mach['load_avg_end'])}; mean 1-minute load over the timed calls: {_mean_load(result)}.",
             *([f"- **Loaded machine**: the 1-minute load average ({mach['load_avg_start'][0]:.1f}) exceeded "
                f"the {mach['cores']} cores when the run began; ratios measured side by side still hold roughly, "
                "absolute speeds do not: re-run on a quiet machine."]
               if mach["load_avg_start"] and mach["load_avg_start"][0] > mach["cores"] else []),
             f"- Python {mach['python']}, torch {mach['torch']}, transformers {mach['transformers']}.",
             f"- Model: {meta['model']}, {cfg['dtype']}, device {cfg['device']}, compile {cfg['compile']}; "
             f"{meta['num_questions']} questions ({'all' if cfg['questions'] is None else cfg['questions']} "
             f"per category, first in file order) of `{os.path.basename(meta['question_file'])}`{_workload_note(meta)}, "
             f"{_turn_note(meta)}; {cfg['max_new_tokens']} new tokens; temperature "
             f"{cfg['temperature']}; batch 1; KV cache of specref methods: {meta['cache']}.",
             "- Interleaved: every method runs on a question before any runs on the next (order rotated "
             "per question), after one untimed warm-up call each.", *suffix_notes(meta)]
    for m, why in meta["skipped"].items():
        parts.append(f"- Not measured: `{m}`: {why}.")
    if hf:
        parts.append(f"- specref's static-cache `autoregressive_generate` vs transformers `generate` "
                     f"(dynamic cache): **{1 / hf['speedup']:.2f}x** (geometric mean of per-question ratios).")
    parts += ["", "### Overall", "", overall_table(result), "",
              "speed-up: geometric mean over questions of tok/s ratios to `ar` in the same run; tau: tokens per "
              "target forward; alpha, k, c, v, predicted: see `specref/bench/report.py` (c = draft cost per "
              "drafted position / one target forward; v = verify forward / one target forward, which the "
              "closed form leaves out); `-`: not measurable for that method.", "",
              "### Speed-up over `ar` per category", "", _category_table(result, "speedup", "{:.2f}x"), "",
              "### Tokens per target forward (tau) per category", "", _category_table(result, "tau", "{:.2f}"), ""]
    acc = {m: s["overall"]["acceptance_per_position"] for m, s in summ.items()
           if s["overall"]["acceptance_per_position"]}
    if acc:
        K = max(len(v) for v in acc.values())
        parts += ["### Acceptance per draft position (overall)", "",
                  "| method | " + " | ".join(str(i + 1) for i in range(K)) + " |", "|---" * (K + 1) + "|"]
        parts += [f"| {m} | " + " | ".join(f"{v[i]:.2f}" if i < len(v) else "" for i in range(K)) + " |"
                  for m, v in acc.items()]
        parts.append("")
    if png is not None:
        parts += [f"![speed-up and tau per method and category]({os.path.relpath(png.resolve(), md_dir)})", ""]
    parts.append(markers(meta)[1])
    return "\n".join(parts)


def splice(md_path: Path, section: str, start: str = START, end: str = END) -> None:
    """Replace the start..end section of md_path (or append it); other sections stay untouched."""
    text = md_path.read_text(encoding="utf-8") if md_path.exists() else "# Benchmarks\n"
    if start in text and end in text and text.index(start) < text.index(end):
        text = text[: text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = md_path.with_suffix(md_path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(md_path)


def plot(result: dict, png: Path) -> None:
    """Grouped bars: speed-up over ar (top) and tau (bottom), per category and overall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = result["summary"]
    cats = list(next(iter(summ.values()))["per_category"]) + ["all"]
    methods = list(summ)
    w = 0.8 / len(methods)
    fig, axes = plt.subplots(2, 1, figsize=(min(16, max(8, 0.5 * len(cats) * max(1, len(methods) / 4))), 7), sharex=True)
    for ax, key, title in ((axes[0], "speedup", "speed-up over specref autoregressive"),
                           (axes[1], "tau", "tokens per target forward (tau)")):
        for j, m in enumerate(methods):
            vals = [summ[m]["per_category"][c][key] for c in cats[:-1]] + [summ[m]["overall"][key]]
            ax.bar([i + (j - (len(methods) - 1) / 2) * w for i in range(len(cats))], vals, w, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(title)
    axes[1].set_xticks(range(len(cats)))
    axes[1].set_xticklabels(cats, rotation=30, ha="right")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out_dir: Path, md_path: Optional[Path]) -> dict:
    """bench.json and bench.png into out_dir; the bench section of md_path (None: skip)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, png = out_dir / "bench.json", out_dir / "bench.png"
    js.write_text(json.dumps(result, indent=1), encoding="utf-8")
    plot(result, png)
    paths = {"json": js, "png": png, "table": overall_table(result)}
    if md_path is not None:
        splice(md_path, markdown(result, png, md_path.resolve().parent), *markers(result["meta"]))
        paths["markdown"] = md_path
    return paths
