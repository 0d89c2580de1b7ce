"""The training loop shared by every learned proposer: the draft model, EAGLE-1/3, Medusa/Hydra, MTP, MLP speculator.

Distillation of a proposer against a frozen target (Leviathan et al. 2023 Sec. 3.5 note that q
only needs to approximate p; DistillSpec, Zhou et al. 2024, distils q towards p on the target's own
outputs): a `TrainTask` owns the frozen target, the trainable module and the loss; this file owns
the rest: AdamW, a linear-warmup cosine learning-rate schedule, gradient clipping by global norm,
periodic held-out evaluation (loss, top-1 agreement with the target = the greedy acceptance rate
per position, and the simulated acceptance beta = sum_x min(p(x), q(x)), Leviathan et al.
Definition 3.1, averaged over positions), checkpoints as safetensors (weights, AdamW moments,
step, history; never pickle) written atomically, and exact resumption: the data order (length-bucketed
batches) is a pure function of (seed, step), so a run resumed from a checkpoint equals an uninterrupted one.
The budget is in steps, epochs or tokens (budget_steps; the cosine spans it), and a run stops early
when its held-out agreement curve stops rising (`stopped`: patience over evaluations with a
minimum gain). The training sequences are a feature store's (store/): a list, or the store read
on demand (store.StreamedStore); each step's are collated into one Batch (store.collate).

`python -m specref train METHOD` (training/cli.py) runs it for each method's task on feature stores.
Data-parallel across processes and GPUs through accelerate (`fit`'s docstring):
`accelerate launch --num_processes N -m specref train METHOD --device auto ...`.
Left out: mixed precision, gradient accumulation, model-parallel training.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .store import Batch, Seq, collate

CHECKPOINT = "checkpoint.safetensors"


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run."""

    steps: int = 600  # optimizer steps in total
    batch_size: int = 8  # sequences per step
    lr: float = 5e-4  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 30  # linear warm-up from 0 to lr
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW betas
    beta2: float = 0.98
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    eval_every: int = 100  # held-out evaluation every this many steps (and at the start and end)
    checkpoint_every: int = 100  # checkpoint every this many steps (and at the end)
    max_len: int = 512  # tokens kept per sequence
    seed: int = 0  # data order
    epochs: float = 0.0  # budget in passes over the training set; > 0 replaces `steps` (see budget_steps)
    tokens: int = 0  # budget in training tokens (after max_len); > 0 replaces `steps` (epochs wins if both)
    patience: int = 0  # stop once `patience` evaluations in a row gained < min_gain on the best (0: never)
    min_gain: float = 0.002  # the held-out agreement gain that counts as still rising
    stop_metric: str = "heldout_top1"  # the curve the stopping rule watches (higher is better)

    def __post_init__(self) -> None:
        for name in ("batch_size", "eval_every", "checkpoint_every", "max_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {self.steps!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if not self.epochs >= 0 or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"epochs and tokens must be >= 0, got {self.epochs!r}, {self.tokens!r}")
        if not isinstance(self.patience, int) or self.patience < 0 or not self.min_gain >= 0:
            raise ValueError(f"patience must be an int >= 0 and min_gain >= 0, got {self.patience!r}, {self.min_gain!r}")


class TrainTask(Protocol):
    """What a learned proposer plugs into `fit`."""

    module: torch.nn.Module  # put in train()/eval() mode by fit

    def named_trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """The parameters to optimise and checkpoint (stable names)."""

    def loss(self, batch: Batch) -> torch.Tensor:
        """Scalar training loss of one batch (the frozen target is the task's business)."""

    def evaluate(self, batch: Batch) -> Dict[str, float]:
        """Sums over the batch's loss positions: 'count' and e.g. 'loss', 'top1', 'accept'."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    t = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def budget_steps(lengths: Sequence[int], cfg: TrainConfig) -> int:
    """Optimizer steps of the run: ceil(epochs * batches per epoch) if cfg.epochs > 0, else
    ceil(tokens / mean tokens per batch) if cfg.tokens > 0, else cfg.steps (lengths: after max_len)."""
    nb = (len(lengths) + cfg.batch_size - 1) // cfg.batch_size
    if cfg.epochs > 0:
        return max(1, math.ceil(cfg.epochs * nb))
    if cfg.tokens > 0:
        return max(1, math.ceil(cfg.tokens * nb / max(sum(lengths), 1)))
    return cfg.steps


def stopped(history: Sequence[dict], cfg: TrainConfig) -> bool:
    """The stopping rule: True once none of the last cfg.patience evaluations of cfg.stop_metric
    beat the best value before them by cfg.min_gain or more (the held-out agreement stopped
    rising). Never with patience 0."""
    curve = [row[cfg.stop_metric] for row in history if cfg.stop_metric in row]
    if cfg.patience and history and not curve:  # a rule that can never fire is a silent no-op: refuse it
        raise ValueError(f"patience {cfg.patience}: the stopping rule watches {cfg.stop_metric!r}, which this "
                         f"task's evaluations do not report (they report {sorted(history[-1])})")
    if cfg.patience == 0 or len(curve) <= cfg.patience:
        return False
    best = max(curve[: -cfg.patience])
    return all(v < best + cfg.min_gain for v in curve[-cfg.patience:])


def sequence_lengths(seqs: Sequence[Seq], max_len: int) -> List[int]:
    """Token counts (after max_len) of the sequences; a streamed store answers from its index."""
    known = getattr(seqs, "lengths", None)
    return [min(n, max_len) for n in (known if known is not None else (len(q.tokens) for q in seqs))]


def epoch_batches(lengths: Sequence[int], epoch: int, cfg: TrainConfig) -> List[List[int]]:
    """The batches of one epoch: a permutation seeded by (seed, epoch), cut into windows of 4
    batches, each window sorted by sequence length (less padding), cut into batches, shuffled."""
    n, bs = len(lengths), cfg.batch_size
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    batches = []
    for w in range(0, n, 4 * bs):
        window = sorted(perm[w: w + 4 * bs], key=lambda i: lengths[i])
        batches += [window[j: j + bs] for j in range(0, len(window), bs)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in order]


def batch_indices(step: int, lengths: Sequence[int], cfg: TrainConfig) -> List[int]:
    """Sequence indices of a step: a pure function of (seed, step), so resumption is exact."""
    nb = (len(lengths) + cfg.batch_size - 1) // cfg.batch_size
    return epoch_batches(lengths, step // nb, cfg)[step % nb]


def evaluate(task: TrainTask, seqs: Sequence[Seq], cfg: TrainConfig) -> Dict[str, float]:
    """Position-weighted means of the task's metrics over held-out sequences."""
    task.module.eval()
    dev = next(p.device for _, p in task.named_trainable())
    sums: Dict[str, float] = {}
    with torch.no_grad():
        for b0 in range(0, len(seqs), cfg.batch_size):
            part = task.evaluate(collate(seqs[b0: b0 + cfg.batch_size], cfg.max_len).to(dev))
            for key, v in part.items():
                sums[key] = sums.get(key, 0.0) + float(v)
    n = max(sums.pop("count", 0.0), 1.0)
    return {key: v / n for key, v in sums.items()}


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(path, task: TrainTask, opt: torch.optim.Optimizer, step: int, history: list,
                    cfg: TrainConfig) -> None:
    """Trainable weights + AdamW state + step + history as one safetensors file (atomic)."""
    from safetensors.torch import save_file

    tensors = {f"module.{n}": p.detach().cpu().contiguous() for n, p in task.named_trainable()}
    state = opt.state_dict()
    for i, st in state["state"].items():
        for key, v in st.items():
            tensors[f"optim.{i}.{key}"] = torch.as_tensor(v).detach().cpu().contiguous()
    meta = {"step": str(step), "history": json.dumps(history), "config": json.dumps(asdict(cfg)),
            "param_groups": json.dumps(state["param_groups"])}
    tmp = str(path) + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def load_checkpoint(path, task: TrainTask, opt: torch.optim.Optimizer) -> Tuple[int, list]:
    """Restore weights and optimizer state in place; returns (step, history)."""
    from safetensors import safe_open

    params = dict(task.named_trainable())
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for key in f.keys():
            kind, rest = key.split(".", 1)
            if kind == "module":
                if rest not in params:
                    raise ValueError(f"checkpoint {path} holds {rest!r}, which the task does not train")
                with torch.no_grad():
                    params[rest].copy_(f.get_tensor(key))
            else:
                i, name = rest.split(".", 1)
                state.setdefault(int(i), {})[name] = f.get_tensor(key)
    groups = json.loads(meta["param_groups"])
    opt.load_state_dict({"state": state, "param_groups": groups})
    return int(meta["step"]), json.loads(meta["history"])


# ----------------------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    history: List[dict]  # one dict per evaluation: step, lr, train_loss, held-out metrics, seconds
    steps: int
    seconds: float
    stopped_early: bool = False  # the stopping rule ended the run before its budget
    budget_steps: int = 0  # the budget in steps (cfg.steps, or what --epochs / --train-tokens came to)


def train_record(cfg: TrainConfig, result: TrainResult) -> dict:
    """A run's `train` record: its settings, with `steps` the budget it ran to (--epochs and
    --train-tokens replace cfg.steps) and `steps_run` (fewer when the stopping rule ended it)."""
    return {**asdict(cfg), "steps": result.budget_steps, "steps_run": result.steps}


def fit(task: TrainTask, train: Sequence[Seq], heldout: Sequence[Seq], cfg: TrainConfig,
        out_dir=None, progress: bool = True, log=print, stop_after: Optional[int] = None) -> TrainResult:
    """Train task's parameters on `train`, evaluating on `heldout`; resumes from out_dir's checkpoint.

    stop_after: leave (after checkpointing) once this step is reached; a later call resumes.
    Data-parallel through accelerate: under `accelerate launch --num_processes N ...` (any number of
    CPU processes or GPUs) process r trains on sequences r, r+N, ... of every step's batch, each
    process's loss is weighted by its share of the batch's loss positions and the gradients are
    summed across processes, so every process takes the same AdamW step as one process on the
    whole batch (exactly, up to float rounding, for tasks whose loss is a mean over the loss
    positions; the draft's is). The main process alone evaluates, logs and checkpoints. One process
    (plain `python -m specref train`): the loop of before, bit for bit."""
    from tqdm.auto import tqdm

    if not train:
        raise ValueError("no training sequences")
    named = task.named_trainable()
    if not named:
        raise ValueError("the task has no trainable parameters")
    lengths = sequence_lengths(train, cfg.max_len)
    cfg = replace(cfg, steps=budget_steps(lengths, cfg))  # the budget in steps (its cosine spans it)
    opt = torch.optim.AdamW([p for _, p in named], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    dev = named[0][1].device
    state = _processes(dev)
    world, rank, main = state.num_processes, state.process_index, state.is_main_process
    if cfg.batch_size < world:
        raise ValueError(f"batch_size {cfg.batch_size} < {world} processes: every process needs a sequence")
    if not main:
        progress, log = False, (lambda *a, **k: None)
    step, history, t_start = 0, [], time.perf_counter()
    ckpt = Path(out_dir) / CHECKPOINT if out_dir is not None else None
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    if ckpt is not None and ckpt.is_file():
        step, history = load_checkpoint(ckpt, task, opt)
        log(f"resumed from {ckpt} at step {step}")
    elapsed0 = history[-1]["seconds"] if history else 0.0

    def record(s: int, train_loss: Optional[float]) -> None:
        if not main:
            return
        row = {"step": s, "lr": lr_at(min(s, max(cfg.steps - 1, 0)), cfg), "train_loss": train_loss,
               **{f"heldout_{k}": v for k, v in evaluate(task, heldout, cfg).items()},
               "seconds": elapsed0 + time.perf_counter() - t_start}
        history.append(row)
        log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    if step == 0 and heldout and not history:
        record(0, None)
    bar = tqdm(total=cfg.steps, initial=step, desc="training", unit="step", disable=not progress)
    running = []
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    nb, epoch, batches = (len(train) + cfg.batch_size - 1) // cfg.batch_size, -1, []
    early = stopped(history, cfg)  # a resumed run that had already stopped stays stopped
    while step < end and not early:
        task.module.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        if step // nb != epoch:
            epoch, batches = step // nb, epoch_batches(lengths, step // nb, cfg)
        mine = batches[step % nb][rank::world]  # this process's share of the step's batch
        batch = collate([train[i] for i in mine], cfg.max_len).to(dev)
        loss = task.loss(batch)
        opt.zero_grad(set_to_none=True)
        if world == 1:
            loss.backward()
        else:  # weight = share of the loss positions; gradients summed = the whole batch's gradient
            n = batch.loss_mask.sum().float()
            weight = n / state_sum(state, n.clone())
            (loss * weight).backward()
            for _, p in named:
                p.grad = state_sum(state, p.grad if p.grad is not None else torch.zeros_like(p))
            loss = state_sum(state, (loss * weight).detach())
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], cfg.grad_clip)
        opt.step()
        step += 1
        running.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(running[-20:]) / len(running[-20:]):.3f}")
        if heldout and (step % cfg.eval_every == 0 or step == cfg.steps):
            record(step, sum(running) / len(running))
            running = []
            early = stopped(history, cfg)
            if early:
                log(f"stopped at step {step}: {cfg.stop_metric} gained < {cfg.min_gain} over {cfg.patience} evaluations")
        if main and ckpt is not None and (step % cfg.checkpoint_every == 0 or step == end or early):
            save_checkpoint(ckpt, task, opt, step, history, cfg)
    bar.close()
    state.wait_for_everyone()
    return TrainResult(history, step, elapsed0 + time.perf_counter() - t_start, early, cfg.steps)


def _processes(dev: torch.device):
    """accelerate's process state (one process unless launched with `accelerate launch`)."""
    from accelerate import PartialState

    return PartialState(cpu=dev.type == "cpu")


def is_main_process() -> bool:
    """True in the process that writes files (the only one without `accelerate launch` / torchrun)."""
    from accelerate import PartialState

    return PartialState().is_main_process


def close_processes() -> None:
    """Close the process group that `accelerate launch` / torchrun opened, if any, before the process exits.

    Left open, gloo's worker threads are torn down by the interpreter's exit, and a rank can abort
    there ("terminate called without an active exception") after its work is done.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def state_sum(state, x: torch.Tensor) -> torch.Tensor:
    """x summed over every process (all-reduce); x itself with one process."""
    if state.num_processes == 1:
        return x
    from accelerate.utils import reduce

    return reduce(x, reduction="sum")


def as_sequence(seqs) -> Sequence[Seq]:
    """seqs itself if it is indexable (a list, a streamed store), else a list of it."""
    return seqs if hasattr(seqs, "__getitem__") and hasattr(seqs, "__len__") else list(seqs)


def split_heldout(seqs: Sequence[Seq], fraction: float, seed: int) -> Tuple[List[Seq], List[Seq]]:
    """(train, heldout): a seeded random `fraction` of the sequences is held out."""
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed + 7)).tolist()
    n_held = max(1, int(round(fraction * len(seqs)))) if fraction > 0 else 0
    held = set(perm[:n_held])
    return ([s for i, s in enumerate(seqs) if i not in held], [s for i, s in enumerate(seqs) if i in held])
