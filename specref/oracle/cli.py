"""`python -m specref oracle`: check a chain or tree verifier (module:function), or self-test the oracle.

Exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE (no failure, but the run cannot detect a TV deviation of
--tv-bound with 95% power: the summary says how many rows would), 2 a usage error."""
from __future__ import annotations

import argparse
import importlib
from typing import Callable, List, Optional

from .adapters import APIS
from .check import CHAIN_LAWS, check_rejection_sampler
from .tree_adapters import TREE_APIS
from .tree_check import DRAFT_LAWS, TREE_LAWS

EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def _load(spec: str) -> Callable:
    if ":" not in spec:
        raise ValueError(f"--sampler must be module:function, got {spec!r}")
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def oracle_main(argv: Optional[List[str]] = None) -> int:
    """`python -m specref oracle --sampler module:function [--tree | --greedy] --api ...` or `--self-test [--tree]`."""
    ap = argparse.ArgumentParser(prog="python -m specref oracle", description=__doc__.split("\n")[0])
    ap.add_argument("--sampler", help="module:function of the verifier to check")
    ap.add_argument("--tree", action="store_true", help="a tree sampler (check_tree_sampler); with --self-test: the tree self-test")
    ap.add_argument("--greedy", action="store_true", help="a greedy tree verifier (check_greedy_verifier, exact)")
    ap.add_argument("--api", default="specref", help=f"calling convention: chain {APIS}, tree/greedy {TREE_APIS} "
                    "(see specref.oracle.adapters.adapt and specref.oracle.tree_adapters)")
    ap.add_argument("--siblings", choices=DRAFT_LAWS, default="iid",
                    help="--tree, the draft law: sampled siblings i.i.d. (SpecInfer), without replacement (Sequoia), "
                    "k i.i.d. sequences a verifier may merge into a trie, or deterministic top-k siblings only")
    ap.add_argument("--law", default="lossless", help="the question: lossless (default: the emitted tokens follow p "
                    "prefix by prefix), or the stricter exact law of one rule: specinfer (--tree), tokenwise (chains)")
    ap.add_argument("--tv-bound", type=float, default=0.05,
                    help="a PASS needs the power to detect this TV deviation (default 0.05); else INCONCLUSIVE")
    ap.add_argument("--lossless", action="store_true", help="with --self-test: the lossless mode's self-test")
    ap.add_argument("--self-test", action="store_true", help="check that the oracle rejects known-wrong samplers")
    ap.add_argument("--samples", type=int, default=None,
                    help="rows per variant (default: chain 200000, tree 250000: where a correct verifier's honest power "
                    "reaches TV 0.05 on the default cases, about 1 and 10 minutes here; greedy 2000; one-row APIs 5000)")
    ap.add_argument("--alpha", type=float, default=1e-3, help="family-wise significance (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--false-alarm-runs", type=int, default=20, help="self-test: repeated correct runs (default 20)")
    args = ap.parse_args(argv)
    if args.tree and args.greedy:
        ap.error("give --tree or --greedy, not both")
    allowed = TREE_APIS if (args.tree or args.greedy) else APIS
    if args.api not in allowed:
        ap.error(f"--api must be one of {allowed} here, got {args.api!r}")
    laws = TREE_LAWS if args.tree else CHAIN_LAWS
    if args.law not in laws and not args.self_test and not args.greedy:
        ap.error(f"--law must be one of {laws} here, got {args.law!r}")
    if args.self_test:
        if args.lossless:
            from .lossless_selftest import lossless_self_test

            ok, lines = lossless_self_test(samples=args.samples or 4_000, seed=args.seed,
                                           ks_runs=min(args.false_alarm_runs, 10))
        elif args.tree:
            from .tree_selftest import tree_self_test

            ok, lines = tree_self_test(samples=args.samples or 4_000, seed=args.seed, false_alarm_runs=args.false_alarm_runs)
        else:
            from .selftest import self_test

            ok, lines = self_test(samples=args.samples or 20_000, alpha=args.alpha, seed=args.seed,
                                  false_alarm_runs=args.false_alarm_runs)
        print("\n".join(lines))
        return 0 if ok else 1
    if not args.sampler:
        ap.error("give --sampler module:function or --self-test")
    fn = _load(args.sampler)
    one_row = args.api in ("plain", "eagle")
    if args.greedy:
        from .tree_greedy import check_greedy_verifier

        report = check_greedy_verifier(fn, api=args.api, samples=args.samples or 2_000, seed=args.seed)
    elif args.tree:
        from .tree_check import check_tree_sampler

        report = check_tree_sampler(fn, api=args.api, siblings=args.siblings, law=args.law,
                                    samples=args.samples or (5_000 if one_row else 250_000), alpha=args.alpha,
                                    seed=args.seed, tv_bound=args.tv_bound)
    else:
        report = check_rejection_sampler(fn, api=args.api, law=args.law, samples=args.samples or (5_000 if one_row else 200_000),
                                         alpha=args.alpha, seed=args.seed, tv_bound=args.tv_bound)
    print(report.summary())
    return EXIT[report.verdict]
