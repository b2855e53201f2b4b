"""Sparse paged decode attention on the GPU (split-K over the loaded blocks, then a reduce).

Per (row, KV head) the selected blocks sit in scattered HBM slots; every query head of the GQA
group attends to them (optionally only to the blocks its `head_mask` row allows) plus the row's
tail block. The blocks are split over several programs per (row, KV head) so that a decode
batch of a few rows still fills the GPU (flash-decoding); each program keeps an online softmax
in fp32 and writes its partial (max, sum, accumulator); a second kernel merges the partials.
The G query heads of a group ride the rows of one `tl.dot`, so a block is read once per group.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TILE_TOKENS = 64  # tokens per inner iteration: 2 blocks of 32 (16 KiB of bf16 K+V at D=128)
MIN_BLOCKS_PER_SPLIT = 4  # fewer makes the partials' write + reduce cost more than the split gains
PROGRAMS_PER_SM = 4


@triton.jit
def _attend(q, k, v, seen, m, l, acc, scaling, IEEE: tl.constexpr):
    """Online-softmax step: q (BG, BD), k/v (T, BD), seen (BG, T) -> updated m, l (BG,), acc (BG, BD)."""
    if IEEE:  # fp32 inputs: no TF32, so the kernel matches the fp32 reference
        logits = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        logits = tl.dot(q, tl.trans(k))
    logits = tl.where(seen, logits * scaling, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head that has seen nothing yet: no NaN
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    pool_ptr,
    slots_ptr,
    mask_ptr,
    scales_ptr,
    tail_k_ptr,
    tail_v_ptr,
    tail_len_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    stride_qb,
    stride_qh,
    stride_sb,
    stride_sh,
    stride_mb,
    stride_mh,
    stride_tb,
    stride_th,
    stride_ts,
    num_kv_heads,
    num_loaded,
    num_splits,
    scaling,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_LOADED: tl.constexpr,
    TAIL_TOKENS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    IEEE: tl.constexpr,
    MIN_PER_SPLIT: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Grid (B * Hkv, num_splits + 1): programs < num_splits share the row's used blocks, the last
    one takes the tail block. Writes partials [b, h*G + g, split].

    SCALED: the pool holds 8-bit blocks, dequantized here with each entry's (key, value) scales,
    laid out as the slots with a trailing 2.

    Selections hold their unused (-1) entries last, often most of U, and how many are used is known
    only here: each (row, KV head) cuts its used prefix into equal whole-tile ranges (at least
    MIN_PER_SPLIT blocks each), so the work spreads over every split program whatever U is."""
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    heads = h * G + g
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if split < num_splits:
        entries = tl.arange(0, BLOCK_LOADED)
        row_slots = tl.load(slots_ptr + b * stride_sb + h * stride_sh + entries, mask=entries < num_loaded, other=-1)
        used_end = tl.max(tl.where(row_slots >= 0, entries + 1, 0), axis=0)
        per_split = tl.maximum(tl.cdiv(used_end, num_splits), MIN_PER_SPLIT)
        per_split = tl.cdiv(per_split, BLOCK_U) * BLOCK_U  # whole tiles
        start = split * per_split
        end = tl.minimum(start + per_split, used_end)
        t = tl.arange(0, BLOCK_U * S)
        for first in range(start, end, BLOCK_U):
            u = first + t // S  # (T,) loaded-block index of each token
            slot = tl.load(slots_ptr + b * stride_sb + h * stride_sh + u, mask=u < end, other=-1).to(tl.int64)
            token_ok = slot >= 0
            base = pool_ptr + slot * (2 * S * D) + (t % S) * D  # (T,) pool is (P, 2, S, D)
            kv_mask = token_ok[:, None] & d_ok[None, :]
            k = tl.load(base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(base[:, None] + S * D + d[None, :], mask=kv_mask, other=0.0)
            if SCALED:  # 8-bit blocks: widen, scale, and attend in the query's dtype
                entry = (b * stride_sb + h * stride_sh + u) * 2
                k_scale = tl.load(scales_ptr + entry, mask=token_ok, other=0.0)
                v_scale = tl.load(scales_ptr + entry + 1, mask=token_ok, other=0.0)
                k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            seen = g_ok[:, None] & token_ok[None, :]
            if HAS_MASK:
                allowed = tl.load(
                    mask_ptr + b * stride_mb + heads[:, None] * stride_mh + u[None, :],
                    mask=g_ok[:, None] & (u < end)[None, :],
                    other=0,
                )
                seen = seen & (allowed != 0)
            m, l, acc = _attend(q, k, v, seen, m, l, acc, scaling, IEEE)
    else:
        # Names differ from the branch above: Triton needs a name bound in both branches to keep one type.
        tail_t = tl.arange(0, TAIL_TOKENS)
        tail_ok = tail_t < tl.load(tail_len_ptr + b)
        tail_offsets = b * stride_tb + h * stride_th + tail_t[:, None] * stride_ts + d[None, :]
        tail_mask = tail_ok[:, None] & d_ok[None, :]
        tail_k = tl.load(tail_k_ptr + tail_offsets, mask=tail_mask, other=0.0)
        tail_v = tl.load(tail_v_ptr + tail_offsets, mask=tail_mask, other=0.0)
        m, l, acc = _attend(q, tail_k, tail_v, g_ok[:, None] & tail_ok[None, :], m, l, acc, scaling, IEEE)
    part = (b * num_kv_heads * G + heads) * (num_splits + 1) + split  # (BG,) partials are (B, Hq, splits+1)
    tl.store(part_m_ptr + part, m, mask=g_ok)
    tl.store(part_l_ptr + part, l, mask=g_ok)
    tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    num_parts,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Grid (B * Hq,): merge one query head's partials into out[b, hq] (contiguous (B, Hq, D))."""
    head = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < num_parts
    m = tl.load(part_m_ptr + head * num_parts + p, mask=p_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + head * num_parts + p, mask=p_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + (head * num_parts + p)[:, None] * D + d[None, :],
        mask=p_ok[:, None] & (d < D)[None, :],
        other=0.0,
    )
    top = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # empty partials weigh 0
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * l, axis=0)
    tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_plan(num_programs: int, num_loaded: int, device: torch.device) -> int:
    """Split programs per (row, KV head): enough to fill the GPU, no more than U's few-block ranges."""
    if num_loaded == 0:
        return 0
    target = PROGRAMS_PER_SM * (_num_sms(device.index or 0) if device.type == "cuda" else 1)
    return max(1, min(triton.cdiv(target, max(num_programs, 1)), triton.cdiv(num_loaded, MIN_BLOCKS_PER_SPLIT)))


def sparse_decode(
    query: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    head_mask: torch.Tensor | None,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_len: torch.Tensor,
    scaling: float,
    num_splits: int | None = None,
    *,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.sparse_decode` as two Triton launches (split-K partials, then their merge).

    Args:
        query: (B, Hq, D) fp16/bf16/fp32, last dim contiguous.
        pool: (P, 2, S, D) contiguous HBM block cache, same dtype.
        slots: (B, Hkv, U) pool slot of each loaded block, -1 where unused.
        head_mask: (B, Hq, U) bool, which loaded blocks each query head sees; None = all.
        tail_keys, tail_values: (B, Hkv, S, D) views with equal strides (e.g. tail[:, :, 0] / [:, :, 1]).
        tail_len: (B,) valid tokens of each tail block.
        scaling: softmax scale.
        num_splits: programs per (row, KV head) sharing its used blocks (each takes at least a few
            blocks, so some may have none); None = enough to fill the GPU.
        scales: (B, Hkv, U, 2) fp32 key/value scales of each entry when `pool` holds 8-bit blocks.
    Returns:
        (B, Hq, D) in the query's dtype. Launches only: no host sync.
    """
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_loaded = slots.shape[1], slots.shape[2]
    block_size = pool.shape[2]
    assert pool.is_contiguous() and query.dtype == tail_keys.dtype == tail_values.dtype
    assert (
        pool.dtype == query.dtype if scales is None else (pool.element_size() == 1 and scales.shape[:3] == slots.shape)
    )
    assert tail_keys.stride() == tail_values.stride() and tail_keys.stride(-1) == 1 and query.stride(-1) == 1
    assert num_q_heads % num_kv_heads == 0 and pool.shape[3] == dim
    slots = slots.contiguous()
    mask = head_mask.contiguous().view(torch.uint8) if head_mask is not None else slots  # slots: unused pointer
    scale_table = scales.float().contiguous() if scales is not None else query  # query: unused pointer
    block_u = max(1, TILE_TOKENS // block_size)
    if num_splits is None:
        num_splits = _split_plan(batch * num_kv_heads, num_loaded, query.device)
    else:
        num_splits = min(max(num_splits, 1), triton.cdiv(num_loaded, MIN_BLOCKS_PER_SPLIT)) if num_loaded else 0
    num_parts = num_splits + 1
    part_m = torch.empty((batch, num_q_heads, num_parts), dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, num_q_heads, num_parts, dim), dtype=torch.float32, device=query.device)
    group = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(max(dim, 16))  # tl.dot needs every side >= 16
    _decode_split_kernel[(batch * num_kv_heads, num_parts)](
        query, pool, slots, mask, scale_table, tail_keys, tail_values, tail_len, part_m, part_l, part_acc,
        query.stride(0), query.stride(1), slots.stride(0), slots.stride(1),
        mask.stride(0), mask.stride(1), tail_keys.stride(0), tail_keys.stride(1), tail_keys.stride(2),
        num_kv_heads, num_loaded, num_splits, scaling,
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        S=block_size,
        D=dim,
        BLOCK_D=block_d,
        BLOCK_U=block_u,
        BLOCK_LOADED=triton.next_power_of_2(max(num_loaded, 1)),
        TAIL_TOKENS=max(16, block_size),
        HAS_MASK=head_mask is not None,
        IEEE=query.dtype == torch.float32,
        MIN_PER_SPLIT=MIN_BLOCKS_PER_SPLIT,
        SCALED=scales is not None,
        num_warps=4,
    )  # fmt: skip
    out = torch.empty((batch, num_q_heads, dim), dtype=query.dtype, device=query.device)
    _decode_reduce_kernel[(batch * num_q_heads,)](
        part_m, part_l, part_acc, out, num_parts, D=dim, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(num_parts)
    )
    return out
