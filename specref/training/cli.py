"""`python -m specref train`: the default model's trained draft, EAGLE head, Medusa heads, MTP modules or
MLP speculator.

The command line over training/data.py (self-distilled data), training/store.py (feature stores:
`--method medusa`, `mtp`, `eagle3`, `mlp_speculator` train on one or more, `eagle` and `draft` with `--store`),
training/loop.py (the shared loop), training/draft.py, eagle.py, medusa.py, mtp.py and
mlp_speculator.py (the trained proposers) and training/evaluate.py (`--measure-only`, `--eval`).
"""
from __future__ import annotations

import argparse

import torch

from ..medusa_prefix import PREFIX_KINDS
from .data import DistillConfig
from .draft import DraftTrainConfig, run_training
from .eagle import EagleTrainConfig, run_eagle_training
from .loop import TrainConfig, close_processes, sequence_lengths
from .medusa import MedusaTrainConfig


def train_main(argv=None) -> int:
    """`python -m specref train`: distil data, train the default model's draft, optionally measure."""
    try:
        return _train_main(argv)
    finally:
        close_processes()  # several processes (accelerate launch): the group closed before exit


def train_parser() -> argparse.ArgumentParser:
    """The command line of `python -m specref train` (rebuild.py checks its recipes against it)."""
    ap = argparse.ArgumentParser(prog="python -m specref train", description=run_training.__doc__)
    ap.add_argument("--method", choices=("draft", "eagle", "eagle3", "medusa", "mtp", "mlp_speculator"),
                    default="draft",
                    help="draft: the reduced-vocabulary draft model; eagle: the EAGLE-1 head; eagle3: the EAGLE-3 "
                    "head (training-time test) on a store with its layers (`python -m specref data --layers 2 15 "
                    "27`); medusa: Medusa-1 heads on the feature store (`python -m specref data`); mtp: DeepSeek-V3 "
                    "MTP modules; mlp_speculator: the MLP speculator on the feature store")
    ap.add_argument("--ttt-steps", type=int, default=3, help="eagle3: unrolled steps of the training-time test "
                    "(1: teacher forcing only)")
    ap.add_argument("--mtp-modules", type=int, default=1, help="mtp: D sequential modules")
    ap.add_argument("--mtp-lambda", type=float, default=1.0, help="mtp: lambda, the weight of the modules' "
                    "soft cross-entropy")
    ap.add_argument("--mtp-current-token", action="store_true", help="mtp: each module also reads the token "
                    "before the one it embeds; with --init, zero projection columns are added to the file's modules")
    ap.add_argument("--mtp-w-reg", type=float, default=0.0, help="mtp: weight of EAGLE's feature regression at "
                    "every depth (0: DeepSeek-V3's cross-entropy only; --mtp-lambda 0.1 --mtp-w-reg 1 is EAGLE's ratio)")
    ap.add_argument("--mlp-stages", type=int, default=3, help="mlp_speculator: n_predict stages")
    ap.add_argument("--mlp-inner-dim", type=int, default=0, help="mlp_speculator: inner_dim (0: the target's "
                    "hidden size, the target's embedding shared)")
    ap.add_argument("--store", nargs="+", default=None, help="medusa, mtp, eagle3: feature store folders, trained "
                    "on together (default: <specref cache>/store; mtp with --data: a self-distilled folder instead); "
                    "eagle, draft: train on these stores (`python -m specref data [--distilled FOLDER]`) instead "
                    "of a self-distilled folder")
    ap.add_argument("--init", default=None, metavar="PATH", help="every method on feature stores (eagle and draft "
                    "with --store; mlp_speculator): continue training this saved head / draft file (e.g. specref/weights/"
                    "smollm2_135m_eagle.safetensors.xz), its shape and draft vocabulary kept; mtp: an EAGLE-1 head "
                    "file too, every module starting as the head (--mtp-modules kept)")
    ap.add_argument("--epochs", type=float, default=TrainConfig.epochs, help="budget in passes over the training "
                    "sequences (replaces --steps)")
    ap.add_argument("--train-tokens", type=int, default=TrainConfig.tokens, help="budget in training tokens "
                    "(replaces --steps; --epochs wins)")
    ap.add_argument("--patience", type=int, default=TrainConfig.patience, help="stop once this many held-out "
                    "evaluations in a row gained < --min-gain top-1 agreement on the best before them (0: never)")
    ap.add_argument("--min-gain", type=float, default=TrainConfig.min_gain)
    ap.add_argument("--stream", action="store_true", help="read the feature stores from disk on demand "
                    "(training/streamed.py): stores larger than memory")
    ap.add_argument("--medusa-heads", type=int, default=MedusaTrainConfig.num_heads, help="medusa: K heads")
    ap.add_argument("--own-lm-head", action="store_true", help="medusa: each head trains its own LM head copy "
                    "(with --init of a file whose heads share one, copies of it)")
    ap.add_argument("--medusa-layers", type=int, default=MedusaTrainConfig.num_layers,
                    help="medusa: ResBlocks per head; with --init, identity blocks are appended to reach it")
    ap.add_argument("--hydra", action="store_true", help="medusa: Hydra's sequentially dependent heads (each "
                    "also reads the tokens before its position); with --init of a Medusa file, they start as "
                    "its first --medusa-heads heads")
    ap.add_argument("--medusa-prefix", choices=PREFIX_KINDS, default=None, help="medusa: Hydra++'s prefix "
                    "layer over the target's states, read by the heads ('layer': a decoder layer, 'attention': its "
                    "attention block, 'pairs': the layer over each state with the token after it, 'eagle': an EAGLE-1 "
                    "head over those pairs); with --init of a file without one, it starts as the identity (an "
                    "'eagle' prefix: as --prefix-from's head)")
    ap.add_argument("--freeze-prefix", action="store_true", help="medusa: train the heads, not their prefix "
                    "layer (with --prefix-from: head 1 stays the EAGLE head's first draft unless its own block moves)")
    ap.add_argument("--prefix-from", default=None, help="medusa: an EAGLE-1 head's file (e.g. the committed "
                    "specref/weights/smollm2_135m_eagle.safetensors.xz) that the Hydra heads of --init read as their "
                    "'eagle' prefix: head 1 starts as its first draft, head k + 1 as the file's head k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--out", default=None, help="run folder (default: <specref cache>/train/seed<N>)")
    ap.add_argument("--data", default=None, help="data folder (default: <out>/data)")
    ap.add_argument("--num-instructions", type=int, default=None)
    ap.add_argument("--passage-prompts", type=int, default=DistillConfig.passage_prompts,
                    help="second-stage prompts quoting the target's own answers as passages")
    ap.add_argument("--self-instruct", type=int, default=DistillConfig.self_instruct, metavar="N",
                    help="also N requests written by the target itself (Magpie-style, training/self_instruct.py), "
                    "answered like the seed instructions")
    ap.add_argument("--max-new-tokens", type=int, default=DistillConfig.max_new_tokens)
    ap.add_argument("--temperature", type=float, default=DistillConfig.temperature)
    ap.add_argument("--gen-batch-size", type=int, default=DistillConfig.batch_size)
    ap.add_argument("--layers", type=int, default=DraftTrainConfig.num_layers)
    ap.add_argument("--draft-vocab", type=int, default=DraftTrainConfig.draft_vocab)
    ap.add_argument("--loss", choices=("kl", "ce"), default=DraftTrainConfig.loss)
    ap.add_argument("--w-cls", type=float, default=EagleTrainConfig.w_cls, help="eagle: weight of the soft CE")
    ap.add_argument("--w-reg", type=float, default=EagleTrainConfig.w_reg, help="eagle: weight of the regression")
    ap.add_argument("--eagle-layers", type=int, default=EagleTrainConfig.layers,
                    help="eagle: decoder layers of the head (the paper's 1); with --init, identity layers are "
                         "added after the file's own")
    ap.add_argument("--eagle-current-token", action="store_true",
                    help="eagle: the head's FC also reads the current token's embedding e(x_t); with --init, "
                         "its columns are added at zero")
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ... or auto: each process's device under "
                    "`accelerate launch --num_processes N -m specref train ...` (GPUs) or `ACCELERATE_USE_CPU=1 "
                    "torchrun --nproc_per_node N -m specref train ...` (CPU processes): data-parallel training")
    ap.add_argument("--export", default=None, help="also write the trained file to this path (.safetensors, or .safetensors.xz: xz-compressed)")
    ap.add_argument("--eval", action="store_true", help="measure tau and speed-up on Spec-Bench afterwards")
    ap.add_argument("--eval-per-category", type=int, default=2)
    ap.add_argument("--eval-max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=None, help="draft length for --eval (default: closed form)")
    ap.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    ap.add_argument("--eval-every", type=int, default=TrainConfig.eval_every, help="held-out evaluation interval")
    ap.add_argument("--max-len", type=int, default=TrainConfig.max_len, help="tokens kept per training sequence")
    ap.add_argument("--measure-only", nargs="?", const="", default=None, metavar="PATH",
                    help="no training: measure a trained draft (default: the committed one) and exit")
    return ap


def _train_main(argv=None) -> int:
    """The command itself: parse the arguments, run the chosen method's training."""
    a = train_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.init is not None and (a.method in ("eagle", "draft") and not a.store or a.method == "mtp" and a.data):
        raise ValueError(f"--init continues a head trained on feature stores: --method {a.method} needs --store "
                         "(and no --data)")
    if a.method != "draft" and (a.measure_only is not None or a.eval):
        raise ValueError(f"--measure-only/--eval measure the draft model; measure the {a.method} method with "
                         f"`python -m specref bench --methods ar {a.method}`")
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
                             passage_prompts=a.passage_prompts, self_instruct=a.self_instruct)
    train_cfg = TrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed,
                            warmup_steps=a.warmup_steps, eval_every=a.eval_every, max_len=a.max_len,
                            epochs=a.epochs, tokens=a.train_tokens, patience=a.patience, min_gain=a.min_gain)
    if a.method == "medusa":
        return _medusa(a, train_cfg)
    if a.method == "eagle3":
        return _eagle3(a, train_cfg)
    if a.method == "mlp_speculator":
        return _mlp_speculator(a, train_cfg)
    if a.method == "mtp" and a.data:  # a self-distilled data folder, as EAGLE's command
        from .mtp import run_mtp_command

        return run_mtp_command(data_cfg, train_cfg, _mtp_config(a),
                               out=a.out, data=a.data, device=a.device, export=a.export)
    if a.method == "mtp":
        return _mtp(a, train_cfg)
    if a.method == "eagle" and a.store:
        return _eagle_store(a, train_cfg)
    if a.method == "eagle":
        return run_eagle_training(data_cfg, train_cfg, EagleTrainConfig(draft_vocab=a.draft_vocab, w_cls=a.w_cls,
                                                                        w_reg=a.w_reg, layers=a.eagle_layers,
                                                                        current_token=a.eagle_current_token),
                                  out=a.out, data=a.data, device=a.device, export=a.export)
    draft_cfg = DraftTrainConfig(num_layers=a.layers, draft_vocab=a.draft_vocab, loss=a.loss)
    if a.store:
        return _draft_store(a, train_cfg, draft_cfg)
    return run_training(data_cfg, train_cfg, draft_cfg, out=a.out, data=a.data, device=a.device,
                        export=a.export, evaluate_after=a.eval, eval_per_category=a.eval_per_category,
                        eval_max_new_tokens=a.eval_max_new_tokens, k=a.k)


def _from_store(a, name: str, heldout_fraction: float, layers=("final",)):
    """The default model frozen, the feature store's (train, heldout) split, the run folder and a
    record of the data. -> (target, train, heldout, out, record)"""
    from pathlib import Path

    from ..models import cache_root, load_default
    from .store import read_store_manifest, stores_split
    from .streamed import streamed_split

    stores = [Path(x) for x in a.store] if a.store else [cache_root() / "store"]
    mans = [read_store_manifest(x) for x in stores]  # each must be a store (ValueError otherwise)
    target, _ = load_default(device=a.device)
    for q in target.parameters():
        q.requires_grad_(False)
    split = streamed_split if getattr(a, "stream", False) else stores_split
    train, held = split(stores, layers=layers, heldout_fraction=heldout_fraction, seed=a.seed)
    out = Path(a.out) if a.out else cache_root() / "train" / f"{name}_seed{a.seed}"
    out.mkdir(parents=True, exist_ok=True)
    rec = {"store": [x.name for x in stores],  # the folders by name: a record names no machine path
           "manifest": [{k: m.get(k) for k in ("model_fingerprint", "settings", "sources")} for m in mans],
           "train_tokens": sum(sequence_lengths(train, 1 << 62)), "heldout_tokens": sum(sequence_lengths(held, 1 << 62)),
           "streamed": split is streamed_split}
    return target, train, held, out, rec


def _export(path, export) -> None:
    from ..weights import copy_weights

    print(f"saved {path}")
    if export:
        copy_weights(path, export)  # an --export name ending in .xz is written xz-compressed
        print(f"saved {export}")


def _medusa(a, train_cfg: TrainConfig) -> int:
    """Medusa-1 heads of the default model on the feature store; saved to the run folder and --export."""
    from .medusa import run_medusa_training

    cfg = MedusaTrainConfig(num_heads=a.medusa_heads, num_layers=a.medusa_layers, draft_vocab=a.draft_vocab,
                            own_lm_head=a.own_lm_head, sequential=a.hydra, prefix=a.medusa_prefix,
                            freeze_prefix=a.freeze_prefix)
    target, train, held, out, rec = _from_store(a, "medusa", cfg.heldout_fraction)
    run_medusa_training(target, train, held, train_cfg, cfg, out / "medusa.safetensors", run_dir=out, data_record=rec,
                        init=a.init, prefix_from=a.prefix_from)
    _export(out / "medusa.safetensors", a.export)
    return 0


def _draft_store(a, train_cfg: TrainConfig, cfg: DraftTrainConfig) -> int:
    """The trained draft of the default model on feature stores (their stored top-k)."""
    from .draft import run_draft_store_training

    target, train, held, out, rec = _from_store(a, "draft_store", cfg.heldout_fraction, layers=())
    run_draft_store_training(target, train, held, train_cfg, cfg, out / "draft.safetensors", run_dir=out,
                             data_record=rec, init=a.init)
    _export(out / "draft.safetensors", a.export)
    return 0


def _eagle_store(a, train_cfg: TrainConfig) -> int:
    """The EAGLE-1 head of the default model on a feature store (its final-layer features)."""
    from .eagle import run_eagle_store_training

    cfg = EagleTrainConfig(draft_vocab=a.draft_vocab, w_cls=a.w_cls, w_reg=a.w_reg, layers=a.eagle_layers,
                           current_token=a.eagle_current_token)
    target, train, held, out, rec = _from_store(a, "eagle_store", cfg.heldout_fraction)
    run_eagle_store_training(target, train, held, train_cfg, cfg, out / "eagle.safetensors", run_dir=out,
                             data_record=rec, init=a.init)
    _export(out / "eagle.safetensors", a.export)
    return 0


def _eagle3(a, train_cfg: TrainConfig) -> int:
    """The EAGLE-3 head of the default model on a store holding its fused layers' features."""
    from ..eagle3 import default_layers
    from .eagle3 import Eagle3TrainConfig, run_eagle3_training

    cfg = Eagle3TrainConfig(draft_vocab=a.draft_vocab, ttt_steps=a.ttt_steps)
    layers = default_layers(30)  # SmolLM2-135M: after layers 2, 15 and 27 of 30
    target, train, held, out, rec = _from_store(a, f"eagle3_ttt{a.ttt_steps}", cfg.heldout_fraction, layers)
    run_eagle3_training(target, train, held, train_cfg, cfg, out / "eagle3.safetensors", layers=layers,
                        checkpoint_dir=out, record=rec, init=a.init)
    _export(out / "eagle3.safetensors", a.export)
    return 0


def _mtp_config(a):
    """The MTP settings of the command line."""
    from .mtp import MTPTrainConfig

    return MTPTrainConfig(num_modules=a.mtp_modules, draft_vocab=a.draft_vocab, lam=a.mtp_lambda, w_reg=a.mtp_w_reg,
                          current_token=a.mtp_current_token)


def _mtp(a, train_cfg: TrainConfig) -> int:
    """MTP modules of the default model on the feature store; saved to the run folder and --export."""
    from .mtp import run_mtp_training

    cfg = _mtp_config(a)
    target, train, held, out, rec = _from_store(a, "mtp", cfg.heldout_fraction)
    run_mtp_training(target, train, held, train_cfg, cfg, out / "mtp.safetensors", checkpoint_dir=out, record=rec,
                     init=a.init)
    _export(out / "mtp.safetensors", a.export)
    return 0


def _mlp_speculator(a, train_cfg: TrainConfig) -> int:
    """The MLP speculator of the default model on feature stores; saved to the run folder and --export."""
    from .mlp_speculator import MLPSpeculatorTrainConfig, run_mlp_speculator_training

    cfg = MLPSpeculatorTrainConfig(n_predict=a.mlp_stages, inner_dim=a.mlp_inner_dim, draft_vocab=a.draft_vocab,
                                   target_embedding=a.mlp_inner_dim == 0)
    target, train, held, out, rec = _from_store(a, "mlp_speculator", cfg.heldout_fraction)
    run_mlp_speculator_training(target, train, held, train_cfg, cfg, out / "mlp_speculator.safetensors",
                                run_dir=out, record=rec, init=a.init)
    _export(out / "mlp_speculator.safetensors", a.export)
    return 0
