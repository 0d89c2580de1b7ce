"""Training the learned proposers: the target's distribution p as the label, never a corpus's token.
One data path: corpus -> scoring -> feature store -> batches (store/__init__.py tells it whole).

    committed_corpus.py  the committed corpus: the target's own answers, xz shards (`python -m specref corpus`)
    data.py      growing it: the target answers seed, self-written (self_instruct.py) and passage requests
    corpus.py    the sources the store scores: the corpus's export and real openly licensed text, as chats
    contamination.py     the word 13-gram check against evaluation text, run by every stage
    store/       scoring (one teacher-forced forward: features + top-k of p), the fp16 shards, the
                 readers (in memory or streamed), Seq/Batch/collate, `python -m specref data`
    loop.py      the shared loop: AdamW, schedule, clipping, held-out evaluation, exact resumption
    draft.py, eagle.py, eagle3.py, medusa.py, mtp.py, mlp_speculator.py
                 each method's task (its loss on a Batch) and its run on feature stores
    cli.py       `python -m specref train METHOD ...`, one subcommand per method
    transfer.py  a trained head's agreement on the target's answers to evaluation prompts
    recipes.py, rebuild.py  the chains that made the committed files, and `python -m specref rebuild`

Method modules never import from here: they load their trained files through specref.weights.
"""
from .warm_start import deepen, hydra_from_medusa, hydra_on_eagle, mtp_from_eagle, untie_lm_heads

__all__ = ["deepen", "hydra_from_medusa", "hydra_on_eagle", "mtp_from_eagle", "untie_lm_heads"]
