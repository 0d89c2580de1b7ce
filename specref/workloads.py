"""The prompt sets the bench, the picker and the training checks run on, found without a path of
this machine.

- The default workload ships with specref: `specref/data/workload.jsonl`, 52 prompts in the 13
  categories of Spec-Bench's layout, written by the project (long-context categories quote licence
  texts and library docstrings; sources and licences in `workload_manifest.json`). It is NOT
  Spec-Bench: numbers measured on it are labelled `specref-workload`.
- Spec-Bench (Xia et al. 2024, "Unlocking Efficiency in Large Language Model Inference: A
  Comprehensive Survey of Speculative Decoding"): 480 questions in 13 categories (MT-Bench's 8,
  translation, summarization, QA, math reasoning, RAG), published as `data/spec_bench/question.jsonl`
  in github.com/hemingkx/Spec-Bench. specref never downloads it: give the file (or any JSONL of its
  shape: question_id, category, turns) by `--question-file` or the `SPECREF_SPEC_BENCH` setting (a
  file or the folder holding question.jsonl). The results documents and the training corpus's
  overlap check use the project's development split found through that one setting.

- Multi-turn (second turns): a conversation file has rows with two or more `turns` (Spec-Bench's
  MT-Bench rows, or `specref/data/multiturn.jsonl`: 50 short two-turn conversations in 9 categories
  written by the project, no text of any evaluation set, zero 8-gram overlap with Spec-Bench's
  questions). The second turn's prompt is [user: turn 1, assistant: answer 1, user: turn 2]; the
  first answers come from plain greedy decoding of turn 1, made once and stored (a first-answers
  file: a `meta` line naming the model, the question file by name and sha256, the decoding; then
  one {"question_id", "answer"} line per conversation; `python -m specref multiturn` writes it).
  Workloads that reuse earlier text (SuffixDecoding's global tree) are measured on them.

A result names its workload portably (`describe`): its name, sha256 and row count, never a path.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

SPEC_BENCH_ENV = "SPECREF_SPEC_BENCH"
DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "data" / "workload.jsonl"
DEFAULT_NAME = "specref-workload"
MULTITURN = Path(__file__).resolve().parent / "data" / "multiturn.jsonl"  # the shipped two-turn set
SPEC_BENCH_HELP = (
    "Spec-Bench (Xia et al. 2024: 480 questions in 13 categories) is not shipped with specref; its "
    "question file is published as data/spec_bench/question.jsonl in https://github.com/hemingkx/Spec-Bench. "
    f"Pass it with --question-file FILE or set {SPEC_BENCH_ENV}=FILE (or the folder holding question.jsonl)")


def _resolve(cand: str, what: str) -> Path:
    p = Path(cand).expanduser()
    p = p / "question.jsonl" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} does not exist. {SPEC_BENCH_HELP}")
    return p


def spec_bench_file(path: Optional[str] = None, required: bool = True) -> Optional[Path]:
    """Spec-Bench's question file: `path`, else $SPECREF_SPEC_BENCH. Neither given: ValueError that
    says what Spec-Bench is and where it is published (required), else None."""
    if path:
        return _resolve(str(path), "question file")
    env = os.environ.get(SPEC_BENCH_ENV)
    if env:
        return _resolve(env, f"${SPEC_BENCH_ENV}")
    if required:
        raise ValueError(f"no Spec-Bench question file given. {SPEC_BENCH_HELP}")
    return None


def question_file(path: Optional[str] = None) -> Path:
    """The bench's prompts: `path`, else $SPECREF_SPEC_BENCH, else the default workload (not Spec-Bench)."""
    return spec_bench_file(path, required=False) or DEFAULT_WORKLOAD


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe(path) -> dict:
    """A prompt file by name, not path: {"name", "sha256", "rows", "default"}; the default workload
    is named `specref-workload`, any other file by its file name."""
    path = Path(path)
    default = path.resolve() == DEFAULT_WORKLOAD
    with open(path, encoding="utf-8") as f:
        rows = sum(1 for line in f if line.strip())
    return {"name": DEFAULT_NAME if default else path.name, "sha256": sha256_of(path), "rows": rows,
            "default": default}


def portable_name(path_or_name) -> str:
    """A file or folder named in a result: its last component, never a path of this machine."""
    return Path(str(path_or_name)).name or str(path_or_name)


def label(desc: dict) -> str:
    """One line for a report: which workload ran."""
    if desc.get("default"):
        return (f"workload: {DEFAULT_NAME} ({desc['rows']} prompts shipped with specref; NOT Spec-Bench: "
                f"give Spec-Bench with --question-file or {SPEC_BENCH_ENV})")
    return f"workload: {desc['name']} (sha256 {desc['sha256'][:12]}, {desc['rows']} rows)"


def manifest() -> dict:
    """The default workload's manifest (sources, licences, sha256)."""
    return json.loads((DEFAULT_WORKLOAD.parent / "workload_manifest.json").read_text(encoding="utf-8"))


def select(rows: List[dict], categories: Optional[tuple], per_category: Optional[int]) -> List[dict]:
    """The first `per_category` rows of each chosen category (None: all), in file order
    (reproducible); ValueError naming the file's categories for an unknown one."""
    known = list(dict.fromkeys(r["category"] for r in rows))
    bad = [c for c in categories or () if c not in known]
    if bad:
        raise ValueError(f"unknown categories {bad}; the question file has {known}")
    seen: Dict[str, int] = {}
    out = []
    for r in rows:
        c = r["category"]
        if categories and c not in categories:
            continue
        if per_category is None or seen.get(c, 0) < per_category:
            out.append(r)
            seen[c] = seen.get(c, 0) + 1
    return out


def load_conversations(path=MULTITURN) -> List[dict]:
    """The rows of a question file with at least two turns (each turn a string), in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            turns = row.get("turns")
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{portable_name(path)} line {n}: 'turns' must be a list of strings, got {turns!r}")
            if len(turns) >= 2:
                out.append(row)
    return out


def write_first_answers(path, question_path, answers: Dict[object, str], model: str, max_new_tokens: int) -> None:
    """Store the greedy first answers ({question_id: text}) of a question file's conversations."""
    meta = {"model": model, "questions": describe(question_path), "decoding": "greedy",
            "max_new_tokens": int(max_new_tokens)}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"meta": meta}, ensure_ascii=False) + "\n")
        for qid, text in answers.items():
            f.write(json.dumps({"question_id": qid, "answer": text}, ensure_ascii=False) + "\n")


def load_first_answers(path) -> Tuple[dict, Dict[object, str]]:
    """(meta, {question_id: first answer}) of a first-answers file."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or "meta" not in rows[0]:
        raise ValueError(f"{portable_name(path)} is not a first-answers file (its first line has no 'meta')")
    return rows[0]["meta"], {r["question_id"]: r["answer"] for r in rows[1:]}


def second_turns(question_path, answers_path) -> List[dict]:
    """The second-turn requests: {"question_id", "category", "messages"} per conversation, messages
    [user turn 1, assistant first answer, user turn 2] for a chat template. ValueError when the
    answers were made for another question file (sha256) or miss a conversation."""
    meta, answers = load_first_answers(answers_path)
    sha = sha256_of(question_path)
    if meta.get("questions", {}).get("sha256") != sha:
        raise ValueError(f"{portable_name(answers_path)} holds answers to another question file "
                         f"({meta.get('questions', {}).get('name')!r}), not {portable_name(question_path)}")
    out = []
    for row in load_conversations(question_path):
        if row["question_id"] not in answers:
            raise ValueError(f"{portable_name(answers_path)} has no first answer for question {row['question_id']!r}")
        t1, t2 = row["turns"][:2]
        out.append({"question_id": row["question_id"], "category": row.get("category", ""),
                    "messages": [{"role": "user", "content": t1},
                                 {"role": "assistant", "content": answers[row["question_id"]]},
                                 {"role": "user", "content": t2}]})
    return out
