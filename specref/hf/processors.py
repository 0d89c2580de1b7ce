"""Logits processors that read the context (repetition penalty, no-repeat n-grams, ...), losslessly.

Speculative sampling reproduces the distribution p the target is sampled from (Leviathan et al.
2023, Sec. 2.3). A processor that reads the context changes p at every position, so p at draft
position i must be computed on the context INCLUDING the draft tokens before i: p_i(x) =
proc(prefix + x_1..x_{i-1})(logits_i)(x). Applied on the committed context only (the same for every
position of the block) it is a different distribution, and the output is no longer what direct
sampling with the processor gives (tests/hf/test_processors.py shows the chi-square test rejecting that
mutant). In a tree each node's processors see its own path (root to node), not its siblings.

A draft that samples may use any q it likes, as long as q is what its tokens were drawn from; the
draft model applies the same processors on its own side (its drafted prefix) because that makes q
close to p, not because losslessness needs it.

Cost: the block's 1 + N contexts are materialised as a (B (1+N), T + D) tensor each step (T the
context width, D the draft depth) and every processor is vectorised over it; a transformers
`LogitsProcessorList` is called once per distinct context length (it takes rectangular input_ids).

Every processor here has the call `proc(tokens (M, T) long, lengths (M,), num_new (M,), logits (M, V))
-> logits (M, V)`: row m's context is tokens[m, :lengths[m]], of which the last num_new[m] are
generated (the rest is the prompt); positions past lengths[m] are undefined and never read.
The semantics are transformers' (RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor,
NoBadWordsLogitsProcessor, MinNewTokensLengthLogitsProcessor) on one unpadded row, and vLLM's for
presence / frequency penalties (over generated tokens only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .. import tree


def _present(tokens: torch.Tensor, valid: torch.Tensor, V: int) -> torch.Tensor:
    """(M, V) bool: token v occurs at a valid position of row m (ids >= V are ignored)."""
    idx = torch.where(valid & (tokens >= 0) & (tokens < V), tokens, V)  # (M, T); V = a spare column
    out = torch.zeros(tokens.shape[0], V + 1, dtype=torch.bool, device=tokens.device)  # (M, V+1)
    return out.scatter_(1, idx, True)[:, :V]


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).view(1, -1)  # (1, T)


@dataclass(frozen=True)
class RepetitionPenalty:
    """CTRL's penalty (Keskar et al. 2019) as transformers applies it: every token that occurs in
    the context (prompt and generated) has its logit divided by `penalty` if positive, multiplied
    if negative."""

    penalty: float

    def __post_init__(self):
        if not (isinstance(self.penalty, (int, float)) and self.penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.penalty!r}")

    def __call__(self, tokens, lengths, num_new, logits):
        seen = _present(tokens, _positions(tokens) < lengths.view(-1, 1), logits.shape[-1])  # (M, V)
        pen = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)  # (M, V)
        return torch.where(seen, pen, logits)


@dataclass(frozen=True)
class PresenceFrequencyPenalty:
    """OpenAI / vLLM penalties over the generated tokens: logit -= frequency * count + presence * [count > 0]."""

    presence: float = 0.0
    frequency: float = 0.0

    def __call__(self, tokens, lengths, num_new, logits):
        M, V = logits.shape
        pos = _positions(tokens)  # (1, T)
        gen = (pos < lengths.view(-1, 1)) & (pos >= (lengths - num_new).view(-1, 1))  # (M, T)
        idx = torch.where(gen & (tokens >= 0) & (tokens < V), tokens, V)  # (M, T)
        count = torch.zeros(M, V + 1, device=logits.device, dtype=logits.dtype)
        count = count.scatter_add_(1, idx, torch.ones_like(idx, dtype=logits.dtype))[:, :V]  # (M, V)
        return logits - self.frequency * count - self.presence * (count > 0).to(logits.dtype)


@dataclass(frozen=True)
class NoRepeatNGram:
    """Ban every token that would complete an n-gram already in the context (Paulus et al. 2017)."""

    n: int

    def __post_init__(self):
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"no_repeat_ngram_size must be an int >= 1, got {self.n!r}")

    def __call__(self, tokens, lengths, num_new, logits):
        M, V = logits.shape
        n, T = self.n, tokens.shape[1]
        if T < n:
            return logits
        win = tokens.unfold(1, n, 1)  # (M, S, n): the n-gram starting at s, S = T - n + 1
        start = torch.arange(win.shape[1], device=tokens.device).view(1, -1)  # (1, S)
        inside = start <= (lengths - n).view(-1, 1)  # (M, S): the whole n-gram is in the context
        if n > 1:
            tail = (lengths.view(-1, 1) - n + 1 + torch.arange(n - 1, device=tokens.device)).clamp(min=0)  # (M, n-1)
            prefix = tokens.gather(1, tail)  # (M, n-1): the last n-1 tokens
            inside &= (win[..., :-1] == prefix.unsqueeze(1)).all(-1)
        banned = _present(win[..., -1], inside, V)  # (M, V)
        return logits.masked_fill(banned, float("-inf"))


@dataclass(frozen=True)
class BadWords:
    """Ban token sequences: a one-token word always, a longer one's last token when the context ends
    with the rest of it."""

    words: Tuple[Tuple[int, ...], ...]

    def __call__(self, tokens, lengths, num_new, logits):
        M, V = logits.shape
        ban = torch.zeros(M, V, dtype=torch.bool, device=logits.device)  # (M, V)
        for w in self.words:
            if w[-1] >= V:
                continue
            if len(w) == 1:
                ban[:, w[0]] = True
                continue
            m = len(w) - 1
            tail = (lengths.view(-1, 1) - m + torch.arange(m, device=tokens.device)).clamp(min=0)  # (M, m)
            hit = (tokens.gather(1, tail) == torch.tensor(w[:-1], device=tokens.device)).all(1) & (lengths >= m)
            ban[:, w[-1]] |= hit
        return logits.masked_fill(ban, float("-inf"))


@dataclass(frozen=True)
class MinNewTokens:
    """No eos before `min_new` tokens have been generated."""

    min_new: int
    eos: Tuple[int, ...]

    def __call__(self, tokens, lengths, num_new, logits):
        V = logits.shape[-1]
        ids = [e for e in self.eos if e < V]
        if not ids:
            return logits
        early = (num_new < self.min_new).view(-1, 1)  # (M, 1)
        is_eos = torch.zeros(V, dtype=torch.bool, device=logits.device)
        is_eos[ids] = True
        return logits.masked_fill(early & is_eos, float("-inf"))


class HFProcessors:
    """A transformers `LogitsProcessorList` (or one processor) as a specref processor: called once
    per distinct context length on the rows of that length (input_ids (m, L), scores (m, V))."""

    def __init__(self, procs):
        self.procs = procs

    def __call__(self, tokens, lengths, num_new, logits):
        out = logits.clone()
        for L in torch.unique(lengths).tolist():
            rows = (lengths == L).nonzero().view(-1)  # (m,)
            out[rows] = self.procs(tokens[rows, :L], out[rows].clone()).to(out.dtype)
        return out


@dataclass(frozen=True)
class Processors:
    """An ordered list of processors, applied left to right (the library's order: repetition,
    presence / frequency, no-repeat n-gram, bad words, min new tokens, then the user's)."""

    procs: Tuple = ()

    def __bool__(self) -> bool:
        return bool(self.procs)

    def __call__(self, tokens, lengths, num_new, logits):
        x = logits.float()  # (M, V) processors work in fp32 whatever the model dtype
        for p in self.procs:
            x = p(tokens, lengths, num_new, x)
        return x


def build(*, repetition_penalty: Optional[float] = None, presence_penalty: float = 0.0,
          frequency_penalty: float = 0.0, no_repeat_ngram_size: Optional[int] = None,
          bad_words_ids: Optional[Sequence[Sequence[int]]] = None, min_new_tokens: Optional[int] = None,
          eos: Sequence[int] = (), logits_processor=None) -> Processors:
    """The processors the settings ask for, each only when it does something."""
    procs: List = []
    if repetition_penalty is not None and repetition_penalty != 1.0:
        procs.append(RepetitionPenalty(float(repetition_penalty)))
    if presence_penalty or frequency_penalty:
        procs.append(PresenceFrequencyPenalty(float(presence_penalty), float(frequency_penalty)))
    if no_repeat_ngram_size:
        procs.append(NoRepeatNGram(no_repeat_ngram_size))
    if bad_words_ids:
        words = tuple(tuple(int(t) for t in w) for w in bad_words_ids)
        if any(len(w) == 0 or min(w) < 0 for w in words):
            raise ValueError(f"bad_words_ids must be non-empty lists of token ids >= 0, got {bad_words_ids!r}")
        procs.append(BadWords(words))
    if min_new_tokens and eos:
        procs.append(MinNewTokens(int(min_new_tokens), tuple(eos)))
    if logits_processor is not None:
        items = list(logits_processor) if isinstance(logits_processor, (list, tuple)) else [logits_processor]
        for p in items:
            if not callable(p):
                raise ValueError(f"logits_processor items must be callable, got {type(p).__name__}")
            procs.append(p if getattr(p, "specref_processor", False) or isinstance(
                p, (RepetitionPenalty, PresenceFrequencyPenalty, NoRepeatNGram, BadWords, MinNewTokens))
                else HFProcessors(p))
    return Processors(tuple(procs))


def path_contexts(ctx_tokens: torch.Tensor, ctx_len: torch.Tensor, num_new: torch.Tensor,
                  tokens: torch.Tensor, parents: Optional[torch.Tensor], lengths: torch.Tensor):
    """The context of every block row: row 0 the committed context, row 1 + j that context followed
    by the path from the root to node j (a chain is the tree with parents j - 1).

    ctx_tokens (B, T), ctx_len (B,), num_new (B,) generated tokens in the context; tokens (B, N) the
    draft, parents (B, N) or None, lengths (B,) its real nodes.
    -> tokens (B (1+N), T + N), lengths (B (1+N),), num_new (B (1+N),), rows in (b, block row) order.
    """
    B, N = tokens.shape
    T, dev = ctx_tokens.shape[1], ctx_tokens.device
    if parents is None:
        parents = (torch.arange(N, device=dev) - 1).expand(B, N)
    par = torch.where(torch.arange(N, device=dev).view(1, N) < lengths.view(B, 1), parents, -1)  # (B, N)
    anc = tree.ancestor_mask(par, lengths)  # (B, N, N): [node j, ancestor a], j itself included
    dep = tree.depths(par, lengths)  # (B, N), 0 for padding
    valid = dep > 0  # (B, N)
    W = T + N
    ext = torch.zeros(B, 1 + N, W + 1, dtype=torch.long, device=dev)  # (B, 1+N, W+1); column W: spare
    ext[:, :, :T] = ctx_tokens.unsqueeze(1)
    pos = ctx_len.view(B, 1) + dep - 1  # (B, N): where node a sits in its descendants' contexts
    write = anc & valid.unsqueeze(2) & valid.unsqueeze(1)  # (B, j, a)
    idx = torch.where(write, pos.unsqueeze(1).expand(B, N, N), W)  # (B, N, N)
    ext[:, 1:].scatter_(2, idx, torch.where(write, tokens.unsqueeze(1).expand(B, N, N), 0))
    extra = torch.cat([dep.new_zeros(B, 1), dep], dim=1)  # (B, 1+N) path length of each row
    lens = (ctx_len.view(B, 1) + extra).reshape(-1)  # (B (1+N),)
    new = (num_new.view(B, 1) + extra).reshape(-1)  # (B (1+N),)
    return ext[..., :W].reshape(B * (1 + N), W), lens, new


def apply_to_block(procs: Processors, logits: torch.Tensor, ctx_tokens: torch.Tensor, ctx_len: torch.Tensor,
                   num_new: torch.Tensor, tokens: torch.Tensor, parents: Optional[torch.Tensor],
                   lengths: torch.Tensor) -> torch.Tensor:
    """logits (B, 1+N, V) of a verify block -> the processed logits, each row on its own path."""
    B, Q, V = logits.shape
    toks, lens, new = path_contexts(ctx_tokens, ctx_len, num_new, tokens[:, :Q - 1],
                                    None if parents is None else parents[:, :Q - 1], lengths)
    return procs(toks, lens, new, logits.reshape(B * Q, V)).view(B, Q, V)
