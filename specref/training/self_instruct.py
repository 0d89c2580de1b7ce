"""Target-written requests: the target writes the user turns that it then answers (self-distillation).

Magpie (Xu et al. 2024, "Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"): an aligned chat model, given its chat template up to the start of a user turn, samples
a user request, because it has learned what users write there. We steer each sample with a
system-turn hint: a kind of request (the kinds people send an assistant: writing, roleplay,
reasoning, maths, coding, extraction, STEM, humanities, translation, summarising or answering
about a pasted passage, general questions) and a topic, both written for specref. The requests
are then answered by data.distill exactly like the seed instructions, through the default chat
template (the hint is NOT part of the training prompt), so the training text is what the target
writes to what a user might send it.

Filtering (Self-Instruct, Wang et al. 2023, dedupes and filters its generated tasks likewise): a
request must end with the end-of-turn token inside max_new_tokens (not truncated), hold at least
`min_chars` characters, not repeat an earlier request (case- and space-normalised), and share no
word 13-gram with any turn of the development questions (contamination.py; the counts are
recorded). Deterministic in (model, seed); written to the data folder as `requests_#####.json`
chunks (rows and the filter's counts), each atomically, so an interrupted run resumes at the first
missing chunk.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set, Tuple

import torch

from . import data
from .contamination import NGRAM, checked_against, dev_ngrams, eval_files, word_ngrams

KINDS = {  # category -> system-turn hints (written for specref)
    "writing": ("The user asks you to write a short story.", "The user asks you to write a poem.",
                "The user asks you to write an email or a letter.", "The user asks you to write a blog post.",
                "The user asks for help writing a speech or an essay.", "The user asks you to improve their text."),
    "roleplay": ("The user asks you to play a character in a role-play.",
                 "The user asks you to pretend to be a famous person and answer as them.",
                 "The user starts a role-play game and gives you a role."),
    "reasoning": ("The user asks a logic puzzle.", "The user asks a question that needs careful step-by-step "
                  "reasoning.", "The user asks a riddle or a brain teaser."),
    "math": ("The user asks a maths question.", "The user asks you to solve an equation.",
             "The user asks a maths word problem.", "The user asks about geometry or probability."),
    "coding": ("The user asks for Python code.", "The user asks for help with a bug in their code.",
               "The user asks how to do something in JavaScript.", "The user asks you to write a SQL query.",
               "The user pastes a piece of code and asks you to explain it."),
    "extraction": ("The user pastes a text and asks you to extract information from it.",
                   "The user pastes a text and asks you to turn it into a list or a table."),
    "stem": ("The user asks a science question.", "The user asks about technology or engineering.",
             "The user asks a question about biology or medicine.", "The user asks about physics or chemistry."),
    "humanities": ("The user asks a question about history.", "The user asks about philosophy or ethics.",
                   "The user asks about art, music or literature.", "The user asks about economics or society."),
    "translation": ("The user asks you to translate a sentence into French.",
                    "The user asks you to translate a sentence into German.",
                    "The user asks you to translate a sentence into Spanish.",
                    "The user writes in another language and asks for an English translation."),
    "summarization": ("The user pastes a passage and asks you to summarise it.",
                      "The user pastes an article and asks for its main points."),
    "qa": ("The user asks a general knowledge question.", "The user asks for advice.",
           "The user asks for a recommendation.", "The user asks how something works."),
    "rag": ("The user pastes a passage and asks a question about it.",
            "The user gives you some facts and asks a question that they answer."),
}

TOPICS = (  # broad topics, crossed with the kinds (written for specref)
    "cooking", "travel", "sport", "health", "school", "work and careers", "money", "space", "the ocean",
    "animals", "plants and gardening", "weather and climate", "cities", "music", "films", "books", "games",
    "computers", "the internet", "phones", "cars", "trains", "energy", "history of science", "ancient Rome",
    "the Middle Ages", "modern history", "languages", "friendship", "family", "holidays", "shopping",
    "fashion", "architecture", "painting", "photography", "mathematics", "statistics", "physics",
    "chemistry", "biology", "medicine", "psychology", "economics", "law", "politics", "the environment",
    "farming", "small business", "marketing", "social media", "robots", "artificial intelligence",
    "data", "security", "mountains", "rivers", "islands", "festivals", "food from around the world",
    "coffee and tea", "pets", "birds", "insects", "the human body", "sleep", "exercise", "children",
    "old age", "volunteering", "news", "science fiction", "fairy tales", "heroes", "mysteries",
)


@dataclass(frozen=True)
class SelfInstructConfig:
    """Settings of the request writing."""

    num_requests: int = 1000  # requests kept (after filtering)
    temperature: float = 0.9  # sampling of the requests
    top_p: float = 0.95
    max_new_tokens: int = 64  # longest request; longer ones are dropped as truncated
    min_chars: int = 20
    batch_size: int = 64
    chunk: int = 256  # requests sampled per resumable chunk file
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_new_tokens", "batch_size", "chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (requests are sampled), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


def hints(n: int, seed: int = 0) -> List[Tuple[str, str]]:
    """n (category, system hint) pairs: categories in turn, hint and topic drawn by `seed`."""
    g = torch.Generator().manual_seed(seed)
    cats = sorted(KINDS)
    out = []
    for i in range(n):
        c = cats[i % len(cats)]
        h = KINDS[c][int(torch.randint(len(KINDS[c]), (1,), generator=g))]
        t = TOPICS[int(torch.randint(len(TOPICS), (1,), generator=g))]
        out.append((c, f"{h} The topic is {t}."))
    return out


def user_prefix(tokenizer, system: str) -> List[int]:
    """The chat template's tokens up to the start of the user's text, with `system` as the system turn.

    Found by rendering a sentinel user message and cutting at it, so any chat template works."""
    mark = "\u2063SPECREF\u2063"
    text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": mark}], tokenize=False)
    if mark not in text:
        raise ValueError("the tokenizer's chat template does not render the user's message verbatim")
    return tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().lower())


def write_requests(model, tokenizer, out_dir, cfg: SelfInstructConfig = SelfInstructConfig(),
                   dev_grams: Optional[Set[tuple]] = None, progress: bool = True) -> List[dict]:
    """The target writes cfg.num_requests requests (resuming out_dir's chunks); returns the rows
    {id, category, instruction}, the first cfg.num_requests kept."""
    from tqdm.auto import tqdm

    from ..generate import autoregressive_generate

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chunks = sorted(out.glob("requests_*.json"))
    rows: List[dict] = [r for p in chunks for r in json.loads(p.read_text())["rows"]]
    seen = {_norm(r["instruction"]) for r in rows}
    eos = data._eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    dev = next(model.parameters()).device
    bar = tqdm(total=cfg.num_requests, initial=min(len(rows), cfg.num_requests), desc="self-instruct",
               unit="request", disable=not progress)
    c = len(chunks)
    while len(rows) < cfg.num_requests:
        pairs = hints(cfg.chunk, cfg.seed * 7919 + c)
        counts = {"sampled": 0, "truncated": 0, "short": 0, "duplicate": 0, "dev_overlap": 0,
                  "dev_checked": dev_grams is not None}
        fresh: List[dict] = []
        for b0 in range(0, cfg.chunk, cfg.batch_size):
            part = pairs[b0: b0 + cfg.batch_size]
            ids, mask = data.left_pad([user_prefix(tokenizer, h) for _, h in part], pad)  # (B, T)
            gen = autoregressive_generate(model, ids.to(dev), mask.to(dev), max_new_tokens=cfg.max_new_tokens,
                                          temperature=cfg.temperature, top_p=cfg.top_p, eos_token_id=eos,
                                          seed=cfg.seed * 100003 + c * 1009 + b0)
            for j, (cat, _) in enumerate(part):
                toks = gen.row(j)
                counts["sampled"] += 1
                if not toks or toks[-1] not in eos:
                    counts["truncated"] += 1
                    continue
                text = tokenizer.decode(toks[:-1], skip_special_tokens=True).strip()
                key = _norm(text)
                if len(text) < cfg.min_chars:
                    counts["short"] += 1
                elif key in seen:
                    counts["duplicate"] += 1
                elif dev_grams is not None and not dev_grams.isdisjoint(word_ngrams(text, NGRAM)):
                    counts["dev_overlap"] += 1
                else:
                    seen.add(key)
                    fresh.append({"id": 200000 + len(rows) + len(fresh), "category": "self_" + cat,
                                  "instruction": text})
        if not fresh and counts["truncated"] == counts["sampled"]:
            raise ValueError(f"none of {counts['sampled']} sampled requests ended with the end-of-turn token "
                             f"{eos} within {cfg.max_new_tokens} tokens: raise max_new_tokens or check the "
                             "model's generation_config.eos_token_id")
        path = out / f"requests_{c:05d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"counts": counts, "rows": fresh}, indent=0))
        os.replace(tmp, path)  # a chunk is there whole or not at all: resumable
        rows += fresh
        c += 1
        bar.update(min(len(fresh), cfg.num_requests - bar.n))
    bar.close()
    return rows[: cfg.num_requests]


def filter_counts(out_dir) -> dict:
    """The filter's counts summed over the written chunks."""
    total: dict = {}
    for p in sorted(Path(out_dir).glob("requests_*.json")):
        for k, v in json.loads(p.read_text())["counts"].items():
            total[k] = (total.get(k, True) and v) if isinstance(v, bool) else total.get(k, 0) + v
    return total


def distill(model, tokenizer, out_dir, config: "data.DistillConfig", progress: bool = True,
            evals: Optional[Sequence] = None, **kwargs) -> dict:
    """data.distill, with config.self_instruct requests written by the target first (into out_dir,
    filtered against the 13-grams of the evaluation files `evals`, default contamination.eval_files())."""
    if not config.self_instruct:
        return data.distill(model, tokenizer, out_dir, config, progress=progress, **kwargs)
    evals = eval_files() if evals is None else list(evals)
    grams = dev_ngrams(evals) if evals else None
    chunk = config.request_chunk or min(256, max(config.batch_size, 2 * config.self_instruct))
    cfg = SelfInstructConfig(num_requests=config.self_instruct, batch_size=config.batch_size, seed=config.seed,
                             chunk=chunk)
    rows = write_requests(model, tokenizer, out_dir, cfg, grams, progress)
    info = {"method": "Magpie-style user turns under kind/topic hints (self_instruct.py)",
            "requests": len(rows), "per_category": categories(rows), "filter": filter_counts(out_dir),
            "dev_overlap_checked_against": checked_against(evals) or None}
    return data.distill(model, tokenizer, out_dir, config, progress=progress, requests=(rows, info), **kwargs)


def categories(rows: Iterable[dict]) -> dict:
    """Requests per category."""
    counts: dict = {}
    for r in rows:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    return dict(sorted(counts.items()))
