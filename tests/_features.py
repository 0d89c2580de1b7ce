"""Shared by the feature-reading proposers' tests (EAGLE, Medusa, MTP): the V = 16 tiny target and
sequences sampled from it with the target's top-k and final features attached; the trained EAGLE
head that test_eagle.py (chains) and test_eagle_tree.py (EAGLE-2 trees) share."""
import functools

import torch

from specref.generate import autoregressive_generate
from specref.models import tiny_model
from specref.training.data import Seq, collate, teacher_topk
from specref.training.eagle import attach_features

V = 16


def feature_target():
    """A peaked, context-dependent V = 16 target (2 decoder layers), frozen."""
    m = tiny_model("llama", vocab_size=V, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def feature_data(target, n, seed=0):
    """Sequences sampled from the target: 5-token random prompts, 16 response tokens, top-k, features."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (n, 5), generator=g)  # (n, 5)
    out = autoregressive_generate(target, prompts, max_new_tokens=16, temperature=1.0, seed=seed)
    seqs = [Seq(torch.cat([prompts[i], out.tokens[i]]), 5) for i in range(n)]
    ids, logp = teacher_topk(target, collate(seqs), 8)  # (n, 21, 8)
    for i, s in enumerate(seqs):
        s.topk_ids, s.topk_logprobs = ids[i, 4:20], logp[i, 4:20]
    attach_features(target, seqs, progress=False)
    return seqs


@functools.lru_cache(maxsize=1)
def trained_eagle():
    """(target, head, training history): 120 steps on 160 sampled sequences; 12 of 16 tokens drafted.
    Trained once per test process."""
    from specref.eagle_head import EagleHead
    from specref.training.draft import build_token_map
    from specref.training.eagle import EagleTask, EagleTrainConfig
    from specref.training.loop import TrainConfig, fit, split_heldout
    target = feature_target()
    train, held = split_heldout(feature_data(target, 160), 0.2, seed=0)
    head = EagleHead(target, build_token_map(train, V, 12), seed=0)
    cfg = TrainConfig(steps=120, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=120, seed=0)
    res = fit(EagleTask(head, EagleTrainConfig(w_reg=0.5, w_cls=1.0), seed=0), train, held, cfg, progress=False,
              log=lambda s: None)
    return target, head.eval(), res.history
