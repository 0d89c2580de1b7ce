"""The first answers of a multi-turn workload: `python -m specref multiturn --out FILE`.

Turn 1 of every conversation (workloads.load_conversations: the shipped specref/data/multiturn.jsonl,
or Spec-Bench's question file with --question-file) is answered once by plain greedy decoding
(`autoregressive_generate`, temperature 0) and stored as a first-answers file
(workloads.write_first_answers); workloads.second_turns then builds the second-turn requests
[user turn 1, assistant answer 1, user turn 2] from it. Building the file is a run of its own (one
greedy answer per conversation); the bench and the picker only read it.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional

from .. import workloads


def first_answers(rows: List[dict], answer: Callable[[List[dict]], str]) -> Dict[object, str]:
    """{question_id: answer([user turn 1])} for every conversation, in order."""
    return {row["question_id"]: answer([{"role": "user", "content": row["turns"][0]}]) for row in rows}


def greedy_answerer(model, tok, max_new_tokens: int, eos) -> Callable[[List[dict]], str]:
    """messages -> the model's greedy answer text (the chat template, specref's plain decoding)."""
    import torch

    from ..generate import autoregressive_generate

    def answer(messages: List[dict]) -> str:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        out = autoregressive_generate(model, torch.tensor([list(ids)], device=model.device),
                                      max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos)
        return tok.decode(out.row(0), skip_special_tokens=True)
    return answer


def multiturn_main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specref multiturn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--question-file", default=None, help="conversations (rows with 2+ turns; default: the "
                    "shipped specref/data/multiturn.jsonl; Spec-Bench's question.jsonl for its MT-Bench rows)")
    ap.add_argument("--out", required=True, help="the first-answers file to write (JSONL)")
    ap.add_argument("--model", default="default", help="'default' (embedded) or a local model folder")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    a = ap.parse_args(argv)
    path = workloads.MULTITURN if a.question_file is None else workloads._resolve(a.question_file, "question file")
    rows = workloads.load_conversations(path)[: a.limit]
    if not rows:
        ap.error(f"{workloads.portable_name(path)} has no conversation of two or more turns")
    if a.model == "default":
        from ..models import load_default

        model, tok = load_default()
        name = "SmolLM2-135M-Instruct (embedded GGUF, dequantised)"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
        name = workloads.portable_name(a.model)
    eos = model.generation_config.eos_token_id
    answers = first_answers(rows, greedy_answerer(model, tok, a.max_new_tokens, tok.eos_token_id if eos is None else eos))
    workloads.write_first_answers(a.out, path, answers, name, a.max_new_tokens)
    print(f"wrote {len(answers)} first answers of {workloads.portable_name(path)} to {a.out}")
    return 0
