"""Training the learned proposers: the target's distribution p as the label, never a corpus's token.

    data.py      self-distillation data: the target's own answers, scored teacher-forced (top-k of p)
    corpus.py    real openly licensed text from installed packages, as chat conversations
    store.py     the feature store: that text scored teacher-forced (features + top-k of p), fp16 shards
    loop.py      the shared loop: AdamW, schedule, clipping, held-out evaluation, exact resumption
    draft.py     the reduced-vocabulary draft model's task (KL to p) and its one command
    eagle.py     the EAGLE-1 head's task (feature regression + soft CE) and its one command
    medusa.py    Medusa-1 heads' task (sum_k 0.8^k soft CE), the tree for this machine, the command
    mtp.py       the MTP modules' task (lambda * mean over depths of soft CE) and the command
    evaluate.py  a trained draft measured side by side on Spec-Bench (tau, speed-up, parity)
    cli.py       `python -m specref train [--method draft|eagle|medusa|mtp] ...`

Method modules never import from here: they load their trained files through specref.weights.
"""
from .warm_start import deepen, hydra_from_medusa, hydra_on_eagle, mtp_from_eagle, untie_lm_heads

__all__ = ["deepen", "hydra_from_medusa", "hydra_on_eagle", "mtp_from_eagle", "untie_lm_heads"]
