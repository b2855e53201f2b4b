"""Block scoring on the GPU: every query head of every row against its ragged block table.

One program scores BLOCK_N blocks of one (row, KV head) for all G query heads of the group:
the block metadata is read once per group (GQA) straight from the metadata pool through the
row's table of DRAM ids, so no (B, Hkv, N, M, D) copy of the metadata is ever gathered. At
128K context and B=32 that copy would be 512 MiB per layer, as much as the scoring reads.
Unused table entries (id -1) score -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference, triton_rank

KINDS = {"quest": 2, "cuboid": 1}  # metadata vectors per sub-block: (min, max) or (mean,)
BLOCK_BYTES = 16 << 10  # metadata bytes one program reads (blocks per program = this / one block's)
NUM_WARPS = 4


@triton.jit
def _score_kernel(
    q_ptr,
    meta_ptr,
    ids_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_ib,
    stride_ih,
    stride_ob,
    stride_oh,
    stride_mc,
    num_blocks,
    num_kv_heads,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    M: tl.constexpr,
    SUB: tl.constexpr,
    QUEST: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes out[b, h*G:(h+1)*G, n-tile].

    A block's M = SUB * (2 or 1) vectors are (min_s, max_s) pairs or means, one per sub-block s;
    its score is the max over sub-blocks. Each sub-block's metadata is read once for the whole
    group; the running max lives in `out` (this program alone owns those entries).
    """
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    in_table = n < num_blocks
    ids = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = ids >= 0
    load_mask = valid[:, None] & (d[None, :] < D)
    for s in tl.static_range(SUB):
        rows = meta_ptr + ids[:, None] * stride_mc + (s * (M // SUB)) * D + d[None, :]  # (BLOCK_N, BLOCK_D)
        first = tl.load(rows, mask=load_mask, other=0.0).to(tl.float32)  # quest: per-channel min; cuboid: mean
        if QUEST:
            second = tl.load(rows + D, mask=load_mask, other=0.0).to(tl.float32)  # per-channel max
        for g in tl.static_range(G):
            head = h * G + g
            q = tl.load(q_ptr + b * stride_qb + head * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
            if QUEST:
                # Quest's upper bound of q.k over the (sub-)block: per channel the larger of q*min, q*max.
                score = tl.sum(tl.maximum(q[None, :] * first, q[None, :] * second), axis=1)
            else:
                score = tl.sum(q[None, :] * first, axis=1)
            score = tl.where(valid, score, float("-inf"))
            out = out_ptr + b * stride_ob + head * stride_oh + n
            if s > 0:
                score = tl.maximum(score, tl.load(out, mask=in_table, other=float("-inf")))
            tl.store(out, score, mask=in_table)


@triton.jit
def _hybrid_score_kernel(
    q_ptr,
    meta_ptr,
    ids_ptr,
    quest_ptr,
    mean_ptr,
    stride_qb,
    stride_qh,
    stride_ib,
    stride_ih,
    stride_ob,
    stride_oh,
    stride_mc,
    num_blocks,
    num_kv_heads,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
):
    """Both hybrid scores in one pass: grid (B * Hkv, cdiv(N, BLOCK_N)).

    A block's metadata rows are (min, max, mean_0 .. mean_{SUB-1}): the Quest bound of the block
    goes to `quest`, the best sub-block mean score to `mean`. The table and each block's rows are
    read once for both rankings and the whole group.
    """
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    in_table = n < num_blocks
    ids = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = ids >= 0
    load_mask = valid[:, None] & (d[None, :] < D)
    rows = meta_ptr + ids[:, None] * stride_mc + d[None, :]  # (BLOCK_N, BLOCK_D), vector 0 of each block
    low = tl.load(rows, mask=load_mask, other=0.0).to(tl.float32)
    high = tl.load(rows + D, mask=load_mask, other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        head = h * G + g
        q = tl.load(q_ptr + b * stride_qb + head * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
        bound = tl.sum(tl.maximum(q[None, :] * low, q[None, :] * high), axis=1)
        out = b * stride_ob + head * stride_oh + n
        tl.store(quest_ptr + out, tl.where(valid, bound, float("-inf")), mask=in_table)
    for s in tl.static_range(SUB):
        mean = tl.load(rows + (2 + s) * D, mask=load_mask, other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            head = h * G + g
            q = tl.load(q_ptr + b * stride_qb + head * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
            score = tl.where(valid, tl.sum(q[None, :] * mean, axis=1), float("-inf"))
            out = mean_ptr + b * stride_ob + head * stride_oh + n
            if s > 0:
                score = tl.maximum(score, tl.load(out, mask=in_table, other=float("-inf")))
            tl.store(out, score, mask=in_table)


def score_table(
    query: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    kind: str,
    depth: int | None = None,
    *,
    block_n: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Scores of every row's block table, read from the metadata pool (see `reference.score_table`).

    `block_n` (blocks per program) and `num_warps` are launch knobs for `eval.bench.score_tuning`.

    Args:
        query: (B, Hq, D) fp16/bf16/fp32 on the GPU.
        metadata: (C, M, D) metadata pool (rows may be strided, each row's (M, D) contiguous), same device; M = 2 (quest) or 1 (cuboid) per
            sub-block (see `reference.block_metadata`).
        block_ids: (B, Hkv, N) long DRAM ids, -1 where unused.
        kind: "quest", "cuboid" or "hybrid" (both rankings, combined by `reference.combine_by_rank`).
        depth: hybrid only: rank just each ranking's top `depth` blocks (see `combine_by_rank`).
    Returns:
        (B, Hq, N) fp32; -inf where the id is -1.
    """
    if kind == "hybrid":  # both rankings in one pass over the pool, combined on the device
        parts = _hybrid_scores(query, metadata, block_ids, block_n, num_warps)
        if depth is None:
            return reference.combine_by_rank(*parts)
        return triton_rank.combine_top_ranks(*parts, depth=depth)
    if kind not in KINDS:
        raise ValueError(f"unknown metadata kind {kind!r}")
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_blocks = block_ids.shape[1], block_ids.shape[2]
    num_vectors = metadata.shape[1]
    if num_vectors % KINDS[kind]:
        raise ValueError(f"{kind} metadata holds {KINDS[kind]} vectors per sub-block, got {num_vectors} per block")
    assert metadata.stride(2) == 1 and metadata.stride(1) == dim and metadata.shape[2] == dim, (
        "pool rows must be (M, D)"
    )
    assert num_q_heads % num_kv_heads == 0 and query.device == metadata.device == block_ids.device
    out = torch.empty((batch, num_q_heads, num_blocks), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    query, block_ids, block_n, grid = _launch_plan(query, metadata, block_ids, block_n)
    _score_kernel[grid](
        query,
        metadata,
        block_ids,
        out,
        query.stride(0),
        query.stride(1),
        block_ids.stride(0),
        block_ids.stride(1),
        out.stride(0),
        out.stride(1),
        metadata.stride(0),
        num_blocks,
        num_kv_heads,
        D=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        G=num_q_heads // num_kv_heads,
        BLOCK_N=block_n,
        M=num_vectors,
        SUB=num_vectors // KINDS[kind],
        QUEST=kind == "quest",
        num_warps=num_warps,
    )
    return out


def _hybrid_scores(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_n: int | None, num_warps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Quest bound, best sub-block mean) scores, each (B, Hq, N) fp32, -inf where the id is -1."""
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_blocks = block_ids.shape[1], block_ids.shape[2]
    num_vectors = metadata.shape[1]
    if num_vectors < 3:
        raise ValueError(f"hybrid metadata holds min, max and >= 1 mean per block, got {num_vectors} vectors")
    assert metadata.stride(2) == 1 and metadata.stride(1) == dim, "pool rows must be (M, D)"
    quest = torch.empty((batch, num_q_heads, num_blocks), dtype=torch.float32, device=query.device)
    mean = torch.empty_like(quest)
    if quest.numel() == 0:
        return quest, mean
    query, block_ids, block_n, grid = _launch_plan(query, metadata, block_ids, block_n)
    _hybrid_score_kernel[grid](
        query, metadata, block_ids, quest, mean,
        query.stride(0), query.stride(1), block_ids.stride(0), block_ids.stride(1),
        quest.stride(0), quest.stride(1), metadata.stride(0), num_blocks, num_kv_heads,
        D=dim, BLOCK_D=triton.next_power_of_2(dim), G=num_q_heads // num_kv_heads, BLOCK_N=block_n,
        SUB=num_vectors - 2, num_warps=num_warps,
    )  # fmt: skip
    return quest, mean


def _launch_plan(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_n: int | None
) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, int]]:
    """Unit-stride query and table, blocks per program (~BLOCK_BYTES of metadata each) and the grid."""
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    block_n = block_n or BLOCK_BYTES // (query.shape[-1] * metadata.element_size() * metadata.shape[1])
    block_n = max(16, min(256, triton.next_power_of_2(block_n)))
    batch, num_kv_heads, num_blocks = block_ids.shape
    return query, block_ids, block_n, (batch * num_kv_heads, triton.cdiv(num_blocks, block_n))


def score_blocks(query: torch.Tensor, metadata: torch.Tensor, kind: str) -> torch.Tensor:
    """`reference.score_blocks` on the GPU: (B, Hq, D) x (B, Hkv, N, M, D) gathered metadata -> (B, Hq, N)."""
    batch, num_kv_heads, num_blocks = metadata.shape[:3]
    pool = metadata.reshape(-1, *metadata.shape[3:])  # (B*Hkv*N, M, D): the gathered table as a pool
    ids = torch.arange(pool.shape[0], device=metadata.device).view(batch, num_kv_heads, num_blocks)
    return score_table(query, pool.contiguous(), ids, kind)
