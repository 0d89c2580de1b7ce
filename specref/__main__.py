"""`python -m specref demo | generate | pick | oracle | bench | train | data | corpus | rebuild | multiturn`: the
command-line entry points.

demo     - speculative decoding on the embedded default model (SmolLM2-135M-Instruct), greedy and
           sampled, with the speed-up over autoregressive_generate measured in the same run.
           --compare: then every method of --compare-methods on two prompts, with the picker's
           predicted speed-up beside the measured one.
generate - one prompt through any local model folder or GGUF file, with any method of registry.py
           (`--method NAME`, or `auto`: the picker's choice for this prompt, k per step from the
           measured costs: picker/auto.py).
pick     - the strategy picker on your prompts: which method, which k, or none (picker.py).
oracle   - check a rejection sampler for losslessness (oracle/).
bench    - every method side by side on Spec-Bench prompts (bench/, writes BENCHMARKS.md).
train    - training of the draft, the EAGLE head, Medusa heads or MTP modules (training/).
data     - the feature store: real text scored teacher-forced by the target (training/store/).
corpus   - the committed corpus of the target's own answers (training/committed_corpus.py).
rebuild  - a committed weight file rebuilt from the committed corpus by its chain (training/rebuild.py).
multiturn - the greedy first answers of a multi-turn workload, stored for its second turns (bench/multiturn.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .registry import WEIGHT_KINDS, weights_item

DEMO_TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the coast "
    "of Queensland, Australia. The Great Barrier Reef can be seen from outer space and is the "
    "world's biggest single structure made by living organisms. This reef structure is composed of "
    "and built by billions of tiny organisms, known as coral polyps."
)
DEMO_PROMPT = "Summarize the following text in three sentences, reusing its wording:\n\n" + DEMO_TEXT
OPEN_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
COMPARE_METHODS = "ar,ngram,eagle,hybrid,medusa"


def _chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    return ids  # (1, T)


def _eos(tokenizer, model):
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return eos


def _proposer(name: str, model, k: int):
    from .draft_model import DraftModelConfig, DraftModelProposer, truncated_draft
    from .ngram import NgramConfig, NgramProposer

    if name == "ngram":
        return NgramProposer(NgramConfig(k=k, adaptive=True))
    if name.startswith("truncated"):
        layers = int(name.split(":")[1]) if ":" in name else 4
        return DraftModelProposer(truncated_draft(model, layers), DraftModelConfig(k=k))
    if os.path.exists(name):
        from transformers import AutoModelForCausalLM

        return DraftModelProposer(AutoModelForCausalLM.from_pretrained(name, local_files_only=True),
                                  DraftModelConfig(k=k))
    raise ValueError(f"unknown draft {name!r}: use 'ngram', 'truncated[:L]' or a local model folder")


def _report(label, out, base_rate=None, tokenizer=None):
    s = out.stats
    # tokens/s ratio: sampled runs may stop at different lengths, so wall times alone do not compare
    speed = f"  speed-up {s.tokens_per_second / base_rate:.2f}x (tokens/s)" if base_rate else ""
    print(f"[{label}] {int(out.num_tokens.sum())} tokens in {s.wall_time:.2f}s "
          f"({s.tokens_per_second:.1f} tok/s), {s.target_forwards} target forwards, "
          f"tokens/forward {s.tokens_per_forward:.2f}{speed}")
    if s.num_draft_tokens:
        per = ", ".join(f"{a:.2f}" for a in s.acceptance_per_position)
        print(f"    acceptance {s.acceptance_rate:.2f} of {s.num_draft_tokens} drafted; per position: {per}")


def demo(args) -> int:
    from .generate import autoregressive_generate, speculative_generate
    from .models import load_default

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = load_default()
    print(f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f}s")
    ids = _chat_ids(tok, args.prompt or DEMO_PROMPT)
    eos = _eos(tok, model)
    n = args.max_new_tokens
    for temp in (0.0, args.temperature):
        mode = "greedy" if temp == 0 else f"sampled, T={temp}"
        print(f"\n=== {mode} ===")
        autoregressive_generate(model, ids, max_new_tokens=4, temperature=temp, seed=0)  # warm-up
        base = autoregressive_generate(model, ids, max_new_tokens=n, temperature=temp, eos_token_id=eos, seed=0)
        spec = speculative_generate(model, _proposer(args.draft, model, args.k), ids, max_new_tokens=n,
                                    temperature=temp, eos_token_id=eos, seed=0)
        print(tok.decode(spec.row(0), skip_special_tokens=True))
        _report("autoregressive", base)
        _report(f"speculative ({args.draft}, k={args.k})", spec, base.stats.tokens_per_second)
        if temp == 0:
            same = spec.row(0) == base.row(0)
            print(f"    greedy output identical to autoregressive: {same}")
            if not same:
                return 1
    if args.compare:
        from .registry import Registry

        reg = Registry(model)
        for label, prompt in (("copy-heavy", DEMO_PROMPT), ("open-ended", OPEN_PROMPT)):
            print(f"\n=== compare, greedy, {label} prompt ===")
            compare(reg, _chat_ids(tok, prompt)[0].tolist(), args.compare_methods, eos)
    return 0


def compare(reg, ids_list, methods, eos=None, max_new_tokens: int = 48, budget_s: float = 20.0) -> dict:
    """Greedy runs of `methods` on one prompt (a list of ids), one line each: tok/s, speed-up over
    "ar" measured in the same run (tokens/s ratio), tokens per forward, and the picker's predicted
    speed-up (picker.recommend on the same prompt). Returns {method: measured speed-up}."""
    from . import picker

    ids = torch.tensor([ids_list])  # (1, T)
    rec = picker.recommend(reg.model, [ids_list], methods=list(methods), temperature=0.0,
                           max_new_tokens=max_new_tokens, budget_s=budget_s, registry=reg)
    pred, pick = dict(rec.predictions), rec.method
    gen = dict(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos, seed=0)
    outs = {}
    for name in ["ar"] + [m for m in methods if m != "ar"]:  # the baseline first
        _run(reg, name, ids, **{**gen, "max_new_tokens": 4})  # warm-up
        outs[name] = _run(reg, name, ids, **gen)
    base = outs["ar"].stats.tokens_per_second
    speedups = {}
    for name, out in outs.items():
        s = out.stats
        speedups[name] = s.tokens_per_second / base
        p = f"  predicted {pred[name]:.2f}x" if name in pred else ""
        same = "" if out.row(0) == outs["ar"].row(0) else "  (output differs from ar)"
        print(f"  {name:<15} {s.tokens_per_second:8.1f} tok/s  speed-up {speedups[name]:.2f}x  "
              f"tokens/forward {s.tokens_per_forward:.2f}{p}{same}")
    print(f"  picker's pick: {pick}")
    return speedups


def _run(reg, name: str, ids, **gen):
    """One generation of method `name` with a fresh proposer (autoregressive for "ar")."""
    from .generate import autoregressive_generate, speculative_generate

    proposer = reg.proposer(name)
    if proposer is None:
        return autoregressive_generate(reg.target, ids, **gen)
    return speculative_generate(reg.target, proposer, ids, **gen)


def _load(model_arg):
    """(model, encode(prompt) -> list of ids, decode(ids) -> str or None, eos, registry kind)."""
    if model_arg == "tiny":  # test-only: bench/methods.py's seeded random Llama, byte "encoder"
        from types import SimpleNamespace

        from .bench.methods import load_model

        model, encode, eos, _ = load_model(SimpleNamespace(model="tiny", dtype="float32", device="cpu"))
        return model, encode, None, eos, "tiny"
    from .models import load_default, load_gguf

    if model_arg and model_arg.endswith(".gguf"):
        model, tok = load_gguf(model_arg)
    elif model_arg:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_arg, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(model_arg, local_files_only=True)
    else:
        model, tok = load_default()
    decode = lambda row: tok.decode(row, skip_special_tokens=True)  # noqa: E731
    return (model, lambda text: _chat_ids(tok, text)[0].tolist(), decode, _eos(tok, model),
            "custom" if model_arg else "default")


def generate_cmd(args) -> int:
    from .generate import autoregressive_generate, speculative_generate
    from .registry import Registry

    model, encode, decode, eos, kind = _load(args.model)
    if args.weights and kind == "tiny":
        raise ValueError("--weights does not apply to --model tiny (its learned methods use untrained heads)")
    ids_list = encode(args.prompt)
    ids = torch.tensor([ids_list])  # (1, T)
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
               top_p=args.top_p, eos_token_id=eos, seed=args.seed)
    if args.draft is not None:  # the older option: ngram | truncated[:L] | a draft model folder
        k = 5 if args.k is None else args.k
        out = speculative_generate(model, _proposer(args.draft, model, k), ids, **gen)
        label = f"speculative ({args.draft}, k={k})"
    else:
        reg = Registry(model, kind=kind, draft_k=args.k, weights=dict(args.weights or []))
        method = args.method or "ngram"
        if method == "auto":  # picker/auto.py: the pick at batch 1, k per step from the measured costs
            from .picker.auto import AutoConfig, build_auto

            a = build_auto(model, [ids_list], AutoConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                                         budget_s=args.budget_s), reg)
            print(f"picked: {a.method} ({a.recommendation.reason})")
            print(a.recommendation.table())
            method, proposer = a.method, a.fresh(reg)
        else:
            proposer = reg.proposer(method)
        if proposer is None:
            out = autoregressive_generate(reg.target, ids, **gen)
            label = "autoregressive"
        else:
            out = speculative_generate(reg.target, proposer, ids, **gen)
            label = a.label if args.method == "auto" else f"speculative ({reg.label(method)})"
    row = out.row(0)
    print(decode(row) if decode is not None else " ".join(map(str, row)))
    _report(label, out)
    return 0


def read_prompts(path: str) -> tuple:
    """(prompts, groups) from a file: JSONL with one object per line (the text in "turns"[0],
    "prompt", "text", "instruction" or "question"; the group in "category" if present), else one
    prompt per non-empty line."""
    import json

    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"no prompts in {path!r}")
    prompts, groups = [], []
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            text = (row.get("turns") or [None])[0] if isinstance(row.get("turns"), list) else None
            text = text or next((row[k] for k in ("prompt", "text", "instruction", "question")
                                 if isinstance(row.get(k), str)), None)
            if not text:
                raise ValueError(f"{path}:{n}: no prompt text (turns, prompt, text, instruction or question)")
            prompts.append(text)
            groups.append(str(row.get("category", "all")))
        else:
            prompts.append(line)
            groups.append("all")
    return prompts, groups


def pick_cmd(args) -> int:
    """`python -m specref pick`: calibrate on the prompts, print the predictions and the pick."""
    from . import picker
    from .picker import calibrate
    from .registry import Registry

    if args.budget_s is not None and args.budget_s <= 0:
        raise ValueError(f"--budget-s must be > 0, got {args.budget_s}")
    texts, groups = read_prompts(args.prompts)
    model, encode, _, _, kind = _load(args.model)
    reg = Registry(model, kind=kind, weights=dict(args.weights or []))
    cfg = picker.PickerConfig(methods=tuple(args.methods) if args.methods else None, temperature=args.temperature,
                              batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                              max_prompts=args.max_prompts, seed=args.seed,
                              budget_s="auto" if args.budget_s is None else args.budget_s)
    cal = calibrate(model, [encode(t) for t in texts], cfg, reg, groups=groups)
    pred = picker.predict(cal)
    method, reason = picker.choose(pred, cfg)
    used = cal.sample()
    cats = {g: sum(1 for _, h in used if h == g) for g in dict.fromkeys(g for _, g in used)}
    print(f"calibrated on {cal.prompts_used} of {cal.prompts_given} prompts in {cal.seconds:.1f}s "
          f"(+{cal.setup_seconds:.1f}s loading weights and measuring costs); seeded sample (--seed {cfg.seed}), "
          f"{len(cats)} of {len(set(groups or ['all']))} categories: "
          + ", ".join(f"{g} {n}" for g, n in cats.items()) + "\n")
    print(picker.prediction_table(pred, method))
    print(f"\npick: {method} - {reason}")
    out = dict(method=method, reason=reason, predicted=pred, groups={})
    for g in dict.fromkeys(r["group"] for r in cal.records):
        if g != "all":
            gp = picker.predict(cal, group=g)
            gm, why = picker.choose(gp, cfg)
            out["groups"][g] = dict(method=gm, reason=why, predicted=gp)
            print(f"  {g}: {gm} ({gp[gm]['speedup']:.2f}x predicted)")
    if args.json:
        picker.save(dict(out, calibration_s=cal.seconds, setup_s=cal.setup_seconds, budget_s=cal.budget_s,
                         records=cal.records,
                         sample=[dict(prompt=i, category=g) for i, g in used]), args.json)
        print(f"wrote {args.json}")
    return 0


def _method_name(s: str) -> str:
    """A registry method name or "auto" (argparse type: the error lists the valid names)."""
    from .registry import check_method

    if s == "auto":
        return s
    try:
        return check_method(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, auto") from None


def _method_list(s: str) -> list:
    """Comma-separated registry method names."""
    from .registry import check_method

    try:
        return [check_method(m.strip()) for m in s.split(",") if m.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("oracle", "bench", "train", "data", "corpus", "rebuild", "multiturn"):  # own parsers
        if argv[0] == "data":
            from .training.store import data_main as sub_main
        elif argv[0] == "corpus":
            from .training.committed_corpus import corpus_main as sub_main
        elif argv[0] == "oracle":
            from .oracle.cli import oracle_main as sub_main
        elif argv[0] == "bench":
            from .bench.runner import bench_main as sub_main
        elif argv[0] == "rebuild":
            from .training.rebuild import rebuild_main as sub_main
        elif argv[0] == "multiturn":
            from .bench.multiturn import multiturn_main as sub_main
        else:
            from .training.cli import train_main as sub_main
        return sub_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m specref", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="speculative decoding on the default model, with measured speed-up")
    d.add_argument("--prompt", default=None)
    d.add_argument("--draft", default="ngram", help="ngram | truncated[:L] | a local draft model folder")
    d.add_argument("--k", type=int, default=5)
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--temperature", type=float, default=0.7)
    d.add_argument("--compare", action="store_true",
                   help="then every --compare-methods method, greedy, on two prompts (48 new tokens)")
    d.add_argument("--compare-methods", type=_method_list, default=COMPARE_METHODS,
                   help=f"comma-separated method names (default {COMPARE_METHODS})")
    g = sub.add_parser("generate", help="generate from a prompt with speculative decoding")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default=None, help="local model folder or .gguf file (default: embedded); "
                   "'tiny': a random test model (for tests only: token ids in and out, untrained heads)")
    g.add_argument("--method", type=_method_name, default=None,
                   help="a method of registry.py (ar, ngram, eagle, hybrid, medusa, ...) or auto: the "
                   "picker's choice for this prompt (default ngram)")
    g.add_argument("--draft", default=None, help="instead of --method (older option): ngram | "
                   "truncated[:L] | a local draft model folder")
    g.add_argument("--weights", type=weights_item, action="append", metavar="KIND=PATH",
                   help="trained weights for a model that is not the default one, KIND one of "
                   f"{', '.join(WEIGHT_KINDS)} (repeatable), e.g. eagle=/path/eagle.safetensors; eagle, eagle3 "
                   "and medusa also take a published head's folder (docs/published_heads.md)")
    g.add_argument("--k", type=int, default=None,
                   help="with --method: the trained draft's k, the EAGLE head's upper bound, MTP's k "
                   "(default: each method's own rule; n-gram, lookahead and Medusa ignore it); "
                   "with --draft: k (default 5)")
    g.add_argument("--budget-s", type=float, default=20.0, help="--method auto: the picker's time budget (s)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    pk = sub.add_parser("pick", help="which method for your prompts: the picker (picker.py)")
    pk.add_argument("--prompts", required=True, help="JSONL (turns / prompt / text, optional category) or "
                    "one prompt per line")
    pk.add_argument("--model", default=None, help="local model folder or .gguf file (default: embedded); "
                    "'tiny': a random test model")
    pk.add_argument("--methods", type=_method_list, default=None, help="comma-separated candidates "
                    "(default: every lossless method the model has)")
    pk.add_argument("--weights", type=weights_item, action="append", metavar="KIND=PATH",
                    help="trained weights for a model that is not the default one (as for generate)")
    pk.add_argument("--temperature", type=float, default=0.0)
    pk.add_argument("--batch-size", type=int, default=1)
    pk.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per request of the workload")
    pk.add_argument("--max-prompts", type=int, default=None, help="most prompts calibrated on")
    pk.add_argument("--budget-s", type=float, default=None, help="calibration time bound (s); default: 5%% of the "
                    "workload's expected autoregressive decoding time, within 30-600 s, and at least one prompt of "
                    "every category (calibrate.budget_for)")
    pk.add_argument("--seed", type=int, default=0)
    pk.add_argument("--json", default=None, help="write the predictions and the calibration here")
    sub.add_parser("oracle", help="check a rejection sampler: python -m specref oracle --help")
    sub.add_parser("bench", help="benchmark every method: python -m specref bench --help")
    sub.add_parser("train", help="train a learned proposer: python -m specref train --help")
    sub.add_parser("data", help="the feature store of real text: python -m specref data --help")
    sub.add_parser("corpus", help="the committed training corpus: python -m specref corpus --help")
    sub.add_parser("rebuild", help="rebuild a committed weight file from the committed corpus: "
                   "python -m specref rebuild --help")
    sub.add_parser("multiturn", help="the greedy first answers of a multi-turn workload: python -m specref "
                   "multiturn --help")
    args = ap.parse_args(argv)
    if args.cmd == "generate" and args.draft is not None and args.method is not None:
        g.error("give --method or --draft, not both")
    if args.cmd == "demo":
        return demo(args)
    if args.cmd == "pick":
        return pick_cmd(args)
    return generate_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
