"""specref: a pure-PyTorch reference library of speculative decoding.

    from specref import speculative_generate, DraftModelProposer, load_default
    model, tok = load_default()
    out = speculative_generate(model, NgramProposer(), input_ids, max_new_tokens=64, temperature=0)

Heavy submodules (models, the oracle's checks) import their optional dependencies lazily.
"""
from .draft_model import DraftModelConfig, DraftModelProposer, truncated_draft
from .eagle_head import EagleConfig, EagleHead, EagleProposer
from .hybrid import HybridProposer
from .generate import GenerationOutput, GenerationStats, NullProposer, autoregressive_generate, speculative_generate
from .kv_rollback import SpecCache
from .lookahead import LookaheadConfig, LookaheadProposer
from .ngram import NgramConfig, NgramProposer, propose_ngram
from .oracle import chi_square_gof, chi_square_two_sample, detectable_tv, joint_index, samples_for_tv, tv_distance
from .oracle_check import Report, check_rejection_sampler
from .oracle_generator import check_generator
from .proposer import Context, Draft, Proposer
from .rejection import ChainResult, TreeResult, verify_chain, verify_chain_greedy, verify_tree, verify_tree_greedy
from .sampling import GREEDY, SamplingConfig, logits_to_probs, make_generators
from .target import Target, TargetConfig
from .theory import expected_tokens, optimal_k, speedup

__version__ = "0.1.0"


def load_default(*args, **kwargs):
    """The embedded default model (SmolLM2-135M-Instruct) and its tokenizer; see models.load_default."""
    from .models import load_default as _load

    return _load(*args, **kwargs)


__all__ = [
    "ChainResult", "Context", "EagleConfig", "EagleHead", "EagleProposer", "Report", "check_generator", "check_rejection_sampler", "joint_index", "Draft", "DraftModelConfig", "DraftModelProposer", "GREEDY",
    "GenerationOutput", "HybridProposer", "LookaheadConfig", "LookaheadProposer", "GenerationStats", "NgramConfig", "NgramProposer", "NullProposer", "Proposer",
    "SamplingConfig", "SpecCache", "Target", "TargetConfig", "TreeResult", "autoregressive_generate",
    "chi_square_gof", "chi_square_two_sample", "detectable_tv", "expected_tokens", "load_default",
    "logits_to_probs", "make_generators", "optimal_k", "propose_ngram", "samples_for_tv",
    "speculative_generate", "speedup", "truncated_draft", "tv_distance", "verify_chain",
    "verify_chain_greedy", "verify_tree", "verify_tree_greedy",
]
