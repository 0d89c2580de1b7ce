"""Training the MLP speculator (mlp_speculator.py) on a frozen target with the shared loop (loop.py).

Wertheimer et al. 2024, Sec. 3: the base model is frozen; stage i at position t reads the state of
stage i-1 at t (stage 1: the target's state h_t) and the embedding of the TRUE token x_{t+i}
(teacher forcing, as IBM's training code runs every stage over the whole sequence at once), and
predicts x_{t+i+1}; the loss is the sum of the stages' cross-entropies (here their mean). The
paper's second phase trains on the base model's own generations so the speculator learns the
model's distribution; here the label is always the target's p (the stored top-k, soft
cross-entropy over the draft vocabulary; mass outside it is dropped, as for the other heads),
whatever the text. Gradients flow through the chain of states.

Held-out metrics per stage d, on the same label positions for every stage (those at t >= n):
ce_d, top1_d (stage d's argmax = the target's: the greedy acceptance of draft d given the drafts
before it were right) and accept_d (sum_x min(p, q) over p's stored top-k); top1 / accept are stage
1's. The keys are MTPTask's, so training/transfer.py reads both alike.
Left out: the paper's phase-1 training on the corpus's own next tokens (never the label here).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..mlp_speculator import MLPSpeculator, save_mlp_speculator
from ..weights import fingerprint
from .draft import build_token_map, inverse_map
from .loop import TrainConfig, TrainResult, fit, is_main_process, train_record
from .store import Batch, Seq


@dataclass(frozen=True)
class MLPSpeculatorTrainConfig:
    """Settings of MLP speculator training (a fresh speculator; `init` keeps a file's own)."""

    n_predict: int = 3  # n, stages (IBM's published speculators: 3 to 5)
    inner_dim: int = 0  # d (0: the target's hidden size)
    tie_weights: bool = True  # one E, H, LN for all stages, one P for stages 2..n (a small file)
    scale_input: bool = True  # s_0 = LN_0(h) / sqrt(2)
    target_embedding: bool = True  # E: the target's input embedding, frozen (ours; needs d = D)
    draft_vocab: int = 2048  # Vd: most frequent tokens of the training responses (>= V: all)
    heldout_fraction: float = 0.05  # sequences held out

    def __post_init__(self) -> None:
        for name, low in (("n_predict", 1), ("inner_dim", 0), ("draft_vocab", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")


class MLPSpeculatorTask:
    """TrainTask (loop.py) of an MLPSpeculator: batches need target features and stored top-k."""

    def __init__(self, speculator: MLPSpeculator):
        if not isinstance(speculator, MLPSpeculator):
            raise ValueError(f"speculator must be an MLPSpeculator, got {type(speculator).__name__}")
        self.module = speculator
        self.inv = inverse_map(speculator.token_map, speculator.vocab_size)  # (V,) target -> draft id

    def named_trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return self.module.trainable()

    def _states(self, batch: Batch) -> List[torch.Tensor]:
        """Teacher-forced stages: entry d-1 is s_d (B, T-d, d) at positions t = 0..T-1-d."""
        if batch.features is None or batch.topk_ids is None:
            raise ValueError("MLP speculator training needs batches with target features and stored top-k "
                             "(a feature store's, or training.eagle.attach_features with topk > 0)")
        T, n = batch.tokens.shape[1], self.module.n_predict
        if T <= n:
            raise ValueError(f"sequences of {T} tokens are too short for {n} speculator stages")
        s = self.module.start(batch.features.to(self.module.proj[0].weight.dtype))  # (B, T, D) s_0
        out = []
        for d in range(1, n + 1):
            s = self.module.stage(d - 1, s[:, : T - d], batch.tokens[:, d:])  # (B, T-d, d) s_d at t
            out.append(s)
        return out

    def _soft(self, d: int, s: torch.Tensor, batch: Batch, m: torch.Tensor):
        """Stage d's terms at label positions m (B, T-d): log q (N, Vd), target ids (N, K), p (N, K),
        log q at p's ids (N, K) and whether they are in the draft vocabulary (N, K)."""
        logq = torch.log_softmax(self.module.logits(d - 1, s[m]).float(), dim=-1)  # (N, Vd)
        ids = batch.topk_ids[:, d:][m]  # (N, K) p of token t+d+1 is stored at t+d
        p = batch.topk_logprobs[:, d:][m].exp()  # (N, K)
        dr = self.inv[ids]  # (N, K) draft ids, -1 outside the draft vocabulary
        return logq, ids, p, logq.gather(1, dr.clamp(min=0)), dr >= 0

    def loss(self, batch: Batch) -> torch.Tensor:
        terms = []
        for d, s in enumerate(self._states(batch), start=1):
            _, _, p, lq, valid = self._soft(d, s, batch, batch.loss_mask[:, d:])
            terms.append(-(p * lq * valid).sum(1).mean() if p.numel() else s.sum() * 0)
        return torch.stack(terms).mean()

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> Dict[str, float]:
        n, T = self.module.n_predict, batch.tokens.shape[1]
        res: Dict[str, float] = {"loss": 0.0}
        for d, s in enumerate(self._states(batch), start=1):
            t = torch.arange(d, T, device=s.device)  # (T-d,) label positions
            m = batch.loss_mask[:, d:] & (t >= n).view(1, -1)  # (B, T-d): the same positions at every stage
            logq, ids, p, lq, valid = self._soft(d, s, batch, m)
            ce = -(p * lq * valid).sum(1)  # (N,)
            res["count"] = float(ids.shape[0])
            res[f"ce_{d}"] = float(ce.sum())
            res[f"top1_{d}"] = float((self.module.token_map[logq.argmax(1)] == ids[:, 0]).sum())
            res[f"accept_{d}"] = float((torch.minimum(p, lq.exp()) * valid).sum())
            res["loss"] += float(ce.sum()) / n
        res["top1"], res["accept"] = res["top1_1"], res["accept_1"]
        return res


def run_mlp_speculator_training(target: torch.nn.Module, train: Sequence[Seq], heldout: Sequence[Seq],
                                train_cfg: TrainConfig, cfg: MLPSpeculatorTrainConfig, out_path, *,
                                run_dir=None, record: Optional[dict] = None, init=None, progress: bool = True,
                                log=print) -> Tuple[MLPSpeculator, TrainResult]:
    """Train an MLP speculator for the frozen `target` on sequences WITH features (the target's
    final normed states, (L, D)) and stored top-k; write it to out_path with a record of the
    settings, the held-out curve (history) and the final held-out numbers. init: a file of
    save_mlp_speculator's to continue (its architecture and draft vocabulary kept; cfg's unused).
    -> (the trained speculator, fit's result)."""
    for name, seqs in (("train", train), ("heldout", heldout)):
        bad = [i for i, s in enumerate(seqs) if s.features is None or s.topk_ids is None]
        if bad:
            raise ValueError(f"{name}[{bad[0]}] has no features or no stored top-k: attach the target's "
                             "final normed states (L, D) as Seq.features and distil with topk > 0")
    rec = dict(record or {})
    if init is not None:
        from ..mlp_speculator import load_mlp_speculator, mlp_speculator_info

        rec["init"] = {"path": Path(str(init)).name, **{k: v for k, v in mlp_speculator_info(init)["record"].items()
                                             if k in ("heldout", "train", "data", "init")}}
        spec = load_mlp_speculator(target, init)  # fit() puts it in training mode
    else:
        V = int(target.get_output_embeddings().weight.shape[0])
        spec = MLPSpeculator(target, cfg.n_predict, cfg.inner_dim, tie_weights=cfg.tie_weights,
                             scale_input=cfg.scale_input, token_map=build_token_map(train, V, min(cfg.draft_vocab, V)),
                             target_embedding=cfg.target_embedding, seed=train_cfg.seed)
    result = fit(MLPSpeculatorTask(spec), list(train), list(heldout), train_cfg, out_dir=run_dir,
                 progress=progress, log=log)
    spec.eval()
    if is_main_process():  # data-parallel runs: the main process writes the file
        final = result.history[-1] if result.history else {}
        rec.update({"train": train_record(train_cfg, result), "mlp_speculator": asdict(cfg), "arch": spec.arch(),
                    "train_seconds": result.seconds, "train_sequences": len(train),
                    "heldout_sequences": len(heldout), "history": result.history, "stopped_early": result.stopped_early,
                    "heldout": {k: v for k, v in final.items() if k.startswith("heldout_")}})
        save_mlp_speculator(out_path, spec, fingerprint(target), rec)
    return spec, result
