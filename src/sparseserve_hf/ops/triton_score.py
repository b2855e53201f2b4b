"""Block scoring on the GPU: every query head of every row against its ragged block table.

One program scores BLOCK_N blocks of one (row, KV head) for all G query heads of the group:
the block metadata is read once per group (GQA) straight from the metadata pool through the
row's table of DRAM ids, so no (B, Hkv, N, M, D) copy of the metadata is ever gathered. At
128K context and B=32 that copy would be 512 MiB per layer, as much as the scoring reads.
Unused table entries (id -1) score -inf.

The group's queries are one (G, D) tile and every score is a tensor-core product of a
(BLOCK_N, D) metadata tile with it: a cuboid mean scores mean . q, and Quest's bound
sum_d max(q_d min_d, q_d max_d) is max . q+ + min . q- (q+ = max(q, 0), q- = min(q, 0); min <= max
per channel). The products are exact in fp32 for fp16/bf16 inputs, so only the summation
order differs from the reference. Scores of sub-blocks reduce by max in registers and every
output is written once (when, is the knob `STORES_LAST`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference, triton_two_level

KINDS = {"quest": 2, "cuboid": 1}  # metadata vectors per sub-block: (min, max) or (mean,)
BLOCK_BYTES = 32 << 10  # metadata bytes one program reads (blocks per program = this / one block's)
NUM_WARPS = 2
# Write a hybrid block's two scores after both are computed (a launch knob): a store before the
# means' loads keeps the compiler from issuing those loads early (the pointers may alias), so
# each program waits for memory twice. False: each score is stored once it is computed.
STORES_LAST = False
MIN_DOT = 16  # tl.dot's smallest tile side: the group's query tile is padded to it


@triton.jit
def _score_kernel(
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
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUEST_SUB: tl.constexpr,
    MEAN_SUB: tl.constexpr,
    UPCAST: tl.constexpr,
    HALF_PRODUCTS: tl.constexpr,
    STORES_LAST: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes quest/mean[b, h*G:(h+1)*G, n-tile].

    A block's vectors are QUEST_SUB (min_s, max_s) pairs, then MEAN_SUB means: the best
    sub-block Quest bound goes to `quest`, the best sub-block mean score to `mean` (each only
    when its count is > 0; "hybrid" has both: one pair, then the sub-block means). Products run
    in the query's dtype, or in fp32 when UPCAST (tl.dot takes one dtype: an fp32 query, or 16-bit
    metadata of another dtype); 8-bit metadata widens to the query's dtype exactly. HALF_PRODUCTS
    (a bf16 query over 8-bit metadata): the products run in fp16, the dtype fp8 widens to in one
    instruction, over the query scaled by a power of two that puts its largest magnitude in
    [2^13, 2^14): every bf16 element above 2^-32 of that largest one is exact in fp16 (the rest
    would vanish in an fp32 sum anyway), and the scores are scaled back exactly.
    """
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    in_table = n < num_blocks
    ids = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = ids >= 0
    load_mask = valid[:, None] & (d[None, :] < D)
    rows = meta_ptr + ids[:, None] * stride_mc + d[None, :]  # (BLOCK_N, BLOCK_D), vector 0 of each block
    q_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    unscale = 1.0
    if HALF_PRODUCTS:
        dot_dtype = tl.float16
        q, unscale = _scaled_to_half(q)
    elif UPCAST:
        dot_dtype = tl.float32
    else:
        dot_dtype = q_ptr.dtype.element_ty
    q = tl.trans(q.to(dot_dtype))  # (BLOCK_D, BLOCK_G)
    out = b * stride_ob + (h * G + g)[None, :] * stride_oh + n[:, None]  # (BLOCK_N, BLOCK_G)
    out_mask = in_table[:, None] & (g < G)[None, :]
    quest_best = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
    if QUEST_SUB > 0:
        q_pos = tl.maximum(q, 0.0).to(dot_dtype)  # exact: max/min of 16-bit floats compute in fp32
        q_neg = tl.minimum(q, 0.0).to(dot_dtype)
        for s in tl.static_range(QUEST_SUB):
            low = tl.load(rows + (2 * s) * D, mask=load_mask, other=0.0).to(dot_dtype)
            high = tl.load(rows + (2 * s + 1) * D, mask=load_mask, other=0.0).to(dot_dtype)
            bound = tl.dot(high, q_pos, input_precision="ieee") + tl.dot(low, q_neg, input_precision="ieee")
            quest_best = tl.maximum(quest_best, bound)
        if not STORES_LAST:
            tl.store(quest_ptr + out, tl.where(valid[:, None], quest_best * unscale, float("-inf")), mask=out_mask)
    if MEAN_SUB > 0:
        best = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
        for s in tl.static_range(MEAN_SUB):
            mean = tl.load(rows + (2 * QUEST_SUB + s) * D, mask=load_mask, other=0.0).to(dot_dtype)
            best = tl.maximum(best, tl.dot(mean, q, input_precision="ieee"))
        tl.store(mean_ptr + out, tl.where(valid[:, None], best * unscale, float("-inf")), mask=out_mask)
    if QUEST_SUB > 0 and STORES_LAST:
        tl.store(quest_ptr + out, tl.where(valid[:, None], quest_best * unscale, float("-inf")), mask=out_mask)


@triton.jit
def _scaled_to_half(q):
    """q * 2^k as fp32 (exact) with max |q * 2^k| in [2^13, 2^14), and 2^-k; powers of two built
    from exponent bits (no approximate log or exp). A zero query stays zero."""
    wide = q.to(tl.float32)
    largest = tl.max(tl.max(tl.abs(wide), axis=1), axis=0)
    exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    biased = tl.minimum(tl.maximum(127 + 13 - exponent, 1), 253)  # 2^k's biased exponent, 2^-k's normal too
    scale = (biased << 23).to(tl.float32, bitcast=True)
    unscale = ((254 - biased) << 23).to(tl.float32, bitcast=True)
    return wide * scale, unscale


def score_table(
    query: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    kind: str,
    depth: int | None = None,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Scores of every row's block table, read from the metadata pool (see `reference.score_table`).

    `block_n` (blocks per program) and `num_warps` are launch knobs for `eval.bench.score_tuning`
    (None: the block count from the metadata's bytes per block, NUM_WARPS).

    Args:
        query: (B, Hq, D) fp16/bf16/fp32 on the GPU.
        metadata: (C, M, D) metadata pool (rows may be strided, each row's (M, D) contiguous), same
            device, fp16/bf16/fp32 or float8_e4m3fn; M = 2 (quest) or 1 (cuboid) per sub-block (see
            `reference.block_metadata`).
        block_ids: (B, Hkv, N) long DRAM ids, -1 where unused.
        kind: "quest", "cuboid" or "hybrid" (both rankings, combined by `reference.combine_by_rank`).
        depth: hybrid only: rank just each ranking's top `depth` blocks (see `combine_by_rank`).
    Returns:
        (B, Hq, N) fp32; -inf where the id is -1.
    """
    parts = score_parts(query, metadata, block_ids, kind, block_n=block_n, num_warps=num_warps)
    if kind != "hybrid":
        return parts[0]
    if depth is None:
        return reference.combine_by_rank(*parts)
    return triton_two_level.combine_top_ranks(*parts, depth=depth)


def score_parts(
    query: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    kind: str,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The kernel alone: (scores,) for "quest" and "cuboid", (Quest bound, best sub-block mean)
    for "hybrid" (before the rank interleave), each (B, Hq, N) fp32, -inf where the id is -1."""
    if kind not in (*KINDS, "hybrid"):
        raise ValueError(f"unknown metadata kind {kind!r}")
    sub = reference.metadata_sub_blocks(kind, metadata.shape[1])
    if kind == "hybrid":  # both rankings from one pass over the pool
        return _scores(query, metadata, block_ids, 1, sub, block_n, num_warps)
    quest, mean = _scores(
        query, metadata, block_ids, sub if kind == "quest" else 0, sub if kind == "cuboid" else 0, block_n, num_warps
    )
    return (quest if kind == "quest" else mean,)


def _scores(
    query: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    quest_sub: int,
    mean_sub: int,
    block_n: int | None,
    num_warps: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(best sub-block Quest bound, best sub-block mean) scores, each (B, Hq, N) fp32, -inf where the
    id is -1; a part with no sub-blocks comes back unwritten."""
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_blocks = block_ids.shape[1], block_ids.shape[2]
    assert metadata.stride(2) == 1 and metadata.stride(1) == dim and metadata.shape[2] == dim, (
        "pool rows must be (M, D)"
    )
    assert num_q_heads % num_kv_heads == 0 and query.device == metadata.device == block_ids.device
    quest = torch.empty((batch, num_q_heads, num_blocks), dtype=torch.float32, device=query.device)
    mean = torch.empty_like(quest) if mean_sub and quest_sub else quest
    if quest.numel() == 0:
        return quest, mean
    query, block_ids, block_n, num_warps, grid = _launch_plan(query, metadata, block_ids, block_n, num_warps)
    group = num_q_heads // num_kv_heads
    _score_kernel[grid](
        query, metadata, block_ids, quest, mean,
        query.stride(0), query.stride(1), block_ids.stride(0), block_ids.stride(1),
        quest.stride(0), quest.stride(1), metadata.stride(0), num_blocks, num_kv_heads,
        D=dim, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(dim)), G=group,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_N=block_n,
        QUEST_SUB=quest_sub, MEAN_SUB=mean_sub, UPCAST=_needs_fp32_products(query.dtype, metadata.dtype),
        HALF_PRODUCTS=query.dtype == torch.bfloat16 and metadata.element_size() == 1, STORES_LAST=STORES_LAST,
        num_warps=num_warps,
    )  # fmt: skip
    return quest, mean


def _needs_fp32_products(query_dtype: torch.dtype, metadata_dtype: torch.dtype) -> bool:
    """True unless the metadata widens exactly to a 16-bit query's dtype (the same dtype, or 8-bit)."""
    if query_dtype == torch.float32:
        return True
    return metadata_dtype != query_dtype and metadata_dtype.itemsize != 1


def _launch_plan(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_n: int | None, num_warps: int | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, tuple[int, int]]:
    """Unit-stride query and table, blocks per program (~BLOCK_BYTES of metadata each), warps per
    program and the grid."""
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    block_n = block_n or BLOCK_BYTES // (query.shape[-1] * metadata.element_size() * metadata.shape[1])
    block_n = max(MIN_DOT, min(256, triton.next_power_of_2(block_n)))
    batch, num_kv_heads, num_blocks = block_ids.shape
    num_warps = num_warps or NUM_WARPS
    return query, block_ids, block_n, num_warps, (batch * num_kv_heads, triton.cdiv(num_blocks, block_n))
