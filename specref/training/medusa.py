"""Training Medusa heads (medusa_heads.py) on a frozen target with the shared loop (training/loop.py).

Cai et al. 2024 (Medusa-1, Sec. 2.2.1): the target is frozen and only the heads learn, from the
target's features. Head k at position t reads h_t and is trained towards the token at t+k+1:

    L_Medusa-1 = sum_{k=1..K} lambda_k CE(p_t^(k), y_{t+k+1}),     lambda_k = lambda^k (paper: 0.8^k)

The label here is the target's own distribution at position t+k (its stored top-k log-probs,
soft cross-entropy over the heads' draft vocabulary): what the target would sample, the
self-distillation the paper recommends (Sec. 2.3.2) without generating text.

Hydra heads (`sequential`, medusa_heads.py) also read the tokens x_{t+1} .. x_{t+k}, teacher
forced from the data, as Hydra trains them (Ankner et al. 2024, Sec. 3). Heads with Hydra++'s prefix
layer (`prefix`) read its output over each whole sequence (one causal pass), the states the
proposer's cached layer computes a verification at a time.

Held-out metrics per head k: top1 (the head's argmax = the target's argmax at t+k) and, for the
tree builder (medusa_tree.best_tree), the rate at which each rank i < `ranks` of the head is the
target's argmax: a_k(i). `run_medusa_training` trains, measures the verify-cost curve and the
heads' cost on this machine, builds the tree that maximises the predicted speed-up and saves
heads, tree and numbers in one safetensors file.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..picker.costs import measure_heads_cost, measure_verify_cost
from ..eagle_head import load_eagle
from ..medusa_heads import MedusaHeads, load_medusa, save_medusa
from ..medusa_prefix import PREFIX_KINDS
from ..target import additive_mask
from ..medusa_tree import best_tree
from ..weights import fingerprint
from .data import Batch, Seq
from .draft import build_token_map, inverse_map
from .loop import TrainConfig, as_sequence, fit, train_record
from .warm_start import deepen, hydra_from_medusa, hydra_on_eagle, untie_lm_heads


@dataclass(frozen=True)
class MedusaTrainConfig:
    """Settings of Medusa-1 head training."""

    num_heads: int = 3  # K: heads for positions t+2 .. t+K+1
    num_layers: int = 1  # ResBlocks per head (Medusa's default: 1); with init, more appends identity blocks
    draft_vocab: int = 8192  # Vd: most frequent target tokens of the data (0: the whole vocabulary)
    own_lm_head: bool = False  # True: each head trains its own copy of the LM head (Medusa-1's); with init of
    # a file whose heads share the frozen one, each head starts from a copy of it
    sequential: bool = False  # True: Hydra's sequentially dependent heads (medusa_heads.py)
    prefix: Optional[str] = None  # "layer" / "attention" / "pairs" / "eagle": a prefix layer (medusa_heads.py);
    # with init, added to a file's heads that have none (starting as the identity; "eagle": run_medusa_training's
    # prefix_from)
    freeze_prefix: bool = False  # True: the prefix layer is not trained (e.g. an "eagle" prefix from a trained
    # EAGLE-1 head: the heads' shared loss would move it towards the later heads, away from head 1's label)
    decay: float = 0.8  # lambda: head k's loss weight is decay ** k
    ranks: int = 8  # held-out: per-rank accuracies a_k(i) for i < ranks (the tree builder's input)
    heldout_fraction: float = 0.05  # sequences held out

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "ranks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab == 1 \
                or self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be 0 (whole vocabulary) or an int >= 2, got {self.draft_vocab!r}")
        if self.prefix is not None and self.prefix not in PREFIX_KINDS:
            raise ValueError(f"prefix must be None or one of {PREFIX_KINDS}, got {self.prefix!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")


class MedusaTask:
    """TrainTask (loop.py) of Medusa heads: batches need `features` (the target's final normed
    states) and the stored top-k."""

    def __init__(self, heads: MedusaHeads, config: MedusaTrainConfig = MedusaTrainConfig()):
        self.module, self.config = heads, config
        self.inv = inverse_map(heads.token_map, heads.vocab_size)  # (V,) target -> draft id

    def named_trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        frozen = self.config.freeze_prefix and self.module.prefix is not None
        return [(n, q) for n, q in self.module.trainable() if not (frozen and n.startswith("prefix"))]

    def _states(self, batch: Batch) -> torch.Tensor:
        """The states the heads read: the target's features (B, T, D), through the prefix layer
        (causal attention over each sequence's valid positions) when the heads have one."""
        if batch.features is None or batch.topk_ids is None:
            raise ValueError("Medusa training needs batches with target features and stored top-k")
        if self.module.prefix is None:
            return batch.features
        B, T = batch.tokens.shape
        dt = self.module.lm_heads[0].weight.dtype
        ar = torch.arange(T, device=batch.features.device)  # (T,)
        allowed = (ar.view(1, T) <= ar.view(T, 1)).unsqueeze(0) & batch.attention[:, None, :T].bool()  # (B, T, T)
        nxt = torch.cat([batch.tokens[:, 1:], torch.zeros_like(batch.tokens[:, :1])], dim=1)  # (B, T) x_{t+1}
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.config.freeze_prefix):
            return self.module.contextualise(batch.features.to(dt), ar.expand(B, T), additive_mask(allowed, dt),
                                             next_tokens=nxt, cur_tokens=batch.tokens)

    def _head(self, batch: Batch, k: int, states: torch.Tensor):
        """Head k (1-based) at every position t whose label (the top-k stored at t+k) exists, on the
        states (B, T, D) of _states.
        -> (log q (N, Vd), label ids (N, Kp), label probs (N, Kp), log q at the labels (N, Kp), valid)"""
        T = batch.tokens.shape[1]
        m = batch.loss_mask[:, k:] & batch.attention[:, :T - k]  # (B, T-k) label at t+k, feature at t
        h = states[:, :T - k][m].float()  # (N, D)
        toks = None
        if self.module.sequential:  # Hydra: teacher-forced x_{t+1} .. x_{t+k}
            toks = torch.stack([batch.tokens[:, j:T - k + j] for j in range(1, k + 1)], dim=-1)[m]  # (N, k)
        dt = self.module.lm_heads[0].weight.dtype
        logq = torch.log_softmax(self.module.head(k, h.to(dt), toks).float(), dim=-1)  # (N, Vd)
        ids = batch.topk_ids[:, k:][m]  # (N, Kp) target ids
        p = batch.topk_logprobs[:, k:][m].exp()  # (N, Kp)
        d = self.inv[ids]  # (N, Kp) draft ids, -1 outside the draft vocabulary
        valid = d >= 0  # (N, Kp)
        return logq, ids, p, logq.gather(1, d.clamp(min=0)), valid

    def loss(self, batch: Batch) -> torch.Tensor:
        total, states = None, self._states(batch)
        for k in range(1, self.module.num_heads + 1):
            _, _, p, lq, valid = self._head(batch, k, states)
            ce = -(p * lq * valid).sum(1).mean() if p.shape[0] else lq.sum() * 0
            total = self.config.decay ** k * ce if total is None else total + self.config.decay ** k * ce
        return total

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> Dict[str, float]:
        out: Dict[str, float] = {}
        R, states = self.config.ranks, self._states(batch)
        for k in range(1, self.module.num_heads + 1):
            logq, ids, p, lq, valid = self._head(batch, k, states)
            n = float(ids.shape[0])
            if k == 1:
                out["count"] = n
            order = logq.topk(min(R, logq.shape[1]), dim=-1).indices  # (N, R) draft ids by rank
            hit = self.module.token_map[order] == ids[:, :1]  # (N, R) rank i is the target's argmax
            out[f"h{k}_n"] = n
            out[f"h{k}_ce"] = float(-(p * lq * valid).sum())
            for i in range(hit.shape[1]):
                out[f"h{k}_r{i}"] = float(hit[:, i].sum())
        out["top1"] = out["h1_r0"]  # head 1's top-1: the curve the stopping rule watches (TrainConfig.stop_metric)
        return out


def rank_accuracies(metrics: Dict[str, float], num_heads: int, ranks: int, prefix: str = "heldout_") -> np.ndarray:
    """(K, ranks) a_k(i) from evaluate()'s position-weighted means (ratios of sums)."""
    acc = np.zeros((num_heads, ranks))
    for k in range(1, num_heads + 1):
        n = metrics.get(f"{prefix}h{k}_n", 0.0)
        for i in range(ranks):
            acc[k - 1, i] = metrics.get(f"{prefix}h{k}_r{i}", 0.0) / n if n > 0 else 0.0
    return acc


def run_medusa_training(target: torch.nn.Module, train: Sequence[Seq], heldout: Sequence[Seq],
                        train_cfg: TrainConfig, cfg: MedusaTrainConfig, out_path, *, run_dir=None,
                        data_record: Optional[dict] = None, measure_costs: bool = True, init=None,
                        prefix_from=None) -> dict:
    """Train heads on sequences WITH features (the feature store's), pick the tree for this
    machine from the held-out accuracies and the measured costs, save to out_path. -> record.
    init: a file (save_medusa's) to continue from, its heads and draft vocabulary kept.
    prefix_from: an EAGLE-1 head's file (save_eagle's) that Hydra heads from `init` get as their
    "eagle" prefix (warm_start.hydra_on_eagle: cfg.num_heads heads, at most one more than the
    file's; the EAGLE head's draft vocabulary)."""
    V = target.get_output_embeddings().weight.shape[0]
    if prefix_from is not None and (init is None or cfg.prefix != "eagle" or not cfg.sequential):
        raise ValueError("prefix_from (an EAGLE-1 head's file) needs init (Hydra heads), sequential heads and the "
                         "prefix 'eagle'")
    if init is not None:
        heads = load_medusa(target, init)
        data_record = {**(data_record or {}), "init": Path(str(init)).name}
        if prefix_from is not None:  # head 1 the EAGLE head's first draft, head k + 1 the file's head k
            if heads.prefix is not None:
                raise ValueError(f"{init} already has a prefix {heads.prefix_kind!r}")
            if not heads.sequential:
                heads = hydra_from_medusa(target, heads)
            heads = hydra_on_eagle(target, heads, load_eagle(target, prefix_from),
                                   min(cfg.num_heads, heads.num_heads + 1)).train()
            data_record["prefix_from"] = Path(str(prefix_from)).name
        if cfg.sequential and not heads.sequential:  # Hydra heads that start as the file's Medusa heads
            heads = hydra_from_medusa(target, heads, min(cfg.num_heads, heads.num_heads))
            data_record["init_from"] = "medusa"
        if cfg.num_layers > heads.num_layers:  # identity ResBlocks appended: the file's logits at the start
            data_record["init_layers"] = heads.num_layers
            deepen(heads, cfg.num_layers)
        if cfg.own_lm_head and not heads.own_lm_head:  # each head's LM head a trainable copy of the shared one
            untie_lm_heads(heads)
            data_record["lm_heads_untied"] = True
        if cfg.prefix is not None and heads.prefix is None:  # a prefix layer that starts as the identity
            heads.add_prefix(target, cfg.prefix)
            data_record["prefix_added"] = cfg.prefix
        elif cfg.prefix is not None and heads.prefix_kind != cfg.prefix:
            raise ValueError(f"{init} has a prefix {heads.prefix_kind!r}, not the {cfg.prefix!r} asked for")
    else:
        token_map = None if cfg.draft_vocab == 0 else build_token_map(train, V, min(cfg.draft_vocab, V))
        heads = MedusaHeads(target, cfg.num_heads, token_map, num_layers=cfg.num_layers,
                            own_lm_head=cfg.own_lm_head, sequential=cfg.sequential, prefix=cfg.prefix)
    result = fit(MedusaTask(heads, cfg), as_sequence(train), as_sequence(heldout), train_cfg, out_dir=run_dir)
    final = result.history[-1] if result.history else {}
    acc = rank_accuracies(final, heads.num_heads, cfg.ranks)  # the heads trained: --init keeps the file's K
    shape = {"num_heads": heads.num_heads, "num_layers": heads.num_layers, "own_lm_head": heads.own_lm_head,
             "sequential": heads.sequential, "prefix": heads.prefix_kind,
             "draft_vocab": int(heads.token_map.numel())}
    record = {"data": data_record or {}, "train": train_record(train_cfg, result), "medusa": {**asdict(cfg), **shape},
              "train_seconds": result.seconds, "train_sequences": len(train), "heldout_sequences": len(heldout),
              "heldout_top1": acc[:, 0].tolist(), "heldout_rank_acc": acc.tolist(), "history": result.history,
              "stopped_early": result.stopped_early}
    choices = None
    if measure_costs:
        heads.eval()
        vc = measure_verify_cost(target, 16)
        hc = measure_heads_cost(target, heads)
        choices, pred = best_tree(acc, vc["ratios"], hc["c"])
        record.update(verify_ratios=vc["ratios"], heads_cost=hc["c"], predicted_speedup=pred,
                      tree_nodes=len(choices))
    save_medusa(out_path, heads, fingerprint(target), record, choices)
    print(json.dumps({k: v for k, v in record.items() if k not in ("data", "history")}, indent=1))
    return record
