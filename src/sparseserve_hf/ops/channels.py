"""Channel scores (`metadata="channels"`): each block's attention estimated token by token from a few
key channels that the block itself keeps, the spec and the CPU path.

Why: a block bound (Quest's min/max) or a block mean blurs a needle's few tokens with the other 31 of
its block; an estimate of every token's attention does not. Keys carry most of q.k in a few channels,
so a coarse copy of those channels estimates each query head's softmax over the whole context well
(SparQ's idea), and the blocks of most estimated mass are the ones to load.

Which channels: each block keeps its own `P` channels, chosen when it fills, as whole RoPE rotation
pairs (d, d + D/2) (a rotation moves a pair's magnitude between its two channels, never out of the
pair): the pairs where the block's keys spread most (their standard deviation over the block's tokens,
what tells its tokens apart), weighted by how large the queries of the KV head's group are on each
channel (`profile`, |q| of the request's prompt; uniform without one). A step then reads exactly those
channels, in whole contiguous rows: choosing channels per step from the query would spread its reads
over every channel's bytes. A block's metadata describes itself, so blocks written under different
profiles (or by other requests, e.g. a shared prefix) score side by side.

Metadata of one block, one KV head: (M, D) bytes in an 8-bit float dtype (D = head_dim), P = 2 x
floor(share x D / 2) stored channels, T = 8 / BITS tokens per byte:
    code rows     the stored channels' codes, BITS per value, as one flat byte run: byte j*P + i holds
                  tokens j*T .. j*T + T - 1 of stored channel i (the first token in the lowest bits);
                  ceil(S*P / (T*D)) rows, zero past the run;
    header        from the next row on: bytes 0 .. P/2-1 the stored pairs' first channels d (stored
                  channel i < P/2 is d_i, channel P/2 + i is d_i + D/2), as raw bytes; then P minima and
                  P steps (values of the dtype): code c of stored channel i stands for
                  minimum_i + c * step_i; zero after it, to M rows (`metadata_rows`: a bound that holds
                  for every head_dim).
At S = 32, BITS = 2 and share = 3/8 that is 3 code rows and 1 header row: 4 x D bytes against
S x 2 x D x 2 of 16-bit KV, exactly 1/32 of it.
The minimum and the step are rounded to the dtype first and the codes taken against the rounded pair,
so a dequantized key is within step / 2 of the true one (the extremes clamp).

Scoring, per (row, KV head, block): each query head's logits over the block's tokens are its q on the
block's stored channels dotted with the dequantized keys, times the softmax scale over sqrt(the share of
the head's |q| those channels hold) (SparQ's correction: fewer channels, smaller logits, a flatter
softmax otherwise); a block's score is that softmax's mass on its tokens, over the row's full blocks.
"""

from __future__ import annotations

import math

import torch

BITS = 2  # bits per stored key value
LEVELS = 2**BITS - 1  # the largest code
PER_BYTE = 8 // BITS  # tokens per code byte
HEADER_BYTES_PER_CHANNEL = 2.5  # half a pair index, a minimum and a step


def stored_channels(share: float, head_dim: int) -> int:
    """P: the channels a block keeps for a `share` of `head_dim`, in whole RoPE pairs, at least one pair."""
    if head_dim % 2 or head_dim > 512:
        raise ValueError(f"channel metadata needs an even head_dim of at most 512 (pairs in a byte), got {head_dim}")
    return 2 * max(1, math.floor(share * head_dim / 2))


def code_rows(block_size: int, share: float) -> int:
    """Rows of packed codes per block: at most ceil(share x S x BITS / 8), whatever head_dim is."""
    if (block_size * BITS) % 8:
        raise ValueError(f"channel metadata packs {PER_BYTE} tokens per byte: block_size must be a multiple of it")
    return math.ceil(share * block_size / PER_BYTE)


def metadata_rows(block_size: int, share: float) -> int:
    """M, the metadata rows of one block: packed codes, then the header (pairs, minima, steps)."""
    return code_rows(block_size, share) + math.ceil(HEADER_BYTES_PER_CHANNEL * share)


def header_start(block_size: int, stored: int, head_dim: int) -> int:
    """The header's first byte in a block's metadata: the row after the last code byte."""
    return math.ceil(block_size * stored / PER_BYTE / head_dim) * head_dim


def channel_metadata(
    keys: torch.Tensor, share: float, dtype: torch.dtype, profile: torch.Tensor | None = None
) -> torch.Tensor:
    """(..., S, D) keys of full blocks -> (..., M, D) channel metadata in the 8-bit float `dtype`.

    profile: (..., D) non-negative weight of each channel (the group's |q|), or None (uniform, as
    is an all-zero profile).
    """
    if dtype.itemsize != 1 or not dtype.is_floating_point:
        raise ValueError(f"channel metadata is stored in an 8-bit float dtype, got {dtype}")
    size, dim = keys.shape[-2:]
    count, half = stored_channels(share, dim), dim // 2
    values = keys.float()
    weight = values.std(dim=-2, correction=0)  # (..., D) the spread over the block's tokens
    if profile is not None:  # an all-zero profile (a row that saw no prompt query) weighs nothing
        weight = weight * torch.where(profile.sum(-1, keepdim=True) > 0, profile.float(), 1.0)
    pairs = (weight[..., :half] + weight[..., half:]).topk(count // 2, dim=-1).indices.sort(dim=-1).values
    channel = torch.cat((pairs, pairs + half), dim=-1)  # (..., P)
    chosen = torch.gather(values, -1, channel.unsqueeze(-2).expand(*values.shape[:-1], count))  # (..., S, P)
    low = _stored(chosen.amin(dim=-2), dtype)  # (..., P)
    step = _stored((chosen.amax(dim=-2) - chosen.amin(dim=-2)) / LEVELS, dtype)
    codes = ((chosen - low.float().unsqueeze(-2)) / _usable(step.float()).unsqueeze(-2)).round().clamp(0, LEVELS)
    shifts = torch.arange(PER_BYTE, dtype=torch.uint8, device=keys.device) * BITS  # (T,)
    grouped = codes.to(torch.uint8).unflatten(-2, (-1, PER_BYTE))  # (..., S/T, T, P)
    packed = (grouped << shifts[:, None]).sum(dim=-2, dtype=torch.uint8)  # (..., S/T, P): disjoint bits
    header = torch.cat((pairs.to(torch.uint8), low.view(torch.uint8), step.view(torch.uint8)), dim=-1)
    start = header_start(size, count, dim)
    body = torch.cat((_padded(packed.flatten(-2), start), header), dim=-1)
    return _padded(body, metadata_rows(size, share) * dim).unflatten(-1, (-1, dim)).view(dtype)


def unpacked(metadata: torch.Tensor, block_size: int, stored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., M, D) channel metadata of blocks of `block_size` tokens keeping `stored` channels ->
    their channels (..., P) long and the keys as the codes stand for them, (..., S, P) fp32."""
    dim = metadata.shape[-1]
    raw = metadata.view(torch.uint8).flatten(-2)  # (..., M*D)
    start = header_start(block_size, stored, dim)
    header = raw[..., start : start + stored // 2 + 2 * stored]
    pairs = header[..., : stored // 2].long()
    channel = torch.cat((pairs, pairs + dim // 2), dim=-1)  # (..., P)
    low = header[..., stored // 2 : stored // 2 + stored].contiguous().view(metadata.dtype).float()
    step = _usable(header[..., stored // 2 + stored :].contiguous().view(metadata.dtype).float())
    packed = raw[..., : block_size // PER_BYTE * stored].unflatten(-1, (-1, stored))  # (..., S/T, P)
    shifts = torch.arange(PER_BYTE, dtype=torch.uint8, device=metadata.device) * BITS  # (T,)
    codes = (packed[..., None, :] >> shifts[:, None]) & LEVELS  # (..., S/T, T, P)
    return channel, codes.flatten(-3, -2).float() * step.unsqueeze(-2) + low.unsqueeze(-2)


def block_logsumexp(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_size: int, stored: int, scaling: float
) -> torch.Tensor:
    """The log of each block's summed exp(estimated logit) (the softmax's unnormalized block mass).

    Args:
        query: (B, Hq, D) decode queries (RoPE applied).
        metadata: (C, M, D) channel metadata of every DRAM block, by DRAM id.
        block_ids: (B, Hkv, N) DRAM ids, -1 where the table is unused.
        block_size, stored: S and P of the metadata (`stored_channels`).
        scaling: the attention's softmax scale.
    Returns:
        (B, Hq, N) fp32, -inf where the id is -1.
    """
    batch, num_kv_heads, num_blocks = block_ids.shape
    dim = query.shape[-1]
    q = query.float().view(batch, num_kv_heads, -1, dim)  # (B, Hkv, G, D)
    channel, keys = unpacked(metadata[block_ids.clamp(min=0)], block_size, stored)  # (B, Hkv, N, P), (..., S, P)
    index = channel[:, :, None].expand(-1, -1, q.shape[2], -1, -1)  # (B, Hkv, G, N, P)
    q_part = torch.gather(q[:, :, :, None].expand(-1, -1, -1, num_blocks, -1), 4, index)  # (B, Hkv, G, N, P)
    kept = q_part.abs().sum(-1) / q.abs().sum(-1, keepdim=True).clamp(min=1e-30)  # (B, Hkv, G, N)
    logits = torch.einsum("bhgnp,bhnsp->bhgns", q_part, keys) * (scaling / kept.clamp(min=1e-6).sqrt())[..., None]
    out = torch.logsumexp(logits, dim=-1).masked_fill((block_ids < 0)[:, :, None], float("-inf"))
    return out.reshape(batch, -1, num_blocks)


def score_channels(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_size: int, stored: int, scaling: float
) -> torch.Tensor:
    """Each query head's estimated attention mass on each block of its row's table: (B, Hq, N) fp32,
    summing to 1 over a row's blocks, -inf where the id is -1 (arguments as `block_logsumexp`)."""
    return block_mass(block_logsumexp(query, metadata, block_ids, block_size, stored, scaling))


def with_feedback(logsumexp: torch.Tensor, fed_back: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """(B, Hq, N) estimated per-block log-sum-exps, each raised to the last decode step's exact one
    where that step attended the block and found more: the next query is close to the last, and the
    exact number is what the estimate approximates. No byte more is read: the attention computed them.

    fed_back: the table positions each KV head loaded (B, Hkv, U) and each query head's exact
    log-sum-exp over them (B, Hq, U), -inf where it attended none; None: the estimates as they are.
    Blocks outside the table (-inf estimates) stay out."""
    if fed_back is None:
        return logsumexp
    picked, exact = fed_back
    group = exact.shape[1] // picked.shape[1]
    positions = picked.repeat_interleave(group, dim=1).clamp(0, logsumexp.shape[-1] - 1)  # (B, Hq, U)
    raised = logsumexp.scatter_reduce(2, positions, exact, reduce="amax", include_self=True)
    return torch.where(torch.isneginf(logsumexp), logsumexp, raised)


def feedback_mass(logsumexp: torch.Tensor, fed_back: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """What the channel scorer ranks: `block_mass(with_feedback(logsumexp, fed_back))`, (B, Hq, N)."""
    return block_mass(with_feedback(logsumexp, fed_back))


def block_mass(logsumexp: torch.Tensor) -> torch.Tensor:
    """(B, Hq, N) per-block log-sum-exp -> the softmax mass of each block, -inf where it was -inf
    (unused entries; a row without blocks would otherwise be NaN)."""
    return torch.softmax(logsumexp, dim=-1).masked_fill(torch.isneginf(logsumexp), float("-inf"))


def query_profile(query: torch.Tensor, num_kv_heads: int, last: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Hq, T, D) queries of a prompt (or a chunk of it) -> (B, Hkv, D) fp32: each row's mean |q| over
    its last `last` positions (the real ones, where `real` (B, T) marks them), summed over each KV head's
    group (what `channel_metadata` weighs channels by); zero for a row with no real position there."""
    batch, num_q_heads, _, dim = query.shape
    recent = query[:, :, -last:].float().abs()  # (B, Hq, t, D)
    weight = torch.ones(batch, recent.shape[2], device=query.device) if real is None else real[:, -last:].float()
    mean = torch.einsum("bhtd,bt->bhd", recent, weight) / weight.sum(-1).clamp(min=1)[:, None, None]  # (B, Hq, D)
    return mean.view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim).sum(2)


def _padded(values: torch.Tensor, length: int) -> torch.Tensor:
    """(..., n) bytes zero-padded to (..., length)."""
    return torch.nn.functional.pad(values, (0, length - values.shape[-1]))


def _stored(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` in the 8-bit float `dtype`, saturated at its largest finite value."""
    bound = torch.finfo(dtype).max
    return values.clamp(-bound, bound).to(dtype)


def _usable(step: torch.Tensor) -> torch.Tensor:
    """A stored step of 0 (a constant channel, or one below the dtype's smallest value) as a tiny one,
    so codes divide by it; every code of such a channel then stands for its minimum."""
    return step.clamp(min=1e-8)
