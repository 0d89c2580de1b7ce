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
  their N-1 continuation tokens are the draft, merged into a token tree (tree.tree_from_sequences:
  common prefixes become one path), q = None (deterministic). Greedy verification takes the longest
  path of target argmaxes (exact); sampling uses recursive rejection over the distinct children at
  each depth (rejection.verify_tree; the paper's Sec. 3.2 sampling rule), lossless for any
  deterministic candidates.
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
pools every n-gram of the prompt and of the committed output. The pool is a Python dict per row
(a hash map; B*W insertions per step); the window, its mask and positions are tensors over rows.
In shape comments here N is the paper's n-gram size; M counts tree nodes, E window tokens.

Left out: the official fill phase (its window grows level by level over the first N-2 steps; here
it is full from the start), multi-GPU lookahead parallelism (Sec. 3.4), the FlashAttention
kernel, and the official code's replacement of EOS guesses in the window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .proposer import AuxBlock, Context, Draft, Generators
from .sampling import SamplingConfig, uniforms
from .tree import tree_from_sequences

Pool = Dict[int, List[Tuple[int, ...]]]  # first token -> continuations, oldest first


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


def remember(pool: Pool, key: int, cont: Tuple[int, ...], G: int) -> None:
    """Put an n-gram into a row's pool: most recent last, at most G per key (LRU)."""
    lst = pool.setdefault(key, [])
    if cont in lst:
        lst.remove(cont)
    elif len(lst) >= G:
        del lst[0]
    lst.append(cont)


class LookaheadProposer:
    """The Proposer protocol for lookahead decoding: a tree draft plus the window as Draft.aux.

    `k` is the widest block after the root (G(N-1) tree nodes + (N-1)W - 1 window tokens), so that
    generate.py sizes the KV cache for it. State per row: window (B, N-1, W) and a pool.
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
        self.pools: List[Pool] = []
        self.steps = 0  # Jacobi steps done
        self._new: Optional[torch.Tensor] = None  # (B, W) argmax at level N-2, from observe()
        self._lens: Optional[torch.Tensor] = None  # (B,) context lengths at propose()

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        cfg, (B, dev) = self.config, (ctx.tokens.shape[0], ctx.tokens.device)
        u = uniforms((cfg.N - 1, cfg.W), B, generator, dev)  # (B, N-1, W) in [0, 1)
        last = (ctx.lengths - 1).view(B, 1, 1)  # (B, 1, 1)
        idx = torch.minimum((u * ctx.lengths.view(B, 1, 1)).long(), last)  # (B, N-1, W) prompt positions
        self.window = ctx.tokens.gather(1, idx.view(B, -1)).view(B, cfg.N - 1, cfg.W)  # (B, N-1, W)
        self.pools = [{} for _ in range(B)]
        self.steps, self._new, self._lens = 0, None, None
        if cfg.pool_from_prompt:
            for b in range(B):
                self._pool_text(b, ctx.row(b).tolist(), 0)

    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        if self.window is None or self.window.shape[0] != B:
            self.begin(ctx, sampling, generator)
        root = ctx.tokens.gather(1, (ctx.lengths - 1).view(B, 1)).squeeze(1)  # (B,)
        self.window[:, 0, 0] = root
        self._lens = ctx.lengths.clone()
        # 1. verification branch: the pool's n-grams that start with the root, most recent first
        roots, active = root.tolist(), ctx.active.tolist()
        seqs = [list(reversed(self.pools[b].get(roots[b], []))) if active[b] else [] for b in range(B)]
        tree = tree_from_sequences(seqs, device=dev)  # tokens, parents (B, M); lengths (B,)
        M = tree.tokens.shape[1]
        # 2. lookahead branch: the window after the tree; it sees root + its trajectory, no nodes
        E = self._depth.numel()
        mask = torch.zeros(B, E, 1 + M + E, dtype=torch.bool, device=dev)  # (B, E, 1+M+E)
        mask[:, :, 0] = self._pattern[:, 0].to(dev)
        mask[:, :, 1 + M:] = self._pattern[:, 1:].to(dev)
        aux = AuxBlock(tokens=self.window.reshape(B, -1)[:, 1:],  # (B, E)
                       mask=mask, depth=self._depth.to(dev).expand(B, E))  # (B, E)
        return Draft(tokens=tree.tokens, lengths=tree.lengths, parents=tree.parents, aux=aux)

    def observe(self, aux_logits: torch.Tensor) -> None:
        """The target's logits at the window tokens (B, E, V): keep the argmax at the newest level."""
        self._new = aux_logits[:, self._newest.to(aux_logits.device)].argmax(-1)  # (B, W)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        """3. pool the window's n-grams, 4. move the window one column (any number accepted)."""
        if self._new is None or self.window is None:  # no forward saw the window this step
            return
        cfg, new, self._new = self.config, self._new.to(self.window.device), None
        self.steps += 1
        active = ctx.active.tolist()
        if self.steps >= cfg.N - 1:  # levels 1..N-2 were all Jacobi outputs in this forward
            grams = torch.cat([self.window, new[:, None]], 1).transpose(1, 2).tolist()  # B x W x N
            for b in range(len(grams)):
                if active[b]:
                    for g in grams[b]:
                        remember(self.pools[b], g[0], tuple(g[1:]), cfg.G)
        self.window = torch.cat([self.window[:, 1:], new[:, None]], 1)  # (B, N-1, W)
        if cfg.pool_from_prompt and self._lens is not None:
            old, lens = self._lens.tolist(), ctx.lengths.tolist()
            for b in range(len(old)):
                if active[b] and lens[b] > old[b]:
                    first = max(old[b] - cfg.N + 1, 0)
                    self._pool_text(b, ctx.tokens[b, first: lens[b]].tolist(), old[b] - first)

    def _pool_text(self, b: int, text: List[int], start: int) -> None:
        """Pool the n-grams of `text` that end at index >= start (and at >= N-1)."""
        N = self.config.N
        for t in range(max(start, N - 1), len(text)):
            remember(self.pools[b], text[t - N + 1], tuple(text[t - N + 2: t + 1]), self.config.G)
