"""Lookahead decoding: a Jacobi-iteration window and an n-gram pool, verified in the same forward.

Fu, Bailis, Stoica, Zhang 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding" (ICML 2024, Sec. 3). No draft model: every target forward does three things at once.
- Lookahead branch (Sec. 3.1): a 2D window of W columns x (N-1) levels of guessed tokens, level 0
  the oldest Jacobi iterate, level N-2 the newest. Layout here: token (l, j) sits at position
  root + l + j, and (0, 0) IS the root (the row's last committed token). One Jacobi step per
  forward: token (N-2, j) is scored in the context of its own trajectory, and the target's argmax
  there is the new guess new[j] for position root + N-1 + j.
- n-gram pool (Sec. 3.1): each step, column j's trajectory read diagonally,
  (g0[j], g1[j], .., g_{N-2}[j], new[j]) at positions root+j .. root+j+N-1, is an n-gram; the pool
  keeps at most G n-grams per first token, the most recently seen (as the official code's LRU).
- Verification branch (Sec. 3.2): the (up to G) pool n-grams whose first token equals the root;
  their N-1 continuation tokens are the draft, merged into a token tree (common prefixes become
  one path; the trees of tree.tree_from_sequences, built vectorised), q = None
  (Draft.siblings="deterministic": the pool's n-grams are a function of the history, so merging
  them changes nothing the deterministic rule relies on).
  Greedy verification takes the longest path of target argmaxes (exact); sampling uses recursive
  rejection over the distinct children at each depth (rejection.verify_tree; the paper's sampling
  verification, after SpecInfer), lossless for any deterministic candidates.
- One forward, the paper's mask (Sec. 3.3, Fig. 2b): block [root, tree nodes, window]. Window token
  (l, j) attends the committed prefix, the level-0 tokens of columns 0..j (root included) and the
  level 1..l tokens of its own column j: the sequence root, g0[1..j], g1[j], .., gl[j] at
  consecutive positions. Tree nodes never attend the window, the window never attends tree nodes;
  window K/V slots are discarded after the step (generate.py, Draft.aux).
- After the step the window moves one column, whatever was accepted (the official code's default
  ALWAYS_FWD_ONE): levels 1..N-2 and new become levels 0..N-2; the next root overwrites (0, 0).

Choices: the window is updated with the target's argmax also when sampling (the official code's
guesses are greedy too); this cannot bias the output, since verification accepts any
deterministic candidates losslessly. The window starts with tokens drawn uniformly from the prompt
(the official code's default), using the call's generator(s) (sampling.uniforms, so with one
generator per row a row's draws are its own). n-grams are pooled once levels 1..N-2 are all Jacobi
outputs (from step N-1 on). `pool_from_prompt` (official POOL_FROM_PROMPT, off in the paper) also
pools every n-gram of the prompt and of the committed output. Everything is a tensor over rows:
the pool is dense over first tokens (B x V x G x (N-1) int32: 5.5 MB per row for V 49152, G 7,
N 5), the only Python loops run over W, N and the prompt's positions.
In shape comments here N is the paper's n-gram size; M counts tree nodes, E window tokens.

Left out: the official fill phase (its window grows level by level over the first N-2 steps; here
it is full from the start), multi-GPU lookahead parallelism (Sec. 3.4), the FlashAttention
kernel, and the official code's replacement of EOS guesses in the window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .checks import normalise_ints
from .proposer import AuxBlock, Context, Draft, Generators
from .sampling import SamplingConfig, uniforms
from .tree import Tree


@dataclass(frozen=True)
class LookaheadConfig:
    """Settings of lookahead decoding (paper symbols W, N, G).

    Defaults: the paper's configuration for 7B models on one A100 (W 15, N 5, G = W). Spec-Bench
    (and the official README) run N 5, W 7, G 7. On a CPU every block token costs (DESIGN.md):
    the block is 1 + (N-1)W - 1 window tokens + up to G(N-1) tree nodes, so use small W, N, G there.
    """

    W: int = 15  # window size: Jacobi columns (how far ahead the window guesses)
    N: int = 5  # n-gram size: the window has N-1 levels, a candidate drafts N-1 tokens (>= 3)
    G: int = 15  # most n-grams per first token in the pool = most candidates verified per step
    pool_from_prompt: bool = False  # also pool the prompt's and output's n-grams (off in the paper)

    def __post_init__(self) -> None:
        normalise_ints(self, "W", "N", "G")
        for name, v, lo in (("W", self.W, 1), ("N", self.N, 3), ("G", self.G, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}"
                                 + (" (N = 2 would draft single tokens from the root's own logits)"
                                    if name == "N" else ""))
        if not isinstance(self.pool_from_prompt, bool):
            raise ValueError(f"pool_from_prompt must be a bool, got {self.pool_from_prompt!r}")


def window_pattern(W: int, N: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lookahead branch's attention pattern and depths (the paper's Fig. 2b, lower left).

    Window token f = l * W + j (level l, column j; f = 0 is the root). Returns
    allowed (E, 1 + E) bool: window token 1+e may attend column 0 (root) / 1+e' (window token 1+e'),
    and depth (E,) long = l + j, E = (N-1) W - 1.
    """
    lev = torch.arange(N - 1).repeat_interleave(W)  # (F,) F = (N-1) W
    col = torch.arange(W).repeat(N - 1)  # (F,)
    ql, qc, kl, kc = lev[:, None], col[:, None], lev[None, :], col[None, :]  # (F, 1), (1, F)
    allowed = ((kl == 0) & (kc <= qc)) | ((kl >= 1) & (kl <= ql) & (kc == qc))  # (F, F)
    return allowed[1:], (lev + col)[1:]  # (E, F), (E,)


class NgramPool:
    """At most G n-grams per first token and row, the most recently seen kept (the official LRU).

    Dense tensors over (row, first token, slot): tokens (B, V, G, N-1) int32, stamps (B, V, G) of a
    clock (0 = empty). Inserting refreshes an equal n-gram's stamp, else fills an empty slot, else
    replaces the oldest. The key axis grows on demand (the vocabulary is learnt from the logits).
    """

    def __init__(self, batch: int, keys: int, G: int, D: int, device: torch.device):
        self.tokens = torch.zeros(batch, keys, G, D, dtype=torch.int32, device=device)  # (B, V, G, N-1)
        self.stamps = torch.zeros(batch, keys, G, dtype=torch.int32, device=device)  # (B, V, G)
        self.clock = 0

    def grow(self, keys: int) -> None:
        B, V, G, D = self.tokens.shape
        if keys > V:
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(B, keys - V, G, D)], 1)  # (B, V', G, D)
            self.stamps = torch.cat([self.stamps, self.stamps.new_zeros(B, keys - V, G)], 1)  # (B, V', G)

    def insert(self, rows: torch.Tensor, key: torch.Tensor, cont: torch.Tensor) -> None:
        """For the rows where rows (B,) is True, put n-gram (key (B,), cont (B, N-1)) in the pool."""
        self.grow(int(key.max()) + 1 if key.numel() else 0)
        ar = torch.arange(key.shape[0], device=key.device)  # (B,)
        old, st = self.tokens[ar, key], self.stamps[ar, key]  # (B, G, N-1), (B, G)
        same = (old == cont[:, None].to(old)).all(-1) & (st > 0)  # (B, G)
        slot = torch.where(same.any(1), same.int().argmax(1), st.argmin(1))  # (B,) empty first, else oldest
        self.clock += 1
        r = ar[rows]  # (R,)
        self.tokens[r, key[r], slot[r]] = cont[r].to(old)
        self.stamps[r, key[r], slot[r]] = self.clock

    def lookup(self, key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The n-grams starting with key (B,), most recent first: (B, G, N-1) long, valid (B, G)."""
        ar = torch.arange(key.shape[0], device=key.device)  # (B,)
        st, order = self.stamps[ar, key].sort(dim=1, descending=True, stable=True)  # (B, G)
        cand = self.tokens[ar, key].gather(1, order[..., None].expand(-1, -1, self.tokens.shape[3]))
        return cand.long(), st > 0  # (B, G, N-1), (B, G)


def merge_candidates(cand: torch.Tensor, valid: torch.Tensor) -> Tree:
    """Merge candidate continuations (B, G, D), valid (B, G), into token trees sharing prefixes.

    The same trees as tree.tree_from_sequences (nodes numbered in order of first appearance,
    candidates in order, each from its first token), vectorised over rows: node (g, d) is new iff
    no earlier valid candidate has the same first d+1 tokens. Returns Tree((B, M), (B, M), (B,)).
    """
    B, G, D = cand.shape
    dev = cand.device
    both = valid[:, :, None] & valid[:, None, :]  # (B, G, G)
    same = (cand[:, :, None] == cand[:, None]).long().cumprod(-1).bool() & both[..., None]  # (B, G, G', D)
    same &= torch.ones(G, G, dtype=torch.bool, device=dev).tril()[None, :, :, None]  # g' <= g
    rep = same.int().argmax(2)  # (B, G, D) the first candidate with the same prefix
    created = valid[..., None] & (rep == torch.arange(G, device=dev)[None, :, None])  # (B, G, D)
    node_id = created.view(B, G * D).long().cumsum(1).view(B, G, D) - 1  # (B, G, D) for created nodes
    own = node_id.gather(1, rep)  # (B, G, D) node of (g, d), via its representative
    parent = torch.cat([torch.full_like(own[..., :1], -1), own[..., :-1]], 2)  # (B, G, D)
    M = int(created.sum((1, 2)).max()) if B else 0
    where = torch.where(created, node_id, M).view(B, G * D)  # (B, G*D), M = discard column
    tokens = torch.full((B, M + 1), -1, dtype=torch.long, device=dev)  # (B, M+1)
    parents = torch.full((B, M + 1), -1, dtype=torch.long, device=dev)  # (B, M+1)
    tokens.scatter_(1, where, torch.where(created, cand, -1).view(B, G * D))
    parents.scatter_(1, where, torch.where(created, parent, -1).view(B, G * D))
    return Tree(tokens[:, :M], parents[:, :M], created.sum((1, 2)))  # (B, M), (B, M), (B,)


class LookaheadProposer:
    """The Proposer protocol for lookahead decoding: a tree draft plus the window as Draft.aux.

    `k` is the widest block after the root (G(N-1) tree nodes + (N-1)W - 1 window tokens), so that
    generate.py sizes the KV cache for it. State per row: window (B, N-1, W) and the pool.
    """

    def __init__(self, config: LookaheadConfig = LookaheadConfig()):
        if not isinstance(config, LookaheadConfig):
            raise ValueError(f"config must be a LookaheadConfig, got {type(config).__name__}")
        self.config = config
        W, N, G = config.W, config.N, config.G
        self.k = G * (N - 1) + (N - 1) * W - 1
        self._pattern, self._depth = window_pattern(W, N)  # (E, F), (E,)
        self._newest = (N - 2) * W + torch.arange(W) - 1  # (W,) window indices of level N-2
        self.window: Optional[torch.Tensor] = None  # (B, N-1, W) long
        self.pool: Optional[NgramPool] = None
        self.steps = 0  # Jacobi steps done
        self._new: Optional[torch.Tensor] = None  # (B, W) argmax at level N-2, from observe()
        self._vocab = 0  # learnt from the window's logits
        self._lens: Optional[torch.Tensor] = None  # (B,) context lengths at propose()

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        cfg, B, dev = self.config, ctx.tokens.shape[0], ctx.tokens.device
        u = uniforms((cfg.N - 1, cfg.W), B, generator, dev)  # (B, N-1, W) in [0, 1)
        last = (ctx.lengths - 1).view(B, 1, 1)  # (B, 1, 1)
        idx = torch.minimum((u * ctx.lengths.view(B, 1, 1)).long(), last)  # (B, N-1, W) prompt positions
        self.window = ctx.tokens.gather(1, idx.view(B, -1)).view(B, cfg.N - 1, cfg.W)  # (B, N-1, W)
        self.pool = NgramPool(B, max(int(ctx.tokens.max()) + 1, self._vocab), cfg.G, cfg.N - 1, dev)
        self.steps, self._new, self._lens = 0, None, None
        if cfg.pool_from_prompt:
            self._pool_text(ctx, torch.zeros_like(ctx.lengths), ctx.active)

    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        if self.window is None or self.window.shape[0] != B:
            self.begin(ctx, sampling, generator)
        root = ctx.tokens.gather(1, (ctx.lengths - 1).view(B, 1)).squeeze(1)  # (B,)
        self.window[:, 0, 0] = root
        self._lens = ctx.lengths.clone()
        # 1. verification branch: the pool's n-grams that start with the root, most recent first
        cand, valid = self.pool.lookup(root)  # (B, G, N-1), (B, G)
        tree = merge_candidates(cand, valid & ctx.active[:, None])  # tokens, parents (B, M); (B,)
        M = tree.tokens.shape[1]
        # 2. lookahead branch: the window after the tree; it sees root + its trajectory, no nodes
        E = self._depth.numel()
        mask = torch.zeros(B, E, 1 + M + E, dtype=torch.bool, device=dev)  # (B, E, 1+M+E)
        mask[:, :, 0] = self._pattern[:, 0].to(dev)
        mask[:, :, 1 + M:] = self._pattern[:, 1:].to(dev)
        aux = AuxBlock(tokens=self.window.reshape(B, -1)[:, 1:],  # (B, E)
                       mask=mask, depth=self._depth.to(dev).expand(B, E))  # (B, E)
        return Draft(tokens=tree.tokens, lengths=tree.lengths, parents=tree.parents, aux=aux,
                     siblings="deterministic")

    def observe(self, aux_logits: torch.Tensor) -> None:
        """The target's logits at the window tokens (B, E, V): keep the argmax at the newest level."""
        self._vocab = aux_logits.shape[-1]
        self._new = aux_logits[:, self._newest.to(aux_logits.device)].argmax(-1)  # (B, W)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        """3. pool the window's n-grams, 4. move the window one column (any number accepted)."""
        if self._new is None or self.window is None:  # no forward saw the window this step
            return
        cfg, new, self._new = self.config, self._new.to(self.window.device), None
        self.steps += 1
        self.pool.grow(self._vocab)
        if cfg.pool_from_prompt and self._lens is not None:  # the output's n-grams, oldest first
            self._pool_text(ctx, self._lens, ctx.active)
        if self.steps >= cfg.N - 1:  # levels 1..N-2 were all Jacobi outputs in this forward
            grams = torch.cat([self.window, new[:, None]], 1)  # (B, N, W): column j = one n-gram
            for j in range(cfg.W):
                self.pool.insert(ctx.active, grams[:, 0, j], grams[:, 1:, j])
        self.window = torch.cat([self.window[:, 1:], new[:, None]], 1)  # (B, N-1, W)

    def _pool_text(self, ctx: Context, start: torch.Tensor, rows: torch.Tensor) -> None:
        """Pool the context's n-grams ending at positions start[b] .. lengths[b]-1 (and >= N-1)."""
        N = self.config.N
        lo = torch.clamp(start, min=N - 1)  # (B,) first end position per row
        span = torch.arange(1 - N, 1, device=ctx.tokens.device)  # (N,) offsets of an n-gram's tokens
        for i in range(int((ctx.lengths - lo).max())):  # offsets from lo, oldest first, over rows
            t = lo + i  # (B,)
            ok = rows & (t < ctx.lengths)  # (B,)
            gram = ctx.tokens.gather(1, (t[:, None] + span).clamp(max=ctx.tokens.shape[1] - 1))  # (B, N)
            self.pool.insert(ok, gram[:, 0], gram[:, 1:])
