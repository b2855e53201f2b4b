"""Channel scores (`metadata="channels"`): each block's attention estimated token by token from a few
key channels, the spec and the CPU path.

Why: a block bound (Quest's min/max) or a block mean blurs a needle's few tokens with the other 31 of
its block; an estimate of every token's attention does not. Keys carry most of q.k in a few channels
(those where the query is large), so reading those channels of a coarse copy of every key estimates
each query head's softmax over the whole context well (SparQ's idea), and the blocks of most
estimated mass are the ones to load.

Metadata of one block, one KV head: (M, D) in an 8-bit dtype, M = S * BITS / 8 + 2:
    rows 0 .. M-3   the keys' codes, BITS per value, packed: row j, channel d holds tokens
                    j*T .. j*T + T - 1 of channel d (T = 8 / BITS tokens per byte, the first token in
                    the lowest bits), stored as raw bytes in the metadata dtype;
    row M-2         each channel's minimum over the block (a value of the metadata dtype);
    row M-1         each channel's step: code c stands for minimum + c * step.
The minimum and the step are rounded to the metadata dtype first and the codes taken against the
rounded pair, so a dequantized key is within step / 2 of the true one (the extremes clamp).

Scoring, per (row, KV head): the `channels` channels where the group's queries are largest
(|q| summed over the group) are read; each query head's logits over every token of the row's full
blocks are its q on those channels dotted with the dequantized keys, times the softmax scale over
sqrt(the share of the head's |q| those channels hold) (SparQ's correction: fewer channels, smaller
logits, a flatter softmax otherwise); the score of a block is that softmax's mass on its tokens.
"""

from __future__ import annotations

import torch

BITS = 2  # bits per stored key value
LEVELS = 2**BITS - 1  # the largest code


def metadata_rows(block_size: int) -> int:
    """M, the metadata rows of one block: packed codes, then the minimum and the step."""
    if (block_size * BITS) % 8:
        raise ValueError(f"channel metadata packs {8 // BITS} tokens per byte: block_size must be a multiple of it")
    return block_size * BITS // 8 + 2


def channel_metadata(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., S, D) keys of full blocks -> (..., M, D) channel metadata in the 8-bit float `dtype`."""
    if dtype.itemsize != 1 or not dtype.is_floating_point:
        raise ValueError(f"channel metadata is stored in an 8-bit float dtype, got {dtype}")
    values = keys.float()
    low = _stored(values.amin(dim=-2, keepdim=True), dtype)  # (..., 1, D)
    step = _stored((values.amax(dim=-2, keepdim=True) - values.amin(dim=-2, keepdim=True)) / LEVELS, dtype)
    codes = ((values - low.float()) / _usable(step.float())).round().clamp(0, LEVELS).to(torch.uint8)  # (..., S, D)
    per_byte = 8 // BITS
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=keys.device) * BITS  # (T,)
    grouped = codes.unflatten(-2, (-1, per_byte))  # (..., S/T, T, D)
    packed = (grouped << shifts[:, None]).sum(dim=-2, dtype=torch.uint8)  # (..., S/T, D): disjoint bits
    return torch.cat((packed.view(dtype), low, step), dim=-2)


def dequantized_keys(metadata: torch.Tensor) -> torch.Tensor:
    """(..., M, D) channel metadata -> (..., S, D) fp32 keys as the codes stand for them."""
    packed, low, step = metadata[..., :-2, :], metadata[..., -2:-1, :], metadata[..., -1:, :]
    per_byte = 8 // BITS
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=metadata.device) * BITS  # (T,)
    codes = (packed.view(torch.uint8)[..., None, :] >> shifts[:, None]) & LEVELS  # (..., S/T, T, D)
    return codes.flatten(-3, -2).float() * _usable(step.float()) + low.float()


def channel_count(share: float, head_dim: int) -> int:
    """Channels read per KV head and step for a `share` of `head_dim`: rounded, at least 1."""
    return min(head_dim, max(1, round(share * head_dim)))


def channel_queries(
    query: torch.Tensor, num_kv_heads: int, channels: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a step reads the keys with: (B, Hq, D) queries -> the `channels` channels of most |q|
    summed over each group, chosen (B, Hkv, R) long, and each query head's q on them times its
    logits' scale, scaled (B, Hkv, G, R) fp32: `scaling` over sqrt(the share of the head's |q| those
    channels hold)."""
    batch, num_q_heads, dim = query.shape
    q = query.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)  # (B, Hkv, G, D)
    chosen = q.abs().sum(dim=2).topk(channels, dim=-1).indices  # (B, Hkv, R)
    q_part = torch.gather(q, 3, chosen[:, :, None].expand(-1, -1, q.shape[2], -1))  # (B, Hkv, G, R)
    kept = q_part.abs().sum(-1, keepdim=True) / q.abs().sum(-1, keepdim=True).clamp(min=1e-30)  # (B, Hkv, G, 1)
    return chosen, q_part * (scaling / kept.clamp(min=1e-6).sqrt())


def block_logsumexp(
    scaled: torch.Tensor, chosen: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor
) -> torch.Tensor:
    """The log of each block's summed exp(estimated logit) (the softmax's unnormalized block mass).

    Args:
        scaled, chosen: from `channel_queries`, (B, Hkv, G, R) and (B, Hkv, R).
        metadata: (C, M, D) channel metadata of every DRAM block, by DRAM id.
        block_ids: (B, Hkv, N) DRAM ids, -1 where the table is unused.
    Returns:
        (B, Hq, N) fp32, -inf where the id is -1.
    """
    batch, num_kv_heads, group, _ = scaled.shape
    num_blocks = block_ids.shape[2]
    meta = metadata.view(torch.uint8)[block_ids.clamp(min=0)]  # (B, Hkv, N, M, D) raw bytes
    meta = torch.gather(meta, 4, chosen[:, :, None, None].expand(-1, -1, num_blocks, meta.shape[3], -1))
    keys = dequantized_keys(meta.view(metadata.dtype))  # (B, Hkv, N, S, R)
    logits = torch.einsum("bhgr,bhnsr->bhgns", scaled, keys)  # (B, Hkv, G, N, S)
    out = torch.logsumexp(logits, dim=-1).masked_fill((block_ids < 0)[:, :, None], float("-inf"))
    return out.reshape(batch, num_kv_heads * group, num_blocks)


def score_channels(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, channels: int, scaling: float
) -> torch.Tensor:
    """Each query head's estimated attention mass on each block of its row's table.

    Args:
        query: (B, Hq, D) decode queries (RoPE applied).
        metadata: (C, M, D) channel metadata of every DRAM block (`channel_metadata`), by DRAM id.
        block_ids: (B, Hkv, N) DRAM ids of each row's full blocks, -1 where the table is unused.
        channels: R, channels read per KV head (`channel_count`).
        scaling: the attention's softmax scale.
    Returns:
        (B, Hq, N) fp32: the softmax mass on each block (summing to 1 over a row's blocks), -inf
        where the id is -1.
    """
    chosen, scaled = channel_queries(query, block_ids.shape[1], channels, scaling)
    return block_mass(block_logsumexp(scaled, chosen, metadata, block_ids))


def block_mass(logsumexp: torch.Tensor) -> torch.Tensor:
    """(B, Hq, N) per-block log-sum-exp -> the softmax mass of each block, -inf where it was -inf
    (unused entries; a row without blocks would otherwise be NaN)."""
    return torch.softmax(logsumexp, dim=-1).masked_fill(torch.isneginf(logsumexp), float("-inf"))


def _stored(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` in the 8-bit float `dtype`, saturated at its largest finite value."""
    bound = torch.finfo(dtype).max
    return values.clamp(-bound, bound).to(dtype)


def _usable(step: torch.Tensor) -> torch.Tensor:
    """A stored step of 0 (a constant channel, or one below the dtype's smallest value) as a tiny one,
    so codes divide by it; every code of such a channel then stands for its minimum."""
    return step.clamp(min=1e-8)
