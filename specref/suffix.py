"""SuffixDecoding: draft from suffix trees over the request's own tokens and the workload's earlier outputs.

Oliaro, Jia, Campos, Qiao 2025, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications" (NeurIPS 2025, arXiv 2411.04975); shipped as vLLM's `method: "suffix"` through
snowflakedb/ArcticInference. No draft model: two suffix trees (suffix_tree.py: counts, D(N), score,
MAX_SPEC) propose the continuation the workload has produced before.
- The request's tree (per row): its prompt and every token it has generated so far, appended as
  they are committed (ArcticInference's "local" tree; it holds the prompt and the response).
- The global tree (`SuffixCache`, shared by the rows and kept across calls): the outputs of earlier
  requests, one sequence each, and the outputs of the rows now generating, live (ArcticInference
  adds a response to both trees as it grows). The cache lives in the proposer object, so a
  proposer reused for several `speculative_generate` calls (or a cache passed to several proposers)
  starts cold and sees the requests in order; registry.py keeps one cache per method and Registry.
- Each step and row: the best draft of each tree over every match length p (score = sum of D(N),
  the expected number of accepted tokens), then the better of the two (the request's tree on a
  tie, ArcticInference's `SuffixDecodingCache.speculate`). `min_score` > 0 drafts only where the
  score reaches it: ArcticInference's hybrid rule, which keeps a suffix draft only if its score is
  at least the model drafter's k (hybrid.py takes such a proposer as its lookup part).
- `tree=False` drafts one path, as vLLM does (`use_tree_spec` off); `tree=True` the paper's
  speculation tree (Sec. 3.3), verified with tree attention. Either way the draft is a function of
  the committed history: q = None, Draft.siblings "deterministic" (trie children are distinct
  tokens), and the verification is rejection.py's token-wise rule, lossless for any such draft.
- Memory cap (the cache): at most `max_cached_requests` requests (vLLM 10,000; 0 turns the global
  tree off) and at most `max_cached_nodes` nodes (ours: a node costs ~140 bytes, measured); past
  either, the oldest request not generating now is evicted with all its suffixes (FIFO, as
  ArcticInference). The rows of the running call are never evicted, so a call of more rows than
  the cap holds them all until it ends.

Defaults are vLLM's (`SpeculativeConfig.suffix_decoding_*`, `SuffixDecodingProposer`): tree depth
24, 10,000 cached requests, spec factor alpha 1.0, min token probability tau 0.1, k (vLLM's
num_speculative_tokens) defaulting to the depth; offset 0 (ArcticInference's `max_spec_offset`,
which vLLM does not expose).

Batches: one request tree per row, one global tree for all; rows are ragged (their own lengths
and matches). A row whose context shrinks or whose prompt length changes between steps is taken
as a new request (a scheduler's refill). Because the global tree holds the other rows' outputs,
a row's draft (so, at T > 0, which tokens it emits for a given seed, not their law) depends on the
other requests, earlier and concurrent; greedy output never does.

Left out: the paper's and ArcticInference's path compression (the trie here has no compressed
edges; depth <= D bounds it), its C++ speed, and vLLM's max_model_len clipping (generate.py bounds
the block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .checks import as_float, normalise_ints
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig
from .suffix_tree import EMPTY, Speculation, SuffixCache, SuffixTree


@dataclass(frozen=True)
class SuffixConfig:
    """SuffixDecoding's settings (paper symbols; vLLM's names in the comments)."""

    k: int = 24  # the most draft tokens (tree nodes) per row and step (num_speculative_tokens:
    # vLLM defaults it to the tree depth); on a CPU a smaller k saves verify cost (registry.py: 10)
    max_depth: int = 24  # D: tree depth, the match length plus the draft length (max_tree_depth)
    max_spec_factor: float = 1.0  # alpha: MAX_SPEC = alpha * p + offset (max_spec_factor)
    max_spec_offset: float = 0.0  # offset of MAX_SPEC (ArcticInference; vLLM leaves it 0)
    min_token_prob: float = 0.1  # tau: draft a node only if D(N) >= tau (min_token_prob)
    max_cached_requests: int = 10_000  # requests in the global tree, FIFO eviction; 0 = no global tree
    max_cached_nodes: Optional[int] = 4_000_000  # ours: nodes of the global tree (~0.55 GB), FIFO
    # eviction; None = no node cap
    tree: bool = False  # False: one path (vLLM); True: the paper's greedy speculation tree
    min_score: float = 0.0  # draft only where the best score (expected accepted tokens) >= this;
    # ArcticInference's hybrid sets it to the model drafter's k

    def __post_init__(self) -> None:
        normalise_ints(self, "k", "max_depth", "max_cached_requests", "max_cached_nodes")
        for name, lo in (("k", 1), ("max_depth", 1), ("max_cached_requests", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        n = self.max_cached_nodes
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"max_cached_nodes must be None or an int >= 0, got {n!r}")
        for name in ("max_spec_factor", "max_spec_offset", "min_token_prob", "min_score"):
            object.__setattr__(self, name, as_float(getattr(self, name), name))
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if not isinstance(self.tree, bool):
            raise ValueError(f"tree must be a bool, got {self.tree!r}")

    def cache(self) -> SuffixCache:
        """A new, empty global tree with these caps."""
        return SuffixCache(self.max_depth, self.max_cached_requests, self.max_cached_nodes)


def max_spec(p: int, cfg: SuffixConfig) -> int:
    """MAX_SPEC for match length p: min(k, floor(alpha * p + offset)), at least 0."""
    return max(min(cfg.k, int(p * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6)), 0)


class SuffixProposer:
    """The Proposer protocol for SuffixDecoding: chain (or tree) drafts, q = None.

    cache: the global tree to use (shared, e.g. by a registry across calls); None: a new one, kept
    by this proposer across its calls. After each propose(), `last` holds every row's Speculation
    (None for rows that did not draft) and `last_probs` (B, K) the D(N) of each drafted node."""

    def __init__(self, config: SuffixConfig = SuffixConfig(), cache: Optional[SuffixCache] = None):
        if not isinstance(config, SuffixConfig):
            raise ValueError(f"config must be a SuffixConfig, got {type(config).__name__}")
        if cache is not None and (not isinstance(cache, SuffixCache) or cache.tree.max_depth != config.max_depth):
            raise ValueError("cache must be a SuffixCache of the config's max_depth (SuffixConfig.cache())")
        self.config, self.k = config, config.k
        self.cache = cache if cache is not None else config.cache()
        self._local: List[SuffixTree] = []  # per row: the request's tree (one sequence, id 0)
        self._rid: List[Optional[int]] = []  # per row: its request id in the global tree
        self._prompt: List[int] = []  # per row: prompt length
        self.last: List[Optional[Speculation]] = []
        self.last_probs: Optional[torch.Tensor] = None
        self.source_counts = [0, 0]  # row-steps drafted from [the request's tree, the global tree]

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        """New requests in every row: their trees start from their prompts (built once per distinct
        prompt and copied)."""
        B = ctx.tokens.shape[0]
        self._local, self._rid, self._prompt = [], [], []
        prompts = (ctx.prompt_lengths if ctx.prompt_lengths is not None else ctx.lengths).tolist()
        rows = ctx.tokens[:, :max(prompts, default=0)].tolist()  # (B, P)
        built: dict = {}
        for b in range(B):
            self._new_request(b, int(prompts[b]))
            key = tuple(rows[b][:prompts[b]])
            if key not in built:
                self._local[b].extend(0, key)
                built[key] = self._local[b]
            self._local[b] = built[key].copy()
        self._sync(ctx)

    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden=None) -> None:
        """Rows that took a new request (scheduler.py): each starts a new request tree from its
        prompt and a new request in the global tree (the old request stays there, finished, until
        evicted). Draws nothing."""
        B = ctx.tokens.shape[0]
        if len(self._local) != B:
            return self.begin(ctx, None, None)
        prompts = (ctx.prompt_lengths if ctx.prompt_lengths is not None else ctx.lengths).tolist()
        for b in rows.tolist():
            self._new_request(b, int(prompts[b]))
        self._sync(ctx)

    def _new_request(self, b: int, prompt_len: int) -> None:
        tree, rid = SuffixTree(self.config.max_depth), self.cache.start()
        if b == len(self._local):
            self._local.append(tree)
            self._rid.append(rid)
            self._prompt.append(prompt_len)
        else:
            self._local[b], self._rid[b], self._prompt[b] = tree, rid, prompt_len

    def _sync(self, ctx: Context) -> None:
        """Append each row's newly committed tokens to its tree and its output to the global tree."""
        lens = ctx.lengths.tolist()
        prompts = None if ctx.prompt_lengths is None else ctx.prompt_lengths.tolist()
        seen = [len(t.seqs.get(0, ())) for t in self._local]
        for b, n in enumerate(lens):
            if n < seen[b] or (prompts is not None and prompts[b] != self._prompt[b]):
                self._new_request(b, prompts[b] if prompts is not None else n)  # a refilled row
                seen[b] = 0
        grew = [b for b, n in enumerate(lens) if n > seen[b]]
        if not grew:
            return
        lo, hi = min(seen[b] for b in grew), max(lens[b] for b in grew)
        block = ctx.tokens[grew, lo:hi].tolist()  # (R, hi - lo) the new tokens and some old ones
        for r, b in enumerate(grew):
            new = block[r][seen[b] - lo: lens[b] - lo]
            self._local[b].extend(0, new)
            out_from = max(self._prompt[b] - seen[b], 0)  # the part past the prompt is output
            self.cache.extend(self._rid[b], new[out_from:])
        self.cache.evict(protected=self._rid)

    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        cfg, B, dev = self.config, ctx.tokens.shape[0], ctx.tokens.device
        if len(self._local) != B:
            self.begin(ctx, sampling, generator)
        self._sync(ctx)
        active = ctx.active.tolist()
        spec: List[Optional[Speculation]] = [None] * B
        glob = self.cache.tree if self.cache.enabled else None
        args = (cfg.k, cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_token_prob, cfg.tree)
        for b in range(B):
            if not active[b]:
                continue
            context = self._local[b].seqs[0][-cfg.max_depth:]  # the row's last D tokens
            own = self._local[b].speculate(context, *args)
            other = glob.speculate(context, *args) if glob is not None and glob.total else EMPTY
            best = own if own.score >= other.score else other  # the request's tree on a tie
            if best.tokens and best.score >= cfg.min_score:
                spec[b] = best
                self.source_counts[best is not own] += 1
        self.last = spec
        K = max((len(s.tokens) for s in spec if s is not None), default=0)
        pad = lambda xs, fill: xs + [fill] * (K - len(xs))  # noqa: E731
        rows = [s if s is not None else EMPTY for s in spec]
        tokens = torch.tensor([pad(s.tokens, -1) for s in rows], dtype=torch.long).view(B, K)  # (B, K)
        lengths = torch.tensor([len(s.tokens) for s in rows], dtype=torch.long)  # (B,)
        self.last_probs = torch.tensor([pad(s.probs, 0.0) for s in rows], dtype=torch.float64).view(B, K)
        if not cfg.tree:
            return Draft(tokens=tokens.to(dev), lengths=lengths.to(dev))
        parents = torch.tensor([pad(s.parents, -1) for s in rows], dtype=torch.long).view(B, K)  # (B, K)
        return Draft(tokens=tokens.to(dev), lengths=lengths.to(dev), parents=parents.to(dev),
                     siblings="deterministic")

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        """The committed tokens (ctx) join the trees; num_accepted is not needed."""
        self._sync(ctx)
