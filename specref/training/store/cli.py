"""`python -m specref data`: the data path's commands, scoring a corpus into a feature store.

    python -m specref data --out STORE --sources --distilled EXPORT      score the committed corpus
                                                                         (an export of it) into STORE
    python -m specref data --out STORE [--sources NAME ...]              also, or only, real text
    python -m specref data --distilled DIR --self-instruct N ... --distill-only
                                                                         grow the corpus: the target's
                                                                         own answers, for `corpus add`

Scoring (build.build_store) resumes a half-scored store; writing --distilled (data.distill,
self_instruct.py) resumes a half-written folder. The contamination check (contamination.py) runs
against the evaluation files given (default: Spec-Bench through $SPECREF_SPEC_BENCH).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .build import StoreConfig, build_store


def data_parser():
    """The command line of `python -m specref data` (rebuild.py checks its recipes against it)."""
    import argparse

    from .. import corpus

    ap = argparse.ArgumentParser(prog="python -m specref data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="store folder (default: <specref cache>/store)")
    ap.add_argument("--tokens", type=int, default=StoreConfig.tokens, help="scored tokens to reach")
    ap.add_argument("--sources", nargs="*", default=list(corpus.SOURCES), choices=list(corpus.SOURCES),
                    help="corpora to score (none: only --distilled)")
    ap.add_argument("--distilled", default=None, help="also a self-distilled data folder (data.distill)")
    ap.add_argument("--self-instruct", type=int, default=0, metavar="N",
                    help="first write (or finish) --distilled: N target-written requests answered by the "
                         "target (self_instruct.py), in --dtype")
    ap.add_argument("--num-instructions", type=int, default=0, help="with --self-instruct: seed instructions too")
    ap.add_argument("--passage-prompts", type=int, default=0, help="with --self-instruct: prompts quoting the "
                                                                   "target's own answers as a passage")
    ap.add_argument("--real-passages", type=int, default=0, metavar="N",
                    help="also write N requests into --distilled that quote real text as the passage "
                         "(python-docs, debian-reference: corpus.passage_requests), answered by the target")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="with --self-instruct: longest answer")
    ap.add_argument("--gen-batch-size", type=int, default=64, help="with --self-instruct: prompts per batch")
    ap.add_argument("--refill", choices=("row", "batch"), default="row",
                    help="with --self-instruct / --num-instructions: the answers' queue (scheduler.py): a finished "
                         "row takes the next prompt at once (row), or static batches (batch); same answers")
    ap.add_argument("--request-chunk", type=int, default=None, metavar="N",
                    help="with --self-instruct: requests sampled per resumable chunk, in batches of "
                         "--gen-batch-size, so a smaller chunk caps the request batch (default: min(256, "
                         "max(--gen-batch-size, 2 x --self-instruct)), what the committed parts were written with)")
    ap.add_argument("--layers", nargs="+", default=["final"], help="'final' and/or hidden_states indices")
    ap.add_argument("--max-len", type=int, default=StoreConfig.max_len)
    ap.add_argument("--batch-tokens", type=int, default=StoreConfig.batch_tokens)
    ap.add_argument("--shard-tokens", type=int, default=StoreConfig.shard_tokens)
    ap.add_argument("--topk", type=int, default=StoreConfig.topk)
    ap.add_argument("--label", choices=("assistant", "all"), default=StoreConfig.label)
    ap.add_argument("--seed", type=int, default=StoreConfig.seed)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no new shard after this long")
    ap.add_argument("--distill-only", action="store_true", help="write (or finish) --distilled, then stop before "
                    "scoring: the run that grows the committed corpus (`corpus add` takes the folder)")
    ap.add_argument("--eval-file", nargs="+", default=None, help="evaluation JSONL files that no training text may "
                    "share a word 13-gram with (default: $SPECREF_SPEC_BENCH; neither: unchecked, said in the manifest)")
    return ap


def data_main(argv=None) -> int:
    """`python -m specref data`: score the default model's feature store (resumable); with
    --self-instruct N, first write (or finish) the --distilled folder: the target's own requests
    (self_instruct.py) and its greedy answers, in --dtype."""
    from .. import contamination as cont
    from .. import corpus

    a = data_parser().parse_args(argv)
    evals = cont.eval_files(a.eval_file)  # the contamination check's files (by name in the manifest)
    if not a.sources and not a.distilled:
        raise ValueError("nothing to score: give --sources and/or --distilled FOLDER")
    generate = bool(a.self_instruct or a.num_instructions or a.passage_prompts or a.real_passages)
    if generate and not a.distilled:
        raise ValueError("--self-instruct / --num-instructions / --passage-prompts / --real-passages write the "
                         "self-distilled folder: give it as --distilled FOLDER")
    if a.distill_only and not generate:
        raise ValueError("--distill-only stops after writing --distilled: give --self-instruct, --num-instructions, "
                         "--passage-prompts or --real-passages")
    if a.threads:
        torch.set_num_threads(a.threads)
    layers = tuple(x if x == "final" else int(x) for x in a.layers)
    cfg = StoreConfig(tokens=a.tokens, max_len=a.max_len, batch_tokens=a.batch_tokens, shard_tokens=a.shard_tokens,
                      topk=a.topk, layers=layers, label=a.label, seed=a.seed)
    from ...models import cache_root, load_default

    target, tok = load_default(dtype=getattr(torch, a.dtype), device=a.device)
    for q in target.parameters():
        q.requires_grad_(False)
    t0 = time.perf_counter()
    if generate:
        from ..data import DistillConfig
        from ..self_instruct import distill

        # topk 0: the store scores every position itself below
        dcfg = DistillConfig(seed=a.seed, num_instructions=a.num_instructions, max_new_tokens=a.max_new_tokens,
                             batch_size=a.gen_batch_size, topk=0, passage_prompts=a.passage_prompts,
                             self_instruct=a.self_instruct, real_passages=a.real_passages,
                             request_chunk=a.request_chunk, refill=a.refill)
        passages = None
        if a.real_passages:
            grams = cont.dev_ngrams(evals) if evals else None
            passages = corpus.passage_requests(corpus.load_sources(["python-docs", "debian-reference"]),
                                               a.real_passages, a.seed, grams=grams)
            if len(passages[0]) < a.real_passages:
                raise ValueError(f"--real-passages {a.real_passages}: only {len(passages[0])} requests pass the "
                                 "development split's 13-gram filter")
            passages[1]["dev_overlap_checked_against"] = cont.checked_against(evals) or None
        dman = distill(target, tok, a.distilled, dcfg, passages=passages, evals=evals)
        secs = time.perf_counter() - t0
        print(json.dumps({"distilled": a.distilled, "seconds": round(secs, 1), "refill": a.refill,
                          "answer_tokens_per_s": round(dman["counts"]["response_tokens"] / max(secs, 1e-9), 1),
                          "counts": dman["counts"]}), flush=True)
        if a.distill_only:
            return 0
        t0 = time.perf_counter()
    grams = cont.dev_ngrams(evals)
    sources = [corpus.overlap_filter(s, grams) for s in corpus.load_sources(a.sources, a.distilled, tok)]
    t_src = time.perf_counter() - t0
    out = Path(a.out) if a.out else cache_root() / "store"
    man = build_store(target, tok, sources, out, cfg, max_seconds=a.max_seconds,
                      extra={"device": a.device, "threads": torch.get_num_threads(),
                             "contamination_check": {"against": cont.checked_against(evals) or
                                                     "nothing: no evaluation file given", "n": cont.NGRAM,
                                                     "unit": "word (lower-cased \\w+ runs)"}})
    print(json.dumps({"out": str(out), "sources_seconds": round(t_src, 1), "counts": man["counts"],
                      "throughput": man["throughput"], "this_run": man["this_run"],
                      "sources": [{k: s[k] for k in ("name", "documents", "tokens", "licence")}
                                  for s in man["sources"]]},
                     indent=1))
    return 0
