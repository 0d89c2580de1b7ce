"""Training the draft for the default model: few target layers, a reduced vocabulary, distilled on p.

Vanilla speculative decoding (Leviathan et al. 2023) gains only if the draft is both cheap (c, the
cost of a draft step over a target step) and close to the target (alpha). On 2 CPU cores the
default target's LM head (576 x 49152) alone costs ~21% of a target step (DESIGN.md), so the draft
here is: the target's input embedding (frozen, shared storage), its first L decoder layers and
final norm (copied, trained), and an LM head over only the Vd most frequent tokens of the
distilled responses (EAGLE-3's reduced draft vocabulary, Li et al. 2025), mapped back to target
ids by `token_map` (Vd,). q is 0 outside the map, which keeps speculative sampling lossless.
The architecture and its weight files live with the method (draft_model.build_draft,
save_draft, load_trained_draft); this file holds its data statistics, loss and training run.

Training (training/loop.py) minimises KL(p || q) on a feature store's answers: the soft cross-
entropy -sum_x p(x) log q(x) over the target's stored top-k tokens that are in the draft
vocabulary (H(p) is a constant), or, with loss="ce", the cross-entropy on the target's argmax.
Held-out metrics: top-1 agreement (the greedy acceptance rate given the target's context),
beta = sum_x min(p, q) over the stored top-k (a lower bound: p's mass outside the top-k is
dropped), and coverage (target argmax inside the draft vocabulary).
Left out: draft models of another architecture or tokenizer; training on target hidden states
(that is EAGLE's, eagle_head.py). Only Llama-family decoders (`model.model.layers`, unscaled
embeddings, plain LM head) are supported.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..draft_model import build_draft, load_trained_draft, save_draft
from .loop import as_sequence, fit, is_main_process, train_record
from .store import Batch, Seq, teacher_topk


@dataclass(frozen=True)
class DraftTrainConfig:
    """Settings of the distilled draft."""

    num_layers: int = 2  # decoder layers, initialised from the target's first ones
    draft_vocab: int = 8192  # Vd: most frequent tokens of the distilled responses
    loss: str = "kl"  # "kl": soft cross-entropy to p's top-k; "ce": cross-entropy to p's argmax
    heldout_fraction: float = 0.05  # sequences held out for evaluation

    def __post_init__(self) -> None:
        if self.loss not in ("kl", "ce"):
            raise ValueError(f"loss must be 'kl' or 'ce', got {self.loss!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {self.num_layers!r}")
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 2:
            raise ValueError(f"draft_vocab must be an int >= 2, got {self.draft_vocab!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")


def inverse_map(token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) target id -> its index in token_map (the draft id), -1 for ids outside the draft vocabulary."""
    inv = torch.full((vocab_size,), -1, dtype=torch.long, device=token_map.device)  # (V,)
    inv[token_map] = torch.arange(token_map.numel(), device=token_map.device)
    return inv


def build_token_map(seqs: Sequence[Seq], vocab_size: int, draft_vocab: int) -> torch.Tensor:
    """The draft_vocab target ids with the most expected occurrences in the responses (sum of p
    over the stored top-k, or plain counts of the response tokens), ties and unseen ids by id."""
    if not 2 <= draft_vocab <= vocab_size:
        raise ValueError(f"draft_vocab must be in [2, {vocab_size}], got {draft_vocab}")
    counts = torch.zeros(vocab_size, dtype=torch.float64)  # (V,)
    for s in seqs:
        if s.topk_ids is not None:
            counts.index_add_(0, s.topk_ids.flatten(), s.topk_logprobs.double().exp().flatten())
        else:
            counts.index_add_(0, s.tokens[s.prompt_len:], torch.ones(len(s.tokens) - s.prompt_len,
                                                                      dtype=torch.float64))
    # stable sort on -count: equal counts keep id order (low BPE ids are the frequent merges)
    order = torch.sort(-counts, stable=True).indices  # (V,)
    return order[:draft_vocab].clone()  # (Vd,)


class DraftDistillTask:
    """TrainTask: distil a reduced-vocabulary draft against the target's top-k distributions.

    Batches carry the stored top-k (the store's); without it, the frozen `target` computes it
    (store.teacher_topk)."""

    def __init__(self, draft: torch.nn.Module, token_map: torch.Tensor, vocab_size: int, loss: str = "kl",
                 target: Optional[torch.nn.Module] = None, topk: int = 32):
        if loss not in ("kl", "ce"):
            raise ValueError(f"loss must be 'kl' or 'ce', got {loss!r}")
        self.module, self.target, self.loss_kind, self.topk = draft, target, loss, topk
        dev = next(draft.parameters()).device
        self.token_map = torch.as_tensor(token_map, dtype=torch.long, device=dev)  # (Vd,)
        self.inv = inverse_map(self.token_map, vocab_size)  # (V,)

    def named_trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def _score(self, batch: Batch):
        """Draft log q and the teacher's top-k at the loss positions (N of them)."""
        if batch.topk_ids is None:
            if self.target is None:
                raise ValueError("the batch holds no stored top-k and the task has no target to compute it")
            ids, logp = teacher_topk(self.target, batch, self.topk)  # (B, T, K)
        else:
            ids, logp = batch.topk_ids, batch.topk_logprobs
        m = batch.loss_mask  # (B, T)
        hid = self.module.model(input_ids=batch.tokens, attention_mask=batch.attention.long()).last_hidden_state
        logq = torch.log_softmax(self.module.lm_head(hid[m]).float(), dim=-1)  # (N, Vd)
        d_ids = self.inv[ids[m]]  # (N, K) draft ids, -1 outside the draft vocabulary
        p = logp[m].exp()  # (N, K)
        valid = d_ids >= 0  # (N, K)
        lq = logq.gather(1, d_ids.clamp(min=0))  # (N, K)
        return logq, ids[m], p, lq, valid

    def _loss_rows(self, p, lq, valid) -> torch.Tensor:
        if self.loss_kind == "kl":
            return -(p * lq * valid).sum(1)  # (N,)
        return -(lq[:, 0] * valid[:, 0])  # (N,)

    def loss(self, batch: Batch) -> torch.Tensor:
        _, _, p, lq, valid = self._score(batch)
        return self._loss_rows(p, lq, valid).mean()

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> Dict[str, float]:
        logq, ids, p, lq, valid = self._score(batch)
        top1 = self.token_map[logq.argmax(1)] == ids[:, 0]  # (N,)
        accept = (torch.minimum(p, lq.exp()) * valid).sum(1)  # (N,)
        return {"count": float(ids.shape[0]), "loss": float(self._loss_rows(p, lq, valid).sum()),
                "top1": float(top1.sum()), "accept": float(accept.sum()),
                "coverage": float(valid[:, 0].sum())}


# ----------------------------------------------------------------------------- one command


def run_draft_store_training(target: torch.nn.Module, train: Sequence[Seq], heldout: Sequence[Seq], train_cfg,
                             draft_cfg: DraftTrainConfig, out_path, *, run_dir=None,
                             data_record: Optional[dict] = None, init=None) -> dict:
    """Train the reduced-vocabulary draft on feature-store sequences (their stored top-k; the
    features are not needed: read the stores with layers=()), save it to out_path. -> record.
    init: a draft file (save_draft's) to continue from, its layers and draft vocabulary kept."""
    from ..weights import fingerprint

    V = target.get_output_embeddings().weight.shape[0]
    if init is not None:
        draft, token_map = load_trained_draft(target, init)
        data_record = {**(data_record or {}), "init": Path(str(init)).name}
    else:
        token_map = build_token_map(train, V, draft_cfg.draft_vocab)
        draft = build_draft(target, draft_cfg.num_layers, token_map)
    task = DraftDistillTask(draft, token_map, V, draft_cfg.loss)  # the stored top-k only
    result = fit(task, as_sequence(train), as_sequence(heldout), train_cfg, out_dir=run_dir)
    final = result.history[-1] if result.history else {}
    shape = {"num_layers": int(draft.config.num_hidden_layers), "draft_vocab": int(token_map.numel())}  # --init: the file's
    record = {"data": data_record or {}, "train": train_record(train_cfg, result), "draft": {**asdict(draft_cfg), **shape},
              "train_seconds": result.seconds, "heldout": {k: v for k, v in final.items() if k.startswith("heldout_")},
              "train_sequences": len(train), "heldout_sequences": len(heldout), "history": result.history,
              "stopped_early": result.stopped_early}
    if is_main_process():
        save_draft(out_path, draft, token_map, fingerprint(target), record)
        print(json.dumps({k: v for k, v in record.items() if k not in ("data", "history")}, indent=1))
    return record
