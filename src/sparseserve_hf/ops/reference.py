"""Plain-PyTorch reference of every op: the specification, the CPU path and the test oracle.

Dimension letters: B requests (batch rows), Hq query heads, Hkv KV heads, G = Hq // Hkv,
N blocks of a row's table, K selected blocks, S block_size tokens, D head_dim,
M metadata vectors per block (2 per sub-block for quest min/max, 1 per sub-block for cuboid mean), P pool slots.
Every op accumulates in fp32 and returns the input dtype where it returns activations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def block_metadata(
    keys: torch.Tensor, kind: str, sub_blocks: int = 1, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Summarize each key block for scoring, per sub-block of S // sub_blocks consecutive tokens.

    Args:
        keys: (..., S, D) keys of full blocks.
        kind: "quest" -> per-channel (min, max); "cuboid" -> per-channel mean; "hybrid" -> the
            whole block's quest (min, max) followed by the cuboid mean of each sub-block.
        sub_blocks: summaries per block (a divisor of S). Finer summaries bound the keys more
            tightly (a needle's few tokens are not averaged or boxed with 31 others), at
            sub_blocks x the metadata; the block is still loaded and attended whole.
        dtype: the stored dtype (see `to_metadata_dtype`); None keeps the keys' dtype.
    Returns:
        (..., M, D) in `dtype` (default the keys'): M = 2 * sub_blocks for quest, laid out
        (min_0, max_0, min_1, max_1, ...); M = sub_blocks for cuboid (mean_0, mean_1, ...);
        M = 2 + sub_blocks for hybrid (min, max, mean_0, mean_1, ...).
    """
    summary = _summarize(keys, kind, sub_blocks)
    return summary if dtype is None else to_metadata_dtype(summary, dtype)


def _summarize(keys: torch.Tensor, kind: str, sub_blocks: int) -> torch.Tensor:
    """`block_metadata` in the keys' dtype."""
    size = keys.shape[-2]
    if sub_blocks < 1 or size % sub_blocks:
        raise ValueError(f"sub_blocks must divide the block's {size} tokens, got {sub_blocks}")
    parts = keys.unflatten(-2, (sub_blocks, size // sub_blocks))  # (..., sub, S / sub, D)
    if kind == "quest":
        return torch.stack((parts.amin(dim=-2), parts.amax(dim=-2)), dim=-2).flatten(-3, -2)  # (..., 2 sub, D)
    if kind == "cuboid":
        return parts.float().mean(dim=-2).to(keys.dtype)  # (..., sub, D)
    if kind == "hybrid":
        # Quest's (min, max) of the whole block, then the cuboid mean of each sub-block.
        return torch.cat((_summarize(keys, "quest", 1), _summarize(keys, "cuboid", sub_blocks)), dim=-2)
    raise ValueError(f"unknown metadata kind {kind!r}")


FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with native 8-bit float conversions


def metadata_dtype(name: str, kv_dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype of `SparseServeConfig.metadata_dtype` `name` for KV of `kv_dtype` on `device`:
    "kv" is `kv_dtype`; "auto" is float8_e4m3fn on the CPU and on CUDA GPUs that convert it
    natively, else `kv_dtype`; any other name is torch's dtype of that name."""
    if name == "kv":
        return kv_dtype
    if name != "auto":
        return getattr(torch, name)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        return kv_dtype
    return torch.float8_e4m3fn


def to_metadata_dtype(metadata: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`metadata` cast to its stored dtype: rounded to nearest, saturated at the dtype's largest
    finite value (an 8-bit float has no infinity, and a cast out of its range gives NaN)."""
    if dtype == metadata.dtype:
        return metadata
    if dtype.is_floating_point and dtype.itemsize == 1:
        bound = torch.finfo(dtype).max
        metadata = metadata.clamp(-bound, bound)
    return metadata.to(dtype)


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype full blocks are stored in for `SparseServeConfig.kv_dtype` `name`: the model's
    ("auto") or an 8-bit float (whose blocks carry scales: `quantize_blocks`)."""
    return model_dtype if name == "auto" else getattr(torch, name)


def quantize_blocks(blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 2, S, D) blocks -> the same in the 8-bit float `dtype` and their (n, 2) fp32 scales.

    Each block's keys and its values get their own scale, so that their largest magnitude becomes
    the dtype's largest finite value (an all-zero part keeps scale 1); values are rounded to nearest.
    `dequantize_blocks` inverts it up to that rounding."""
    amax = blocks.detach().abs().amax(dim=(-2, -1)).float()  # (n, 2)
    scales = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    return to_metadata_dtype(blocks.float() / scales[..., None, None], dtype), scales


def dequantize_blocks(stored: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, 2, S, D) 8-bit blocks and their (n, 2) scales -> (n, 2, S, D) in `dtype`."""
    return (stored.float() * scales[..., None, None]).to(dtype)


def metadata_sub_blocks(kind: str, num_vectors: int) -> int:
    """Sub-blocks per block of a (..., M, D) metadata tensor of `kind` (see `block_metadata`)."""
    if kind == "quest":
        if num_vectors % 2:
            raise ValueError(f"quest metadata holds (min, max) pairs, got {num_vectors} vectors per block")
        return num_vectors // 2
    if kind == "cuboid":
        return num_vectors
    if kind == "hybrid":
        if num_vectors < 3:
            raise ValueError(f"hybrid metadata holds (min, max) + at least one mean, got {num_vectors} vectors")
        return num_vectors - 2
    raise ValueError(f"unknown metadata kind {kind!r}")


def score_blocks(query: torch.Tensor, metadata: torch.Tensor, kind: str) -> torch.Tensor:
    """Score every block of every row for every query head.

    Args:
        query: (B, Hq, D) decode queries (RoPE applied).
        metadata: (B, Hkv, N, M, D) metadata of each row's block table (see `block_metadata`).
        kind: "quest" scores the upper bound sum_d max(q_d * min_d, q_d * max_d) of q.k over
            the block (Quest); "cuboid" scores q . mean(k). With several sub-blocks per block
            the block scores the max over its sub-blocks (for quest still an upper bound of q.k
            over the block, and a tighter one). "hybrid" ranks the blocks by both (quest over
            the whole block, cuboid over sub-blocks) and interleaves the two rankings (see
            `combine_by_rank`): half the top-k by each, without double-counting.
    Returns:
        (B, Hq, N) fp32 scores (for hybrid: minus the combined rank, higher is better).
    """
    if kind == "hybrid":
        return combine_by_rank(*(score_blocks(query, part, k) for k, part in hybrid_parts(metadata)))
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_blocks, num_vectors = metadata.shape[1:4]
    sub = metadata_sub_blocks(kind, num_vectors)
    q = query.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)  # (B, Hkv, G, D)
    meta = metadata.float().flatten(2, 3)  # (B, Hkv, N*M, D): block n's vectors at n*M .. n*M + M - 1
    if kind == "quest":
        # max(q*lo, q*hi) per channel is q*hi where q > 0 and q*lo where q < 0: two matmuls.
        lo, hi = meta[..., 0::2, :], meta[..., 1::2, :]  # (B, Hkv, N*sub, D)
        scores = q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)
    else:
        scores = q @ meta.transpose(-1, -2)  # (B, Hkv, G, N*sub)
    scores = scores.unflatten(-1, (num_blocks, sub)).amax(dim=-1)  # (B, Hkv, G, N): best sub-block
    return scores.reshape(batch, num_q_heads, num_blocks)  # (B, Hkv, G, N) -> (B, Hq, N)


def aggregate_group_scores(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """(B, Hq, N) query-head scores -> (B, Hkv, N), one selection per KV head."""
    batch, num_q_heads, num_blocks = scores.shape
    grouped = scores.view(batch, num_kv_heads, num_q_heads // num_kv_heads, num_blocks)
    if how == "max":
        return grouped.amax(dim=2)
    if how == "sum":
        return grouped.sum(dim=2)
    raise ValueError(f"unknown group aggregation {how!r}")


def select_blocks(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    num_selected: int,
    sink_blocks: int,
    window_blocks: int,
    ordered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick `num_selected` blocks per (row, head): sink and window blocks always, the rest by score.

    Args:
        scores: (B, H, N) block scores; entries at or past a row's block count are ignored.
        num_blocks: (B,) full blocks per row.
        num_selected: K, blocks per (row, head). A row with at most K blocks selects all of them.
        sink_blocks: leading blocks always kept.
        window_blocks: trailing blocks always kept.
        ordered: False skips the final sort (the same set, in no particular order) for callers
            that only take a union of the selections (`union_over_group`), which orders itself.
    Returns:
        index: (B, H, K) long block indices into the row's table, ascending among valid entries
            (valid entries first) when `ordered`.
        valid: (B, H, K) bool; False where the row has fewer than K blocks.
    """
    width = max(scores.shape[-1], num_selected)
    rank, _ = ranking_keys(scores, num_blocks, width, sink_blocks, window_blocks)
    count = num_blocks.view(-1, 1, 1)
    top = rank.topk(num_selected, dim=-1, sorted=False).indices  # (B, H, K), in no particular order
    # Invalid entries (past the row's count) sort last; valid ones ascend, so attention visits
    # blocks in position order.
    index = torch.where(top < count, top, width)
    if ordered:
        index = index.sort(dim=-1).values
    valid = index < width
    return torch.where(valid, index, 0), valid


def ranking_keys(
    scores: torch.Tensor, num_blocks: torch.Tensor, width: int, sink_blocks: int, window_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, width) fp32 keys that rank each row's blocks as the selection does (higher first):
    sink and window blocks +inf, blocks at or past the row's count -inf, NaN the lowest finite
    float (below every real score); and which blocks exist, (B, 1, width). `width` >= N pads the
    scores (B, H, N) with blocks that do not exist."""
    capacity = scores.shape[-1]
    position = torch.arange(width, device=scores.device)  # (N',)
    count = num_blocks.view(-1, 1, 1)
    exists = position < count  # (B, 1, N')
    forced = exists & ((position < sink_blocks) | (position >= count - window_blocks))
    # Three passes over the (B, H, N') scores (this runs every decode step over every block).
    key = torch.nan_to_num(
        scores.float(), nan=torch.finfo(torch.float32).min, posinf=float("inf"), neginf=float("-inf")
    )
    if width > capacity:
        key = torch.nn.functional.pad(key, (0, width - capacity), value=float("-inf"))
    return key.masked_fill_(~exists, float("-inf")).masked_fill_(forced, float("inf")), exists


def union_over_group(
    index: torch.Tensor, valid: torch.Tensor, num_kv_heads: int, capacity: int, with_head_mask: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-query-head selections -> the blocks each KV head loads (their union) and who uses which.

    Args:
        index, valid: (B, Hq, K) as returned by `select_blocks`.
        num_kv_heads: Hkv.
        capacity: N, the width of the block table the indices point into.
        with_head_mask: False skips the per-head mask (group_union attends the whole union).
    Returns:
        union: (B, Hkv, U) block indices, ascending among valid entries, U = G*K whatever N is:
            the union's width (and so the attention kernel's split over it, and its float
            summation order) must not depend on how wide a table happens to be, or a CUDA-graph
            step (fixed-width tables) and the eager step would round differently.
        union_valid: (B, Hkv, U).
        head_mask: (B, Hq, U) True where the query head itself selected that union block; None
            without `with_head_mask`.
    """
    batch, num_q_heads, num_selected = index.shape
    group = num_q_heads // num_kv_heads
    width = max(capacity, group * num_selected, 1)
    own = torch.zeros((batch, num_q_heads, width), dtype=torch.long, device=index.device)
    own.scatter_add_(2, index, valid.long())  # (B, Hq, N) > 0 where the head chose the block
    chosen = own.view(batch, num_kv_heads, group, width).sum(dim=2) > 0  # (B, Hkv, N)
    position = torch.arange(width, device=index.device)
    # Chosen blocks rank by position, unchosen ones after all of them: the smallest keys, ascending.
    key = torch.where(chosen, position, width + position)
    key, union = key.topk(group * num_selected, dim=-1, largest=False)
    union_valid = key < width
    union = torch.where(union_valid, union, 0)
    if not with_head_mask:
        return union, union_valid, None
    head_mask = torch.gather(own, 2, union.repeat_interleave(group, dim=1)) > 0  # (B, Hq, U)
    return union, union_valid, head_mask & union_valid.repeat_interleave(group, dim=1)


def select_group_union(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    num_selected: int,
    sink_blocks: int,
    window_blocks: int,
    num_kv_heads: int,
    score_floor: int | None = None,
    max_loaded: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The default selection in one op: every query head picks its blocks (`select_blocks`), each KV
    head loads the union of its group's picks (`union_over_group`, no per-head mask).

    Args:
        scores: (B, Hq, N) block scores, -inf past a row's blocks; NaN ranks lowest among real blocks.
        num_blocks, num_selected, sink_blocks, window_blocks: as in `select_blocks`.
        num_kv_heads: Hkv.
        score_floor: a promise that every score is -inf or an integer >= it (a rank interleave,
            `combine_by_rank`); it changes no result, a kernel may search fewer key bits with it.
        max_loaded: most blocks a KV head loads (`SparseServeConfig.load_blocks`), >= K; None or
            >= G*K: no cap. Where the union is larger, it is the union of each head's k best
            blocks for the largest k whose union fits (`capped_group_union`).
    Returns:
        union, union_valid: (B, Hkv, U) block indices, ascending, valid entries first (0 where
        invalid); U = G*K, or `max_loaded` where that is smaller.
    """
    group = scores.shape[1] // num_kv_heads
    if max_loaded is not None and max_loaded < group * num_selected:
        return capped_group_union(
            scores, num_blocks, num_selected, sink_blocks, window_blocks, num_kv_heads, max_loaded
        )
    picked, valid = select_blocks(scores, num_blocks, num_selected, sink_blocks, window_blocks, ordered=False)
    union, union_valid, _ = union_over_group(picked, valid, num_kv_heads, scores.shape[-1], with_head_mask=False)
    return union, union_valid


def capped_group_union(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    num_selected: int,
    sink_blocks: int,
    window_blocks: int,
    num_kv_heads: int,
    max_loaded: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_group_union` with at most `max_loaded` (< G*K) blocks per KV head, ties to the lower index.

    Each query head ranks its row's blocks (sink and window first, then by score; a stable order,
    so equal scores go to the lower block index); a block's group rank is its best rank over the
    group's heads. The union of every head's k best blocks is then the blocks of group rank < k,
    and the KV head loads it for the largest k <= K whose union holds at most `max_loaded` blocks.
    Returns union, union_valid: (B, Hkv, max_loaded), as `select_group_union`'s.
    """
    batch, num_q_heads, capacity = scores.shape
    group = num_q_heads // num_kv_heads
    width = max(capacity, num_selected)
    position = torch.arange(width, device=scores.device)
    key, exists = ranking_keys(scores, num_blocks, width, sink_blocks, window_blocks)
    order = key.sort(dim=-1, descending=True, stable=True).indices  # (B, Hq, N'): the rank-r block at r
    rank = torch.empty_like(order).scatter_(-1, order, position.expand_as(order))  # (B, Hq, N') each block's rank
    group_rank = rank.view(batch, num_kv_heads, group, width).amin(dim=2)  # (B, Hkv, N')
    group_rank = torch.where(exists, group_rank, width)  # blocks past the row's count: never loaded
    # union size at k = blocks of group rank < k, for k = 1..K
    sizes = (group_rank[..., None] < torch.arange(1, num_selected + 1, device=scores.device)).sum(dim=2)  # (B, Hkv, K)
    best_k = (sizes <= max_loaded).sum(dim=-1, keepdim=True)  # sizes grow with k: the fitting ones lead
    chosen = group_rank < best_k  # (B, Hkv, N')
    sort_key = torch.where(chosen, position, width + position)
    if max_loaded > width:  # a table narrower than the cap: the union's width stays the cap
        sort_key = torch.nn.functional.pad(sort_key, (0, max_loaded - width), value=2 * width)
    sort_key, union = sort_key.topk(max_loaded, dim=-1, largest=False)
    union_valid = sort_key < width
    return torch.where(union_valid, union, 0), union_valid


def sparse_decode(
    query: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    head_mask: torch.Tensor | None,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_len: torch.Tensor,
    scaling: float,
    *,
    scales: torch.Tensor | None = None,
    block_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token of attention over the blocks each KV head loaded plus each row's tail block.

    All query heads of a GQA group read the same loaded blocks, as a grouped kernel would.

    Args:
        query: (B, Hq, D).
        pool: (P, 2, S, D) device block cache; [:, 0] keys, [:, 1] values.
        slots: (B, Hkv, U) pool slot of each block the KV head loaded, -1 where unused.
        head_mask: (B, Hq, U) which loaded blocks each query head attends to; None = all of them.
        tail_keys, tail_values: (B, Hkv, S, D) the partial block of each row (the newest tokens).
        tail_len: (B,) valid tokens in each tail block.
        scaling: softmax scale.
        scales: (B, Hkv, U, 2) fp32 key and value scales of each loaded block when the pool holds
            8-bit blocks (`quantize_blocks`); None when it holds the query's dtype.
        block_lse: None, or a (B, Hq, U) fp32 tensor that receives each query head's exact
            log-sum-exp of its scaled logits over each loaded block's S tokens (-inf where the entry
            is unused or the head does not attend it): what the attention knew about each block,
            for the next step's selection.
    Returns:
        (B, Hq, D) in the query's dtype.
    """
    batch, num_q_heads, dim = query.shape
    num_kv_heads, block_size = tail_keys.shape[1], pool.shape[2]
    group = num_q_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, dim)  # (B, Hkv, G, D)
    used = (slots >= 0)[..., None, None, None]  # (B, Hkv, U, 1, 1, 1)
    # Unused entries read slot 0 (clamped) and are zeroed, not just weighted by zero: a pool slot
    # may hold uninitialized memory (the device pool with offload=False), and 0 * NaN is NaN.
    blocks = pool[slots.clamp(min=0)].float()  # (B, Hkv, U, 2, S, D)
    if scales is not None:
        blocks = blocks * scales[..., None, None]
    blocks = torch.where(used, blocks, 0)
    block_logits = torch.einsum("bhgd,bhusd->bhgus", q, blocks[:, :, :, 0]) * scaling  # (B, Hkv, G, U, S)
    attended = (slots >= 0)[:, :, None, :]  # (B, Hkv, 1, U)
    if head_mask is not None:
        attended = attended & head_mask.view(batch, num_kv_heads, group, -1)
    block_logits = block_logits.masked_fill(~attended[..., None], float("-inf"))  # (B, Hkv, G, U, S)
    if block_lse is not None:
        block_lse.copy_(torch.logsumexp(block_logits, dim=-1).reshape(batch, num_q_heads, -1))
    block_logits = block_logits.flatten(3)  # (B, Hkv, G, U*S)
    tail_logits = torch.einsum("bhgd,bhsd->bhgs", q, tail_keys.float()) * scaling  # (B, Hkv, G, S)
    tail_valid = torch.arange(block_size, device=query.device) < tail_len.view(batch, 1, 1, 1)
    tail_logits = tail_logits.masked_fill(~tail_valid, float("-inf"))
    weights = torch.softmax(torch.cat((block_logits, tail_logits), dim=-1), dim=-1)
    block_weights, tail_weights = weights.split([block_logits.shape[-1], block_size], dim=-1)
    out = torch.einsum("bhgus,bhusd->bhgd", block_weights.unflatten(-1, (-1, block_size)), blocks[:, :, :, 1])
    out = out + torch.einsum("bhgs,bhsd->bhgd", tail_weights, tail_values.float())
    return out.reshape(batch, num_q_heads, dim).to(query.dtype)


def begin_decode(
    query: torch.Tensor,
    pool: torch.Tensor,
    resident: torch.Tensor,
    head_mask: torch.Tensor | None,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_len: torch.Tensor,
    scaling: float,
    *,
    scales: torch.Tensor | None = None,
    block_lse: torch.Tensor | None = None,
) -> functools.partial:
    """`sparse_decode` in two halves around a lookup: the first attends the blocks already in the
    pool (`resident` (B, Hkv, U) their slots, -1 elsewhere) and the tails while the lookup loads
    the rest into other slots; `finish_decode(pending, block_ids, block_slot)` attends those and merges.

    The result is `sparse_decode` over the final slots (`block_slot` at each entry's id, equal to
    `resident` wherever it is >= 0), as this spec computes it; a kernel merges the halves' partials
    instead (the same up to the order of float additions). Arguments as `sparse_decode`; `scales`
    and `block_lse` cover every entry (`block_lse` is written by `finish_decode`)."""
    return functools.partial(
        sparse_decode, query, pool, head_mask=head_mask, tail_keys=tail_keys, tail_values=tail_values,
        tail_len=tail_len, scaling=scaling, scales=scales, block_lse=block_lse,
    )  # fmt: skip


def finish_decode(pending: functools.partial, block_ids: torch.Tensor, block_slot: torch.Tensor) -> torch.Tensor:
    """The second half of `begin_decode`: attention over every entry's slot, (B, Hq, D).

    block_ids: (B, Hkv, U) the entries' DRAM ids, -1 where unused; block_slot: (C,) the HBM
    cache's slot of each DRAM id (`lru.LruTables.block_slot`) after the lookup that loaded them."""
    return pending(slots=torch.where(block_ids >= 0, block_slot[block_ids.clamp(min=0)], -1))


def hybrid_parts(metadata: torch.Tensor) -> tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]:
    """Hybrid (..., 2 + sub, D) metadata -> ("quest", (..., 2, D)) and ("cuboid", (..., sub, D)) views."""
    return ("quest", metadata[..., :2, :]), ("cuboid", metadata[..., 2:, :])


def combine_by_rank(first: torch.Tensor, second: torch.Tensor, depth: int | None = None) -> torch.Tensor:
    """Interleave two block rankings: (B, H, N) scores -> (B, H, N) scores whose top-k is the union of
    both rankings' top blocks, taken alternately (first's j-th, second's j-th, first's j+1-th, ...).

    Why: Quest's bound keeps the mass of diffuse early layers, the sub-block mean finds the few
    tokens a retrieval head reads; either alone loses what the other finds.
    Output = -(2 * min(rank1, rank2) + [rank2 < rank1]): exact small integers (ties go to
    `first`); -inf stays -inf (unused table entries).

    `depth`: rank only each ranking's top `depth` blocks, two top-k instead of four full sorts over
    every block; the rest tie at rank `depth`.
    Any top-k with k <= depth is unchanged (the two top-depth lists hold >= depth distinct
    blocks), except that equal scores may break ties either way. None ranks every block.
    """
    if depth is not None:
        return _combine_top_ranks(first, second, min(depth, first.shape[-1]))
    rank1, rank2 = _rank(first), _rank(second)
    combined = -(2 * torch.minimum(rank1, rank2) + (rank2 < rank1).long()).float()
    return combined.masked_fill(torch.isneginf(first) | torch.isneginf(second), float("-inf"))


def _rank(scores: torch.Tensor) -> torch.Tensor:
    """(B, H, N) scores -> (B, H, N) long ranks, 0 = best, -inf entries last, ties by position."""
    return scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)


def _combine_top_ranks(first: torch.Tensor, second: torch.Tensor, depth: int) -> torch.Tensor:
    """`combine_by_rank` over each ranking's top `depth` only, without a full-size rank tensor.

    Block at rank j of `first` scores -2j, at rank j of `second` -(2j + 1), the larger where it is
    in both (= -(2 min(r1, r2) + [r2 < r1])); a block in neither list scores -2 * depth.
    """
    steps = torch.arange(depth, device=first.device, dtype=torch.float32)  # (depth,)
    out = torch.full(first.shape, -2.0 * depth, device=first.device)  # (B, H, N)
    for scores, offset in ((second, 1.0), (first, 0.0)):
        top = scores.topk(depth, dim=-1).indices  # (B, H, depth), best first
        out.scatter_reduce_(-1, top, (-(2 * steps + offset)).expand(top.shape), "amax")
    return out.masked_fill_(torch.isneginf(first) | torch.isneginf(second), float("-inf"))


def score_table(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, kind: str, depth: int | None = None
) -> torch.Tensor:
    """Score each row's block table straight from the metadata pool (no gathered copy).

    Args:
        query: (B, Hq, D) decode queries.
        metadata: (C, M, D) metadata of every DRAM block, indexed by DRAM id.
        block_ids: (B, Hkv, N) DRAM ids of each row's blocks, -1 where the table is unused.
        kind: "quest", "cuboid" or "hybrid", as in `score_blocks`.
        depth: hybrid only: rank just this many top blocks of each ranking (`combine_by_rank`).
    Returns:
        (B, Hq, N) fp32 scores; -inf where the id is -1.
    """
    if kind == "hybrid":  # rank only real blocks: unused entries are -inf before ranking
        parts = (score_table(query, part, block_ids, k) for k, part in hybrid_parts(metadata))
        return combine_by_rank(*parts, depth=depth)
    scores = score_blocks(query, metadata[block_ids.clamp(min=0)], kind)  # (B, Hq, N)
    group = query.shape[1] // block_ids.shape[1]
    unused = (block_ids < 0).repeat_interleave(group, dim=1)  # (B, Hq, N)
    return scores.masked_fill(unused, float("-inf"))


LOAD_COUNTERS = 5  # per (sparse layer, KV head): see `account_loads`


@dataclass(frozen=True)
class LoadCount:
    """Where a step's reads are added (`account_loads`'s arguments but the picks): an op that reads
    the picks anyway (`lru.picked_blocks`) may count them on the way, saving a launch."""

    totals: torch.Tensor  # (Hkv, LOAD_COUNTERS) int64
    num_blocks: torch.Tensor  # (B,)
    tail_len: torch.Tensor  # (B,)
    block_size: int


def account_loads(
    totals: torch.Tensor, valid: torch.Tensor, num_blocks: torch.Tensor, tail_len: torch.Tensor, block_size: int
) -> None:
    """Add one decode step's reads to `totals` (Hkv, LOAD_COUNTERS) int64, in place.

    Per KV head, over the live rows (those holding any token): [0] tokens attention reads (the
    loaded blocks x block_size + the tail's tokens), [1] tokens in the cache, [2] live rows,
    [3] blocks scored (every full block's metadata is read), and [4] += 1 (the calls).

    Args:
        valid: (B, Hkv, U) which of the blocks each KV head loaded are real.
        num_blocks, tail_len: (B,) full blocks and tail tokens of each row.
    """
    tail = tail_len.view(-1, 1)  # (B, 1)
    context = num_blocks.view(-1, 1) * block_size + tail  # (B, 1)
    live = (context > 0).long()
    loaded = (valid.sum(dim=-1) * block_size + tail) * live  # (B, Hkv)
    per_row = torch.cat((context * live, live, num_blocks.view(-1, 1) * live), dim=1)  # (B, 3)
    step = torch.cat((loaded.sum(dim=0)[:, None], per_row.sum(dim=0).expand(loaded.shape[1], 3)), dim=1)
    totals[:, : LOAD_COUNTERS - 1] += step  # (Hkv, 4)
    totals[:, LOAD_COUNTERS - 1] += 1


def gather_blocks(
    pool_src: torch.Tensor,
    src_ids: torch.Tensor,
    pool_dst: torch.Tensor,
    dst_slots: torch.Tensor,
    count: torch.Tensor | None = None,
) -> None:
    """Copy head-blocks `pool_src[src_ids[i]] -> pool_dst[dst_slots[i]]` (FlashH2D's spec).

    Args:
        pool_src: (C, 2, S, D) source pool (the pinned DRAM pool for H2D).
        src_ids: (n,) or (L, n) long source ids (L lists of n entries); -1 entries are skipped.
        pool_dst: (P, 2, S, D) destination pool (the HBM slot pool), same dtype.
        dst_slots: long destination slots, shaped as `src_ids`; -1 entries are skipped.
        count: optional (L,) int tensor (L = 1 for (n,) ids): only the first `count[l]` entries
            of list l are copied (the rest of a fixed-size list is unused, as under CUDA-graph
            capture, where a lookup's per-KV-head load lists are filled on the device).
    """
    src_ids, dst_slots = live_entries(count, src_ids, dst_slots)
    keep = (src_ids >= 0) & (dst_slots >= 0)
    src = src_ids[keep].to(pool_src.device)
    dst = dst_slots[keep].to(pool_dst.device)
    pool_dst[dst] = pool_src[src].to(pool_dst.device, non_blocking=True)


def live_entries(count: torch.Tensor | None, *ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The live entries of each id list, flattened: with a (L,) `count`, the first `count[l]` of
    list l of (L, n) ids (or of (n,) ids when L = 1); every entry when `count` is None.

    Host-side copies select them with a mask (a sync); the FlashH2D kernel reads `count` on the device.
    """
    if count is None:
        return tuple(t.reshape(-1) for t in ids)
    lists = [t.reshape(count.numel(), -1) for t in ids]  # (L, n)
    live = torch.arange(lists[0].shape[1], device=count.device) < count.reshape(-1, 1)  # (L, n)
    return tuple(t[live.to(t.device)] for t in lists)


def scatter_blocks(src_blocks: torch.Tensor, pool_dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Save `src_blocks[i] -> pool_dst[dst_ids[i]]` (the save path's spec).

    Args:
        src_blocks: (n, 2, S, D) blocks on any device (new full blocks on the GPU).
        pool_dst: (C, 2, S, D) destination pool (the pinned DRAM pool), same dtype.
        dst_ids: (n,) long destination ids; -1 entries are skipped.
    """
    keep = dst_ids >= 0
    pool_dst[dst_ids[keep].to(pool_dst.device)] = src_blocks[keep.to(src_blocks.device)].to(pool_dst.device)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, cuda_order: bool = False) -> torch.Tensor:
    """Llama's RMSNorm, op for op: the mean square in float32, the normalized row cast back to the
    input's dtype, then scaled by `weight` (the result in their promoted dtype). (..., H) -> (..., H).

    `cuda_order`: add the mean square's terms in the order PyTorch's CUDA reduction adds them
    (`cuda_row_mean`): run on a GPU, this spec then gives the model's own norm's bits there (every
    other op runs where PyTorch's does; on the CPU only rsqrt rounds differently)."""
    normed = hidden.to(torch.float32)
    squares = normed.pow(2)
    mean_square = cuda_row_mean(squares) if cuda_order else squares.mean(-1, keepdim=True)
    normed = normed * torch.rsqrt(mean_square + eps)
    return weight * normed.to(hidden.dtype)


def add_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, cuda_order: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and the RMSNorm after it, op for op: (rms_norm(residual +
    hidden), residual + hidden), the sum in the inputs' dtype as PyTorch's add rounds it."""
    summed = residual + hidden
    return rms_norm(summed, weight, eps, cuda_order), summed


CUDA_REDUCE_THREADS = 512  # threads of one block of PyTorch's CUDA reduction
CUDA_WARP = 32
CUDA_REDUCE_VECTOR = 4  # float32 elements per vector load


def cuda_reduce_lanes(num_rows: int, width: int) -> int:
    """Threads PyTorch's CUDA reduction gives each row of a (num_rows, width) float32 mean over its
    last dim: the block is `CUDA_REDUCE_THREADS` threads, as wide as the row's vector loads (a power
    of two) and as tall as the rows (a power of two, at most 512 / 32), so few rows get wide lanes.
    Holds where `cuda_row_mean_applies`."""
    vectors = width // CUDA_REDUCE_VECTOR
    row_lanes = _last_pow2(min(vectors, CUDA_REDUCE_THREADS))
    height = min(_last_pow2(min(num_rows, CUDA_REDUCE_THREADS)), CUDA_REDUCE_THREADS // min(row_lanes, CUDA_WARP))
    return min(row_lanes, CUDA_REDUCE_THREADS // height)


def cuda_row_mean(x: torch.Tensor) -> torch.Tensor:
    """x (..., H) float32 -> (..., 1): the mean over the last dim with the additions in the order
    of PyTorch's CUDA reduction for a contiguous input whose H is a multiple of 4 and more than 128:
    - each of a row's L lanes (`cuda_reduce_lanes`) takes every L-th 4-vector, from its own index
      on, into four running sums (one per vector element), added together first to last;
    - the lanes fold down by halves: lane t adds lane t + L/2, then t + L/4, ... t + 1 (through
      shared memory above the warp, by shuffles within it);
    - the sum is scaled by 1/H rounded to float32.
    Each step is an elementwise float32 addition, so this runs the same additions on any device."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if not cuda_row_mean_applies(width):
        raise NotImplementedError(f"cuda_row_mean needs a width that is a multiple of 4 in (128, 8192), got {width}")
    lanes = cuda_reduce_lanes(rows.shape[0], width)
    vectors = width // CUDA_REDUCE_VECTOR
    rounds = -(-vectors // lanes)
    padded = torch.zeros(rows.shape[0], rounds * lanes * CUDA_REDUCE_VECTOR, dtype=torch.float32, device=x.device)
    padded[:, :width] = rows  # +0.0 leaves a sum of squares as it is: lanes past the row add nothing
    chunks = padded.view(rows.shape[0], rounds, lanes, CUDA_REDUCE_VECTOR)
    running = chunks[:, 0]
    for step in range(1, rounds):
        running = running + chunks[:, step]
    total = running[..., 0]
    for element in range(1, CUDA_REDUCE_VECTOR):
        total = total + running[..., element]  # (R, L)
    while total.shape[1] > 1:
        half = total.shape[1] // 2
        total = total[:, :half] + total[:, half:]
    return (total * cuda_mean_scale(width)).view(*x.shape[:-1], 1)


def cuda_row_mean_applies(width: int) -> bool:
    """Whether `cuda_row_mean` describes rows of `width`: vector loads (a multiple of 4, over 128)
    and one warp-row of lanes per row (under 8192 floats: from there a thread would add at least
    16 x (block height) values, and PyTorch splits a row over the block's warps too)."""
    return width % CUDA_REDUCE_VECTOR == 0 and 128 < width < 8192


@functools.cache
def cuda_mean_scale(width: int) -> float:
    """1 / width rounded to float32 (what PyTorch's mean multiplies a row's sum by), as a Python float
    (cached: the fused norm asks for it on every call)."""
    return (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(width), dtype=torch.float32)).item()


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary embedding, op for op: x * cos + rotate_half(x) * sin for q (B, Hq, T, D) and
    k (B, Hk, T, D), with cos and sin (B, T, D) broadcast over the heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def append_token(
    tail: torch.Tensor,
    tail_len: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_blocks: torch.Tensor | None = None,
) -> None:
    """Write one token per row at its tail position and count it, in place.

    tail (B, Hkv, 2, S, D) (keys at [:, :, 0], values at [:, :, 1]); tail_len (B,) long, every
    entry < S; keys and values (B, Hkv, 1, D) in the tail's dtype. `num_blocks` (B,): given, a row
    that holds nothing (no full block, an empty tail) stays empty: an unused slot of a batch cache
    (`SparseServeCache.take_rows`), which a step runs over without storing anything. Fixed shapes
    and no host work, so a CUDA graph can capture it."""
    rows = torch.arange(keys.shape[0], device=tail.device)
    new = torch.stack((keys[:, :, 0], values[:, :, 0]), dim=2)  # (B, Hkv, 2, D)
    if num_blocks is None:
        tail[rows, :, :, tail_len] = new
        tail_len += 1
        return
    held = ((num_blocks > 0) | (tail_len > 0)).long()  # (B,)
    old = tail[rows, :, :, tail_len]
    tail[rows, :, :, tail_len] = torch.where(held.view(-1, 1, 1, 1) > 0, new, old)
    tail_len += held


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's MLP activation, op for op: silu(gate) rounded to its dtype, times up."""
    return torch.nn.functional.silu(gate) * up
