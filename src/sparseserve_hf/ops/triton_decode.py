"""Sparse paged decode attention on the GPU (split-K over the loaded blocks, then a reduce).

Per (row, KV head) the selected blocks sit in scattered HBM slots; every query head of the GQA
group attends to them (optionally only to the blocks its `head_mask` row allows) plus the row's
tail block. The blocks are split over several programs per (row, KV head) so that a decode
batch of a few rows still fills the GPU (flash-decoding); each program keeps an online softmax
in fp32 and writes its partial (max, sum, accumulator); a second kernel merges the partials.
The G query heads of a group ride the rows of one `tl.dot`, so a block is read once per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device_info import sm_count

TILE_TOKENS = 64  # tokens per inner iteration: 2 blocks of 32 (16 KiB of bf16 K+V at D=128)
MIN_BLOCKS_PER_SPLIT = 4  # fewer makes the partials' write + reduce cost more than the split gains
PROGRAMS_PER_SM = 4
# Beside a lookup (`begin_decode`) half as many: a second wave of split programs would wait behind
# the lookup's and the miss copy's programs, which share the SMs meanwhile.
PROGRAMS_PER_SM_BESIDE_LOOKUP = 2
SPLIT_WARPS = 4  # warps of a split program (a launch knob)
SPLIT_STAGES = 3  # software-pipelining stages of its block loop (a launch knob; Triton's default)


@triton.jit
def _attend(q, k, v, seen, m, l, acc, scaling, IEEE: tl.constexpr):
    """Online-softmax step: q (BG, BD), k/v (T, BD), seen (BG, T) -> updated m, l (BG,), acc (BG, BD),
    and the step's scaled logits (BG, T), -inf where not seen."""
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
    return m_new, l, acc, logits


@triton.jit
def _store_block_lse(
    lse_ptr, head_rows, g_ok, u, block_ok, logits, BG: tl.constexpr, BU: tl.constexpr, S: tl.constexpr
):
    """Each of a tile's BU blocks' log-sum-exp of its S logits per head into lse[head_rows + u]
    (`reference.sparse_decode`'s `block_lse`): logits (BG, BU * S); u, block_ok (BU * S,) each token's
    entry and whether its block is attended here; head_rows (BG,) each head's row of lse."""
    per_block = tl.reshape(logits, (BG, BU, S))
    top = tl.max(per_block, axis=2)  # (BG, BU)
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(per_block - safe[:, :, None]), axis=2)
    lse = tl.where(top == float("-inf"), float("-inf"), safe + tl.log(tl.maximum(total, 1e-30)))  # nothing seen: -inf
    entry = tl.max(tl.reshape(u, (BU, S)), axis=1)  # (BU,): the tokens of a block share its entry
    ok = tl.max(tl.reshape(block_ok.to(tl.int32), (BU, S)), axis=1) > 0
    tl.store(lse_ptr + head_rows[:, None] + entry[None, :], lse, mask=g_ok[:, None] & ok[None, :])


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
    resident_ptr,
    late_entries_ptr,
    block_slot_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_sb,
    stride_sh,
    stride_mb,
    stride_mh,
    stride_tb,
    stride_th,
    stride_ts,
    stride_lb,
    stride_lh,
    num_kv_heads,
    num_loaded,
    num_splits,
    first_part,
    num_parts,
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
    LATE: tl.constexpr,
    BLOCK_LSE: tl.constexpr,
):
    """Grid (B * Hkv, num_splits + 1): programs < num_splits share the row's used blocks, the last
    one takes the tail block. Writes partials [b, h*G + g, first_part + split] of num_parts.

    SCALED: the pool holds 8-bit blocks, dequantized here with each entry's (key, value) scales,
    laid out as the slots with a trailing 2.

    BLOCK_LSE: each attended entry's log-sum-exp of its logits per head goes to lse (B, Hq, U) at
    strides (stride_lb, stride_lh, 1); entries no program attends are left as they are.

    LATE (grid (B * Hkv, num_splits), no tail program): `slots` holds DRAM block ids, and only the
    entries that `resident` (laid out as the ids) held at -1 are attended, each at the slot the
    block -> slot table `block_slot` now gives its id: the blocks a lookup loaded after the
    resident ones were attended. Each program lists the row's late entries in order into its own
    row of `late_entries` (B * Hkv * num_splits, BLOCK_LOADED) and takes its share of that list.

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
        row = b * stride_sb + h * stride_sh
        row_slots = tl.load(slots_ptr + row + entries, mask=entries < num_loaded, other=-1)
        if LATE:  # row_slots holds the entries' block ids
            resident = tl.load(resident_ptr + row + entries, mask=entries < num_loaded, other=-1)
            late = (resident < 0) & (row_slots >= 0)
            late_list = late_entries_ptr + (row_head * num_splits + split).to(tl.int64) * BLOCK_LOADED
            tl.store(late_list + tl.cumsum(late.to(tl.int32), axis=0) - 1, entries, mask=late)
            used_end = tl.sum(late.to(tl.int32), axis=0)
            tl.debug_barrier()  # the list is written before any lane reads it
        else:
            used_end = tl.max(tl.where(row_slots >= 0, entries + 1, 0), axis=0)
        per_split = tl.maximum(tl.cdiv(used_end, num_splits), MIN_PER_SPLIT)
        per_split = tl.cdiv(per_split, BLOCK_U) * BLOCK_U  # whole tiles
        start = split * per_split
        end = tl.minimum(start + per_split, used_end)
        t = tl.arange(0, BLOCK_U * S)
        head_rows = b * stride_lb + heads * stride_lh  # (BG,) each head's row of lse (BLOCK_LSE)
        for first in range(start, end, BLOCK_U):
            j = first + t // S  # (T,) position of each token's block in the row's (late) list
            if LATE:
                u = tl.load(late_list + j, mask=j < end, other=0)
            else:
                u = j  # (T,) loaded-block index of each token
            slot = tl.load(slots_ptr + row + u, mask=j < end, other=-1).to(tl.int64)
            if LATE:  # a block id: its slot from the table
                slot = tl.load(block_slot_ptr + slot, mask=slot >= 0, other=-1).to(tl.int64)
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
                    mask=g_ok[:, None] & (j < end)[None, :],
                    other=0,
                )
                seen = seen & (allowed != 0)
            m, l, acc, logits = _attend(q, k, v, seen, m, l, acc, scaling, IEEE)
            if BLOCK_LSE:
                _store_block_lse(lse_ptr, head_rows, g_ok, u, token_ok & (j < end), logits, BLOCK_G, BLOCK_U, S)
    else:
        # Names differ from the branch above: Triton needs a name bound in both branches to keep one type.
        tail_t = tl.arange(0, TAIL_TOKENS)
        tail_ok = tail_t < tl.load(tail_len_ptr + b)
        tail_offsets = b * stride_tb + h * stride_th + tail_t[:, None] * stride_ts + d[None, :]
        tail_mask = tail_ok[:, None] & d_ok[None, :]
        tail_k = tl.load(tail_k_ptr + tail_offsets, mask=tail_mask, other=0.0)
        tail_v = tl.load(tail_v_ptr + tail_offsets, mask=tail_mask, other=0.0)
        m, l, acc, _ = _attend(q, tail_k, tail_v, g_ok[:, None] & tail_ok[None, :], m, l, acc, scaling, IEEE)
    part = (b * num_kv_heads * G + heads) * num_parts + first_part + split  # (BG,) partials are (B, Hq, parts)
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


def _split_plan(num_programs: int, num_loaded: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Split programs per (row, KV head): enough to fill the GPU, no more than U's few-block ranges."""
    if num_loaded == 0:
        return 0
    target = per_sm * (sm_count(device) if device.type == "cuda" else 1)
    return max(1, min(triton.cdiv(target, max(num_programs, 1)), triton.cdiv(num_loaded, MIN_BLOCKS_PER_SPLIT)))


@dataclass(frozen=True)
class PendingDecode:
    """A decode whose resident blocks and tails are attended (`begin_decode`): their partials, and
    what the late programs (`finish_decode`) read besides the slots."""

    query: torch.Tensor
    pool: torch.Tensor
    resident: torch.Tensor  # (B, Hkv, U) the slots the first programs read, -1 elsewhere
    head_mask: torch.Tensor | None  # (B, Hq, U) uint8
    scales: torch.Tensor | None  # (B, Hkv, U, 2) fp32
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # m, l (B, Hq, parts), acc (B, Hq, parts, D)
    num_splits: int
    scaling: float
    block_lse: torch.Tensor | None = None  # (B, Hq, U) fp32, each entry's log-sum-exp per head, or None


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
    block_lse: torch.Tensor | None = None,
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
        block_lse: None, or a contiguous (B, Hq, U) fp32 tensor for each entry's log-sum-exp per head.
    Returns:
        (B, Hq, D) in the query's dtype. Launches only: no host sync.
    """
    pending = _attend_first(
        query, pool, slots, head_mask, tail_keys, tail_values, tail_len, scaling, num_splits, scales,
        late_splits=False, block_lse=block_lse,
    )  # fmt: skip
    return _merge(pending)


def begin_decode(
    query: torch.Tensor,
    pool: torch.Tensor,
    resident: torch.Tensor,
    head_mask: torch.Tensor | None,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_len: torch.Tensor,
    scaling: float,
    num_splits: int | None = None,
    *,
    scales: torch.Tensor | None = None,
    block_lse: torch.Tensor | None = None,
) -> PendingDecode:
    """The first half of `reference.begin_decode` / `finish_decode`: attend the entries whose
    `resident` (B, Hkv, U) slot is >= 0 and the tails (arguments as `sparse_decode`; `scales` and
    `block_lse` cover every entry). Launches only; the pool's other slots may be written meanwhile."""
    return _attend_first(
        query,
        pool,
        resident,
        head_mask,
        tail_keys,
        tail_values,
        tail_len,
        scaling,
        num_splits,
        scales,
        late_splits=True,
        block_lse=block_lse,
    )


def finish_decode(pending: PendingDecode, block_ids: torch.Tensor, block_slot: torch.Tensor) -> torch.Tensor:
    """Attend the entries `begin_decode` left out (resident -1, `block_ids` (B, Hkv, U) >= 0), each
    at the slot `block_slot` (the HBM cache's block -> slot table, after the lookup that loaded
    them) gives its id, and merge every partial: (B, Hq, D). Launches only."""
    resident = pending.resident
    assert block_ids.shape == resident.shape
    batch, num_kv_heads, num_loaded = resident.shape
    block_ids = block_ids.contiguous()
    late_entries = torch.empty(
        (batch * num_kv_heads * pending.num_splits, triton.next_power_of_2(max(num_loaded, 1))),
        dtype=torch.int32,
        device=resident.device,
    )
    first_part = pending.num_splits + 1
    _launch_split(
        pending,
        block_ids,
        late_entries,
        pending.num_splits,
        first_part,
        None,
        None,
        None,
        late=True,
        block_slot=block_slot,
    )
    return _merge(pending)


def _attend_first(
    query: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    head_mask: torch.Tensor | None,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_len: torch.Tensor,
    scaling: float,
    num_splits: int | None,
    scales: torch.Tensor | None,
    late_splits: bool,
    block_lse: torch.Tensor | None = None,
) -> PendingDecode:
    """Launch the split programs over `slots` and the tail program; `late_splits` leaves room in
    the partials for as many late programs. `block_lse` starts at -inf: entries no program
    attends keep it."""
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_loaded = slots.shape[1], slots.shape[2]
    assert pool.is_contiguous() and query.dtype == tail_keys.dtype == tail_values.dtype
    assert (
        pool.dtype == query.dtype if scales is None else (pool.element_size() == 1 and scales.shape[:3] == slots.shape)
    )
    assert tail_keys.stride() == tail_values.stride() and tail_keys.stride(-1) == 1 and query.stride(-1) == 1
    assert num_q_heads % num_kv_heads == 0 and pool.shape[3] == dim
    slots = slots.contiguous()
    if num_splits is None:
        per_sm = PROGRAMS_PER_SM_BESIDE_LOOKUP if late_splits else PROGRAMS_PER_SM
        num_splits = _split_plan(batch * num_kv_heads, num_loaded, query.device, per_sm)
    else:
        num_splits = min(max(num_splits, 1), triton.cdiv(num_loaded, MIN_BLOCKS_PER_SPLIT)) if num_loaded else 0
    num_parts = num_splits + 1 + (num_splits if late_splits else 0)
    part_m = torch.empty((batch, num_q_heads, num_parts), dtype=torch.float32, device=query.device)
    part_acc = torch.empty((batch, num_q_heads, num_parts, dim), dtype=torch.float32, device=query.device)
    if block_lse is not None:
        assert block_lse.shape == (batch, num_q_heads, num_loaded) and block_lse.is_contiguous()
        block_lse.fill_(float("-inf"))
    pending = PendingDecode(
        query=query,
        pool=pool,
        resident=slots,
        head_mask=head_mask.contiguous().view(torch.uint8) if head_mask is not None else None,
        scales=scales.float().contiguous() if scales is not None else None,
        parts=(part_m, torch.empty_like(part_m), part_acc),
        num_splits=num_splits,
        scaling=scaling,
        block_lse=block_lse,
    )
    _launch_split(pending, slots, slots, num_splits + 1, 0, tail_keys, tail_values, tail_len, late=False)
    return pending


def _launch_split(
    pending: PendingDecode,
    slots: torch.Tensor,
    late_entries: torch.Tensor,
    programs_per_row: int,
    first_part: int,
    tail_keys: torch.Tensor | None,
    tail_values: torch.Tensor | None,
    tail_len: torch.Tensor | None,
    late: bool,
    block_slot: torch.Tensor | None = None,
) -> None:
    """One launch of the split kernel: (B * Hkv, programs_per_row) programs writing partials from
    `first_part` on. A late launch has no tail program (its tail pointers are unused); its `slots`
    are block ids, mapped through `block_slot`."""
    query = pending.query
    mask = pending.head_mask if pending.head_mask is not None else slots  # slots: an unused pointer
    scale_table = pending.scales if pending.scales is not None else query  # query: an unused pointer
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_loaded = slots.shape[1], slots.shape[2]
    if programs_per_row == 0:
        return
    tail_keys = query.view(batch, num_q_heads, 1, dim) if tail_keys is None else tail_keys  # unused when late
    tail_values = tail_keys if tail_values is None else tail_values
    tail_len = slots if tail_len is None else tail_len
    group = num_q_heads // num_kv_heads
    part_m, part_l, part_acc = pending.parts
    block_size = pending.pool.shape[2]
    lse = pending.block_lse if pending.block_lse is not None else part_m  # part_m: an unused pointer
    _decode_split_kernel[(batch * num_kv_heads, programs_per_row)](
        query, pending.pool, slots, mask, scale_table, tail_keys, tail_values, tail_len,
        part_m, part_l, part_acc, pending.resident, late_entries, slots if block_slot is None else block_slot, lse,
        query.stride(0), query.stride(1), slots.stride(0), slots.stride(1),
        mask.stride(0), mask.stride(1), tail_keys.stride(0), tail_keys.stride(1), tail_keys.stride(2),
        lse.stride(0), lse.stride(1), num_kv_heads, num_loaded, pending.num_splits, first_part, part_m.shape[2], pending.scaling,
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        S=block_size,
        D=dim,
        BLOCK_D=triton.next_power_of_2(max(dim, 16)),  # tl.dot needs every side >= 16
        BLOCK_U=max(1, TILE_TOKENS // block_size),
        BLOCK_LOADED=triton.next_power_of_2(max(num_loaded, 1)),
        TAIL_TOKENS=max(16, block_size),
        HAS_MASK=pending.head_mask is not None,
        IEEE=query.dtype == torch.float32,
        MIN_PER_SPLIT=MIN_BLOCKS_PER_SPLIT,
        SCALED=pending.scales is not None,
        LATE=late,
        BLOCK_LSE=pending.block_lse is not None,
        num_warps=SPLIT_WARPS,
        num_stages=SPLIT_STAGES,
    )  # fmt: skip


def _merge(pending: PendingDecode) -> torch.Tensor:
    """Merge each query head's partials: (B, Hq, D) in the query's dtype."""
    query = pending.query
    batch, num_q_heads, dim = query.shape
    part_m, part_l, part_acc = pending.parts
    num_parts = part_m.shape[2]
    out = torch.empty((batch, num_q_heads, dim), dtype=query.dtype, device=query.device)
    _decode_reduce_kernel[(batch * num_q_heads,)](
        part_m, part_l, part_acc, out, num_parts,
        D=dim, BLOCK_D=triton.next_power_of_2(max(dim, 16)), BLOCK_P=triton.next_power_of_2(num_parts),
    )  # fmt: skip
    return out
