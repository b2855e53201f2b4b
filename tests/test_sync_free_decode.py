"""A steady decode step through a SparseServeCache does no host sync.

Steady: no row's tail block fills in this step (that step saves the full block to DRAM, host
work once per block_size tokens of a row) and the rows did not change since the last step.
On CUDA with the Triton backend, `torch.cuda.set_sync_debug_mode("error")` turns any sync into
an error. On CPU, `sync_guard.forbid_host_syncs` looks for the ops that would sync; two CPU-only
pieces are swapped out there: the block copy, whose reference filters entries with a boolean mask
(on the GPU it is the FlashH2D kernel, one launch over a fixed grid that skips -1 entries), and
the eager CPU decode's trim of unused union columns (`attention.used_columns`, never run on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.generation.prefill import DecoderStack
from sync_guard import forbid_host_syncs
from tiny_models import greedy, random_ids, tiny_model

BLOCK = 16
PROMPT = 150  # 9 full blocks + a tail of 6 tokens: the next 9 steps fill no block


def fixed_shape_gather(pool_src, src_ids, pool_dst, dst_slots, count=None) -> None:
    """`reference.gather_blocks` without a boolean mask: skipped entries write a scratch row."""
    live = (src_ids >= 0) & (dst_slots >= 0)
    scratch = torch.cat((pool_dst, pool_dst[:1]))  # (P + 1, 2, S, D): row P absorbs skipped entries
    scratch[torch.where(live, dst_slots, pool_dst.shape[0])] = pool_src[src_ids.clamp(min=0)].to(pool_dst.device)
    pool_dst.copy_(scratch[:-1])


def prefilled(device: str, backend: str, batch: int = 3, layer_graphs: bool = False):
    """A tiny model, its stack and a cache holding a prefilled batch, tight enough to evict."""
    model = tiny_model("llama", num_heads=4, num_kv_heads=2).to(device)
    config = SparseServeConfig(
        block_size=BLOCK,
        token_budget=64,
        hbm_cache_bytes=2 * batch * 4 * 3 * 2 * BLOCK * 16 * 4,
        backend=backend,
        layer_graphs=layer_graphs,
    )
    cache = SparseServeCache(model.config, config)
    ids = random_ids(batch, PROMPT).to(device)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[:, -1:]
    return DecoderStack(model), cache, logits.argmax(-1)


def decode_step(stack: DecoderStack, cache: SparseServeCache, tokens: torch.Tensor, position: int) -> torch.Tensor:
    """One decode forward of every layer, as the Generator runs it; returns the next tokens (B, 1) on device."""
    positions = torch.full_like(tokens, position)
    hidden = stack.run_layers(stack.embed(tokens), 0, stack.num_layers, cache=cache, position_ids=positions)
    return stack.logits(hidden).argmax(-1)


def test_steady_decode_step_runs_no_data_dependent_op_on_cpu(monkeypatch):
    stack, cache, tokens = prefilled("cpu", "torch")
    cache.store.hbm.gather_blocks = fixed_shape_gather
    monkeypatch.setattr(
        "sparseserve_hf.attention.used_columns", lambda slots, head_mask, scales: (slots, head_mask, scales)
    )
    with torch.no_grad():
        for step in range(4):  # the prompt's commit left the block and tail counts known on the host
            with forbid_host_syncs() as seen:
                tokens = decode_step(stack, cache, tokens, PROMPT + step)
            assert seen == [], f"step {step}: {sorted(set(seen))}"
    stats = cache.stats()
    assert stats["misses"] > 0 and stats["hits"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("layer_graphs", [False, True])
def test_steady_decode_step_does_not_sync_on_cuda(layer_graphs):
    """Launched kernel by kernel, or each layer's attention replayed (`layer_graphs`: the first
    step captures, the next ones replay)."""
    stack, cache, tokens = prefilled("cuda", "triton", layer_graphs=layer_graphs)
    with torch.no_grad():
        tokens = decode_step(stack, cache, tokens, PROMPT)
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            for step in range(1, 4):
                tokens = decode_step(stack, cache, tokens, PROMPT + step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert cache.stats()["misses"] > 0
    if layer_graphs:
        assert cache.store.layer_graphs.num_captures == stack.num_layers


def test_decode_under_inference_mode_equals_stock():
    """Inference-mode tensors keep no version counter: the host copy of block and tail counts is then re-read."""
    model, sdpa = tiny_model("llama"), tiny_model("llama", "sdpa")
    ids = random_ids(2, 70)
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=BLOCK, token_budget=4096))
    with torch.inference_mode():
        assert torch.equal(greedy(model, ids, cache), greedy(sdpa, ids))


def test_stats_and_a_second_generate_outside_inference_mode():
    """A cache first used under inference_mode still reports stats and decodes outside it (examples/demo.py)."""
    model = tiny_model("llama")
    ids = random_ids(1, 70)
    cache = SparseServeCache(
        model.config, SparseServeConfig(block_size=BLOCK, token_budget=4 * BLOCK, hbm_cache_bytes=1 << 20)
    )
    with torch.inference_mode():
        greedy(model, ids, cache, max_new_tokens=4)
    first = cache.stats()
    assert first["hits"] + first["misses"] > 0
    assert cache.stats()["hits"] == first["hits"]  # counters folded in once, not twice
