"""Training the EAGLE head (eagle_head.py) on a feature store with the shared loop (training/loop.py).

Li et al. 2024 (EAGLE, Sec. 3.2): the head is trained with teacher forcing on the target's own
features: at every position t it reads (f_t, x_{t+1}) and is asked for f_{t+1}. Loss =
w_reg * SmoothL1(f^_{t+1}, f_{t+1}) + w_cls * CE(p_{t+2}, q_{t+2}), where p is the target's
distribution (here its stored top-k, soft cross-entropy over the draft vocabulary) and the input
features carry uniform noise U(-eps, eps) (scaled by the features' RMS here; the paper adds
U(-0.1, 0.1) to Vicuna's features). Features are regressed after division by their RMS, so the
loss does not depend on the target's feature scale.

Held-out metrics: top1 (the head's argmax = the target's argmax of p_{t+2}, given true features: the
greedy acceptance of the first draft token), accept (sum_x min(p, q) over p's stored top-k) and
top1_step2 (the second draft token, fed the head's own predicted features at EVERY earlier
position: a pessimistic stand-in for drafting, where only the drafted positions are predicted).
Data: feature stores (`run_eagle_store_training`, `python -m specref train eagle --store A B ...`:
features scored once by store/, the corpus's answers and real text alike); `attach_features`
computes the same features in memory (tests, notebooks, transfer.py).
Left out: EAGLE-3's training-time test (unrolled drafting inside training).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..eagle_head import EagleHead, cur_kwargs, save_eagle
from ..target import additive_mask
from .draft import build_token_map, inverse_map
from .loop import as_sequence, fit, is_main_process, train_record
from .store import Batch, Seq


@dataclass(frozen=True)
class EagleTrainConfig:
    """Settings of EAGLE head training."""

    draft_vocab: int = 8192  # Vd: most frequent tokens of the distilled responses
    # the EAGLE paper's weights: at equal compute they beat 0.5 / 1.0 by +0.024 agreement on the
    # development answers (docs/experiments/levers.md, "Measured: compute and the EAGLE-1 loss weights")
    w_reg: float = 1.0  # weight of the feature regression (Smooth-L1 on RMS-normalised features)
    w_cls: float = 0.1  # weight of the soft cross-entropy against p's stored top-k
    noise: float = 0.1  # uniform input-feature noise, as a fraction of the features' RMS
    layers: int = 1  # decoder layers of the head (the paper's: 1); with --init, identity layers are
    # added after the file's own up to this count
    current_token: bool = False  # the FC also reads e(x_t) (eagle_head.py); with --init, zero columns added
    heldout_fraction: float = 0.05  # sequences held out for evaluation

    def __post_init__(self) -> None:
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 2:
            raise ValueError(f"draft_vocab must be an int >= 2, got {self.draft_vocab!r}")
        for name in ("w_reg", "w_cls", "noise"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.w_reg == 0 and self.w_cls == 0:
            raise ValueError("w_reg and w_cls cannot both be 0")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        if not isinstance(self.layers, int) or isinstance(self.layers, bool) or self.layers < 1:
            raise ValueError(f"layers must be an int >= 1, got {self.layers!r}")
        if not isinstance(self.current_token, bool):
            raise ValueError(f"current_token must be a bool, got {self.current_token!r}")


# ----------------------------------------------------------------------------- target features


@torch.no_grad()
def attach_features(target: torch.nn.Module, seqs: Sequence[Seq], batch_size: int = 8,
                    max_len: Optional[int] = None, dtype: torch.dtype = torch.float16,
                    progress: bool = True) -> None:
    """Set seq.features (L, D) = the target's final normed hidden states (what its LM head reads),
    computed in right-padded batches of similar length; kept in `dtype` to save memory."""
    from tqdm.auto import tqdm

    dev = next(target.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens))
    for b0 in tqdm(range(0, len(order), batch_size), desc="target features", disable=not progress):
        part = [seqs[i] for i in order[b0: b0 + batch_size]]
        lens = [min(len(s.tokens), max_len or len(s.tokens)) for s in part]
        tok = torch.zeros(len(part), max(lens), dtype=torch.long)  # (B, T)
        att = torch.zeros(len(part), max(lens), dtype=torch.long)  # (B, T)
        for j, (s, L) in enumerate(zip(part, lens)):
            tok[j, :L], att[j, :L] = s.tokens[:L], 1
        h = target.model(input_ids=tok.to(dev), attention_mask=att.to(dev)).last_hidden_state  # (B, T, D)
        for j, (s, L) in enumerate(zip(part, lens)):
            s.features = h[j, :L].to(dtype).cpu()  # (L, D)


# ----------------------------------------------------------------------------- the task


class EagleTask:
    """TrainTask (loop.py) of the EAGLE head: needs batches with features and stored top-k."""

    def __init__(self, head: EagleHead, config: EagleTrainConfig = EagleTrainConfig(), seed: int = 0):
        self.module, self.config = head, config
        dev = head.token_map.device
        self.inv = inverse_map(head.token_map, head.vocab_size)  # (V,) target -> draft id
        self.gen = torch.Generator(device=dev).manual_seed(seed)

    def named_trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return self.module.trainable()

    def _run(self, batch: Batch, feats_in: torch.Tensor) -> torch.Tensor:
        """Teacher-forced head over pairs (f_t, x_{t+1}), t = 0..T-2. -> f^ (B, T-1, D)"""
        B, T = batch.tokens.shape
        pos = torch.arange(T - 1, device=feats_in.device).expand(B, -1)  # (B, T-1)
        keys = batch.attention[:, 1:]  # (B, T-1) real pairs
        causal = pos.unsqueeze(2) >= pos.unsqueeze(1)  # (B, T-1, T-1)
        mask = additive_mask(causal & keys.unsqueeze(1), feats_in.dtype)  # (B, 1, T-1, T-1)
        return self.module(feats_in, batch.tokens[:, 1:], pos, mask,
                           **cur_kwargs(self.module, batch.tokens[:, :-1]))  # (B, T-1, D)

    def _parts(self, batch: Batch, noise: bool):
        if batch.features is None or batch.topk_ids is None:
            raise ValueError("EAGLE training needs batches with target features and stored top-k "
                             "(attach_features; distill with topk > 0)")
        f = batch.features.float()  # (B, T, D)
        real = batch.attention  # (B, T)
        rms = f[real].pow(2).mean().sqrt().clamp(min=1e-6)  # ()
        f_in = f[:, :-1]  # (B, T-1, D) f_t
        if noise and self.config.noise > 0:
            u = torch.rand(f_in.shape, generator=self.gen, device=f.device)  # (B, T-1, D)
            f_in = f_in + (2 * u - 1) * (self.config.noise * rms)
        f_hat = self._run(batch, f_in)  # (B, T-1, D) predicts f_{t+1}
        return f, rms, f_hat

    def _cls(self, batch: Batch, f_hat: torch.Tensor):
        """Soft CE terms at pairs whose f_{t+1} predicts a response token (stored top-k at t+1)."""
        m = batch.loss_mask[:, 1:]  # (B, T-1)
        logq = torch.log_softmax(self.module.logits(f_hat[m]).float(), dim=-1)  # (N, Vd)
        ids = batch.topk_ids[:, 1:][m]  # (N, K) target ids
        p = batch.topk_logprobs[:, 1:][m].exp()  # (N, K)
        d = self.inv[ids]  # (N, K) draft ids, -1 outside the draft vocabulary
        valid = d >= 0  # (N, K)
        lq = logq.gather(1, d.clamp(min=0))  # (N, K)
        return logq, ids, p, lq, valid

    def loss(self, batch: Batch) -> torch.Tensor:
        f, rms, f_hat = self._parts(batch, noise=True)
        real = batch.attention[:, 1:]  # (B, T-1)
        reg = F.smooth_l1_loss(f_hat[real] / rms, f[:, 1:][real] / rms)
        _, _, p, lq, valid = self._cls(batch, f_hat)
        cls = -(p * lq * valid).sum(1).mean() if p.numel() else f_hat.sum() * 0
        return self.config.w_reg * reg + self.config.w_cls * cls

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> Dict[str, float]:
        f, rms, f_hat = self._parts(batch, noise=False)
        real = batch.attention[:, 1:]  # (B, T-1)
        logq, ids, p, lq, valid = self._cls(batch, f_hat)
        top1 = self.module.token_map[logq.argmax(1)] == ids[:, 0]  # (N,)
        accept = (torch.minimum(p, lq.exp()) * valid).sum(1)  # (N,)
        # step 2: every pair reads the head's own prediction of its feature (f^_t from pair t-1)
        f2 = torch.cat([f[:, :1], f_hat[:, :-1]], dim=1)  # (B, T-1, D)
        logq2 = self._cls(batch, self._run(batch, f2))[0]  # (N, Vd)
        top1_2 = self.module.token_map[logq2.argmax(1)] == ids[:, 0]  # (N,)
        reg = F.smooth_l1_loss(f_hat[real] / rms, f[:, 1:][real] / rms, reduction="sum") / f.shape[-1]
        n = float(ids.shape[0])
        copy = copy_positions(batch, ids[:, 0])  # (N,)
        return {"count": n, "top1": float(top1.sum()), "accept": float(accept.sum()),
                "top1_step2": float(top1_2.sum()), "reg": float(reg) * n / max(float(real.sum()), 1.0),
                "coverage": float(valid[:, 0].sum()), "copy_count": float(copy.sum()),
                "copy_top1": float((top1 & copy).sum())}


def copy_positions(batch: Batch, labels: torch.Tensor) -> torch.Tensor:
    """(N,) bool over the pairs EagleTask scores (batch.loss_mask[:, 1:], row-major): the target's
    next token continues a bigram of the row's prompt, i.e. (x_{t+1}, label) occurs in tokens[:P]:
    the positions prompt lookup drafts and a head must copy. labels (N,) target ids."""
    m = batch.loss_mask[:, 1:]  # (B, T-1)
    rows, cols = m.nonzero(as_tuple=True)  # (N,) each
    V = int(max(int(batch.tokens.max()), int(labels.max()) if labels.numel() else 0)) + 1
    code = batch.tokens[rows, cols + 1] * V + labels  # (N,) the bigram (x_{t+1}, label)
    out = torch.zeros_like(labels, dtype=torch.bool)  # (N,)
    first = torch.where(batch.loss_mask.any(1), batch.loss_mask.float().argmax(1), 0)  # (B,) P - 1 per row
    for b in range(m.shape[0]):
        P = int(first[b]) + 1
        sel = rows == b
        if P > 1 and bool(sel.any()):
            pr = batch.tokens[b, :P]  # (P,) the prompt
            out[sel] = torch.isin(code[sel], pr[:-1] * V + pr[1:])
    return out


# ----------------------------------------------------------------------------- one command


def run_eagle_store_training(target: torch.nn.Module, train: Sequence[Seq], heldout: Sequence[Seq],
                             train_cfg, eagle_cfg: EagleTrainConfig, out_path, *, run_dir=None,
                             data_record: Optional[dict] = None, init=None) -> dict:
    """Train the EAGLE-1 head on sequences that carry features (a feature store's, store/: the
    corpus's answers, real text, or both), save it to out_path. -> record.

    init: a head file (save_eagle's) to continue training from, its draft vocabulary kept
    (eagle_cfg.draft_vocab is then unused): more data and more steps for a head whose own data is
    gone, e.g. the committed one; None: a fresh head, its vocabulary from `train`."""
    V = target.get_output_embeddings().weight.shape[0]
    init_record = None
    if init is not None:
        from ..eagle_head import eagle_info, extra_layers_in, load_eagle

        init_record = {"path": Path(str(init)).name, **{k: v for k, v in eagle_info(init)["record"].items()
                                             if k in ("heldout", "train", "data", "init")}}
        head = load_eagle(target, init, max(extra_layers_in(init), eagle_cfg.layers - 1),
                          True if eagle_cfg.current_token else None)  # fit() trains it
    else:
        head = EagleHead(target, build_token_map(train, V, eagle_cfg.draft_vocab), seed=train_cfg.seed,
                         extra_layers=eagle_cfg.layers - 1, current_token=eagle_cfg.current_token)
    result = fit(EagleTask(head, eagle_cfg, seed=train_cfg.seed), as_sequence(train), as_sequence(heldout), train_cfg,
                 out_dir=run_dir)
    final = result.history[-1] if result.history else {}
    # the head's own shape, not the flags: a head continued from a file keeps the file's vocabulary,
    # depth and inputs whatever the command said
    shape = {"draft_vocab": int(head.token_map.numel()), "layers": head.num_layers,
             "current_token": bool(head.current_token)}
    record = {"data": data_record or {}, "train": train_record(train_cfg, result),
              "eagle": {**asdict(eagle_cfg), **shape}, "train_seconds": result.seconds,
              "heldout": {k: v for k, v in final.items() if k.startswith("heldout_")},
              "train_sequences": len(train), "heldout_sequences": len(heldout), "history": result.history,
              "stopped_early": result.stopped_early}
    if init_record is not None:
        record["init"] = init_record
    if is_main_process():
        from ..weights import fingerprint

        save_eagle(out_path, head, fingerprint(target), record)
        print(json.dumps({k: v for k, v in record.items() if k not in ("data", "history")}, indent=1))
    return record
