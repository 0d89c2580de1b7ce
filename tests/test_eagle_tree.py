"""Tests of eagle_tree.py (EAGLE-2 dynamic trees) and of the sibling-kind contract (proposer.Draft
.siblings): the tree equals its recomputation from scratch, greedy parity (batched, ragged, each
row alone), losslessness of the whole loop at T=1 and T=0.7 with top-k (chi-square against the
exact joint), the refusal of a deterministic tree that passes q, config errors."""
import math

import pytest
import torch

from _features import trained_eagle
from _stats import power_rows
from specref import oracle
from specref.draft_model import to_target_vocab
from specref.eagle_head import load_eagle, save_eagle
from specref.eagle_tree import Eagle2Config, Eagle2Proposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.oracle.exact import hf_joint_distribution
from specref.proposer import Draft
from specref.rejection import verify_tree
from specref.sampling import SamplingConfig
from specref.weights import fingerprint

V = 16


@pytest.fixture(scope="module")
def trained():
    return trained_eagle()  # (target, EAGLE-1 head, history), shared with test_eagle.py


def _logq(target, head, row, path):
    """log q over the draft vocabulary after the committed row and the drafted path, recomputed
    from scratch: the target's features of row[:-1], then one head run over all pairs per path token
    (each drafted token paired with the head's own predicted feature before it)."""
    f = target.model(input_ids=row[None, :-1]).last_hidden_state  # (1, L-1, D)
    x, c = row[None, 1:], row[None, :-1]  # (1, L-1) each: x_{t+1} and x_t of every pair
    for tok in list(path) + [None]:
        Q = x.shape[1]
        pos = torch.arange(Q).view(1, Q)  # (1, Q)
        mask = torch.where(pos.view(1, 1, Q, 1) >= pos.view(1, 1, 1, Q), 0.0, float("-inf"))  # (1, 1, Q, Q)
        f_hat = head(f, x, pos, mask, **({"cur_tokens": c} if head.current_token else {}))[:, -1:]  # (1, 1, D)
        if tok is None:
            return torch.log_softmax(head.logits(f_hat[0, 0]).float(), -1)  # (Vd,)
        f = torch.cat([f, f_hat], dim=1)
        c = torch.cat([c, x[:, -1:]], dim=1)
        x = torch.cat([x, torch.tensor([[tok]])], dim=1)


def _reference_tree(target, head, row, cfg):
    """EAGLE-2's expansion and reranking by brute force: the set of root-to-node token paths."""
    tm = head.token_map.tolist()
    lq = _logq(target, head, row, [])
    s, i = lq.topk(cfg.top_k)
    pool = [((tm[int(t)],), float(v)) for v, t in zip(s, i)]
    front = list(pool)
    for level in range(1, cfg.depth):
        kids = []
        for path, score in front:
            s, i = _logq(target, head, row, path).topk(cfg.top_k)
            kids += [(path + (tm[int(t)],), score + float(v)) for v, t in zip(s, i)]
        pool += kids
        front = sorted(kids, key=lambda n: -n[1])[: cfg.top_k]
    ranked = sorted(range(len(pool)), key=lambda j: (-pool[j][1], j))[: cfg.total_tokens]
    floor = math.log(cfg.min_value) if cfg.min_value > 0 else -math.inf
    return {pool[j][0] for j in ranked if pool[j][1] >= floor}


def _paths(draft, b):
    tok, par, n = draft.tokens[b].tolist(), draft.parents[b].tolist(), int(draft.lengths[b])
    out = set()
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(tok[j])
            j = par[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.fixture(scope="module")
def current_head(trained, tmp_path_factory):
    """The trained head with e(x_t) as a third input (eagle_head.py's current_token), its columns random."""
    target, head, _ = trained
    path = tmp_path_factory.mktemp("cur") / "head.safetensors"
    save_eagle(path, head, fingerprint(target), {"note": "test"})
    cur = load_eagle(target, path, current_token=True)
    with torch.no_grad():
        cur.fc.weight[:, 2 * head.hidden_size:].normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    return cur


@pytest.mark.parametrize("cfg,current", [(Eagle2Config(top_k=3, depth=3, total_tokens=8, min_value=0.0), False),
                                         (Eagle2Config(top_k=2, depth=4, total_tokens=6, min_value=0.05), False),
                                         (Eagle2Config(top_k=3, depth=3, total_tokens=8, min_value=0.0), True)])
def test_tree_equals_recomputation_from_scratch(trained, current_head, cfg, current):
    """Every step of a batched, ragged greedy generation: the cached, tree-masked frontier blocks give
    exactly the tree that brute-force recomputation from the committed tokens gives (catch-up,
    the ancestors' slots, positions, frontier selection, reranking, parents kept, roll-back; with
    current: each node's pair reads its parent's token as x_t)."""
    target, head, _ = trained
    head = current_head if current else head
    prop = Eagle2Proposer(head, cfg)
    checked, sizes, orig = [], set(), prop.propose

    def propose(ctx, sampling, generator):
        d = orig(ctx, sampling, generator)
        for b in range(ctx.tokens.shape[0]):
            if bool(ctx.active[b]):
                with torch.no_grad():
                    assert _paths(d, b) == _reference_tree(target, head, ctx.row(b), cfg), (b, ctx.row(b))
                checked.append(b)
                sizes.add(int(d.lengths[b]))
        return d

    prop.propose = propose
    ids = torch.tensor([[0, 0, 3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1], [0, 0, 0, 0, 9, 9, 2]])
    mask = (torch.arange(7) >= torch.tensor([2, 0, 4]).view(3, 1)).long()
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=12, temperature=0)
    assert len(checked) >= 9 and out.stats.accepted_per_position[1] > 0, out.stats
    if cfg.min_value > 0:
        assert len(sizes) > 1, sizes  # rows' trees differ in size (ragged)
    else:
        assert sizes == {cfg.total_tokens}


@pytest.mark.parametrize("cfg", [
    Eagle2Config(),  # the CPU defaults: top_k 4, depth 2, 4 nodes, min_value 0.05 (ragged)
    Eagle2Config(top_k=1, depth=4, total_tokens=4, min_value=0.0),  # a chain
    Eagle2Config(top_k=3, depth=4, total_tokens=10, min_value=0.2),  # small ragged trees
])
def test_greedy_parity_batched(trained, cfg):
    target, head, _ = trained
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(cfg.top_k))
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 8]).view(4, 1)).long()  # left padding; row 3: 1 token
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    sp = speculative_generate(target, Eagle2Proposer(head, cfg), ids, mask, max_new_tokens=20, temperature=0,
                              eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.tokens_per_forward > 1.3, sp.stats  # the trained head's trees are accepted
    for b in range(4):  # a row alone drafts and emits the same as in the batch
        one = speculative_generate(target, Eagle2Proposer(head, cfg), ids[b:b + 1], mask[b:b + 1],
                                   max_new_tokens=20, temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


@pytest.mark.two_threads
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_whole_loop_lossless(trained, temperature, top_k):
    """Joint of the first 3 tokens vs the exact distribution, n rows in one batch; power: n is the
    fewest rows (steps of 5,000, at most 80,000) detecting a TV deviation of 0.02 with probability
    >= 0.99 at 1e-3 (tests/_stats.power_rows). Deterministic siblings: q = None, recursive rule."""
    target, head, _ = trained
    L, prompt = 3, torch.tensor([3, 1, 4, 1, 5])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k)).numpy()
    n = power_rows(exact)
    prop = Eagle2Proposer(head, Eagle2Config(top_k=2, depth=3, total_tokens=5, min_value=0.0))  # siblings at 2 levels
    out = speculative_generate(target, prop, prompt.expand(n, -1), max_new_tokens=L, temperature=temperature,
                               top_k=top_k, generator=torch.Generator().manual_seed(7 + top_k))
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L), exact)
    assert res.p_value > 1e-3, res
    s = out.stats  # thousands of accepted nodes and of rejected first-level nodes
    assert s.num_accepted_tokens > 2000 and s.accepted_per_position[1] > 1000, s
    assert s.tokens_per_forward < 3.0, s  # not every path accepted: the rejections were exercised


class _WithQ:
    """Wraps a proposer; hands the verifier its trees with a q (the head's placeholder) attached."""

    def __init__(self, inner, siblings):
        self.inner, self.siblings, self.k = inner, siblings, inner.k
        self.hidden_layers, self.vocab_size = inner.hidden_layers, inner.vocab_size

    def begin(self, *a):
        self.inner.begin(*a)

    def update(self, *a):
        self.inner.update(*a)

    def propose(self, ctx, sampling, generator):
        d = self.inner.propose(ctx, sampling, generator)
        q = torch.full(tuple(d.tokens.shape) + (V,), 1.0 / V)  # (B, N, V)
        return Draft(d.tokens, d.lengths, q=q, parents=d.parents, siblings=self.siblings)


class _RootQ(Eagle2Proposer):
    """The refused pairing forced through: depth-1 trees (the head's top-k at the root) declared
    "sampled", every node with the head's q at the root, the distribution it was ranked by."""

    def _catch_up(self, ctx):
        self.last = super()._catch_up(ctx)  # (B, D) f^ at the pending token
        return self.last

    def _propose(self, ctx, sampling, generator):
        d = super()._propose(ctx, sampling, generator)
        q = to_target_vocab(torch.softmax(self.head.logits(self.last).float(), -1), self.head.token_map, V)  # (B, V)
        return Draft(d.tokens, d.lengths, q=q.unsqueeze(1).expand(-1, d.tokens.shape[1], -1).contiguous(),
                     parents=d.parents, siblings="sampled")


@pytest.mark.parametrize("siblings", [None, "deterministic"])
def test_deterministic_tree_with_q_is_refused(trained, siblings):
    """Top-k siblings verified with the q they were ranked by are lossy (shown: the chi-square
    rejects it at p < 1e-6 on 5,000 rows), so the loop and rejection.verify_tree refuse the pairing."""
    target, head, _ = trained
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with pytest.raises(ValueError, match="siblings"):
        speculative_generate(target, _WithQ(Eagle2Proposer(head), siblings), ids, max_new_tokens=4, temperature=1.0)
    # declared "sampled" (what hybrid.py's independent branches are), the same draft runs
    out = speculative_generate(target, _WithQ(Eagle2Proposer(head), "sampled"), ids, max_new_tokens=4,
                               temperature=1.0)
    assert out.num_tokens.tolist() == [4]
    with pytest.raises(ValueError, match="siblings"):
        speculative_generate(target, _WithQ(Eagle2Proposer(head), "iid"), ids, max_new_tokens=4, temperature=1.0)
    if siblings is None:  # forced through (declared "sampled"), the root's top-3 against the head's q: lossy
        L, prompt = 3, torch.tensor([3, 1, 4, 1, 5])
        exact = hf_joint_distribution(target, prompt, L, SamplingConfig(1.0)).numpy()
        prop = _RootQ(head, Eagle2Config(top_k=3, depth=1, total_tokens=3, min_value=0.0))
        out = speculative_generate(target, prop, prompt.expand(5000, -1), max_new_tokens=L, temperature=1.0,
                                   generator=torch.Generator().manual_seed(1))
        res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L), exact)
        assert res.p_value < 1e-6, res
    tok, par = torch.tensor([[1, 2]]), torch.tensor([[-1, -1]])
    p, q = torch.full((1, 3, V), 1.0 / V), torch.full((1, 2, V), 1.0 / V)
    with pytest.raises(ValueError, match="deterministic"):
        verify_tree(tok, par, p, q, siblings="deterministic")
    with pytest.raises(ValueError, match="sampled"):
        verify_tree(tok, par, p, None, siblings="sampled")
    assert verify_tree(tok, par, p, q, siblings="sampled").num_accepted.shape == (1,)


def test_config_errors(trained):
    _, head, _ = trained
    for bad in ({"top_k": 0}, {"depth": 0}, {"total_tokens": -1}, {"min_value": 1.0}, {"min_value": -0.1},
                {"top_k": 2.5}):
        with pytest.raises(ValueError):
            Eagle2Config(**bad)
    with pytest.raises(ValueError, match="Eagle2Config"):
        Eagle2Proposer(head, object())
    with pytest.raises(ValueError, match="EagleHead"):
        Eagle2Proposer(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="before begin"):
        Eagle2Proposer(head).propose(None, SamplingConfig(0.0), None)
    assert Eagle2Proposer(head, Eagle2Config(total_tokens=9)).k == 9


def test_verify_tree_refuses_a_q_without_its_sibling_kind():
    """A q says nothing of how the siblings were drawn (i.i.d., without replacement, merged into a
    trie): the public verifier is told, never guesses."""
    tok, par = torch.tensor([[1, 2]]), torch.tensor([[-1, -1]])
    p, q = torch.full((1, 3, V), 1.0 / V), torch.full((1, 2, V), 1.0 / V)
    with pytest.raises(ValueError, match="siblings"):
        verify_tree(tok, par, p, q)
    assert verify_tree(tok, par, p, None).num_accepted.shape == (1,)  # q None: deterministic siblings


def test_a_user_subclass_is_not_trusted(trained):
    """checks.trusted: a library class is trusted, a user's subclass of one is not, whichever method
    it overrides, so its drafts get the per-step Draft check."""
    from specref import checks

    _, head, _ = trained
    assert checks.trusted(Eagle2Proposer(head))

    class Mine(Eagle2Proposer):
        def _propose(self, *args, **kwargs):  # a drafting method of the user's (here: the library's drafts)
            return super()._propose(*args, **kwargs)

    assert not checks.trusted(Mine(head))
