"""The serving benchmark's ablation switches (offload, transfer, save_path) change where blocks live and
how they move, never the tokens. Each switch is checked for what it really does, not only for its output.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.resident import ResidentBlocks
from sparseserve_hf.ops import block_copy
from tiny_models import greedy, left_pad, random_ids, tiny_model

BLOCK_BYTES = 2 * 16 * 16 * 4  # (2, S=16, D=16) fp32 head-block


def run(model, ids, mask=None, new_tokens: int = 12, **overrides) -> tuple[torch.Tensor, SparseServeCache]:
    """Greedy tokens of a left-padded batch at budget 48 (real selection over 70-150 tokens) and the cache."""
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=48, **overrides))
    return greedy(model, ids, cache, attention_mask=mask, max_new_tokens=new_tokens), cache


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([random_ids(1, n, seed=n)[0] for n in (150, 97, 70)])


class CopyCounter(TorchDispatchMode):
    """Counts `aten.copy_` calls: one per block on the per-block copy path."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


# ---- offload -----------------------------------------------------------------------------------


@pytest.mark.core
def test_no_offload_gives_the_same_tokens_with_every_block_on_the_device(llama):
    ids, mask = padded_batch()
    offloaded, tiered = run(llama, ids, mask)
    resident, flat = run(llama, ids, mask, offload=False)
    assert torch.equal(resident, offloaded)
    assert isinstance(flat.store.hbm, ResidentBlocks) and flat.store.dram.device == ids.device
    assert not flat.store.dram.storage.is_pinned()
    tiered_stats, flat_stats = tiered.stats(), flat.stats()
    # The same blocks are stored and selected; they are counted as HBM, and every lookup hits.
    assert flat_stats["dram_bytes"] == 0 and tiered_stats["dram_bytes"] > 0
    assert flat_stats["hbm_block_cache_bytes"] == tiered_stats["dram_bytes"]
    assert flat_stats["blocks_selected"] == tiered_stats["blocks_selected"] > 0
    assert flat_stats["hit_rate"] == 1.0 and flat_stats["misses"] == 0
    assert flat_stats["h2d_bytes"] == 0 and flat_stats["d2h_bytes"] == 0
    assert tiered_stats["misses"] > 0 and tiered_stats["h2d_bytes"] > 0
    assert flat_stats["hbm_bytes"] > tiered_stats["hbm_bytes"]


@pytest.mark.core
def test_no_offload_multi_turn_and_reset(llama):
    """The dense path reads the past back from the device pool; reset frees every block."""
    ids = random_ids(1, 60)
    tokens, cache = run(llama, ids, offload=False, new_tokens=6)
    expected, tiered = run(llama, ids, new_tokens=6)
    follow_up = torch.cat((ids, tokens, random_ids(1, 25, seed=7)), dim=1)
    again = torch.cat((ids, expected, random_ids(1, 25, seed=7)), dim=1)
    assert torch.equal(
        greedy(llama, follow_up, cache, max_new_tokens=6), greedy(llama, again, tiered, max_new_tokens=6)
    )
    assert cache.stats()["dense_read_bytes"] > 0
    cache.reset()
    assert cache.store.dram.num_used == 0 and cache.stats()["hbm_block_cache_bytes"] == 0


@pytest.mark.gpu
def test_no_offload_keeps_the_pool_in_cuda_memory():
    model = tiny_model("llama").cuda()
    ids, mask = padded_batch()
    offloaded, tiered = run(model, ids.cuda(), mask.cuda())
    resident, flat = run(model, ids.cuda(), mask.cuda(), offload=False)
    assert torch.equal(resident, offloaded)
    assert flat.store.dram.storage.is_cuda and flat.store.hbm.pool.is_cuda
    assert tiered.store.dram.storage.is_pinned() and not tiered.store.dram.storage.is_cuda
    assert flat.stats()["h2d_bytes"] == 0 and flat.stats()["hit_rate"] == 1.0


# ---- transfer ------------------------------------------------------------------------------


@pytest.mark.core
def test_copy_transfers_move_each_block_with_its_own_copy(llama):
    """Same tokens; the copy path issues exactly one extra `copy_` per block moved in either direction."""
    ids, mask = padded_batch()
    counters = {}
    results = {}
    for transfer in ("kernel", "copy"):
        with CopyCounter() as counters[transfer]:
            results[transfer] = run(llama, ids, mask, transfer=transfer, hbm_cache_bytes=2 * 8 * 4 * 3 * BLOCK_BYTES)
    (kernel_tokens, kernel_cache), (copy_tokens, copy_cache) = results["kernel"], results["copy"]
    assert torch.equal(copy_tokens, kernel_tokens)
    assert copy_cache.store.ops.gather_blocks is block_copy.gather_blocks
    assert copy_cache.store.ops.scatter_blocks is block_copy.scatter_blocks
    assert kernel_cache.store.ops.gather_blocks is not block_copy.gather_blocks
    stats = copy_cache.stats()
    assert stats == kernel_cache.stats()
    saved, loaded, read = stats["d2h_bytes"], stats["h2d_bytes"], stats["dense_read_bytes"]
    moved = (saved + loaded + read) // BLOCK_BYTES
    assert saved > 0 and loaded > 0
    assert counters["copy"].copies - counters["kernel"].copies == moved


@pytest.mark.core
def test_copy_transfers_without_offload(llama):
    ids, mask = padded_batch()
    expected, _ = run(llama, ids, mask)
    tokens, cache = run(llama, ids, mask, transfer="copy", offload=False)
    assert torch.equal(tokens, expected)
    assert cache.store.ops.name == "torch+copy" and cache.stats()["h2d_bytes"] == 0


@pytest.mark.gpu
def test_copy_transfers_on_cuda_equal_the_kernels():
    model = tiny_model("llama").cuda()
    ids, mask = padded_batch()
    expected, _ = run(model, ids.cuda(), mask.cuda(), backend="auto")
    tokens, cache = run(model, ids.cuda(), mask.cuda(), backend="auto", transfer="copy")
    assert torch.equal(tokens, expected)
    assert cache.store.ops.name.endswith("+copy") and cache.stats()["misses"] > 0


# ---- save_path -----------------------------------------------------------------------------


@pytest.mark.core
def test_flash_d2h_save_path_from_the_config(llama):
    ids, mask = padded_batch()
    expected, scatter = run(llama, ids, mask)
    tokens, staged = run(llama, ids, mask, save_path="flash_d2h")
    assert torch.equal(tokens, expected)
    assert scatter.store.saver is None and staged.store.saver is not None
    # Saves went through the saver's pinned (here: plain host) staging buffers.
    assert any(buffer is not None for buffer in staged.store.saver._staging)
    assert staged.stats()["d2h_bytes"] == scatter.stats()["d2h_bytes"] > 0
    staged.store.saver.close()
