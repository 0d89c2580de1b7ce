"""The chains that made the committed weight files, as data for rebuild.py (`python -m specref rebuild`):
a chain is a list of Steps (one command each) and store names (STORES: a store's export and scoring).

Read from the files themselves and the repository's history: each file's `record` (stores by folder
name, the training settings, for EAGLE-1 the nested records of all eight runs), the store manifests
in them (the dtype shows in the target's fingerprint: float32 for the first stores of parts 5-14,
bfloat16 for every later store and for the rebuilt ones), and the commands of docs/training.md
("Recipes"). Facts a rebuild depends on:

- `--sources` with no names scores only the exported distilled folder: no committed head saw real text.
- The first EAGLE-1 runs and Medusa read float32 stores of parts 5-14; EAGLE-1's later runs and the
  draft read the same data scored again in bfloat16 (2026-12-05). Both are here: `f32/S_q` is the
  float32 store, `S_q` the bfloat16 one (a record names a store by its folder's name: both "S_q").
- A continuation started from the int8 file committed before it, so each chain compacts between runs.
- int4 matrices were compacted from the int8 file (EAGLE-3, MTP, the draft, the MLP speculator), as
  each was made (from the 16-bit export they come out different).
- The Hydra heads' frozen prefix is the EAGLE-1 file's tensors: the Hydra file references that file
  (weights/refs.py) instead of holding a copy.

Each step's `minutes` is its time on 2 CPU cores when it ran. The MLP speculator's committed run
differs from its recipe: its first 100 steps ran under a 300-step cosine schedule (that run was
stopped and resumed to 200 steps); the recipe runs 200 steps under one schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

# the program of each step kind: `python -m ...` then the step's arguments
PROGRAMS = {
    "export": ("specref", "corpus", "--root", "{corpus}", "export"),
    "score": ("specref", "data"),
    "train": ("specref", "train"),
    "compact": ("specref.weights", "compact"),
}


@dataclass(frozen=True)
class Step:
    """One command of a chain."""
    kind: str  # export | score | train | compact
    args: Tuple[str, ...]  # the arguments after the program (PROGRAMS[kind])
    out: str  # the file or folder it writes, relative to the work folder
    minutes: float = 0.0  # its time on 2 CPU cores when the committed file was made (0: not recorded)

    def __post_init__(self) -> None:
        if self.kind not in PROGRAMS:
            raise ValueError(f"step kind must be one of {sorted(PROGRAMS)}, got {self.kind!r}")


def final_name(name: str) -> str:
    """The file a chain ends with, in the work folder (as the committed file is named)."""
    return f"smollm2_135m_{name}.safetensors.xz"


P7 = tuple(f"selfdistill_seed{i}" for i in range(5, 12))  # the first seven parts, written on 2 CPU cores


def _parts(*seeds: int) -> Tuple[str, ...]:
    return tuple(f"selfdistill_seed{i}" for i in seeds)


# -------------------------------------------------------------------------------- corpus exports
EXPORTS = {
    "EXP_q": Step("export", ("--out", "EXP_q", "--fraction", "0.25", "--seed", "0", "--parts") + P7, "EXP_q"),
    "EXP_q2": Step("export", ("--out", "EXP_q2", "--fraction", "0.5", "--from-fraction", "0.25", "--seed", "0",
                              "--parts") + P7, "EXP_q2"),
    "EXP_h2": Step("export", ("--out", "EXP_h2", "--fraction", "1.0", "--from-fraction", "0.5", "--seed", "0",
                              "--parts") + P7, "EXP_h2"),
    "EXP_half": Step("export", ("--out", "EXP_half", "--fraction", "0.5", "--seed", "0", "--parts") + P7, "EXP_half"),
    "EXP_g": Step("export", ("--out", "EXP_g", "--parts") + _parts(12, 13, 14), "EXP_g"),  # written on a lent H200
    "EXP_c": Step("export", ("--out", "EXP_c", "--parts") + _parts(15, 16), "EXP_c"),
    "EXP_d": Step("export", ("--out", "EXP_d", "--parts") + _parts(17, 18), "EXP_d"),
    "EXP_e": Step("export", ("--out", "EXP_e", "--parts") + _parts(19, 20), "EXP_e"),
    "EXP_f": Step("export", ("--out", "EXP_f", "--parts") + _parts(21, 22, 23, 24), "EXP_f"),
    "EXP_5": Step("export", ("--out", "EXP_5", "--parts") + _parts(5), "EXP_5"),
}


def _store(out: str, export: str, minutes: float, *extra: str, dtype: str = "bfloat16") -> Tuple[Step, ...]:
    """A store: its export, then `python -m specref data` on it (distilled answers only)."""
    score = Step("score", ("--distilled", export, "--sources", "--out", out, "--dtype", dtype) + extra, out, minutes)
    return (EXPORTS[export], score)


E3_LAYERS = ("--layers", "2", "15", "27")  # EAGLE-3's fused layers of SmolLM2-135M
ALL_LAYERS = ("--layers", "final", "2", "15", "27")  # one store for EAGLE-1, MTP, Hydra (and EAGLE-3)

STORES: Dict[str, Tuple[Step, ...]] = {
    "f32/S_q": _store("f32/S_q", "EXP_q", 21.9, dtype="float32"),
    "f32/S_q2": _store("f32/S_q2", "EXP_q2", 21.6, dtype="float32"),
    "f32/S_h2": _store("f32/S_h2", "EXP_h2", 48.4, dtype="float32"),
    "f32/S_g": _store("f32/S_g", "EXP_g", 49.7, dtype="float32"),
    "S_q": _store("S_q", "EXP_q", 12.5),
    "S_q2": _store("S_q2", "EXP_q2", 12.4),
    "S_h2": _store("S_h2", "EXP_h2", 25.0),
    "S_g": _store("S_g", "EXP_g", 23.2),
    "S_c": _store("S_c", "EXP_c", 14.0),
    "S_d": _store("S_d", "EXP_d", 11.8),
    "S_e": _store("S_e", "EXP_e", 12.1, *ALL_LAYERS),
    "S_f": _store("S_f", "EXP_f", 24.9, *ALL_LAYERS),
    "S3h": _store("S3h", "EXP_half", 24.4, *E3_LAYERS),
    "S3h2": _store("S3h2", "EXP_h2", 25.0, *E3_LAYERS),
    "S3g": _store("S3g", "EXP_g", 22.6, *E3_LAYERS),
    "S3c": _store("S3c", "EXP_c", 14.4, *E3_LAYERS),
    "S3d": _store("S3d", "EXP_d", 12.0, *E3_LAYERS),
    "S_mlp": _store("S_mlp", "EXP_5", 2.8, "--tokens", "32768", "--shard-tokens", "16384", dtype="float32"),
}


# -------------------------------------------------------------------------------- steps
def _train(method: str, stores: Tuple[str, ...], out: str, minutes: float, *flags: str, stream: bool = True) -> Step:
    """`python -m specref train --method M --store ... [--stream] FLAGS --out runs/NAME --export NAME.safetensors`."""
    name = out[: -len(".safetensors")]
    return Step("train", ("--method", method, "--store") + stores + (("--stream",) if stream else ()) + flags
                + ("--out", f"runs/{name}", "--export", out), out, minutes)


def _compact(src: str, out: str, *flags: str) -> Step:
    return Step("compact", (src, "--out", out) + flags, out, 0.5)


def _int4(*names: str) -> Tuple[str, ...]:
    return ("--int4",) + names


# the later runs' settings: one epoch at 3e-4, the stopping rule patient
K0 = ("--warmup-steps", "20", "--max-len", "1024", "--patience", "8", "--min-gain", "0.002", "--eval-every", "400",
      "--epochs", "1.0")
K = ("--lr", "3e-4") + K0
F32_7 = ("f32/S_q", "f32/S_q2", "f32/S_h2")  # parts 5-11, float32
B16_12 = ("S_q", "S_q2", "S_h2", "S_g", "S_c")  # parts 5-16, bfloat16
DEF = ("S_d", "S_e", "S_f")  # parts 17-24
E3 = ("--ttt-steps", "3", "--max-len", "512", "--batch-size", "8", "--warmup-steps", "20", "--min-gain", "0.002",
      "--eval-every", "200")
E3_MORE = E3 + ("--lr", "3e-4", "--epochs", "1.0", "--patience", "8")
MLP = ("gate_proj", "up_proj", "down_proj")

RECIPES: Dict[str, list] = {
    "eagle": [  # EAGLE-1: eight runs, all nested in the file's record
        *F32_7,
        _train("eagle", F32_7, "E1.safetensors", 61, "--lr", "2e-3", "--warmup-steps", "20", "--max-len", "1024",
               "--epochs", "4", "--patience", "3", "--min-gain", "0.002", "--eval-every", "400"),
        "f32/S_g",
        _train("eagle", F32_7 + ("f32/S_g",), "E.safetensors", 33, "--init", "E1.safetensors", "--lr", "3e-4",
               "--warmup-steps", "20", "--max-len", "1024", "--epochs", "1.5", "--patience", "3", "--min-gain",
               "0.002", "--eval-every", "400"),
        _compact("E.safetensors", "E.safetensors.xz"),
        *B16_12,
        _train("eagle", B16_12, "E2.safetensors", 30, "--init", "E.safetensors.xz", *K),
        _compact("E2.safetensors", "E2.safetensors.xz"),
        "S_d",
        _train("eagle", B16_12 + ("S_d",), "E14.safetensors", 34, "--init", "E2.safetensors.xz", *K),
        _compact("E14.safetensors", "E14.safetensors.xz"),
        "S_e",
        _train("eagle", ("S_d", "S_e"), "Ec1.safetensors", 8, "--init", "E14.safetensors.xz", "--eagle-current-token",
               *K),
        _compact("Ec1.safetensors", "Ec1.safetensors.xz"),
        _train("eagle", ("S_d", "S_e"), "Ec2.safetensors", 8, "--init", "Ec1.safetensors.xz", *K),
        _compact("Ec2.safetensors", "Ec2.safetensors.xz"),
        "S_f",
        _train("eagle", DEF, "Ec3.safetensors", 16, "--init", "Ec2.safetensors.xz", *K),
        _compact("Ec3.safetensors", "Ec3.safetensors.xz"),
        _train("eagle", DEF, "Ec4.safetensors", 17, "--init", "Ec3.safetensors.xz", *K),
        _compact("Ec4.safetensors", "smollm2_135m_eagle.safetensors.xz"),
    ],
    "eagle3": [  # EAGLE-3: four runs, each continuing the int8 file of the one before
        "S3h",
        _train("eagle3", ("S3h",), "E3h.safetensors", 89, *E3, "--lr", "2e-3", "--epochs", "4", "--patience", "3"),
        _compact("E3h.safetensors", "E3h.safetensors.xz"),
        "S3h2",
        _train("eagle3", ("S3h", "S3h2"), "E3s.safetensors", 48, "--init", "E3h.safetensors.xz", *E3_MORE),
        _compact("E3s.safetensors", "E3s.safetensors.xz"),
        "S3g", "S3c",
        _train("eagle3", ("S3h", "S3h2", "S3g", "S3c"), "E3a.safetensors", 93, "--init", "E3s.safetensors.xz",
               *E3_MORE),
        _compact("E3a.safetensors", "E3a.safetensors.xz"),
        "S3d",
        _train("eagle3", ("S3c", "S3d"), "E3d.safetensors", 25, "--init", "E3a.safetensors.xz", *E3_MORE),
        _compact("E3d.safetensors", "E3d.safetensors.xz"),
        _compact("E3d.safetensors.xz", "smollm2_135m_eagle3.safetensors.xz",
                 *_int4(*(f"layer.mlp.{m}.weight" for m in MLP))),
    ],
    "mtp": [  # two MTP modules, each starting as the EAGLE-1 head
        *DEF,
        _train("mtp", ("S_d", "S_e"), "T.safetensors", 14, "--mtp-modules", "2", "--init", "{weights:eagle}", *K),
        _compact("T.safetensors", "T.safetensors.xz"),
        _train("mtp", ("S_f",), "T2.safetensors", 14, "--init", "T.safetensors.xz", *K),
        _compact("T2.safetensors", "T2.safetensors.xz"),
        _compact("T2.safetensors.xz", "smollm2_135m_mtp.safetensors.xz",
                 *_int4(*(f"layers.{i}.block.mlp.{m}.weight" for i in (0, 1) for m in MLP))),
    ],
    "medusa": [  # Medusa-1: three heads, one run
        *F32_7,
        _train("medusa", F32_7, "M.safetensors", 34, "--lr", "2e-3", "--warmup-steps", "20", "--max-len", "1024",
               "--epochs", "3", "--patience", "3", "--min-gain", "0.002", "--eval-every", "400"),
        _compact("M.safetensors", "smollm2_135m_medusa.safetensors.xz"),
    ],
    "hydra": [  # Hydra heads from the Medusa heads, then on the EAGLE-1 head as their (frozen, referenced) prefix
        *DEF,
        _train("medusa", DEF, "Y1.safetensors", 10, "--hydra", "--medusa-heads", "2", "--init", "{weights:medusa}",
               *K0, "--lr", "1e-3"),
        _compact("Y1.safetensors", "Y1.safetensors.xz"),
        _train("medusa", DEF, "Y2.safetensors", 10, "--hydra", "--init", "Y1.safetensors.xz", *K0, "--lr", "5e-4"),
        _compact("Y2.safetensors", "Y2.safetensors.xz"),
        _train("medusa", DEF, "YE.safetensors", 18, "--hydra", "--medusa-prefix", "eagle", "--freeze-prefix",
               "--init", "Y2.safetensors.xz", "--prefix-from", "{weights:eagle}", *K),
        _compact("YE.safetensors", "smollm2_135m_hydra.safetensors.xz", "--ref", "prefix.", "{weights:eagle}"),
    ],
    "draft": [  # the 2-layer draft model from the target's layers, on the stored top-32
        *B16_12,
        _train("draft", B16_12, "D1.safetensors", 41, "--lr", "2e-3", "--warmup-steps", "20", "--max-len", "1024",
               "--epochs", "1.0", "--patience", "8", "--min-gain", "0.002", "--eval-every", "400"),
        _train("draft", B16_12, "D.safetensors", 22, "--init", "D1.safetensors", "--lr", "1e-3", "--warmup-steps",
               "20", "--max-len", "1024", "--epochs", "0.5", "--patience", "8", "--min-gain", "0.002",
               "--eval-every", "400"),
        _compact("D.safetensors", "D.safetensors.xz"),
        _compact("D.safetensors.xz", "smollm2_135m_draft.safetensors.xz",
                 *_int4(*(f"model.layers.{i}.mlp.{m}.weight" for i in (0, 1) for m in MLP))),
    ],
    "mlp_speculator": [  # three tied stages on a small store of part 5 (see the module docstring)
        "S_mlp",
        _train("mlp_speculator", ("S_mlp",), "MS.safetensors", 7.4, "--draft-vocab", "2048", "--steps", "200",
               "--eval-every", "50", "--batch-size", "16", "--lr", "1e-3", "--warmup-steps", "20", stream=False),
        _compact("MS.safetensors", "MS.safetensors.xz"),
        _compact("MS.safetensors.xz", "smollm2_135m_mlp_speculator.safetensors.xz", "--bits", "4"),
    ],
}
