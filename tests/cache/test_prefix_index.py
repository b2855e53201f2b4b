"""PrefixIndex over a real store: longest-chain match by tokens, one reference per entry, safe reclaim."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.cache import prefix_index
from sparseserve_hf.cache.prefix_index import PrefixIndex
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops

S, LAYERS, HEADS, DIM = 4, 2, 3, 8  # block size, sparse layers, KV heads, head_dim


@pytest.fixture
def store():
    config = SparseServeConfig(block_size=S, token_budget=4 * S, backend="torch")
    return TieredBlockStore(config, get_ops("torch", torch.device("cpu")), DIM, torch.float32, torch.device("cpu"))


def saved(store: TieredBlockStore, blocks: int) -> torch.Tensor:
    """(L, Hkv, blocks) ids of freshly saved random head-blocks, one reference each (the 'request')."""
    ids = store.save(torch.randn(LAYERS * HEADS * blocks, 2, S, DIM))
    return ids.view(LAYERS, HEADS, blocks)


def refs(store: TieredBlockStore, ids: torch.Tensor) -> list[int]:
    return store.dram.refcount[ids.flatten()].tolist()


def test_match_takes_the_longest_chain_of_whole_blocks_by_tokens(store):
    index = PrefixIndex(store, S)
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    ids = saved(store, 3)
    assert index.insert(tokens, ids) == 3
    assert [torch.equal(e.ids, ids[:, :, j]) for j, e in enumerate(index.match(tokens))] == [True] * 3
    assert len(index.match(tokens[:11])) == 2  # the third block is not whole
    other = tokens[:5] + [7] + tokens[6:]  # block 1 differs: the chain stops after block 0
    assert len(index.match(other)) == 1 and index.match([1, 2, 3, 4, 5]) == []
    assert index.match(tokens[4:]) == []  # the same tokens at another position are another prefix


def test_insert_references_each_new_block_once_and_keeps_the_first_ids(store):
    index = PrefixIndex(store, S)
    tokens = list(range(12))
    first, second = saved(store, 3), saved(store, 3)
    index.insert(tokens[:8], first[:, :, :2])
    assert index.insert(tokens, second) == 1  # blocks 0 and 1 were cached: only block 2 is new
    assert set(refs(store, first[:, :, :2])) == {2} and set(refs(store, second[:, :, 2])) == {2}
    assert set(refs(store, second[:, :, :2])) == {1}  # the duplicates stay the request's alone
    assert torch.equal(index.match(tokens)[1].ids, first[:, :, 1])


def test_colliding_hashes_are_told_apart_by_their_tokens(store, monkeypatch):
    monkeypatch.setattr(prefix_index, "chain_key", lambda parent_key, tokens: 0)  # every block one bucket
    index = PrefixIndex(store, S)
    a, b = list(range(8)), list(range(8, 16))
    ids_a, ids_b = saved(store, 2), saved(store, 2)
    index.insert(a, ids_a)
    index.insert(b, ids_b)
    assert [torch.equal(e.ids, ids_b[:, :, j]) for j, e in enumerate(index.match(b))] == [True, True]
    assert len(index.match(a[:4] + b[4:])) == 1  # a's first block, then b's second block under another parent


def test_reclaim_frees_unused_leaves_oldest_first_and_never_what_a_request_holds(store):
    index = PrefixIndex(store, S)
    doc, other = list(range(12)), list(range(50, 58))
    doc_ids, other_ids = saved(store, 3), saved(store, 2)
    index.insert(doc, doc_ids)
    index.insert(other, other_ids)
    store.free(doc_ids.flatten())  # the requests that computed them ended: only the index holds them
    store.free(other_ids.flatten())
    used = index.match(doc[:8])  # a live request adopts doc's first two blocks
    index.acquire(used)
    index.match(other)  # other is the most recently used now
    per_block = LAYERS * HEADS
    assert index.reclaim(1) == per_block  # doc's third block: the oldest leaf nobody uses
    assert store.dram.refcount[doc_ids[:, :, 2].flatten()].sum() == 0 and index.num_entries == 4
    assert index.reclaim(10 * per_block) == 2 * per_block  # other's two; doc's first two are in use
    assert set(refs(store, doc_ids[:, :, :2])) == {1} and index.num_entries == 2
    index.release(used)
    assert index.reclaim(10 * per_block) == 2 * per_block and index.num_entries == 0  # child before parent
    assert store.dram.num_used == 0


def test_a_block_a_request_still_references_frees_nothing_when_its_entry_goes(store):
    index = PrefixIndex(store, S)
    ids = saved(store, 1)
    index.insert(list(range(S)), ids)
    assert index.reclaim(1) == 0 and index.num_entries == 0  # the entry went, the block stays the request's
    assert set(refs(store, ids)) == {1}


def test_clear_gives_every_reference_back(store):
    index = PrefixIndex(store, S)
    ids = saved(store, 2)
    index.insert(list(range(2 * S)), ids)
    index.clear()
    assert set(refs(store, ids)) == {1} and index.num_entries == 0 and index.match(list(range(2 * S))) == []
