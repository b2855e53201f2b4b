"""Sparse paged decode attention on flash-attn-4 (`flash_attn.cute`, Hopper and Blackwell).

The HBM block cache is fa4's page pool: pool slot = page, block_size = page size, one KV head
per page. A batch entry of fa4 is one (row, KV head) with its G query heads (head_mask None:
the whole group reads the same loaded blocks, packed into one tile by fa4's PackGQA) or one
(row, query head) (head_mask given: each head its own pages). Its page-table row lists the
slots it attends, -1 holes compacted away (`flash_plan.page_tables`).

Why the tail is attended outside fa4 and merged by log-sum-exp: `page_table` indexes the one
K/V tensor passed in, and the tails are not in the pool. Scratch pages would mean either
copying the whole pool or reserving per-row slots in it (the block cache owns the slots); a
separate (B, Hkv, G, S) attention in plain torch is tiny next to the U pages, and fa4 returns
the LSE that the merge needs (`return_lse=True`).

Why we split entries into chunks ourselves: fa4's SplitKV is not supported on SM90
(`interface.py`, `_flash_attn_fwd`: "SplitKV not supported on SM 9.0"), so one entry = one
CTA, and a decode batch of a few rows would leave most SMs idle. A chunk is just more fa4
batch entries (its query repeated), merged with the tail in the same LSE merge.

No host sync: tables, counts and merges are device tensor ops; fa4 itself reads only shapes
on the host (`seqused_k` stays on the device; `max_seqlen_k` defaults to the table width).
"""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_varlen_func

from .device_info import sm_count
from .flash_plan import merge_partials, num_chunks, page_tables, tail_attention

FA4_DTYPES = (torch.float16, torch.bfloat16)  # fa4 asserts fp16/bf16/fp8 inputs; fp8 is SM100-only


_num_sms = sm_count  # a module name of its own: tests set the SM count here


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
    """`reference.sparse_decode` with the loaded blocks attended by flash-attn-4's paged kernel.

    Args:
        query: (B, Hq, D) fp16/bf16 (fp32 runs the Triton kernel: fa4 has no fp32 path).
        pool: (P, 2, S, D) HBM block cache, same dtype, last dim contiguous; S is fa4's page size.
        slots: (B, Hkv, U) pool slot of each loaded block, -1 where unused.
        head_mask: (B, Hq, U) bool, which loaded blocks each query head sees; None = all.
        tail_keys, tail_values: (B, Hkv, S, D) each row's partial block (finite past tail_len).
        tail_len: (B,) valid tokens of each tail block, 0..S.
        scaling: softmax scale.
        num_splits: chunks per fa4 entry; None = enough entries to give every SM one.
        scales: must be None: fa4 reads the pool as stored (8-bit blocks are refused by the
            config before they exist; this guards a direct call).
        block_lse: must be None: fa4 returns no per-block log-sum-exps (`channel_feedback` is
            refused by the config with this backend; this guards a direct call).
    Returns:
        (B, Hq, D) in the query's dtype. A row whose head sees no block and has an empty tail
        never occurs (decode always has the current token in the tail); it would give NaN, as
        the reference does.
    """
    if scales is not None:
        raise NotImplementedError("flash-attn-4 decode attends the pool as stored: 8-bit blocks need backend='triton'")
    if block_lse is not None:
        raise NotImplementedError(
            "flash-attn-4 decode writes no per-block log-sum-exps: channel_feedback needs backend='triton'"
        )
    if query.dtype not in FA4_DTYPES:
        from . import triton_decode

        return triton_decode.sparse_decode(
            query, pool, slots, head_mask, tail_keys, tail_values, tail_len, scaling, num_splits
        )
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_loaded = slots.shape[1], slots.shape[2]
    group = num_q_heads // num_kv_heads
    assert num_q_heads % num_kv_heads == 0 and pool.shape[3] == dim and pool.stride(-1) == 1
    assert pool.dtype == query.dtype == tail_keys.dtype == tail_values.dtype
    tail_out, tail_lse = tail_attention(
        query.reshape(batch, num_kv_heads, group, dim), tail_keys, tail_values, tail_len, scaling
    )  # (B, Hkv, G, D), (B, Hkv, G)
    if num_loaded == 0:  # no loaded block anywhere (budget above every row's length): the tail is all
        return tail_out.reshape(batch, num_q_heads, dim).to(query.dtype)
    out, lse = _paged_attention(query, pool, slots, head_mask, scaling, num_splits)  # (B, Hq, n, D), (B, Hq, n)
    parts_out = torch.cat((out.float(), tail_out.reshape(batch, num_q_heads, 1, dim)), dim=2)
    parts_lse = torch.cat((lse, tail_lse.reshape(batch, num_q_heads, 1)), dim=2)
    return merge_partials(parts_out, parts_lse).to(query.dtype)


def _paged_attention(
    query: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    head_mask: torch.Tensor | None,
    scaling: float,
    num_splits: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fa4 over the loaded blocks -> per-chunk out (B, Hq, n, D) in the query dtype and lse (B, Hq, n) fp32."""
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_loaded = slots.shape[1], slots.shape[2]
    block_size = pool.shape[2]
    if head_mask is None:  # entry = (row, KV head), its G query heads share the pages
        entry_slots = slots.reshape(batch * num_kv_heads, num_loaded)
        heads_per_entry = num_q_heads // num_kv_heads
    else:  # entry = (row, query head), the pages its head_mask row allows
        group = num_q_heads // num_kv_heads
        per_head = slots[:, :, None].expand(-1, -1, group, -1).reshape(batch, num_q_heads, num_loaded)  # (B, Hq, U)
        entry_slots = torch.where(head_mask, per_head, -1).reshape(batch * num_q_heads, num_loaded)
        heads_per_entry = 1
    num_entries = entry_slots.shape[0]
    if num_splits is None:
        num_splits = num_chunks(num_entries, num_loaded, _num_sms(query.device))
    table, pages = page_tables(entry_slots, num_splits)  # (E*n, C) int32, (E*n,) int32
    # (B, Hq, D) -> (E, 1, heads, D): query heads h*G + g are consecutive, as fa4's GQA head h // G expects.
    q = query.reshape(num_entries, 1, heads_per_entry, dim)
    if num_splits > 1:  # chunk j of entry e is row e * n + j, as in `table`
        q = q[:, None].expand(-1, num_splits, -1, -1, -1).reshape(num_entries * num_splits, 1, heads_per_entry, dim)
    # (P, S, 1, D) views of the pool, no copy: fa4's page layout is (num_pages, page_size, Hkv, D);
    # the strides (2*S*D, D, D, 1) pass its alignment check (`maybe_contiguous`) for D % 8 == 0.
    keys, values = pool[:, 0].unsqueeze(2), pool[:, 1].unsqueeze(2)
    out, lse = flash_attn_varlen_func(
        q,
        keys,
        values,
        seqused_k=pages * block_size,
        page_table=table,
        softmax_scale=scaling,
        return_lse=True,
    )  # out (E*n, 1, heads, D), lse (E*n, heads, 1) natural-log LSE of the scaled logits
    # A chunk with no page (an entry with fewer pages than chunks, or a head that sees none of the
    # loaded blocks) is an fa4 entry with seqused_k = 0. fa4's SM90 kernel has no special case for
    # it, so its LSE is set here; merge_partials never reads an out whose LSE is -inf.
    lse = lse.view(num_entries, num_splits, heads_per_entry).masked_fill(
        (pages == 0).view(num_entries, num_splits, 1), float("-inf")
    )
    out = out.view(num_entries, num_splits, heads_per_entry, dim)
    # (E, n, heads, ...) -> (E, heads, n, ...) -> (B, Hq, n, ...): E * heads = B * Hq in both layouts.
    out = out.transpose(1, 2).reshape(batch, num_q_heads, num_splits, dim)
    lse = lse.transpose(1, 2).reshape(batch, num_q_heads, num_splits)
    return out, lse
