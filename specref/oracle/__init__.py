"""The oracle: is a speculative sampler lossless? Answered with p-values against exact distributions.

    stats.py      chi-square goodness of fit / homogeneity, TV with confidence intervals, power
    cases.py      the standard (p, q, length) cases of a chain rejection step
    check.py      check_rejection_sampler: drive anyone's chain rejection sampler through the cases
    selftest.py   known-wrong samplers (mutants) the check must reject; the transformers adapter
    generator.py  check_generator: the joint of a whole decoder's first L tokens vs the exact one
    exact.py      exact sequence distributions of tiny HF models (V^L continuations enumerated)
    toy.py        a Markov toy LM whose every distribution is known in closed form
    cli.py        `python -m specref oracle --sampler module:function [--api ...] | --self-test`

The statistics are re-exported here (`from specref import oracle; oracle.chi_square_gof(...)`).
"""
from .check import Report, TestResult, adapt, check_rejection_sampler
from .generator import check_generator
from .stats import (GofResult, TvResult, chi_square_gof, chi_square_two_sample, counts, detectable_tv,
                    joint_index, samples_for_tv, tv_distance)

__all__ = [
    "GofResult", "Report", "TestResult", "TvResult", "adapt", "check_generator", "check_rejection_sampler",
    "chi_square_gof", "chi_square_two_sample", "counts", "detectable_tv", "joint_index", "samples_for_tv",
    "tv_distance",
]
