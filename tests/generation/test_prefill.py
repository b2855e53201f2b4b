"""Prefill in pieces (generation/prefill.py: layer-segmented, chunked) equals `model(ids)`.

Every mode, segment size and chunking, with DynamicCache, StaticCache and SparseServeCache (budget
>= length, so sparse == dense), on tiny fp32 models: the last-position logits match the one-call forward
and the cache then decodes the same greedy tokens as stock `generate`. Layer-segmented prefill
with a SparseServeCache holds one layer's KV on the device at a time (checked after every layer,
and by measuring the peak of live tensor bytes as the model gets deeper).
"""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.generation import prefill as prefill_module
from sparseserve_hf.generation.prefill import BudgetedPrefill, DecoderStack, PrefillJob
from tiny_models import greedy, left_pad, random_ids, tiny_config, tiny_model

LAYERS = 3  # Gemma-3: sliding, full, sliding
T = 77  # not a block multiple; longer than Gemma's window (24)
ATOL = 1e-4

# (mode, max_inject_tokens, token-layer budget per advance)
PLANS = {
    "full": ("full", None, None),
    "chunked16": ("chunked", 16 * LAYERS, 16 * LAYERS),  # 5 chunks of 15-16 tokens
    "chunked40": ("chunked", 40 * LAYERS, None),  # 2 chunks, all in one call
    "seg1": ("layer_segmented", None, T),
    "seg2": ("layer_segmented", None, 2 * T),
    "seg_all": ("layer_segmented", None, None),
    "split30": ("layer_segmented", 30, 30),  # 3 chunks per layer, one per advance
    "split30x2": ("layer_segmented", 30, 64),  # 2 chunks per advance
    "split20_all": ("layer_segmented", 20, None),
}


@functools.cache
def model(arch: str, attn: str = "sparseserve") -> torch.nn.Module:
    return tiny_model(arch, attn, num_layers=LAYERS)


@functools.cache
def reference_logits(arch: str) -> torch.Tensor:
    with torch.no_grad():
        return model(arch)(random_ids(1, T)).logits[:, -1]  # (1, V)


@functools.cache
def reference_tokens(arch: str, new_tokens: int = 8) -> torch.Tensor:
    return greedy(model(arch, "sdpa"), random_ids(1, T), max_new_tokens=new_tokens)


def make_cache(kind: str, m: torch.nn.Module, **overrides):
    if kind == "dynamic":
        return DynamicCache(config=m.config)
    if kind == "lazy":  # no config: layers appear as they are first written, all of them full-size
        return DynamicCache()
    if kind == "static":
        return StaticCache(config=m.config, max_cache_len=128)
    return SparseServeCache(m.config, SparseServeConfig(block_size=16, token_budget=1024, **overrides))


def prefill(m, ids, cache, plan: str) -> tuple[BudgetedPrefill, PrefillJob, list[int]]:
    """Run a whole prefill the way a Generator would: one advance per iteration."""
    mode, max_inject, budget = PLANS[plan]
    runner = BudgetedPrefill(DecoderStack(m), mode, max_inject)
    job = runner.start(ids, cache)
    work = []
    while not job.done:
        work.append(runner.advance(job, budget))
    return runner, job, work


def continue_greedy(m, cache, first_logits: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decode from a prefilled cache: (1, steps) tokens, the first from the prefill's logits."""
    tokens = [first_logits.argmax(-1, keepdim=True)]
    with torch.no_grad():
        for _ in range(steps - 1):
            logits = m(tokens[-1], **{cache_kwarg(m): cache}).logits
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


# ---- exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "sparse"])
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3", "mistral"])
def test_prefill_logits_equal_model_forward(arch, plan, cache_kind):
    m = model(arch)
    cache = make_cache(cache_kind, m)
    runner, job, work = prefill(m, random_ids(1, T), cache, plan)
    torch.testing.assert_close(runner.logits(job), reference_logits(arch), atol=ATOL, rtol=ATOL)
    assert sum(work) == job.total_token_layers == T * LAYERS and job.remaining_token_layers == 0
    assert [cache.get_seq_length(i) for i in range(LAYERS)] == [T] * LAYERS
    assert job.hidden is None  # the (T, H) activations are gone once done


@pytest.mark.core
@pytest.mark.parametrize("cache_kind", ["dynamic", "lazy", "sparse"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_split_layers_equal_model_forward_core(arch, cache_kind):
    """The fast subset also run on transformers 5.17: layers split into chunks, two per advance."""
    m = model(arch)
    runner, job, _ = prefill(m, random_ids(1, T), make_cache(cache_kind, m), "split30x2")
    torch.testing.assert_close(runner.logits(job), reference_logits(arch), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("cache_kind", ["dynamic", "sparse"])
@pytest.mark.parametrize("plan", ["full", "chunked16", "seg1", "split30x2"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_decode_after_prefill_equals_stock_generate(arch, plan, cache_kind):
    """The cache a prefill leaves behind decodes exactly like stock generate's own prefill."""
    m = model(arch)
    cache = make_cache(cache_kind, m)
    runner, job, _ = prefill(m, random_ids(1, T), cache, plan)
    tokens = continue_greedy(m, cache, runner.logits(job), steps=8)
    assert torch.equal(tokens, reference_tokens(arch))


@pytest.mark.core
def test_sparse_cache_then_stock_generate_core():
    """Prefill with the cache, then hand it to stock generate for the rest (5.17 too)."""
    m = model("llama")
    cache = make_cache("sparse", m)
    ids = random_ids(1, T)
    runner, job, _ = prefill(m, ids, cache, "split30")
    first = runner.logits(job).argmax(-1, keepdim=True)
    rest = m.generate(
        torch.cat((ids, first), dim=1), past_key_values=cache, max_new_tokens=7, do_sample=False, pad_token_id=0
    )
    assert torch.equal(torch.cat((first, rest[:, T + 1 :]), dim=1), reference_tokens("llama"))


def mistral_with_window() -> torch.nn.Module:
    config = tiny_config("mistral", num_layers=LAYERS)
    config.sliding_window = 24  # one window for every layer, no layer_types (unlike Gemma / Qwen)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sparseserve").eval()


@pytest.mark.parametrize("plan", ["chunked16", "split30"])
def test_mistral_sliding_window_chunks_with_dynamic_cache(plan):
    m = mistral_with_window()
    ids = random_ids(1, T)
    assert DecoderStack(m).layer_types == ["sliding_attention"] * LAYERS
    with torch.no_grad():
        expected = m(ids).logits[:, -1]
    runner, job, _ = prefill(m, ids, DynamicCache(config=m.config), plan)
    torch.testing.assert_close(runner.logits(job), expected, atol=ATOL, rtol=ATOL)


def test_mistral_sliding_window_chunks_with_sparse_cache():
    """A global sliding_window without layer_types makes every layer sliding, as in transformers."""
    m = mistral_with_window()
    ids = random_ids(1, T)
    with torch.no_grad():
        expected = m(ids).logits[:, -1]
    cache = make_cache("sparse", m)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer"] * LAYERS
    runner, job, _ = prefill(m, ids, cache, "split30")
    torch.testing.assert_close(runner.logits(job), expected, atol=ATOL, rtol=ATOL)


def test_mistral_sliding_window_generate_with_sparse_cache_equals_stock():
    m = mistral_with_window()
    ids = random_ids(1, T)
    assert torch.equal(greedy(m, ids, make_cache("sparse", m), max_new_tokens=8), greedy(m, ids, max_new_tokens=8))


def test_prompt_after_a_past_continues_its_positions():
    """A job over a cache that already holds a turn places the prompt after it (multi-turn)."""
    m = model("llama")
    ids = random_ids(1, T)
    cache = make_cache("dynamic", m)
    with torch.no_grad():
        m(ids[:, :40], **{cache_kwarg(m): cache})
    runner = BudgetedPrefill(DecoderStack(m), "layer_segmented", 16)
    job = runner.start(ids[:, 40:], cache)
    assert job.past_length == 40
    runner.advance(job, None)
    torch.testing.assert_close(runner.logits(job), reference_logits("llama"), atol=ATOL, rtol=ATOL)


@pytest.mark.core
def test_run_layers_with_padding_equals_model_forward():
    """run_layers builds the padding mask too (what a batched Generator step needs)."""
    m = model("gemma3")
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (50, 31)])
    stack = DecoderStack(m)
    with torch.no_grad():
        expected = m(ids, attention_mask=mask).logits
        hidden = stack.run_layers(
            stack.embed(ids), 0, LAYERS, cache=DynamicCache(config=m.config), attention_mask_2d=mask
        )
        got = stack.logits(hidden)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=ATOL)


def test_run_layers_takes_cache_position_and_applies_gemma_softcapping():
    config = tiny_config("gemma3", num_layers=LAYERS)
    config.final_logit_softcapping = 0.5  # small enough that tanh visibly bends random logits
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config, attn_implementation="sparseserve").eval()
    ids = random_ids(1, T)
    stack = DecoderStack(m)
    with torch.no_grad():
        expected = m(ids).logits
        hidden = stack.run_layers(stack.embed(ids), 0, LAYERS, cache=None, cache_position=torch.arange(T))
        got = stack.logits(hidden)
    assert got.abs().max() <= 0.5
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


# ---- budgets -----------------------------------------------------------------------------


@pytest.mark.core
@pytest.mark.parametrize(
    "plan, expected_work",
    [
        ("full", [T * LAYERS]),
        ("chunked16", [15 * LAYERS, 15 * LAYERS, 16 * LAYERS, 15 * LAYERS, 16 * LAYERS]),
        ("seg1", [T] * LAYERS),  # segment size 1
        ("seg2", [2 * T, T]),  # segment size 2 (3 layers: 2 + 1)
        ("seg_all", [T * LAYERS]),
        ("split30", [25, 26, 26] * LAYERS),  # 77 tokens in 3 balanced chunks of <= 30, per layer
        ("split30x2", [51, 26 + 25, 26 + 26, 25 + 26, 26]),
    ],
)
def test_work_per_advance_follows_the_budget(plan, expected_work):
    m = model("llama")
    _, _, work = prefill(m, random_ids(1, T), make_cache("dynamic", m), plan)
    assert work == expected_work


def test_a_budget_below_one_unit_still_makes_progress():
    m = model("llama")
    runner = BudgetedPrefill(DecoderStack(m), "layer_segmented", None)
    job = runner.start(random_ids(1, T), make_cache("dynamic", m))
    assert runner.advance(job, 1) == T and job.next_layer == 1  # one whole layer over the prompt
    assert runner.advance(job, None) == 2 * T and job.done
    assert runner.advance(job, 5) == 0 and job.remaining_token_layers == 0


def test_a_paced_advance_splits_a_layer_too_long_for_its_budget_and_keeps_the_split(monkeypatch):
    """`split_to_budget`: a layer of 77 tokens against 30 token-layers runs as 3 chunks (25, 26, 26),
    one per call; a layer never splits below PACED_MIN_CHUNK_TOKENS; the logits are the forward's."""
    monkeypatch.setattr(prefill_module, "PACED_MIN_CHUNK_TOKENS", 20)
    m = model("llama")
    runner = BudgetedPrefill(DecoderStack(m), "layer_segmented", None)
    job = runner.start(random_ids(1, T), make_cache("sparse", m))
    assert runner.advance(job, 30, split_to_budget=True) == 25 and job.chunks == [(0, 25), (25, 51), (51, 77)]
    assert runner.advance(job, 30, split_to_budget=True) == 26  # the layer keeps its split
    # a large budget: the layer's last chunk, then layers 1 and 2 whole (a layer that fits is not split)
    assert runner.advance(job, 1000, split_to_budget=True) == 26 + 2 * T and job.done and job.chunks == [(0, T)]
    torch.testing.assert_close(runner.logits(job), reference_logits("llama"), atol=ATOL, rtol=ATOL)
    job = runner.start(random_ids(1, T), make_cache("dynamic", m))
    assert runner.advance(job, 10, split_to_budget=False) == T  # unpaced: a whole layer, as before
    assert runner.advance(job, 10, split_to_budget=True, at_least_one_unit=False) == 0  # no unit fits 10 ...
    assert job.chunks == [(0, T)] and job.next_layer == 1 and job.next_chunk_start == 0  # ... and none was planned
    assert runner.advance(job, 10, split_to_budget=True) == 19  # forced: the smallest chunk, 20 tokens at most
    assert job.chunks == [(0, 19), (19, 38), (38, 57), (57, 77)] and job.next_layer == 1


def test_from_config_reads_mode_and_cap():
    stack = DecoderStack(model("llama"))
    runner = BudgetedPrefill.from_config(stack, SparseServeConfig(prefill_mode="chunked", max_inject_tokens=96))
    job = runner.start(random_ids(1, T), make_cache("dynamic", model("llama")))
    assert (runner.mode, runner.max_inject_tokens) == ("chunked", 96)
    assert job.chunks == [(0, 25), (25, 51), (51, 77)]  # chunks of <= 96 // 3 layers = 32 tokens
    assert runner.advance(job, 1) == 25 * LAYERS  # the first chunk through every layer


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.core
@pytest.mark.parametrize(
    "mode, max_inject, message",
    [
        ("layerwise", None, "prefill mode"),
        ("layer_segmented", 0, "max_inject_tokens"),
        ("chunked", -8, "max_inject_tokens"),
        ("layer_segmented", 2.5, "max_inject_tokens"),
        ("chunked", LAYERS - 1, "at least num_layers"),
    ],
)
def test_bad_settings_raise(mode, max_inject, message):
    with pytest.raises(ValueError, match=message):
        BudgetedPrefill(DecoderStack(model("llama")), mode, max_inject)


@pytest.mark.core
def test_bad_prompts_and_calls_raise():
    m = model("llama")
    runner = BudgetedPrefill(DecoderStack(m), "layer_segmented", 32)
    with pytest.raises(ValueError, match="empty prompt"):
        runner.start(torch.zeros((1, 0), dtype=torch.long), make_cache("sparse", m))
    with pytest.raises(ValueError, match="one prompt"):
        runner.start(random_ids(2, 10), make_cache("dynamic", m))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        runner.start(torch.ones((1, 2049), dtype=torch.long), make_cache("dynamic", m))
    job = runner.start(random_ids(1, 10), make_cache("dynamic", m))
    with pytest.raises(ValueError, match="token_layer_budget"):
        runner.advance(job, 0)
    with pytest.raises(ValueError, match="not finished"):
        runner.logits(job)
    with pytest.raises(ValueError, match="layer range"):
        runner.stack.run_layers(runner.stack.embed(job.input_ids), 2, 1, cache=None)
    runner.advance(job, None)  # the job survived the bad calls
    assert job.done


# ---- device memory: one layer's KV at a time -------------------------------------------------


def kv_bytes_per_layer(tokens: int) -> int:
    return tokens * 2 * 16 * 2 * 4  # tokens x 2 KV heads x head_dim 16 x (K, V) x fp32


TAIL_BYTES = 2 * 2 * 16 * 16 * 4  # one layer's tail: (1 row, 2 KV heads, K/V, 16 tokens, 16 dims) fp32
BLOCK_BYTES = 2 * 16 * 16 * 4  # one head-block: K/V x 16 tokens x 16 dims, fp32
WINDOW_KEPT = 23  # Gemma's sliding layers keep window - 1 tokens


@pytest.mark.core
@pytest.mark.parametrize("max_inject", [None, 30])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_each_layer_leaves_the_device_before_the_next(arch, max_inject):
    """Observed after every decoder-layer call (a forward hook): the KV of the layers run so far is in
    DRAM, the device holds only block metadata, one tail block per layer and (Gemma) the sliding
    window, later layers are untouched, and a chunk reads back only its own layer's past."""
    m = model(arch)
    cache = make_cache("sparse", m)
    runner = BudgetedPrefill(DecoderStack(m), "layer_segmented", max_inject)
    types = runner.stack.layer_types
    calls = []

    def check(layer_idx: int, module, args, output) -> None:
        stats = cache.stats()
        stored = [cache.get_seq_length(i) for i in range(LAYERS)]
        full = [i for i in range(layer_idx + 1) if types[i] == "full_attention"]
        sliding = [i for i in range(layer_idx + 1) if types[i] != "full_attention"]
        assert stats["dram_bytes"] == sum((stored[i] - 1) // 16 for i in full) * 2 * BLOCK_BYTES
        assert stats["hbm_block_cache_bytes"] == 0
        assert stats["hbm_tail_bytes"] == len(full) * TAIL_BYTES
        assert stats["hbm_dense_layer_bytes"] == sum(kv_bytes_per_layer(min(stored[i], WINDOW_KEPT)) for i in sliding)
        assert all(n == 0 for n in stored[layer_idx + 1 :])  # later layers untouched
        past = stored[layer_idx] - args[0].shape[1]  # tokens of this layer before this chunk
        read_before = calls[-1][1] if calls else 0
        if types[layer_idx] == "full_attention":  # its past came back from DRAM: this layer's blocks only
            assert stats["dense_read_bytes"] - read_before == max(past - 1, 0) // 16 * 2 * BLOCK_BYTES
        calls.append((layer_idx, stats["dense_read_bytes"]))

    job = runner.start(random_ids(1, T), cache)
    hooks = [layer.register_forward_hook(functools.partial(check, i)) for i, layer in enumerate(runner.stack.layers)]
    try:
        while not job.done:
            runner.advance(job, 1)  # one unit per call
    finally:
        for hook in hooks:
            hook.remove()
    assert [i for i, _ in calls] == [i for i in range(LAYERS) for _ in job.chunks]  # layer by layer
    assert cache.stats()["dense_read_bytes"] > 0 if max_inject else cache.stats()["dense_read_bytes"] == 0
    torch.testing.assert_close(runner.logits(job), reference_logits(arch), atol=ATOL, rtol=ATOL)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while active; storages in `ignore` (weights) are skipped.

    Every op output is tracked until the last tensor on its storage is garbage: on this CPU machine
    device and host are one memory, so this is what a GPU's peak allocated bytes would show.
    """

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore = ignore
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensors]
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.ignore or storage.nbytes() == 0:
            return
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.live[key][1] += 1
        weakref.finalize(tensor, self._drop, key)

    def _drop(self, key: int) -> None:
        record = self.live.get(key)
        if record is not None:
            record[1] -= 1
            if record[1] == 0:
                self.current -= record[0]
                del self.live[key]


def peak_prefill_bytes(num_layers: int, cache_kind: str, tokens: int = 256) -> int:
    m = tiny_model("llama", num_layers=num_layers)
    # A fixed DRAM pool: allocated once at the same size whatever the depth, so it cancels out.
    cache = make_cache(cache_kind, m) if cache_kind == "dynamic" else make_cache(cache_kind, m, dram_bytes=1 << 20)
    runner = BudgetedPrefill(DecoderStack(m), "layer_segmented", None)
    job = runner.start(random_ids(1, tokens), cache)
    weights = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]}
    with LiveBytes(weights) as tracker:
        while not job.done:
            runner.advance(job, tokens)  # one layer per iteration
    return tracker.peak


@pytest.mark.core
def test_peak_memory_does_not_grow_with_depth():
    """Layer-segmented prefill into a SparseServeCache: 6 layers peak within one layer's KV of 2 layers.

    A DynamicCache (every layer's KV kept on the device, as a prefill that did not hand each layer
    to DRAM would) grows by 4 layers' KV: the measurement sees it.
    """
    one_layer = kv_bytes_per_layer(256)
    sparse_growth = peak_prefill_bytes(6, "sparse") - peak_prefill_bytes(2, "sparse")
    dense_growth = peak_prefill_bytes(6, "dynamic") - peak_prefill_bytes(2, "dynamic")
    assert sparse_growth < one_layer, (sparse_growth, one_layer)
    assert dense_growth >= 4 * one_layer, (dense_growth, one_layer)


@pytest.mark.core
@pytest.mark.parametrize("cache_kind", ["sparse", "dynamic"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sparse_full_layers_build_no_mask(arch, cache_kind, monkeypatch):
    """A chunk over its past builds no (T, past + T) mask for a SparseServeCache's full-attention
    layers (their attention is causal by itself; at 128K that mask was 8 GiB, the prefill's peak),
    while sliding layers and other caches still get HF's masks. Logits stay those of `model(ids)`."""
    import sparseserve_hf.generation.stack as stack_module

    built = []
    for kind, make_mask in dict(stack_module._MASK_FUNCTIONS).items():

        def counting(*args, _kind=kind, _make=make_mask, **kwargs):
            built.append(_kind)
            return _make(*args, **kwargs)

        monkeypatch.setitem(stack_module._MASK_FUNCTIONS, kind, counting)
    m = model(arch)
    runner, job, _ = prefill(m, random_ids(1, T), make_cache(cache_kind, m), "split30")
    torch.testing.assert_close(runner.logits(job), reference_logits(arch), atol=ATOL, rtol=ATOL)
    full_built = built.count(stack_module.FULL)
    if cache_kind == "sparse":
        assert full_built == 0
        assert built.count(stack_module.SLIDING) == (2 * 3 if arch == "gemma3" else 0)  # 2 sliding layers x 3 chunks
    else:
        assert full_built > 0


def fixed_shape_scatter(src_blocks: torch.Tensor, pool_dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """`reference.scatter_blocks` without its boolean mask (on the GPU the save is one kernel over a
    fixed grid): skipped entries write a scratch row."""
    scratch = torch.cat((pool_dst, pool_dst[:1]))  # (C + 1, 2, S, D): row C absorbs skipped entries
    scratch[torch.where(dst_ids >= 0, dst_ids, pool_dst.shape[0])] = src_blocks.to(pool_dst.device)
    pool_dst.copy_(scratch[:-1])


def test_a_fresh_prompt_through_every_layer_reads_nothing_back_from_the_device():
    """A new request's layer-segmented prefill into an empty SparseServeCache queues every layer
    without waiting for one: no length, mask or shape is read back (on CUDA the host would stall
    after each layer's attention, and the GPU idle while Python launched the next kernels)."""
    from dataclasses import replace

    from sparseserve_hf.cache.store import TieredBlockStore
    from sparseserve_hf.ops import get_ops
    from sync_guard import forbid_host_syncs

    m = tiny_model("llama", num_layers=LAYERS)
    config = SparseServeConfig(block_size=16, token_budget=1024)
    ops = replace(get_ops("torch", torch.device("cpu")), scatter_blocks=fixed_shape_scatter)
    head_dim = m.config.hidden_size // m.config.num_attention_heads
    store = TieredBlockStore(config, ops, head_dim, torch.float32, torch.device("cpu"))
    ids, cache = random_ids(1, T), SparseServeCache(m.config, config, store=store)
    runner = BudgetedPrefill(DecoderStack(m), "layer_segmented", None)
    job = runner.start(ids, cache)
    with forbid_host_syncs() as seen:
        runner.advance(job, None)
    assert job.done and seen == []
    assert cache.layers[0].store.dram.num_used == (T - 1) // 16 * LAYERS * m.config.num_key_value_heads
    with torch.no_grad():
        assert torch.allclose(runner.logits(job), m(ids).logits[:, -1], atol=ATOL)
