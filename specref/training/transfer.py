"""Does a proposer's training data transfer? Teacher-forced agreement on the target's own answers.

A head's held-out agreement measures it on text like its training text; what pays is agreement on
what the target writes when it serves real prompts. So (measure (b) of the heads' studies): the target answers
the first turn of every evaluation question (greedy, through the chat template, batched, with
data._distill_rows: the same code that makes the training data), its top-k log-probs stored at
every answer position; then each head is scored teacher-forced on those sequences with its own
TrainTask's `evaluate`, exactly as on its held-out training positions. top1 = how often the
head's argmax is the target's argmax given the true context: the greedy acceptance rate of a first
draft token. Reported per category and over all positions; for heads that draft several tokens
from one context (Medusa's head k: token t+k+1; MTP's module d: token t+d+1, the modules before it
teacher-forced; the MLP speculator's stage d likewise) also per head / depth, `top1_by_depth`; for the EAGLE-3 head, per draft position j
of its training-time test (its own outputs fed back for the j-1 positions before; every position
counted from the 4th answer token on, Eagle3TrainConfig.eval_steps). For EAGLE-1 heads also the
copy / new split (`copy`: the share of positions whose next token continues a bigram of the
prompt, eagle.copy_positions, and top-1 on those and on the rest): where prompt lookup drafts and
a head must copy.

The answers are evaluation data: measured on, never trained on (their folder is separate from
every training folder). Run: `python -m specref.training.transfer --eagle OLD.safetensors
NEW.safetensors --draft OLD.safetensors NEW.safetensors --medusa FILE --mtp FILE --eagle3 FILE
--mlp-speculator FILE --answers FOLDER`.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .data import DistillConfig, Seq, _distill_rows, iter_sequences
from .loop import TrainConfig, evaluate


def answers(model, tokenizer, folder, question_file=None, max_new_tokens: int = 128, batch_size: int = 64,
            topk: int = 32, progress: bool = True) -> Tuple[List[Seq], List[str]]:
    """The target's greedy answers to the first turn of every question (made once, then read back)
    -> (sequences with stored top-k, their categories)."""
    from ..bench.runner import load_questions
    from ..workloads import spec_bench_file

    rows = load_questions(spec_bench_file(question_file), None, None)  # the evaluation questions
    instr = [{"id": i, "category": r["category"], "instruction": r["turns"][0]} for i, r in enumerate(rows)]
    cfg = DistillConfig(max_new_tokens=max_new_tokens, batch_size=batch_size, topk=topk, temperature=0.0)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    _distill_rows(model, tokenizer, out, "shard_", instr, cfg, progress, "target answers")
    seqs = list(iter_sequences(out))
    if len(seqs) != len(instr):
        raise ValueError(f"{out} holds {len(seqs)} answers for {len(instr)} questions: use a new folder")
    return seqs, [r["category"] for r in instr]


def top1_by_depth(m: Dict[str, float]) -> List[float]:
    """Top-1 agreement per drafted position from a task's evaluate() means: MTP's top1_d, Medusa's
    head k (h{k}_r0 over h{k}_n: each head has its own label positions); else [top1]."""
    if "h1_n" in m:  # MedusaTask
        from .medusa import rank_accuracies

        heads = sum(1 for key in m if re.fullmatch(r"h\d+_n", key))
        return rank_accuracies(m, heads, 1, prefix="")[:, 0].tolist()
    if "top1_step1" in m:  # Eagle3Task: draft position j after j-1 of its own outputs
        return [m[f"top1_step{j}"] for j in range(1, sum(key.startswith("top1_step") for key in m) + 1)]
    if "top1_1" in m:  # MTPTask, MLPSpeculatorTask
        return [m[f"top1_{d}"] for d in range(1, sum(key.startswith("top1_") for key in m) + 1)]
    return [m.get("top1", 0.0)]


def per_category(task, seqs: Sequence[Seq], cats: Sequence[str], batch_size: int = 8,
                 max_len: int = 1024) -> Dict[str, Dict[str, float]]:
    """{category or "all": {"top1", "accept", "top1_by_depth", "positions"[, "coverage"]}} of `task`
    (a TrainTask) on `seqs`; top1 is the first drafted position's (Medusa: head 1; accept None
    where the task measures no sum min(p, q))."""
    cfg = TrainConfig(batch_size=batch_size, max_len=max_len)
    res = {}
    for c in sorted(set(cats)) + ["all"]:
        part = [s for s, k in zip(seqs, cats) if c == "all" or k == c]
        m = evaluate(task, part, cfg)
        depths = top1_by_depth(m)
        res[c] = {"top1": depths[0], "accept": m.get("accept"), "top1_by_depth": depths,
                  "positions": sum(max(min(len(s.tokens), max_len) - s.prompt_len, 0) for s in part)}
        if "coverage" in m:  # the target's argmax inside the head's draft vocabulary: top1's ceiling
            res[c]["coverage"] = m["coverage"]
        if m.get("copy_count"):  # EAGLE-1: positions whose next token continues a bigram of the prompt
            res[c]["copy"] = {"share": m["copy_count"], "top1": m["copy_top1"] / m["copy_count"],
                              "new_top1": (depths[0] - m["copy_top1"]) / max(1.0 - m["copy_count"], 1e-9)}
    return res


def eagle_task(target, path):
    from ..eagle_head import eagle_info, load_eagle
    from .eagle import EagleTask

    return EagleTask(load_eagle(target, path)), eagle_info(path)["record"]


def draft_task(target, path):
    from ..draft_model import load_trained_draft, trained_draft_info
    from .draft import DraftDistillTask

    draft, token_map = load_trained_draft(target, path)
    return DraftDistillTask(draft, token_map, target.get_output_embeddings().weight.shape[0]), \
        trained_draft_info(path)["record"]


def medusa_task(target, path):
    from ..medusa_heads import load_medusa, medusa_info
    from .medusa import MedusaTask

    record = medusa_info(path)["record"]
    return MedusaTask(load_medusa(target, path)), {"heldout": {"heldout_top1": (record.get("heldout_top1") or [None])[0]}}


def mtp_task(target, path):
    from ..mtp import load_mtp, mtp_info
    from .mtp import MTPTask

    return MTPTask(load_mtp(target, path)), mtp_info(path)["record"]


def mlp_speculator_task(target, path):
    from ..mlp_speculator import load_mlp_speculator, mlp_speculator_info
    from .mlp_speculator import MLPSpeculatorTask

    return MLPSpeculatorTask(load_mlp_speculator(target, path)), mlp_speculator_info(path)["record"]


def eagle3_task(target, path):
    from ..eagle3 import eagle3_info, load_eagle3
    from .eagle3 import Eagle3Task

    return Eagle3Task(load_eagle3(target, path)), eagle3_info(path)["record"]


def to_markdown(results: Dict[str, dict]) -> str:
    """One row per head: held-out training top-1 (its record), then top-1 per category and all."""
    cats = sorted({c for r in results.values() for c in r["categories"] if c != "all"})
    lines = ["| head | held-out (a) | " + " | ".join(cats) + " | all (b) | (a) - (b) |",
             "|---|---|" + "---|" * len(cats) + "---|---|"]
    for name, r in results.items():
        a = r.get("heldout_top1")
        b = r["categories"]["all"]["top1"]
        cells = [f"{r['categories'][c]['top1']:.3f}" for c in cats]
        lines.append(f"| {name} | {'n/a' if a is None else f'{a:.3f}'} | " + " | ".join(cells) +
                     f" | {b:.3f} | {'n/a' if a is None else f'{a - b:+.3f}'} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specref.training.transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--eagle", nargs="*", default=[], help="EAGLE-1 head files")
    ap.add_argument("--draft", nargs="*", default=[], help="trained draft files")
    ap.add_argument("--medusa", nargs="*", default=[], help="Medusa heads files")
    ap.add_argument("--mtp", nargs="*", default=[], help="MTP modules files")
    ap.add_argument("--eagle3", nargs="*", default=[], help="EAGLE-3 head files (their layers' features)")
    ap.add_argument("--mlp-speculator", nargs="*", default=[], help="MLP speculator files")
    ap.add_argument("--answers", required=True, help="folder of the target's answers (made on first use)")
    ap.add_argument("--question-file", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gen-batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if not (a.eagle or a.draft or a.medusa or a.mtp or a.eagle3 or a.mlp_speculator):
        raise ValueError("pass at least one head: --eagle / --draft / --medusa / --mtp / --eagle3 / "
                         "--mlp-speculator FILE ...")
    if a.threads:
        torch.set_num_threads(a.threads)
    from ..models import load_default
    from .eagle import attach_features
    from .eagle3 import attach_layer_features

    target, tok = load_default()
    for q in target.parameters():
        q.requires_grad_(False)
    seqs, cats = answers(target, tok, a.answers, a.question_file, a.max_new_tokens, a.gen_batch_size)
    if a.eagle or a.medusa or a.mtp or a.mlp_speculator:  # heads that read the target's final normed states
        with torch.no_grad():
            attach_features(target, seqs)
    results, layers = {}, None
    for kind, paths, make in (("eagle", a.eagle, eagle_task), ("draft", a.draft, draft_task),
                              ("medusa", a.medusa, medusa_task), ("mtp", a.mtp, mtp_task),
                              ("mlp_speculator", a.mlp_speculator, mlp_speculator_task),
                              ("eagle3", a.eagle3, eagle3_task)):  # last: it replaces the features
        for p in paths:
            task, record = make(target, p)
            if kind == "eagle3" and task.module.layers != layers:  # (L, 3D): its low, middle, high layers
                layers = task.module.layers
                attach_layer_features(target, seqs, layers)
            results[f"{kind} {p}"] = {"heldout_top1": (record.get("heldout") or {}).get("heldout_top1"),
                                      "categories": per_category(task, seqs, cats)}
    print(to_markdown(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
