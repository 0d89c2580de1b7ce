"""`python -m specref oracle`: check a rejection sampler (module:function) or self-test the oracle."""
from __future__ import annotations

import argparse
import importlib
from typing import Callable, List, Optional

from .check import APIS, check_rejection_sampler


def _load(spec: str) -> Callable:
    if ":" not in spec:
        raise ValueError(f"--sampler must be module:function, got {spec!r}")
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def oracle_main(argv: Optional[List[str]] = None) -> int:
    """`python -m specref oracle --sampler module:function --api vllm|specref|plain` or `--self-test`."""
    ap = argparse.ArgumentParser(prog="python -m specref oracle", description=__doc__.split("\n")[0])
    ap.add_argument("--sampler", help="module:function of the rejection sampler to check")
    ap.add_argument("--api", choices=APIS, default="specref", help="its calling convention (see specref.oracle.check.adapt)")
    ap.add_argument("--self-test", action="store_true", help="check that the oracle rejects known-wrong samplers")
    ap.add_argument("--samples", type=int, default=None, help="rows per variant (default 50000; plain API 5000)")
    ap.add_argument("--alpha", type=float, default=1e-3, help="family-wise significance (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--false-alarm-runs", type=int, default=20, help="self-test: repeated correct runs (default 20)")
    args = ap.parse_args(argv)
    if args.self_test:
        from .selftest import self_test

        ok, lines = self_test(samples=args.samples or 20_000, alpha=args.alpha, seed=args.seed,
                              false_alarm_runs=args.false_alarm_runs)
        print("\n".join(lines))
        return 0 if ok else 1
    if not args.sampler:
        ap.error("give --sampler module:function or --self-test")
    samples = args.samples or (5_000 if args.api == "plain" else 50_000)
    report = check_rejection_sampler(_load(args.sampler), api=args.api, samples=samples, alpha=args.alpha, seed=args.seed)
    print(report.summary())
    return 0 if report.passed else 1
