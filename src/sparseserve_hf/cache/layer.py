"""SparseServeLayer: one attention layer's KV as DRAM head-blocks plus a device tail block."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import SparseServeConfig
from .grow import grown
from .store import TieredBlockStore


class SparseServeLayer(CacheLayerMixin):
    """KV of one layer for a batch of rows, in blocks of `block_size` tokens per KV head.

    Each row stores only its real tokens (padding never enters a block), compacted from its
    first real token. Full blocks live in the shared DRAM pool with their metadata on the
    device; the newest, partial block of every row stays on the device as the tail.

    `update` only stages the new K/V; the attention function commits them with `commit` once
    it knows (from the mask) which new tokens are real. A staged chunk left uncommitted means
    the model is not running `attn_implementation="sparseserve"`, which `update` reports.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(
        self, layer_idx: int, config: SparseServeConfig, store_for: Callable[[torch.Tensor], TieredBlockStore]
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
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
        self.num_blocks: torch.Tensor | None = None  # (B,) full blocks per row
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None
        # Graph mode (`graph.DecodeGraphRunner`): the caller rolls full tails before the step and
        # tracks tail lengths on the host, so a decode commit only appends (`append_token_static`).
        self.caller_owns_tails = False
        self._tail_len_mirror: tuple[torch.Tensor, int | None, list[int]] | None = None  # see _host_tail_len
        # The last decode step's pick: per-KV-head block indices (B, Hkv, U), their validity, which
        # of them each query head attends to ((B, Hq, U), None = all) and the GQA group size.
        self.last_pick: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int] | None = None

    # ---- HF cache contract -------------------------------------------------------------

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
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage (B, Hkv, T, D) new keys/values for the attention function; returns them unchanged."""
        if self.staged is not None:
            self.staged = None
            raise RuntimeError(
                f"SparseServeCache layer {self.layer_idx} received new keys before the previous ones were "
                "attended: load the model with attn_implementation='sparseserve' (import sparseserve_hf first)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.tail.shape[0] or key_states.shape[1] != self.tail.shape[1]:
            raise ValueError(
                f"SparseServeCache holds {self.tail.shape[0]} rows x {self.tail.shape[1]} KV heads, got keys "
                f"of shape {tuple(key_states.shape)}; call cache.reset() before a new batch"
            )
        self.staged = (key_states, value_states)
        self.num_positions += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        """Positions cached so far, left padding included (what HF builds positions from)."""
        return self.num_positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for HF's mask: every cached position plus the query, no offset."""
        return self.num_positions + query_length, 0

    def get_max_length(self) -> int:
        """-1: unbounded (the block pool grows unless `dram_bytes` fixes its size)."""
        return -1

    def reset(self) -> None:
        """Free this layer's DRAM blocks back to the store and forget every position."""
        if self.is_initialized and self.store is not None:
            self.store.free(self.block_ids.flatten())
        self._clear()

    def offload(self) -> None:
        """Nothing to do: full blocks already live in DRAM."""

    def prefetch(self) -> None:
        """Nothing to do: selected blocks are fetched at attention time."""

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest `tokens_to_remove` positions (negative values count the same way)."""
        remove = abs(tokens_to_remove)
        if not self.is_initialized or remove == 0:
            return
        lengths = self.row_lengths()
        for row in range(lengths.shape[0]):
            self._truncate_row(row, max(int(lengths[row]) - remove, 0))
        self.num_positions = max(self.num_positions - remove, 0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Make row i a copy of old row `indices[i]`: rows may repeat (they then share blocks) or go."""
        if not self.is_initialized:
            return
        indices = torch.as_tensor(indices, device=self.device).flatten()
        selected = self.block_ids[indices]
        self.store.retain(selected)  # before freeing, so kept blocks never reach zero references
        self.store.free(self.block_ids)
        self.block_ids = selected
        self.tail, self.tail_len, self.num_blocks = self.tail[indices], self.tail_len[indices], self.num_blocks[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (e.g. for several returned sequences)."""
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.tail.shape[0], device=self.device).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues from old row `beam_idx[i]`; shared pasts share their blocks."""
        self.batch_select_indices(beam_idx)

    # ---- moving rows between caches over one store (the batching Generator) ---------------

    def append_rows(self, other: SparseServeLayer) -> None:
        """Move every row of `other` (a layer over the same store) after this layer's rows.

        Block references move with the rows: nothing is copied to or freed from the store, and
        `other` is left empty. `num_positions` becomes the longer of the two.
        """
        if not other.is_initialized:
            return
        if self.staged is not None or other.staged is not None:
            raise RuntimeError(f"layer {self.layer_idx}: rows cannot move while new keys are staged")
        if self.store is not None and other.store is not self.store:
            raise ValueError(f"layer {self.layer_idx}: rows can only move between caches that share one store")
        if not self.is_initialized:
            self.store, self.device, self.dtype = other.store, other.device, other.dtype
            self.tail, self.tail_len, self.block_ids, self.num_blocks = (
                other.tail,
                other.tail_len,
                other.block_ids,
                other.num_blocks,
            )
            self.is_initialized = True
        else:
            width = max(self.block_ids.shape[2], other.block_ids.shape[2])
            self.block_ids = torch.cat(
                (grown(self.block_ids, width, fill=-1, dim=2), grown(other.block_ids, width, fill=-1, dim=2))
            )  # (B + B', Hkv, N)
            self.tail = torch.cat((self.tail, other.tail))
            self.tail_len = torch.cat((self.tail_len, other.tail_len))
            self.num_blocks = torch.cat((self.num_blocks, other.num_blocks))
        self.num_positions = max(self.num_positions, other.num_positions)
        self.last_pick = None
        other._clear()

    def pop_rows(self, rows: list[int], into: SparseServeLayer) -> None:
        """Move `rows` (in that order) into the empty layer `into`; the other rows stay, in order.

        Block references move with the rows. Both layers' `num_positions` become their longest
        row's stored length (rows moved here hold no padding).
        """
        if into.is_initialized:
            raise ValueError(f"layer {self.layer_idx}: pop_rows needs an empty target layer")
        if not self.is_initialized or not rows:
            return
        if self.staged is not None:
            raise RuntimeError(f"layer {self.layer_idx}: rows cannot move while new keys are staged")
        batch = self.tail.shape[0]
        if len(set(rows)) != len(rows) or not all(0 <= r < batch for r in rows):
            raise ValueError(f"pop_rows got rows {rows} for a layer of {batch} rows (distinct indices expected)")
        leaving = set(rows)
        taken = torch.tensor(rows, dtype=torch.long, device=self.device)
        kept = torch.tensor([r for r in range(batch) if r not in leaving], dtype=torch.long, device=self.device)
        into.store, into.device, into.dtype = self.store, self.device, self.dtype
        into.tail, into.tail_len = self.tail[taken], self.tail_len[taken]
        into.block_ids, into.num_blocks = self.block_ids[taken], self.num_blocks[taken]
        into.is_initialized = True
        into.num_positions = int(into.row_lengths().max())
        if kept.numel() == 0:
            self._clear()
            return
        self.tail, self.tail_len = self.tail[kept], self.tail_len[kept]
        self.block_ids, self.num_blocks = self.block_ids[kept], self.num_blocks[kept]
        self.num_positions = int(self.row_lengths().max())
        self.last_pick = None

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

    def row_lengths(self) -> torch.Tensor:
        """(B,) real tokens stored per row."""
        return self.num_blocks * self.config.block_size + self.tail_len

    def commit(self, valid: torch.Tensor | None) -> None:
        """Store the staged tokens; `valid` (B, T) marks real tokens (None: all are real)."""
        keys, values = self.staged
        self.staged = None
        if self.caller_owns_tails:
            # Graph mode: the runner feeds one real token per row and never reads `valid`
            # (a mask HF builds while a CUDA graph captures holds no values yet, and reading it syncs).
            self.append_token_static(keys, values)
            return
        if (valid is None or bool(valid.all())) and keys.shape[-2] == 1:
            self._append_token(keys, values)
            return
        for row in range(keys.shape[0]):
            take = slice(None) if valid is None else valid[row]
            new = torch.stack((keys[row][:, take], values[row][:, take]), dim=1)  # (Hkv, 2, t, D)
            self._append_row(row, new)

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

    def _row_tokens(self, row: int) -> torch.Tensor:
        """(Hkv, 2, n, D) every stored token of one row, oldest first."""
        count = int(self.num_blocks[row])
        num_kv_heads, _, size, head_dim = self.tail.shape[1:]
        blocks = self.store.read(self.block_ids[row, :, :count].flatten())  # (Hkv*n, 2, S, D)
        blocks = blocks.view(num_kv_heads, count, 2, size, head_dim).permute(0, 2, 1, 3, 4)
        full = blocks.reshape(num_kv_heads, 2, count * size, head_dim)
        return torch.cat((full, self.tail[row, :, :, : int(self.tail_len[row])]), dim=2)

    def _append_token(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Decode fast path: full tails go to DRAM first (`roll_full_tails`), then one token per row joins its tail."""
        lengths = self._host_tail_len()
        full = [row for row, length in enumerate(lengths) if length == self.config.block_size]
        if full:  # host work (DRAM allocation), once per block_size tokens of a row
            self.roll_full_tails(full)
        self.append_token_static(keys, values)
        self._remember_tail_len([0 if row in full else length for row, length in enumerate(lengths)])

    def roll_full_tails(self, rows: list[int], table_width: int | None = None) -> None:
        """Save the full tail blocks of `rows` to DRAM and empty those tails (eager: host allocation).

        Saving a full tail only when the next token arrives keeps the current token in the tail,
        which sparse decode always attends. `table_width`: the table width the rows need
        afterwards, known on the host (graph mode); None reads it from the device (one sync).
        """
        if not rows:
            return
        full_rows = torch.tensor(rows, device=self.device)
        self.link_saved_tails(full_rows, self.store.save(self.full_tails(full_rows)), table_width)

    def full_tails(self, full_rows: torch.Tensor) -> torch.Tensor:
        """(R*Hkv, 2, S, D) the tail blocks of rows `full_rows` (R,), head-major per row."""
        return self.tail[full_rows].flatten(0, 1)

    def link_saved_tails(self, full_rows: torch.Tensor, ids: torch.Tensor, table_width: int | None = None) -> None:
        """Append the saved tails' DRAM ids (R*Hkv,) to the rows' tables and empty their tails."""
        self._ensure_capacity(int(self.num_blocks.max()) + 1 if table_width is None else table_width)
        self.block_ids[full_rows, :, self.num_blocks[full_rows]] = ids.view(-1, self.tail.shape[1])
        self.num_blocks[full_rows] += 1
        self.tail_len.index_fill_(0, full_rows, 0)  # not `[rows] = 0`: a Python scalar through an index syncs

    def append_token_static(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one (B, Hkv, 1, D) token per row to its tail: fixed shapes, no host work (CUDA-graph safe).

        Every tail must have room (fewer than block_size tokens): `roll_full_tails` runs first.
        """
        rows = torch.arange(keys.shape[0], device=self.device)
        self.tail[rows, :, :, self.tail_len] = torch.stack((keys[:, :, 0], values[:, :, 0]), dim=2)
        self.tail_len += 1

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors a captured decode step reads or writes by address."""
        return {
            "tail": self.tail,
            "tail_len": self.tail_len,
            "block_ids": self.block_ids,
            "num_blocks": self.num_blocks,
        }

    def forget_host_tail_len(self) -> None:
        """Drop the host copy of the tail lengths, so the next eager decode step reads them back.

        A CUDA-graph replay advances `tail_len` without bumping its version, so after one the
        copy would still look current while holding old lengths.
        """
        self._tail_len_mirror = None

    def set_table_width(self, width: int) -> None:
        """Make the block table exactly `width` blocks wide (graph mode: one fixed width per captured graph).

        Reallocates the table once; `width` must hold every row's blocks (the caller knows them on the host).
        """
        have = self.block_ids.shape[2]
        if width < have:
            self.block_ids = self.block_ids[:, :, :width].clone()  # the dropped columns are all -1
        elif width > have:
            self.block_ids = grown(self.block_ids, width, fill=-1, dim=2)

    def _host_tail_len(self) -> list[int]:
        """Each row's tail length, known on the host without a device sync in steady decode.

        The decode fast path keeps a host copy; it is trusted only while `tail_len` is the same
        tensor at the same in-place version as when the copy was made, so any other change
        (prefill, row moves, crop) makes the next decode step read the lengths back once.
        """
        mirror = self._tail_len_mirror
        version = _version(self.tail_len)
        if mirror is not None and mirror[0] is self.tail_len and version is not None and mirror[1] == version:
            return mirror[2]
        return self.tail_len.tolist()

    def _remember_tail_len(self, before: list[int]) -> None:
        """Record the lengths after a decode append (`before` + 1) at the tensor's current version."""
        self._tail_len_mirror = (self.tail_len, _version(self.tail_len), [length + 1 for length in before])

    def _append_row(self, row: int, new: torch.Tensor) -> None:
        """Append (Hkv, 2, t, D) tokens to one row: complete blocks go to DRAM, the rest to the tail."""
        size = self.config.block_size
        joined = torch.cat((self.tail[row, :, :, : int(self.tail_len[row])], new), dim=2)
        num_full = max(joined.shape[2] - 1, 0) // size  # the tail keeps 1..S tokens (see _append_token)
        if num_full:
            num_kv_heads, _, _, head_dim = joined.shape
            blocks = joined[:, :, : num_full * size].reshape(num_kv_heads, 2, num_full, size, head_dim)
            ids = self.store.save(blocks.transpose(1, 2).flatten(0, 1))  # head-major: (Hkv*n,)
            start = int(self.num_blocks[row])
            self._ensure_capacity(start + num_full)
            self.block_ids[row, :, start : start + num_full] = ids.view(num_kv_heads, num_full)
            self.num_blocks[row] += num_full
        rest = joined[:, :, num_full * size :]
        self.tail[row, :, :, : rest.shape[2]] = rest
        self.tail_len[row] = rest.shape[2]

    def _truncate_row(self, row: int, length: int) -> None:
        size = self.config.block_size
        count = int(self.num_blocks[row])
        keep = max(length - 1, 0) // size
        rest = length - keep * size
        if keep < count:
            block = self.store.read(self.block_ids[row, :, keep])  # (Hkv, 2, S, D)
            self.tail[row, :, :, :rest] = block[:, :, :rest]
            self.store.free(self.block_ids[row, :, keep:count].flatten())
            self.block_ids[row, :, keep:count] = -1
            self.num_blocks[row] = keep
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
