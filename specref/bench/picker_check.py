"""The picker (picker.py) against the bench: predicted and measured speed-ups of the same methods
on the same prompts, one run (`python -m specref bench --pick`): Spearman's rank correlation of the
methods over the whole workload (geometric means over its prompts) and per Spec-Bench task group,
the median |predicted / measured - 1| over methods, and how many categories' picks land within 5%
of the best measured method; a Markdown table and a plot.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from ..picker import Calibration, choose, predict

GROUPS = {  # Spec-Bench's task groups (Xia et al. 2024): MT-Bench's eight categories, then one each
    "multi-turn conversation": ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                "humanities"),
    "translation": ("translation",), "summarization": ("summarization",), "qa": ("qa",),
    "math reasoning": ("math_reasoning",), "rag": ("rag",)}


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (scipy.stats.spearmanr; ties get mean ranks)."""
    from scipy.stats import spearmanr

    if len(x) < 2:
        raise ValueError("rank correlation needs at least two values")
    return float(spearmanr(x, y).statistic)


def compare(cal: Calibration, summary: dict, max_new_tokens: Optional[int] = None, near: float = 0.05) -> dict:
    """Predicted against measured (a bench summary of the same methods, report.summarize):
    per category the prediction and the pick; Spearman of the methods over the whole workload
    (`spearman`, "ar" included at 1.0) and per task group (geometric means over the group's
    categories); median |predicted / measured - 1| over methods (overall); how many categories'
    picks are within `near` of the best measured method."""
    methods = ["ar"] + [m for m in cal.methods if m in summary]
    cats = list(next(iter(summary.values()))["per_category"])
    per_cat, picks = {}, {}
    for c in cats:
        pred = predict(cal, max_new_tokens, group=c)
        meas = {m: summary[m]["per_category"][c]["speedup"] for m in methods}
        pick, _ = choose(pred, cal.config)
        best = max(meas.values())
        per_cat[c] = dict(predicted={m: pred[m]["speedup"] for m in methods}, measured=meas, pick=pick,
                          best=max(meas, key=meas.get), within=meas[pick] >= (1 - near) * best)
        picks[c] = per_cat[c]["within"]
    groups = {}
    for g, members in GROUPS.items():
        cs = [c for c in members if c in per_cat]
        if not cs:
            continue
        gm = lambda key, m: math.exp(sum(math.log(per_cat[c][key][m]) for c in cs) / len(cs))  # noqa: E731
        pv, mv = [gm("predicted", m) for m in methods], [gm("measured", m) for m in methods]
        groups[g] = dict(categories=cs, spearman=spearman(pv, mv), predicted=dict(zip(methods, pv)),
                         measured=dict(zip(methods, mv)))
    overall = predict(cal, max_new_tokens)
    err = {m: overall[m]["speedup"] / summary[m]["overall"]["speedup"] - 1 for m in methods if m != "ar"}
    pred_all = {m: overall[m]["speedup"] for m in methods}
    meas_all = {m: summary[m]["overall"]["speedup"] for m in methods}
    errs = sorted(abs(e) for e in err.values())
    return dict(per_category=per_cat, groups=groups, error=err,
                median_abs_error=errs[len(errs) // 2] if len(errs) % 2 else sum(errs[len(errs) // 2 - 1:
                                                                                      len(errs) // 2 + 1]) / 2,
                picks_within=sum(picks.values()), categories=len(cats),
                spearman=spearman(list(pred_all.values()), list(meas_all.values())),
                overall=dict(predicted=pred_all, measured=meas_all))


def comparison_markdown(cmp: dict, cal_s: float, bench_s: float) -> str:
    """The comparison as Markdown (BENCHMARKS.md)."""
    lines = [f"- Calibration {cal_s:.0f} s against the bench's {bench_s:.0f} s on the same methods "
             f"({cal_s / bench_s:.1%}).",
             f"- Spearman of the methods over the workload: **{cmp['spearman']:.2f}**; median |predicted / measured "
             f"- 1| over methods: **{cmp['median_abs_error']:.3f}**; picks within 5% "
             f"of the best measured method: **{cmp['picks_within']} of {cmp['categories']}** categories.",
             "", "| method | predicted (all) | measured (all) | error |", "|---|---|---|---|"]
    for m, p in cmp["overall"]["predicted"].items():
        e = cmp["error"].get(m)
        lines.append(f"| {m} | {p:.2f}x | {cmp['overall']['measured'][m]:.2f}x | {'-' if e is None else f'{e:+.3f}'} |")
    lines += ["", "| task group | Spearman | predicted best | measured best |", "|---|---|---|---|"]
    for g, r in cmp["groups"].items():
        pb, mb = max(r["predicted"], key=r["predicted"].get), max(r["measured"], key=r["measured"].get)
        lines.append(f"| {g} | {r['spearman']:.2f} | {pb} | {mb} |")
    lines += ["", "| category | pick | measured best | pick's measured / best | predicted (pick) |",
              "|---|---|---|---|---|"]
    for c, r in cmp["per_category"].items():
        ratio = r["measured"][r["pick"]] / r["measured"][r["best"]]
        lines.append(f"| {c} | {r['pick']} | {r['best']} ({r['measured'][r['best']]:.2f}x) | {ratio:.2f} | "
                     f"{r['predicted'][r['pick']]:.2f}x |")
    return "\n".join(lines)


def plot_comparison(cmp: dict, path) -> None:
    """Predicted against measured speed-up, one point per (method, category)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    methods = list(cmp["overall"]["predicted"])
    for m in methods:
        xs = [r["measured"][m] for r in cmp["per_category"].values()]
        ys = [r["predicted"][m] for r in cmp["per_category"].values()]
        ax.scatter(xs, ys, label=m, s=18)
    lo = min(min(r["measured"].values()) for r in cmp["per_category"].values()) * 0.9
    hi = max(max(r["measured"].values()) for r in cmp["per_category"].values()) * 1.1
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xlabel("measured speed-up (bench)")
    ax.set_ylabel("predicted speed-up (picker)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recompare(folder) -> dict:
    """The comparison again from a `bench --pick` run's saved files (<folder>/bench.json and
    picker.json): the prediction recomputed by this predict() from the run's calibration records."""
    import json
    from pathlib import Path

    from ..picker import PickerConfig

    folder = Path(folder)
    bench = json.loads((folder / "bench.json").read_text())
    pk = json.loads((folder / "picker.json").read_text())
    cfg = bench["meta"]["config"]
    methods = [m for m in dict.fromkeys(r["method"] for r in pk["records"]) if m != "ar"]
    cal = Calibration(config=PickerConfig(methods=tuple(methods), temperature=cfg["temperature"],
                                          max_new_tokens=cfg["max_new_tokens"], budget_s=None),
                      methods=methods, labels={}, records=pk["records"], verify_ratios=pk["verify_ratios"],
                      seconds=pk["calibration_s"])
    spec = {m: s for m, s in bench["summary"].items() if m == "ar" or m in methods}
    return dict(compare=compare(cal, spec), calibration_s=pk["calibration_s"], bench_s=bench["meta"]["timed_loop_s"])


if __name__ == "__main__":  # python -m specref.bench.picker_check FOLDER: the comparison of a saved run
    import sys

    r = recompare(sys.argv[1])
    print(comparison_markdown(r["compare"], r["calibration_s"], r["bench_s"]))
