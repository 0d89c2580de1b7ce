"""Every bad input gets a clear error (specref/checks.py), and none of them changes the model.

Each case: the call, the error type, and a pattern the message must match (the argument's name, and
for drafts the proposer's class and the Draft field). After each case the target's weights and a
fresh greedy generation are checked unchanged. Positive cases: what a user would reasonably pass
(numpy ints, 0-d tensors, lists) is accepted and gives the same tokens as the canonical form.
The oracle's own bad inputs are tested in tests/oracle/.
"""
import numpy as np
import pytest
import torch

from specref import rejection
from specref.checks import ArgumentTypeError
from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import tiny_model
from specref.ngram import NgramConfig, NgramProposer
from specref.proposer import Draft

V = 32
TARGET = tiny_model("llama", vocab_size=V, seed=0, max_positions=128)
IDS = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))  # (2, 6)
REF = autoregressive_generate(TARGET, IDS, max_new_tokens=8, temperature=0).tokens  # (2, 8)
WEIGHTS = {n: p.detach().clone() for n, p in TARGET.named_parameters()}


def ar(**kw):
    kw.setdefault("temperature", 0.0)
    return autoregressive_generate(TARGET, kw.pop("ids", IDS), max_new_tokens=kw.pop("max_new_tokens", 8), **kw)


def spec(proposer, **kw):
    kw.setdefault("temperature", 0.0)
    return speculative_generate(TARGET, proposer, kw.pop("ids", IDS), max_new_tokens=kw.pop("max_new_tokens", 8),
                                **kw)


class Scripted:
    """A user's proposer returning whatever `make(ctx)` builds (a bad Draft, or None)."""

    def __init__(self, make, k=3):
        self.make, self.k = make, k

    def begin(self, ctx, sampling, generator):
        pass

    def propose(self, ctx, sampling, generator):
        return self.make(ctx)

    def update(self, ctx, num_accepted):
        pass


def draft(tokens, lengths, **kw):
    return Scripted(lambda ctx: Draft(tokens=torch.as_tensor(tokens), lengths=lengths, **kw))


def _q(rows, K, fill=None):
    q = torch.full((rows, K, V), 1.0 / V)  # (B, K, V) uniform
    if fill is not None:
        q[fill[0]] = fill[1]
    return q


G = torch.Generator().manual_seed(0)
CASES = [
    # -- prompts
    ("input_ids float", lambda: ar(ids=IDS.float()), TypeError, "input_ids must hold integers"),
    ("input_ids str", lambda: ar(ids="hello"), TypeError, "input_ids must be a torch.Tensor"),
    ("input_ids 3-d", lambda: ar(ids=IDS[None]), ValueError, "input_ids must have shape"),
    ("input_ids ragged list", lambda: ar(ids=[[1, 2], [3]]), TypeError, "input_ids must be a tensor or a rectangular"),
    ("token out of vocab", lambda: ar(ids=torch.tensor([[1, V]])), ValueError, r"outside \[0, 32\)"),
    ("empty row", lambda: ar(attention_mask=torch.tensor([[1] * 6, [0] * 6])), ValueError, "prompt row 1 is empty"),
    ("mask shape", lambda: ar(attention_mask=torch.ones(2, 5, dtype=torch.long)), ValueError, "attention_mask shape"),
    ("mask float values", lambda: ar(attention_mask=torch.full((2, 6), 0.5)), ValueError, "attention_mask must hold 0"),
    ("mask values", lambda: ar(attention_mask=torch.full((2, 6), 2)), ValueError, "attention_mask must hold 0"),
    # -- sampling settings and lengths
    ("temperature < 0", lambda: ar(temperature=-1.0), ValueError, "temperature"),
    ("temperature str", lambda: ar(temperature="hot"), TypeError, "temperature must be a number"),
    ("temperature nan", lambda: ar(temperature=float("nan")), ValueError, "temperature"),
    ("top_k float", lambda: ar(temperature=1.0, top_k=1.5), TypeError, "top_k must be an int"),
    ("top_p 0", lambda: ar(temperature=1.0, top_p=0.0), ValueError, "top_p"),
    ("max_new_tokens < 0", lambda: ar(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
    ("max_new_tokens str", lambda: ar(max_new_tokens="5"), TypeError, "max_new_tokens must be an int"),
    ("max_new_tokens huge", lambda: ar(max_new_tokens=10**12), ValueError, "128 positions"),  # before allocating
    ("past the window", lambda: ar(ids=IDS[:, :1].repeat(1, 7), max_new_tokens=122), ValueError,
     r"longest prompt \(7 tokens\) \+ max_new_tokens \(122\) exceeds the model's 128 positions"),
    ("max_len 0", lambda: ar(max_len=0), ValueError, "max_len must be >= 1"),
    ("max_len small", lambda: ar(max_len=8), ValueError, "max_len 8 is too small"),
    ("eos out of vocab", lambda: ar(eos_token_id=100), ValueError, r"eos_token_id must be token ids in \[0, 32\)"),
    ("eos -1", lambda: ar(eos_token_id=-1), ValueError, "eos_token_id"),
    ("eos list with str", lambda: ar(eos_token_id=[3, "a"]), TypeError, r"eos_token_id\[1\] must be an int"),
    ("eos float tensor", lambda: ar(eos_token_id=torch.tensor(5.0)), TypeError, "eos_token_id"),
    # -- generators and seeds
    ("seed float", lambda: ar(temperature=1.0, seed=1.7), TypeError, "seed must be an int"),
    ("seed str", lambda: ar(temperature=1.0, seed="12"), TypeError, "seed must be an int"),
    ("seed 2**64", lambda: ar(temperature=1.0, seed=2**64), ValueError, "seed must be in"),
    ("seed < 0", lambda: ar(temperature=1.0, seed=-1), ValueError, "seed must be in"),
    ("generator int", lambda: ar(temperature=1.0, generator=42), TypeError, "generator must be a torch.Generator"),
    ("generator list with None", lambda: ar(temperature=1.0, generator=[G, None]), TypeError, r"generator\[1\]"),
    ("three generators, greedy", lambda: ar(generator=[G, G, G]), ValueError, "3 generators for a batch of 2"),
    ("generator and seed", lambda: ar(temperature=1.0, generator=G, seed=0), ValueError, "generator or seed"),
    # -- proposers
    ("a class", lambda: spec(NgramProposer), TypeError, "proposer must be an instance.*NgramProposer"),
    ("no methods", lambda: spec(object()), TypeError, r"lacks the Proposer methods \['begin', 'propose', 'update'\]"),
    ("k str", lambda: spec(Scripted(None, k="abc")), TypeError, "Scripted.k must be an int"),
    ("k < 0", lambda: spec(Scripted(None, k=-1)), ValueError, "Scripted.k must be >= 0"),
    ("draft vocab", lambda: spec(DraftModelProposer(tiny_model("llama", vocab_size=16))), ValueError, "vocab size"),
    # -- their drafts (a user's proposer: checked every step)
    ("propose None", lambda: spec(Scripted(lambda ctx: None)), TypeError, "Scripted.propose.. returned NoneType"),
    ("token >= vocab", lambda: spec(draft([[V, 1], [2, 3]], torch.tensor([2, 2]))), ValueError,
     r"Scripted: Draft.tokens\[0, 0\] = 32 is not a token id"),
    ("float tokens", lambda: spec(draft([[1.0, 2.0]] * 2, torch.tensor([2, 2]))), TypeError, "Scripted: Draft.tokens"),
    ("too many rows", lambda: spec(draft([[1, 2]] * 3, torch.tensor([2, 2, 2]))), ValueError,
     "Draft.tokens has 3 rows for a batch of 2"),
    ("lengths as list", lambda: spec(draft([[1, 2]] * 2, [2, 2])), TypeError, "Scripted: Draft.lengths"),
    ("lengths wider", lambda: spec(draft([[1, 2]] * 2, torch.tensor([3, 2]))), ValueError, "Draft.lengths must be in"),
    ("lengths < 0", lambda: spec(draft([[1, 2]] * 2, torch.tensor([-1, 2]))), ValueError, "Draft.lengths must be in"),
    ("lengths > k", lambda: spec(draft([[1, 2, 3, 4]] * 2, torch.tensor([4, 4]))), ValueError, r"k = 3"),
    ("q shape", lambda: spec(draft([[1, 2]] * 2, torch.tensor([2, 2]), q=torch.rand(2, 2, 5))), ValueError,
     r"Scripted: Draft.q must be a float tensor"),
    ("q nan", lambda: spec(draft([[1, 2]] * 2, torch.tensor([2, 2]), q=_q(2, 2, ((1, 1), float("nan"))))),
     ValueError, r"Scripted: Draft.q\[1, 1\] is NaN"),
    ("q logits", lambda: spec(draft([[1, 2]] * 2, torch.tensor([2, 2]), q=_q(2, 2) * 3)), ValueError, "sums to"),
    ("parents order", lambda: spec(draft([[1, 2]] * 2, torch.tensor([2, 2]), parents=torch.tensor([[-1, 1]] * 2))),
     ValueError, r"Scripted: Draft.parents\[0, 1\] = 1"),
    ("tree q without a kind", lambda: spec(draft([[1, 2]] * 2, torch.tensor([2, 2]), q=_q(2, 2),
                                                parents=torch.tensor([[-1, -1]] * 2))),
     ValueError, r"Scripted: Draft.siblings is None but a q was given"),
    ("per-node kinds, one short", lambda: spec(draft([[1, 2]] * 2, torch.tensor([2, 2]), q=_q(2, 2),
                                                    parents=torch.tensor([[-1, -1]] * 2), siblings=["sampled"])),
     ValueError, r"Scripted: Draft.siblings as a list must name one kind"),
    ("kind index out of range", lambda: spec(draft([[1, 2]] * 2, torch.tensor([2, 2]), q=_q(2, 2),
                                                  parents=torch.tensor([[-1, -1]] * 2), siblings=torch.tensor([1, 7]))),
     ValueError, r"Scripted: Draft.siblings\[0, 1\] = 7"),
    # -- verifiers (the public rejection API checks its inputs)
    ("verify_chain p nan", lambda: rejection.verify_chain(torch.tensor([[1]]), torch.full((1, 2, V), float("nan"))),
     ValueError, r"p\[0, 0, 0\] = nan"),
    ("verify_tree parents", lambda: rejection.verify_tree(torch.tensor([[1, 2]]), torch.tensor([[0, -1]]),
                                                         torch.full((1, 3, V), 1.0 / V)), ValueError, r"parents\[0, 0\]"),
    ("verify_tree q without a kind", lambda: rejection.verify_tree(torch.tensor([[1, 2]]), torch.tensor([[-1, -1]]),
                                                                  torch.full((1, 3, V), 1.0 / V), torch.full((1, 2, V), 1.0 / V)),
     ValueError, r"siblings is None but a q was given"),
]


@pytest.mark.parametrize("name,call,exc,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error_and_changes_nothing(name, call, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        call()
    assert isinstance(info.value, ValueError)  # every user error is a ValueError (DESIGN.md), types too
    for n, p in TARGET.named_parameters():
        assert torch.equal(p, WEIGHTS[n]), n
    assert torch.equal(ar(temperature=0).tokens, REF)


def _nan_model(seed):
    m = tiny_model("llama", vocab_size=V, seed=seed, max_positions=128)
    with torch.no_grad():
        m.get_output_embeddings().weight[3] = float("nan")  # every logit row gets a NaN
    return m


@pytest.mark.parametrize("temperature,pattern", [(0.0, "the target's logits are NaN in row 0 at step 0"),
                                                 (1.0, "the target's distribution p .* in row 0 at step 0")])
def test_nan_target_is_named_with_row_and_step(temperature, pattern):
    with pytest.raises(ValueError, match=pattern):
        autoregressive_generate(_nan_model(1), IDS, max_new_tokens=4, temperature=temperature, seed=0)


def test_nan_draft_is_named():
    prop = DraftModelProposer(_nan_model(2), DraftModelConfig(k=2))
    with pytest.raises(ValueError, match="the draft distribution q of DraftModelProposer .* row 0 at step 0"):
        spec(prop, temperature=1.0, seed=0)
    assert torch.equal(ar(temperature=0).tokens, REF)


def test_what_a_user_would_pass_is_accepted():
    assert torch.equal(ar(max_new_tokens=np.int64(8)).tokens, REF)
    assert torch.equal(ar(ids=IDS.tolist(), attention_mask=[[1] * 6] * 2).tokens, REF)
    assert torch.equal(ar(ids=IDS.numpy()).tokens, REF)
    assert torch.equal(ar(attention_mask=torch.ones(2, 6)).tokens, REF)  # float and bool masks of 0/1
    assert torch.equal(ar(attention_mask=torch.ones(2, 6, dtype=torch.bool)).tokens, REF)
    eos = int(REF[0, 3])
    want = ar(eos_token_id=eos).tokens
    for same in (np.int64(eos), torch.tensor(eos), [eos], (eos,), torch.tensor([eos])):
        assert torch.equal(ar(eos_token_id=same).tokens, want)
    a = ar(temperature=1.0, seed=np.int64(7)).tokens
    assert torch.equal(ar(temperature=torch.tensor(1.0), seed=torch.tensor(7)).tokens, a)
    # a tiny temperature is the greedy limit, not an overflow: max-subtracted before dividing
    assert torch.equal(ar(temperature=1e-45, seed=0).tokens, REF)
    # prompt + max_new_tokens may fill the window exactly (7 + 121 = 128 positions)
    assert ar(ids=IDS[:, :1].repeat(1, 7), max_new_tokens=121).num_tokens.tolist() == [121, 121]


def test_configs_take_numpy_ints():
    from specref.eagle_head import EagleConfig
    from specref.lookahead import LookaheadConfig

    for cfg, field in ((DraftModelConfig(k=np.int64(3)), "k"), (EagleConfig(k=np.int32(2)), "k"),
                       (NgramConfig(min_n=np.int64(1), max_n=torch.tensor(3), k=np.int64(4)), "max_n"),
                       (LookaheadConfig(W=np.int64(3), N=np.int64(3), G=np.int64(2)), "W")):
        assert type(getattr(cfg, field)) is int, (cfg, field)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        DraftModelConfig(k=np.float64(3.0))  # a float stays refused


def test_a_users_correct_drafts_pass_the_per_step_check():
    # the same drafts as the library's n-gram proposer, through a user's wrapper: checked each step
    class Wrapped:
        def __init__(self):
            self.inner = NgramProposer(NgramConfig(k=3, min_n=1))
            self.k = 3

        def begin(self, *a):
            self.inner.begin(*a)

        def propose(self, *a):
            return self.inner.propose(*a)

        def update(self, *a):
            self.inner.update(*a)

    out = spec(Wrapped(), temperature=0)
    assert torch.equal(out.tokens, REF) and out.stats.num_draft_tokens > 0
