"""The Generator end to end on tiny random models (Llama, and Mistral / Qwen2 / Qwen3): batch == one by one, streaming, cancel, metrics."""

from __future__ import annotations

import io
import json

import pytest
import torch
from gen_support import prompt, stock_greedy, tiny_model

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

LENGTHS = (5, 37, 80, 130, 16, 1)


# The default selector loads exactly its budget per KV head; the hybrid group union (the default before
# channel scores) loads up to G x it, so its working sets are larger: a larger HBM cache makes admission
# leave rows out as often.
CACHE_BYTES = 32 * 2048
HYBRID_UNION = dict(metadata="hybrid", selection="group_union", group_aggregation="max")
HYBRID_CACHE_BYTES = 48 * 2048


def small_config(**overrides) -> SparseServeConfig:
    values = dict(block_size=16, token_budget=48) | overrides
    return SparseServeConfig(**values)


def one_by_one(model, config: SparseServeConfig, prompts, params) -> list[tuple[int, ...]]:
    """Each prompt alone through a fresh Generator (`params`: one for all, or one per prompt)."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    return [Generator(model, None, config).generate([p], q)[0].token_ids for p, q in zip(prompts, per_prompt)]


@pytest.mark.core
def test_batch_equals_stock_generate_one_by_one(llama, llama_sdpa):
    """Budget >= every length: sparse decode is dense, so the batch must give stock greedy tokens."""
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    gen = Generator(llama, None, small_config(token_budget=1024))
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=20))
    for p, out in zip(prompts, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 20
        assert list(out.token_ids) == stock_greedy(llama_sdpa, p, 20), f"prompt of {len(p)} tokens"
    assert gen.metrics()["totals"]["mean_decode_batch"] > 2  # the rows really decoded together


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_every_full_attention_family_batches_as_stock_and_as_one_by_one(arch):
    """Beyond Llama: with a budget covering every length the batch gives stock greedy tokens; with
    a small budget and HBM cache (real selection, admission leaving rows out) the batch gives each
    request's tokens alone."""
    model, stock = tiny_model(arch), tiny_model(arch, "sdpa")
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    outs = Generator(model, None, small_config(token_budget=1024)).generate(prompts, SamplingParams(max_new_tokens=12))
    assert [list(o.token_ids) for o in outs] == [stock_greedy(stock, p, 12) for p in prompts]
    config = small_config(  # the paper's admission rule, so that rows sit out (reserve_decode would start fewer)
        max_batch=3, token_budget=64, hbm_cache_bytes=CACHE_BYTES, max_inject_tokens=60, reserve_decode=False
    )
    params = SamplingParams(max_new_tokens=16)
    gen = Generator(model, None, config)
    assert [o.token_ids for o in gen.generate(prompts, params)] == one_by_one(model, config, prompts, params)
    assert gen.metrics()["totals"]["sat_out"] > 0


@pytest.mark.core
@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(
            max_batch=3,
            token_budget=64,
            hbm_cache_bytes=CACHE_BYTES,
            prefill_mode="layer_segmented",
            max_inject_tokens=60,
        ),
        dict(max_batch=4, prefill_mode="chunked", max_inject_tokens=64, max_batch_tokens=40),
        dict(prefill_mode="full", admission=False, hbm_cache_bytes=2 * 24 * 2048),
        dict(  # the paper's admission rule: with its decode room reserved no request of this one sits out
            kv_dtype="float8_e4m3fn",
            max_batch=3,
            token_budget=64,
            hbm_cache_bytes=32 * 512,
            max_inject_tokens=60,
            reserve_decode=False,
        ),
        dict(HYBRID_UNION, max_batch=3, token_budget=64, hbm_cache_bytes=HYBRID_CACHE_BYTES, max_inject_tokens=60),
    ],
    ids=["default", "segmented-small-cache", "chunked", "full-no-admission", "fp8-kv", "hybrid-union"],
)
def test_small_budget_batch_equals_one_by_one(llama, overrides):
    """Budget 48 of up to 150 tokens: real selection. Rows join, sit out and leave; tokens must not move."""
    config = small_config(**overrides)
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    params = SamplingParams(max_new_tokens=24)
    gen = Generator(llama, None, config)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == one_by_one(llama, config, prompts, params)
    totals = gen.metrics()["totals"]
    assert totals["hbm_bytes_in_use"] == 0 and totals["dram_bytes_in_use"] == 0
    if config.hbm_cache_bytes is not None:
        assert (
            totals["hbm_peak_bytes"] > 0 and gen.store.hbm.num_slots * gen.store.block_bytes <= config.hbm_cache_bytes
        )
    if config.admission and config.hbm_cache_bytes is not None:
        assert totals["sat_out"] > 0  # admission really left requests out of some iterations
        assert totals["admitted_working_set_peak_bytes"] <= config.hbm_cache_bytes


@pytest.mark.core
def test_stream_gives_each_requests_tokens_in_order(llama):
    prompts = [prompt(n, seed=n) for n in (30, 7, 64)]
    gen = Generator(llama, None, small_config(max_batch=2))
    params = [SamplingParams(max_new_tokens=n) for n in (5, 9, 3)]
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = []
    for event in gen.stream(prompts, params):
        assert event.prompt_index not in finished, "an event after the request's last one"
        if event.token_id is not None:
            seen[event.prompt_index].append(event.token_id)
        if event.finished:
            finished.append(event.prompt_index)
            assert list(event.output.token_ids) == seen[event.prompt_index]
    assert sorted(finished) == [0, 1, 2] and [len(seen[i]) for i in range(3)] == [5, 9, 3]
    # max_batch 2: prompt 2 waits for prompt 0 to end, then its 3 tokens still beat prompt 1's 9
    assert finished == [0, 2, 1]
    assert [list(t) for t in one_by_one(llama, small_config(), prompts, params)] == [seen[i] for i in range(3)]


@pytest.mark.core
def test_cancel_mid_flight_frees_blocks_and_others_continue(llama):
    config = small_config(max_batch=2)
    prompts = [prompt(n, seed=n) for n in (100, 90, 120)]
    params = SamplingParams(max_new_tokens=12)
    gen = Generator(llama, None, config)
    ids = [gen.submit(p, params) for p in prompts]
    events = gen.step() + gen.step() + gen.step()
    assert {e.request_id for e in events} == {ids[0], ids[1]}  # max_batch 2: the third waits
    held = gen.dram_bytes_in_use()
    assert gen.cancel(ids[0]) and gen.cancel(ids[2])  # one decoding, one waiting
    assert not gen.cancel(ids[0]) and not gen.cancel(12345)
    assert gen.dram_bytes_in_use() < held
    outputs = {}
    while gen.has_unfinished or not outputs:
        for event in gen.step():
            if event.finished:
                outputs[event.request_id] = event.output
    assert outputs[ids[0]].finish_reason == "cancelled" and len(outputs[ids[0]].token_ids) == 3
    assert outputs[ids[2]].finish_reason == "cancelled" and outputs[ids[2]].token_ids == ()
    assert outputs[ids[1]].token_ids == one_by_one(llama, config, [prompts[1]], params)[0]
    assert gen.dram_bytes_in_use() == 0 and gen.hbm_bytes_in_use() == 0
    assert gen.store.dram.num_used == 0 and int(gen.store.dram.refcount.sum()) == 0


def test_stop_tokens_eos_and_context_limit(llama):
    p = prompt(20, seed=3)
    free = Generator(llama, None, small_config()).generate([p], SamplingParams(max_new_tokens=10))[0].token_ids
    stop_at = free[4]
    gen = Generator(llama, None, small_config())
    out = gen.generate([p], SamplingParams(max_new_tokens=10, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(stop_at) + 1]
    llama.generation_config.eos_token_id = stop_at
    try:
        eos = Generator(llama, None, small_config())
        assert eos.generate([p], SamplingParams(max_new_tokens=10))[0].token_ids[-1] == stop_at
        ignored = eos.generate([p], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
        assert ignored.token_ids == free and ignored.finish_reason == "length"
    finally:
        llama.generation_config.eos_token_id = None
    near_end = prompt(2045, seed=4)  # max_position_embeddings 2048: room for 3 tokens
    out = Generator(llama, None, small_config()).generate([near_end], SamplingParams(max_new_tokens=10))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_metrics_per_request_and_json_lines(llama):
    sink = io.StringIO()
    gen = Generator(llama, None, small_config(), metrics_file=sink)
    gen.generate([prompt(50, 1), prompt(20, 2)], SamplingParams(max_new_tokens=6))
    metrics = gen.metrics()
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert len(lines) == 2 and {line["request_id"] for line in lines} == set(metrics["requests"])
    for record in metrics["requests"].values():
        assert record["generated_tokens"] == 6 and len(record["tbt_s"]) == 5 and len(record["token_times_s"]) == 6
        assert 0 <= record["queueing_delay_s"] <= record["ttft_s"] <= record["finish_s"]
        assert record["working_set_blocks"] > 0 and record["working_set_bytes"] == record["working_set_blocks"] * 2048
    totals = metrics["totals"]
    assert totals["generated_tokens"] == 12 and totals["tokens_per_s"] > 0 and totals["finished"] == 2
    assert 0 < totals["hit_rate"] <= 1 and totals["hbm_peak_bytes"] > 0
    assert totals["hbm_bytes_in_use"] == 0 and totals["dram_bytes_in_use"] == 0


def test_seeded_sampling_does_not_depend_on_the_batch(llama):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    target = prompt(40, seed=5)
    alone = Generator(llama, None, small_config()).generate([target], params)[0].token_ids
    others = [prompt(n, seed=n) for n in (30, 70)]
    gen = Generator(llama, None, small_config())
    mixed = gen.generate([others[0], target, others[1]], [SamplingParams(max_new_tokens=5, seed=1), params, params])
    assert mixed[1].token_ids == alone
    greedy = Generator(llama, None, small_config()).generate([target], SamplingParams(max_new_tokens=12))[0]
    top1 = Generator(llama, None, small_config()).generate(
        [target], SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, seed=3)
    )[0]
    assert top1.token_ids == greedy.token_ids
    assert torch.tensor(alone).unique().numel() > 1


@pytest.mark.core
def test_iteration_breakdown_counts_every_iteration_and_all_prefill_work(llama):
    """Iterations split into decode-only / mixed / prefill-only; their prefill work is every prompt token-layer."""
    config = small_config(prefill_mode="layer_segmented", max_inject_tokens=60)
    gen = Generator(llama, None, config)
    first = gen.submit(prompt(80, seed=1), SamplingParams(max_new_tokens=30))
    gen.step()  # the first request starts alone: a prefill-only iteration
    gen.submit(prompt(130, seed=2), SamplingParams(max_new_tokens=4))  # its prefill overlaps the first's decode
    while gen.has_unfinished:
        gen.step()
    gen.step()  # nothing left to run: an idle iteration
    totals = gen.metrics()["totals"]
    kinds = totals["iterations_by_kind"]
    assert sum(k["count"] for k in kinds.values()) == totals["iterations"] and kinds["idle"]["count"] == 1
    assert kinds["prefill"]["count"] >= 1 and kinds["mixed"]["count"] >= 1 and kinds["decode"]["count"] >= 1
    assert totals["prefill_token_layers"] == (80 + 130) * llama.config.num_hidden_layers
    assert all(kinds[k]["total_s"] > 0 for k in ("decode", "mixed", "prefill")) and first in gen.metrics()["requests"]


GRAPH_CONFIG = dict(
    max_batch=3, token_budget=64, hbm_cache_bytes=CACHE_BYTES, dram_bytes=4000 * 2048, prefill_mode="layer_segmented",
    max_inject_tokens=60,
)  # fmt: skip


@pytest.mark.core
@pytest.mark.parametrize("pools", ["fixed", "growing"])
@pytest.mark.parametrize("stand_in_graphs", [False, True], ids=["static-step", "fake-graphs"])
@pytest.mark.parametrize(
    "selector",
    [
        {},
        {"channel_feedback": False},
        HYBRID_UNION | {"hbm_cache_bytes": HYBRID_CACHE_BYTES},
    ],
    ids=["default", "no-feedback", "hybrid-union"],
)
def test_cuda_graph_decode_gives_the_eager_tokens_and_working_sets(llama, stand_in_graphs, pools, selector):
    """cuda_graphs=True: rows join, sit out and leave (a restart each time), tokens and admission must not move.

    On CPU the decoder runs the captured step eagerly; with the stand-in it captures and replays,
    a replay running no Python (tests/fake_graphs.py), so the working sets come from captured outputs.
    """
    from fake_graphs import FakeGraphs

    prompts = [prompt(n, seed=n) for n in LENGTHS]
    params = SamplingParams(max_new_tokens=24)
    config = GRAPH_CONFIG | selector | ({"dram_bytes": None} if pools == "growing" else {})  # growing: during the run
    eager = Generator(llama, None, small_config(**config))
    graphed = Generator(llama, None, small_config(**config, cuda_graphs=True))
    decoder, starts = graphed._decoder, []
    if stand_in_graphs:
        decoder.capture, decoder.graphs = True, FakeGraphs(decoder)
    start = decoder.start
    decoder.start = lambda *args: starts.append(args) or start(*args)  # each change of the batch's rows
    outs = graphed.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompts, params)]
    mine, theirs = graphed.metrics(), eager.metrics()
    assert mine["totals"]["sat_out"] == theirs["totals"]["sat_out"] > 0  # admission saw the same working sets
    sizes = [r["working_set_blocks"] for r in mine["requests"].values()]
    assert sizes == [r["working_set_blocks"] for r in theirs["requests"].values()]
    if pools == "growing":
        assert graphed.store.epoch > 0  # the DRAM pool grew (and moved) during the run
    if stand_in_graphs and pools == "fixed":
        # one capture per (rows, table width) ever seen, however often the batch changed
        assert mine["totals"]["graph_captures"] == len(decoder._captured) and 2 <= len(decoder._captured) < len(starts)
    if stand_in_graphs:
        assert mine["totals"]["hits"] + mine["totals"]["misses"] > 0


@pytest.mark.core
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_decode_iteration_reads_the_device_back_once(llama, cuda_graphs, monkeypatch):
    """One read-back per iteration (the sampled tokens with the working-set sizes); the memory peak
    stays on the device. (The torch reference's block gather filters with masks, and the eager CPU
    decode drops unused union columns, `attention.used_columns`: the GPU path does neither.)"""
    from sync_guard import forbid_host_syncs

    monkeypatch.setattr(
        "sparseserve_hf.attention.used_columns", lambda slots, head_mask, scales: (slots, head_mask, scales)
    )

    steady = GRAPH_CONFIG | dict(
        max_batch=4, hbm_cache_bytes=2 * 400 * 2048, max_inject_tokens=600
    )  # all decode by step 8
    gen = Generator(llama, None, small_config(**steady, cuda_graphs=cuda_graphs))
    for n in (200, 150, 180):
        gen.submit(prompt(n, seed=n), SamplingParams(max_new_tokens=40))
    for _ in range(8):
        gen.step()
    with forbid_host_syncs() as seen:
        gen.step()
    assert [op for op in seen if "boolean mask" not in op] == ["Tensor.tolist"]
    assert gen.metrics()["totals"]["hbm_peak_bytes"] >= gen.store.block_bytes  # read back here, once


@pytest.mark.core
def test_graphs_past_max_graphs_are_dropped_least_recently_used_first(llama):
    """Three batch sizes, room for two graphs: the least recently replayed goes, tokens stay the eager ones."""
    from fake_graphs import FakeGraphs

    prompts = [prompt(n, seed=n) for n in LENGTHS]
    params = SamplingParams(max_new_tokens=24)
    config = GRAPH_CONFIG | dict(hbm_cache_bytes=72 * 2048)  # room for 3 decoding rows
    graphed = Generator(llama, None, small_config(**config, cuda_graphs=True))
    decoder = graphed._decoder
    decoder.capture, decoder.graphs, decoder.max_graphs = True, FakeGraphs(decoder), 2
    outs = graphed.generate(prompts, params)
    eager = Generator(llama, None, small_config(**config)).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert len(decoder._captured) == 2 and decoder.num_captures > 3  # 3 batch sizes: evictions forced recaptures


@pytest.mark.core
def test_a_request_that_ends_leaves_its_slot_and_the_others_keep_their_tensors_and_graph(llama):
    """Slots: the middle request ends first; the other rows stay where they are (same tensors, no
    copy into the graph's), the step keeps its graph, and a new request takes the vacant slot.
    Every request's tokens are its tokens alone."""
    from fake_graphs import FakeGraphs

    settings = GRAPH_CONFIG | dict(hbm_cache_bytes=None, max_inject_tokens=None)
    gen = Generator(llama, None, small_config(**settings, cuda_graphs=True))
    gen._decoder.capture, gen._decoder.graphs = True, FakeGraphs(gen._decoder)
    prompts = [prompt(n, seed=n) for n in (40, 50, 60, 20)]
    params = [SamplingParams(max_new_tokens=m) for m in (30, 6, 30, 4)]
    ids, outputs = [gen.submit(p, q) for p, q in zip(prompts[:3], params[:3])], {}

    def step() -> None:
        outputs.update({e.request_id: e.output.token_ids for e in gen.step() if e.output is not None})

    while None in gen.slots or len(gen.slots) < 3:
        step()
    assert gen.slots == ids
    tensors = [t for layer in gen.batch.layers for t in layer.graph_tensors().values()]
    captures, capture_s = gen._decoder.num_captures, gen._decoder.capture_s
    assert captures >= 1 and capture_s > 0 and gen.metrics()["totals"]["graph_capture_s"] == capture_s
    while ids[1] not in outputs:
        step()
    step()
    assert gen.slots == [ids[0], None, ids[2]] and gen.batch.vacant_slots == [1]
    now = [t for layer in gen.batch.layers for t in layer.graph_tensors().values()]
    assert all(a is b for a, b in zip(now, tensors))  # the rows that stayed did not move
    assert gen._decoder.num_captures == captures  # the same (rows, table width): replayed, not captured
    assert gen._decoder.capture_s == capture_s  # a replay adds no capture time
    ids.append(gen.submit(prompts[3], params[3]))
    while gen.slots[1] is None:
        step()
    assert gen.slots == [ids[0], ids[3], ids[2]]
    while gen.has_unfinished:
        step()
    assert gen.slots == [] and gen.batch.num_rows == 0
    assert [outputs[rid] for rid in ids] == one_by_one(llama, small_config(**settings), prompts, params)


def test_the_batch_cache_never_holds_more_rows_than_one_lookup_can_serve(llama):
    """Row counts are 1, 2, 3, 4, 6, ...: where the HBM cache serves 5 rows, a fifth request makes
    the batch 5 rows, not 6 (a lookup is sized by its rows, vacant or not)."""
    probe = Generator(llama, None, small_config(max_batch=8))
    config = small_config(max_batch=8, hbm_cache_bytes=5 * probe.sizes.one_row_hbm_cache_bytes)
    gen = Generator(llama, None, config)
    assert gen.sizes.max_decode_rows == 5
    for n in (30, 40, 50, 60, 70):
        gen.submit(prompt(n, seed=n), SamplingParams(max_new_tokens=6))
    rows, reasons = set(), []
    while gen.has_unfinished:
        reasons += [e.output.finish_reason for e in gen.step() if e.output is not None]
        rows.add(gen.batch.num_rows)
    assert reasons == ["length"] * 5 and max(rows) == 5


def test_static_decoder_refuses_a_bad_max_graphs(llama):
    from sparseserve_hf.graph import StaticDecoder

    gen = Generator(llama, None, small_config(**GRAPH_CONFIG, cuda_graphs=True))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_graphs must be a positive int"):
            StaticDecoder(llama, gen.batch, capture=False, max_graphs=bad)


def test_every_decode_runs_the_decoders_step_captured_only_where_a_capture_can_run(llama, monkeypatch):
    """One decode step for every setting: `cuda_graphs` only says whether the decoder's step is
    captured (None: where `graph_obstacle` finds nothing in the way, as on CUDA; never on a
    tensor-parallel rank)."""
    for setting in (None, True, False):
        gen = Generator(llama, None, small_config(**GRAPH_CONFIG, cuda_graphs=setting))
        assert gen._decoder.capture is False  # CPU: a capture cannot run
    monkeypatch.setattr("sparseserve_hf.graph.graph_obstacle", lambda model, cache, capture: None)
    assert gen._captures(llama) is False  # cuda_graphs=False
    gen.config = small_config(**GRAPH_CONFIG)
    assert gen._captures(llama) is True
    gen.tp_size = 2  # a rank of a tensor-parallel engine: its collectives are not captured
    assert gen._captures(llama) is False
