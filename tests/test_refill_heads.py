"""reset_rows of the feature-reading proposers (eagle_head.py, eagle_tree.py, eagle3.py,
medusa_heads.py with and without a prefix layer, mtp.py, mlp_speculator.py; the shared
proposer.refill_context; hybrid.py over them) and of suffix.py (its request trees): a finished row
takes the next request and its state restarts from that
request's prefill features, the other rows untouched. Random heads (greedy parity holds for any
draft); that the drafts of a refilled row are its request's alone is shown draft by draft against
one fresh begin() per request (greedy drafts are a function of the request's context)."""
import pytest
import torch

from specref import eagle_head
from specref.eagle3 import Eagle3Head
from specref.eagle_head import EagleConfig, EagleHead, EagleProposer
from specref.eagle_tree import Eagle2Config, Eagle2Proposer
from specref.generate import autoregressive_generate
from specref.hybrid import HybridConfig, HybridProposer
from specref.medusa_heads import MedusaConfig, MedusaHeads, MedusaProposer
from specref.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig, MLPSpeculatorProposer
from specref.models import tiny_model
from specref.mtp import MTPConfig, MTPProposer, MTPStack
from specref.ngram import NgramConfig, NgramProposer
from specref.scheduler import Request, schedule
from specref.suffix import SuffixConfig, SuffixProposer

V = 16
SMALL = [[0], [1], [0, 0], [0, 0, 0]]  # a Medusa tree of 4 nodes over 3 heads

PROPOSERS = {
    "eagle": lambda t: EagleProposer(EagleHead(t, torch.arange(V), seed=1), EagleConfig(k=3)),
    "eagle_adaptive": lambda t: EagleProposer(EagleHead(t, torch.arange(V), seed=1),
                                              EagleConfig(k=3, adaptive=True)),  # per-row acceptance reset too
    "eagle2": lambda t: Eagle2Proposer(EagleHead(t, torch.arange(V), seed=1), Eagle2Config(top_k=2, depth=3,
                                                                                          total_tokens=5)),
    "eagle3": lambda t: EagleProposer(Eagle3Head(t, torch.arange(V), layers=(0, 1, 2), seed=0), EagleConfig(k=3)),
    "medusa": lambda t: MedusaProposer(MedusaHeads(t, 3, torch.arange(V)), MedusaConfig(choices=SMALL)),
    "medusa_prefix": lambda t: MedusaProposer(MedusaHeads(t, 3, torch.arange(V)).add_prefix(t, "layer"),
                                              MedusaConfig(choices=SMALL)),
    "mtp": lambda t: MTPProposer(MTPStack(t, num_modules=2, seed=5).eval(), MTPConfig(k=3)),
    "hybrid": lambda t: HybridProposer(NgramProposer(NgramConfig(k=3, min_n=1)), PROPOSERS["eagle"](t)),
    "hybrid_tree": lambda t: HybridProposer(NgramProposer(NgramConfig(k=3, min_n=1)), PROPOSERS["eagle"](t),
                                            HybridConfig(mode="tree")),
    "hybrid_medusa": lambda t: HybridProposer(NgramProposer(NgramConfig(k=3, min_n=1)), PROPOSERS["medusa"](t)),
    # SuffixDecoding without its global tree: a draft is then a function of the request alone
    "suffix_tree": lambda t: SuffixProposer(SuffixConfig(k=4, max_depth=8, max_cached_requests=0, tree=True)),
    "hybrid_suffix": lambda t: HybridProposer(SuffixProposer(SuffixConfig(k=3, max_depth=8, max_cached_requests=0)),
                                              PROPOSERS["eagle"](t)),
    "mlp_speculator": lambda t: MLPSpeculatorProposer(MLPSpeculator(t, 3, token_map=torch.arange(12), seed=3).eval(),
                                                      MLPSpeculatorConfig(k=3)),
}


@pytest.fixture(scope="module")
def target():
    """test_scheduler's peaked V=16 target (a Llama: the heads need one)."""
    return tiny_model("llama", vocab_size=V, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)


def _requests(n, seed):
    """n requests: ragged prompts of 1..8 tokens (one-token prompts have no prefill feature), budgets 1..9."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        P = int(torch.randint(1, 9, (), generator=g))
        m = int(torch.randint(1, 10, (), generator=g))
        out.append(Request(torch.randint(0, V, (P,), generator=g).tolist(), max_new_tokens=m))
    return out


def _counts(out):
    s = out.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def _run(target, method, reqs, B, refill):
    """schedule() with a proposer whose every draft is recorded by the row's context: {context
    tokens: (draft tokens, parents)} (a greedy draft is a function of the request's context alone)."""
    prop = PROPOSERS[method](target)
    drafts, propose = {}, prop.propose

    def recording(ctx, sampling, generator):
        d = propose(ctx, sampling, generator)
        for b in range(ctx.tokens.shape[0]):
            if bool(ctx.active[b]):
                n = int(d.lengths[b])
                par = None if d.parents is None else d.parents[b, :n].tolist()
                par = None if par == list(range(-1, n - 1)) else par  # a chain, as a tree beside other rows' trees
                drafts[tuple(ctx.row(b).tolist())] = (d.tokens[b, :n].tolist(), par)
        return d

    prop.propose = recording
    return schedule(target, prop, reqs, batch_size=B, refill=refill, temperature=0), drafts, prop


@pytest.mark.parametrize("method", list(PROPOSERS))
def test_refilled_rows_restart_from_the_new_request(target, method):
    """More requests than rows: each request's tokens are `ar`'s alone, no row idles while requests
    wait, and every draft of a refilled row is the one its request gets alone (a begin() per request)."""
    reqs = _requests(9, seed=1)
    ref = [autoregressive_generate(target, torch.tensor(r.prompt), max_new_tokens=r.max_new_tokens,
                                   temperature=0).row(0) for r in reqs]
    alone, want, _ = _run(target, method, reqs, 1, "batch")
    assert alone.tokens == ref
    assert alone.stats.num_draft_tokens > 0
    for B in (1, 3):
        out, got, prop = _run(target, method, reqs, B, "row")
        assert callable(getattr(prop, "reset_rows", None))
        assert out.tokens == ref, B
        assert out.stats.idle_row_steps == 0, B  # per-row refill, not static batches
        assert got == want, B
        if method != "hybrid_medusa":  # there a chain row beside tree rows is verified as a tree, whose
            assert _counts(out) == _counts(alone), B  # budget cut comes later: other counts, same drafts


def test_a_reset_without_the_new_features_is_caught(target, monkeypatch):
    """Mutant: reset_rows forgets the new prompt's features (the head's catch-up reads zeros): the
    output stays exact (verification) but the drafts differ from a fresh begin()'s."""
    reqs = _requests(9, seed=1)
    alone, want, _ = _run(target, "eagle", reqs, 1, "batch")
    monkeypatch.setattr(eagle_head, "refill_context", lambda ctx, rows, hidden: None)
    out, got, _ = _run(target, "eagle", reqs, 3, "row")
    assert out.tokens == alone.tokens
    assert got != want


def test_reset_rows_before_begin_is_refused(target):
    rows = torch.tensor([0])
    for method in ("eagle", "medusa", "mtp", "mlp_speculator"):
        with pytest.raises(ValueError, match="before begin"):
            PROPOSERS[method](target).reset_rows(None, rows, None)


def test_an_empty_tree_step_keeps_the_pending_tokens_feature(target):
    """A one-token prompt has no prefill feature, so Medusa drafts nothing in the first step; that
    step's committed token must still hand its feature on (generate._commit_cache: the root of an
    empty tree path), or the row never drafts at all."""
    from specref.generate import speculative_generate
    out = speculative_generate(target, PROPOSERS["medusa"](target), torch.tensor([[5]]), max_new_tokens=7,
                               temperature=0)
    assert out.stats.num_drafts > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "mlp_speculator"])
def test_k_by_batch_over_the_learned_chains(target, method):
    """batch_k's BatchKProposer over each learned chain (variable_k: it drafts only the k chosen),
    refilled per row: one row alone drafts k = 3, two rows k = 1, three (compute-bound) none; greedy
    output exact whatever k each step took."""
    from specref.batch_k import BatchKConfig, BatchKProposer, StepCosts

    reqs = _requests(9, seed=2)
    ref = [autoregressive_generate(target, torch.tensor(r.prompt), max_new_tokens=r.max_new_tokens,
                                   temperature=0).row(0) for r in reqs]
    costs = StepCosts({1: [1.0, 1.0, 1.0, 1.0], 2: [1.0, 1.1, 3.0, 4.0], 3: [1.0, 3.0, 5.0, 7.0]})
    prop = BatchKProposer(PROPOSERS[method](target), BatchKConfig(costs=costs))
    assert prop.inner.variable_k and callable(prop.reset_rows)
    out = schedule(target, prop, reqs, batch_size=3, refill="row", temperature=0)
    assert out.tokens == ref
    assert out.stats.idle_row_steps == 0
    assert {0, 3} <= set(prop.ks)  # three rows: plain decoding; the last row alone: k = 3
