"""The block oracle as an attention function: the ceiling a block selector is judged against.

At each decode step every KV head attends only the sink blocks, the window blocks and the blocks
with the most true attention mass of its query heads (summed over the group), as many in all as
`SparseServeConfig.selected_full_blocks`, plus the row's tail: exactly what `selection="kv_head"`
loads, chosen by the one thing no real selector can read, the step's dense attention. Prefill is
dense. It runs over any dense cache (DynamicCache), so it measures selection alone: no metadata,
no HBM cache, no DRAM round trip. Evaluation only, never a serving path.

Blocks are counted from each row's first real token (left padding is skipped), as the cache counts
them; a row of n tokens (the decoding one included) has (n - 1) // block_size full blocks and the
rest in its tail, as in `SparseServeCache`'s decode step.

    with oracle_run(model, config) as run:   # the model attends through the oracle meanwhile
        model.generate(...)
    run.loads()                              # loaded tokens per KV head, their fraction, as stats() names them
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sparseserve_hf import SparseServeConfig

ORACLE_NAME = "sparseserve_oracle"


@dataclass
class OracleRun:
    """The oracle's budget and what its decode steps loaded (one entry per sparse layer call)."""

    config: SparseServeConfig
    # Per call, on the model's device (read back once, in `loads`): (mean loaded tokens over
    # (row, KV head), their p95 over KV heads averaged over rows, mean over rows of loaded / tokens).
    steps: list[torch.Tensor] = field(default_factory=list)

    def loads(self) -> dict[str, float]:
        """The batch's averages under the names `SparseServeCache.stats()` gives them (no metadata)."""
        if not self.steps:
            return {}
        tokens, p95, fraction = torch.stack(self.steps).double().mean(0).tolist()
        return {
            "loaded_tokens_per_kv_head": tokens,
            "loaded_tokens_p95_over_heads": p95,
            "loaded_fraction": fraction,
            "metadata_fraction": 0.0,
        }


_CURRENT: ContextVar[OracleRun | None] = ContextVar("sparseserve_oracle_run", default=None)


def register() -> None:
    """Make `ORACLE_NAME` an attention implementation (with the SDPA mask); safe to call again."""
    AttentionInterface.register(ORACLE_NAME, oracle_attention)
    AttentionMaskInterface.register(ORACLE_NAME, sdpa_mask)


@contextlib.contextmanager
def oracle_run(model, config: SparseServeConfig) -> Iterator[OracleRun]:
    """Route `model`'s attention through the oracle at `config`'s budget for the block's duration,
    then restore its own implementation."""
    register()
    own = model.config._attn_implementation
    run = OracleRun(config)
    token = _CURRENT.set(run)
    model.set_attn_implementation(ORACLE_NAME)
    try:
        yield run
    finally:
        model.set_attn_implementation(own)
        _CURRENT.reset(token)


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function: dense SDPA for prefill, sliding-window layers (Gemma-3's local ones,
    which a SparseServeCache keeps dense too) and outside an `oracle_run`; the oracle's blocks for a
    one-token decode step. q (B, Hq, 1, D), k/v (B, Hkv, L, D); returns (B, 1, Hq, D)."""
    run = _CURRENT.get()
    if run is None or query.shape[2] != 1 or getattr(module, "sliding_window", None) is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    real = _real_tokens(attention_mask, key)  # (B, L)
    allowed = oracle_tokens(query, key, real, scaling, run)  # (B, Hkv, L)
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    mask = allowed.repeat_interleave(group, dim=1)[:, :, None, :]  # (B, Hq, 1, L)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)  # (B, Hq, 1, D)
    return out.transpose(1, 2).contiguous(), None


def oracle_tokens(
    query: torch.Tensor, key: torch.Tensor, real: torch.Tensor, scaling: float, run: OracleRun | None = None
) -> torch.Tensor:
    """(B, Hkv, L) bool: the tokens each KV head attends under the oracle. query (B, Hq, 1, D), key
    (B, Hkv, L, D), real (B, L) the rows' real tokens (contiguous, the decoding one last). Records
    the step's loads in `run` (its config sets the budget; None: the default config)."""
    config = run.config if run is not None else SparseServeConfig()
    size = config.block_size
    batch, num_kv_heads, length, dim = key.shape
    group = query.shape[1] // num_kv_heads
    logits = query.float().view(batch, num_kv_heads, group, dim) @ key.float().transpose(2, 3)  # (B, Hkv, G, L)
    probs = torch.softmax((logits * scaling).masked_fill(~real[:, None, None, :], float("-inf")), dim=-1)
    tokens = real.sum(-1)  # (B,) the decoding token included
    first = length - tokens  # (B,) left padding
    num_full = (tokens - 1) // size  # (B,)
    position = torch.arange(length, device=key.device) - first[:, None]  # (B, L) within the row
    block = torch.where(real, position // size, -1)  # (B, L)
    in_full = (block >= 0) & (block < num_full[:, None])
    width = int(num_full.max()) + 1  # the last column collects every token outside a full block
    index = torch.where(in_full, block, width - 1)[:, None, :].expand(batch, num_kv_heads, length)
    mass = torch.zeros(batch, num_kv_heads, width, device=key.device).scatter_add_(2, index, probs.sum(2))
    chosen = top_blocks(mass[..., :-1], num_full, config)  # (B, Hkv, width - 1)
    in_tail = real & ~in_full
    outside = torch.zeros_like(chosen[..., :1])  # the last column: no full block
    picked = torch.gather(torch.cat((chosen, outside), dim=2), 2, index)  # (B, Hkv, L): the token's block is chosen
    allowed = (picked & in_full[:, None]) | in_tail[:, None]
    if run is not None:
        _record(run, allowed, tokens)
    return allowed


def top_blocks(mass: torch.Tensor, num_full: torch.Tensor, config: SparseServeConfig) -> torch.Tensor:
    """(B, Hkv, N) bool: of each row's `num_full` (B,) blocks, the sink, the window and the blocks of
    most `mass` (B, Hkv, N), `selected_full_blocks` in all (every block where the row has fewer)."""
    width = mass.shape[-1]
    n = torch.arange(width, device=mass.device)
    exists = n < num_full[:, None]  # (B, N)
    forced = exists & ((n < config.sink_blocks) | (n >= num_full[:, None] - config.window_blocks))
    ranked = torch.where(forced[:, None], float("inf"), mass).masked_fill(~exists[:, None], float("-inf"))
    count = min(config.selected_full_blocks, width)
    top = ranked.topk(count, dim=-1).indices  # (B, Hkv, K)
    chosen = torch.zeros_like(ranked, dtype=torch.bool).scatter_(2, top, True)
    return chosen & exists[:, None]


def _record(run: OracleRun, allowed: torch.Tensor, tokens: torch.Tensor) -> None:
    loaded = allowed.sum(-1).float()  # (B, Hkv)
    p95 = loaded.quantile(0.95, dim=1).mean()
    run.steps.append(torch.stack((loaded.mean(), p95, (loaded.mean(1) / tokens.float()).mean())))


def _real_tokens(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the key positions the decoding token may attend (its mask row; all without one)."""
    batch, _, length, _ = key.shape
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=key.device)
    row = attention_mask[:, 0, -1, :length]  # (B, L)
    return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
