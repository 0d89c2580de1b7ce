"""`python -m specref demo | generate | oracle | bench | train | data`: the command-line entry points.

demo     - speculative decoding on the embedded default model (SmolLM2-135M-Instruct), greedy and
           sampled, with the speed-up over autoregressive_generate measured in the same run.
generate - one prompt through any local model folder or GGUF file, with a chosen proposer.
oracle   - check a rejection sampler for losslessness (oracle/).
bench    - every method side by side on Spec-Bench prompts (bench/, writes BENCHMARKS.md).
train    - training of the draft, the EAGLE head, Medusa heads or MTP modules (training/).
data     - the feature store: real text scored teacher-forced by the target (training/store.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

DEMO_TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the coast "
    "of Queensland, Australia. The Great Barrier Reef can be seen from outer space and is the "
    "world's biggest single structure made by living organisms. This reef structure is composed of "
    "and built by billions of tiny organisms, known as coral polyps."
)
DEMO_PROMPT = "Summarize the following text in three sentences, reusing its wording:\n\n" + DEMO_TEXT


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
    return 0


def generate_cmd(args) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .generate import speculative_generate
    from .models import load_default, load_gguf

    if args.model and args.model.endswith(".gguf"):
        model, tok = load_gguf(args.model)
    elif args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    else:
        model, tok = load_default()
    ids = _chat_ids(tok, args.prompt)
    out = speculative_generate(model, _proposer(args.draft, model, args.k), ids,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, eos_token_id=_eos(tok, model), seed=args.seed)
    print(tok.decode(out.row(0), skip_special_tokens=True))
    _report("speculative", out)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("oracle", "bench", "train", "data"):  # subcommands with their own parsers
        if argv[0] == "data":
            from .training.store import data_main as sub_main
        elif argv[0] == "oracle":
            from .oracle.cli import oracle_main as sub_main
        elif argv[0] == "bench":
            from .bench.runner import bench_main as sub_main
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
    g = sub.add_parser("generate", help="generate from a prompt with speculative decoding")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default=None, help="local model folder or .gguf file (default: embedded)")
    g.add_argument("--draft", default="ngram")
    g.add_argument("--k", type=int, default=5)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    sub.add_parser("oracle", help="check a rejection sampler: python -m specref oracle --help")
    sub.add_parser("bench", help="benchmark every method: python -m specref bench --help")
    sub.add_parser("train", help="train a learned proposer: python -m specref train --help")
    sub.add_parser("data", help="the feature store of real text: python -m specref data --help")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        return demo(args)
    return generate_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
