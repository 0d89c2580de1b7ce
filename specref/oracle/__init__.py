"""The oracle: is a speculative sampler lossless? Answered with p-values against exact distributions.

    stats.py      chi-square goodness of fit / homogeneity, the calibrated per-prefix test (gof_test) and its
                  exact null tail (null_tail), TV with confidence intervals, power
    cases.py      the standard (p, q, length) cases of a chain rejection step
    adapters.py   the chain calling conventions (specref, vllm, plain); argument checks shared by all
    check.py      check_rejection_sampler (lossless or token-wise law); Report and its verdict PASS/FAIL/INCONCLUSIVE
    selftest.py   known-wrong samplers (mutants) the check must reject; the transformers adapter
    generator.py  check_generator: the joint of a whole decoder's first L tokens vs the exact one
    exact.py      exact sequence distributions of tiny HF models (V^L continuations enumerated)
    toy.py        a Markov toy LM whose every distribution is known in closed form
    tree_cases.py    token trees with known p and q tables (deterministic, sampled, mixed siblings)
    tree_exact.py    the exact law of one tree-verification step (SpecInfer; Sequoia without replacement)
    tree_adapters.py tree calling conventions (specref, plain, eagle retrieve indices); the draws' sibling kind
    tree_check.py    check_tree_sampler: a tree verifier, lossless law (default) or SpecInfer's exact law
    lossless.py      the lossless law: the emitted tokens follow p prefix by prefix (chains and trees)
    lossless_selftest.py  block verification, trie merge, reversed order; the lossless self-test, KS
    power_mutants.py lossy verifiers hiding where power is thin (rare paths, pooled cells, many depths)
    tree_greedy.py   check_greedy_verifier: exact comparison with greedy decoding
    tree_selftest.py tree and greedy mutants, references in every convention, tree_self_test
    cli.py        `python -m specref oracle --sampler module:function [--api ...] [--tree|--greedy] | --self-test`

The statistics are re-exported here (`from specref import oracle; oracle.chi_square_gof(...)`).
"""
from .check import Report, TestResult, adapt, check_rejection_sampler
from .tree_adapters import retrieve_layout
from .tree_cases import TreeCase, TreeVariant, standard_tree_cases
from .tree_check import check_tree_sampler
from .tree_greedy import check_greedy_verifier
from .generator import check_generator
from .stats import (GofResult, TvResult, chi_square_gof, chi_square_two_sample, counts, detectable_tv,
                    joint_index, samples_for_tv, tv_distance)

__all__ = [
    "GofResult", "Report", "TestResult", "TreeCase", "TreeVariant", "TvResult", "adapt", "check_generator",
    "check_greedy_verifier", "check_rejection_sampler", "check_tree_sampler", "chi_square_gof",
    "chi_square_two_sample", "counts", "detectable_tv", "joint_index", "retrieve_layout", "samples_for_tv",
    "standard_tree_cases", "tv_distance",
]
