"""A feature store read from disk on demand: training on a store larger than memory.

The EAGLE recipe (Li et al. 2024, Sec. 4) trains on features of the target over a fixed corpus;
at a few million tokens the features (sum L, D) fp16 outgrow memory. `StreamedStore` is an
indexable sequence of data.Seq over one or more feature stores (store.py) that keeps only an index
in memory (per sequence: shard, offsets, prompt length; built from each shard's small tensors) and
reads a sequence's tokens, top-k labels and features with safetensors slices of the memory-mapped
shard when it is asked for. Its items equal read_store_shard's, so a streamed run takes the same
batches and the same losses as an in-memory one (`fit` reads `lengths` from the index).
Left out: prefetching, caching of decoded sequences.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .data import Seq
from .store import _key, is_heldout, read_store_manifest, store_shards
from .teacher import Layer


class StreamedStore:
    """The (train or heldout) sequences of feature stores, read lazily; list-like (len, [i], iter).

    split: None (all), "train" or "heldout", the document split of store.store_split."""

    def __init__(self, folders: Sequence, layers: Sequence[Layer] = ("final",), split: Optional[str] = None,
                 heldout_fraction: float = 0.02, seed: int = 0):
        from safetensors import safe_open

        if split not in (None, "train", "heldout"):
            raise ValueError(f"split must be None, 'train' or 'heldout', got {split!r}")
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
    """(train, heldout) of stores.stores_split, both read on demand."""
    return tuple(StreamedStore(folders, layers, s, heldout_fraction, seed) for s in ("train", "heldout"))
