"""The feature store: one teacher-forced target forward over real chats -> features + p, on disk.

EAGLE (Li et al. 2024, Sec. 4) trains on a fixed corpus with the target's features; Medusa-2 and
DistillSpec distil q towards the target's p. Both come out of ONE frozen forward over a sequence
x_{1..L}: at every position t the features f_t (the final normed state, what the LM head reads, as
training.eagle.attach_features computes it; or any decoder layer's output, EAGLE-3's low / middle /
high layers) and the label p(. | x_{<=t}), stored as its top-k log-probabilities. The corpus's next
token is never the label. Scoring takes no sequential steps: one parallel forward per batch.

Algorithm (`build_store`):
  1. stream: the sources (corpus.py) interleaved by weight (smooth weighted round-robin on tokens),
     each in a seeded random order, chat-encoded (corpus.encode) and truncated to max_len; a prefix
     of the stream does not depend on --tokens, so a larger run extends a smaller one;
  2. shard: consecutive runs of ~shard_tokens tokens of the stream (each a random sample of it);
  3. score: within a shard, sequences sorted by length and packed to <= batch_tokens (B * T) per
     target forward (right-padded); the LM head runs only at the labelled positions
     (tokens[prompt_len:], i.e. positions prompt_len-1 .. L-2) in chunks;
  4. write: the shard as one safetensors file (temp file + rename), then the manifest; a rerun skips
     every finished shard (checking its documents) and resumes at the first missing one.

Shard layout (`shard_#####.safetensors`): tokens (sum L,) int32, offsets (S+1,) int64, prompt_lens
(S,) int32, doc_ids (S,) int64 (stable hash of source + document key: the held-out split),
source_ids (S,) int32 (index into manifest["sources"]), topk_ids (sum R, K) int32 and
topk_logprobs (sum R, K) fp16 (row j of a sequence: p that predicted tokens[prompt_len + j]),
features.<layer> (sum L, D) fp16 for each layer ("final" or an int: hidden_states[i] of
output_hidden_states, 0 = the embeddings). The reader (`iter_store`) yields data.Seq, so
data.collate and every training task (EagleTask, DraftDistillTask) read it unchanged.
Left out: multi-GPU scoring (one device per process); compression; EAGLE-3's fused features
(the reader concatenates the requested layers along D; the head's FC does the rest).
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

from ..weights import fingerprint
from .corpus import Doc, Source, encode
from .data import DistillConfig, Seq
from .teacher import Layer, score

FORMAT = 1  # bump when the shard layout changes


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one feature store (all but `tokens` must match to resume)."""

    tokens: int = 2_000_000  # scored tokens to reach (whole shards: rounded up)
    max_len: int = 1024  # tokens kept per sequence (longer chats are truncated)
    batch_tokens: int = 8192  # padded tokens B * T per target forward
    shard_tokens: int = 32768  # tokens per shard file (the unit of resumption)
    topk: int = DistillConfig.topk  # target top-k log-probs per labelled position (same as self-distillation)
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


def is_heldout(did: int, fraction: float, seed: int = 0) -> bool:
    """The deterministic held-out split: a hash of (seed, document id) below `fraction`."""
    h = int(hashlib.sha1(f"{seed}:{did}".encode()).hexdigest()[:8], 16)
    return h < fraction * 0x100000000


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


# ----------------------------------------------------------------------------- 3. score: teacher.score


def pack(lengths: Sequence[int], batch_tokens: int) -> List[List[int]]:
    """Indices sorted by length (longest first), cut into batches with B * max(L) <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + ([cur] if cur else [])


# ----------------------------------------------------------------------------- 4. shard files


def _key(x: Layer) -> str:
    return f"features.{x}"


def write_store_shard(path, seqs: Sequence[Seq], doc_ids: Sequence[int], source_ids: Sequence[int],
                      layer_feats: Dict[Layer, Sequence[torch.Tensor]], meta: Optional[dict] = None) -> None:
    """One shard (atomically: temp file, then rename). layer_feats[layer][i]: (L_i, D) of sequence i."""
    from safetensors.torch import save_file

    lens = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)  # (S,)
    t = {"tokens": torch.cat([s.tokens.to(torch.int32) for s in seqs]),  # (sum L,)
         "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),  # (S+1,)
         "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),  # (S,)
         "doc_ids": torch.tensor(list(doc_ids), dtype=torch.long),  # (S,)
         "source_ids": torch.tensor(list(source_ids), dtype=torch.int32),  # (S,)
         "topk_ids": torch.cat([s.topk_ids.to(torch.int32) for s in seqs]),  # (sum R, K)
         "topk_logprobs": torch.cat([s.topk_logprobs.to(torch.float16) for s in seqs])}  # (sum R, K)
    for x, fs in layer_feats.items():
        t[_key(x)] = torch.cat([f.to(torch.float16) for f in fs])  # (sum L, D)
    tmp = str(path) + ".tmp"
    save_file({k: v.contiguous() for k, v in t.items()}, tmp, metadata={"format": str(FORMAT), **(meta or {})})
    os.chmod(tmp, 0o644)  # the cache may be shared
    os.replace(tmp, path)


def read_store_shard(path, layers: Sequence[Layer] = ("final",), with_ids: bool = False):
    """The Seqs of one shard, features = the requested layers concatenated along D ((L, n*D)), or
    None for layers=(); with_ids: also (doc_ids, source_ids)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing = [x for x in layers if _key(x) not in keys]
        if missing:
            have = sorted(k.split(".", 1)[1] for k in keys if k.startswith("features."))
            raise ValueError(f"{path} stores no features of layers {missing}; it has {have}")
        t = {k: f.get_tensor(k) for k in ("tokens", "offsets", "prompt_lens", "doc_ids", "source_ids",
                                         "topk_ids", "topk_logprobs")}
        feats = [f.get_tensor(_key(x)) for x in layers]  # each (sum L, D)
    feat = torch.cat(feats, dim=-1) if feats else None  # (sum L, n*D)
    off, P = t["offsets"].tolist(), t["prompt_lens"].tolist()
    seqs, r = [], 0
    for i in range(len(P)):
        a, b = off[i], off[i + 1]
        R = b - a - P[i]
        seqs.append(Seq(t["tokens"][a:b].long(), P[i], t["topk_ids"][r: r + R].long(),
                        t["topk_logprobs"][r: r + R].float(), None if feat is None else feat[a:b]))
        r += R
    return (seqs, t["doc_ids"].tolist(), t["source_ids"].tolist()) if with_ids else seqs


def store_shards(folder) -> List[Path]:
    return sorted(Path(folder).glob("shard_*.safetensors"))


def iter_store(folder, layers: Sequence[Layer] = ("final",), split: Optional[str] = None,
               heldout_fraction: float = 0.02, seed: int = 0) -> Iterator[Seq]:
    """Stream a store's sequences (one shard in memory at a time) as data.Seq with `features` (L, D)
    of the requested layers (concatenated) and topk covering tokens[prompt_len:].
    split: None (all), "train" or "heldout" (is_heldout on the document id, independent of shards)."""
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be None, 'train' or 'heldout', got {split!r}")
    for path in store_shards(folder):
        seqs, dids, _ = read_store_shard(path, layers, with_ids=True)
        for s, d in zip(seqs, dids):
            if split is None or is_heldout(d, heldout_fraction, seed) == (split == "heldout"):
                yield s


def store_split(folder, layers: Sequence[Layer] = ("final",), heldout_fraction: float = 0.02,
                seed: int = 0) -> Tuple[List[Seq], List[Seq]]:
    """(train, heldout) lists of a store, split by document (see iter_store)."""
    train, held = [], []
    for path in store_shards(folder):
        seqs, dids, _ = read_store_shard(path, layers, with_ids=True)
        for s, d in zip(seqs, dids):
            (held if is_heldout(d, heldout_fraction, seed) else train).append(s)
    return train, held


def stores_split(folders: Sequence, layers: Sequence[Layer] = ("final",), heldout_fraction: float = 0.02,
                 seed: int = 0) -> Tuple[List[Seq], List[Seq]]:
    """(train, heldout) of several stores together (each split as store_split), in folder order;
    ValueError if they were scored by different models or hold features of different widths."""
    fps = {str(f): read_store_manifest(f).get("model_fingerprint") for f in folders}
    if len(set(fps.values())) > 1:
        raise ValueError(f"these stores were scored by different models: {fps}")
    train, held = [], []
    for f in folders:
        t, h = store_split(f, layers, heldout_fraction, seed)
        train, held = train + t, held + h
    if len({s.features.shape[-1] for s in train + held if s.features is not None}) > 1:
        raise ValueError(f"the stores {list(fps)} hold features of different widths")
    return train, held


def read_store_manifest(folder) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{folder} holds no manifest.json: not a specref feature store")
    return json.loads(path.read_text())


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


# ----------------------------------------------------------------------------- the command


def data_parser():
    """The command line of `python -m specref data` (rebuild.py checks its recipes against it)."""
    import argparse

    from . import corpus

    ap = argparse.ArgumentParser(prog="python -m specref data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="store folder (default: <specref cache>/store)")
    ap.add_argument("--tokens", type=int, default=StoreConfig.tokens, help="scored tokens to reach")
    ap.add_argument("--sources", nargs="*", default=list(corpus.SOURCES), choices=list(corpus.SOURCES),
                    help="corpora to score (none: only --distilled)")
    ap.add_argument("--distilled", default=None, help="also a self-distilled data folder (data.distill)")
    ap.add_argument("--self-instruct", type=int, default=0, metavar="N",
                    help="first write (or finish) --distilled: N target-written requests answered by the "
                         "target (self_instruct.py), in --dtype")
    ap.add_argument("--num-instructions", type=int, default=0, help="with --self-instruct: seed instructions too")
    ap.add_argument("--passage-prompts", type=int, default=0, help="with --self-instruct: prompts quoting the "
                                                                   "target's own answers as a passage")
    ap.add_argument("--real-passages", type=int, default=0, metavar="N",
                    help="also write N requests into --distilled that quote real text as the passage "
                         "(python-docs, debian-reference: corpus.passage_requests), answered by the target")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="with --self-instruct: longest answer")
    ap.add_argument("--gen-batch-size", type=int, default=64, help="with --self-instruct: prompts per batch")
    ap.add_argument("--request-chunk", type=int, default=None, metavar="N",
                    help="with --self-instruct: requests sampled per resumable chunk, in batches of "
                         "--gen-batch-size, so a smaller chunk caps the request batch (default: min(256, "
                         "max(--gen-batch-size, 2 x --self-instruct)), what the committed parts were written with)")
    ap.add_argument("--layers", nargs="+", default=["final"], help="'final' and/or hidden_states indices")
    ap.add_argument("--max-len", type=int, default=StoreConfig.max_len)
    ap.add_argument("--batch-tokens", type=int, default=StoreConfig.batch_tokens)
    ap.add_argument("--shard-tokens", type=int, default=StoreConfig.shard_tokens)
    ap.add_argument("--topk", type=int, default=StoreConfig.topk)
    ap.add_argument("--label", choices=("assistant", "all"), default=StoreConfig.label)
    ap.add_argument("--seed", type=int, default=StoreConfig.seed)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no new shard after this long")
    ap.add_argument("--distill-only", action="store_true", help="write (or finish) --distilled, then stop before "
                    "scoring: the run that grows the committed corpus (`corpus add` takes the folder)")
    ap.add_argument("--eval-file", nargs="+", default=None, help="evaluation JSONL files that no training text may "
                    "share a word 13-gram with (default: $SPECREF_SPEC_BENCH; neither: unchecked, said in the manifest)")
    return ap


def data_main(argv=None) -> int:
    """`python -m specref data`: score the default model's feature store (resumable); with
    --self-instruct N, first write (or finish) the --distilled folder: the target's own requests
    (self_instruct.py) and its greedy answers, in --dtype."""
    from . import corpus

    a = data_parser().parse_args(argv)
    evals = corpus.eval_files(a.eval_file)  # the contamination check's files (by name in the manifest)
    if not a.sources and not a.distilled:
        raise ValueError("nothing to score: give --sources and/or --distilled FOLDER")
    generate = bool(a.self_instruct or a.num_instructions or a.passage_prompts or a.real_passages)
    if generate and not a.distilled:
        raise ValueError("--self-instruct / --num-instructions / --passage-prompts / --real-passages write the "
                         "self-distilled folder: give it as --distilled FOLDER")
    if a.distill_only and not generate:
        raise ValueError("--distill-only stops after writing --distilled: give --self-instruct, --num-instructions, "
                         "--passage-prompts or --real-passages")
    if a.threads:
        torch.set_num_threads(a.threads)
    layers = tuple(x if x == "final" else int(x) for x in a.layers)
    cfg = StoreConfig(tokens=a.tokens, max_len=a.max_len, batch_tokens=a.batch_tokens, shard_tokens=a.shard_tokens,
                      topk=a.topk, layers=layers, label=a.label, seed=a.seed)
    from ..models import cache_root, load_default

    target, tok = load_default(dtype=getattr(torch, a.dtype), device=a.device)
    for q in target.parameters():
        q.requires_grad_(False)
    t0 = time.perf_counter()
    if generate:
        from .data import DistillConfig
        from .self_instruct import distill

        # topk 0: the store scores every position itself below
        dcfg = DistillConfig(seed=a.seed, num_instructions=a.num_instructions, max_new_tokens=a.max_new_tokens,
                             batch_size=a.gen_batch_size, topk=0, passage_prompts=a.passage_prompts,
                             self_instruct=a.self_instruct, real_passages=a.real_passages,
                             request_chunk=a.request_chunk)
        passages = None
        if a.real_passages:
            grams = corpus.dev_ngrams(evals) if evals else None
            passages = corpus.passage_requests(corpus.load_sources(["python-docs", "debian-reference"]),
                                               a.real_passages, a.seed, grams=grams)
            if len(passages[0]) < a.real_passages:
                raise ValueError(f"--real-passages {a.real_passages}: only {len(passages[0])} requests pass the "
                                 "development split's 13-gram filter")
            passages[1]["dev_overlap_checked_against"] = corpus.checked_against(evals) or None
        dman = distill(target, tok, a.distilled, dcfg, passages=passages, evals=evals)
        print(json.dumps({"distilled": a.distilled, "seconds": round(time.perf_counter() - t0, 1),
                          "counts": dman["counts"]}), flush=True)
        if a.distill_only:
            return 0
        t0 = time.perf_counter()
    grams = corpus.dev_ngrams(evals)
    sources = [corpus.overlap_filter(s, grams) for s in corpus.load_sources(a.sources, a.distilled, tok)]
    t_src = time.perf_counter() - t0
    out = Path(a.out) if a.out else cache_root() / "store"
    man = build_store(target, tok, sources, out, cfg, max_seconds=a.max_seconds,
                      extra={"device": a.device, "threads": torch.get_num_threads(),
                             "contamination_check": {"against": corpus.checked_against(evals) or
                                                     "nothing: no evaluation file given", "n": corpus.NGRAM,
                                                     "unit": "word (lower-cased \\w+ runs)"}})
    print(json.dumps({"out": str(out), "sources_seconds": round(t_src, 1), "counts": man["counts"],
                      "throughput": man["throughput"], "this_run": man["this_run"],
                      "sources": [{k: s[k] for k in ("name", "documents", "tokens", "licence")}
                                  for s in man["sources"]]},
                     indent=1))
    return 0
