"""The same ladder on a CUDA device (pinned DRAM pool, device-resident metadata and block cache)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import greedy, left_pad, random_ids, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_budget_covering_the_sequence_equals_sdpa(dtype):
    model = tiny_model("llama", num_heads=6, num_kv_heads=2).to("cuda", dtype)
    sdpa = tiny_model("llama", "sdpa", num_heads=6, num_kv_heads=2).to("cuda", dtype)
    ids = random_ids(2, 203).cuda()
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=4096))
    assert torch.equal(greedy(model, ids, cache), greedy(sdpa, ids))
    store = cache.store
    assert store.dram.storage.is_pinned() and store.hbm.pool.is_cuda and store.metadata.is_cuda


def test_cuda_left_padded_small_budget_equals_single_runs():
    model = tiny_model("llama").cuda()
    rows = [random_ids(1, n, seed=n)[0] for n in (180, 77)]
    ids, mask = left_pad(rows)
    config = SparseServeConfig(block_size=16, token_budget=48, hbm_cache_bytes=1 << 20)
    batched = greedy(model, ids.cuda(), SparseServeCache(model.config, config), attention_mask=mask.cuda())
    for i, row in enumerate(rows):
        alone = greedy(model, row[None].cuda(), SparseServeCache(model.config, config))
        assert torch.equal(batched[i], alone[0])


def test_cuda_and_cpu_select_the_same_blocks():
    cpu_model, gpu_model = tiny_model("llama"), tiny_model("llama").cuda()
    ids = random_ids(1, 300)
    config = SparseServeConfig(block_size=16, token_budget=64)
    caches = [SparseServeCache(m.config, config) for m in (cpu_model, gpu_model)]
    with torch.no_grad():
        for model, cache, device in zip((cpu_model, gpu_model), caches, ("cpu", "cuda")):
            token = model(ids.to(device), past_key_values=cache).logits[:, -1:].argmax(-1)
            model(token, past_key_values=cache)
    for cpu_layer, gpu_layer in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(cpu_layer.last_selection, gpu_layer.last_selection.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_generate_replaying_layer_pieces_equals_launching_them(dtype):
    """The drop-in `generate` with each layer's attention replayed (`layer_graphs`, the default)
    decodes the tokens it decodes launching the kernels one by one, through block fills, an HBM
    cache that evicts and a table that grows (prompts of 250 tokens, 16-token blocks)."""
    model = tiny_model("llama", num_heads=6, num_kv_heads=2).to("cuda", dtype)
    ids = random_ids(3, 250).cuda()
    outs, caches = [], []
    for layer_graphs in (True, False):
        config = SparseServeConfig(block_size=16, token_budget=64, hbm_cache_bytes=1 << 20, layer_graphs=layer_graphs)
        cache = SparseServeCache(model.config, config)
        outs.append(greedy(model, ids, cache, max_new_tokens=40))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    graphs = caches[0].store.layer_graphs
    assert caches[1].store.layer_graphs is None
    assert len(caches[0].layers) <= graphs.num_captures <= 3 * len(caches[0].layers)  # per table width
    stats = [cache.stats() for cache in caches]
    assert stats[0]["misses"] == stats[1]["misses"] > 0 and stats[0]["hits"] == stats[1]["hits"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pools", ["fixed", "growing"])
def test_cuda_generate_replaying_whole_steps_equals_the_eager_path(dtype, pools):
    """A cache built from the model (`generate_graphs`, the default) replays each decode step of the
    whole model as one CUDA graph: the tokens of the eager path (with and without layer pieces),
    left padding, block fills, evictions, a growing table; with the default pools too (DRAM sized
    by the prompt, an unlimited HBM cache grown before replays)."""
    model = tiny_model("llama", num_heads=6, num_kv_heads=2).to("cuda", dtype)
    rows = [random_ids(1, n, seed=n)[0] for n in (250, 231, 244)]
    ids, mask = left_pad(rows)
    ids, mask = ids.cuda(), mask.cuda()
    sizes = dict(hbm_cache_bytes=1 << 20, dram_bytes=64 << 20) if pools == "fixed" else {}
    config = SparseServeConfig(block_size=16, token_budget=64, **sizes)
    routed = SparseServeCache(model, config)
    assert routed.generate_graphs is not None
    got = greedy(model, ids, routed, max_new_tokens=40, attention_mask=mask)
    for layer_graphs in (True, False):
        plain = SparseServeCache(model.config, replace(config, layer_graphs=layer_graphs))
        assert torch.equal(got, greedy(model, ids, plain, max_new_tokens=40, attention_mask=mask)), layer_graphs
    route = routed.generate_graphs
    assert route.steps == 39 and route.decoder.capture and route.decoder.capture_error is None
    assert 1 <= route.decoder.num_captures <= 4
    assert routed.stats()["misses"] > 0


def test_cuda_pinned_empty_is_page_locked_and_copies_both_ways():
    from sparseserve_hf.pinned import pinned_empty

    host = pinned_empty((1000, 2, 32, 64), torch.bfloat16)
    assert host.is_pinned()
    host.copy_(torch.randn(host.shape).to(torch.bfloat16))
    device = host.to("cuda", non_blocking=True)
    back = pinned_empty(host.shape, host.dtype)
    back.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, host)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_8bit_kv_decodes_alike_on_every_route_and_close_to_model_dtype_kv(dtype):
    """kv_dtype float8: the pinned pool and the HBM cache hold 8-bit blocks, the Triton kernel
    dequantizes them; whole-step replays, layer pieces and launched kernels give the same tokens."""
    model = tiny_model("llama", num_heads=6, num_kv_heads=2).to("cuda", dtype)
    ids = random_ids(3, 250).cuda()
    config = SparseServeConfig(block_size=16, token_budget=64, hbm_cache_bytes=1 << 20, kv_dtype="float8_e4m3fn")
    routed = SparseServeCache(model, config)
    got = greedy(model, ids, routed, max_new_tokens=40)
    assert routed.store.dram.storage.dtype == routed.store.hbm.pool.dtype == torch.float8_e4m3fn
    assert routed.store.dram.storage.is_pinned() and routed.generate_graphs.decoder.num_captures >= 1
    for layer_graphs in (True, False):
        plain = SparseServeCache(model.config, replace(config, layer_graphs=layer_graphs))
        assert torch.equal(got, greedy(model, ids, plain, max_new_tokens=40)), layer_graphs
    fed = torch.cat((ids, got[:, :-1]), dim=1)  # the 8-bit run's tokens, teacher-forced through both
    logits = {}
    for kv_dtype in ("auto", "float8_e4m3fn"):
        cache = SparseServeCache(model.config, replace(config, kv_dtype=kv_dtype))
        with torch.no_grad():
            model(fed[:, :250], past_key_values=cache)
            steps = [model(fed[:, t : t + 1], past_key_values=cache).logits[:, -1].float() for t in range(250, 289)]
        logits[kv_dtype] = torch.stack(steps)
    error = (logits["float8_e4m3fn"] - logits["auto"]).abs().mean() / logits["auto"].std()
    assert 0 < error <= 0.04  # the channel default feeds exact numbers over 8-bit blocks back: some picks move


class _Cycle:
    """An object in a reference cycle: only the garbage collector frees it (and what it holds)."""

    def __init__(self, payload) -> None:
        self.payload, self.me = payload, self


def test_cuda_a_collection_during_capture_cannot_free_pinned_memory_inside_it():
    """Caches dropped in reference cycles hold pinned DRAM pools; with the collector's threshold at
    1 it would run inside every capture, and freeing a pool there (a CUDA call a capture forbids
    on its thread) would invalidate the capture. Captures pause the collector, so every layer
    piece and whole step is captured and the process stays usable."""
    import gc

    model = tiny_model("llama", num_heads=6, num_kv_heads=2).to("cuda", torch.bfloat16)
    ids = random_ids(3, 250).cuda()
    config = SparseServeConfig(block_size=16, token_budget=64, hbm_cache_bytes=1 << 20)
    threshold = gc.get_threshold()
    try:
        for built_from in (model.config, model):  # layer pieces, then whole-step replays
            for _ in range(3):
                dropped = SparseServeCache(model.config, config)
                greedy(model, ids[:, :40], dropped, max_new_tokens=2)  # its pinned pool exists
                _Cycle(dropped)
                del dropped
            gc.set_threshold(1)
            cache = SparseServeCache(built_from, config)
            got = greedy(model, ids, cache, max_new_tokens=20)
            gc.set_threshold(*threshold)
            graphs = cache.store.layer_graphs if built_from is model.config else cache.generate_graphs.decoder
            assert graphs.num_captures >= 1 and getattr(graphs, "enabled", True)
            assert torch.equal(got, greedy(model, ids, SparseServeCache(model.config, config), max_new_tokens=20))
    finally:
        gc.set_threshold(*threshold)
