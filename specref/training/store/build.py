"""Steps 1-3 of the data path: a corpus's sequences scored into the feature store, on disk.

EAGLE (Li et al. 2024, Sec. 4) trains on a fixed corpus with the target's features; Medusa-2 and
DistillSpec distil q towards the target's p. Both come out of ONE frozen forward over a sequence
x_{1..L} (scoring.score): at every position t the features f_t (the final normed state, what the LM
head reads; or any decoder layer's output, EAGLE-3's low / middle / high layers) and the label
p(. | x_{<=t}), stored as its top-k log-probabilities. The corpus's next token is never the label.
Scoring takes no sequential steps: one parallel forward per batch.

Algorithm (`build_store`):
  1. stream: the sources (corpus.py: the committed corpus exported as a distilled folder, real
     text) interleaved by weight (smooth weighted round-robin on tokens), each in a seeded random
     order, chat-encoded (corpus.encode) and truncated to max_len; a prefix of the stream does not
     depend on --tokens, so a larger run extends a smaller one;
  2. shard: consecutive runs of ~shard_tokens tokens of the stream (each a random sample of it);
  3. score: within a shard, sequences sorted by length and packed to <= batch_tokens (B * T) per
     target forward (right-padded); the LM head runs only at the labelled positions
     (tokens[prompt_len:], i.e. positions prompt_len-1 .. L-2) in chunks;
  4. write: the shard as one safetensors file (files.py: temp file + rename), then the manifest;
     a rerun skips every finished shard (checking its documents) and resumes at the first missing one.
Left out: multi-GPU scoring (one device per process); EAGLE-3's fused features (the reader
concatenates the requested layers along D; the head's FC does the rest).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ...weights import fingerprint
from ..corpus import Doc, Source, encode
from .batches import Seq
from .scoring import TOPK, Layer, pack, score
from .files import FORMAT, write_store_shard


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one feature store (all but `tokens` must match to resume)."""

    tokens: int = 2_000_000  # scored tokens to reach (whole shards: rounded up)
    max_len: int = 1024  # tokens kept per sequence (longer chats are truncated)
    batch_tokens: int = 8192  # padded tokens B * T per target forward
    shard_tokens: int = 32768  # tokens per shard file (the unit of resumption)
    topk: int = TOPK  # target top-k log-probs per labelled position (same as self-distillation)
    layers: Tuple[Layer, ...] = ("final",)  # "final": the normed state the LM head reads; int i: hidden_states[i]
    label: str = "assistant"  # "assistant": label from the first assistant turn on; "all": every position
    seed: int = 0  # orders each source

    def __post_init__(self) -> None:
        for name in ("tokens", "max_len", "batch_tokens", "shard_tokens", "topk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.batch_tokens < self.max_len:
            raise ValueError(f"batch_tokens {self.batch_tokens} < max_len {self.max_len}: a sequence must fit")
        if self.label not in ("assistant", "all"):
            raise ValueError(f"label must be 'assistant' or 'all', got {self.label!r}")
        if not self.layers or any(not (x == "final" or (isinstance(x, int) and x >= 0)) for x in self.layers):
            raise ValueError(f"layers must be 'final' or ints >= 0, got {self.layers!r}")


def doc_id(doc: Doc) -> int:
    """A stable 60-bit id of a document (source + key)."""
    return int(hashlib.sha1(f"{doc.source}\0{doc.key}".encode()).hexdigest()[:15], 16)


# ----------------------------------------------------------------------------- 1.-2. stream, shards


def stream(sources: Sequence[Source], tokenizer, cfg: StoreConfig) -> Iterator[Tuple[int, Doc, List[int], int]]:
    """(source index, doc, ids, prompt_len), sources interleaved by weight, each in seeded order."""
    orders = []
    for s in sources:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + int(hashlib.sha1(s.name.encode()).hexdigest()[:6], 16))
        orders.append(torch.randperm(len(s.docs), generator=g).tolist())
    pos, taken = [0] * len(sources), [0.0] * len(sources)
    live = [i for i, s in enumerate(sources) if s.docs and s.weight > 0]
    while live:
        i = min(live, key=lambda j: (taken[j] / sources[j].weight, j))  # smooth weighted round-robin
        doc = sources[i].docs[orders[i][pos[i]]]
        pos[i] += 1
        if pos[i] == len(sources[i].docs):
            live.remove(i)
        ids, p = encode(doc, tokenizer, cfg.label)
        ids = ids[: cfg.max_len]
        if p >= len(ids):  # nothing labelled left after truncation
            continue
        taken[i] += len(ids)
        yield i, doc, ids, p


def shards(sources: Sequence[Source], tokenizer, cfg: StoreConfig) -> Iterator[List[Tuple[int, Doc, List[int], int]]]:
    """Consecutive groups of ~shard_tokens tokens of the stream, until cfg.tokens are planned."""
    group, n, total = [], 0, 0
    for row in stream(sources, tokenizer, cfg):
        group.append(row)
        n += len(row[2])
        if n >= cfg.shard_tokens:
            yield group
            total += n
            group, n = [], 0
            if total >= cfg.tokens:
                return
    if group:
        yield group


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- build


def build_store(target: torch.nn.Module, tokenizer, sources: Sequence[Source], out,
                cfg: StoreConfig = StoreConfig(), progress: bool = True, max_seconds: Optional[float] = None,
                extra: Optional[dict] = None) -> dict:
    """Score (or finish scoring) the store in `out`; returns the manifest. max_seconds: start no new
    shard after this long (the run stays resumable). Sources should be overlap-filtered (corpus.py)."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in asdict(cfg).items() if k != "tokens"}
    settings["layers"] = list(cfg.layers)
    fp = fingerprint(target)
    src = [s.record() for s in sources]
    mpath = out / "manifest.json"
    man = {"format": FORMAT, "model": Path(getattr(target.config, "_name_or_path", "") or "").name, "model_fingerprint": fp,
           "dtype": str(next(target.parameters()).dtype), "settings": settings, "tokens_requested": cfg.tokens,
           "sources": src, "shards": {}, **(extra or {})}
    if mpath.is_file():
        old = json.loads(mpath.read_text())
        def ident(sources):
            return [(s["name"], s["documents"], s["weight"]) for s in sources]

        was = (old.get("model_fingerprint"), old.get("settings"), ident(old.get("sources", [])))
        if was != (fp, settings, ident(src)):
            raise ValueError(f"{out} holds a store made with other settings, sources or model; use a new folder")
        man["shards"] = old.get("shards", {})
    bar = tqdm(total=cfg.tokens, desc="scoring", unit="tok", unit_scale=True, disable=not progress, smoothing=0.1)
    t_run, done_now = time.perf_counter(), 0
    for s_idx, group in enumerate(shards(sources, tokenizer, cfg)):
        name = f"shard_{s_idx:05d}.safetensors"
        path = out / name
        dids = [doc_id(d) for _, d, _, _ in group]
        if path.is_file():  # 4. finished before: check it holds this plan's documents, skip
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                if f.get_tensor("doc_ids").tolist() != dids:
                    raise ValueError(f"{path} holds other documents than this run plans; use a new folder")
            man["shards"].setdefault(name, _shard_record(group, sources, None))
            bar.update(man["shards"][name]["tokens"])
            continue
        if max_seconds is not None and time.perf_counter() - t_run > max_seconds:
            break
        t0 = time.perf_counter()
        rows = [(ids, p) for _, _, ids, p in group]
        res: List[Optional[dict]] = [None] * len(rows)
        for idx in pack([len(r) for r, _ in rows], cfg.batch_tokens):  # 3. similar lengths together
            for i, r in zip(idx, score(target, [rows[i] for i in idx], cfg.layers, cfg.topk)):
                res[i] = r
            bar.update(sum(len(rows[i][0]) for i in idx))
        seqs = [Seq(torch.tensor(ids), p, r["topk_ids"], r["topk_logprobs"]) for (ids, p), r in zip(rows, res)]
        feats = {x: [r["features"][x] for r in res] for x in cfg.layers}
        write_store_shard(path, seqs, dids, [i for i, _, _, _ in group], feats, {"model_fingerprint": fp})
        man["shards"][name] = _shard_record(group, sources, time.perf_counter() - t0)
        done_now += man["shards"][name]["tokens"]
        _finish(man, sources)
        _write_json(mpath, man)
    bar.close()
    _finish(man, sources)
    man["this_run"] = {"tokens": done_now, "seconds": time.perf_counter() - t_run}
    _write_json(mpath, man)
    return man


def _shard_record(group, sources, seconds) -> dict:
    per: Dict[str, int] = {}
    for i, _, ids, _ in group:
        per[sources[i].name] = per.get(sources[i].name, 0) + len(ids)
    return {"sequences": len(group), "tokens": sum(len(r[2]) for r in group),
            "labelled": sum(len(r[2]) - r[3] for r in group), "seconds": seconds, "tokens_by_source": per}


def _finish(man: dict, sources) -> None:
    """Totals and throughput from the shard records."""
    recs = list(man["shards"].values())
    timed = [r for r in recs if r["seconds"]]
    man["counts"] = {"shards": len(recs), "sequences": sum(r["sequences"] for r in recs),
                     "tokens": sum(r["tokens"] for r in recs), "labelled": sum(r["labelled"] for r in recs)}
    secs = sum(r["seconds"] for r in timed)
    man["throughput"] = {"scored_tokens_per_second": sum(r["tokens"] for r in timed) / secs if secs else None,
                         "seconds": secs}
    for s in man["sources"]:
        s["tokens"] = sum(r["tokens_by_source"].get(s["name"], 0) for r in recs)
