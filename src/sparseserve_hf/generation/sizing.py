"""EngineSizes: the byte and block arithmetic behind admission, DRAM reservation and prompt checks."""

from __future__ import annotations

from typing import Any

import torch

from ..cache.block_cache import rows_that_fit
from ..cache.cache import hbm_partitions, selected_blocks_per_kv_head
from ..cache.forward_log import PositionLimit
from ..config import SparseServeConfig
from ..ops.reference import kv_storage_dtype


class EngineSizes:
    """Sizes derived once from the model shape and the config.

    Args:
        model_config: the model's PretrainedConfig.
        config: the SparseServeConfig.
        dtype: the KV dtype (the model's).
        tp_size: tensor-parallel ranks the model's heads are split over (transformers' `tp_plan`):
            this engine then stores and sizes for its share of the KV heads.
    """

    def __init__(self, model_config: Any, config: SparseServeConfig, dtype: torch.dtype, tp_size: int = 1) -> None:
        text = model_config.get_text_config()
        self.config = config
        self.num_layers = text.num_hidden_layers
        self.num_heads = text.num_attention_heads
        model_kv_heads = getattr(text, "num_key_value_heads", None) or self.num_heads
        if model_kv_heads % tp_size:
            raise ValueError(f"{tp_size} tensor-parallel ranks cannot split {model_kv_heads} KV heads evenly")
        self.num_kv_heads = model_kv_heads // tp_size  # this rank's
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.num_heads
        self.vocab_size = text.vocab_size
        self.hbm_partitions = hbm_partitions(model_config, config, self.num_kv_heads)
        self.selected_per_kv_head = selected_blocks_per_kv_head(model_config, config)  # per decode row
        self.positions = PositionLimit.of(text)
        # A head-block as stored (in DRAM and the HBM block cache), in `config.kv_dtype`; the prefill's
        # KV on the device keeps the model's dtype.
        self.block_bytes = 2 * config.block_size * self.head_dim * kv_storage_dtype(config.kv_dtype, dtype).itemsize
        self.kv_bytes_per_token_layer = self.num_kv_heads * 2 * self.head_dim * dtype.itemsize

    @property
    def max_decode_rows(self) -> int:
        """Most rows one decode step can serve: one layer's selection for all of them must fit in each
        of its KV heads' HBM partitions (a lookup cannot evict blocks it is itself using)."""
        if self.config.hbm_cache_bytes is None:
            return self.config.max_batch
        slots = self.config.hbm_cache_bytes // self.block_bytes
        fit = rows_that_fit(slots, self.hbm_partitions, self.selected_per_kv_head)
        return max(1, min(self.config.max_batch, fit))

    @property
    def one_row_hbm_cache_bytes(self) -> int:
        """The smallest HBM block cache that decodes one row: its largest selection in every partition."""
        return self.hbm_partitions * self.selected_per_kv_head * self.block_bytes

    def prefill_bytes(self, num_tokens: int) -> int:
        """Exact HBM working set of a prompt's prefill: the KV it holds on the device at once.

        Layer-segmented prefill saves each layer's KV to DRAM before the next layer runs: one
        layer's KV. Chunked and full prefill hold (or read back) every layer's KV of the prompt.
        """
        layers = 1 if self.config.prefill_mode == "layer_segmented" else self.num_layers
        return num_tokens * layers * self.kv_bytes_per_token_layer

    def lifetime_dram_blocks(self, num_tokens: int) -> int:
        """DRAM head-blocks a request of `num_tokens` (prompt + new) can hold at most."""
        return self.num_layers * self.num_kv_heads * -(-num_tokens // self.config.block_size)

    def prefill_budget(self, decode_rows: int, num_layers: int) -> int | None:
        """Token-layers of prefill this iteration: `max_inject_tokens`, and what `max_batch_tokens`
        leaves after one token per decoding row (times the layers). None = no cap."""
        budgets = []
        if self.config.max_inject_tokens is not None:
            budgets.append(self.config.max_inject_tokens)
        if self.config.max_batch_tokens is not None:
            budgets.append((self.config.max_batch_tokens - decode_rows) * num_layers)
        return min(budgets) if budgets else None

    def check_prompt(self, ids: tuple[int, ...], max_new_tokens: int) -> None:
        """Raise ValueError for a prompt that can never run, naming the problem."""
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        for t in ids:  # one predicate finds and names the bad id (a bool is no id: True == 1 to Python)
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token {t!r} is not an id in the model's vocabulary [0, {self.vocab_size})")
        self.positions.check(len(ids), f"a prompt of {len(ids)} tokens and its first new token")
        prefill = self.prefill_bytes(len(ids))
        cache = self.config.hbm_cache_bytes
        if self.config.admission and cache is not None and prefill > cache:
            raise ValueError(
                f"prompt of {len(ids)} tokens cannot fit alone: its {self.config.prefill_mode} prefill needs "
                f"{prefill} bytes of HBM, more than hbm_cache_bytes={cache}"
            )
        if self.config.dram_bytes is not None:
            need = self.lifetime_dram_blocks(len(ids) + max_new_tokens)
            have = self.config.dram_bytes // self.block_bytes
            if need > have:
                raise ValueError(
                    f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} cannot fit alone: it needs "
                    f"{need} DRAM blocks, dram_bytes={self.config.dram_bytes} holds {have}"
                )
