"""Training the EAGLE-3 head (eagle3.py) with the training-time test, on the feature store.

Li et al. 2025 (EAGLE-3, Sec. 3.2): with the feature regression gone, a head trained only with
teacher forcing sees true features at every input, while drafting feeds it its own outputs after
the first step. The training-time test unrolls drafting inside training. Step 0 is teacher forced:
at every position t the head reads (g_t, x_{t+1}) (g the fused target features) and outputs a_t.
Step j >= 1 feeds, at position t, the PREVIOUS step's output at t-1 with the true token,
(a^{j-1}_{t-1}, x_{t+1}): exactly the input that a chain started j steps earlier has at position t.
Its attention is drafting's: the true pairs of positions <= t - j (step 0's keys) and, of each
step i = 1..j, the one key at position t - j + i (its own chain's earlier drafts). Every step's
output at t is trained on the same label: the target's distribution of token t+2 (soft
cross-entropy against the stored top-k over the draft vocabulary). Loss = mean over the steps.

Here the steps are unrolled over the concatenation of all steps, [step 0 | step 1 | ... | step j],
with the block mask above. Each earlier block's rows are unchanged by the later ones, so step j runs
the head on block j's rows alone and reads blocks 0..j-1's keys and values from a cache (kept with
their autograd graph): the same outputs and gradients as rerunning the head over all j+1 blocks, at
(j+1) T'^2 attention scores instead of ((j+1) T')^2. Gradients flow through the unrolled chain.
`ttt_steps=1` is plain teacher forcing (the "without" of the comparison).

Held-out metrics: top1_step{j} (j = 1..eval_steps): the head's argmax at unrolled step j-1 equals
the target's argmax: agreement at draft position j given j-1 drafted tokens before it (conditional
on nothing else; positions t >= j-1 only), accept (sum_x min(p, q), step 1), top1 (= top1_step1).
Left out: the paper's data scale (its heads train on ShareGPT + UltraChat, ~500k dialogues).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache

from ..eagle3 import Eagle3Head, save_eagle3
from ..target import additive_mask
from ..weights import fingerprint
from .draft import build_token_map, inverse_map
from .loop import TrainConfig, TrainResult, fit, is_main_process, train_record
from .store import Batch, Seq


@dataclass(frozen=True)
class Eagle3TrainConfig:
    """Settings of EAGLE-3 head training."""

    draft_vocab: int = 8192  # Vd: most frequent tokens of the training responses
    ttt_steps: int = 3  # unrolled steps of the training-time test (1: teacher forcing only)
    eval_steps: int = 4  # held-out agreement measured at draft positions 1..eval_steps
    heldout_fraction: float = 0.02  # store sequences held out (by document hash, store.store_split)

    def __post_init__(self) -> None:
        for name, low in (("draft_vocab", 2), ("ttt_steps", 1), ("eval_steps", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")


def ttt_mask(T: int, steps: int, keys: torch.Tensor) -> torch.Tensor:
    """The attention of `steps` unrolled blocks of T positions: query (block a, position t) may see
    key (block 0, s) iff s <= t - a and the key is real, and key (block b, s), 1 <= b <= a, iff
    s == t - a + b. keys (B, T) bool real pairs. -> (B, steps*T, steps*T) bool."""
    t = torch.arange(T, device=keys.device)
    a = torch.arange(steps, device=keys.device)
    ta = t.view(1, T, 1, 1)  # query position
    aa = a.view(steps, 1, 1, 1)  # query block
    sb = t.view(1, 1, 1, T)  # key position
    bb = a.view(1, 1, steps, 1)  # key block
    first = (bb == 0) & (sb <= ta - aa)  # (steps, T, steps, T) the true pairs drafting reads
    diag = (bb >= 1) & (bb <= aa) & (sb == ta - aa + bb)  # own chain's earlier drafts
    own = (bb == aa) & (sb == ta)  # a query sees itself (rows t < a have nothing else; unused)
    allowed = (first | diag | own).reshape(steps * T, steps * T)  # (Q, Q)
    real = keys.repeat(1, steps)  # (B, steps*T)
    return allowed.unsqueeze(0) & (real.unsqueeze(1) | own.reshape(steps * T, steps * T).unsqueeze(0))


class Eagle3Task:
    """TrainTask (loop.py) of an Eagle3Head: batches need the fused layers' features and top-k."""

    def __init__(self, head: Eagle3Head, config: Eagle3TrainConfig = Eagle3TrainConfig()):
        if not isinstance(head, Eagle3Head):
            raise ValueError(f"head must be an Eagle3Head, got {type(head).__name__}")
        self.module, self.config = head, config
        self.inv = inverse_map(head.token_map, head.vocab_size)  # (V,) target -> draft id

    def named_trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return self.module.trainable()

    def unroll(self, batch: Batch, steps: int) -> List[torch.Tensor]:
        """The head's outputs a^j at every position, j = 0..steps-1. -> steps x (B, T-1, D)"""
        head = self.module
        if batch.features is None or batch.topk_ids is None:
            raise ValueError("EAGLE-3 training needs batches with the target's features of the head's layers "
                             "(concatenated, (T, 3D)) and stored top-k")
        if batch.features.shape[-1] != head.feature_size:
            raise ValueError(f"features have width {batch.features.shape[-1]}, the head reads "
                             f"{head.feature_size} (layers {head.layers})")
        B, T = batch.tokens.shape
        g = head.embed_features(batch.features[:, :-1])  # (B, T', D) fused g_t, t = 0..T-2
        x = batch.tokens[:, 1:]  # (B, T') x_{t+1}
        Tp = T - 1
        full = ttt_mask(Tp, steps, batch.attention[:, 1:])  # (B, steps*T', steps*T')
        pos = torch.arange(Tp, device=x.device).expand(B, Tp)  # (B, T')
        cache = DynamicCache()  # blocks 0..j-1's keys and values, kept with their autograd graph
        f, outs = g, []
        for j in range(steps):
            m = additive_mask(full[:, j * Tp:(j + 1) * Tp, :(j + 1) * Tp], f.dtype)  # (B, 1, T', (j+1)T')
            a = head(f, x, pos, m, cache=cache)  # (B, T', D): block j's rows only
            outs.append(a)
            f = torch.cat([torch.zeros_like(a[:, :1]), a[:, :-1]], dim=1)  # a^j_{t-1} at t
        return outs

    def _terms(self, batch: Batch, a: torch.Tensor, step: int):
        """Soft-CE terms of one step's outputs at label positions t >= step. -> (logq, ids, p, lq, valid)"""
        m = batch.loss_mask[:, 1:].clone()  # (B, T') position t labels token t+2
        m[:, :step] = False
        logq = torch.log_softmax(self.module.logits(a[m]).float(), dim=-1)  # (N, Vd)
        ids = batch.topk_ids[:, 1:][m]  # (N, K) target ids
        p = batch.topk_logprobs[:, 1:][m].exp()  # (N, K)
        d = self.inv[ids]  # (N, K) draft ids, -1 outside the draft vocabulary
        valid = d >= 0
        return logq, ids, p, logq.gather(1, d.clamp(min=0)), valid

    def loss(self, batch: Batch) -> torch.Tensor:
        outs = self.unroll(batch, self.config.ttt_steps)
        total = 0.0
        for j, a in enumerate(outs):
            _, _, p, lq, valid = self._terms(batch, a, j)
            total = total + (-(p * lq * valid).sum(1).mean() if p.numel() else a.sum() * 0)
        return total / len(outs)

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> Dict[str, float]:
        S = self.config.eval_steps
        outs = self.unroll(batch, S)
        res: Dict[str, float] = {}
        for j, a in enumerate(outs):
            logq, ids, p, lq, valid = self._terms(batch, a, S - 1)  # the same positions for every step
            hit = self.module.token_map[logq.argmax(1)] == ids[:, 0]  # (N,)
            res[f"top1_step{j + 1}"] = float(hit.sum())
            if j == 0:
                res["count"] = float(ids.shape[0])
                res["top1"] = float(hit.sum())
                res["accept"] = float((torch.minimum(p, lq.exp()) * valid).sum())
                res["ce"] = float(-(p * lq * valid).sum())
        return res


@torch.no_grad()
def attach_layer_features(target: torch.nn.Module, seqs: Sequence[Seq], layers: Sequence[int], batch_size: int = 8,
                          dtype: torch.dtype = torch.float16) -> None:
    """Set seq.features (L, len(layers) * D) = the target's hidden_states[i] for i in layers,
    concatenated (what the proposer asks the target for at inference; the store's `--layers`)."""
    dev = next(target.parameters()).device
    for b0 in range(0, len(seqs), batch_size):
        part = seqs[b0: b0 + batch_size]
        T = max(len(s.tokens) for s in part)
        tok = torch.zeros(len(part), T, dtype=torch.long)  # (B, T)
        att = torch.zeros(len(part), T, dtype=torch.long)  # (B, T)
        for j, s in enumerate(part):
            tok[j, :len(s.tokens)], att[j, :len(s.tokens)] = s.tokens, 1
        hs = target.model(input_ids=tok.to(dev), attention_mask=att.to(dev), output_hidden_states=True).hidden_states
        h = torch.cat([hs[i] for i in layers], dim=-1)  # (B, T, len(layers) * D)
        for j, s in enumerate(part):
            s.features = h[j, :len(s.tokens)].to(dtype).cpu()


def run_eagle3_training(target: torch.nn.Module, train_seqs: Sequence[Seq], heldout_seqs: Sequence[Seq],
                        train_cfg: TrainConfig, cfg: Eagle3TrainConfig, out_path, *, layers=None,
                        checkpoint_dir=None, record: Optional[dict] = None, progress: bool = True,
                        log=print, init=None) -> Tuple[Eagle3Head, TrainResult]:
    """Train an EAGLE-3 head for the frozen `target` on sequences whose `features` are its
    `layers` (hidden_states indices, concatenated (L, 3D)) with stored top-k; save to out_path.
    init: a head file (save_eagle3's) to continue from, its draft vocabulary and layers kept."""
    V = int(target.get_output_embeddings().weight.shape[0])
    if init is not None:
        from ..eagle3 import load_eagle3

        head = load_eagle3(target, init)  # fit() puts it in training mode
        record = {**(record or {}), "init": Path(str(init)).name}
    else:
        head = Eagle3Head(target, build_token_map(train_seqs, V, min(cfg.draft_vocab, V)), layers=layers,
                          seed=train_cfg.seed)
    result = fit(Eagle3Task(head, cfg), train_seqs, heldout_seqs, train_cfg, out_dir=checkpoint_dir,
                 progress=progress, log=log)
    head.eval()
    if is_main_process():
        final = result.history[-1] if result.history else {}
        rec = {**(record or {}), "train": train_record(train_cfg, result),
               "eagle3": {**asdict(cfg), "draft_vocab": int(head.token_map.numel())},  # --init: the file's
               "layers": list(head.layers),
               "train_seconds": result.seconds, "heldout": {k: v for k, v in final.items() if k.startswith("heldout_")},
               "train_sequences": len(train_seqs), "heldout_sequences": len(heldout_seqs),
               "history": result.history, "stopped_early": result.stopped_early}
        save_eagle3(out_path, head, fingerprint(target), rec)
        log(json.dumps({"saved": str(out_path), "heldout": rec["heldout"]}))
    return head, result
