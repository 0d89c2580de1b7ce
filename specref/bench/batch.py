"""`python -m specref bench --batch-size 1 4 16`: total throughput of every method at batch B.

Speculative decoding spends spare compute (the k+1-token verify block costs little more than one
token while a forward is bound by reading the weights; Leviathan et al. 2023, Sec. 3.4) to save
sequential target forwards. Batching spends the same spare compute on more rows, so the gain of
speculation shrinks as the batch grows; here that is measured, not asserted. Setup: the chosen
Spec-Bench questions (first turn, chat template) in file order, cut into batches of B, left-padded
(ragged prompts); every method on the same batch before the next batch (order rotating), after a
warm-up at each B; per (B, method): total tokens / total wall time, and its ratio to specref's
`autoregressive_generate` at the same B (and at B = 1). A batch runs until its last row ends:
the fraction of row-steps spent on rows that had already finished is reported as "idle".
transformers' assisted generation and prompt lookup run at batch 1 only (its own restriction), so
they are skipped for B > 1. The adaptive proposers keep the costs measured once at B = 1.
Beside the end-to-end tokens/s (left-padded prompts' prefill included): decoding alone (tokens over
the time outside the prefills), the median time to first token (TTFT: a batch's call start to its
first step's end) and the median time per output token (TPOT: per row, its last token's time less
its first's, over its tokens less one). With `--refill`, every specref method also runs as one
queue of every question through scheduler.py at each B > 1: static batches (refill "batch") and
a finished row taking the next question at once (refill "row"), with TTFT from the queue's start
(the wait included) and the idle row-steps while questions waited. `--repeats N` runs every batch
(and queue) N times, interleaved, and reports the median tokens/s. `auto` (picker/auto.py, named in
`--methods`) calibrates at each B on these questions before its warm-up (untimed), its candidates
the other specref methods named; each row says what it picked.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..target import Target, TargetConfig
from .methods import build_methods, load_model
from .report import splice

BATCH_ONLY_1 = ("hf_pld", "hf_assist")
START, END = "<!-- bench-batch:start -->", "<!-- bench-batch:end -->"


def _batches(prompts: List[List[int]], B: int, device) -> List[tuple]:
    """(ids (b, T) left-padded with 0, mask (b, T)) for consecutive groups of B prompts."""
    out = []
    for i in range(0, len(prompts), B):
        rows = prompts[i:i + B]
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)  # (b, T)
        mask = torch.zeros(len(rows), T, dtype=torch.long)  # (b, T)
        for j, r in enumerate(rows):
            ids[j, T - len(r):] = torch.tensor(r)
            mask[j, T - len(r):] = 1
        out.append((ids.to(device), mask.to(device)))
    return out


def _median(xs: list) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def _queue_bench(methods, prompts: List[List[int]], B: int, slack: int, seed: int, repeats: int = 1) -> Dict[str, dict]:
    """Every specref method as one queue of every prompt with B rows: static batches, then refill
    (each `repeats` times, interleaved: the median run by tokens/s is reported)."""
    out: Dict[str, dict] = {}
    max_len = max(len(p) for p in prompts) + slack
    todo = [(m, refill) for m in methods if m.queue is not None for refill in ("batch", "row")]
    for m, refill in todo:
        m.queue(prompts[:B], B, max_len, seed, refill)  # warm-up, untimed
    runs: Dict[str, list] = {}
    for _ in range(repeats):
        for m, refill in todo:
            rec = m.queue(prompts, B, max_len, seed, refill)
            tokens = sum(len(r) for r in rec["rows"])
            runs.setdefault(f"{m.name}/{refill}", []).append(dict(
                label=m.label, refill=refill, tokens=tokens, tok_s=tokens / max(rec["wall"], 1e-9),
                dec_tok_s=tokens / max(rec["wall"] - rec["prefill_time"], 1e-9), ttft=_median(rec["ttft"]),
                tpot=_median(rec["tpot"]), idle=rec["idle"], finished=rec["finished"], rows=rec["rows"],
                pick=rec.get("pick")))
    for name, recs in runs.items():
        recs = sorted(recs, key=lambda r: r["tok_s"])
        out[name] = dict(recs[(len(recs) - 1) // 2], repeats=[r["tok_s"] for r in recs])  # the median run
    return out


def run_batch_bench(cfg, sizes: List[int], questions: List[dict], command: str = "", refill: bool = False,
                    repeats: int = 1) -> dict:
    """Every method of cfg.methods at each batch size (refill: also as queues, scheduler.py), every
    batch `repeats` times (tokens/s: the median of the repeats' totals); returns the JSON-able result."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    model, encode, eos, name = load_model(cfg)
    target = Target(model, TargetConfig(compile=cfg.compile))
    methods, skipped = build_methods(cfg, model, eos, target)
    prompts = [encode(q["turns"][0]) for q in questions]
    for m in methods:
        if m.prepare is not None:
            m.prepare(prompts)  # auto: the workload it calibrates on
    slack = cfg.max_new_tokens + 2 * max([m.k or 0 for m in methods] + [16]) + 64
    rows: Dict[int, Dict[str, dict]] = {}
    ar_rows: Dict[int, list] = {}  # the baseline's rows at each B, file order
    bar = tqdm(total=sum(len(range(0, len(prompts), B)) for B in sizes) * len(methods) * repeats, desc="batch bench",
               disable=not cfg.progress)
    for B in sizes:
        todo = [m for m in methods if B == 1 or m.name not in BATCH_ONLY_1]
        batches = _batches(prompts, B, model.device)
        w_ids, w_mask = batches[0]
        for m in todo:  # warm-up at this batch size, untimed
            m.run(w_ids, w_ids.shape[1] + slack, cfg.seed, min(16, cfg.max_new_tokens), mask=w_mask)
        acc = {m.name: dict(tokens=0, wall=0.0, rows=[], idle=[], decode=0.0, ttft=[], tpot=[], reps=[0.0] * repeats,
                            pick=None) for m in todo}
        for rep, (i, (ids, mask)) in ((rep, x) for rep in range(repeats) for x in enumerate(batches)):
            r = (i + rep) % len(todo)
            for m in todo[r:] + todo[:r]:
                rec = m.run(ids, ids.shape[1] + slack, cfg.seed + i, mask=mask)
                a = acc[m.name]
                a["reps"][rep] += rec["wall"]
                a["pick"] = rec.get("pick", a["pick"])
                if rep == 0:  # the tokens (greedy: the same every repeat) once
                    a["tokens"] += sum(len(x) for x in rec["rows"])
                    a["rows"] += rec["rows"]
                a["wall"] += rec["wall"] / repeats
                a["idle"].append(rec.get("idle"))
                a["decode"] += (rec["wall"] - rec["prefill_time"]) / repeats if "prefill_time" in rec else 0.0
                a["ttft"].append(rec.get("ttft"))
                a["tpot"] += rec.get("tpot", [])
                bar.update(1)
        base = acc["ar"]
        ar_rows[B] = base["rows"]
        rows[B] = {}
        for m in todo:
            a = acc[m.name]
            idle = [x for x in a["idle"] if x is not None]
            reps = sorted(a["tokens"] / max(w, 1e-9) for w in a["reps"])  # tokens/s of each repeat
            rows[B][m.name] = dict(
                label=m.label, tokens=a["tokens"], wall=a["wall"], tok_s=_median(reps), repeats=reps, pick=a["pick"],
                idle=sum(idle) / len(idle) if idle else None,
                dec_tok_s=a["tokens"] / a["decode"] if a["decode"] > 0 else None, ttft=_median(a["ttft"]),
                tpot=_median(a["tpot"]),
                identical=(a["rows"] == base["rows"]) if (m.specref and cfg.temperature == 0) else None)
    bar.close()
    queues = {str(B): _queue_bench(methods, prompts, B, slack, cfg.seed, repeats) for B in sizes if refill and B > 1}
    for B, per in queues.items():
        for rec in per.values():
            rec["identical"] = (rec.pop("rows") == ar_rows[int(B)]) if cfg.temperature == 0 else None
    ar1 = rows[sizes[0]]["ar"]["tok_s"] if sizes[0] == 1 else None
    for B, per in rows.items():
        for rec in per.values():
            rec["speedup"] = rec["tok_s"] / per["ar"]["tok_s"]
            rec["vs_ar_b1"] = None if ar1 is None else rec["tok_s"] / ar1
    meta = dict(command=command, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), model=name, sizes=sizes, repeats=repeats,
                questions=len(questions), max_new_tokens=cfg.max_new_tokens, skipped=skipped,
                threads=torch.get_num_threads(), duration_s=time.perf_counter() - t0,
                load_avg=list(os.getloadavg()) if hasattr(os, "getloadavg") else None)
    return dict(meta=meta, rows={str(B): per for B, per in rows.items()}, queues=queues)


def merge_batch_runs(results: List[dict]) -> dict:
    """Batch runs of one setting at different B (one run per B, so a run cut short loses only its
    B) as one result: rows and queues by B, 'vs ar B=1' from the B = 1 run's ar when there, the
    commands joined, the durations summed. ValueError if model, questions, tokens or repeats differ."""
    if not results:
        raise ValueError("no batch runs to merge")
    keys = ("model", "questions", "max_new_tokens", "repeats")
    first = results[0]["meta"]
    for r in results[1:]:
        if any(r["meta"].get(k) != first.get(k) for k in keys):
            raise ValueError(f"batch runs differ in {[k for k in keys if r['meta'].get(k) != first.get(k)]}")
    rows, queues = {}, {}
    for r in results:
        rows.update(r["rows"])
        queues.update(r.get("queues") or {})
    order = lambda d: {B: d[B] for B in sorted(d, key=int)}  # noqa: E731
    rows, queues = order(rows), order(queues)
    ar1 = rows.get("1", {}).get("ar", {}).get("tok_s")
    for per in rows.values():
        for rec in per.values():
            rec["vs_ar_b1"] = None if ar1 is None else rec["tok_s"] / ar1
    metas = [r["meta"] for r in results]
    meta = dict(first, command="; ".join(dict.fromkeys(m["command"] for m in metas)),
                date=f"{min(m['date'] for m in metas)} to {max(m['date'] for m in metas)}",
                sizes=[int(B) for B in rows], duration_s=sum(m["duration_s"] for m in metas),
                skipped={k: v for m in metas for k, v in (m.get("skipped") or {}).items()})
    return dict(meta=meta, rows=rows, queues=queues)


def batch_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [START, "## Batch size (throughput of every method at batch B)", "",
             f"`{m['command']}` ({m['date']}; {m['model']}; {m['questions']} questions, {m['max_new_tokens']} new "
             f"tokens, batches of B in file order, left-padded; {m['threads']} threads; {m['duration_s'] / 60:.1f} "
             f"min; tokens/s the median of {m.get('repeats', 1)} repeat(s)). Speed-up: total tokens/s over specref autoregressive at the same B; 'vs ar B=1': over "
             "autoregressive at batch 1; idle: row-steps spent on rows that had already finished; decode "
             "tokens/s: the time outside the prefills; TTFT and TPOT: medians (a batch's first token; a row's "
             "time per token after its first).", "",
             "| B | method | tokens/s | decode tokens/s | TTFT | TPOT | speed-up | vs ar B=1 | idle | greedy identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for B, per in result["rows"].items():
        for rec in per.values():
            idle = "-" if rec["idle"] is None else f"{rec['idle']:.2f}"
            ident = "-" if rec["identical"] is None else ("yes" if rec["identical"] else "NO")
            vs1 = "-" if rec["vs_ar_b1"] is None else f"{rec['vs_ar_b1']:.2f}x"
            lines.append(f"| {B} | {_label(rec)} | {rec['tok_s']:.1f} | {_num(rec.get('dec_tok_s'), '.1f')} | "
                         f"{_ms(rec.get('ttft'))} | {_ms(rec.get('tpot'))} | {rec['speedup']:.2f}x | {vs1} | {idle} | "
                         f"{ident} |")
    if result.get("queues"):
        lines += ["", "As queues (scheduler.py, `--refill`): every question in one queue of B rows; static: batches of B, "
                  "each waiting for its slowest row; refill: a finished row takes the next question at once. TTFT "
                  "from the queue's start (the wait included); idle: row-steps with no question in the row while "
                  "questions waited; tail: ... while none waited.", "",
                  "| B | method | queue | tokens/s | decode tokens/s | TTFT | TPOT | idle | tail | greedy identical |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for B, per in result["queues"].items():
            for rec in per.values():
                ident = "-" if rec["identical"] is None else ("yes" if rec["identical"] else "NO")
                lines.append(f"| {B} | {_label(rec)} | {'refill' if rec['refill'] == 'row' else 'static'} | "
                             f"{rec['tok_s']:.1f} | {_num(rec['dec_tok_s'], '.1f')} | {_ms(rec['ttft'])} | "
                             f"{_ms(rec['tpot'])} | {rec['idle']:.2f} | {rec['finished']:.2f} | {ident} |")
    if m["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in m["skipped"].items())]
    lines += ["", "transformers' assisted generation and prompt lookup run at batch 1 only.", END]
    return "\n".join(lines)


def _label(rec: dict) -> str:
    """The method's label, and for `auto` what it picked at this B."""
    return rec["label"] + (f" -> {rec['pick']}" if rec.get("pick") else "")


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ms(x) -> str:
    """Seconds as milliseconds, '-' when not measured."""
    return "-" if x is None else f"{1000 * x:.0f} ms"


def write_batch_outputs(result: dict, out_dir: Path, md_path) -> str:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "batch.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    md = batch_markdown(result)
    if md_path is not None:
        splice(Path(md_path), md, START, END)
    return md
