"""`python -m specref rebuild NAME ... --work DIR`: one command that rebuilds a committed weight file
of the default model from the committed corpus, by the chain of commands that made it.

Every committed file (specref/weights/smollm2_135m_NAME.safetensors.xz) came out of a chain, not one
run: corpus parts exported (`python -m specref corpus export`), scored by the target into feature
stores (`python -m specref data`), trained and continued on more stores (`python -m specref train
--init`), compacted between and after (`python -m specref.weights compact`). recipes.py holds each
chain as data, its stores shared between chains by name; this module plans and runs them:

    1. plan: the chains of the names asked, each store's export and scoring before the first step
       that reads it, every step once (the stores and files chains share are built once);
    2. run: each step as its own process in DIR, in order; a step whose output is there with a done
       marker holding the same command is skipped, so an interrupted rebuild resumes where it
       stopped (the store command itself resumes a half-scored store); once a step runs, every
       step after it runs too, since what it reads may have changed;
    3. a failing step stops the rebuild with an error naming it.

`{corpus}` in a step is the committed corpus folder; `{weights:NAME}` is NAME's file rebuilt in DIR
when this plan rebuilds NAME, else the committed file (a Hydra rebuild reads the committed Medusa
and EAGLE-1 files unless they are rebuilt with it). The final step of NAME writes
DIR/smollm2_135m_NAME.safetensors.xz; use it with `--weights KIND=FILE`, or copy it over the
committed file. What it leaves out: the rebuilt weights equal the committed ones only up to the
nondeterminism of threaded CPU kernels (the same data, order and settings; not the same bits), and
a full chain takes hours on 2 CPU cores (`--dry-run` prints each step's measured minutes).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import recipes as R
from .recipes import PROGRAMS, Step, final_name

def plan(names: Sequence[str], recipes: Optional[Dict[str, list]] = None,
         stores: Optional[Dict[str, Tuple[Step, ...]]] = None) -> List[Tuple[str, Step]]:
    """1. The steps that rebuild `names`, in order, each once: [(chain name, step)]. A recipe is a list
    of Steps and store names; a store name stands for its steps (export, scoring) in `stores`."""
    recipes = R.RECIPES if recipes is None else recipes
    stores = R.STORES if stores is None else stores
    unknown = [n for n in names if n not in recipes]
    if unknown or not names:
        raise ValueError(f"rebuild which weights? got {list(names)}; known: {sorted(recipes)}")
    out, seen = [], set()
    for name in dict.fromkeys(names):  # in the order given, once each
        for item in recipes[name]:
            if isinstance(item, str):
                if item not in stores:
                    raise ValueError(f"recipe {name!r} names store {item!r}, which no store recipe builds")
                steps = stores[item]
            else:
                steps = (item,)
            for s in steps:
                if s.out not in seen:
                    seen.add(s.out)
                    out.append((name, s))
        if out[-1][1].out != final_name(name):
            raise ValueError(f"recipe {name!r} must end by writing {final_name(name)}, not {out[-1][1].out}")
    return out


def resolve(step: Step, names: Sequence[str], corpus: Path, weights_dir: Path, work: Path) -> List[str]:
    """The step's command line with `{corpus}` and `{weights:NAME}` filled in (see the module docstring)."""
    def fill(a: str) -> str:
        a = a.replace("{corpus}", str(corpus))
        if a.startswith("{weights:") and a.endswith("}"):
            w = a[len("{weights:"):-1]
            return str(work / final_name(w)) if w in names else str(weights_dir / final_name(w))
        return a

    return [sys.executable, "-m"] + [fill(a) for a in PROGRAMS[step.kind] + step.args]


def _marker(work: Path, step: Step) -> Path:
    return work / ".rebuild" / (step.out.replace("/", "__") + ".done")


def run(names: Sequence[str], work, corpus="corpus", weights_dir=None, threads: Optional[int] = None,
        runner: Optional[Callable[[List[str], Path], int]] = None, dry_run: bool = False, log=print,
        recipes: Optional[Dict[str, list]] = None, stores: Optional[Dict[str, Tuple[Step, ...]]] = None) -> List[str]:
    """2-3. Run the plan of `names` in the folder `work` (created); -> the command lines run (all of them
    with dry_run, where nothing runs). `runner(cmd, cwd) -> exit status` runs one step (default: a
    subprocess); `threads` is passed to the scoring and training steps; `recipes` and `stores` default
    to recipes.py's."""
    from ..weights import FOLDER

    names = list(dict.fromkeys(names))
    work = Path(work).resolve()
    corpus = Path(corpus).resolve()
    weights_dir = Path(weights_dir).resolve() if weights_dir else FOLDER
    steps = plan(names, recipes, stores)
    if not (corpus / "manifest.json").is_file():
        raise ValueError(f"{corpus} is not the committed corpus (no manifest.json): give --corpus, the "
                         "repository's corpus/ folder")
    runner = runner or (lambda cmd, cwd: subprocess.run(cmd, cwd=cwd).returncode)
    done = []
    total = sum(s.minutes for _, s in steps)
    log(f"rebuild {' '.join(names)}: {len(steps)} steps, ~{total:.0f} min measured on 2 CPU cores, in {work}")
    ran = False  # once a step runs, every step after it runs too: its inputs may have changed
    for i, (name, s) in enumerate(steps, 1):
        cmd = resolve(s, names, corpus, weights_dir, work)
        key = shlex.join(cmd[1:])  # without the interpreter's path or the threads, which change no result
        if threads and s.kind in ("score", "train"):
            cmd += ["--threads", str(threads)]
        line = shlex.join(cmd[1:])
        mark = _marker(work, s)
        if not dry_run and not ran and (work / s.out).exists() and mark.is_file() and mark.read_text() == key:
            log(f"[{i}/{len(steps)}] {name}: done before, {s.out}")
            continue
        log(f"[{i}/{len(steps)}] {name}: python {line}" + (f"   (~{s.minutes:g} min)" if s.minutes else ""))
        done.append(line)
        ran = True
        if dry_run:
            continue
        work.mkdir(parents=True, exist_ok=True)
        rc = runner(cmd, work)
        if rc != 0 or not (work / s.out).exists():
            raise RuntimeError(f"rebuild of {name!r} stopped at step {i} ({s.kind} -> {s.out}): "
                               + (f"exit status {rc}" if rc != 0 else f"it did not write {s.out}")
                               + f"; fix it and run the same command again to resume: python {line}")
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(key)
    if not dry_run:
        for n in names:
            log(f"{n}: {work / final_name(n)}")
    return done


def rebuild_main(argv=None) -> int:
    """`python -m specref rebuild NAME ... --work DIR [--dry-run] [--threads N] [--corpus DIR]`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specref rebuild", description=__doc__.split("\n\n")[0],
                                 epilog=f"NAME: {', '.join(sorted(R.RECIPES))}")
    ap.add_argument("names", nargs="*", metavar="NAME", help="the committed files to rebuild, in this order")
    ap.add_argument("--work", default=None, help="the folder for the exports, stores (GBs), runs and files")
    ap.add_argument("--corpus", default="corpus", help="the committed corpus folder (default: ./corpus)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads of the scoring and training steps")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--list", action="store_true", help="the files that can be rebuilt, with their steps' minutes")
    a = ap.parse_args(argv)
    if a.list:
        for n in sorted(R.RECIPES):
            steps = plan([n])
            print(f"{n}: {len(steps)} steps, ~{sum(s.minutes for _, s in steps):.0f} min on 2 CPU cores")
        return 0
    if not a.names:
        ap.error("name the files to rebuild (--list shows them)")
    if a.work is None and not a.dry_run:
        ap.error("give --work DIR")
    run(a.names, a.work or os.path.join(".", "rebuild"), corpus=a.corpus, threads=a.threads, dry_run=a.dry_run)
    return 0
