"""`python -m specref train`: self-distilled data, then the default model's trained draft or EAGLE head.

The command line over training/data.py (the data), training/loop.py (the shared loop),
training/draft.py and training/eagle.py (the two trained proposers) and training/evaluate.py
(`--measure-only`, `--eval`).
"""
from __future__ import annotations

import argparse

import torch

from .data import DistillConfig
from .draft import DraftTrainConfig, run_training
from .eagle import EagleTrainConfig, run_eagle_training
from .loop import TrainConfig


def train_main(argv=None) -> int:
    """`python -m specref train`: distil data, train the default model's draft, optionally measure."""

    ap = argparse.ArgumentParser(prog="python -m specref train", description=run_training.__doc__)
    ap.add_argument("--method", choices=("draft", "eagle"), default="draft",
                    help="draft: the reduced-vocabulary draft model; eagle: the EAGLE-1 head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--out", default=None, help="run folder (default: <specref cache>/train/seed<N>)")
    ap.add_argument("--data", default=None, help="data folder (default: <out>/data)")
    ap.add_argument("--num-instructions", type=int, default=None)
    ap.add_argument("--passage-prompts", type=int, default=DistillConfig.passage_prompts,
                    help="second-stage prompts quoting the target's own answers as passages")
    ap.add_argument("--max-new-tokens", type=int, default=DistillConfig.max_new_tokens)
    ap.add_argument("--temperature", type=float, default=DistillConfig.temperature)
    ap.add_argument("--gen-batch-size", type=int, default=DistillConfig.batch_size)
    ap.add_argument("--layers", type=int, default=DraftTrainConfig.num_layers)
    ap.add_argument("--draft-vocab", type=int, default=DraftTrainConfig.draft_vocab)
    ap.add_argument("--loss", choices=("kl", "ce"), default=DraftTrainConfig.loss)
    ap.add_argument("--w-cls", type=float, default=EagleTrainConfig.w_cls, help="eagle: weight of the soft CE")
    ap.add_argument("--w-reg", type=float, default=EagleTrainConfig.w_reg, help="eagle: weight of the regression")
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ... or auto: each process's device under "
                    "`accelerate launch --num_processes N -m specref train ...` (GPUs) or `ACCELERATE_USE_CPU=1 "
                    "torchrun --nproc_per_node N -m specref train ...` (CPU processes): data-parallel training")
    ap.add_argument("--export", default=None, help="also write the trained draft to this .safetensors path")
    ap.add_argument("--eval", action="store_true", help="measure tau and speed-up on Spec-Bench afterwards")
    ap.add_argument("--eval-per-category", type=int, default=2)
    ap.add_argument("--eval-max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=None, help="draft length for --eval (default: closed form)")
    ap.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    ap.add_argument("--measure-only", nargs="?", const="", default=None, metavar="PATH",
                    help="no training: measure a trained draft (default: the committed one) and exit")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.method == "eagle" and (a.measure_only is not None or a.eval):
        raise ValueError("--measure-only/--eval measure the draft model; measure the EAGLE head with "
                         "`python -m specref bench --methods ar eagle`")
    if a.measure_only is not None:
        from ..draft_model import WEIGHTS, load_trained_draft, trained_draft_info
        from ..models import load_default
        from .evaluate import measure_draft, to_markdown

        path = a.measure_only or WEIGHTS
        target, tok = load_default(device=a.device)
        draft, token_map = load_trained_draft(target, path)
        alpha = trained_draft_info(path)["record"].get("heldout", {}).get("heldout_top1")
        res = measure_draft(target, tok, draft, token_map, per_category=a.eval_per_category,
                            max_new_tokens=a.eval_max_new_tokens, k=a.k, alpha=alpha)
        print(to_markdown(res))
        return 0 if res["parity"] else 1
    data_cfg = DistillConfig(seed=a.seed, num_instructions=a.num_instructions, max_new_tokens=a.max_new_tokens,
                             temperature=a.temperature, batch_size=a.gen_batch_size,
                             passage_prompts=a.passage_prompts)
    train_cfg = TrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed,
                            warmup_steps=a.warmup_steps)
    if a.method == "eagle":
        return run_eagle_training(data_cfg, train_cfg, EagleTrainConfig(draft_vocab=a.draft_vocab, w_cls=a.w_cls,
                                                                        w_reg=a.w_reg),
                                  out=a.out, data=a.data, device=a.device, export=a.export)
    draft_cfg = DraftTrainConfig(num_layers=a.layers, draft_vocab=a.draft_vocab, loss=a.loss)
    return run_training(data_cfg, train_cfg, draft_cfg, out=a.out, data=a.data, device=a.device,
                        export=a.export, evaluate_after=a.eval, eval_per_category=a.eval_per_category,
                        eval_max_new_tokens=a.eval_max_new_tokens, k=a.k)
