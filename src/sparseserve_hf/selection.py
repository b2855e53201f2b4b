"""Selection granularities: one per `SparseServeConfig.selection`.

A granularity says who picks a layer's blocks at a decode step (every query head, or every KV head
from its group's combined scores), how wide one KV head's pick can be (what the HBM cache must hold
and what the working-set estimate counts), how deep a ranking scorer must rank, and how the picks
come out of the block scores. The decode step, the cache's fit checks, the Generator's admission and
the scorers ask `SELECTIONS`; a new granularity is one class here and one entry in `SELECTIONS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .config import SparseServeConfig


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
    """ "group_union" (the default): every query head picks its own blocks, its KV head loads the union
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
        """`ops.aggregate_group_scores`, then one sorted top-k per KV head (`ops.select_blocks`)."""
        scores = ops.aggregate_group_scores(scores, num_kv_heads, config.group_aggregation)  # (B, Hkv, N)
        picked, valid = ops.select_blocks(
            scores, num_blocks, config.selected_full_blocks, config.sink_blocks, config.window_blocks, True
        )  # (B, Hkv, K)
        return picked, valid, None


SELECTIONS: dict[str, Selection] = {
    "query_head": QueryHead(),
    "group_union": GroupUnion(),
    "kv_head": KvHead(),
}
