"""The feature store: the one path from the corpus to the trainer's batches.

Heads and drafts learn the target's distribution p, never a corpus's next token, and EAGLE-style
heads read the target's features. Both come out of one teacher-forced target forward per
sequence, done once and kept on disk, so training never runs the target:

    1. corpus     the committed corpus (committed_corpus.py: the target's own answers, xz shards),
                  exported as a distilled folder (`python -m specref corpus export`), and/or real
                  text (corpus.py), as chats, overlap-filtered (contamination.py)
    2. scoring    one frozen forward per packed batch (scoring.score): features of the chosen
                  layers at every position, p's top-k log-probs at every labelled position
    3. store      fp16 safetensors shards + manifest (build.build_store, files.py), resumable,
                  recorded by the target's fingerprint; `python -m specref data` (cli.py)
    4. batches    the store's sequences, in memory (files.stores_split) or read on demand
                  (files.StreamedStore), split by document, collated into right-padded Batches
                  (batches.collate) by loop.fit for every method of `python -m specref train`

    scoring.py  the teacher-forced forward (score), the full-forward reference (teacher_topk), pack
    batches.py  Seq, Batch, collate
    build.py    StoreConfig, the weighted stream of the sources, shards, build_store
    files.py    the shard layout, the readers, StreamedStore
    cli.py      `python -m specref data`

The corpus itself grows upstream of step 1: the target answers requests (data.py, self_instruct.py,
`python -m specref data --distill-only`) and `python -m specref corpus add` appends them.
"""
from .batches import Batch, Seq, collate
from .build import StoreConfig, build_store, doc_id, shards, stream
from .cli import data_main, data_parser
from .files import (FORMAT, StreamedStore, is_heldout, iter_store, read_store_manifest, read_store_shard,
                    store_shards, store_split, stores_split, streamed_split, write_store_shard)
from .scoring import TOPK, Layer, pack, score, teacher_topk

__all__ = ["Batch", "FORMAT", "Layer", "Seq", "StoreConfig", "StreamedStore", "TOPK", "build_store", "collate",
           "data_main", "data_parser", "doc_id", "is_heldout", "iter_store", "pack", "read_store_manifest",
           "read_store_shard", "score", "shards", "store_shards", "store_split", "stores_split", "stream",
           "streamed_split", "teacher_topk", "write_store_shard"]
