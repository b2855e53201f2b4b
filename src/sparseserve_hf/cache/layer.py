"""SparseServeLayer: one attention layer's KV as DRAM head-blocks plus a device tail block."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import ClassVar

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import SparseServeConfig
from ..ops import channels
from .grow import grown
from .plain import plain_tensors
from .store import TieredBlockStore

PROFILE_QUERIES = 64  # a prompt's last queries that make its row's query profile (those nearest to decode)


class SparseServeLayer(CacheLayerMixin):
    """KV of one layer for a batch of rows, in blocks of `block_size` tokens per KV head.

    Each row stores only its real tokens (padding never enters a block), compacted from its
    first real token. Full blocks live in the shared DRAM pool with their metadata on the
    device; the newest, partial block of every row stays on the device as the tail.

    `update` only stages the new K/V; the attention function commits them with `commit` once
    it knows (from the mask) which new tokens are real. A staged chunk left uncommitted means
    the model is not running `attn_implementation="sparseserve"`, which `update` reports.

    Every change is all or nothing: a `commit` that fails leaves the rows as they were, and
    `undo_update` takes back the last `update` (staged or committed) when a later step of the
    same forward fails (see `ForwardLog`). State tensors are plain tensors (`plain_tensors`),
    so the layer works inside and outside `torch.inference_mode` alike.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        layer_idx: int,
        config: SparseServeConfig,
        store_for: Callable[[torch.Tensor], TieredBlockStore],
        first_partition: int = 0,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.first_partition = first_partition  # HBM cache partition of KV head 0 (see `TieredBlockStore.fetch`)
        self.config = config
        self._store_for = store_for
        self.store: TieredBlockStore | None = None
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.num_positions = 0  # HF positions seen, padding included: what get_seq_length reports
        self.tail: torch.Tensor | None = None  # (B, Hkv, 2, S, D) newest 1..S tokens per row
        self.tail_len: torch.Tensor | None = None  # (B,) tokens in each tail
        self.block_ids: torch.Tensor | None = None  # (B, Hkv, N) DRAM ids of full blocks, -1 unused
        # (B, Hkv, D) each row's query profile, for a scorer that weighs a block's channels by it
        # (`Scorer.uses_query_profile`; None otherwise): its last prompt's, zero before one.
        self.query_profile: torch.Tensor | None = None
        self.num_blocks: torch.Tensor | None = None  # (B,) full blocks per row
        # The last decode step's exact numbers for a scorer that takes them (`Scorer.uses_feedback`;
        # None otherwise, and before a first sparse step): the table positions each KV head loaded
        # (B, Hkv, U) and each query head's exact log-sum-exp over each of them (B, Hq, U), -inf for
        # none (a row that has not decoded since it came). Rows move with their rows; a captured step
        # reads and rewrites them in place.
        self.feedback_picked: torch.Tensor | None = None
        self.feedback_lse: torch.Tensor | None = None
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None
        # What `undo_update` takes back: the last update's new positions, the tokens it stored per
        # row once committed, and whether it initialized the layer. None: nothing to undo.
        self._undo: _Undo | None = None
        self._known_counts: tuple[tuple, tuple[list[int], list[int]]] | None = None  # see _host_counts
        # The last decode step's pick: per-KV-head block indices (B, Hkv, U), their validity, which
        # of them each query head attends to ((B, Hq, U), None = all) and the GQA group size.
        self.last_pick: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int] | None = None

    # ---- HF cache contract -------------------------------------------------------------

    @plain_tensors
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Size the tail blocks and block table from the first `update`'s (B, Hkv, S, D) keys."""
        batch, num_kv_heads, _, head_dim = key_states.shape
        self.store = self._store_for(key_states)
        self.device, self.dtype = key_states.device, key_states.dtype
        size = self.config.block_size
        self.tail = torch.zeros((batch, num_kv_heads, 2, size, head_dim), dtype=self.dtype, device=self.device)
        self.tail_len = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.block_ids = torch.full((batch, num_kv_heads, 16), -1, dtype=torch.long, device=self.device)
        self.num_blocks = torch.zeros(batch, dtype=torch.long, device=self.device)
        if self.store.scorer.uses_query_profile():
            self.query_profile = torch.zeros((batch, num_kv_heads, head_dim), dtype=torch.float32, device=self.device)
        self.is_initialized = True

    @plain_tensors
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage (B, Hkv, T, D) new keys/values for the attention function; returns them unchanged."""
        self._undo = None
        if self.staged is not None:
            self._drop_staged()  # never attended: its positions must not count
            raise RuntimeError(
                f"SparseServeCache layer {self.layer_idx} received new keys before the previous ones were "
                "attended: load the model with attn_implementation='sparseserve' (import sparseserve_hf first)"
            )
        if self.is_initialized and (
            key_states.shape[0] != self.tail.shape[0] or key_states.shape[1] != self.tail.shape[1]
        ):
            raise ValueError(
                f"SparseServeCache holds {self.tail.shape[0]} rows x {self.tail.shape[1]} KV heads, got keys "
                f"of shape {tuple(key_states.shape)}; call cache.reset() before a new batch"
            )
        initializes = not self.is_initialized
        if initializes:
            self.lazy_initialization(key_states, value_states)
        self.staged = (key_states, value_states)
        self.num_positions += key_states.shape[-2]
        self._undo = _Undo(key_states.shape[-2], initializes)
        return key_states, value_states

    def _drop_staged(self) -> None:
        """Forget staged keys and the positions `update` counted for them."""
        self.num_positions -= self.staged[0].shape[-2]
        self.staged = None

    @plain_tensors
    def undo_update(self) -> None:
        """Take back the last `update`, staged or committed: lengths, blocks and positions as before it.

        Called when a later step of the same forward fails (another layer, or this layer's
        attention), so that no layer keeps tokens the others do not have. A no-op when anything
        else changed the layer since (reset, crop, row moves, a newer update).
        """
        undo, self._undo = self._undo, None
        if undo is None:
            return
        if undo.initialized:  # the update made this layer: back to empty, blocks freed
            self.reset()
            return
        if not undo.committed:
            if self.staged is not None:
                self._drop_staged()
            return
        added = [undo.num_new] * self.tail.shape[0] if undo.added is None else undo.added.tolist()
        lengths = self.row_lengths().tolist()
        # A vacant row (it holds nothing: `SparseServeCache.take_rows`) took no token from a static
        # commit, which counts every row as taking one: it stays empty, never cut below nothing.
        self._truncate_rows([(row, max(lengths[row] - added[row], 0)) for row in range(len(lengths))])
        self.num_positions -= undo.num_new
        self.query_profile = undo.profile
        self.last_pick = None
        if self.feedback_lse is not None:  # the undone step's numbers: every row starts over
            self.feedback_lse.fill_(float("-inf"))

    def get_seq_length(self) -> int:
        """Positions cached so far, left padding included (what HF builds positions from)."""
        return self.num_positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for HF's mask: every cached position plus the query, no offset."""
        return self.num_positions + query_length, 0

    def get_max_length(self) -> int:
        """-1: unbounded (the block pool grows unless `dram_bytes` fixes its size)."""
        return -1

    @plain_tensors
    def reset(self) -> None:
        """Free this layer's DRAM blocks back to the store and forget every position."""
        if self.is_initialized and self.store is not None:
            self.store.free(self.block_ids.flatten())
        self._clear()

    def offload(self) -> None:
        """Nothing to do: full blocks already live in DRAM."""

    def prefetch(self) -> None:
        """Nothing to do: selected blocks are fetched at attention time."""

    @plain_tensors
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest `tokens_to_remove` positions (negative values count the same way)."""
        if not isinstance(tokens_to_remove, numbers.Integral) or isinstance(tokens_to_remove, bool):
            raise TypeError(f"tokens_to_remove must be an int, got {type(tokens_to_remove).__name__}")
        remove = abs(int(tokens_to_remove))
        if not self.is_initialized or remove == 0:
            return
        self._undo = None
        lengths = self.row_lengths().tolist()
        self._truncate_rows([(row, max(length - remove, 0)) for row, length in enumerate(lengths)])
        self.num_positions = max(self.num_positions - remove, 0)

    @plain_tensors
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Make row i a copy of old row `indices[i]`: rows may repeat (they then share blocks) or go."""
        if not self.is_initialized:
            return
        indices = torch.as_tensor(indices, device=self.device).flatten()
        if indices.dtype in (torch.bool, torch.uint8) or indices.is_floating_point() or indices.is_complex():
            raise TypeError(f"indices must be integer row indices, got dtype {indices.dtype}")
        # Every new tensor first (a bad index raises here): only then do references and rows change.
        selected = self.block_ids[indices]
        tail, tail_len, num_blocks = self.tail[indices], self.tail_len[indices], self.num_blocks[indices]
        profile = None if self.query_profile is None else self.query_profile[indices]
        feedback = self._feedback_rows(indices)
        self.store.retain(selected)  # before freeing, so kept blocks never reach zero references
        self.store.free(self.block_ids)
        self.block_ids, self.tail, self.tail_len, self.num_blocks = selected, tail, tail_len, num_blocks
        self.query_profile = profile
        self.feedback_picked, self.feedback_lse = feedback
        self._undo, self.last_pick = None, None

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (e.g. for several returned sequences)."""
        if not isinstance(repeats, numbers.Integral) or isinstance(repeats, bool) or repeats <= 0:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.tail.shape[0], device=self.device).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues from old row `beam_idx[i]`; shared pasts share their blocks."""
        self.batch_select_indices(beam_idx)

    # ---- a shared prompt prefix (the batching Generator's prefix cache) --------------------

    @plain_tensors
    def adopt_blocks(self, ids: torch.Tensor, like: torch.Tensor) -> None:
        """Start this empty layer as one row holding the full blocks `ids` (Hkv, m), already in the
        store (another request's prompt prefix): one more reference to each, m * block_size
        positions, an empty tail. `like`: a (1, Hkv, 0, D) key tensor of the cache's dtype and device."""
        if self.is_initialized:
            raise RuntimeError(f"SparseServeCache layer {self.layer_idx}: adopt_blocks needs an empty layer")
        self.lazy_initialization(like, like)
        count = ids.shape[1]
        self._ensure_capacity(count)
        self.block_ids[0, :, :count] = ids.to(self.device)
        self.num_blocks.fill_(count)
        self.store.retain(ids)
        self.num_positions = count * self.config.block_size
        self._known_counts = (self._counts_stamp(), ([count], [0]))

    # ---- moving rows between caches over one store (the batching Generator) ---------------

    @plain_tensors
    def append_rows(self, other: SparseServeLayer) -> None:
        """Move every row of `other` (a layer over the same store) after this layer's rows.

        Block references move with the rows: nothing is copied to or freed from the store, and
        `other` is left empty. `num_positions` becomes the longer of the two. Checked and built
        before anything moves: a refusal leaves both layers as they were.
        """
        if not other.is_initialized:
            return
        self.check_can_append(other)
        if not self.is_initialized:
            self.store, self.device, self.dtype = other.store, other.device, other.dtype
            self.tail, self.tail_len, self.block_ids, self.num_blocks = (
                other.tail,
                other.tail_len,
                other.block_ids,
                other.num_blocks,
            )
            self.query_profile = other.query_profile
            self.feedback_picked, self.feedback_lse = other.feedback_picked, other.feedback_lse
            self.is_initialized = True
        else:
            width = max(self.block_ids.shape[2], other.block_ids.shape[2])
            block_ids = torch.cat(
                (grown(self.block_ids, width, fill=-1, dim=2), grown(other.block_ids, width, fill=-1, dim=2))
            )  # (B + B', Hkv, N)
            tail = torch.cat((self.tail, other.tail))
            tail_len = torch.cat((self.tail_len, other.tail_len))
            num_blocks = torch.cat((self.num_blocks, other.num_blocks))
            profile = None if self.query_profile is None else torch.cat((self.query_profile, other.query_profile))
            feedback = _joined_feedback(self, other)
            self.block_ids, self.tail, self.tail_len, self.num_blocks = block_ids, tail, tail_len, num_blocks
            self.query_profile = profile
            self.feedback_picked, self.feedback_lse = feedback
        self.num_positions = max(self.num_positions, other.num_positions)
        self.last_pick, self._undo = None, None
        other._clear()

    def check_can_append(self, other: SparseServeLayer) -> None:
        """Raise unless `append_rows(other)` can move `other`'s rows here (changes nothing)."""
        if not isinstance(other, SparseServeLayer):
            raise TypeError(f"append_rows takes a SparseServeLayer, got {type(other).__name__}")
        if not other.is_initialized:
            return
        if self.staged is not None or other.staged is not None:
            raise RuntimeError(f"layer {self.layer_idx}: rows cannot move while new keys are staged")
        if self.store is not None and other.store is not self.store:
            raise ValueError(f"layer {self.layer_idx}: rows can only move between caches that share one store")
        if self.is_initialized and (
            self.tail.shape[1:] != other.tail.shape[1:] or (self.dtype, self.device) != (other.dtype, other.device)
        ):
            raise ValueError(
                f"layer {self.layer_idx}: rows of tails {tuple(other.tail.shape[1:])} {other.dtype} cannot join "
                f"rows of {tuple(self.tail.shape[1:])} {self.dtype}"
            )

    @plain_tensors
    def pop_rows(self, rows: list[int], into: SparseServeLayer) -> None:
        """Move `rows` (in that order) into the empty layer `into`; the other rows stay, in order.

        Block references move with the rows. The caller (`SparseServeCache.pop_rows`) sets both
        layers' `num_positions` to their longest row's stored length (rows moved hold no padding).
        """
        if into.is_initialized:
            raise ValueError(f"layer {self.layer_idx}: pop_rows needs an empty target layer")
        if not self.is_initialized or not rows:
            return
        self.check_rows(rows)
        batch, leaving = self.tail.shape[0], set(rows)
        taken = torch.tensor(rows, dtype=torch.long, device=self.device)
        kept = torch.tensor([r for r in range(batch) if r not in leaving], dtype=torch.long, device=self.device)
        # Both sides' tensors first, then the assignments: no row is ever in both layers or in neither.
        moved = self.tail[taken], self.tail_len[taken], self.block_ids[taken], self.num_blocks[taken]
        stay = self.tail[kept], self.tail_len[kept], self.block_ids[kept], self.num_blocks[kept]
        profiles = (None, None) if self.query_profile is None else (self.query_profile[taken], self.query_profile[kept])
        feedback_moved, feedback_stay = self._feedback_rows(taken), self._feedback_rows(kept)
        into.store, into.device, into.dtype = self.store, self.device, self.dtype
        into.tail, into.tail_len, into.block_ids, into.num_blocks = moved
        into.query_profile = profiles[0]
        into.feedback_picked, into.feedback_lse = feedback_moved
        into.is_initialized = True
        if kept.numel() == 0:
            self._clear()
            return
        self.tail, self.tail_len, self.block_ids, self.num_blocks = stay
        self.query_profile = profiles[1]
        self.feedback_picked, self.feedback_lse = feedback_stay
        self.last_pick, self._undo = None, None

    # ---- slots: rows that keep their place (the batching Generator's batch cache) -----------

    @plain_tensors
    def place_rows(self, other: SparseServeLayer, slots: torch.Tensor, rows: int) -> None:
        """Move every row of `other` into `slots` (R,) (its row i into slots[i]; long, on this layer's
        device), rows of this layer that hold nothing, and keep `rows` rows (new ones hold nothing).
        `other` is left empty. The caller (`SparseServeCache.place_rows`) checked the slots and
        `check_can_append` for every layer before any row moved.

        The rows already here stay in place, in the same tensors unless the layer grows (more
        rows or a wider table): a decode step captured over them stays valid. Block references
        move with the rows.
        """
        if not other.is_initialized:
            return
        width = max(other.block_ids.shape[2], self.block_ids.shape[2] if self.is_initialized else 0)
        if not self.is_initialized:
            self.store, self.device, self.dtype = other.store, other.device, other.dtype
            self.tail, self.tail_len, self.num_blocks = other.tail[:0], other.tail_len[:0], other.num_blocks[:0]
            self.block_ids = other.block_ids[:0]
            self.query_profile = None if other.query_profile is None else other.query_profile[:0]
            self.is_initialized = True
        self.resize_rows(rows)
        self.block_ids = grown(self.block_ids, width, fill=-1, dim=2)
        self.tail[slots] = other.tail
        self.tail_len[slots] = other.tail_len
        self.num_blocks[slots] = other.num_blocks
        self.block_ids[slots] = grown(other.block_ids, width, fill=-1, dim=2)
        if self.query_profile is not None:
            self.query_profile[slots] = other.query_profile
        self._place_feedback(other, slots)
        self.num_positions = max(self.num_positions, other.num_positions)
        self.last_pick, self._undo = None, None
        other._clear()

    @plain_tensors
    def take_rows(self, slots: torch.Tensor, into: SparseServeLayer, rows: int) -> None:
        """Move the rows at `slots` (R,) (in that order; long, on this layer's device) into the empty
        layer `into`; those slots then hold nothing, and this layer keeps `rows` rows (the caller,
        `SparseServeCache.take_rows`, checked the slots and drops only rows that hold nothing, and
        sets both layers' `num_positions`).

        The rows that stay keep their place, in the same tensors unless the layer shrinks.
        """
        if into.is_initialized:
            raise ValueError(f"layer {self.layer_idx}: take_rows needs an empty target layer")
        if not self.is_initialized or slots.numel() == 0:
            return
        into.store, into.device, into.dtype = self.store, self.device, self.dtype
        into.tail, into.tail_len, into.block_ids = self.tail[slots], self.tail_len[slots], self.block_ids[slots]
        into.num_blocks = self.num_blocks[slots]
        into.query_profile = None if self.query_profile is None else self.query_profile[slots]
        into.feedback_picked, into.feedback_lse = self._feedback_rows(slots)
        into.is_initialized = True
        # Emptied in place; the tail's old tokens stay unread behind a zero length.
        self.tail_len.index_fill_(0, slots, 0)
        self.num_blocks.index_fill_(0, slots, 0)
        self.block_ids.index_fill_(0, slots, -1)
        if self.query_profile is not None:
            self.query_profile.index_fill_(0, slots, 0)
        self._forget_feedback(slots)
        if rows == 0:
            self._clear()
            return
        self.resize_rows(rows)
        self.last_pick, self._undo = None, None

    def resize_rows(self, rows: int) -> None:
        """Make the layer exactly `rows` rows: new rows hold nothing, dropped ones must hold nothing."""
        have = self.tail.shape[0]
        if rows > have:
            self.tail = grown(self.tail, rows, dim=0)
            self.tail_len, self.num_blocks = grown(self.tail_len, rows), grown(self.num_blocks, rows)
            self.block_ids = grown(self.block_ids, rows, fill=-1, dim=0)
            self.query_profile = None if self.query_profile is None else grown(self.query_profile, rows)
            if self.feedback_lse is not None:
                self.feedback_picked = grown(self.feedback_picked, rows, dim=0)
                self.feedback_lse = grown(self.feedback_lse, rows, fill=float("-inf"), dim=0)
        elif rows < have:
            self.tail, self.tail_len = self.tail[:rows].clone(), self.tail_len[:rows].clone()
            self.num_blocks, self.block_ids = self.num_blocks[:rows].clone(), self.block_ids[:rows].clone()
            self.query_profile = None if self.query_profile is None else self.query_profile[:rows].clone()
            if self.feedback_lse is not None:
                self.feedback_picked = self.feedback_picked[:rows].clone()
                self.feedback_lse = self.feedback_lse[:rows].clone()

    def check_rows(self, rows: list[int]) -> None:
        """Raise unless `rows` are distinct int indices of this layer's rows and may move now (changes nothing)."""
        if self.staged is not None:
            raise RuntimeError(f"layer {self.layer_idx}: rows cannot move while new keys are staged")
        batch = self.tail.shape[0] if self.is_initialized else 0
        if (
            not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
            or len(set(rows)) != len(rows)
            or not all(0 <= r < batch for r in rows)
        ):
            raise ValueError(f"rows {rows!r} are not distinct int indices of the cache's {batch} rows")

    # ---- block bookkeeping used by the attention function --------------------------------

    @property
    def last_selection(self) -> torch.Tensor | None:
        """(B, Hq, U) block indices each query head attended to at the last decode step, -1 elsewhere."""
        if self.last_pick is None:
            return None
        picked, valid, head_mask, group = self.last_pick
        attended = valid.repeat_interleave(group, dim=1)
        if head_mask is not None:
            attended = attended & head_mask
        return torch.where(attended, picked.repeat_interleave(group, dim=1), -1)

    @plain_tensors  # called from the attention function, often under inference mode
    def remember_pick(self, picked: torch.Tensor, num_q_heads: int) -> None:
        """Keep this step's pick (B, Hkv, U) in place for the next step's scorer (where the store
        `feeds_back`), and make sure `feedback_lse` is the (B, Hq, U) tensor this step's attention
        writes its exact log-sum-exps into (the scorer has read the last step's already)."""
        lse_shape = (picked.shape[0], num_q_heads, picked.shape[2])
        if self.feedback_lse is None or self.feedback_lse.shape != lse_shape:
            self.feedback_picked = torch.zeros_like(picked)
            self.feedback_lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=picked.device)
        self.feedback_picked.copy_(picked)

    def _feedback_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The feedback tensors' `rows` (copies), or (None, None) where there are none."""
        if self.feedback_lse is None:
            return None, None
        return self.feedback_picked[rows], self.feedback_lse[rows]

    def _place_feedback(self, other: SparseServeLayer, slots: torch.Tensor) -> None:
        """`other`'s rows' last-step numbers into `slots`: a row that sat out resumes from its own, as
        it would have decoded alone; rows with none (new ones) start without."""
        if other.feedback_lse is None:
            self._forget_feedback(slots)
            return
        if self.feedback_lse is None or self.feedback_lse.shape[1:] != other.feedback_lse.shape[1:]:
            self.feedback_picked, self.feedback_lse = _no_feedback(other, self.tail.shape[0])
        self.feedback_picked[slots] = other.feedback_picked
        self.feedback_lse[slots] = other.feedback_lse

    def _forget_feedback(self, slots: torch.Tensor) -> None:
        """Rows at `slots` start over without the last step's numbers (in place: a captured step keeps them)."""
        if self.feedback_lse is not None:
            self.feedback_lse.index_fill_(0, slots, float("-inf"))

    def _observe_prompt(self, query: torch.Tensor, real: torch.Tensor | None) -> None:
        """Each row's query profile from a prompt's (B, Hq, T, D) queries (`real` (B, T) marks real
        tokens): their last positions' |q| (`channels.query_profile`); a row with none keeps its own."""
        if self.query_profile is None:
            return
        seen = channels.query_profile(query, self.tail.shape[1], PROFILE_QUERIES, real)  # (B, Hkv, D)
        self.query_profile = torch.where(seen.sum(-1, keepdim=True) > 0, seen, self.query_profile)

    def row_lengths(self) -> torch.Tensor:
        """(B,) real tokens stored per row."""
        return self.num_blocks * self.config.block_size + self.tail_len

    @plain_tensors
    def commit(
        self, valid: torch.Tensor | None, prompt_queries: torch.Tensor | None = None, static: bool = False
    ) -> None:
        """Store the staged tokens; `valid` (B, T) marks real tokens (None: all are real).
        `prompt_queries`: a prompt's (B, Hq, T, D) queries, which set each row's query profile
        (`_observe_prompt`) before its blocks are saved. `static`: the cache's static step
        (`SparseServeCache.static_step`): its caller rolled every full tail before the step and feeds
        one real token per row, so the commit only appends.

        All or nothing: when it fails, the rows, positions and profiles are as before the `update`.
        """
        if self.staged is None:
            raise RuntimeError(f"SparseServeCache layer {self.layer_idx}: commit without staged keys")
        keys, values = self.staged
        self.staged = None
        undo, self._undo = self._undo, None
        profile = self.query_profile
        try:
            if prompt_queries is not None:
                self._observe_prompt(prompt_queries, valid)
            added = self._store(keys, values, valid, empty=undo is not None and undo.initialized, static=static)
        except BaseException:
            self.query_profile = profile
            self.num_positions -= keys.shape[-2]
            if undo is not None and undo.initialized:
                self.reset()  # the failed update made the layer: nothing of it may stay
            raise
        if undo is not None:
            self._undo = _Undo(undo.num_new, undo.initialized, committed=True, added=added, profile=profile)

    def _store(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor | None,
        empty: bool = False,
        static: bool = False,
    ) -> torch.Tensor | None:
        """Append the new tokens; returns (B,) tokens appended per row, None when every row took all T.

        `empty`: every row is known to hold nothing yet (the update made the layer), so no row's
        lengths are read back from the device: a prompt's commit then waits for no kernel.
        `static`: as in `commit`."""
        if static:
            # Graph mode: the decoder feeds one real token per row and never reads `valid`
            # (a mask HF builds while a CUDA graph captures holds no values yet, and reading it syncs).
            self._known_counts = None  # the kernel below changes tail_len without a version bump
            # Every tail has room; a row that holds nothing is a vacant slot (`take_rows`) and stays empty.
            self.store.ops.append_token(self.tail, self.tail_len, keys, values, self.num_blocks)
            return None
        if keys.shape[-2] == 1 and (valid is None or bool(valid.all())):  # a prompt never reads `valid` here
            self._append_token(keys, values)
            return None
        before = self.row_lengths()  # (B,) on the device: read back only to roll a failure back
        batch = keys.shape[0]
        blocks, tails = ([0] * batch, [0] * batch) if empty else map(list, self._host_counts())
        for row in range(batch):
            take = slice(None) if valid is None else valid[row]
            new = torch.stack((keys[row][:, take], values[row][:, take]), dim=1)  # (Hkv, 2, t, D)
            try:
                self._append_row(row, new, blocks, tails)
            except BaseException:
                lengths = before.tolist()
                self._truncate_rows([(done, lengths[done]) for done in range(row + 1)])  # `row` may be half done
                raise
        return None if valid is None else valid.sum(dim=-1)  # not `valid` itself: it may view a whole mask

    def past(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All stored tokens, left-aligned: keys, values (B, Hkv, L, D) and valid (B, L)."""
        lengths = self.row_lengths()
        batch, num_kv_heads, _, _, head_dim = self.tail.shape
        longest = int(lengths.max())
        keys = torch.zeros((batch, num_kv_heads, longest, head_dim), dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        for row in range(batch):
            tokens = self._row_tokens(row)  # (Hkv, 2, n, D)
            keys[row, :, : tokens.shape[2]] = tokens[:, 0]
            values[row, :, : tokens.shape[2]] = tokens[:, 1]
        valid = torch.arange(longest, device=self.device) < lengths[:, None]
        return keys, values, valid

    @plain_tensors  # the buffer is written in place by the store, outside inference mode
    def past_with(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-row layer's stored tokens followed by new keys/values (1, Hkv, T, D): keys and
        values (1, Hkv, L + T, D), built in one buffer (the prefill over a stored past).

        The full blocks go from DRAM straight to their token positions (`TieredBlockStore.read_tokens`),
        then the tail and the new tokens: no stacked copy of the past to concatenate, and no
        read-back where the row's block and tail counts are known on the host (`_host_counts`)."""
        if self.tail.shape[0] != 1:
            raise ValueError(f"past_with reads one row, the layer holds {self.tail.shape[0]}")
        (count,), (held,) = self._host_counts()
        _, num_kv_heads, _, size, head_dim = self.tail.shape
        start, total = count * size + held, count * size + held + keys.shape[2]
        buffer = torch.empty(
            (2, num_kv_heads, -(-total // size) * size, head_dim), dtype=self.dtype, device=self.device
        )
        self.store.read_tokens(self.block_ids[0, :, :count], buffer)
        buffer[:, :, count * size : start] = self.tail[0, :, :, :held].transpose(0, 1)  # (2, Hkv, held, D)
        buffer[0, :, start:total] = keys[0]
        buffer[1, :, start:total] = values[0]
        return buffer[0, None, :, :total], buffer[1, None, :, :total]

    def _host_counts(self) -> tuple[list[int], list[int]]:
        """Every row's full blocks and tail tokens on the host: the copy kept where this layer made
        or read the last change to them (an eager commit, `adopt_blocks`, a read-back), else read back
        now. The lists are the copy itself: a caller copies them before changing them.

        Known counts hold while `num_blocks` and `tail_len` are the same tensors at the same in-place
        versions. A kernel or a graph replay changes them without a version bump: `_append_token`
        records what its kernel did, and a caller that replays graphs forgets them (`forget_host_counts`)."""
        stamp, known = self._counts_stamp(), self._known_counts
        held = known is not None and known[0][0] is stamp[0] and known[0][1] is stamp[1]  # tensors: `==` is by value
        if held and None not in stamp[2:] and known[0][2:] == stamp[2:]:
            return known[1]
        blocks, tails = self._read_counts()
        self._known_counts = (stamp, (blocks, tails))
        return blocks, tails

    def _counts_stamp(self) -> tuple[torch.Tensor, torch.Tensor, int | None, int | None]:
        """What known counts hold for: the tensors `num_blocks` and `tail_len` and their in-place versions."""
        return self.num_blocks, self.tail_len, _version(self.num_blocks), _version(self.tail_len)

    def _read_counts(self) -> tuple[list[int], list[int]]:
        """Every row's (full blocks, tail tokens), in one read-back (a host sync on CUDA)."""
        blocks, tails = torch.stack((self.num_blocks, self.tail_len)).tolist()
        return blocks, tails

    def _row_tokens(self, row: int) -> torch.Tensor:
        """(Hkv, 2, n, D) every stored token of one row, oldest first."""
        count = int(self.num_blocks[row])
        num_kv_heads, _, size, head_dim = self.tail.shape[1:]
        blocks = self.store.read(self.block_ids[row, :, :count].flatten())  # (Hkv*n, 2, S, D)
        blocks = blocks.view(num_kv_heads, count, 2, size, head_dim).permute(0, 2, 1, 3, 4)
        full = blocks.reshape(num_kv_heads, 2, count * size, head_dim)
        return torch.cat((full, self.tail[row, :, :, : int(self.tail_len[row])]), dim=2)

    def _append_token(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Decode fast path: full tails go to DRAM first (`roll_full_tails`), then one token per row
        joins its tail. The counts stay known on the host (`_host_counts`): no read-back in steady decode."""
        blocks, tails = self._host_counts()
        full = {row for row, length in enumerate(tails) if length == self.config.block_size}
        if full:  # host work (DRAM allocation), once per block_size tokens of a row
            self.roll_full_tails(sorted(full), table_width=max(blocks) + 1)
            blocks = [count + (row in full) for row, count in enumerate(blocks)]
        self._known_counts = None  # until the kernel below is launched: it bumps no version
        self.store.ops.append_token(self.tail, self.tail_len, keys, values)
        tails = [1 if row in full else length + 1 for row, length in enumerate(tails)]
        self._known_counts = (self._counts_stamp(), (blocks, tails))

    @plain_tensors
    def roll_full_tails(self, rows: list[int], table_width: int | None = None) -> None:
        """Save the full tail blocks of `rows` to DRAM and empty those tails (eager: host allocation).

        Saving a full tail only when the next token arrives keeps the current token in the tail,
        which sparse decode always attends. `table_width`: the table width the rows need
        afterwards, known on the host (the static step's caller, or the decode's host copy of the
        counts); None reads it from the device (one sync).
        """
        if not rows:
            return
        full_rows = torch.tensor(rows, device=self.device)
        width = self.reserve_table(table_width)  # before the save: nothing may fail between save and link
        blocks, profile = self.full_tails(full_rows)
        ids = self.store.save(blocks, profile=profile)
        try:
            self.link_saved_tails(full_rows, ids, width)
        except BaseException:
            self.store.free(ids)  # in no table: nobody else would ever give them back
            raise

    def reserve_table(self, table_width: int | None = None) -> int:
        """Grow the block table to hold one more block per row (or to `table_width`); returns the width.

        `roll_full_tails` calls it before saving, so that linking the saved ids cannot fail.
        """
        width = int(self.num_blocks.max()) + 1 if table_width is None else table_width
        self._ensure_capacity(width)
        return width

    def full_tails(self, full_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(R*Hkv, 2, S, D) the tail blocks of rows `full_rows` (R,), head-major per row, and their
        query profiles (R*Hkv, D) (None without profiles): what `TieredBlockStore.save` takes."""
        profile = None if self.query_profile is None else self.query_profile[full_rows].flatten(0, 1)
        return self.tail[full_rows].flatten(0, 1), profile

    @plain_tensors
    def link_saved_tails(self, full_rows: torch.Tensor, ids: torch.Tensor, table_width: int | None = None) -> None:
        """Append the saved tails' DRAM ids (R*Hkv,) to the rows' tables and empty their tails."""
        self.reserve_table(table_width)
        self._undo = None
        self.block_ids[full_rows, :, self.num_blocks[full_rows]] = ids.view(-1, self.tail.shape[1])
        self.num_blocks[full_rows] += 1
        self.tail_len.index_fill_(0, full_rows, 0)  # not `[rows] = 0`: a Python scalar through an index syncs

    # What a captured step's feedback tensors hold for rows with no numbers of their own (a row that
    # came, or a batch whose last step fed nothing back): nothing raised.
    GRAPH_EMPTY: ClassVar[dict[str, float]] = {"feedback_picked": 0, "feedback_lse": float("-inf")}

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors a captured decode step reads or writes by address (`GRAPH_EMPTY` says
        what those the layer may lack hold when it does)."""
        tensors = {
            "tail": self.tail,
            "tail_len": self.tail_len,
            "block_ids": self.block_ids,
            "num_blocks": self.num_blocks,
        }
        if self.feedback_lse is not None:
            tensors |= {"feedback_picked": self.feedback_picked, "feedback_lse": self.feedback_lse}
        return tensors

    @plain_tensors
    def move_into(self, held: dict[str, torch.Tensor]) -> None:
        """Make the tensors `held` (what an earlier `graph_tensors` returned, as a captured step holds
        them) this layer's own again, with its rows' current values: copied in where they are other
        tensors, the `GRAPH_EMPTY` values where the rows have none of them (no numbers fed back yet)."""
        for name, tensor in held.items():
            current = getattr(self, name)
            if current is tensor:
                continue
            if current is None:
                tensor.fill_(self.GRAPH_EMPTY[name])
            else:
                tensor.copy_(current)
            setattr(self, name, tensor)

    def forget_host_counts(self) -> None:
        """Drop the host copy of the block and tail counts, so the next eager step reads them back.

        A CUDA-graph replay advances `tail_len` without bumping its version, so after one the
        copy would still look current while holding old counts.
        """
        self._known_counts = None

    @plain_tensors
    def set_table_width(self, width: int) -> None:
        """Make the block table exactly `width` blocks wide (graph mode: one fixed width per captured graph).

        Reallocates the table once; `width` must hold every row's blocks (the caller knows them on the host).
        """
        have = self.block_ids.shape[2]
        if width < have:
            self.block_ids = self.block_ids[:, :, :width].clone()  # the dropped columns are all -1
        elif width > have:
            self.block_ids = grown(self.block_ids, width, fill=-1, dim=2)

    def _append_row(self, row: int, new: torch.Tensor, block_counts: list[int], tail_counts: list[int]) -> None:
        """Append (Hkv, 2, t, D) tokens to one row: complete blocks go to DRAM, the rest to the tail.

        `block_counts`, `tail_counts`: every row's counts before this row's append (`_host_counts`), updated here
        and remembered as known. The table grows before the save and the save is all or nothing, so a
        failure leaves the row as it was.
        """
        size = self.config.block_size
        start, held = block_counts[row], tail_counts[row]
        joined = torch.cat((self.tail[row, :, :, :held], new), dim=2) if held else new  # a prompt's KV: no copy
        num_full = max(joined.shape[2] - 1, 0) // size  # the tail keeps 1..S tokens (see _append_token)
        if num_full:
            num_kv_heads, _, _, head_dim = joined.shape
            self._ensure_capacity(start + num_full)
            blocks = joined[:, :, : num_full * size].reshape(num_kv_heads, 2, num_full, size, head_dim)
            profile = None if self.query_profile is None else self.query_profile[row].repeat_interleave(num_full, 0)
            ids = self.store.save(  # head-major: (Hkv*n,)
                blocks.transpose(1, 2).flatten(0, 1), beside_compute=True, profile=profile
            )
            self.block_ids[row, :, start : start + num_full] = ids.view(num_kv_heads, num_full)
            self.num_blocks[row] += num_full
        rest = joined[:, :, num_full * size :]
        self.tail[row, :, :, : rest.shape[2]] = rest
        self.tail_len[row].fill_(rest.shape[2])  # the scalar as a kernel argument, not a host-to-device copy
        block_counts[row], tail_counts[row] = start + num_full, rest.shape[2]
        self._known_counts = (self._counts_stamp(), (block_counts, tail_counts))

    def _truncate_rows(self, targets: list[tuple[int, int]]) -> None:
        """Cut each (row, length) of `targets` to `length` stored tokens (at most its current length).

        Two passes: every DRAM read first (the step that can fail), then the changes, so a failed
        read changes no row. A cut inside a saved block reads that block back into the tail and
        frees it and every later block: the tail keeps 1..S tokens, as after a commit.
        """
        size = self.config.block_size
        plans = []
        for row, length in targets:
            count, keep = int(self.num_blocks[row]), max(length - 1, 0) // size
            block = self.store.read(self.block_ids[row, :, keep]) if keep < count else None  # (Hkv, 2, S, D)
            plans.append((row, count, keep, length - keep * size, block))
        for row, count, keep, rest, block in plans:
            if block is not None:
                self.tail[row, :, :, :rest] = block[:, :, :rest]
                self.store.free(self.block_ids[row, :, keep:count].flatten())
                self.block_ids[row, :, keep:count] = -1
                self.num_blocks[row] = keep
                if self.feedback_lse is not None:  # its numbers may name blocks it no longer holds
                    self.feedback_lse[row] = float("-inf")
            self.tail_len[row] = rest

    def _ensure_capacity(self, blocks: int) -> None:
        have = self.block_ids.shape[2]
        if blocks > have:
            self.block_ids = grown(self.block_ids, max(blocks, 2 * have, 16), fill=-1, dim=2)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; None for inference-mode tensors, which keep none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Undo:
    """What `SparseServeLayer.undo_update` needs to take one update back.

    num_new: positions the update counted; initialized: the update created the layer's tensors;
    committed: its tokens were stored (else only staged); added: (B,) tokens stored per row
    (None: all `num_new` in every row); profile: the rows' query profiles before the commit.
    """

    num_new: int
    initialized: bool
    committed: bool = False
    added: torch.Tensor | None = None
    profile: torch.Tensor | None = None


def _no_feedback(like: SparseServeLayer, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Feedback tensors of `rows` rows shaped as `like`'s, that know nothing (-inf: no estimate raised)."""
    picked = like.feedback_picked.new_zeros((rows, *like.feedback_picked.shape[1:]))
    return picked, like.feedback_lse.new_full((rows, *like.feedback_lse.shape[1:]), float("-inf"))


def _joined_feedback(
    first: SparseServeLayer, second: SparseServeLayer
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both layers' feedback rows, `first`'s then `second`'s; a side without any adds rows that know
    nothing (-inf); None where neither has any, or the two were picked at different widths."""
    if first.feedback_lse is None and second.feedback_lse is None:
        return None, None
    ref = first if first.feedback_lse is not None else second
    parts_picked, parts_lse = [], []
    for layer in (first, second):
        if layer.feedback_lse is not None:
            parts_picked.append(layer.feedback_picked)
            parts_lse.append(layer.feedback_lse)
        else:
            picked, lse = _no_feedback(ref, layer.tail.shape[0])
            parts_picked.append(picked)
            parts_lse.append(lse)
    if parts_lse[0].shape[1:] != parts_lse[1].shape[1:]:
        return None, None
    return torch.cat(parts_picked), torch.cat(parts_lse)
