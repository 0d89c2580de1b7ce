"""A static KV cache with per-row lengths, block writes, rollback and tree-path compaction.

Speculative decoding writes K+1 (chain) or 1+N (tree) key/value slots per verification and keeps
only the accepted ones (Leviathan et al. 2023; Miao et al. 2024, SpecInfer, for trees). This cache
implements transformers' `Cache` interface so that `model(..., cache=cache)` reads and writes it,
with three differences from transformers' StaticCache:

- a committed length PER ROW (`lengths`, (B,)): row b's committed tokens occupy slots
  0..lengths[b]-1 in order, so the slot of a committed token is its position id and a row's cache is
  exactly the cache of that row run alone (batch independence);
- a block of Q tokens is written at explicit slots (`begin_block`), normally lengths[b] + 0..Q-1;
  the caller passes the matching 4D attention mask and position ids (target.py builds them);
- rollback is a length change (`commit`): slots beyond a row's length are stale, masked out by the
  caller's attention mask, and overwritten by the next block; `commit_path` gathers an arbitrary
  subset of the freshly written slots (an accepted tree path) into contiguous slots first.

Invariant (tested): after every commit, slots 0..lengths[b]-1 of every layer equal a fresh prefill
of row b's committed tokens. Overflowing max_len raises before any state changes.
Each layer's keys and values live on the device of the layer that writes them (a model placed by
accelerate's device_map spreads the cache with it). Left out: sliding-window layers,
linear-attention (SSM) layers, offloading the cache itself, quantised caches.
"""
from __future__ import annotations

from typing import Optional

import torch

from .hf.compat import check_transformers

try:  # an incompatible transformers fails in SpecCache() with check_transformers' message, not here
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError:  # pragma: no cover - exercised only on an incompatible install
    Cache = CacheLayerMixin = object  # type: ignore[misc,assignment]


class _RowLayer(CacheLayerMixin):
    """One layer's keys/values (B, H, S, D), written at the owner's block slots."""

    is_compileable = True
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "SpecCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H = key_states.shape[:2]
        S = self.owner.max_len
        self.keys = key_states.new_zeros((B, H, S, key_states.shape[-1]))  # (B, H, S, Dk)
        self.values = value_states.new_zeros((B, H, S, value_states.shape[-1]))  # (B, H, S, Dv)
        self.device = key_states.device
        self.is_initialized = True
        if self.keys.is_cuda and not torch.compiler.is_compiling():  # (prefill is eager: here)
            torch._dynamo.mark_static_address(self.keys)  # written in place by compiled forwards:
            torch._dynamo.mark_static_address(self.values)  # CUDA graphs need fixed addresses

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.block_slots  # (B, Q)
        assert slots is not None and slots.shape[1] == key_states.shape[2], "begin_block() not called"
        slots = slots.to(key_states.device)  # a layer placed on another device (accelerate device_map)
        B, H, Q, Dk = key_states.shape
        idx_k = slots.view(B, 1, Q, 1).expand(B, H, Q, Dk)  # (B, H, Q, Dk)
        idx_v = slots.view(B, 1, Q, 1).expand(B, H, Q, value_states.shape[-1])  # (B, H, Q, Dv)
        self.keys.scatter_(2, idx_k, key_states)
        self.values.scatter_(2, idx_v, value_states)
        n = self.owner.attend_len
        if n is None:
            return self.keys, self.values  # (B, H, S, D) each; the caller's mask hides stale slots
        return self.keys[:, :, :n], self.values[:, :, :n]  # (B, H, n, D): slots >= n unused by all rows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.owner.max_len if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.owner.max_len

    def gather_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """keys[b, :, dst[b, j]] = keys[b, :, src[b, j]] for all j (all reads before writes)."""
        if not self.is_initialized:
            return
        src, dst = src.to(self.keys.device), dst.to(self.keys.device)
        for buf in (self.keys, self.values):
            B, H, _, D = buf.shape
            J = src.shape[1]
            moved = buf.gather(2, src.view(B, 1, J, 1).expand(B, H, J, D))  # (B, H, J, D)
            buf.scatter_(2, dst.view(B, 1, J, 1).expand(B, H, J, D), moved)


class SpecCache(Cache):
    """Static KV cache of `max_len` slots per row, with a committed length per row.

    Usage per verification: `begin_block(slots)` -> model forward with a 4D mask and position ids ->
    `commit(keep)` (chain: keep the first keep[b] block slots) or `commit_path(...)` (tree).
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, device: torch.device):
        check_transformers()  # the cache API this class relies on (compat.py); cached after one call
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = int(max_len)
        self.batch = int(batch_size)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.block_slots: Optional[torch.Tensor] = None  # (B, Q) slots of the block being written
        self.attend_len: Optional[int] = None  # forwards attend slots 0..attend_len-1 (None: all
        # max_len; a compiled forward needs the fixed size); set by the caller with its mask
        super().__init__(layers=[_RowLayer(self) for _ in range(num_layers)])

    # -- writing a block ---------------------------------------------------------------------
    def block_slots_for(self, width: int) -> torch.Tensor:
        """Slots lengths[b] + 0..width-1 for every row. -> (B, Q)."""
        ar = torch.arange(width, device=self.lengths.device)  # (Q,)
        return self.lengths.unsqueeze(1) + ar  # (B, Q)

    def begin_block(self, width: int, committed_max: Optional[int] = None) -> torch.Tensor:
        """Prepare to write a block of `width` tokens after each row's committed tokens.

        Raises ValueError before any state changes if a row would overflow max_len.
        committed_max: the longest row's committed length if the caller knows it on the host (the
        loop does: no device read then). Returns the slots (B, Q), also a chain block's position ids.
        """
        if committed_max is None:
            committed_max = int(self.lengths.max()) if self.batch else 0
        top = committed_max + width
        if top > self.max_len:
            raise ValueError(
                f"KV cache overflow: a block of {width} tokens after {committed_max} committed "
                f"tokens needs {top} slots, but max_len is {self.max_len}; allocate a larger cache")
        self.block_slots = self.block_slots_for(width)  # (B, Q)
        return self.block_slots

    def set_block_slots(self, slots: torch.Tensor) -> None:
        """Write the next block at explicit slots (B, Q) (compiled paths reuse a fixed-shape tensor)."""
        self.block_slots = slots

    # -- committing ------------------------------------------------------------------------------
    def commit(self, keep: torch.Tensor, validate: bool = True) -> None:
        """Chain: keep the first keep[b] slots of the block just written in row b (0 = roll back all).
        validate=False skips the check keep >= 0 (a device read) for callers that guarantee it."""
        keep = keep.to(self.lengths)
        if validate and bool((keep < 0).any()):
            raise ValueError(f"keep must be >= 0, got {keep.tolist()}")
        self.lengths += keep
        self.block_slots = None

    def commit_path(self, path: torch.Tensor, num: torch.Tensor) -> None:
        """Tree: keep block slots path[b, :num[b]] (offsets into the block just written, strictly
        increasing) by moving them to offsets 0..num[b]-1; then lengths[b] += num[b].

        path (B, J) long, entries beyond num[b] ignored; num (B,) long.
        """
        B, J = path.shape
        start = self.lengths.unsqueeze(1)  # (B, 1)
        ar = torch.arange(J, device=path.device)  # (J,)
        valid = ar.unsqueeze(0) < num.unsqueeze(1)  # (B, J)
        src = torch.where(valid, start + path.clamp(min=0), start + ar)  # (B, J)
        dst = start + ar  # (B, J)
        src = src.clamp(max=self.max_len - 1)
        dst = dst.clamp(max=self.max_len - 1)
        for layer in self.layers:
            layer.gather_slots(src, dst)
        self.lengths += num.to(self.lengths)
        self.block_slots = None

    def rollback_to(self, lengths: torch.Tensor) -> None:
        """Set every row's committed length (must not grow a row)."""
        lengths = lengths.to(self.lengths)
        if bool((lengths > self.lengths).any()) or bool((lengths < 0).any()):
            raise ValueError("rollback_to may only shorten rows, to a length >= 0")
        self.lengths.copy_(lengths)

    def write_rows(self, rows: torch.Tensor, src: "SpecCache") -> None:
        """Row rows[r] of this cache becomes row r of `src` (its committed slots, its length): a
        request prefilled alone (src, R rows) placed into the slots of the rows it takes (a batch
        scheduler's refill, scheduler.py); every other row untouched. rows (R,) long."""
        rows = rows.to(self.lengths.device)
        for mine, theirs in zip(self.layers, src.layers):
            if not theirs.is_initialized:
                continue  # src wrote nothing (prompts of one token: nothing to prefill)
            if not mine.is_initialized:  # this cache has not been written yet: allocate it whole
                k, v = theirs.keys, theirs.values  # (R, H, S', D)
                mine.lazy_initialization(k.new_zeros((self.batch, *k.shape[1:])), v.new_zeros((self.batch, *v.shape[1:])))
            n = min(theirs.keys.shape[2], self.max_len)
            r = rows.to(mine.keys.device)
            mine.keys[r, :, :n] = theirs.keys[:, :, :n].to(mine.keys)
            mine.values[r, :, :n] = theirs.values[:, :, :n].to(mine.values)
        self.lengths[rows] = src.lengths.to(self.lengths)

    # -- transformers Cache interface ------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.batch else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.max_len if self.attend_len is None else self.attend_len), 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_len

    def layer_kv(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys and values of one row at one layer: (H, lengths[row], D) each."""
        layer = self.layers[layer_idx]
        n = int(self.lengths[row])
        return layer.keys[row, :, :n], layer.values[row, :, :n]
