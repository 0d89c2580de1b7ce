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

A result names its workload portably (`describe`): its name, sha256 and row count, never a path.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

SPEC_BENCH_ENV = "SPECREF_SPEC_BENCH"
DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "data" / "workload.jsonl"
DEFAULT_NAME = "specref-workload"
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
