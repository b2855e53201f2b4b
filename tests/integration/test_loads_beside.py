"""Loads beside the attention (`TieredBlockStore.fetch_beside`): a lookup's misses are copied from
pinned DRAM on a side stream while the attention over its hits runs, and the attention waits for
the copy before it reads the blocks the copy brings."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops, reference

SIZE, DIM, GROUP = 32, 128, 4


def make_store(device: str, dtype: torch.dtype = torch.bfloat16) -> TieredBlockStore:
    config = SparseServeConfig(block_size=SIZE, hbm_cache_bytes=64 << 20)
    device = torch.device(device)
    return TieredBlockStore(config, get_ops("auto", device), DIM, dtype, device, hbm_partitions=2)


def saved_blocks(store: TieredBlockStore, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, 2, S, D) random blocks saved to the store's DRAM, and their ids."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randn(count, 2, SIZE, DIM, generator=generator).to(store.dtype).to(store.device)
    return blocks, store.save(blocks)


def attend(store: TieredBlockStore, query: torch.Tensor, lookup, tail: torch.Tensor) -> torch.Tensor:
    tail_len = torch.full((query.shape[0],), SIZE // 2, device=query.device)
    return store.ops.sparse_decode(
        query, store.hbm.pool, lookup.slots, None, tail[:, :, 0], tail[:, :, 1], tail_len, DIM**-0.5,
        loading=lookup.loading, await_loads=lookup.wait,
    )  # fmt: skip


def expected_attention(
    query: torch.Tensor, blocks: torch.Tensor, ids: torch.Tensor, selection: torch.Tensor, tail: torch.Tensor
) -> torch.Tensor:
    """The reference over the selected blocks themselves: a pool whose slot i holds DRAM block i."""
    by_id = blocks.new_zeros((int(ids.max()) + 1, *blocks.shape[1:]))
    by_id[ids] = blocks
    tail_len = torch.full((query.shape[0],), SIZE // 2, device=query.device)
    return reference.sparse_decode(
        query, by_id, selection, None, tail[:, :, 0], tail[:, :, 1], tail_len, DIM**-0.5
    )  # fmt: skip


def test_on_cpu_a_lookup_beside_is_an_ordinary_complete_lookup():
    store = make_store("cpu", torch.float32)
    blocks, ids = saved_blocks(store, 12, seed=0)
    lookup = store.fetch_beside(ids.view(2, 2, 3))
    assert lookup.loading is None and lookup.copied is None and store._load_stream is None
    lookup.wait()  # nothing to wait for
    assert torch.equal(store.hbm.pool[lookup.slots.flatten()], blocks)


@pytest.mark.gpu
def test_the_loading_entries_are_the_misses_and_hold_their_blocks_after_the_wait():
    store = make_store("cuda")
    blocks, ids = saved_blocks(store, 64, seed=1)
    selection = ids.view(2, 2, 16)  # head h's ids are its own: partition h
    store.fetch(selection[:, :, :8]).flatten()  # the first half of every list is resident
    lookup = store.fetch_beside(selection)
    lookup.wait()
    torch.cuda.synchronize()
    assert torch.equal(lookup.loading.cpu(), torch.arange(16).expand(2, 2, 16) >= 8)
    assert torch.equal(store.hbm.pool[lookup.slots.flatten()], blocks)
    assert lookup.copied is None and lookup.in_flight == ()


@pytest.mark.gpu
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "cuda_graph"])
def test_attention_over_a_lookup_beside_equals_the_reference(captured):
    """Every step mixes hits and misses (new blocks enter each step, evicting old ones); in a CUDA
    graph the side stream joins the capture and each replay loads that replay's misses."""
    store = make_store("cuda")
    blocks, ids = saved_blocks(store, 2 * 2 * 200, seed=2)
    heads = ids.view(2, 2, 200)
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 2 * GROUP, DIM, generator=generator).to(torch.bfloat16).cuda()
    tail = torch.randn(2, 2, 2, SIZE, DIM, generator=generator).to(torch.bfloat16).cuda()
    selection = torch.empty(2, 2, 24, dtype=torch.long, device="cuda")
    static = {}

    def step():
        static["out"] = attend(store, query, store.fetch_beside(selection), tail)

    graph = None
    for index in range(6):
        start = index * 4  # a sliding window of 24 of each list's 200 blocks: 4 new ones per step
        selection.copy_(heads[:, :, start : start + 24])
        if captured and graph is None:
            step()  # a warm-up launch outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        if graph is not None:
            graph.replay()
        else:
            step()
        torch.cuda.synchronize()
        want = expected_attention(query, blocks, ids, selection, tail)
        torch.testing.assert_close(static["out"].float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_the_ablation_loads_before_the_attention():
    config = SparseServeConfig(block_size=SIZE, hbm_cache_bytes=64 << 20, loads_beside=False)
    cuda = torch.device("cuda")
    store = TieredBlockStore(config, get_ops("auto", cuda), DIM, torch.bfloat16, cuda, hbm_partitions=2)
    blocks, ids = saved_blocks(store, 12, seed=4)
    lookup = store.fetch_beside(ids.view(2, 2, 3))
    assert lookup.loading is None and lookup.copied is None and store._load_stream is None
    torch.cuda.synchronize()
    assert torch.equal(store.hbm.pool[lookup.slots.flatten()], blocks)
