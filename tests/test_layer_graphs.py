"""Eager decode with each layer's attention replayed as a captured piece (`LayerGraphs`), on CPU.

A stand-in for the CUDA side (`fake_graphs.FakePieceCapture`) does to state what a capture and
a replay do: a capture runs no kernel, a replay no Python. The eager path with pieces must decode
exactly what it decodes without them, through block fills, table growth, pool growth and rows
that move, and a whole-step caller (`StaticDecoder`) must never replay a piece.
tests/test_cuda.py runs real pieces on CUDA (`model.generate`).
"""

from __future__ import annotations

import pytest
import torch

from fake_graphs import FakePieceCapture
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.store import LOAD_SUMMARY_KEYS
from sparseserve_hf.graph import StaticDecoder
from sparseserve_hf.layer_graphs import LayerGraphs, garbage_collection_paused
from test_static_decode import LENGTHS, batch_cache, eager_step, static_config
from tiny_models import random_ids

STEPS = 40  # every row's tail fills twice or more
GROWING = (250, 241, 255)  # 16 blocks (the first table width) are full within the steps


def with_pieces(cache: SparseServeCache, **kwargs) -> FakePieceCapture:
    capture = FakePieceCapture(cache)
    cache.store.layer_graphs = LayerGraphs(cache.store, capture, **kwargs)
    return capture


def decode(model, cache: SparseServeCache, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    positions = cache.layers[0].row_lengths().view(-1, 1)
    out = []
    for step in range(steps):
        tokens = eager_step(model, cache, tokens, positions + step).argmax(-1, keepdim=True)
        out.append(tokens)
    return out


@pytest.mark.core
def test_replayed_pieces_decode_what_the_eager_path_decodes(llama):
    """Rows whose tails fill at different steps, an HBM cache that evicts, table widths that grow."""
    config = static_config(dram_bytes=None)  # a pool that grows: the store moves, every piece goes
    plain, tokens = batch_cache(llama, config, lengths=GROWING)
    pieces, _ = batch_cache(llama, config, lengths=GROWING)
    capture = with_pieces(pieces)
    graphs = pieces.store.layer_graphs
    pools, epoch = capture.pools, pieces.store.epoch
    half = STEPS // 2
    want, got = decode(llama, plain, tokens, half), decode(llama, pieces, tokens, half)
    store = pieces.store  # blocks nobody reads fill the pool: it grows, the metadata moves
    spare = store.save(torch.randn(store.dram.capacity - store.dram.num_used + 1, *store.dram.block_shape))
    want += decode(llama, plain, want[-1], STEPS - half)
    got += decode(llama, pieces, got[-1], STEPS - half)
    store.free(spare)
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {step}"
    sparse_layers = len(pieces.layers)
    assert capture.replays > (STEPS - 8) * sparse_layers  # most calls replay
    assert graphs.num_captures >= 2 * sparse_layers  # the table grew: captured again
    assert pieces.store.epoch > epoch and capture.pools > pools  # the pool grew: every piece dropped
    ours, theirs = pieces.stats(), plain.stats()
    for key in ("hits", "misses", *LOAD_SUMMARY_KEYS):
        assert ours[key] == pytest.approx(theirs[key]), key
    for layer_a, layer_b in zip(plain.layers, pieces.layers):  # the working set reads what replays picked
        assert torch.equal(layer_a.last_selection, layer_b.last_selection)


@pytest.mark.core
def test_rows_that_move_are_captured_again(llama):
    """Beam-style row reordering replaces the layers' tensors: their pieces are captured anew."""
    config = static_config()
    plain, tokens = batch_cache(llama, config)
    pieces, _ = batch_cache(llama, config)
    with_pieces(pieces)
    graphs = pieces.store.layer_graphs
    decode(llama, plain, tokens, 3), decode(llama, pieces, tokens, 3)
    before = graphs.num_captures
    order = torch.tensor([2, 0, 0])
    for cache in (plain, pieces):
        cache.reorder_cache(order)
    last = pieces.layers[0].row_lengths().view(-1, 1)
    tokens = random_ids(3, 1, seed=9)
    want, got = decode(llama, plain, tokens, 5), decode(llama, pieces, tokens, 5)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert graphs.num_captures == before + len(pieces.layers)  # once per layer, then replays
    assert len(graphs._pieces) == len(pieces.layers)  # the pieces of the old rows are gone
    assert torch.equal(pieces.layers[0].row_lengths().view(-1, 1), last + 5)


@pytest.mark.core
def test_a_whole_step_caller_never_replays_a_piece(llama):
    """The decoder's static step (eager here, captured on CUDA) runs the attention inline."""
    cache, tokens = batch_cache(llama, static_config())
    capture = with_pieces(cache)
    decoder = StaticDecoder(llama, cache, capture=False)
    decoder.start(tokens)
    for _ in range(4):
        decoder.step()
    assert cache.store.layer_graphs.num_captures == 0 and capture.replays == 0


@pytest.mark.core
def test_the_piece_limit_drops_the_least_recently_replayed(llama):
    cache, tokens = batch_cache(llama, static_config())
    with_pieces(cache, max_pieces=1)
    plain, _ = batch_cache(llama, static_config())
    want, got = decode(llama, plain, tokens, 4), decode(llama, cache, tokens, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    graphs = cache.store.layer_graphs
    assert len(graphs._pieces) == 1 and graphs.num_captures == 4 * len(cache.layers)  # every call captured


def test_layer_graphs_is_a_bool_and_off_on_cpu(llama):
    with pytest.raises(ValueError, match="layer_graphs must be a bool"):
        SparseServeConfig(layer_graphs="yes")
    assert SparseServeConfig().layer_graphs is True
    cache, _ = batch_cache(llama, static_config(layer_graphs=True), lengths=LENGTHS[:1])
    assert cache.store.layer_graphs is None  # CPU: nothing to capture


@pytest.mark.core
def test_a_failed_capture_switches_pieces_off_and_decoding_goes_on(llama, caplog):
    """The capture raises (e.g. out of memory): that step's result is its warm-up's, one warning
    says so, the layer's pool is forgotten (a half-made graph takes it with it) and every later
    call runs eagerly; the tokens are the plain path's throughout."""
    plain, tokens = batch_cache(llama, static_config())
    pieces, _ = batch_cache(llama, static_config())
    capture = with_pieces(pieces)

    def failing(fn, layer_idx):
        raise RuntimeError("out of memory while capturing")

    capture.record = failing
    want, got = decode(llama, plain, tokens, 6), decode(llama, pieces, tokens, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    graphs = pieces.store.layer_graphs
    assert not graphs.enabled and not graphs._pieces and capture.replays == 0
    assert "capturing layer 0 failed" in caplog.text


@pytest.mark.core
def test_a_selection_override_set_after_captures_is_followed(llama):
    """Pieces captured without an override would replay the model's own picks: the override is
    part of the store's graph state, so the next call forgets them and captures the override's
    launches; `paused` runs every call eagerly meanwhile."""
    cache, tokens = batch_cache(llama, static_config())
    capture = with_pieces(cache)
    graphs = cache.store.layer_graphs
    got = decode(llama, cache, tokens, 3)
    captured, before = graphs.num_captures, cache.store.graph_state()
    calls = []

    def first_blocks(layer_idx, num_blocks, width):  # every KV head loads the row's first blocks
        calls.append(layer_idx)
        picked = torch.arange(width).expand(num_blocks.shape[0], cache.layers[0].tail.shape[1], width)
        return picked.clamp(max=int(num_blocks.min()) - 1), picked < int(num_blocks.min())

    cache.store.selection_override = first_blocks
    assert cache.store.graph_state() != before
    replays = capture.replays
    with graphs.paused():
        decode(llama, cache, got[-1], 2)
    assert capture.replays == replays and len(calls) == 2 * len(cache.layers)  # Python ran at every call
    decode(llama, cache, got[-1], 1)
    assert graphs.num_captures == captured + len(cache.layers)  # captured again, under the override
    assert len(calls) > 2 * len(cache.layers)  # the capture ran the override
    assert torch.equal(cache.layers[0].last_pick[0][0, 0, :2], torch.tensor([0, 1]))


def test_captures_pause_the_garbage_collector_and_restore_it():
    """Inside `garbage_collection_paused` no automatic collection runs; afterwards the collector is
    as it was (on, or off when the caller had turned it off), also after an exception."""
    import gc

    assert gc.isenabled()
    with garbage_collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), garbage_collection_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
