"""Growing the corpus: the target's own answers to instructions, written as a distilled folder.

Drafts and heads are trained on what the target itself writes (Medusa-2's and EAGLE's
"self-distillation", Cai et al. 2024 Sec. 3.3; Li et al. 2024): the target answers a seed list of
instructions (specref/data/instructions.jsonl: hand-written templates x topics, never Spec-Bench)
with specref's own autoregressive decoding through the request queue (scheduler.py: a row whose
answer ends takes the next instruction; each instruction its own seed), at a configured temperature.
Optionally the first stage also answers requests that the target itself wrote (`self_instruct`:
self_instruct.py, Magpie-style user turns over the kinds of request people send an assistant).
An optional second stage (`passage_prompts`) quotes the target's own first-stage answers as
passages in new instructions (summarise, answer questions about, rewrite, proofread, translate,
compare two texts): prompts of a few hundred tokens whose answers copy from the context, as
Spec-Bench's summarisation / RAG / extraction / translation prompts do, without any evaluation
text. A third stage (`real_passages`) quotes REAL text as the passage instead
(corpus.passage_requests: documentation prose, and the Debian Reference in four other languages
to translate): the answers are still the target's own.

This is where the data path starts: `python -m specref data --distilled DIR --self-instruct N
... --distill-only` writes DIR, `python -m specref corpus add DIR` appends it to the committed
corpus (committed_corpus.py), whose export (a folder in this same format) the store scores
(store/). With config.topk > 0 the answers also keep the target's top-k log-probabilities from
one frozen forward (store.scoring.score: the LM head only at the answer positions); the command
writes none (topk 0): the store scores every position itself.

Storage: `shard_#####.safetensors`, each holding a group of sequences as flat tensors
(`tokens` (sum L,), `offsets` (S+1,), `prompt_lens` (S,), and when stored `topk_ids` /
`topk_logprobs` (sum R, K) aligned with the response tokens: row j of a sequence is the target's
distribution that predicted its response token j), and `manifest.json` (seed, counts, model
fingerprint, generation settings). Shards are written atomically, so an interrupted run resumes at
the first missing shard, and read one at a time (`iter_sequences`).
Seq, Batch, collate (store/batches.py) and teacher_topk (store/scoring.py) are also importable from
here. Left out: multi-turn conversations.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import torch

from ..weights import fingerprint
from .store.batches import Batch, Seq, collate  # noqa: F401 (the trainer's types, also read from here)
from .store.scoring import TOPK, score, teacher_topk  # noqa: F401

INSTRUCTIONS = Path(__file__).resolve().parents[1] / "data" / "instructions.jsonl"
FORMAT = 1  # bump when the shard layout changes


@dataclass(frozen=True)
class DistillConfig:
    """Settings of the self-distillation data generation."""

    seed: int = 0  # shuffles the instructions and seeds sampling (temperature > 0)
    num_instructions: Optional[int] = None  # None: all of instructions.jsonl
    max_new_tokens: int = 128  # longest response per instruction (Spec-Bench runs use 128)
    temperature: float = 0.0  # 0: greedy responses, as in the greedy evaluation
    batch_size: int = 16  # prompts generated together
    shard_size: int = 64  # sequences per shard file
    topk: int = TOPK  # target top-k log-probs stored per response position (0: none)
    passage_prompts: int = 0  # second stage: prompts that quote the target's own first-stage
    # answers as a passage (summarise / answer about / rewrite / proofread / translate it)
    self_instruct: int = 0  # first stage too: this many requests written by the target itself
    # (self_instruct.py, Magpie-style), answered like the seed instructions
    real_passages: int = 0  # a third stage: requests quoting REAL text as the passage (corpus.
    # passage_requests: summarise / answer about / extract from / translate documentation prose)
    request_chunk: Optional[int] = None  # self_instruct: requests sampled per resumable chunk file,
    # in batches of at most batch_size, so a chunk below batch_size caps the request batch (a GPU's
    # large batch wants request_chunk >= batch_size). None: min(256, max(batch_size, 2 * self_instruct)),
    # what the committed corpus parts were written with (their commands rebuild them unchanged)
    refill: str = "row"  # scheduler.schedule's queue: "row" (a finished row takes the next prompt at
    # once) or "batch" (static batches, each waiting for its slowest row); the answers are the same

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "shard_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("topk", "passage_prompts", "self_instruct", "real_passages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.request_chunk is not None and (isinstance(self.request_chunk, bool)
                                               or not isinstance(self.request_chunk, int) or self.request_chunk < 1):
            raise ValueError(f"request_chunk must be None or an int >= 1, got {self.request_chunk!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.refill not in ("row", "batch"):
            raise ValueError(f"refill must be 'row' or 'batch', got {self.refill!r}")


def load_instructions(path=INSTRUCTIONS, limit: Optional[int] = None, seed: int = 0) -> List[dict]:
    """The seed instructions, shuffled by `seed`, the first `limit` of them."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [rows[i] for i in perm]
    return rows if limit is None else rows[:limit]


def chat_prompt_ids(tokenizer, text: str) -> List[int]:
    """One user turn through the tokenizer's chat template, ready for the assistant's answer."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0):
    """List of token lists -> (ids (B, T), attention_mask (B, T)), left-padded."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # (B, T)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
        mask[b, T - len(r):] = 1
    return ids, mask


# ----------------------------------------------------------------------------- shards


def write_shard(path, seqs: Sequence[Seq]) -> None:
    """Write sequences into one safetensors shard (atomically: temp file, then rename)."""
    from safetensors.torch import save_file

    lens = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)  # (S,)
    tensors = {
        "tokens": torch.cat([s.tokens.to(torch.int32) for s in seqs]),  # (sum L,)
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),  # (S+1,)
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),  # (S,)
    }
    if all(s.topk_ids is not None for s in seqs):
        tensors["topk_ids"] = torch.cat([s.topk_ids.to(torch.int32) for s in seqs])  # (sum R, K)
        tensors["topk_logprobs"] = torch.cat([s.topk_logprobs.to(torch.float16) for s in seqs])  # (sum R, K)
    tmp = str(path) + ".tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": str(FORMAT)})
    os.replace(tmp, path)


def read_shard(path) -> List[Seq]:
    """The sequences of one shard."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    off, P = t["offsets"].tolist(), t["prompt_lens"].tolist()
    seqs, r = [], 0
    for i in range(len(P)):
        tok = t["tokens"][off[i]: off[i + 1]].long()  # (L,)
        R = len(tok) - P[i]
        s = Seq(tok, P[i])
        if "topk_ids" in t:
            s.topk_ids = t["topk_ids"][r: r + R].long()  # (R, K)
            s.topk_logprobs = t["topk_logprobs"][r: r + R].float()  # (R, K)
        r += R
        seqs.append(s)
    return seqs


def shard_paths(folder) -> List[Path]:
    """The shards of a data folder: first-stage ones (shard_#####) first, then second-stage ones."""
    return sorted(Path(folder).glob("shard_*.safetensors"))  # "shard_0..." sorts before "shard_p..."


def iter_sequences(folder, paths: Optional[Sequence[Path]] = None) -> Iterator[Seq]:
    """Stream every sequence of a data folder (or of the given shards), one shard in memory at a time."""
    for p in (shard_paths(folder) if paths is None else paths):
        yield from read_shard(p)


def read_manifest(folder) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{folder} holds no manifest.json: not a specref distillation folder")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- generation


def _eos_ids(model, tokenizer) -> List[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


PASSAGE_TEMPLATES = (  # written for specref; {p} is one passage, {a} / {b} two
    ("summarization", "Summarize the following text in two or three sentences.\n\n{p}"),
    ("summarization", "Write a one-paragraph summary of this text for a busy reader.\n\nText: {p}"),
    ("rag", "Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: What are the main "
            "points of the passage?"),
    ("rag", "Use only the information in the text below to answer: what does it say, and what does it "
            "leave out?\n\n{p}"),
    ("extraction", "Extract the key facts and names from this text as a bulleted list.\n\n{p}"),
    ("extraction", "List every number, date or quantity mentioned in the following text, with what it "
                   "refers to.\n\n{p}"),
    ("writing", "Rewrite the following text so that a ten-year-old could understand it.\n\n{p}"),
    ("writing", "Proofread the following text and return the corrected version.\n\n{p}"),
    ("translation", "Translate the following text into French.\n\n{p}"),
    ("translation", "Translate the following text into Spanish.\n\n{p}"),
    ("translation", "Translate the first two sentences of this text into German.\n\n{p}"),
    ("writing", "Give the following text a title, then explain in one sentence why it fits.\n\n{p}"),
    ("summarization", "Here are two texts.\n\nText A: {a}\n\nText B: {b}\n\nSummarize both in one "
                      "paragraph."),
    ("rag", "Text A: {a}\n\nText B: {b}\n\nWhat do these two texts have in common, and how do they "
            "differ?"),
)


def passage_instructions(texts: Sequence[str], n: int, seed: int = 0, min_chars: int = 200) -> List[dict]:
    """n instructions quoting passages from `texts` (the target's own answers), templates in turn.

    Passages are texts of at least min_chars characters, whitespace-trimmed; a template with two
    passages draws two different ones. Deterministic in (texts, n, seed)."""
    pool = [t.strip() for t in texts if len(t.strip()) >= min_chars]
    if n and len(pool) < 2:
        raise ValueError(f"need at least 2 answers of >= {min_chars} characters to quote, got {len(pool)}")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        cat, tpl = PASSAGE_TEMPLATES[i % len(PASSAGE_TEMPLATES)]
        a, b = torch.randperm(len(pool), generator=g)[:2].tolist()
        rows.append({"id": 100000 + i, "category": "passage_" + cat,
                     "instruction": tpl.format(p=pool[a], a=pool[a], b=pool[b])})
    return rows


def distill(model, tokenizer, out_dir, config: DistillConfig = DistillConfig(),
            instructions_path=INSTRUCTIONS, progress: bool = True, requests=None, passages=None) -> dict:
    """Generate (or finish generating) the self-distilled data in out_dir; returns the manifest.
    requests: (rows, manifest record) of target-written requests when config.self_instruct > 0
    (self_instruct.distill passes them); passages: (rows, manifest record) of real-passage requests
    when config.real_passages > 0 (corpus.passage_requests; `python -m specref data` passes them)."""
    if config.self_instruct and requests is None:
        raise ValueError("config.self_instruct > 0: the requests come from self_instruct.distill, which "
                         "writes them and then calls this function")
    if config.real_passages and (passages is None or len(passages[0]) != config.real_passages):
        raise ValueError(f"config.real_passages = {config.real_passages}: pass that many requests as "
                         "passages=(rows, record) (corpus.passage_requests)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = load_instructions(instructions_path, config.num_instructions, config.seed)
    manifest = {
        "format": FORMAT, "seed": config.seed, "settings": asdict(config),
        "instructions": str(Path(instructions_path).name), "num_instructions": len(rows),
        "model_fingerprint": fingerprint(model), "model": Path(getattr(model.config, "_name_or_path", "") or "").name,
        "dtype": str(next(model.parameters()).dtype), "generator": "specref.scheduler.schedule (autoregressive)",
        "corpora": "none (self-distilled only; second-stage passages are the target's own answers; "
                   "self-instruct requests are the target's own text)" if not config.real_passages else
                   "third-stage passages quote corpus.py's python-docs and debian-reference (see real_passages)",
    }
    old = out / "manifest.json"
    if old.is_file():
        prev = json.loads(old.read_text())
        same = {k: prev.get(k) for k in ("settings", "model_fingerprint", "num_instructions")}
        same["settings"] = {**asdict(DistillConfig()), **(same["settings"] or {})}  # fields added later: defaults
        if same != {k: manifest[k] for k in same}:
            raise ValueError(f"{out} holds data made with other settings or another model; "
                             "use a new folder")
    _distill_rows(model, tokenizer, out, "shard_", rows, config, progress, "self-distillation")
    if config.self_instruct:
        rows_si, info = requests
        _distill_rows(model, tokenizer, out, "shard_s", rows_si, config, progress, "self-instruct answers")
        manifest["self_instruct"] = info
    if config.passage_prompts:
        first = [p for p in shard_paths(out) if not p.name.startswith(("shard_p", "shard_r"))]
        texts = [tokenizer.decode(q.tokens[q.prompt_len:].tolist(), skip_special_tokens=True)
                 for q in iter_sequences(out, first)]
        rows2 = passage_instructions(texts, config.passage_prompts, config.seed)
        _distill_rows(model, tokenizer, out, "shard_p", rows2, config, progress, "passage prompts")
    if config.real_passages:
        rows3, info3 = passages
        _distill_rows(model, tokenizer, out, "shard_r", rows3, config, progress, "real-passage requests")
        manifest["real_passages"] = info3
    counts = {"sequences": 0, "tokens": 0, "response_tokens": 0}
    for q in iter_sequences(out):
        counts["sequences"] += 1
        counts["tokens"] += len(q.tokens)
        counts["response_tokens"] += len(q.tokens) - q.prompt_len
    manifest["counts"] = counts
    manifest["shards"] = len(shard_paths(out))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _distill_rows(model, tokenizer, out: Path, prefix: str, rows: List[dict], config: DistillConfig,
                  progress: bool, desc: str) -> None:
    """Answer `rows` with the target into shards `<prefix>#####` (existing shards are kept)."""
    from tqdm.auto import tqdm

    from ..generate import NullProposer
    from ..scheduler import schedule

    eos = _eos_ids(model, tokenizer)
    n_shards = (len(rows) + config.shard_size - 1) // config.shard_size
    bar = tqdm(total=len(rows), desc=desc, unit="prompt", disable=not progress)
    salt = {"shard_": 0, "shard_s": 3571, "shard_r": 5303}.get(prefix, 7919)  # each stage its own seeds (T > 0)
    for s in range(n_shards):
        path = out / f"{prefix}{s:05d}.safetensors"
        group = rows[s * config.shard_size: (s + 1) * config.shard_size]
        if path.is_file():
            bar.update(len(group))
            continue
        prompts = [chat_prompt_ids(tokenizer, r["instruction"]) for r in group]
        # one queue of batch_size rows (scheduler.py): a row whose answer ends takes the next prompt;
        # prompt i samples with its own generator (seed base + i), whatever the batch or the order
        gen = schedule(model, NullProposer(), prompts, batch_size=config.batch_size, refill=config.refill,
                       max_new_tokens=config.max_new_tokens, temperature=config.temperature, eos_token_id=eos,
                       seed=config.seed * 100003 + (s + salt) * 1009)
        seqs: List[Seq] = [Seq(torch.tensor(p + gen.row(i)), len(p)) for i, p in enumerate(prompts)]
        if config.topk:  # p at the answer's positions only: the LM head never sees the prompt
            for b0 in range(0, len(seqs), config.batch_size):
                part = seqs[b0: b0 + config.batch_size]
                labels = score(model, [(q.tokens.tolist(), q.prompt_len) for q in part], (), config.topk)
                for q, lab in zip(part, labels):
                    q.topk_ids, q.topk_logprobs = lab["topk_ids"], lab["topk_logprobs"]  # (L - P, K)
        bar.update(len(group))
        write_shard(path, seqs)
    bar.close()
