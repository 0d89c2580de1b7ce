"""Host synchronisations per speculative step in the loop's own code (issue: fast on CUDA).

Every read of a tensor value on the host (`.item()`, `.tolist()`, `bool()`, `int()`, `float()`,
an index) waits for the device on CUDA. The loop may make two per step for a chain proposer: one
read of (rows alive, the longest context, the last step's NaN check) and the chain's width. This
test counts them with a proposer that reads nothing itself, by patching torch.Tensor's conversions
and attributing each call to the specref file it came from; the per-step figure is the difference
between a long and a short run (setup reads cancel out).
"""
import collections
import sys

import pytest
import torch

from specref.generate import speculative_generate
from specref.models import tiny_model
from specref.proposer import Draft

CONVERSIONS = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__"]


class _SyncFree:
    """Drafts k tokens per row by arithmetic on the device: x_i = (last + 1 + i) mod V; optionally a
    uniform q (the statistics are not the point here, the reads are)."""

    def __init__(self, k, V, with_q):
        self.k, self.V, self.with_q = k, V, with_q

    def begin(self, ctx, sampling, generator):
        pass

    def propose(self, ctx, sampling, generator):
        B = ctx.tokens.shape[0]
        last = ctx.tokens.gather(1, (ctx.lengths - 1).view(B, 1))  # (B, 1)
        toks = (last + 1 + torch.arange(self.k).view(1, -1)) % self.V  # (B, k)
        lengths = torch.full((B,), self.k) * ctx.active  # (B,)
        toks = torch.where(lengths.view(B, 1) > 0, toks, -1)
        q = torch.full((B, self.k, self.V), 1.0 / self.V) if self.with_q and not sampling.greedy else None
        return Draft(tokens=toks, lengths=lengths, q=q)

    def update(self, ctx, num_accepted):
        pass


def _count(fn):
    counts = collections.Counter()
    orig = {n: getattr(torch.Tensor, n) for n in CONVERSIONS}

    def wrap(name):
        f = orig[name]

        def counted(self, *a, **kw):
            path = sys._getframe(1).f_code.co_filename
            if "/specref/" in path:
                counts[path.split("/specref/")[1]] += 1
            return f(self, *a, **kw)
        return counted

    try:
        for n in CONVERSIONS:
            setattr(torch.Tensor, n, wrap(n))
        out = fn()
    finally:
        for n, f in orig.items():
            setattr(torch.Tensor, n, f)
    return out, counts


@pytest.mark.parametrize("temperature, gen", [(0.0, None), (1.0, "rows"), (1.0, "one"), (0.8, "rows")])
@pytest.mark.parametrize("trusted", [True, False])
def test_at_most_two_host_reads_per_chain_step(monkeypatch, temperature, gen, trusted):
    """The library's own proposers are trusted (checks.trusted): 2 reads per step. A user's
    proposer has each Draft checked before the target sees it: 2 more, 6 with q (checks.check_draft)."""
    from specref import checks

    monkeypatch.setattr(checks, "trusted", lambda proposer: trusted)
    V = 32
    target = tiny_model("llama", vocab_size=V, seed=2)
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(0))

    def run(n):
        g = None if gen is None else ([torch.Generator().manual_seed(i) for i in range(3)] if gen == "rows"
                                      else torch.Generator().manual_seed(0))
        return speculative_generate(target, _SyncFree(3, V, with_q=temperature == 1.0), ids, max_new_tokens=n,
                                    temperature=temperature, top_k=5 if temperature == 0.8 else 0, generator=g)

    short, c1 = _count(lambda: run(6))
    long, c2 = _count(lambda: run(40))
    steps = long.stats.target_forwards - short.stats.target_forwards
    assert steps >= 8
    per_step = {f: (c2[f] - c1[f]) / steps for f in set(c1) | set(c2)}
    loop = sum(v for f, v in per_step.items() if f != "checks.py")
    assert loop <= 2.0 + 1e-9, per_step
    assert (per_step.get("checks.py", 0) > 0) == (not trusted), per_step  # the user-draft check: 2-6 reads
