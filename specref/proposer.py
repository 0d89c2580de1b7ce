"""The proposer protocol: what every speculative method implements, and all that generate.py knows.

Leviathan et al. 2023 (Algorithm 1) split a speculative step into "guess" and "verify". A
proposer is the guessing half: from the committed context it returns a Draft of at most k tokens
per row, with the draft distribution q it sampled them from (or q = None for a deterministic draft:
n-gram lookup, argmax heads), and after verification it is told how many were accepted so it can
roll back its own state (a draft model's KV cache, a lookahead window).

A chain draft is tokens (B, K) with per-row lengths (ragged; -1 beyond a row's length). A tree
draft adds `parents`; see tree.py. The verifier (rejection.py) never calls a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from .sampling import Generators, SamplingConfig
from .tree import Siblings


@dataclass
class Context:
    """The committed tokens of every row, right-padded.

    Row b's context is tokens[b, :lengths[b]]: the prompt and every emitted token, the last of
    which the target has not processed yet (it is the first token of the next verify block).
    """

    tokens: torch.Tensor  # (B, T) long, right-padded (value beyond lengths is undefined)
    lengths: torch.Tensor  # (B,) long, valid tokens per row
    active: torch.Tensor  # (B,) bool, rows still generating (finished rows may get an empty draft)
    hidden: Optional[torch.Tensor] = None  # (B, W, D) target features of the tokens the last target
    # forward committed, for proposers that set `hidden_layers` (EAGLE, Medusa); else None
    hidden_len: Optional[torch.Tensor] = None  # (B,) valid rows of `hidden`: row b's hidden[b, j] is
    # the feature at position lengths[b] - 1 - hidden_len[b] + j (the pending token has none yet)
    prompt_lengths: Optional[torch.Tensor] = None  # (B,) prompt tokens of each row (the rest is generated)

    def row(self, b: int) -> torch.Tensor:
        return self.tokens[b, : int(self.lengths[b])]  # (T_b,)


@dataclass
class Draft:
    """What a proposer returns for one step.

    Chain: tokens (B, K), row b drafts tokens[b, :lengths[b]], the rest is -1.
    Tree: `parents` (B, N) gives each node's parent node index (-1 for a child of the root, which is
    the row's last committed token); nodes are topologically ordered (parent index < node index);
    tokens (B, N), lengths (B,) the number of real nodes per row (the rest -1).
    q: (B, K, V) probabilities the tokens were sampled from, or None for a deterministic draft
    (q is one-hot on the drafted token).
    siblings (trees only): how the children of a node were drawn, which decides the rule that
    verifies them (tree.SIBLING_KINDS, rejection.py, docs/sibling_kinds.md); given, never guessed:
    - "deterministic" (or None), q None: the nodes are a function of the history (top-k of a head,
      EAGLE-2, Medusa, n-gram and lookahead candidates); the rule removes a rejected token from p;
    - "sampled": each node an independent draw from its own q row (SpecInfer's i.i.d. siblings, or
      siblings from different q's, hybrid.py's two branches: an n-gram node's q is one-hot);
    - "without": the siblings of a node drawn without replacement from their parent's q
      (Gumbel-top-k, k distinct samples, tree.tree_from_sequences merging sampled sequences);
      Sequoia's rule, q[b, i] the parent's q (before removing the earlier siblings' tokens) or the
      q node i was drawn from;
    - one kind per node, for trees that mix them (top-k levels over sampled levels, a top-k sibling
      beside samples): a list of K names, or an integer tensor (K,) or (B, K) of indices into
      tree.SIBLING_KINDS; q rows of deterministic nodes are then not read.
    A tree draft with q must name its kind, and a single "deterministic" refuses a q: top-k siblings
    verified against the q they were ranked by, or without-replacement siblings verified as i.i.d.,
    are silently lossy (exact numbers in docs/sibling_kinds.md), so the loop refuses the pairings it
    can see (checks.check_siblings) and the label is the proposer's to get right.
    """

    tokens: torch.Tensor  # (B, K) long, -1 padded
    lengths: torch.Tensor  # (B,) long, 0..K
    q: Optional[torch.Tensor] = None  # (B, K, V) float or None
    parents: Optional[torch.Tensor] = None  # (B, N) long for a tree draft, None for a chain
    aux: Optional["AuxBlock"] = None  # extra tokens scored in the same forward (lookahead), or None
    siblings: Siblings = None  # trees: a kind of tree.SIBLING_KINDS or one per node; see above

    @property
    def is_tree(self) -> bool:
        return self.parents is not None or self.aux is not None

    @staticmethod
    def empty(batch: int, device: torch.device) -> "Draft":
        return Draft(
            tokens=torch.full((batch, 0), -1, dtype=torch.long, device=device),  # (B, 0)
            lengths=torch.zeros(batch, dtype=torch.long, device=device),  # (B,)
        )


@dataclass
class AuxBlock:
    """Tokens a proposer wants scored in the verification forward without being verified
    (lookahead decoding's Jacobi window, Fu et al. 2024). They follow the draft in the block:
    [root, node_0..node_{N-1}, aux_0..aux_{E-1}]; draft nodes never attend them; their K/V slots are
    discarded after the step. The proposer receives their logits through `observe(aux_logits)`.
    """

    tokens: torch.Tensor  # (B, E) long
    mask: torch.Tensor  # (B, E, 1+N+E) bool: aux i may attend block position j (the committed
    # prefix is always visible; column 0 is the root, 1..N the draft nodes, 1+N+j aux j)
    depth: torch.Tensor  # (B, E) long: position id = root position + depth


def refill_context(ctx: Context, rows: torch.Tensor, hidden: Optional[torch.Tensor]) -> Optional[Context]:
    """For a feature-reading proposer's `reset_rows`: ctx with the new rows' prefill features
    `hidden` (R, P, D) placed in rows `rows` of a (B, P, D) tensor, hidden_len the prompt length - 1
    there and 0 elsewhere (the other rows see no new feature), as begin() sees a prefill. None when
    no new row has a feature (prompts of one token)."""
    if hidden is None or hidden.shape[1] == 0:
        return None
    B = ctx.tokens.shape[0]
    full = hidden.new_zeros((B, *hidden.shape[1:]))  # (B, P, D)
    full[rows.to(hidden.device)] = hidden
    n = torch.zeros(B, dtype=torch.long, device=ctx.lengths.device)  # (B,)
    n[rows.to(n.device)] = ctx.lengths[rows.to(n.device)] - 1
    return Context(tokens=ctx.tokens, lengths=ctx.lengths, active=ctx.active, hidden=full, hidden_len=n,
                   prompt_lengths=ctx.prompt_lengths)


@runtime_checkable
class Proposer(Protocol):
    """Implemented by every method (draft_model.py, ngram.py, lookahead.py, eagle_head.py,
    medusa_heads.py, mtp.py, mlp_speculator.py, hybrid.py, suffix.py). generate.py relies on exactly this, and nothing else:

    - `k`: the most draft tokens (chain) or nodes (tree) per row and step; a chain's length and a
      tree's depth never exceed it (generate.py sizes its buffers by it).
    - The call order: begin() once after the target's prefill, then per step propose() -> one
      target forward -> [observe()] -> update(). update() follows every verification, whether or not
      the proposer drafted anything in that step.
    - Rows outside `ctx.active` (finished rows, or rows a combining proposer such as hybrid.py gives
      to another source this step) get an empty draft (length 0) and draw no random numbers; the
      proposer keeps its state for them as it was (update() reports 0 accepted for them) and
      catches up on the tokens committed in between the next time it drafts them.
    - q: the distribution each drafted token was actually sampled from, or None for a
      deterministic draft (q one-hot on the drafted token). One generator per row means row b's
      draws come from generator b alone (sampling.ragged_uniforms / sample_rows).
    - Tree drafts name their sibling kind (Draft.siblings), which must match how the nodes were
      drawn. The library's: EAGLE-2 (eagle_tree.py), Medusa (medusa_heads.py) and lookahead
      (lookahead.py) and SuffixDecoding's trees (suffix.py) emit "deterministic" (top-k / candidate
      n-grams / distinct trie children, q None: the token set is a
      function of the history, so each node is accepted with probability p(x) among distinct
      siblings); HybridConfig(mode="tree") emits "sampled" (the n-gram node, q one-hot, and the
      learned node, drawn from its own q independently of it: SpecInfer's rule for independent
      draws from different q's, which for a one-hot q is the deterministic rule); the chain
      proposers (draft model, n-gram, EAGLE-1, MTP) have no siblings.
    - A proposer the library trusts (checks.trusted: every method its class runs is specref's own)
      skips the per-step Draft check; a user's class, or a subclass overriding any method, is checked.
    - Optional `vocab_size` (int): must equal the target's; checked once.
    - Optional `hidden_layers` (a tuple of layer indices, e.g. (-1,) for the final normed state):
      generate.py then passes the target's states of those layers of the tokens the last forward
      committed in ctx.hidden / ctx.hidden_len, to begin() (the prefill's) and to update().
    - Optional `acceptance_rule`: None (rejection sampling, exact) or a typical.TypicalAcceptance:
      then at T > 0 the step accepts by Medusa's typical acceptance instead (LOSSY, opt-in).
    - Optional `observe(aux_logits)`: called after the verification forward with the (B, E, V)
      logits of Draft.aux, before update() (lookahead decoding's Jacobi window).
    - Optional `reset_rows(ctx, rows, hidden)`: the request queue (scheduler.py) put new requests
      into rows (R,) after an update(): ctx holds their prompts (lengths = prompt lengths, active,
      nothing generated), the target's cache their prefill (every prompt token but the last), and
      hidden (R, P, D) its features (None unless `hidden_layers`). The proposer forgets what it knew
      of those rows and starts them as begin() would, leaving the other rows as they are; it draws
      no random numbers. A proposer without it is scheduled in static batches (begin() per batch).
      The feature-reading ones (EAGLE-1/2/3, Medusa, MTP, the MLP speculator) zero the rows' state
      and store `hidden` through refill_context() as begin() stores the prefill's.
    """

    k: int

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        """Called once after the target's prefill (e.g. a draft model prefills its own cache)."""

    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        """Return the draft for the next step. q must be the distribution actually sampled from."""

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        """Told after verification: ctx is the new committed context, num_accepted (B,) how many
        draft tokens (for a tree: path nodes) each row accepted and kept (0 for rows it did not
        draft). Roll back own state here."""
