"""specref: a pure-PyTorch reference library of speculative decoding.

    from specref import speculative_generate, NgramProposer, load_default
    model, tok = load_default()
    out = speculative_generate(model, NgramProposer(), input_ids, max_new_tokens=64, temperature=0)

Everything a user needs is re-exported here. The package: the core (sampling, rejection, tree,
kv_rollback, target, proposer, generate, theory, picker/), one module per method (draft_model,
ngram, lookahead, eagle_head (+ eagle_tree, eagle3), medusa_heads (+ medusa_tree, typical), mtp, mlp_speculator, hybrid), and three wings: oracle/ (is a sampler lossless?),
training/ (data and training of the learned proposers), bench/ (Spec-Bench side by side). Heavy
submodules (models, training, bench) import their optional dependencies lazily.
"""
from .batch_k import BatchKConfig, BatchKProposer, StepCosts
from .draft_model import DraftModelConfig, DraftModelProposer, load_trained_draft, truncated_draft
from .eagle3 import Eagle3Head, load_eagle3
from .eagle_head import EagleConfig, EagleHead, EagleProposer, load_eagle
from .eagle_tree import Eagle2Config, Eagle2Proposer
from .generate import GenerationOutput, GenerationStats, NullProposer, autoregressive_generate, speculative_generate
from .hybrid import HybridConfig, HybridProposer
from .kv_rollback import SpecCache
from .lookahead import LookaheadConfig, LookaheadProposer
from .medusa_heads import MedusaConfig, MedusaHeads, MedusaProposer, load_medusa
from .mlp_speculator import MLPSpeculator, MLPSpeculatorConfig, MLPSpeculatorProposer, load_mlp_speculator
from .mtp import MTPConfig, MTPProposer, MTPStack, load_mtp
from .ngram import NgramConfig, NgramProposer, propose_ngram
from .oracle import (Report, check_generator, check_greedy_verifier, check_rejection_sampler, check_tree_sampler,
                     chi_square_gof, chi_square_two_sample, detectable_tv, joint_index, samples_for_tv, tv_distance)
from .picker import PickerConfig, Recommendation, measure_cost, measure_verify_cost, recommend
from .proposer import Context, Draft, Proposer
from .published import load_native_mtp, load_published_mlp_speculator
from .registry import METHODS, Registry
from .rejection import (ChainResult, TreeResult, verify_chain, verify_chain_block, verify_chain_greedy, verify_tree,
                        verify_tree_greedy, verify_tree_traversal)
from .sampling import GREEDY, SamplingConfig, logits_to_probs, make_generators
from .scheduler import Request, ScheduleOutput, schedule
from .suffix import SuffixConfig, SuffixProposer
from .target import Target, TargetConfig
from .theory import expected_tokens, optimal_k, speedup
from .tree import SIBLING_KINDS, SampledTree, tree_from_sequences
from .typical import TypicalAcceptance, verify_tree_typical

__version__ = "0.1.0"


def load_default(*args, **kwargs):
    """The embedded default model (SmolLM2-135M-Instruct) and its tokenizer; see models.load_default."""
    from .models import load_default as _load

    return _load(*args, **kwargs)


__all__ = [  # sorted
    "BatchKConfig", "BatchKProposer", "ChainResult", "Context", "Draft", "DraftModelConfig", "DraftModelProposer", "Eagle2Config",
    "Eagle2Proposer", "Eagle3Head", "EagleConfig", "EagleHead", "EagleProposer", "GREEDY",
    "GenerationOutput", "GenerationStats", "HybridConfig", "HybridProposer", "LookaheadConfig",
    "LookaheadProposer", "METHODS", "MLPSpeculator", "MLPSpeculatorConfig", "MLPSpeculatorProposer", "MTPConfig", "MTPProposer", "MTPStack", "MedusaConfig", "MedusaHeads",
    "MedusaProposer", "NgramConfig", "NgramProposer", "NullProposer", "PickerConfig", "Proposer",
    "Recommendation", "Registry", "Report", "Request", "SIBLING_KINDS", "SampledTree", "SamplingConfig",
    "ScheduleOutput", "SpecCache", "StepCosts", "SuffixConfig", "SuffixProposer", "Target",
    "TargetConfig",
    "TreeResult", "TypicalAcceptance", "autoregressive_generate", "check_generator",
    "check_greedy_verifier", "check_rejection_sampler", "check_tree_sampler", "chi_square_gof",
    "chi_square_two_sample", "detectable_tv", "expected_tokens", "joint_index", "load_default",
    "load_eagle", "load_eagle3", "load_medusa", "load_mlp_speculator", "load_mtp", "load_native_mtp",
    "load_published_mlp_speculator", "load_trained_draft",
    "logits_to_probs", "make_generators", "measure_cost", "measure_verify_cost", "optimal_k",
    "propose_ngram", "recommend", "samples_for_tv", "schedule", "speculative_generate", "speedup",
    "tree_from_sequences", "truncated_draft", "tv_distance", "verify_chain", "verify_chain_block", "verify_chain_greedy",
    "verify_tree", "verify_tree_greedy", "verify_tree_traversal", "verify_tree_typical",
]
