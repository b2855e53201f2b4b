"""StaticDecoder on CPU: its static step against the eager path, and its graph bookkeeping.

On CPU the decoder runs the very step a CUDA graph captures, eagerly (`capture=False`). These tests
check what capture relies on: the same tokens as the ordinary eager decode path, no host sync
inside the captured part on any step (block fills included), every tensor the graph holds staying
at its address, and, with a stand-in for the CUDA graph, when the decoder recaptures and what it
advances by hand after a replay. tests/test_decode_graph.py runs real graphs on CUDA.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
from dataclasses import replace
from unittest import mock

import pytest
import torch
from transformers.models.llama import modeling_llama

from fake_graphs import FakeGraphs
from sparseserve_hf import SparseServeCache, SparseServeConfig, fused_ops
from sparseserve_hf.cache import block_cache
from sparseserve_hf.cache.store import LOAD_SUMMARY_KEYS
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.graph import StaticDecoder, graph_obstacle, table_width
from sparseserve_hf.ops import reference
from sync_guard import forbid_host_syncs
from test_static_decode import BLOCK, LENGTHS, batch_cache, eager_step, static_config
from test_sync_free_decode import fixed_shape_gather
from tiny_models import HEAD_DIM, random_ids, tiny_model

STEPS = 40  # each row's tail fills twice or more (rows start 16, 6 and 16 tokens into their tail)


class EagerReference:
    """The ordinary eager decode path over its own copy of the rows (greedy, explicit positions)."""

    def __init__(self, model, config: SparseServeConfig) -> None:
        self.model = model
        self.cache, self.tokens = batch_cache(model, config)
        self.positions = torch.tensor(LENGTHS, device=self.tokens.device).view(-1, 1)

    def step(self) -> torch.Tensor:
        self.logits = eager_step(self.model, self.cache, self.tokens, self.positions)
        self.tokens, self.positions = self.logits.argmax(-1, keepdim=True), self.positions + 1
        return self.tokens


def started_decoder(model, config: SparseServeConfig, **kwargs) -> StaticDecoder:
    cache, tokens = batch_cache(model, config)
    decoder = StaticDecoder(model, cache, capture=False, **kwargs)
    decoder.start(tokens)
    return decoder


def addresses(cache: SparseServeCache) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in cache.graph_tensors().items()}


@pytest.mark.core
def test_static_step_equals_the_eager_path_with_no_host_sync_on_any_step(llama):
    """Plan tests (f) and (g): rows filling at different steps, table widths crossed, block evictions."""
    config = static_config()
    reference = EagerReference(llama, config)
    decoder = started_decoder(llama, config, table_step=4)  # table widths of 4 x 1, 2, 3, 4 blocks
    decoder.cache.store.hbm.gather_blocks = fixed_shape_gather  # the torch reference's copy masks by value
    static_step, seen_per_step = decoder._static_step, []

    def guarded():  # what a graph captures, with the mask transformers 5.17 builds while a stream captures
        with forbid_host_syncs() as seen, mock.patch("transformers.masking_utils.is_tracing", lambda *_: True):
            out = static_step()
        seen_per_step.append(sorted(set(seen)))
        return out

    decoder._static_step = guarded
    fills = widths = 0
    for step in range(STEPS):
        blocks, width = decoder.cache.layers[0].num_blocks.sum(), decoder.cache.layers[0].block_ids.shape[2]
        expected = reference.step()
        assert torch.equal(decoder.step(), expected), f"step {step}"
        assert torch.equal(decoder.logits, reference.logits), f"step {step}"
        assert seen_per_step[-1] == [], f"step {step}: {seen_per_step[-1]}"
        fills += int(decoder.cache.layers[0].num_blocks.sum() != blocks)
        widths += int(decoder.cache.layers[0].block_ids.shape[2] != width)
    assert fills >= 5 and widths >= 1
    loads = [cache.stats() for cache in (decoder.cache, reference.cache)]
    for key in LOAD_SUMMARY_KEYS:  # the static step counts what it reads as the eager path does
        assert loads[0][key] == pytest.approx(loads[1][key]), key
    assert loads[0]["decode_steps"] == STEPS
    stats = decoder.cache.stats()
    assert stats["misses"] > 0 and stats["hits"] > 0
    layer = decoder.cache.layers[0]
    assert layer.tail_len.tolist() == decoder._tail_len and layer.num_blocks.tolist() == decoder._num_blocks


@pytest.mark.core
def test_a_vacant_slot_rides_along_storing_loading_and_counting_nothing(llama):
    """A batch whose middle row was taken out (`take_rows`, as when a request ends) decodes its
    other rows as a batch of those rows alone: the vacant row takes no token, selects and loads no
    block, and counts in no statistic. Block fills and table widths are crossed on the way."""
    config = static_config()
    three, firsts = batch_cache(llama, config)
    three.take_rows([1]).reset()
    again, _ = batch_cache(llama, config)  # the same rows over a store of its own
    pair = SparseServeCache(llama.config, config, store=again.store)
    for slot, row in enumerate((again.take_rows([0]), again.take_rows([2]))):
        pair.place_rows(row, [slot])
    decoders = []
    for cache, tokens in ((three, firsts), (pair, firsts[[0, 2]])):
        decoders.append(StaticDecoder(llama, cache, capture=False, table_step=4))
        decoders[-1].start(tokens)
    for _ in range(STEPS):
        with_vacancy, alone = (decoder.step().clone() for decoder in decoders)
        assert torch.equal(with_vacancy[[0, 2]], alone)
    for layer in three.layers:
        assert int(layer.row_lengths()[1]) == 0 and not bool((layer.block_ids[1] >= 0).any())
    assert three.store.load_summary() == pair.store.load_summary()
    assert three.vacant_slots == [1]


def test_static_step_with_a_host_syncing_rope_equals_the_eager_path():
    """A rope that reads positions on the host keeps the step from a capture, not from the decoder:
    uncaptured, the static step of a dynamic-NTK Llama gives the eager path's tokens."""
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    config = static_config()
    reference, decoder = EagerReference(model, config), started_decoder(model, config)
    for step in range(12):
        assert torch.equal(decoder.step(), reference.step()), f"step {step}"


def test_every_captured_tensor_keeps_its_address_across_fills_stats_and_frees(llama):
    """Plan test (h): a graph holds these by address; nothing but a table-width change may move them."""
    config = static_config()
    decoder = started_decoder(llama, config)
    store = decoder.cache.store
    other = SparseServeCache(llama.config, config, store=store)  # a second request over the same pools
    with torch.no_grad():
        llama(random_ids(1, 70, seed=9), **{cache_kwarg(llama): other})
    decoder.step()  # the first step sets the table width
    before, epoch = addresses(decoder.cache), store.epoch
    for step in range(STEPS):
        decoder.step()
        decoder.cache.stats()  # folds the device counters in: must reset them in place
        if step == STEPS // 2:
            other.reset()  # frees its blocks from both tiers
        assert addresses(decoder.cache) == before, f"step {step}"
    assert store.epoch == epoch and decoder.cache.layers[0].num_blocks.tolist() == [12, 11, 11]


@pytest.mark.parametrize("beside", [True, False], ids=["lookup_beside", "lookup_first"])
def test_static_step_over_a_growing_hbm_cache_equals_the_eager_path(llama, beside, monkeypatch):
    """An unlimited HBM cache grows during the steps (a new pool and tables, a new epoch), in the
    lookup's host-side preparation: with the lookup beside attention or before it, the static step
    keeps the eager path's tokens."""
    monkeypatch.setattr(block_cache, "UNLIMITED_INITIAL_SLOTS", 120)  # the rows' blocks pass it mid-run
    config = static_config(hbm_cache_bytes=None, lookup_beside_attention=beside)
    reference = EagerReference(llama, static_config(hbm_cache_bytes=None))
    decoder = started_decoder(llama, config)
    assert decoder.cache.store.lookup_beside == beside
    epochs = set()
    for step in range(STEPS):
        assert torch.equal(decoder.step(), reference.step()), f"step {step}"
        epochs.add(decoder.cache.store.epoch)
    assert len(epochs) > 1  # the cache really grew during the steps


def test_graph_bookkeeping_recaptures_on_moves_and_hands_back_to_the_eager_path(llama):
    """Plan test (i), with a stand-in graph: recapture triggers, Python counters, then plain eager decode."""
    config = static_config()
    reference = EagerReference(llama, config)
    decoder = started_decoder(llama, config, table_step=10)  # width 10, then 20 once a row holds 10 blocks
    decoder.capture, decoder.graphs = True, FakeGraphs(decoder)
    captures = []
    for step in range(20):
        if step == 12:
            store = decoder.cache.store
            store.metadata = store.metadata.clone()  # as if the pool had been reallocated
        assert torch.equal(decoder.step(), reference.step()), f"step {step}"
        captures.append(decoder.num_captures)
        for mine, theirs in zip(decoder.layers, reference.cache.layers):  # what the working-set tracker reads
            ours, eager = mine.last_selection, theirs.last_selection
            assert torch.equal(ours.sort(-1).values, eager.sort(-1).values), f"step {step}: selections differ"
    # step 0: first capture; step 1: the table widens to 20 blocks; step 12: the metadata moved
    assert captures == [1] + [2] * 11 + [3] * 8
    layers = decoder.cache.layers
    assert [layer.num_positions for layer in layers] == [layer.num_positions for layer in reference.cache.layers]
    assert layers[0].tail_len.tolist() == decoder._tail_len and all(layer._known_counts is None for layer in layers)
    tokens, positions = decoder._ids.clone(), reference.positions.clone()
    for step in range(BLOCK + 2):  # the ordinary eager path takes over: every row fills once more
        logits = eager_step(llama, decoder.cache, tokens, positions + step)
        tokens = logits.argmax(-1, keepdim=True)
        assert torch.equal(tokens, reference.step()), f"eager step {step}"


def test_decoder_refuses_what_a_captured_step_cannot_follow():
    model = tiny_model("llama")
    fixed = static_config()
    with pytest.raises(NotImplementedError, match="dense_layers"):
        StaticDecoder(model, SparseServeCache(model.config, replace(fixed, dense_layers=(1,))), capture=False)
    copying = SparseServeCache(model.config, replace(fixed, transfer="copy"))
    with pytest.raises(ValueError, match="transfer='kernel'"):
        StaticDecoder(model, copying, capture=True)
    assert graph_obstacle(model, copying, capture=False) is None  # eager static steps may copy per block
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(model, SparseServeCache(model.config, fixed), capture=True)
    with pytest.raises(ValueError, match="attn_implementation"):
        sdpa = tiny_model("llama", "sdpa")
        StaticDecoder(sdpa, SparseServeCache(sdpa.config, fixed), capture=False)
    gemma = tiny_model("gemma3")
    with pytest.raises(NotImplementedError, match="sliding"):
        StaticDecoder(gemma, SparseServeCache(gemma.config, fixed), capture=False)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(NotImplementedError, match="dynamic"):
        StaticDecoder(model, SparseServeCache(model.config, fixed), capture=True)
    assert graph_obstacle(model, SparseServeCache(model.config, fixed), capture=False) is None  # eager: it may sync
    fresh = tiny_model("llama")
    decoder = StaticDecoder(fresh, SparseServeCache(fresh.config, fixed), capture=False)
    with pytest.raises(RuntimeError, match="start"):
        decoder.step()
    with pytest.raises(ValueError, match="prefilled"):
        decoder.start(torch.ones(1, 1, dtype=torch.long))


def test_cuda_graphs_config_field_is_validated():
    assert SparseServeConfig().cuda_graphs is None  # on wherever a capture can run
    config = static_config(cuda_graphs=True)
    assert SparseServeConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        SparseServeConfig(cuda_graphs=1)
    with pytest.raises(ValueError, match="transfer='kernel'.*dense_layers"):
        SparseServeConfig(cuda_graphs=True, transfer="copy", dense_layers=(0,))
    SparseServeConfig(cuda_graphs=True)  # growing pools: captured again when they move
    SparseServeConfig(cuda_graphs=True, offload=False, dram_bytes=1 << 20)


def test_decoder_refuses_positions_past_the_model_limit(llama):
    decoder = started_decoder(llama, static_config())
    decoder._last_position = llama.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        decoder.step()


@pytest.mark.core
def test_table_widths_follow_the_geometric_buckets(llama):
    """Each step's table is `table_width` wide: 12 blocks, not 11, for rows needing 11 (step 1)."""
    decoder = started_decoder(llama, static_config(), table_step=1)
    widths = []
    for _ in range(BLOCK + 2):  # every row fills a block
        decoder.step()
        needed = max(decoder._num_blocks) + 1
        widths.append((needed, decoder.layers[0].block_ids.shape[2]))
    assert all(width == table_width(needed, 1) for needed, width in widths)
    assert any(width != needed for needed, width in widths)  # a linear width would fail the line above


def test_captured_steps_count_their_loads_once_and_never_move_the_counters(llama):
    """A capture runs the step once (its warm-up) and a replay once more: the load counters add
    each step once, as the eager path's do, and stay where the first capture found them."""
    config = static_config()
    reference = EagerReference(llama, config)
    decoder = started_decoder(llama, config, table_step=64)  # one table width for all these steps
    decoder.capture, decoder.graphs = True, FakeGraphs(decoder)
    counters = decoder.cache.store.load_totals.data_ptr()
    for step in range(12):
        assert torch.equal(decoder.step(), reference.step()), f"step {step}"
    assert decoder.num_captures == 1
    assert decoder.cache.store.load_totals.data_ptr() == counters
    loads = [cache.stats() for cache in (decoder.cache, reference.cache)]
    for key in LOAD_SUMMARY_KEYS:
        assert loads[0][key] == pytest.approx(loads[1][key]), key


@pytest.mark.core  # the decoder layer, attention and MLP it swaps are each version's own code
def test_fused_ops_run_inside_the_step_only(llama):
    """The op set's `rope`, `silu_mul` (and with `fused_norms` its `rms_norm` and `add_rms_norm`) run
    for every rotary embedding, MLP activation (and RMSNorm, the residual add before it joined to
    it) of the static step; here all are the references, Llama's own ops bit for bit, so the tokens
    stay the eager path's. Outside the step the model runs its own ops."""
    calls = {"rope": 0, "rms_norm": 0, "silu_mul": 0, "add_rms_norm": 0}

    def counted(name, op):
        def run(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)

        return run

    own_rope, decoders = modeling_llama.apply_rotary_pos_emb, []
    for fused_norms in (True, False):
        config = replace(static_config(), fused_norms=fused_norms)
        cache, tokens = batch_cache(llama, config)
        ops = cache.store.ops
        cache.store.ops = replace(
            ops,
            rope=counted("rope", reference.rope),
            rms_norm=counted("rms_norm", ops.rms_norm),
            silu_mul=counted("silu_mul", reference.silu_mul),
            add_rms_norm=counted("add_rms_norm", ops.add_rms_norm),
        )
        decoders.append(StaticDecoder(llama, cache, capture=False))
        decoders[-1].start(tokens)  # first tries each fused op against the model's own
    checks = len(fused_ops.NORM_CHECK_ROWS)
    assert calls == {"rope": 2, "rms_norm": checks, "silu_mul": 2, "add_rms_norm": checks}
    assert len(decoders[0]._fused.decoders) == llama.config.num_hidden_layers
    calls.update(rope=0, rms_norm=0, silu_mul=0, add_rms_norm=0)
    eager = EagerReference(llama, static_config())
    layers = llama.config.num_hidden_layers
    # per step: the first layer's input norm and the final norm alone; every other norm with its add
    per_step = {"rope": layers, "rms_norm": 2, "silu_mul": layers, "add_rms_norm": 2 * layers - 1}
    for step in range(6):
        want = eager.step()  # the model's own ops: counts nothing
        assert torch.equal(decoders[0].step(), want), f"step {step}"
        assert calls == {name: count * (step + 1) for name, count in per_step.items()}
        assert all("forward" not in module.__dict__ for module in llama.modules())
        assert modeling_llama.apply_rotary_pos_emb is own_rope  # the module's own function again
        assert decoders[0]._fused._handed is None
    decoders[1].step()  # fused_norms off: the rotary embedding and the activation only
    assert calls == {
        "rope": layers * 7,
        "rms_norm": 2 * 6,
        "silu_mul": layers * 7,
        "add_rms_norm": (2 * layers - 1) * 6,
    }


def test_a_layers_handed_norm_is_taken_only_by_that_norm_of_that_tensor(llama, monkeypatch):
    fused = fused_ops.FusedModelOps(
        llama, reference.rms_norm, None, True, HEAD_DIM, None, False, reference.add_rms_norm
    )
    first, second = (layer.input_layernorm for layer in llama.model.layers[:2])
    hidden, sentinel = torch.randn(2, 1, llama.config.hidden_size), torch.zeros(2, 1, llama.config.hidden_size)
    fused._handed = (hidden, first, sentinel)
    assert torch.equal(fused._norm(second, hidden), reference.rms_norm(hidden, second.weight, second.variance_epsilon))
    assert fused._handed is None  # any norm's call ends a hand-over
    fused._handed = (hidden, first, sentinel)
    assert torch.equal(
        fused._norm(first, hidden.clone()), reference.rms_norm(hidden, first.weight, first.variance_epsilon)
    )
    fused._handed = (hidden, first, sentinel)
    assert fused._norm(first, hidden) is sentinel
    monkeypatch.setattr(fused_ops, "ADD_INTO_NORMS", False)
    assert (
        fused_ops.FusedModelOps(
            llama, reference.rms_norm, None, True, HEAD_DIM, None, False, reference.add_rms_norm
        ).decoders
        == []
    )


def test_a_forward_set_after_the_decoder_started_stays_in_place(llama, monkeypatch):
    """A hook or a test's fault set on a layer (or a norm, an MLP) after the fused ops were chosen
    runs in the step, and is still there after it; the other layers keep the fused ops."""
    cache, tokens = batch_cache(llama, static_config())
    decoder = StaticDecoder(llama, cache, capture=False)
    decoder.start(tokens)
    layer, calls = llama.model.layers[1], []
    own = functools.partial(type(layer).forward, layer)
    monkeypatch.setattr(layer, "forward", lambda *a, **k: calls.append(1) or own(*a, **k))
    hooked = layer.forward
    eager = EagerReference(llama, static_config())
    for step in range(3):
        before = len(calls)
        assert torch.equal(decoder.step(), eager.step()), f"step {step}"
        assert layer.forward is hooked and len(calls) > before
    assert "forward" not in llama.model.layers[0].__dict__
    norm, norm_calls = llama.model.layers[0].post_attention_layernorm, []
    own_norm = functools.partial(type(norm).forward, norm)
    monkeypatch.setattr(norm, "forward", lambda *a: norm_calls.append(1) or own_norm(*a))
    assert torch.equal(decoder.step(), eager.step()) and norm_calls  # its layer calls it: not joined to an add


def test_fused_activation_off_runs_the_models_own_mlp(llama):
    cache, tokens = batch_cache(llama, replace(static_config(), fused_activation=False))
    cache.store.ops = replace(cache.store.ops, silu_mul=reference.silu_mul)
    decoder = StaticDecoder(llama, cache, capture=False)
    decoder.start(tokens)
    assert decoder._fused is None or not decoder._fused.mlps


def test_only_llamas_rms_norm_mlp_and_rotary_embedding_are_fused_and_never_over_a_hook():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    model = torch.nn.ModuleList([Qwen3RMSNorm(8), Gemma3RMSNorm(8), torch.nn.LayerNorm(8)])
    assert fused_ops.fusable_norms(model) == [model[0]]
    hooked = Qwen3RMSNorm(8)
    hooked.forward = functools.partial(Qwen3RMSNorm.forward, hooked)  # as a hook wraps it, on the instance
    assert fused_ops.fusable_norms(torch.nn.ModuleList([hooked])) == []
    mlp_config = tiny_model("llama").config
    silu, gelu = modeling_llama.LlamaMLP(mlp_config), modeling_llama.LlamaMLP(replace_act(mlp_config, "gelu"))
    assert fused_ops.fusable_mlps(torch.nn.ModuleList([silu, gelu])) == [silu]
    silu.forward = functools.partial(modeling_llama.LlamaMLP.forward, silu)
    assert fused_ops.fusable_mlps(torch.nn.ModuleList([silu])) == []
    assert (
        fused_ops.FusedModelOps(tiny_model("qwen3"), reference.rms_norm, reference.rope, False, HEAD_DIM).rope
        is not None
    )
    llama, qwen3 = tiny_model("llama"), tiny_model("qwen3")  # Qwen3's attention norms q and k: its own
    attentions = fused_ops.fusable_attentions(llama)
    assert attentions == [layer.self_attn for layer in llama.model.layers]
    assert fused_ops.fusable_attentions(qwen3) == []
    attentions[0].k_proj.forward = functools.partial(torch.nn.Linear.forward, attentions[0].k_proj)
    assert fused_ops.fusable_attentions(llama) == attentions[1:]
    beside = fused_ops.FusedModelOps(llama, reference.rms_norm, None, False, HEAD_DIM, reference.silu_mul, True)
    assert beside.attentions == [] and beside.mlp_side is None  # no second stream off CUDA

    home = types.ModuleType("partial_rotary_modeling")  # a family whose rotary embedding is its own
    home.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)
    attention = type("PartialAttention", (torch.nn.Module,), {"__module__": home.__name__})
    with mock.patch.dict(sys.modules, {home.__name__: home}):
        model = torch.nn.ModuleList([attention(), tiny_model("llama")])
        assert fused_ops.FusedModelOps(model, reference.rms_norm, reference.rope, False, HEAD_DIM).rope is None


def replace_act(config, act: str):
    """A copy of a model config with another MLP activation."""
    config = copy.deepcopy(config)
    config.hidden_act = act
    return config


def test_a_fused_op_that_differs_or_fails_is_left_out_with_a_warning(llama, caplog):
    def off_by_a_bit(q, k, cos, sin):
        q_out, k_out = reference.rope(q, k, cos, sin)
        return q_out.nextafter(q_out + 1), k_out

    def broken(hidden, weight, eps):
        raise RuntimeError("no kernel for this device")

    cache, tokens = batch_cache(llama, replace(static_config(), fused_norms=True))
    cache.store.ops = replace(cache.store.ops, rope=off_by_a_bit, rms_norm=broken)
    decoder = StaticDecoder(llama, cache, capture=False)
    with caplog.at_level("WARNING", logger="sparseserve_hf.fused_ops"):
        decoder.start(tokens)
    assert decoder._fused is None
    assert "fused rope is not used (its result differs" in caplog.text
    assert "fused rms_norm is not used (RuntimeError: no kernel for this device)" in caplog.text
    assert torch.equal(decoder.step(), EagerReference(llama, static_config()).step())


@pytest.mark.core
def test_a_failed_static_step_is_undone_and_leaves_a_vacant_row_empty(llama, monkeypatch):
    """A static step whose block fetch fails at a later layer is taken back in every layer: the rows
    hold what a batch that never failed holds after its step, and the vacant row, which took no
    token, stays empty (its length is never cut below nothing)."""
    config = static_config()
    caches = [batch_cache(llama, config) for _ in range(2)]
    decoders = []
    for cache, tokens in caches:
        cache.take_rows([1]).reset()
        decoders.append(StaticDecoder(llama, cache, capture=False, table_step=4))
        decoders[-1].start(tokens)
    failing, clean = decoders
    for decoder in decoders:
        decoder.step()
    store = failing.cache.store
    calls = iter(range(1_000))
    real_fetch = store.fetch

    def fetch_failing_at_the_second_layer(*args, **kwargs):
        if next(calls) == 1:
            raise RuntimeError("injected fetch failure")
        return real_fetch(*args, **kwargs)

    monkeypatch.setattr(store, "fetch", fetch_failing_at_the_second_layer)
    with pytest.raises(RuntimeError, match="injected"):
        failing.step()
    monkeypatch.undo()
    for layer in failing.cache.layers:
        assert int(layer.tail_len.min()) >= 0 and int(layer.row_lengths()[1]) == 0
    for mine, theirs in zip(failing.cache.layers, clean.cache.layers):
        assert mine.row_lengths().tolist() == theirs.row_lengths().tolist()
