"""`python -m specref bench`: every decoding method side by side on one prompt set, in one process.

The prompts: `--question-file FILE` (Spec-Bench's question.jsonl or any JSONL of its shape), else
$SPECREF_SPEC_BENCH, else the workload shipped with specref (`specref-workload`, NOT Spec-Bench;
workloads.py). Every result names the workload it ran (name, sha256, rows).

Spec-Bench (Xia et al. 2024, "Unlocking Efficiency in Large Language Model Inference: A
Comprehensive Survey of Speculative Decoding") compares speculative methods on one machine, one
model and one question set. Here: the first turn of each question through the model's chat
template (`--turns 2 --answers FILE`: the second turn of each conversation, the rows of two or more
turns, as [user turn 1, the stored greedy first answer, user turn 2]; FILE from `python -m specref
multiturn`, made for the same question file; bench/multiturn.py), every method on question i
before any method on question i+1 (the order of methods rotates from question to question, so slow
drift of the machine's load hits all of them alike), after one untimed warm-up call of each method
(32 tokens, a prompt outside the workload). SuffixDecoding's global trees are emptied after the
warm-up (and the picker's calibration): they start cold and see the timed questions in file order;
their size at the end (nodes, bytes) is recorded. Methods:
  ar         specref `autoregressive_generate` (static cache): the baseline of every ratio
  ar_fp32    the same on a float32 copy of the model, its own attention (with --dtype bfloat16 / float16)
  hf         transformers `model.generate`, greedy/sampled, dynamic cache
  hf_static  the same with cache_implementation="static" (transformers compiles it on CUDA)
  ngram      specref prompt lookup (NgramConfig(adaptive=True))
  lookahead  specref lookahead decoding (W, N, G = --lookahead)
  draft      specref draft model with the trained reduced-vocabulary draft, when its weights exist
  eagle      specref EAGLE-1 chain with the committed head (adaptive k per row)
  hybrid     prompt lookup where it matches, else the EAGLE head (HybridProposer, mode "select")
  hybrid_tree  both of them every step, as two branches of one token tree (mode "tree")
  hybrid_draft prompt lookup, else the trained draft
  medusa     specref Medusa heads over the tree their file ships (lossless tree acceptance)
  medusa_typical  the same heads with Medusa's typical acceptance (LOSSY at T > 0)
  hybrid_medusa   prompt lookup, else the Medusa heads' tree (HybridProposer, mode "select")
  hydra      specref Hydra heads (sequentially dependent Medusa heads) over their tree (lossless)
  hybrid_hydra    prompt lookup, else the Hydra heads' tree
  mtp        specref DeepSeek-V3-style MTP modules trained on the frozen target (chain)
  mlp_speculator         specref MLP speculator (Wertheimer et al. 2024) trained on the frozen target (chain)
  hybrid_mlp_speculator  prompt lookup, else the MLP speculator's chain
  hf_pld     transformers prompt lookup (`prompt_lookup_num_tokens=10`)
  hf_assist  transformers assisted generation with the same trained draft as `assistant_model`;
             its Vd-row LM head is wrapped to scatter into the full V (-inf outside the map)
Numbers (Leviathan et al. 2023 notation): tokens/s (median over questions); speed-up = geometric
mean over questions of tok/s(method) / tok/s(ar); tau = tokens emitted per target forward;
acceptance per draft position (per depth for trees); alpha = accepted / reached at each position
(the i.i.d. per-token rate); k = mean draft length of the steps that drafted; c = draft time per
drafted position / one `ar` target forward; the closed form (1 - a^(k+1)) / ((1 - a)(1 + c k)),
mixed with the fraction f of steps that drafted at all: ((1-f) + f E) / ((1-f) + f (1 + c k));
v = the method's verify forward / one `ar` forward (what the closed form leaves out); peak memory
(RSS high-water mark per call on CPU, torch.cuda.max_memory_allocated on CUDA); and whether the
greedy output equals `ar` token for token. The methods live in methods.py, the reporting in report.py.
Batch > 1: `--batch-size 1 4 16` (bench/batch.py; `--refill`: also as queues through scheduler.py). `--pick`: the picker (picker.py) calibrates on
the same prompts and methods after the warm-up, timed apart, and its predictions are compared with
the measured speed-ups (bench/picker_check.py: <out>/picker.md, .json, .png).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..target import Target, TargetConfig
from ..workloads import describe, label, portable_name, question_file, select
from .methods import ALL_METHODS, EXTRA_METHODS, build_methods, load_model
from .multiturn import answers_info, prompt_of, second_turn_file, second_turn_questions
from .report import first_difference, suffix_notes


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one benchmark run."""

    methods: tuple = ALL_METHODS  # which methods; "ar" is always run (it is the baseline)
    categories: Optional[tuple] = None  # None: every category in the question file
    questions: Optional[int] = 1  # first N questions per category in file order; None: all
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy (output identity is checked)
    device: str = "cpu"
    compile: bool = False  # specref target forwards under torch.compile (prefill stays eager)
    dtype: str = "float32"  # model weights: float32 | bfloat16 | float16
    attn: Optional[str] = None  # the model's attention implementation (e.g. "eager", "sdpa"); None: its own
    question_file: Optional[str] = None  # None: $SPECREF_SPEC_BENCH, else the shipped default workload
    model: str = "default"  # "default" (SmolLM2-135M-Instruct), a local model folder, or "tiny" (tests)
    draft_k: Optional[int] = None  # None: closed-form optimal k from the draft's alpha and measured c
    # (the trained draft's k; the EAGLE head's upper bound on its adaptive k)
    lookahead: tuple = (7, 5, 7)  # lookahead's (W, N, G): Spec-Bench's setting
    seed: int = 0
    progress: bool = True
    pick: bool = False  # also run the picker's calibration (picker.py) and compare it with the bench
    pick_tokens: int = 56  # greedy: new tokens of the real answer each method is replayed on
    pick_from: str = "benched"  # "benched": the picker calibrates on the benched prompts, all of them;
    # "workload": as `python -m specref pick` would, on its own seeded sample of EVERY prompt of the
    # file (chosen categories), stratified by category, within the automatic budget (calibrate.budget_for)
    weights: tuple = ()  # ((kind, path), ...): trained weights instead of the committed ones (registry.py)
    verify: str = "tokenwise"  # speculative_generate(verify=...) for the methods that take it (registry.verify_rules)
    turns: int = 1  # 1: first turns; 2: second turns of the conversations, first answers from `answers`
    answers: Optional[str] = None  # turns 2: a first-answers file (python -m specref multiturn)


# ----------------------------------------------------------------------------- questions


def find_question_file(path: Optional[str] = None) -> Path:
    """The prompts: `path`, else $SPECREF_SPEC_BENCH (a file or its folder), else the default
    workload shipped with specref (NOT Spec-Bench; workloads.py)."""
    return question_file(path)


def load_questions(path: Path, categories: Optional[tuple], per_category: Optional[int]) -> List[dict]:
    """First `per_category` questions of each chosen category, in file order (reproducible)."""
    import json

    return select([json.loads(line) for line in open(path, encoding="utf-8") if line.strip()], categories, per_category)


def bench_questions(cfg: BenchConfig, per_category: Optional[int]) -> tuple:
    """(question file, chosen questions): first turns, or (cfg.turns 2) the conversations' second turns."""
    if cfg.turns == 1:
        qfile = find_question_file(cfg.question_file)
        return qfile, load_questions(qfile, cfg.categories, per_category)
    qfile = second_turn_file(cfg.question_file, cfg.answers)
    return qfile, second_turn_questions(qfile, cfg.answers, cfg.categories, per_category)


# ----------------------------------------------------------------------------- measuring


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return
    try:  # Linux: "5" resets this process's RSS high-water mark (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_mb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # process-wide maximum: cannot be reset per method

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _machine(dev: torch.device) -> dict:
    import transformers

    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(platform=platform.platform(), cpu=cpu, cores=os.cpu_count(), threads=torch.get_num_threads(),
                gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__,
                load_avg_start=list(os.getloadavg()) if hasattr(os, "getloadavg") else None)


def run_bench(cfg: BenchConfig, command: str = "") -> dict:
    """Run every method on every chosen question; returns the JSON-able result (see report.py)."""
    from tqdm.auto import tqdm

    from .report import summarize

    t_start = time.perf_counter()
    machine, date = _machine(torch.device(cfg.device)), time.strftime("%Y-%m-%d %H:%M:%S %Z")
    qfile, questions = bench_questions(cfg, cfg.questions)
    workload = describe(qfile)
    if not questions:
        raise ValueError(f"no questions selected from {workload['name']}")
    print(label(workload), file=sys.stderr)
    model, encode, eos, model_name = load_model(cfg)
    dev = model.device
    if cfg.compile:
        import torch._dynamo as dynamo

        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, max(256, getattr(dynamo.config, knob)))
    target = Target(model, TargetConfig(compile=cfg.compile))  # prefill stays eager
    from ..registry import Registry

    reg = Registry(model, target, kind="tiny" if cfg.model == "tiny" else "default" if cfg.model == "default"
                   else "custom", draft_k=cfg.draft_k, lookahead=cfg.lookahead, weights=dict(cfg.weights))
    methods, skipped = build_methods(cfg, model, eos, target, registry=reg)
    prompts = [torch.tensor([encode(prompt_of(q))], device=dev) for q in questions]  # (1, T) each
    for m in methods:
        if m.prepare is not None:
            m.prepare([p[0].tolist() for p in prompts])  # auto: the workload it calibrates on
    slack = cfg.max_new_tokens + 2 * max([m.k or 0 for m in methods] + [16]) + 64
    fixed = _bucket(max(p.shape[1] for p in prompts) + slack) if cfg.compile else None

    warm = torch.tensor([encode("Hello! Tell me a little about yourself.")], device=dev)  # (1, T)
    for m in tqdm(methods, desc="warm-up", disable=not cfg.progress):
        m.run(warm, fixed or _bucket(warm.shape[1] + slack), cfg.seed, min(32, cfg.max_new_tokens))
    if cfg.compile:  # a warm-up that drafts nothing leaves the k+1-token graph to a timed call
        for kk in sorted({m.k for m in methods if m.specref and m.k and m.name != "lookahead"}):
            cache = target.new_cache(1, fixed)
            target.prefill(cache, warm, torch.tensor([warm.shape[1]], device=dev), logits=False)
            target.verify_chain(cache, warm[:, -1:].repeat(1, kk + 1), pad_to=kk + 1)

    cal, pool = None, []
    if cfg.pick:  # the picker on the same prompts and methods, timed apart from the bench's runs
        from ..picker import PickerConfig, calibrate

        cand = tuple(m.name for m in methods if m.specref and m.name != "ar")
        whole = cfg.pick_from == "workload"
        pool = bench_questions(cfg, None)[1] if whole else questions
        pc = PickerConfig(methods=cand, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                          replay_tokens=cfg.pick_tokens, budget_s="auto" if whole else None, seed=cfg.seed,
                          progress=cfg.progress)
        cal = calibrate(model, [encode(prompt_of(q)) for q in pool] if whole else [p[0].tolist() for p in prompts],
                        pc, reg, groups=[q["category"] for q in pool])
    reg.reset_suffix_caches()  # the timed questions start from empty global trees, in file order
    t_loop = time.perf_counter()
    records: Dict[str, List[dict]] = {m.name: [] for m in methods}
    bar = tqdm(total=len(questions) * len(methods), desc="spec-bench", disable=not cfg.progress)
    for i, (q, ids) in enumerate(zip(questions, prompts)):
        max_len = fixed or _bucket(ids.shape[1] + slack)  # the same cache size for every method
        r = i % len(methods)
        for m in methods[r:] + methods[:r]:
            bar.set_postfix_str(f"{q['category']} #{q['question_id']} {m.name}")
            _reset_peak(dev)
            rec = m.run(ids, max_len, cfg.seed + i)
            rec.update(question_id=q["question_id"], category=q["category"], prompt_tokens=ids.shape[1],
                       n=len(rec["tokens"]), peak_mb=_peak_mb(dev),
                       load1=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
            records[m.name].append(rec)
            bar.update(1)
    bar.close()
    t_loop = time.perf_counter() - t_loop
    for m in methods:  # greedy identity with the baseline, token for token
        for rec, base in zip(records[m.name], records["ar"]):
            rec["first_diff"] = first_difference(rec["tokens"], base["tokens"]) if cfg.temperature == 0 else None
            rec["identical"] = (rec["first_diff"] is None) if cfg.temperature == 0 else None
    meta = dict(command=command, date=date, model=model_name,
                question_file=workload["name"], workload=workload,
                config={**asdict(cfg), "question_file": workload["name"], "model": portable_name(cfg.model),
                        "weights": [(kind, portable_name(p)) for kind, p in cfg.weights],
                        "answers": cfg.answers and portable_name(cfg.answers)},
                skipped=skipped, num_questions=len(questions), machine=machine,
                labels={m.name: m.label for m in methods}, specref={m.name: m.specref for m in methods},
                ks={m.name: m.k for m in methods}, verify=_rules(cfg, methods), cache="fixed" if fixed else "per question, 128-slot buckets")
    if cfg.turns == 2:
        meta["answers"] = answers_info(cfg.answers)
    suffix = [m.name for m in methods if m.name in ("suffix", "suffix_tree", "hybrid_suffix")]
    if suffix:  # each method's own global tree at the end of the run (suffix_tree.SuffixCache.memory)
        meta["suffix_cache"] = dict(start="cold", order="file order", memory={n: reg.suffix(n).cache.memory()
                                                                               for n in suffix})
    meta["machine"]["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    meta["duration_s"] = time.perf_counter() - t_start
    meta["timed_loop_s"] = t_loop
    result = dict(meta=meta, summary=summarize(records, [m.name for m in methods]), records=records)
    if cal is not None:
        from .picker_check import compare

        spec = {m: s for m, s in result["summary"].items() if m == "ar" or m in cal.methods}
        result["picker"] = dict(compare=compare(cal, spec), calibration_s=cal.seconds, setup_s=cal.setup_seconds,
                                records=cal.records, verify_ratios=cal.verify_ratios, pick_from=cfg.pick_from,
                                budget_s=cal.budget_s,
                                prompts_used=cal.prompts_used, prompts_given=cal.prompts_given,
                                sample=[dict(question_id=pool[i]["question_id"], category=g) for i, g in cal.sample()])
    return result


def _rules(cfg: BenchConfig, methods) -> Dict[str, str]:
    """The rule each specref method ran under: cfg.verify where it takes it, else token-wise."""
    from ..registry import METHODS, verify_rules

    return {m.name: cfg.verify if m.name in METHODS and cfg.verify in verify_rules(m.name) else "tokenwise"
            for m in methods if m.specref}


def _bucket(n: int, step: int = 128) -> int:
    return int(math.ceil(n / step) * step)


# ----------------------------------------------------------------------------- command line


def _split(values: Optional[List[str]]) -> Optional[tuple]:
    if not values:
        return None
    return tuple(v for item in values for v in item.split(",") if v)


def bench_main(argv=None) -> int:
    """Entry point of `python -m specref bench`. Returns 0, or 1 when a specref method's greedy
    output differed from the baseline (a bug)."""
    from ..registry import weights_item
    from .report import write_outputs

    ap = argparse.ArgumentParser(prog="python -m specref bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=None, help=f"any of {', '.join(ALL_METHODS + EXTRA_METHODS)} (default: all but auto)")
    ap.add_argument("--categories", nargs="+", default=None, help="default: every category")
    ap.add_argument("--questions", default="1", help="questions per category (first N in file order), or 'all'")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--compile", action="store_true", help="specref target forwards under torch.compile")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--attn", default=None, choices=("eager", "sdpa"),
                    help="the model's attention implementation (default: as loaded, sdpa); bf16 with "
                         "eager attention was block-invariant here (docs/experiments/cpu_speed.md, bf16 on CPU)")
    ap.add_argument("--question-file", default=None, help="Spec-Bench's question.jsonl or any JSONL of its shape "
                    "(default: $SPECREF_SPEC_BENCH, else the workload shipped with specref, which is NOT Spec-Bench)")
    ap.add_argument("--turns", type=int, default=1, choices=(1, 2), help="1: first turns; 2: the second turns "
                    "of the question file's conversations (rows of 2+ turns), after the first answers of --answers")
    ap.add_argument("--answers", default=None, help="with --turns 2: the first-answers file of `python -m specref "
                    "multiturn` for the same question file (default question file: the one the answers were made for)")
    ap.add_argument("--model", default="default", help="'default' or a local model folder")
    ap.add_argument("--draft-k", type=int, default=None, help="draft tokens of the trained draft, and "
                    "the most per step of the EAGLE head (default: closed-form optimum)")
    ap.add_argument("--lookahead", default="7,5,7", help="lookahead's W,N,G (default: Spec-Bench's)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="specref_bench", help="folder for bench.json and bench.png (default: "
                    "./specref_bench; the committed results are written by python -m specref.bench.results)")
    ap.add_argument("--markdown", default="none",
                    help="a Markdown file whose bench section is replaced (default 'none': skip)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--weights", type=weights_item, action="append", default=[], metavar="KIND=PATH",
                    help="trained weights instead of the committed ones (repeatable), e.g. eagle=/path/eagle.safetensors;"
                    " needed for the learned methods of a --model that is not the default one")
    ap.add_argument("--pick", action="store_true", help="also calibrate the picker (picker.py) on the same "
                    "prompts and methods, and write predicted against measured to <out>/picker.{md,json,png}")
    ap.add_argument("--pick-tokens", type=int, default=56, help="picker: new tokens of the real answer per prompt")
    ap.add_argument("--pick-from", choices=("benched", "workload"), default="benched",
                    help="picker: calibrate on the benched prompts (all of them), or as `python -m specref pick` "
                         "would, on its own sample of every prompt of the file within the automatic budget")
    ap.add_argument("--verify", default="tokenwise", choices=("tokenwise", "block", "traversal"),
                    help="the lossless rule of the rejection step for the methods that take it (registry.verify_rules): "
                         "block verification for chains, traversal verification for trees drawn without "
                         "replacement; the others stay token-wise (recorded per method)")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1],
                    help="batch sizes, e.g. 1 4 16: total throughput per method at each (bench/batch.py); "
                         "writes <out>/batch/batch.json and the batch section of the Markdown file")
    ap.add_argument("--refill", action="store_true",
                    help="with --batch-size: also run every specref method as one queue of every question at each "
                         "B > 1 (scheduler.py), in static batches and with a finished row taking the next question")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --batch-size: every batch and queue N times, interleaved; tokens/s the median")
    a = ap.parse_args(argv)
    if a.questions == "all":
        per = None
    elif a.questions.isdigit() and int(a.questions) > 0:
        per = int(a.questions)
    else:
        raise ValueError(f"--questions must be a positive int or 'all', got {a.questions!r}")
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {a.temperature}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if a.weights and a.model == "tiny":
        raise ValueError("--weights does not apply to --model tiny (its learned methods use untrained heads)")
    if (a.turns == 2) != (a.answers is not None):
        raise ValueError("--turns 2 and --answers FILE go together (the first answers of the conversations)")
    if a.turns == 2 and a.batch_size != [1]:
        raise ValueError("--turns 2 runs at batch size 1 only")
    if a.threads:
        torch.set_num_threads(a.threads)
    methods = _split(a.methods) or ALL_METHODS
    bad = [m for m in methods if m not in ALL_METHODS + EXTRA_METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}; choose from {', '.join(ALL_METHODS + EXTRA_METHODS)}")
    look = tuple(int(x) for x in a.lookahead.split(",") if x.strip().isdigit())
    if len(look) != 3 or len(a.lookahead.split(",")) != 3:
        raise ValueError(f"--lookahead must be three ints W,N,G, got {a.lookahead!r}")
    cfg = BenchConfig(methods=methods, lookahead=look, categories=_split(a.categories), questions=per,
                      max_new_tokens=a.max_new_tokens, temperature=a.temperature, device=a.device,
                      compile=a.compile, dtype=a.dtype, attn=a.attn, question_file=a.question_file, model=a.model,
                      draft_k=a.draft_k, seed=a.seed, progress=not a.no_progress,
                      pick=a.pick, pick_tokens=a.pick_tokens, pick_from=a.pick_from, weights=tuple(a.weights),
                      verify=a.verify, turns=a.turns, answers=a.answers)
    args = list(sys.argv[1:] if argv is None else argv)
    args = args[1:] if args[:1] == ["bench"] else args
    path_flags = {"--question-file", "--out", "--markdown", "--answers"}  # recorded by name: no path of this machine
    args = [portable_name(x) if i and args[i - 1] in path_flags else x for i, x in enumerate(args)]
    command = "python -m specref bench " + " ".join(shlex.quote(x) for x in args)
    sizes = a.batch_size
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    if any(b < 1 for b in sizes) or sorted(set(sizes)) != list(sizes):
        raise ValueError(f"--batch-size must be increasing ints >= 1, got {sizes}")
    if sizes != [1]:
        from .batch import run_batch_bench, write_batch_outputs

        qfile = find_question_file(cfg.question_file)
        qs, workload = load_questions(qfile, cfg.categories, cfg.questions), describe(qfile)
        print(label(workload), file=sys.stderr)
        with torch.inference_mode():
            result = run_batch_bench(cfg, sizes, qs, command.strip(), refill=a.refill, repeats=a.repeats)
        result["meta"]["workload"] = workload
        md = None if a.markdown == "none" else Path(a.markdown)
        print(write_batch_outputs(result, Path(a.out) / "batch", md))
        bad = [(B, n) for part in ("rows", "queues") for B, per in result[part].items() for n, r in per.items()
               if r["identical"] is False]
        if bad:
            print(f"greedy output differs from the baseline for {bad}", file=sys.stderr)
        return 1 if bad else 0
    with torch.inference_mode():
        result = run_bench(cfg, command.strip())
    md = None if a.markdown == "none" else Path(a.markdown)
    paths = write_outputs(result, Path(a.out), md)
    print("\n" + paths["table"])
    print("\n" + "\n".join([label(result["meta"]["workload"]), *suffix_notes(result["meta"])]))
    print("\nwrote " + ", ".join(str(p) for k, p in paths.items() if k != "table"))
    if "picker" in result:
        from ..picker import save
        from .picker_check import comparison_markdown, plot_comparison

        pk, out = result["picker"], Path(a.out)
        cats = sorted({r["category"] for r in pk["sample"]})
        text = (f"- Calibrated on {pk['prompts_used']} of {pk['prompts_given']} prompts "
                f"({'the benched prompts' if pk['pick_from'] == 'benched' else 'its own sample of the workload'}; "
                f"{len(cats)} categories; question ids {', '.join(str(r['question_id']) for r in pk['sample'])}).\n"
                + comparison_markdown(pk["compare"], pk["calibration_s"], result["meta"]["timed_loop_s"]))
        (out / "picker.md").write_text(text + "\n", encoding="utf-8")
        save(pk, out / "picker.json")
        plot_comparison(pk["compare"], out / "picker.png")
        print("\n" + text + f"\nwrote {out / 'picker.md'}, picker.json, picker.png")
    bad = [name for name, s in result["summary"].items()
           if result["meta"]["specref"].get(name) and s["overall"]["identical"] is False]
    if bad and cfg.dtype != "float32":  # a block and a single token take different low-precision
        print(f"greedy output differs from the baseline for {bad}: expected in {cfg.dtype}, where a "
              "block and a single token round differently (losslessness is the chi-square tests' claim)")
        return 0
    if bad:
        print(f"greedy output differs from the baseline for specref methods {bad}", file=sys.stderr)
    return 1 if bad else 0
