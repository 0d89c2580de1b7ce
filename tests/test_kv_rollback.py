"""The cache invariant: after every commit the committed cache equals a fresh prefill."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specref.kv_rollback import SpecCache
from specref.target import Target


def _model(seed=0, vocab=64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _fresh(target, rows, max_len):
    """Prefill each committed row alone: the reference cache."""
    caches = []
    for r in rows:
        c = target.new_cache(1, max_len)
        target.prefill(c, r.view(1, -1), torch.tensor([len(r)]))
        caches.append(c)
    return caches


def _assert_equal_to_fresh(target, cache, rows):
    fresh = _fresh(target, rows, cache.max_len)
    for b, r in enumerate(rows):
        assert int(cache.lengths[b]) == len(r)
        for layer in range(target.num_layers):
            k, v = cache.layer_kv(layer, b)
            k0, v0 = fresh[b].layer_kv(layer, 0)
            torch.testing.assert_close(k, k0, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, v0, atol=1e-5, rtol=1e-5)


def test_chain_commit_full_accept_and_reject_at_zero():
    t = Target(_model())
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 64, (3, 30), generator=g)
    lens = torch.tensor([7, 4, 10])
    c = t.new_cache(3, 40)
    t.prefill(c, toks[:, :10], lens)
    rows = [toks[b, : lens[b]] for b in range(3)]
    _assert_equal_to_fresh(t, c, rows)
    # verify a block of 1 + 4 tokens per row; keep: row 0 all 5 (full accept), row 1 only the
    # pending token (rejection at draft position 0), row 2 three slots
    block = torch.randint(0, 64, (3, 5), generator=g)
    t.verify_chain(c, block)
    keep = torch.tensor([5, 1, 3])
    c.commit(keep)
    rows = [torch.cat([rows[b], block[b, : keep[b]]]) for b in range(3)]
    _assert_equal_to_fresh(t, c, rows)
    # a second step after the rollback overwrites the stale slots
    block = torch.randint(0, 64, (3, 3), generator=g)
    out = t.verify_chain(c, block)
    keep = torch.tensor([2, 3, 0])
    c.commit(keep)
    rows = [torch.cat([rows[b], block[b, : keep[b]]]) for b in range(3)]
    _assert_equal_to_fresh(t, c, rows)
    # and the logits of that block equal the full-sequence forward of each row
    with torch.no_grad():
        ref = t.model(torch.cat([rows[0], block[0, 2:]]).view(1, -1)).logits[0, -3:]
    torch.testing.assert_close(out.logits[0], ref, atol=1e-4, rtol=1e-4)


def test_tree_commit_path_compacts_accepted_nodes():
    t = Target(_model(seed=3))
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(0, 64, (2, 12), generator=g)
    lens = torch.tensor([6, 9])
    c = t.new_cache(2, 32)
    t.prefill(c, toks[:, :9], lens)
    rows = [toks[b, : lens[b]] for b in range(2)]
    # tree of 5 nodes below the root r:   r -> a(1), r -> b(2), a -> c(3), a -> d(4), d -> e(5)
    parent = torch.tensor([-1, 0, 0, 1, 1, 4])  # block position -> parent block position
    Q = 6
    anc = torch.zeros(Q, Q, dtype=torch.bool)
    depth = torch.zeros(Q, dtype=torch.long)
    for i in range(Q):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = int(parent[j])
        depth[i] = int(anc[i].sum()) - 1
    block = torch.randint(0, 64, (2, Q), generator=g)
    out = t.verify_tree(c, block, anc.expand(2, Q, Q), depth.expand(2, Q))
    # each node's logits equal the plain forward of its root-to-node path
    for b in range(2):
        for i in range(Q):
            path = block[b][anc[i]]
            with torch.no_grad():
                ref = t.model(torch.cat([rows[b], path]).view(1, -1)).logits[0, -1]
            torch.testing.assert_close(out.logits[b, i], ref, atol=1e-4, rtol=1e-4)
    # row 0 accepts the path r, a, d, e (block offsets 0, 1, 4, 5); row 1 accepts r, b (0, 2)
    path = torch.tensor([[0, 1, 4, 5], [0, 2, -1, -1]])
    num = torch.tensor([4, 2])
    c.commit_path(path, num)
    rows = [torch.cat([rows[0], block[0, [0, 1, 4, 5]]]), torch.cat([rows[1], block[1, [0, 2]]])]
    _assert_equal_to_fresh(t, c, rows)


def test_overflow_raises_before_state_changes():
    t = Target(_model())
    c = t.new_cache(2, 8)
    t.prefill(c, torch.zeros(2, 6, dtype=torch.long), torch.tensor([6, 3]))
    before = c.lengths.clone()
    with pytest.raises(ValueError, match="overflow"):
        t.verify_chain(c, torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(c.lengths, before)
    with pytest.raises(ValueError):
        c.commit(torch.tensor([-1, 0]))
    with pytest.raises(ValueError):
        c.rollback_to(torch.tensor([7, 0]))
    with pytest.raises(ValueError):
        SpecCache(2, 1, 0, torch.device("cpu"))
