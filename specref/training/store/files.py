"""Step 3-4 of the data path: the store's shard files, and the sequences streamed from them.

Shard layout (`shard_#####.safetensors`, FORMAT 1): tokens (sum L,) int32, offsets (S+1,) int64,
prompt_lens (S,) int32, doc_ids (S,) int64 (stable hash of source + document key: the held-out
split), source_ids (S,) int32 (index into manifest["sources"]), topk_ids (sum R, K) int32 and
topk_logprobs (sum R, K) fp16 (row j of a sequence: p that predicted tokens[prompt_len + j]),
features.<layer> (sum L, D) fp16 for each layer ("final" or an int: hidden_states[i] of
output_hidden_states, 0 = the embeddings); metadata: format, model_fingerprint.

Readers, all yielding batches.Seq with the requested layers' features concatenated along D:
`read_store_shard` (one file), `iter_store` (a store, one shard in memory at a time),
`stores_split` (several stores as in-memory (train, heldout) lists) and `StreamedStore` /
`streamed_split` (the same sequences read on demand from the memory-mapped shards: only an index
in memory, for stores larger than memory; its items equal read_store_shard's, so a streamed run
takes the same batches and losses as an in-memory one). The held-out split hashes the document id
(`is_heldout`), so it does not depend on the shards or on the other stores.
Left out: compression; prefetching and caching of decoded sequences.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .batches import Seq
from .scoring import Layer

FORMAT = 1  # bump when the shard layout changes


def is_heldout(did: int, fraction: float, seed: int = 0) -> bool:
    """The deterministic held-out split: a hash of (seed, document id) below `fraction`."""
    h = int(hashlib.sha1(f"{seed}:{did}".encode()).hexdigest()[:8], 16)
    return h < fraction * 0x100000000


def _key(x: Layer) -> str:
    return f"features.{x}"


def _check_split(split: Optional[str]) -> None:
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be None, 'train' or 'heldout', got {split!r}")


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


def read_store_manifest(folder) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{folder} holds no manifest.json: not a specref feature store")
    return json.loads(path.read_text())


def _labelled(folder, layers: Sequence[Layer], heldout_fraction: float, seed: int) -> Iterator[Tuple[Seq, bool]]:
    """(sequence, held out?) of every sequence of a store, one shard in memory at a time."""
    for path in store_shards(folder):
        seqs, dids, _ = read_store_shard(path, layers, with_ids=True)
        for s, d in zip(seqs, dids):
            yield s, is_heldout(d, heldout_fraction, seed)


def iter_store(folder, layers: Sequence[Layer] = ("final",), split: Optional[str] = None,
               heldout_fraction: float = 0.02, seed: int = 0) -> Iterator[Seq]:
    """Stream a store's sequences (one shard in memory at a time) as Seq with `features` (L, D)
    of the requested layers (concatenated) and topk covering tokens[prompt_len:].
    split: None (all), "train" or "heldout" (is_heldout on the document id, independent of shards)."""
    _check_split(split)
    for s, held in _labelled(folder, layers, heldout_fraction, seed):
        if split is None or held == (split == "heldout"):
            yield s


def store_split(folder, layers: Sequence[Layer] = ("final",), heldout_fraction: float = 0.02,
                seed: int = 0) -> Tuple[List[Seq], List[Seq]]:
    """(train, heldout) lists of a store, split by document (see iter_store)."""
    train, held = [], []
    for s, h in _labelled(folder, layers, heldout_fraction, seed):
        (held if h else train).append(s)
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


class StreamedStore:
    """The (train or heldout) sequences of feature stores, read lazily; list-like (len, [i], iter).

    Keeps only an index in memory (per sequence: shard, offsets, prompt length; built from each
    shard's small tensors) and reads a sequence's tokens, top-k labels and features with
    safetensors slices of the memory-mapped shard when it is asked for.
    split: None (all), "train" or "heldout", the document split of store_split."""

    def __init__(self, folders: Sequence, layers: Sequence[Layer] = ("final",), split: Optional[str] = None,
                 heldout_fraction: float = 0.02, seed: int = 0):
        from safetensors import safe_open

        _check_split(split)
        self.layers = tuple(layers)
        self.paths: List[Path] = []
        self.index: List[Tuple[int, int, int, int, int]] = []  # (shard, a, b, r, prompt_len) per sequence
        for folder in folders:
            read_store_manifest(folder)  # ValueError if not a store
            for path in store_shards(folder):
                with safe_open(str(path), framework="pt") as f:
                    missing = [x for x in self.layers if _key(x) not in set(f.keys())]
                    if missing:
                        raise ValueError(f"{path} stores no features of layers {missing}")
                    off, P = f.get_tensor("offsets").tolist(), f.get_tensor("prompt_lens").tolist()
                    dids = f.get_tensor("doc_ids").tolist()
                self.paths.append(path)
                r = 0
                for i in range(len(P)):
                    a, b = off[i], off[i + 1]
                    if split is None or is_heldout(dids[i], heldout_fraction, seed) == (split == "heldout"):
                        self.index.append((len(self.paths) - 1, a, b, r, P[i]))
                    r += b - a - P[i]
        self.lengths = [b - a for _, a, b, _, _ in self.index]  # (n,) tokens per sequence
        self._open: Dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.index)

    def _file(self, shard: int):
        from safetensors import safe_open

        if shard not in self._open:  # memory-mapped: the OS pages in only what is sliced
            self._open[shard] = safe_open(str(self.paths[shard]), framework="pt")
        return self._open[shard]

    def __getitem__(self, i: int) -> Seq:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        shard, a, b, r, p = self.index[i]
        f = self._file(shard)
        R = b - a - p
        feats = [f.get_slice(_key(x))[a:b] for x in self.layers]  # each (L, D) fp16
        return Seq(f.get_slice("tokens")[a:b].long(), p, f.get_slice("topk_ids")[r: r + R].long(),
                   f.get_slice("topk_logprobs")[r: r + R].float(),
                   torch.cat(feats, dim=-1) if feats else None)  # features (L, n*D)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getstate__(self):  # picklable (no open handles)
        return {**self.__dict__, "_open": {}}


def streamed_split(folders: Sequence, layers: Sequence[Layer] = ("final",), heldout_fraction: float = 0.02,
                   seed: int = 0) -> Tuple[StreamedStore, StreamedStore]:
    """(train, heldout) of stores_split, both read on demand."""
    return tuple(StreamedStore(folders, layers, s, heldout_fraction, seed) for s in ("train", "heldout"))
