"""How a decode step chooses blocks: a scorer per `SparseServeConfig.metadata` kind, and a selection
granularity per `SparseServeConfig.selection`.

A scorer says what a full block keeps as metadata (rows of head_dim values, in the store's (C, M, D)
pool), what a config needs for it, how a block's metadata is made when the block fills, and how a
decode step scores every block of a row's table from it. The config's validation, the store and
the decode step ask `SCORERS`; a new kind is one class here with its ops (a spec in `ops/`, and a
kernel where it pays) and one entry in `SCORERS`.

A selection granularity says who picks a layer's blocks from those scores (every query head, or
every KV head from its group's combined scores), how wide one KV head's pick can be (what the HBM
cache must hold), how many distinct blocks it holds (what the working-set estimate counts) and how
deep a ranking scorer must rank. The decode step, the cache's fit checks, the Generator's admission
and the scorers ask `SELECTIONS`; a new granularity is one class here and one entry in `SELECTIONS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from .ops import channels, reference

if TYPE_CHECKING:
    from .config import SparseServeConfig
    from .ops import BlockOps

HYBRID_SUB_BLOCKS = 4  # default sub-blocks of "hybrid" metadata: one cuboid mean per 8 tokens of a 32-token block


class Scorer(Protocol):
    """What the cache needs of a metadata kind (every method takes the cache's config)."""

    def default_sub_blocks(self, block_size: int) -> int:
        """`SparseServeConfig.sub_blocks` when `metadata_sub_blocks` is None."""
        ...

    def metadata_rows(self, config: SparseServeConfig) -> int:
        """M: head_dim-wide rows of metadata per block."""
        ...

    def check(self, config: SparseServeConfig) -> None:
        """ValueError naming the field, where the config's other fields do not suit this kind."""
        ...

    def stored_dtype(self, name: str, kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The dtype this kind's metadata is stored in on `device`, for `SparseServeConfig.metadata_dtype`
        `name` and KV of `kv_dtype`."""
        ...

    def summarize(
        self,
        ops: BlockOps,
        keys: torch.Tensor,
        config: SparseServeConfig,
        dtype: torch.dtype,
        profile: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(n, S, D) keys of full blocks -> their (n, M, D) metadata in `dtype`; `profile` (n, D):
        each block's KV head's query profile (`uses_query_profile`), or None."""
        ...

    def uses_query_profile(self) -> bool:
        """Whether `summarize` weighs channels by the queries of recent prompts (`ops.channels.query_profile`),
        which the cache then keeps per (layer, KV head) and hands to every save."""
        ...

    def uses_feedback(self, config: SparseServeConfig) -> bool:
        """Whether `score` takes the last decode step's exact per-block log-sum-exps (`fed_back`), which
        the attention then writes and the layer keeps."""
        ...

    def score(
        self,
        ops: BlockOps,
        query: torch.Tensor,
        metadata: torch.Tensor,
        block_ids: torch.Tensor,
        config: SparseServeConfig,
        scaling: float,
        fed_back: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B, Hq, N) fp32 scores of each row's table, higher is better, -inf where the id is -1.
        query (B, Hq, D); metadata (C, M, D) by DRAM id; block_ids (B, Hkv, N); scaling: the softmax's;
        fed_back: the last step's table positions (B, Hkv, U) and exact log-sum-exps (B, Hq, U) where
        `uses_feedback`, else None."""
        ...

    def score_floor(self, config: SparseServeConfig) -> int | None:
        """A promise that every score is -inf or an integer >= this (None: real numbers), which lets
        the group union's kernel search fewer key bits (`reference.select_group_union`)."""
        ...


class BlockSummaries:
    """ "quest" (per-channel key min/max: Quest's bound of q.k), "cuboid" (per-channel key mean) and
    "hybrid" (the block's min/max and a mean per sub-block, the two rankings interleaved), each per
    `metadata_sub_blocks` sub-block (`reference.block_metadata`, `reference.score_table`)."""

    def __init__(self, kind: str, default_sub_blocks: int = 1) -> None:
        self.kind = kind
        self._default_sub_blocks = default_sub_blocks

    def default_sub_blocks(self, block_size: int) -> int:
        """The kind's default (4 for hybrid, else 1), at most one per token."""
        return min(self._default_sub_blocks, block_size)

    def metadata_rows(self, config: SparseServeConfig) -> int:
        """quest: (min, max) per sub-block; cuboid: a mean per sub-block; hybrid: one (min, max), then a
        mean per sub-block."""
        if self.kind == "hybrid":
            return 2 + config.sub_blocks
        return (2 if self.kind == "quest" else 1) * config.sub_blocks

    def check(self, config: SparseServeConfig) -> None:
        """Sub-blocks: a power of two, at most one per token."""
        sub = config.sub_blocks
        if not isinstance(sub, int) or isinstance(sub, bool) or sub < 1 or sub & (sub - 1) or sub > config.block_size:
            raise ValueError(
                f"metadata_sub_blocks must be a power of two no larger than block_size ({config.block_size}), "
                f"got {config.metadata_sub_blocks!r}"
            )

    def stored_dtype(self, name: str, kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """`ops.reference.metadata_dtype`: "auto" is 8-bit where the GPU converts it natively (any float holds a
        summary, and the scoring kernel converts 8-bit values in hardware)."""
        return reference.metadata_dtype(name, kv_dtype, device)

    def summarize(
        self,
        ops: BlockOps,
        keys: torch.Tensor,
        config: SparseServeConfig,
        dtype: torch.dtype,
        profile: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`ops.block_metadata` of the kind (computed from the keys as given, then stored in `dtype`)."""
        return ops.block_metadata(keys, self.kind, config.sub_blocks, dtype)

    def uses_query_profile(self) -> bool:
        """No: a summary depends on the keys alone."""
        return False

    def uses_feedback(self, config: SparseServeConfig) -> bool:
        """No: the scores are bounds and ranks, not log-sum-exps."""
        return False

    def score(
        self,
        ops: BlockOps,
        query: torch.Tensor,
        metadata: torch.Tensor,
        block_ids: torch.Tensor,
        config: SparseServeConfig,
        scaling: float,
        fed_back: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`ops.score_table`: Quest's bound or the mean's q.k, or for hybrid the interleaved ranks."""
        depth = SELECTIONS[config.selection].rank_depth(config)
        return ops.score_table(query, metadata, block_ids, self.kind, depth)

    def score_floor(self, config: SparseServeConfig) -> int | None:
        """Hybrid ranks are integers from -2 x the ranked depth up; the other kinds' scores are real numbers."""
        depth = SELECTIONS[config.selection].rank_depth(config)
        return -2 * depth if self.kind == "hybrid" and depth is not None else None


CHANNEL_BYTES = "metadata='channels' stores its codes in bytes: metadata_dtype must be 'auto' or 'float8_e4m3fn'"


class ChannelScores:
    """ "channels": each block keeps a 2-bit copy of a share of its keys' channels, chosen by their
    spread and the group's query profile, and is scored by its query heads' softmax mass as
    estimated from them (`ops.channels`)."""

    def default_sub_blocks(self, block_size: int) -> int:
        """1: every token is scored; there are no sub-block summaries."""
        return 1

    def metadata_rows(self, config: SparseServeConfig) -> int:
        """The packed codes' rows and the header's (`ops.channels.metadata_rows`)."""
        return channels.metadata_rows(config.block_size, config.channel_share)

    def check(self, config: SparseServeConfig) -> None:
        """Whole bytes of codes per block, no sub-blocks, 8-bit storage."""
        channels.code_rows(config.block_size, config.channel_share)  # raises unless the codes fill whole bytes
        if config.metadata_sub_blocks is not None:
            raise ValueError(
                "metadata_sub_blocks does not apply to metadata='channels' (it scores every token): leave it None"
            )
        if config.metadata_dtype == "kv":
            raise ValueError(CHANNEL_BYTES)

    def stored_dtype(self, name: str, kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """float8_e4m3fn on every device: the codes are raw bytes, and where a GPU does not convert 8-bit
        floats natively the channel kernel decodes the minima and steps with integer operations."""
        if name == "kv":  # `check` refuses it first; kept for callers that skip the config
            raise ValueError(CHANNEL_BYTES)
        return torch.float8_e4m3fn

    def summarize(
        self,
        ops: BlockOps,
        keys: torch.Tensor,
        config: SparseServeConfig,
        dtype: torch.dtype,
        profile: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`channels.channel_metadata`, the channels weighed by `profile`."""
        return channels.channel_metadata(keys, config.channel_share, dtype, profile)

    def uses_query_profile(self) -> bool:
        """Yes: the channels a block keeps are weighed by the size of the group's queries."""
        return True

    def uses_feedback(self, config: SparseServeConfig) -> bool:
        """`config.feeds_back`: a block the last step attended scores at least that step's exact
        log-sum-exp over it (`ops.channels.with_feedback`)."""
        return config.feeds_back

    def score(
        self,
        ops: BlockOps,
        query: torch.Tensor,
        metadata: torch.Tensor,
        block_ids: torch.Tensor,
        config: SparseServeConfig,
        scaling: float,
        fed_back: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Each query head's estimated softmax mass per block (`ops.channel_logsumexp`, then
        `ops.channel_mass`), with the last step's exact numbers fed back where given first."""
        stored = channels.stored_channels(config.channel_share, query.shape[-1])
        estimate = ops.channel_logsumexp(query, metadata, block_ids, config.block_size, stored, scaling)
        return ops.channel_mass(estimate, fed_back)

    def score_floor(self, config: SparseServeConfig) -> int | None:
        """None: the masses are real numbers."""
        return None


SCORERS: dict[str, Scorer] = {
    "quest": BlockSummaries("quest"),
    "cuboid": BlockSummaries("cuboid"),
    "hybrid": BlockSummaries("hybrid", HYBRID_SUB_BLOCKS),
    "channels": ChannelScores(),
}


class Selection(Protocol):
    """What the cache needs of a selection granularity (every method takes the cache's config)."""

    def pick_width(self, config: SparseServeConfig, group: int) -> int:
        """Head-blocks one KV head's pick can hold per layer and request (some may repeat or be unused);
        `group` is the query heads per KV head."""
        ...

    def distinct_blocks(self, config: SparseServeConfig, group: int) -> int:
        """At most how many different blocks one KV head loads per layer and step."""
        ...

    def rank_depth(self, config: SparseServeConfig) -> int | None:
        """How deep a ranking scorer must rank each query head's blocks; None = every rank counts."""
        ...

    def pick(
        self, ops, config: SparseServeConfig, scores: torch.Tensor, num_blocks: torch.Tensor, num_kv_heads: int,
        capacity: int, score_floor: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(B, Hkv, U) picked block indices and validity, and the (B, Hq, U) per-query-head mask or None
        (every query head attends every block its KV head loads), from (B, Hq, N) block scores.
        `score_floor`: the lowest score a real block can have, where the scorer knows one."""
        ...


class GroupUnion:
    """ "group_union": every query head picks its own blocks, its KV head loads the union
    of its group's picks (capped by `load_budget`), and every query head attends all of them. One op
    (one kernel with Triton)."""

    capped = True  # `load_budget` caps the union

    def pick_width(self, config: SparseServeConfig, group: int) -> int:
        """G x the blocks a query head picks, or the config's load cap."""
        return self._cap(config, group * config.selected_full_blocks)

    def distinct_blocks(self, config: SparseServeConfig, group: int) -> int:
        """Sink and window once, G x the top-k, or the load cap."""
        return self._cap(config, config.sink_blocks + config.window_blocks + group * config.topk_blocks)

    def rank_depth(self, config: SparseServeConfig) -> int | None:
        """A query head's top-k is all the union reads."""
        return config.selected_full_blocks

    def _cap(self, config: SparseServeConfig, blocks: int) -> int:
        return blocks if config.load_blocks is None or not self.capped else min(blocks, config.load_blocks)

    def pick(
        self, ops, config: SparseServeConfig, scores: torch.Tensor, num_blocks: torch.Tensor, num_kv_heads: int,
        capacity: int, score_floor: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """`ops.select_group_union`: U = G x K, or the config's load cap."""
        picked, valid = ops.select_group_union(
            scores, num_blocks, config.selected_full_blocks, config.sink_blocks, config.window_blocks,
            num_kv_heads, score_floor, config.load_blocks,
        )  # fmt: skip
        return picked, valid, None


class QueryHead(GroupUnion):
    """ "query_head": every query head picks its own blocks and attends only them; its KV head loads the
    union of its group's picks, never capped (the config refuses `load_budget` with it)."""

    capped = False

    def pick(
        self, ops, config: SparseServeConfig, scores: torch.Tensor, num_blocks: torch.Tensor, num_kv_heads: int,
        capacity: int, score_floor: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Per-head top-k (`ops.select_blocks`, unsorted: the union orders the blocks), then
        `ops.union_over_group` with the per-query-head mask."""
        picked, valid = ops.select_blocks(
            scores, num_blocks, config.selected_full_blocks, config.sink_blocks, config.window_blocks, False
        )  # (B, Hq, K)
        return ops.union_over_group(picked, valid, num_kv_heads, capacity, True)


class KvHead:
    """ "kv_head": one pick per KV head from its query heads' scores combined by `group_aggregation`;
    a KV head loads exactly the budget."""

    def pick_width(self, config: SparseServeConfig, group: int) -> int:
        """The budget's full blocks, whatever the group size."""
        return config.selected_full_blocks

    def distinct_blocks(self, config: SparseServeConfig, group: int) -> int:
        """The budget's full blocks."""
        return config.selected_full_blocks

    def rank_depth(self, config: SparseServeConfig) -> int | None:
        """The group's scores are combined before the pick, so every rank counts."""
        return None

    def pick(
        self, ops, config: SparseServeConfig, scores: torch.Tensor, num_blocks: torch.Tensor, num_kv_heads: int,
        capacity: int, score_floor: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """`ops.aggregate_group_scores`, then one top-k per KV head, ascending: `ops.select_group_union`
        over groups of one head (a head's union is its own pick; one launch with Triton)."""
        scores = ops.aggregate_group_scores(scores, num_kv_heads, config.group_aggregation)  # (B, Hkv, N)
        picked, valid = ops.select_group_union(
            scores, num_blocks, config.selected_full_blocks, config.sink_blocks, config.window_blocks, num_kv_heads
        )  # (B, Hkv, K)
        return picked, valid, None


SELECTIONS: dict[str, Selection] = {
    "query_head": QueryHead(),
    "group_union": GroupUnion(),
    "kv_head": KvHead(),
}
