"""Suffix trees of bounded depth with counts: SuffixDecoding's data structure (suffix.py drafts from it).

Oliaro, Jia, Campos, Qiao 2025, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications" (NeurIPS 2025, arXiv 2411.04975, Sec. 3). A suffix tree over a set of token sequences
holds every substring of length <= D (the tree depth, vLLM's `suffix_decoding_max_tree_depth`, 24)
as the path from the root; node N counts C(N), the occurrences of its string (the suffixes that pass
through or end at N: a root child's count is its token's frequency, the root's the number of tokens).

- Pattern match (Sec. 3.2): the context's last p tokens, walked from the root, for p = 1, 2, ..
  while they match; p is the match length.
- Drafting (Sec. 3.3): from the matched node, a token's probability is the product of
  C(child) / C(parent) along its path, D(N) = prod C(N_i) / C(N_{i-1}), an estimate of the chance
  the whole path is accepted; a draft's score is the sum of D(N) over its nodes, its expected
  number of accepted tokens. A path draft follows the most frequent child; a tree draft grows
  greedily, always adding the frontier node of largest D(N) (a priority queue). Nodes with
  D(N) < tau (min token probability, vLLM 0.1) are not drafted, and a draft holds at most
  MAX_SPEC = min(k, floor(alpha * p + offset)) tokens (alpha: vLLM's spec factor, 1.0; offset:
  ArcticInference's max_spec_offset, 0.0).
- Best match (ArcticInference's `SuffixTree::speculate`): every matched p in 1..min(T, D)-1 is
  drafted and the draft with the largest score wins, the longer match on a tie.

What we took from where (facts, our own code): the count semantics (a node counts the suffixes
that pass through it, the root every appended token), the path rule (the most frequent child, stop
below tau), the priority-queue tree rule, the ">=" tie rules and the range of p, from
ArcticInference's csrc/suffix_decoding/suffix_tree.cc; the defaults from vLLM's
`SpeculativeConfig` (config/speculative.py) and `SuffixDecodingProposer`.

How (ours): a trie with no path compression, depth <= D keeps it bounded (at most D nodes per
appended token), stored flat (SuffixTree: an edge dict and int64 arrays, no Python object per node). Appending a token to sequence s extends the <= D-1
open suffixes of s by one node each (ArcticInference's window of active nodes); removing s walks its
suffixes again and decrements, deleting the nodes that reach 0 (they form a chain: a node's count
bounds its children's). Ties between equally frequent children go to the newest. Pure
Python: a step costs O(D^2) dict look-ups per row (matching every p); measured here, a row with a
1,000-token prompt and a 280,000-node global tree: 0.44 ms a step, 33 ms to build the prompt's tree,
~140 bytes a node.
"""
from __future__ import annotations

import heapq
import itertools
from array import array
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Sequence


class Speculation(NamedTuple):
    """A draft from one suffix tree: tokens, parents (-1 for a child of the root, the context's last
    token), D(N) of each node, the score sum D(N), and the match length p it came from."""

    tokens: List[int]
    parents: List[int]
    probs: List[float]
    score: float
    match_len: int


EMPTY = Speculation([], [], [], 0.0, 0)
NODE_BYTES = 140  # memory per node, edge dict and arrays together (tracemalloc, 460,000-node tree: 139)
_SHIFT = 32  # an edge's key: parent id << 32 | token (token ids < 2^32)


class SuffixTree:
    """A depth-D suffix trie with counts over several sequences (ids: any hashable).

    Flat storage, no object per node (millions of small objects would make Python's cyclic garbage
    collector dominate the run time): node 0 is the root; `edges` maps parent << 32 | token to the
    child's id (a dict of ints, which the collector does not track); per node, in int64 arrays,
    its count C(N), token, first child and next sibling (children form a list, newest first)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.edges: Dict[int, int] = {}
        self.cnt, self.tok = array("q", [0]), array("q", [-1])  # C(N), token of each node
        self.head, self.nxt = array("q", [-1]), array("q", [-1])  # first child, next sibling
        self._free: List[int] = []  # ids of deleted nodes, reused
        self.seqs: Dict[object, List[int]] = {}
        self._open: Dict[object, List[int]] = {}  # per sequence: the nodes of its suffixes shorter
        # than D, longest first (the next token extends each of them)

    def copy(self) -> "SuffixTree":
        """An independent copy (rows with the same prompt start from one tree)."""
        new = SuffixTree(self.max_depth)
        new.edges = dict(self.edges)
        new.cnt, new.tok, new.head, new.nxt = (array("q", a) for a in (self.cnt, self.tok, self.head, self.nxt))
        new._free = list(self._free)
        new.seqs = {k: list(v) for k, v in self.seqs.items()}
        new._open = {k: list(v) for k, v in self._open.items()}
        return new

    @property
    def num_nodes(self) -> int:
        """Nodes below the root (the memory the caps bound)."""
        return len(self.cnt) - 1 - len(self._free)

    @property
    def total(self) -> int:
        """The root's count: tokens held."""
        return self.cnt[0]

    def _new_child(self, node: int, t: int) -> int:
        """A new child of node for token t (count 0), first in its parent's list."""
        if self._free:
            c = self._free.pop()
            self.cnt[c], self.tok[c], self.head[c] = 0, t, -1
        else:
            c = len(self.cnt)
            for a, v in ((self.cnt, 0), (self.tok, t), (self.head, -1), (self.nxt, -1)):
                a.append(v)
        self.nxt[c], self.head[node] = self.head[node], c
        self.edges[node << _SHIFT | t] = c
        return c

    def extend(self, seq_id, tokens: Sequence[int]) -> None:
        """Append tokens to sequence seq_id (created if new): every new suffix, up to depth D."""
        seq = self.seqs.setdefault(seq_id, [])
        open_ = self._open.setdefault(seq_id, [])
        D, cnt, edges = self.max_depth, self.cnt, self.edges
        for t in tokens:
            t = int(t)
            seq.append(t)
            cnt[0] += 1
            open_.append(0)  # the suffix that starts at this token (open_ holds depths 0..D-1)
            for i, node in enumerate(open_):
                c = edges.get(node << _SHIFT | t)
                if c is None:
                    c = self._new_child(node, t)
                cnt[c] += 1
                open_[i] = c
            if len(open_) == D:  # the longest suffix reached depth D: it grows no further
                del open_[0]

    def remove(self, seq_id) -> None:
        """Remove sequence seq_id: decrement its suffixes' counts, delete the nodes left at 0."""
        seq = self.seqs.pop(seq_id)
        self._open.pop(seq_id, None)
        D, cnt, edges = self.max_depth, self.cnt, self.edges
        cnt[0] -= len(seq)
        for start in range(len(seq)):
            node, end = 0, min(start + D, len(seq))
            for j in range(start, end):
                c = edges[node << _SHIFT | seq[j]]
                cnt[c] -= 1
                if cnt[c] == 0:  # this suffix alone held it: it and the chain below it go
                    self._unlink(node, c)
                    for jj in range(j, end):
                        c = edges.pop(node << _SHIFT | seq[jj])
                        self._free.append(c)
                        node = c
                    break
                node = c

    def _unlink(self, parent: int, c: int) -> None:
        """Take c out of its parent's list of children."""
        if self.head[parent] == c:
            self.head[parent] = self.nxt[c]
            return
        s = self.head[parent]
        while self.nxt[s] != c:
            s = self.nxt[s]
        self.nxt[s] = self.nxt[c]

    def children(self, node: int):
        """(token, child) pairs of a node, newest first."""
        c = self.head[node]
        while c >= 0:
            yield self.tok[c], c
            c = self.nxt[c]

    def count(self, pattern: Sequence[int]) -> int:
        """C(N) of the node of `pattern` (occurrences, for patterns of length <= D); 0 if absent."""
        node = self.match(pattern)
        return 0 if node is None else self.cnt[node]

    def match(self, pattern: Sequence[int]) -> Optional[int]:
        """The node of `pattern`, or None."""
        node, edges = 0, self.edges
        for t in pattern:
            node = edges.get(node << _SHIFT | int(t))
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], k: int, alpha: float, offset: float, tau: float,
                  tree: bool) -> Speculation:
        """The best-scoring draft over every match length p (module doc); EMPTY without a match."""
        ctx = list(context[-self.max_depth:])
        best = EMPTY
        for p in range(1, len(ctx)):
            node = self.match(ctx[len(ctx) - p:])
            if node is None:  # a longer pattern contains this one: no longer match either
                break
            n = max(min(k, int(p * alpha + offset + 1e-6)), 0)  # MAX_SPEC
            toks, par, probs = (self.draft_tree if tree else self.draft_path)(node, n, tau)
            score = sum(probs)
            if score >= best.score:
                best = Speculation(toks, par, probs, score, p)
        return best

    def draft_path(self, node: int, n: int, tau: float):
        """The most frequent child (ties: the newest), n times at most, while D(N) >= tau:
        (tokens, parents, probs)."""
        cnt, head, nxt = self.cnt, self.head, self.nxt
        toks: List[int] = []
        probs: List[float] = []
        prob = 1.0
        while len(toks) < n and head[node] >= 0:
            best, c = -1, head[node]
            while c >= 0:
                if best < 0 or cnt[c] > cnt[best]:
                    best = c
                c = nxt[c]
            prob *= cnt[best] / cnt[node]
            if prob < tau:
                break
            toks.append(self.tok[best])
            probs.append(prob)
            node = best
        return toks, list(range(-1, len(toks) - 1)), probs

    def draft_tree(self, node: int, n: int, tau: float):
        """Greedy expansion: the frontier node of largest D(N) >= tau joins, n nodes at most (ties:
        the first pushed). Nodes come out in topological order (a child after its parent)."""
        toks: List[int] = []
        parents: List[int] = []
        probs: List[float] = []
        heap: list = []
        order = itertools.count()  # ties: the first pushed

        def push(parent: int, parent_prob: float, parent_idx: int) -> None:
            for t, c in self.children(parent):
                prob = parent_prob * self.cnt[c] / self.cnt[parent]
                if prob >= tau:
                    heapq.heappush(heap, (-prob, next(order), t, c, parent_idx))

        push(node, 1.0, -1)
        while heap and len(toks) < n:
            neg, _, t, c, parent_idx = heapq.heappop(heap)
            toks.append(t)
            parents.append(parent_idx)
            probs.append(-neg)
            push(c, -neg, len(toks) - 1)
        return toks, parents, probs


class SuffixCache:
    """The global tree: earlier outputs of the workload, one sequence per request, with caps.

    Requests are numbered in arrival order. Eviction (ArcticInference's rule, FIFO, plus a node cap
    of ours): when more than `max_requests` requests are cached, or the tree holds more than
    `max_nodes` nodes, the oldest request that is not `protected` (still generating) is removed with
    all its suffixes. max_requests 0 turns the global tree off (vLLM's meaning)."""

    def __init__(self, max_depth: int, max_requests: int, max_nodes: Optional[int]):
        self.tree = SuffixTree(max_depth)
        self.max_requests, self.max_nodes = max_requests, max_nodes
        self._order: "OrderedDict[int, None]" = OrderedDict()  # cached request ids, oldest first
        self._next = 0
        self.evicted = 0  # requests evicted so far

    @property
    def enabled(self) -> bool:
        return self.max_requests != 0

    @property
    def requests(self) -> List[int]:
        return list(self._order)

    def start(self) -> Optional[int]:
        """A new request: its id (None when the global tree is off)."""
        if not self.enabled:
            return None
        rid = self._next
        self._next += 1
        self._order[rid] = None
        self.tree.seqs.setdefault(rid, [])
        return rid

    def extend(self, rid: Optional[int], tokens: Sequence[int]) -> None:
        if rid is not None and rid in self._order and len(tokens):
            self.tree.extend(rid, tokens)

    def memory(self) -> dict:
        """The global tree's size: nodes, tokens held, cached and evicted requests, and bytes
        (nodes x NODE_BYTES, the measured cost of a node)."""
        n = self.tree.num_nodes
        return dict(nodes=n, tokens=self.tree.total, requests=len(self._order), evicted=self.evicted,
                    bytes=n * NODE_BYTES)

    def _over(self) -> bool:
        return len(self._order) > self.max_requests or (
            self.max_nodes is not None and self.tree.num_nodes > self.max_nodes)

    def evict(self, protected=()) -> None:
        """Remove the oldest unprotected requests while a cap is exceeded."""
        if not self._over():
            return
        protected = set(protected)
        for rid in list(self._order):
            if not self._over():
                return
            if rid in protected:
                continue
            del self._order[rid]
            self.tree.remove(rid)
            self.evicted += 1
