"""The decode step as a CUDA-graph replay: same tokens as eager, no host sync, recaptures.

Three rows of different lengths (their tail blocks fill at different steps), tiny Llama, block
16, an HBM cache small enough to evict, Triton backend. The graph decoder is compared with the
same static step run eagerly (`capture=False`) and with the ordinary eager decode path.
CPU counterparts of these checks: tests/test_static_decoder.py.
"""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf.cache import block_cache
from sparseserve_hf.cache.store import LOAD_SUMMARY_KEYS
from sparseserve_hf.graph import StaticDecoder
from test_static_decode import BLOCK, batch_cache, eager_step, static_config
from test_static_decoder import EagerReference
from tiny_models import random_ids, tiny_model

pytestmark = pytest.mark.gpu
STEPS = 3 * BLOCK + 5  # every row's tail fills three times


def model_on_cuda(dtype: torch.dtype):
    return tiny_model("llama").to("cuda", dtype)


def decoder_for(model, capture: bool, **kwargs) -> StaticDecoder:
    cache, tokens = batch_cache(model, static_config(backend="triton"))
    decoder = StaticDecoder(model, cache, capture=capture, **kwargs)
    decoder.start(tokens)
    return decoder


@pytest.mark.parametrize("reorder_beside", [False, True], ids=["install_reorders", "reorder_beside"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_tokens_equal_the_eager_step_and_the_eager_path(dtype, reorder_beside, monkeypatch):
    """Plan test (a); afterwards the ordinary eager path takes the rows over. With the lookup's
    eviction order on a stream of its own too (captured, that stream joins the step again)."""
    monkeypatch.setattr(block_cache, "REORDER_BESIDE", reorder_beside)
    model = model_on_cuda(dtype)
    graph, eager = decoder_for(model, capture=True), decoder_for(model, capture=False)
    reference = EagerReference(model, static_config(backend="triton"))
    for step in range(STEPS):
        got, want, plain = graph.step().clone(), eager.step().clone(), reference.step()
        assert torch.equal(got, want), f"step {step}: graph vs the eager static step"
        assert torch.equal(got, plain), f"step {step}: graph vs the ordinary eager path"
        torch.testing.assert_close(graph.logits, eager.logits)
    assert graph.num_captures == 1
    hits = [decoder.cache.stats() for decoder in (graph, eager)]
    assert hits[0]["hits"] == hits[1]["hits"] and hits[0]["misses"] == hits[1]["misses"] > 0
    for key in LOAD_SUMMARY_KEYS:  # replays count what they read, as the eager step does
        assert hits[0][key] == pytest.approx(hits[1][key]), key
    assert hits[0]["decode_steps"] == STEPS
    tokens, positions = graph._ids.clone(), reference.positions.clone()
    for step in range(BLOCK + 2):  # host tail lengths and num_positions must be right after replays
        tokens = eager_step(model, graph.cache, tokens, positions + step).argmax(-1, keepdim=True)
        assert torch.equal(tokens, reference.step()), f"eager step {step} after the graph"


def test_replays_do_not_sync_with_the_host():
    """Plan test (d): a step that saves no block and changes no table width is one replay, no sync."""
    model = model_on_cuda(torch.float32)
    decoder, eager = decoder_for(model, capture=True), decoder_for(model, capture=False)
    got, guarded = [], 0
    for step in range(STEPS):
        steady = (
            step > 0
            and all(length < BLOCK for length in decoder._tail_len)
            and max(decoder._num_blocks) + 1 <= decoder.cache.layers[0].block_ids.shape[2]
        )
        torch.cuda.synchronize()
        try:
            if steady:
                torch.cuda.set_sync_debug_mode("error")
                guarded += 1
            got.append(decoder.step().clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert guarded >= STEPS - 8 and decoder.num_captures == 1
    for step, tokens in enumerate(got):
        assert torch.equal(tokens, eager.step()), f"step {step}"


def test_a_table_width_change_recaptures_and_keeps_the_tokens():
    """Plan test (e): widths of 4 x 1, 2, 3, 4 blocks, so the rows cross several during the run."""
    model = model_on_cuda(torch.float32)
    graph, eager = decoder_for(model, capture=True, table_step=4), decoder_for(model, capture=False, table_step=4)
    widths = set()
    for step in range(STEPS):
        assert torch.equal(graph.step().clone(), eager.step()), f"step {step}"
        widths.add(graph.cache.layers[0].block_ids.shape[2])
    assert len(widths) >= 2 and graph.num_captures == len(widths)


def test_a_vacant_slot_rides_along_a_captured_step():
    """A batch whose middle slot is vacant replays the tokens of its other rows decoded alone,
    stores nothing in the vacant row and counts it in no statistic (Triton kernels, CUDA graphs)."""
    from sparseserve_hf import SparseServeCache

    model, config = model_on_cuda(torch.float32), static_config(backend="triton")
    three, firsts = batch_cache(model, config)
    three.take_rows([1]).reset()
    again, _ = batch_cache(model, config)
    pair = SparseServeCache(model.config, config, store=again.store)
    for slot, row in enumerate((again.take_rows([0]), again.take_rows([2]))):
        pair.place_rows(row, [slot])
    decoders = []
    for cache, tokens in ((three, firsts), (pair, firsts[[0, 2]])):
        decoders.append(StaticDecoder(model, cache, capture=True))
        decoders[-1].start(tokens)
    for step in range(STEPS):
        with_vacancy, alone = (decoder.step().clone() for decoder in decoders)
        assert torch.equal(with_vacancy[[0, 2]], alone), f"step {step}"
    for layer in three.layers:
        assert int(layer.row_lengths()[1]) == 0 and not bool((layer.block_ids[1] >= 0).any())
    assert three.store.load_summary() == pair.store.load_summary() and decoders[0].num_captures == 1


def test_generator_with_cuda_graphs_gives_the_eager_generators_tokens():
    """Plan test (c): staggered joins, sit-outs and finishes (vacant slots riding along), max_batch 3."""
    from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

    model = model_on_cuda(torch.float32)
    values = dict(block_size=16, token_budget=64, max_batch=3, hbm_cache_bytes=48 * 2048, dram_bytes=4000 * 2048,
                  prefill_mode="layer_segmented", max_inject_tokens=60, backend="triton")  # fmt: skip
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (5, 37, 80, 130, 16, 1)]
    params = SamplingParams(max_new_tokens=3 * BLOCK)
    eager = Generator(model, None, SparseServeConfig(**values)).generate(prompts, params)
    graphed_gen = Generator(model, None, SparseServeConfig(**values, cuda_graphs=True))
    graphed = graphed_gen.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    decoder = graphed_gen._decoder  # one capture per (rows, table width)
    assert decoder.num_captures == len(decoder._captured) > 1


def test_decode_ahead_over_replayed_steps_gives_the_tokens_of_steps_read_in_turn():
    """`decode_ahead` on CUDA: the next replay is launched before this step's tokens are read back
    (the pinned copy behind an event), and the tokens equal the same engine reading each step back
    before the next launch. Steps were really in flight between iterations."""
    from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

    model = model_on_cuda(torch.float32)
    values = dict(block_size=16, token_budget=64, dram_bytes=4000 * 2048, backend="triton", cuda_graphs=True)
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (37, 80, 130, 16)]
    params = [SamplingParams(max_new_tokens=n) for n in (40, 25, 33, 48)]
    in_turn = Generator(model, None, SparseServeConfig(**values)).generate(prompts, params)
    ahead = Generator(model, None, SparseServeConfig(**values, decode_ahead=True))
    ids = [ahead.submit(p, q) for p, q in zip(prompts, params)]
    outputs, in_flight = {}, 0
    while ahead.has_unfinished:
        outputs |= {e.request_id: e.output for e in ahead.step() if e.output is not None}
        in_flight += ahead._ahead is not None
    assert [outputs[i].token_ids for i in ids] == [o.token_ids for o in in_turn]
    assert in_flight >= 10 and ahead._decoder.num_captures >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_replay_the_eager_static_step_and_equal_the_models_norms(dtype):
    """`fused_norms`: the graph and the same static step run eagerly both fuse the norms, and the
    fused norm is the model's own bit for bit, so both give the eager path's logits and tokens."""
    model = tiny_model("llama", num_heads=16, num_kv_heads=2).to("cuda", dtype)  # rows of 256: the kernel's
    room = 2 * static_config().hbm_cache_bytes  # a group of 8 query heads: twice the union
    config = static_config(backend="triton", fused_norms=True, hbm_cache_bytes=room)
    decoders = []
    for capture in (True, False):
        cache, tokens = batch_cache(model, config)
        decoders.append(StaticDecoder(model, cache, capture=capture))
        decoders[-1].start(tokens)
    assert decoders[0]._fused.norms, "the fused norm was left out: it differs from the model's"
    assert decoders[0]._fused.mlps, "the fused activation was left out: it differs from the model's"
    assert decoders[0]._fused.decoders, "the residual adds were left out of the norms: they differ from the model's"
    cache, tokens = batch_cache(model, static_config(backend="triton", fused_norms=False, hbm_cache_bytes=room))
    plain = StaticDecoder(model, cache, capture=False)
    plain.start(tokens)
    for step in range(BLOCK + 3):
        got, want = decoders[0].step().clone(), decoders[1].step().clone()
        assert torch.equal(got, want), f"step {step}"
        assert torch.equal(plain.step(), want), f"step {step}"
        if step == 0:
            assert torch.equal(decoders[1].logits, plain.logits)
    assert decoders[0].num_captures == 1


def kernel_streams(decoder: StaticDecoder) -> set[int]:
    """The CUDA streams one step of `decoder` ran kernels on."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        decoder.step()
        torch.cuda.synchronize()
    return {event.device_resource_id for event in profile.events() if event.device_type.name == "CUDA"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_beside_run_on_a_second_stream_and_keep_the_bits(dtype):
    """`projections_beside`: k's and v's projections (and the MLP's up) run on a stream of their own
    in the static step, eager or captured, and the logits stay those of the step without it."""
    model = tiny_model("llama", num_heads=16, num_kv_heads=2).to("cuda", dtype)
    room = 2 * static_config().hbm_cache_bytes
    decoders = {}
    for beside, capture in ((True, True), (True, False), (False, False)):
        cache, tokens = batch_cache(
            model, static_config(backend="triton", hbm_cache_bytes=room, projections_beside=beside)
        )
        decoders[beside, capture] = StaticDecoder(model, cache, capture=capture)
        decoders[beside, capture].start(tokens)
    fused = decoders[True, True]._fused
    assert len(fused.attentions) == model.config.num_hidden_layers and fused.mlp_side is not None
    assert decoders[False, False]._fused.attentions == []
    for step in range(BLOCK + 3):
        tokens = [decoder.step().clone() for decoder in decoders.values()]
        assert torch.equal(tokens[0], tokens[2]) and torch.equal(tokens[1], tokens[2]), f"step {step}"
        assert torch.equal(decoders[True, False].logits, decoders[False, False].logits), f"step {step}"
    streams = [kernel_streams(decoders[beside, False]) for beside in (True, False)]  # each cache has its own
    assert len(streams[0]) == len(streams[1]) + 1, "k's and v's projections ran on the step's own stream"
