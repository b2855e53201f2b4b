"""8-bit KV (`kv_dtype="float8_e4m3fn"`): full blocks are stored in DRAM and in the HBM block cache as
float8 with a scale per block's keys and per its values; attention and the dense past read them
dequantized, tails keep the model's dtype, and every byte count halves against 16-bit KV."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops, reference
from tiny_models import greedy, random_ids, tiny_model

FP8 = "float8_e4m3fn"
SIZE = 16


def cache_for(model, **overrides) -> SparseServeCache:
    return SparseServeCache(model.config, SparseServeConfig(block_size=SIZE, **overrides))


def step_logits(model, ids: torch.Tensor, cache, fed: torch.Tensor) -> list[torch.Tensor]:
    """Prefill `ids`, then decode the tokens `fed` (B, N) one step each: the logits of every step, (B, V)."""
    with torch.no_grad():
        out = [model(ids, past_key_values=cache).logits[:, -1].float()]
        for step in range(fed.shape[1]):
            out.append(model(fed[:, step : step + 1], past_key_values=cache).logits[:, -1].float())
    return out


@pytest.mark.core
def test_the_past_reads_back_as_each_full_block_dequantized_and_the_tail_exactly(llama):
    ids = random_ids(1, 70)  # 4 full blocks of 16 and a tail of 6
    dynamic = DynamicCache(config=llama.config)
    with torch.no_grad():
        tiny_model("llama", "sdpa")(ids, past_key_values=dynamic)
        cache = cache_for(llama, kv_dtype=FP8)
        llama(ids, past_key_values=cache)
    full = 4 * SIZE
    for layer, expected in zip(cache.layers, dynamic.layers):
        keys, values, valid = layer.past()
        assert valid.all() and keys.dtype == expected.keys.dtype == torch.float32
        blocks = torch.stack((expected.keys[..., :full, :], expected.values[..., :full, :]), dim=2)  # (1, H, 2, T, D)
        blocks = blocks.unflatten(3, (4, SIZE)).permute(0, 1, 3, 2, 4, 5).flatten(0, 2)  # (H * 4, 2, S, D)
        stored, scales = reference.quantize_blocks(blocks, torch.float8_e4m3fn)
        want = reference.dequantize_blocks(stored, scales, torch.float32).view(1, -1, 4, 2, SIZE, blocks.shape[-1])
        assert torch.equal(keys[..., :full, :], want[:, :, :, 0].flatten(2, 3))
        assert torch.equal(values[..., :full, :], want[:, :, :, 1].flatten(2, 3))
        assert torch.equal(keys[..., full:, :], expected.keys[..., full:, :])  # the tail: exactly
        assert not torch.equal(keys[..., :full, :], expected.keys[..., :full, :])  # rounded, really


@pytest.mark.core
def test_prefill_is_exact_and_decode_stays_close_to_model_dtype_kv(llama):
    """Quantization happens as blocks are stored, after the prefill's attention: its logits are the
    model-dtype run's exactly; decode attends rounded blocks and stays within a percent on average."""
    ids, fed = random_ids(2, 150), random_ids(2, 40, seed=7)  # decode crosses two block boundaries
    plain = step_logits(llama, ids, cache_for(llama, token_budget=4096), fed)  # every block: no pick can move
    fp8 = step_logits(llama, ids, cache_for(llama, token_budget=4096, kv_dtype=FP8), fed)
    assert torch.equal(fp8[0], plain[0])
    for step, (got, want) in enumerate(zip(fp8[1:], plain[1:]), start=1):
        error = (got - want).abs() / want.std()  # ~0.3% on average here, at most ~2%
        assert error.mean() <= 0.01 and error.max() <= 0.05, step
        assert not torch.equal(got, want), step  # the decode really read 8-bit blocks


@pytest.mark.core
def test_a_real_selection_through_a_small_hbm_cache_stays_close(llama):
    """Budget 48 of ~190 tokens through 48 slots (evictions, misses loaded as 8-bit blocks): the
    same picks up to rounding, so the logits stay within a percent on average over the steps."""
    ids, fed = random_ids(2, 130), random_ids(2, 40, seed=9)
    plain = step_logits(llama, ids, cache_for(llama, token_budget=48, hbm_cache_bytes=48 * 2048), fed)
    cache = cache_for(llama, token_budget=48, hbm_cache_bytes=48 * 512, kv_dtype=FP8)  # 48 slots of 8-bit blocks
    fp8 = step_logits(llama, ids, cache, fed)
    errors = torch.stack([((got - want).abs() / want.std()).mean() for got, want in zip(fp8[1:], plain[1:])])
    assert errors.mean() <= 0.01 and errors.max() <= 0.05
    stats = cache.stats()
    assert stats["misses"] > 0 and stats["hbm_block_cache_bytes"] <= 48 * 512


@pytest.mark.core
def test_every_byte_count_is_one_byte_per_value(llama):
    ids = random_ids(1, 200)
    counts = {}
    for kv_dtype in ("auto", FP8):
        cache = cache_for(llama, token_budget=48, kv_dtype=kv_dtype)
        greedy(llama, ids, cache, max_new_tokens=8)
        counts[kv_dtype] = cache.stats()
    plain, fp8 = counts["auto"], counts[FP8]
    assert fp8["dram_bytes"] * 4 == plain["dram_bytes"] > 0  # fp32 model: 4 bytes a value, 1 in fp8
    assert fp8["h2d_bytes"] == fp8["misses"] * 2 * SIZE * 16 and fp8["misses"] == plain["misses"] > 0
    assert fp8["hbm_block_cache_bytes"] * 4 == plain["hbm_block_cache_bytes"]


@pytest.mark.core
def test_multi_turn_reads_the_8bit_past_back_for_the_next_prompt(llama):
    """A second turn's prefill attends the stored past dequantized: close to the model-dtype run's."""
    first, second = random_ids(1, 90), random_ids(1, 20, seed=5)
    logits = {}
    for kv_dtype in ("auto", FP8):
        cache = cache_for(llama, kv_dtype=kv_dtype)
        with torch.no_grad():
            llama(first, past_key_values=cache)
            logits[kv_dtype] = llama(second, past_key_values=cache).logits[:, -1]
    want = logits["auto"]
    error = (logits[FP8] - want).abs() / want.std()
    assert error.mean() <= 0.01 and error.max() <= 0.2 and not torch.equal(logits[FP8], want)


def test_a_store_of_8bit_blocks_holds_scales_beside_them():
    cpu = torch.device("cpu")
    config = SparseServeConfig(block_size=SIZE, kv_dtype=FP8, hbm_cache_bytes=1 << 20)
    store = TieredBlockStore(config, get_ops("torch", cpu), 16, torch.bfloat16, cpu, hbm_partitions=1)
    blocks = (torch.randn(6, 2, SIZE, 16) * torch.arange(1, 7).view(6, 1, 1, 1)).to(torch.bfloat16)
    ids = store.save(blocks)
    assert store.dram.storage.dtype == store.hbm.pool.dtype == torch.float8_e4m3fn and store.block_bytes == 512
    stored, scales = reference.quantize_blocks(blocks, torch.float8_e4m3fn)
    assert torch.equal(store.block_scales[ids], scales)
    assert torch.equal(store.read(ids), reference.dequantize_blocks(stored, scales, torch.bfloat16))
    slots = store.fetch(ids.view(1, 1, 6))  # through the HBM cache: the stored bytes, unchanged
    assert torch.equal(store.hbm.pool[slots.flatten()].view(torch.uint8), stored.view(torch.uint8))
    plain = TieredBlockStore(SparseServeConfig(block_size=SIZE), get_ops("torch", cpu), 16, torch.bfloat16, cpu)
    assert plain.block_scales is None


@pytest.mark.core
@pytest.mark.parametrize(
    "transfer", [dict(), dict(save_path="flash_d2h"), dict(transfer="copy"), dict(offload=False)],
    ids=["scatter", "flash_d2h", "per-block-copy", "no-offload"],
)  # fmt: skip
def test_every_save_and_load_path_moves_8bit_blocks_and_reads_them_dequantized(transfer):
    cpu = torch.device("cpu")
    sized = {} if transfer.get("offload") is False else dict(hbm_cache_bytes=1 << 20)
    config = SparseServeConfig(block_size=SIZE, kv_dtype=FP8, **sized, **transfer)
    store = TieredBlockStore(config, get_ops("torch", cpu), 16, torch.float32, cpu)
    blocks = torch.randn(40, 2, SIZE, 16) * 5
    ids = store.save(blocks)
    stored, scales = reference.quantize_blocks(blocks, torch.float8_e4m3fn)
    assert torch.equal(store.read(ids), reference.dequantize_blocks(stored, scales, torch.float32))
    slots = store.fetch(ids[:8].view(2, 1, 4))
    assert torch.equal(store.hbm.pool[slots.flatten()].view(torch.uint8), stored[:8].view(torch.uint8))
