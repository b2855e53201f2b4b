"""The plain-PyTorch half of the flash-attn-4 decode backend (`ops.flash_decode`).

flash-attn-4's paged attention reads, per batch entry, a row of page indices and a count of
used tokens (`page_table`, `seqused_k`); it has no per-page mask and, on Hopper, no split-KV.
`page_tables` turns per-entry pool-slot lists with -1 holes into such rows, each entry cut
into `num_splits` chunks of about equal work (our own split-KV: more entries for the GPU's
SMs). The tail block of a row is not a pool page: `tail_attention` attends it here, and
`merge_partials` combines the partial attentions by their log-sum-exps.

Everything is a device tensor op on shapes known on the host: no host sync, no data-dependent
shape (CUDA-graph safe). CPU-importable: nothing here imports flash_attn.
"""

from __future__ import annotations

import torch

MIN_PAGES_PER_SPLIT = 8  # 256 tokens: two of fa4's 128-token key tiles; fewer costs more in merges than it gains


def num_chunks(num_entries: int, num_loaded: int, num_sms: int) -> int:
    """Chunks per entry: enough entries x chunks to give every SM one, at least a few pages each."""
    if num_loaded == 0:
        return 1
    wanted = -(-num_sms // max(num_entries, 1))
    return max(1, min(wanted, -(-num_loaded // MIN_PAGES_PER_SPLIT)))


def page_tables(slots: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-entry slot lists -> fa4 page-table rows, `num_splits` balanced chunks per entry.

    Args:
        slots: (E, U) pool slot of each page an entry attends, -1 where none; U >= 1.
        num_splits: chunks per entry (>= 1).
    Returns:
        table: (E * num_splits, C) int32, C = ceil(U / num_splits); row e * num_splits + j holds
            entry e's valid slots [j * c_e, (j + 1) * c_e) with c_e = ceil(n_e / num_splits), n_e its
            count of valid slots. Entries past a chunk's pages are 0, a real slot that fa4 never reads
            (it reads a table entry only below seqused_k), so no -1 ever reaches the kernel.
        pages: (E * num_splits,) int32 valid pages per row (0: an empty chunk).
    """
    num_entries, width = slots.shape
    assert width >= 1 and num_splits >= 1
    # Valid slots first: a descending sort moves every -1 to the end. The order of the pages of
    # one softmax does not matter, so no stable argsort + gather is needed.
    packed = slots.sort(dim=-1, descending=True).values  # (E, U)
    count = (slots >= 0).sum(dim=-1)  # (E,)
    chunk = (count + num_splits - 1) // num_splits  # (E,) c_e
    cols = -(-width // num_splits)  # C: c_e <= C for every entry
    split = torch.arange(num_splits, device=slots.device)
    start = chunk[:, None] * split  # (E, n) first page of each chunk
    pages = (count[:, None] - start).clamp(min=0).minimum(chunk[:, None])  # (E, n)
    col = torch.arange(cols, device=slots.device)
    index = (start[:, :, None] + col).clamp(max=width - 1)  # (E, n, C)
    table = packed.gather(1, index.flatten(1)).view(num_entries, num_splits, cols)
    table = torch.where(col < pages[:, :, None], table, 0)
    return table.flatten(0, 1).to(torch.int32), pages.flatten().to(torch.int32)


def tail_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tail_len: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a GQA group over each row's tail block, with its log-sum-exp.

    Args:
        query: (B, Hkv, G, D).
        keys, values: (B, Hkv, S, D); values past tail_len must be finite (the layer's tail is
            zero-initialized), as they are multiplied by a zero weight.
        tail_len: (B,) valid tokens, 0..S.
        scaling: softmax scale.
    Returns:
        out: (B, Hkv, G, D) fp32, 0 for an empty tail.
        lse: (B, Hkv, G) fp32 log-sum-exp of the scaled logits, -inf for an empty tail.
    """
    size = keys.shape[2]
    logits = torch.einsum("bhgd,bhsd->bhgs", query.float(), keys.float()) * scaling  # (B, Hkv, G, S)
    valid = torch.arange(size, device=keys.device) < tail_len.view(-1, 1, 1, 1)
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf when the tail is empty
    weights = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])  # all 0 when empty
    return torch.einsum("bhgs,bhsd->bhgd", weights, values.float()), lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Combine attentions over disjoint key sets into the attention over their union.

    Args:
        out: (..., n, D) each part's softmax-weighted values (any float dtype).
        lse: (..., n) each part's log-sum-exp of its scaled logits; -inf marks an empty part, whose
            `out` may hold anything (even NaN): it is never multiplied in.
    Returns:
        (..., D) fp32. NaN where every part is empty (as the reference gives: softmax of nothing).
    """
    top = lse.amax(dim=-1, keepdim=True)
    weight = torch.exp(lse - top.masked_fill(top == float("-inf"), 0.0))  # (..., n), 0 for empty parts
    weighted = torch.where(weight[..., None] > 0, out.float() * weight[..., None], 0.0)
    return weighted.sum(dim=-2) / weight.sum(dim=-1, keepdim=True)
