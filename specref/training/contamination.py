"""The contamination check every stage of the data path runs: word 13-grams shared with evaluation text.

A training text that shares a WORD 13-gram (lower-cased \\w+ runs: the GPT-3 paper's
decontamination unit, Brown et al. 2020 App. C) with any turn of an evaluation file is dropped
(real-text sources: corpus.overlap_filter; target-written requests: self_instruct.py; real-passage
requests: corpus.passage_requests) or refused (a corpus part: committed_corpus.add_part). The
evaluation files are the ones given, by default Spec-Bench's development split through
$SPECREF_SPEC_BENCH (`eval_files`); manifests record them by name and sha256 (`checked_against`),
never by path.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Optional, Sequence, Set, Tuple

NGRAM = 13  # contamination n-gram length, in words


def word_ngrams(text: str, n: int = NGRAM) -> Set[Tuple[str, ...]]:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i: i + n]) for i in range(len(w) - n + 1)}


def eval_files(paths: Optional[Sequence] = None) -> List[Path]:
    """The evaluation files a contamination check runs against: `paths`, else Spec-Bench's
    development split through $SPECREF_SPEC_BENCH, else none (the check is skipped; the manifest
    says so)."""
    from ..workloads import spec_bench_file

    if paths:
        return [spec_bench_file(p) for p in paths]
    found = spec_bench_file(required=False)
    return [found] if found else []


def checked_against(paths: Sequence) -> list:
    """What a manifest records of the files checked: name, sha256, rows (never a path)."""
    from ..workloads import describe

    return [{k: v for k, v in describe(p).items() if k != "default"} for p in paths]


def dev_ngrams(paths: Sequence, n: int = NGRAM) -> Set[Tuple[str, ...]]:
    """The word n-grams of the evaluation files `paths` (a path alone is one file): every turn, or
    the prompt / question / instruction / text field of a row without turns."""
    grams: Set[Tuple[str, ...]] = set()
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for line in open(path, encoding="utf-8"):
            if line.strip():
                row = json.loads(line)
                texts = row.get("turns") or [row.get(k) for k in ("prompt", "question", "instruction", "text")]
                for t in texts:
                    if isinstance(t, str):
                        grams |= word_ngrams(t, n)
    return grams


def eval_ngrams(files: Sequence, n: int = NGRAM):
    """(word n-grams of the evaluation files' texts, their records: name, sha256, rows); ValueError
    naming a file that does not exist."""
    for path in files:
        if not Path(path).is_file():
            raise ValueError(f"evaluation file {str(path)!r} does not exist")
    return dev_ngrams(files, n), checked_against(files)
