"""`python -m specref train METHOD ...`: a learned proposer of the default model, trained on feature stores.

    python -m specref train draft           the reduced-vocabulary draft model (draft.py)
    python -m specref train eagle           the EAGLE-1 head (eagle.py)
    python -m specref train eagle3          the EAGLE-3 head, training-time test (eagle3.py)
    python -m specref train medusa          Medusa-1 heads, or Hydra's with --hydra (medusa.py)
    python -m specref train mtp             DeepSeek-V3 MTP modules (mtp.py)
    python -m specref train mlp_speculator  the MLP speculator (mlp_speculator.py)

Every method reads the same data, the feature stores of `python -m specref data` (store/: the
corpus scored once by the target), and runs the shared loop (loop.py). The flags every method
takes come from one parent parser, each method's own are on its subcommand; `train METHOD --help`
lists both. The flat form of before, `python -m specref train --method METHOD ...` (the committed
recipes' form, recipes.py), is the same command.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..medusa_prefix import PREFIX_KINDS
from .draft import DraftTrainConfig
from .eagle import EagleTrainConfig
from .loop import TrainConfig, close_processes, sequence_lengths
from .medusa import MedusaTrainConfig

METHODS = ("draft", "eagle", "eagle3", "medusa", "mtp", "mlp_speculator")


def train_main(argv=None) -> int:
    """`python -m specref train METHOD ...`: train the method's proposer on feature stores."""
    try:
        a = train_parser().parse_args(argv)
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.init is not None and not a.store:
            raise ValueError(f"--init continues a head on feature stores named with --store: `train {a.method} "
                             f"--store STORE ... --init {a.init}` (the record names the stores it trained on)")
        train_cfg = TrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed,
                                warmup_steps=a.warmup_steps, eval_every=a.eval_every, max_len=a.max_len,
                                epochs=a.epochs, tokens=a.train_tokens, patience=a.patience, min_gain=a.min_gain)
        return a.run(a, train_cfg)
    finally:
        close_processes()  # several processes (accelerate launch): the group closed before exit


class _TrainParser(argparse.ArgumentParser):
    """The `train` parser; it also takes the flat form `--method METHOD ...` (default: draft)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(flat_to_subcommand(args), namespace)


def flat_to_subcommand(args):
    """`--method M rest` (anywhere, or `--method=M`) -> `M rest`; flags without a method -> `draft flags`,
    the flat form's default; a subcommand form is returned as it is."""
    args = list(args)
    if args and (args[0] in METHODS or args[0] in ("-h", "--help")):
        return args
    for i, x in enumerate(args):
        if x == "--method" and i + 1 < len(args):
            return [args[i + 1]] + args[:i] + args[i + 2:]
        if x.startswith("--method="):
            return [x.split("=", 1)[1]] + args[:i] + args[i + 1:]
    return ["draft"] + args if args and args[0].startswith("-") else args


def _shared() -> argparse.ArgumentParser:
    """The flags of every method: data, budget, optimisation, run folder, device."""
    ap = argparse.ArgumentParser(add_help=False)
    g = ap.add_argument_group("data (every method)")
    g.add_argument("--store", nargs="+", default=None, help="feature store folders (`python -m specref data --out "
                   "STORE`), trained on together (default: <specref cache>/store)")
    g.add_argument("--stream", action="store_true", help="read the stores from disk on demand (store.StreamedStore): "
                   "stores larger than memory")
    g.add_argument("--init", default=None, metavar="PATH", help="continue training this saved file of the method "
                   "(e.g. specref/weights/smollm2_135m_eagle.safetensors.xz), its shape and draft vocabulary kept; "
                   "needs --store")
    g.add_argument("--draft-vocab", type=int, default=DraftTrainConfig.draft_vocab, help="Vd: the most frequent "
                   "target tokens of the training answers (with --init: the file's)")
    g.add_argument("--max-len", type=int, default=TrainConfig.max_len, help="tokens kept per training sequence")
    g = ap.add_argument_group("budget and optimisation (every method)")
    g.add_argument("--epochs", type=float, default=TrainConfig.epochs, help="budget in passes over the training "
                   "sequences (replaces --steps)")
    g.add_argument("--train-tokens", type=int, default=TrainConfig.tokens, help="budget in training tokens "
                   "(replaces --steps; --epochs wins)")
    g.add_argument("--steps", type=int, default=TrainConfig.steps)
    g.add_argument("--patience", type=int, default=TrainConfig.patience, help="stop once this many held-out "
                   "evaluations in a row gained < --min-gain top-1 agreement on the best before them (0: never)")
    g.add_argument("--min-gain", type=float, default=TrainConfig.min_gain)
    g.add_argument("--eval-every", type=int, default=TrainConfig.eval_every, help="held-out evaluation interval")
    g.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    g.add_argument("--lr", type=float, default=TrainConfig.lr)
    g.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("run (every method)")
    g.add_argument("--out", default=None, help="run folder: checkpoint, file (default: <specref cache>/train/...)")
    g.add_argument("--export", default=None, help="also write the trained file to this path (.safetensors, or "
                   ".safetensors.xz: xz-compressed)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, ... or auto: each process's device under "
                   "`accelerate launch --num_processes N -m specref train ...` (GPUs) or `ACCELERATE_USE_CPU=1 "
                   "torchrun --nproc_per_node N -m specref train ...` (CPU processes): data-parallel training")
    return ap


def train_parser() -> argparse.ArgumentParser:
    """The command line of `python -m specref train` (rebuild.py checks its recipes against it)."""
    ap = _TrainParser(prog="python -m specref train", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="method", required=True, metavar="METHOD", parser_class=argparse.ArgumentParser)
    shared = [_shared()]

    def method(name, run, help):
        p = sub.add_parser(name, parents=shared, help=help, description=help)
        p.set_defaults(run=run)
        return p.add_argument_group(f"{name} only")

    p = method("draft", _draft, "the reduced-vocabulary draft model: KL to the stored top-k of p")
    p.add_argument("--layers", type=int, default=DraftTrainConfig.num_layers, help="decoder layers copied from "
                   "the target")
    p.add_argument("--loss", choices=("kl", "ce"), default=DraftTrainConfig.loss)
    p = method("eagle", _eagle, "the EAGLE-1 head: feature regression + soft cross-entropy")
    p.add_argument("--w-cls", type=float, default=EagleTrainConfig.w_cls, help="weight of the soft CE")
    p.add_argument("--w-reg", type=float, default=EagleTrainConfig.w_reg, help="weight of the regression")
    p.add_argument("--eagle-layers", type=int, default=EagleTrainConfig.layers, help="decoder layers of the head "
                   "(the paper's 1); with --init, identity layers are added after the file's own")
    p.add_argument("--eagle-current-token", action="store_true", help="the head's FC also reads the current "
                   "token's embedding e(x_t); with --init, its columns are added at zero")
    p = method("eagle3", _eagle3, "the EAGLE-3 head (training-time test) on a store with its layers "
               "(`python -m specref data --layers 2 15 27`)")
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled steps of the training-time test "
                   "(1: teacher forcing only)")
    p = method("medusa", _medusa, "Medusa-1 heads (sum_k 0.8^k soft CE), or Hydra's with --hydra")
    p.add_argument("--medusa-heads", type=int, default=MedusaTrainConfig.num_heads, help="K heads")
    p.add_argument("--medusa-layers", type=int, default=MedusaTrainConfig.num_layers, help="ResBlocks per head; "
                   "with --init, identity blocks are appended to reach it")
    p.add_argument("--own-lm-head", action="store_true", help="each head trains its own LM head copy (with --init "
                   "of a file whose heads share one, copies of it)")
    p.add_argument("--hydra", action="store_true", help="Hydra's sequentially dependent heads (each also reads "
                   "the tokens before its position); with --init of a Medusa file, they start as its first "
                   "--medusa-heads heads")
    p.add_argument("--medusa-prefix", choices=PREFIX_KINDS, default=None, help="Hydra++'s prefix layer over the "
                   "target's states, read by the heads ('layer': a decoder layer, 'attention': its attention block, "
                   "'pairs': the layer over each state with the token after it, 'eagle': an EAGLE-1 head over those "
                   "pairs); with --init of a file without one, it starts as the identity (an 'eagle' prefix: as "
                   "--prefix-from's head)")
    p.add_argument("--freeze-prefix", action="store_true", help="train the heads, not their prefix layer (with "
                   "--prefix-from: head 1 stays the EAGLE head's first draft unless its own block moves)")
    p.add_argument("--prefix-from", default=None, help="an EAGLE-1 head's file (e.g. the committed specref/weights/"
                   "smollm2_135m_eagle.safetensors.xz) that the Hydra heads of --init read as their 'eagle' prefix: "
                   "head 1 starts as its first draft, head k + 1 as the file's head k")
    p = method("mtp", _mtp, "DeepSeek-V3 MTP modules (lambda * mean over depths of soft CE); --init also takes an "
               "EAGLE-1 head's file: every module starts as the head")
    p.add_argument("--mtp-modules", type=int, default=1, help="D sequential modules")
    p.add_argument("--mtp-lambda", type=float, default=1.0, help="lambda, the weight of the modules' soft "
                   "cross-entropy")
    p.add_argument("--mtp-w-reg", type=float, default=0.0, help="weight of EAGLE's feature regression at every "
                   "depth (0: DeepSeek-V3's cross-entropy only; --mtp-lambda 0.1 --mtp-w-reg 1 is EAGLE's ratio)")
    p.add_argument("--mtp-current-token", action="store_true", help="each module also reads the token before the "
                   "one it embeds; with --init, zero projection columns are added to the file's modules")
    p = method("mlp_speculator", _mlp_speculator, "vLLM V0's MLP speculator (tied stages)")
    p.add_argument("--mlp-stages", type=int, default=3, help="n_predict stages")
    p.add_argument("--mlp-inner-dim", type=int, default=0, help="inner_dim (0: the target's hidden size, the "
                   "target's embedding shared)")
    return ap


# ----------------------------------------------------------------------------- the runs


def _from_store(a, name: str, heldout_fraction: float, layers=("final",)):
    """The default model frozen, the feature stores' (train, heldout) split, the run folder and a
    record of the data. -> (target, train, heldout, out, record)"""
    from pathlib import Path

    from ..models import cache_root, load_default
    from .loop import _processes
    from .store import read_store_manifest, stores_split, streamed_split

    stores = [Path(x) for x in a.store] if a.store else [cache_root() / "store"]
    mans = [read_store_manifest(x) for x in stores]  # each must be a store (ValueError otherwise)
    device = _processes(torch.device("cuda")).device if a.device == "auto" else a.device  # each process its own
    target, _ = load_default(device=device)
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


def _draft(a, train_cfg: TrainConfig) -> int:
    """The draft of the default model on feature stores (their stored top-k; no features read)."""
    from .draft import run_draft_store_training

    cfg = DraftTrainConfig(num_layers=a.layers, draft_vocab=a.draft_vocab, loss=a.loss)
    target, train, held, out, rec = _from_store(a, "draft_store", cfg.heldout_fraction, layers=())
    run_draft_store_training(target, train, held, train_cfg, cfg, out / "draft.safetensors", run_dir=out,
                             data_record=rec, init=a.init)
    _export(out / "draft.safetensors", a.export)
    return 0


def _eagle(a, train_cfg: TrainConfig) -> int:
    """The EAGLE-1 head of the default model on feature stores (their final-layer features)."""
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


def _medusa(a, train_cfg: TrainConfig) -> int:
    """Medusa-1 (or Hydra) heads of the default model on feature stores."""
    from .medusa import run_medusa_training

    cfg = MedusaTrainConfig(num_heads=a.medusa_heads, num_layers=a.medusa_layers, draft_vocab=a.draft_vocab,
                            own_lm_head=a.own_lm_head, sequential=a.hydra, prefix=a.medusa_prefix,
                            freeze_prefix=a.freeze_prefix)
    target, train, held, out, rec = _from_store(a, "medusa", cfg.heldout_fraction)
    run_medusa_training(target, train, held, train_cfg, cfg, out / "medusa.safetensors", run_dir=out, data_record=rec,
                        init=a.init, prefix_from=a.prefix_from)
    _export(out / "medusa.safetensors", a.export)
    return 0


def _mtp(a, train_cfg: TrainConfig) -> int:
    """MTP modules of the default model on feature stores."""
    from .mtp import MTPTrainConfig, run_mtp_training

    cfg = MTPTrainConfig(num_modules=a.mtp_modules, draft_vocab=a.draft_vocab, lam=a.mtp_lambda, w_reg=a.mtp_w_reg,
                         current_token=a.mtp_current_token)
    target, train, held, out, rec = _from_store(a, "mtp", cfg.heldout_fraction)
    run_mtp_training(target, train, held, train_cfg, cfg, out / "mtp.safetensors", checkpoint_dir=out, record=rec,
                     init=a.init)
    _export(out / "mtp.safetensors", a.export)
    return 0


def _mlp_speculator(a, train_cfg: TrainConfig) -> int:
    """The MLP speculator of the default model on feature stores."""
    from .mlp_speculator import MLPSpeculatorTrainConfig, run_mlp_speculator_training

    cfg = MLPSpeculatorTrainConfig(n_predict=a.mlp_stages, inner_dim=a.mlp_inner_dim, draft_vocab=a.draft_vocab,
                                   target_embedding=a.mlp_inner_dim == 0)
    target, train, held, out, rec = _from_store(a, "mlp_speculator", cfg.heldout_fraction)
    run_mlp_speculator_training(target, train, held, train_cfg, cfg, out / "mlp_speculator.safetensors",
                                run_dir=out, record=rec, init=a.init)
    _export(out / "mlp_speculator.safetensors", a.export)
    return 0
