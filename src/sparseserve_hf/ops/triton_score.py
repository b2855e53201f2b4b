"""Block scoring on the GPU: every query head of every row against its ragged block table.

One program scores BLOCK_N blocks of one (row, KV head) for all G query heads of the group at
once, as a (BLOCK_N, G) fp32 tile: each metadata vector is read once per group (GQA) straight
from the metadata pool through the row's table of DRAM ids, so no (B, Hkv, N, M, D) copy of the
metadata is ever gathered (at 128K context and B=32 that copy would be 512 MiB per layer, as much
as the scoring reads). Unused table entries (id -1) score -inf.

Why this shape (H200, Llama-3-8B: Hq 32, Hkv 8, D 128, bf16, B=32, N=4095): the first version
scored one head and one sub-block at a time and kept the running max over sub-blocks in the
output, S * G dependent load/store round trips per program, each store also holding back the
next metadata load (the compiler cannot tell the pointers apart). Quest took 205 us (512 MiB,
0.66 of copy bandwidth) and hybrid's cuboid pass ~557 us for its 1 GiB of means (~1.9 TB/s of
~4.2), after a separate quest pass over the same rows. Now the running max stays in registers,
every output is stored once, after all loads, and hybrid scores both parts of a row (quest over
its min/max, cuboid over its means) in one pass: each block's metadata is read once.

Layout: each metadata vector is loaded as a (BLOCK_N, 1, BLOCK_D) tile, so Triton's coalesced load
layout (8 channels a thread, 16 threads a 128-channel row) carries over to the (BLOCK_N, G_PAD,
BLOCK_D) product and the G heads of a channel stay in one thread; the sum over D is then 8 adds
in the thread and a 16-lane shuffle tree. A (BLOCK_N, BLOCK_D) load expanded afterwards got one
channel a thread (sm_90 build: 14x the shuffles). No tl.dot: small G would be padded to its
minimum width, and fp32 inputs would go through TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference

KINDS = {"quest": 2, "cuboid": 1}  # metadata vectors per sub-block: (min, max) or (mean,)
# fp32 products of one (BLOCK_N, G_PAD, BLOCK_D) tile, 64 a thread at 4 warps: the default BLOCK_N,
# 16 blocks at G = 4, D = 128 (Llama-3-8B; sm_90 build of hybrid: 80 registers, no spills), 8 at G = 8.
TILE_ELEMENTS = 8192
NUM_WARPS = 4


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
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr,
    MEANS: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes out[b, h*G:(h+1)*G, n-tile] of quest and/or mean.

    A row holds PAIRS (min_s, max_s) pairs, then MEANS mean vectors (quest: PAIRS = sub-blocks,
    MEANS = 0; cuboid: 0, sub-blocks; hybrid: 1, sub-blocks). Quest's score is the best pair's
    bound, written to quest_ptr; cuboid's the best mean's q . mean, written to mean_ptr.
    """
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    in_table = n < num_blocks
    ids = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = ids >= 0
    rows = meta_ptr + ids[:, None, None] * stride_mc + d[None, None, :]  # (BLOCK_N, 1, BLOCK_D): vector 0
    row_mask = valid[:, None, None] & (d[None, None, :] < D)
    heads = h * G + g  # (G_PAD,): padded heads load q = 0 and are never stored
    q_mask = (g[None, :, None] < G) & (d[None, None, :] < D)
    q = tl.load(q_ptr + b * stride_qb + heads[None, :, None] * stride_qh + d[None, None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)  # (1, G_PAD, BLOCK_D)
    # Every store after every metadata load: a store in between would hold the later loads back.
    if PAIRS > 0:
        quest = _best_quest(rows, row_mask, q, D, PAIRS)
    if MEANS > 0:
        mean = _best_mean(rows + 2 * PAIRS * D, row_mask, q, D, MEANS)
    out = b * stride_ob + heads[None, :] * stride_oh + n[:, None]  # (BLOCK_N, G_PAD)
    out_mask = in_table[:, None] & (g[None, :] < G)
    if PAIRS > 0:
        tl.store(quest_ptr + out, tl.where(valid[:, None], quest, float("-inf")), mask=out_mask)
    if MEANS > 0:
        tl.store(mean_ptr + out, tl.where(valid[:, None], mean, float("-inf")), mask=out_mask)


@triton.jit
def _best_quest(rows, mask, q, D: tl.constexpr, PAIRS: tl.constexpr):
    """(BLOCK_N, G_PAD): max over the PAIRS (min, max) pairs at `rows` of sum_d max(q_d min_d, q_d max_d).

    Written as Quest's max rather than q+ . max + q- . min: one q tile instead of three in registers.
    """
    for s in tl.static_range(PAIRS):
        lo = tl.load(rows + (2 * s) * D, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_N, 1, BLOCK_D)
        hi = tl.load(rows + (2 * s + 1) * D, mask=mask, other=0.0).to(tl.float32)
        score = tl.sum(tl.maximum(q * lo, q * hi), axis=2)  # (BLOCK_N, G_PAD)
        if s == 0:
            best = score
        else:
            best = tl.maximum(best, score)
    return best


@triton.jit
def _best_mean(rows, mask, q, D: tl.constexpr, MEANS: tl.constexpr):
    """(BLOCK_N, G_PAD): max over the MEANS mean vectors at `rows` of q . mean."""
    for s in tl.static_range(MEANS):
        mean = tl.load(rows + s * D, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_N, 1, BLOCK_D)
        score = tl.sum(q * mean, axis=2)  # (BLOCK_N, G_PAD)
        if s == 0:
            best = score
        else:
            best = tl.maximum(best, score)
    return best


def _row_layout(kind: str, num_vectors: int) -> tuple[int, int]:
    """(min/max pairs, mean vectors) of one (M, D) metadata row of `kind` (see `reference.block_metadata`)."""
    if kind == "hybrid":
        return 1, reference.metadata_sub_blocks(kind, num_vectors)
    if kind not in KINDS:
        raise ValueError(f"unknown metadata kind {kind!r}")
    if num_vectors % KINDS[kind]:
        raise ValueError(f"{kind} metadata holds {KINDS[kind]} vectors per sub-block, got {num_vectors} per block")
    return (num_vectors // 2, 0) if kind == "quest" else (0, num_vectors)


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

    One kernel pass over the table for every kind: hybrid scores quest and cuboid together and
    combines the two rankings on the device. `block_n` (blocks per program; default from
    `TILE_ELEMENTS`) and `num_warps` are launch knobs for `eval.bench.score_tuning`.

    Args:
        query: (B, Hq, D) fp16/bf16/fp32 on the GPU.
        metadata: (C, M, D) metadata pool (rows may be strided, each row's (M, D) contiguous), same
            device; M = 2 (quest) or 1 (cuboid) per sub-block, 2 + sub-blocks for hybrid (see
            `reference.block_metadata`).
        block_ids: (B, Hkv, N) long DRAM ids, -1 where unused.
        kind: "quest", "cuboid" or "hybrid" (both rankings, combined by `reference.combine_by_rank`).
        depth: hybrid only: rank just each ranking's top `depth` blocks (see `combine_by_rank`).
    Returns:
        (B, Hq, N) fp32; -inf where the id is -1 (hybrid: minus the combined rank).
    """
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_blocks = block_ids.shape[1], block_ids.shape[2]
    pairs, means = _row_layout(kind, metadata.shape[1])
    assert metadata.stride(2) == 1 and metadata.stride(1) == dim and metadata.shape[2] == dim, (
        "pool rows must be (M, D)"
    )
    assert num_q_heads % num_kv_heads == 0 and query.device == metadata.device == block_ids.device
    parts = int(pairs > 0) + int(means > 0)  # hybrid: both scores, from one read of each row
    out = torch.empty((parts, batch, num_q_heads, num_blocks), dtype=torch.float32, device=query.device)
    if out.numel():
        _launch(query, metadata, block_ids, out, pairs, means, block_n, num_warps)
    return reference.combine_by_rank(out[0], out[1], depth=depth) if kind == "hybrid" else out[0]


def _launch(
    query: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    out: torch.Tensor,
    pairs: int,
    means: int,
    block_n: int | None,
    num_warps: int,
) -> None:
    """Runs `_score_kernel` into `out` (parts, B, Hq, N): quest's scores into out[0], cuboid's into out[-1]."""
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_blocks = block_ids.shape[1], block_ids.shape[2]
    group = num_q_heads // num_kv_heads
    group_pad, block_d = triton.next_power_of_2(group), triton.next_power_of_2(dim)
    block_n = triton.next_power_of_2(block_n or TILE_ELEMENTS // (group_pad * block_d))
    block_n = max(8, min(256, block_n))
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    grid = (batch * num_kv_heads, triton.cdiv(num_blocks, block_n))
    _score_kernel[grid](
        query,
        metadata,
        block_ids,
        out[0],
        out[-1],
        query.stride(0),
        query.stride(1),
        block_ids.stride(0),
        block_ids.stride(1),
        out.stride(1),
        out.stride(2),
        metadata.stride(0),
        num_blocks,
        num_kv_heads,
        D=dim,
        BLOCK_D=block_d,
        G=group,
        G_PAD=group_pad,
        BLOCK_N=block_n,
        PAIRS=pairs,
        MEANS=means,
        num_warps=num_warps,
    )


def score_blocks(query: torch.Tensor, metadata: torch.Tensor, kind: str) -> torch.Tensor:
    """`reference.score_blocks` on the GPU: (B, Hq, D) x (B, Hkv, N, M, D) gathered metadata -> (B, Hq, N)."""
    batch, num_kv_heads, num_blocks = metadata.shape[:3]
    pool = metadata.reshape(-1, *metadata.shape[3:])  # (B*Hkv*N, M, D): the gathered table as a pool
    ids = torch.arange(pool.shape[0], device=metadata.device).view(batch, num_kv_heads, num_blocks)
    return score_table(query, pool.contiguous(), ids, kind)
