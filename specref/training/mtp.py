"""Training MTP modules (mtp.py) on a frozen target with the shared loop (training/loop.py).

DeepSeek-V3 technical report, Sec. 2.2, "MTP Training Objective": module k's cross-entropy
L^k_MTP = -1/T sum_{i=2+k}^{T+1} log P^k_i[t_i], and L_MTP = lambda/D * sum_k L^k_MTP, added to the
main model's loss. The target is frozen here, so only L_MTP is trained, and its label is the target's
distribution p, never the corpus token: soft cross-entropy against the stored top-k of p (over the
draft vocabulary; mass outside it is dropped, as for the EAGLE head). Teacher forcing as in the
report: module d at position i reads the TRUE token x_{i+d} and h^{d-1}_i (the target's features for
d = 1, module d-1's outputs otherwise; gradients flow back through the chain) and predicts x_{i+d+1},
whose p is stored at position i+d (data.Batch: position t holds the target's top-k for token t+1).

Held-out metrics per depth d, on the same label positions for every depth (those at t >= D):
ce_d, top1_d (module d's argmax = the target's: the greedy acceptance of draft d given the drafts
before it were right) and accept_d (sum_x min(p, q) over p's stored top-k); top1 / accept are depth
1's (what the bench reads as alpha); loss is the training objective.
Left out: the main model's next-token loss and lambda's schedule (0.3 then 0.1 in the report; with
a frozen target lambda only scales the gradient), feature noise (the report adds none).

Beyond the report (off by default): `w_reg` > 0 adds EAGLE's feature regression (Li et al. 2024,
Sec. 3.2; training/eagle.py) to every depth: module d's normed output at position i, what the
shared LM head reads, is asked for the target's own final normed state at position i + d (the one
whose LM head gives p of the same token x_{i+d+1}): w_reg * mean_d SmoothL1 over RMS-normalised
states. In DeepSeek-V3 the main model trains beside the modules; on a frozen target this gives
each module the target's next state as a dense target, as EAGLE's head gets (EAGLE's ablation of
the loss weights: docs/training.md, lever ii). lam = 0.1 with w_reg = 1.0 is EAGLE's ratio.
`current_token` (mtp.py's option) feeds module d at i the true token x_{i+d-1} as its third input.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..eagle_head import FORMAT as EAGLE_FORMAT, load_eagle
from ..mtp import MTPStack, load_mtp, save_mtp
from ..target import additive_mask
from ..weights import copy_weights, fingerprint, read_weights
from .data import Batch, Seq
from .draft import build_token_map, inverse_map
from .loop import TrainConfig, TrainResult, distilled_run, fit, is_main_process, split_heldout, train_record
from .warm_start import mtp_from_eagle


@dataclass(frozen=True)
class MTPTrainConfig:
    """Settings of MTP training."""

    num_modules: int = 1  # D, sequential modules (DeepSeek-V3 ships 1)
    draft_vocab: int = 8192  # Vd: most frequent tokens of the training responses (>= V: all)
    lam: float = 1.0  # lambda, the weight of L_MTP (the report: 0.3, then 0.1, beside the main loss)
    w_reg: float = 0.0  # weight of EAGLE's feature regression at every depth (0: the report's CE only)
    current_token: bool = False  # modules also read the token before the one they embed (mtp.py); with --init,
    # zero columns added to the file's modules
    heldout_fraction: float = 0.05  # sequences held out (the one-command run only)

    def __post_init__(self) -> None:
        for name, low in (("num_modules", 1), ("draft_vocab", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if isinstance(self.lam, bool) or not (isinstance(self.lam, (int, float)) and self.lam > 0):
            raise ValueError(f"lam must be a number > 0, got {self.lam!r}")
        if isinstance(self.w_reg, bool) or not (isinstance(self.w_reg, (int, float)) and self.w_reg >= 0):
            raise ValueError(f"w_reg must be a number >= 0, got {self.w_reg!r}")
        if not isinstance(self.current_token, bool):
            raise ValueError(f"current_token must be a bool, got {self.current_token!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")


class MTPTask:
    """TrainTask (loop.py) of an MTPStack: batches need target features and stored top-k."""

    def __init__(self, stack: MTPStack, config: MTPTrainConfig = MTPTrainConfig()):
        if not isinstance(stack, MTPStack):
            raise ValueError(f"stack must be an MTPStack, got {type(stack).__name__}")
        self.module, self.config = stack, config
        self.inv = inverse_map(stack.token_map, stack.vocab_size)  # (V,) target -> draft id

    def named_trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return self.module.trainable()

    def _depths(self, batch: Batch) -> List[torch.Tensor]:
        """Teacher-forced modules: entry d-1 is h^d (B, T-d, D) at positions i = 0..T-1-d."""
        if batch.features is None or batch.topk_ids is None:
            raise ValueError("MTP training needs batches with target features and stored top-k "
                             "(training.eagle.attach_features; distill with topk > 0)")
        B, T = batch.tokens.shape
        if T <= self.module.num_modules:
            raise ValueError(f"sequences of {T} tokens are too short for {self.module.num_modules} MTP modules")
        h, out = batch.features.to(self.module.lm_head.weight.dtype), []  # (B, T, D) h^0
        for d in range(1, self.module.num_modules + 1):
            Q = T - d
            pos = torch.arange(Q, device=h.device).expand(B, Q)  # (B, Q)
            causal = pos.unsqueeze(2) >= pos.unsqueeze(1)  # (B, Q, Q)
            mask = additive_mask(causal & batch.attention[:, d:].unsqueeze(1), h.dtype)  # (B, 1, Q, Q)
            cur = batch.tokens[:, d - 1:T - 1]  # (B, Q) t_{i+d-1}, read by a current_token stack
            h = self.module(d - 1, h[:, :Q], batch.tokens[:, d:], pos, mask, cur_tokens=cur)  # (B, Q, D) h^d_i
            out.append(h)
        return out

    def _soft(self, d: int, h: torch.Tensor, batch: Batch, m: torch.Tensor):
        """Depth d's terms at label positions m (B, T-d): log q (N, Vd), target ids (N, K), p (N, K),
        log q at p's ids (N, K) and whether they are in the draft vocabulary (N, K)."""
        logq = torch.log_softmax(self.module.logits(d - 1, h[m]).float(), dim=-1)  # (N, Vd)
        ids = batch.topk_ids[:, d:][m]  # (N, K)
        p = batch.topk_logprobs[:, d:][m].exp()  # (N, K)
        dr = self.inv[ids]  # (N, K) draft ids, -1 outside the draft vocabulary
        return logq, ids, p, logq.gather(1, dr.clamp(min=0)), dr >= 0

    def _reg(self, d: int, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Depth d's feature regression: its normed output at i (B, T-d, D) against the target's
        h^0_{i+d}, both over the target states' RMS, at real positions; Smooth-L1, mean."""
        f = batch.features.float()  # (B, T, D) h^0
        real = batch.attention[:, d:]  # (B, T-d) positions i + d that hold a real token
        rms = f[batch.attention].pow(2).mean().sqrt().clamp(min=1e-6)  # ()
        out = self.module.layers[d - 1].norm(h).float()  # (B, T-d, D) what the LM head reads
        return F.smooth_l1_loss(out[real] / rms, f[:, d:][real] / rms)

    def loss(self, batch: Batch) -> torch.Tensor:
        terms, regs = [], []
        for d, h in enumerate(self._depths(batch), start=1):
            _, _, p, lq, valid = self._soft(d, h, batch, batch.loss_mask[:, d:])
            terms.append(-(p * lq * valid).sum(1).mean() if p.numel() else h.sum() * 0)
            if self.config.w_reg > 0:
                regs.append(self._reg(d, h, batch))
        loss = self.config.lam * torch.stack(terms).mean()
        return loss + self.config.w_reg * torch.stack(regs).mean() if regs else loss

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> Dict[str, float]:
        D, T = self.module.num_modules, batch.tokens.shape[1]
        res: Dict[str, float] = {"loss": 0.0}
        for d, h in enumerate(self._depths(batch), start=1):
            t = torch.arange(d, T, device=h.device)  # (T-d,) label positions
            m = batch.loss_mask[:, d:] & (t >= D).view(1, -1)  # (B, T-d): the same positions at every depth
            logq, ids, p, lq, valid = self._soft(d, h, batch, m)
            ce = -(p * lq * valid).sum(1)  # (N,)
            res["count"] = float(ids.shape[0])
            res[f"ce_{d}"] = float(ce.sum())
            res[f"top1_{d}"] = float((self.module.token_map[logq.argmax(1)] == ids[:, 0]).sum())
            res[f"accept_{d}"] = float((torch.minimum(p, lq.exp()) * valid).sum())
            res["loss"] += self.config.lam * float(ce.sum()) / D
            if self.config.w_reg > 0:  # a sum over label positions of the batch's mean, as loss's terms
                res[f"reg_{d}"] = float(self._reg(d, h, batch)) * float(ids.shape[0])
                res["loss"] += self.config.w_reg * res[f"reg_{d}"] / D
        res["top1"], res["accept"] = res["top1_1"], res["accept_1"]
        return res


# ----------------------------------------------------------------------------- one function, one command


def run_mtp_training(target: torch.nn.Module, train_seqs: Sequence[Seq], heldout_seqs: Sequence[Seq],
                     train_cfg: TrainConfig, mtp_cfg: MTPTrainConfig, out_path, *, checkpoint_dir=None,
                     record: Optional[dict] = None, progress: bool = True, log=print,
                     init=None) -> Tuple[MTPStack, TrainResult]:
    """Train MTP modules for the frozen `target` on sequences WITH `features` (the target's final
    normed states, (L, D)) and stored top-k; write them to out_path (safetensors, through
    specref.weights: the target's fingerprint, a record with the settings and held-out numbers).
    init: a file (save_mtp's) to continue from, its modules and draft vocabulary kept, or an
    EAGLE-1 head's file (save_eagle's) whose head every module starts as (warm_start.mtp_from_eagle).
    -> (the trained stack, fit's result)."""
    for name, seqs in (("train_seqs", train_seqs), ("heldout_seqs", heldout_seqs)):
        bad = [i for i, s in enumerate(seqs) if s.features is None or s.topk_ids is None]
        if bad:
            raise ValueError(f"{name}[{bad[0]}] has no features or no stored top-k: attach the target's "
                             "final normed states (L, D) as Seq.features and distil with topk > 0")
    V = int(target.get_output_embeddings().weight.shape[0])
    cur = True if mtp_cfg.current_token else None  # None: the file's inputs
    if init is not None and read_weights(init, names=())[1].get("format") == EAGLE_FORMAT:
        stack = mtp_from_eagle(target, load_eagle(target, init, current_token=cur), mtp_cfg.num_modules)
        record = {**(record or {}), "init": Path(str(init)).name, "init_from": "eagle"}
    elif init is not None:
        stack = load_mtp(target, init, cur)
        record = {**(record or {}), "init": Path(str(init)).name}
    else:
        token_map = build_token_map(train_seqs, V, min(mtp_cfg.draft_vocab, V))
        stack = MTPStack(target, token_map, num_modules=mtp_cfg.num_modules, seed=train_cfg.seed,
                         current_token=mtp_cfg.current_token)
    result = fit(MTPTask(stack, mtp_cfg), train_seqs, heldout_seqs, train_cfg, out_dir=checkpoint_dir,
                 progress=progress, log=log)
    stack.eval()
    if is_main_process():  # data-parallel runs: the main process writes the file
        final = result.history[-1] if result.history else {}
        shape = {"num_modules": stack.num_modules, "draft_vocab": int(stack.token_map.numel()),
                 "current_token": stack.current_token}  # --init: the file's
        rec = {**(record or {}), "train": train_record(train_cfg, result), "mtp": {**asdict(mtp_cfg), **shape},
               "train_seconds": result.seconds,
               "heldout": {k: v for k, v in final.items() if k.startswith("heldout_")},
               "train_sequences": len(train_seqs), "heldout_sequences": len(heldout_seqs),
               "history": result.history, "stopped_early": result.stopped_early}
        save_mtp(out_path, stack, fingerprint(target), rec)
    return stack, result


def run_mtp_command(data_cfg, train_cfg: TrainConfig, mtp_cfg: MTPTrainConfig, *, out=None, data=None,
                    device="cpu", export=None) -> int:
    """`python -m specref train --method mtp`: self-distil data with the default model (or reuse
    `data`), attach the target's features (cached in the run folder), train, save (and `export`)."""
    from accelerate import PartialState

    from .eagle import attach_features, load_features, save_features

    out, target, _, manifest, seqs, t_data = distilled_run(data_cfg, out, data, device, f"mtp_seed{train_cfg.seed}")
    fp = f"{manifest['model_fingerprint']}:{len(seqs)}:{train_cfg.max_len}"
    t0 = time.perf_counter()
    with PartialState().main_process_first():  # the features file is shared with EAGLE's format
        if not load_features(out / "features.safetensors", seqs, fp):
            attach_features(target, seqs, max_len=train_cfg.max_len)
            if is_main_process():
                save_features(out / "features.safetensors", seqs, fp)
    train, held = split_heldout(seqs, mtp_cfg.heldout_fraction, train_cfg.seed)
    rec = {"data": {k: manifest[k] for k in ("counts", "settings", "model_fingerprint")},
           "data_seconds_this_run": t_data + time.perf_counter() - t0}
    stack, _ = run_mtp_training(target, train, held, train_cfg, mtp_cfg, out / "mtp.safetensors",
                                checkpoint_dir=out, record=rec)
    if is_main_process():
        if export:
            copy_weights(out / "mtp.safetensors", export)
        print(json.dumps({"saved": str(out / "mtp.safetensors"), "export": export}, indent=1))
    return 0
