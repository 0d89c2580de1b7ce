"""The first answers of a multi-turn workload: `python -m specref multiturn --out FILE`.

Turn 1 of every conversation (workloads.load_conversations: the shipped specref/data/multiturn.jsonl,
or Spec-Bench's question file with --question-file) is answered once by plain greedy decoding
(`autoregressive_generate`, temperature 0) and stored as a first-answers file
(workloads.write_first_answers); workloads.second_turns then builds the second-turn requests
[user turn 1, assistant answer 1, user turn 2] from it. Building the file is a run of its own (one
greedy answer per conversation); the bench (`python -m specref bench --turns 2 --answers FILE`) and
the picker only read it. The bench's second-turn questions and their question file are chosen here
(second_turn_file, second_turn_questions); a question is a first turn (text) or a second turn's
messages (prompt_of), which the bench's encoder puts through the chat template.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import workloads


def second_turn_file(question_file: Optional[str], answers: str) -> Path:
    """The conversations of a second-turn bench: `question_file`; else the shipped set when the
    answers were made for it; else Spec-Bench's file ($SPECREF_SPEC_BENCH, required)."""
    if not Path(answers).is_file():
        raise ValueError(f"answers file {str(answers)!r} does not exist: write it with `python -m specref multiturn --out FILE`")
    if question_file:
        return workloads._resolve(question_file, "question file")
    meta, _ = workloads.load_first_answers(answers)
    if meta.get("questions", {}).get("sha256") == workloads.sha256_of(workloads.MULTITURN):
        return workloads.MULTITURN
    return workloads.spec_bench_file(None, required=True)


def second_turn_questions(question_path, answers, categories: Optional[tuple], per_category: Optional[int]) -> List[dict]:
    """The chosen conversations' second turns ({"question_id", "category", "messages"}), the first
    `per_category` of each category in file order; ValueError for answers to another question file."""
    rows = workloads.select(workloads.second_turns(question_path, answers), categories, per_category)
    if not rows:
        raise ValueError(f"no conversation of two or more turns selected from {workloads.portable_name(question_path)}")
    return rows


def answers_info(answers) -> dict:
    """A first-answers file as a result names it: file name, sha256, the model and budget that made it."""
    meta, texts = workloads.load_first_answers(answers)
    return {"name": workloads.portable_name(answers), "sha256": workloads.sha256_of(answers), "answers": len(texts),
            **{k: meta.get(k) for k in ("model", "decoding", "max_new_tokens")}}


def prompt_of(question: dict):
    """What the bench encodes: a second turn's messages, else the first turn's text."""
    return question["messages"] if "messages" in question else question["turns"][0]


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
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the first answers' budget (default 256)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    a = ap.parse_args(argv)
    if a.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device is available")
    path = workloads.MULTITURN if a.question_file is None else workloads._resolve(a.question_file, "question file")
    rows = workloads.load_conversations(path)[: a.limit]
    if not rows:
        ap.error(f"{workloads.portable_name(path)} has no conversation of two or more turns")
    if a.model == "default":
        from ..models import load_default

        model, tok = load_default(device=a.device)
        name = "SmolLM2-135M-Instruct (embedded GGUF, dequantised)"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True).to(a.device).eval()
        tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
        name = workloads.portable_name(a.model)
    eos = model.generation_config.eos_token_id
    from tqdm.auto import tqdm

    answers = first_answers(tqdm(rows, desc="first answers"), greedy_answerer(model, tok, a.max_new_tokens, tok.eos_token_id if eos is None else eos))
    workloads.write_first_answers(a.out, path, answers, name, a.max_new_tokens)
    print(f"wrote {len(answers)} first answers of {workloads.portable_name(path)} to {a.out}")
    return 0
