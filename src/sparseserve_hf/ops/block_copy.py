"""Per-block copy transfers: the paper's baseline (one cudaMemcpy per block), behind the BlockOps seam.

`transfer="copy"` swaps these in for the backend's gather/scatter (FlashH2D and the UVA scatter
with Triton, index copies with the torch reference) so the serving benchmark can measure what
fragmentation-aware transfer buys (16 KiB blocks moved one copy each reach only a few GB/s).
Same contracts as
`reference.gather_blocks` / `reference.scatter_blocks`, so the outputs are bit-identical.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from . import reference

if TYPE_CHECKING:
    from . import BlockOps


def gather_blocks(
    pool_src: torch.Tensor,
    src_ids: torch.Tensor,
    pool_dst: torch.Tensor,
    dst_slots: torch.Tensor,
    count: torch.Tensor | None = None,
) -> None:
    """Copy `pool_src[src_ids[i]] -> pool_dst[dst_slots[i]]` with one `copy_` per block.

    Args as in `reference.gather_blocks`: pools (C, 2, S, D) / (P, 2, S, D), ids (n,) or (L, n)
    long with -1 skipped, optional (L,) `count` of live entries per list. Reads the ids on the
    host (a sync): a copy per block is launched from the host anyway.
    """
    src_ids, dst_slots = reference.live_entries(count, src_ids, dst_slots)
    for src, dst in zip(src_ids.tolist(), dst_slots.tolist()):
        if src >= 0 and dst >= 0:
            pool_dst[dst].copy_(pool_src[src], non_blocking=True)  # stream-ordered, like cudaMemcpyAsync


def scatter_blocks(src_blocks: torch.Tensor, pool_dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Save `src_blocks[i] -> pool_dst[dst_ids[i]]` with one `copy_` per block (-1 ids skipped).

    Args as in `reference.scatter_blocks`: blocks (n, 2, S, D), pool (C, 2, S, D), ids (n,) long.
    Copies into pinned memory are asynchronous, as the UVA scatter's writes are: the store
    synchronizes before the host touches the pool.
    """
    for row, dst in enumerate(dst_ids.tolist()):
        if dst >= 0:
            pool_dst[dst].copy_(src_blocks[row], non_blocking=True)


def with_copy_transfers(ops: BlockOps) -> BlockOps:
    """`ops` with gather/scatter replaced by the per-block copies (name suffixed "+copy")."""
    return replace(ops, name=f"{ops.name}+copy", gather_blocks=gather_blocks, scatter_blocks=scatter_blocks)
