"""`model.generate` over a cache built from the model: decode steps routed through the captured step.

On CPU the route runs the static step eagerly (`capture=False`), or replays it through the stand-in
for CUDA graphs (`fake_graphs.FakeGraphs`: a capture runs no kernel, a replay no Python). Either way
`generate` must return exactly what it returns over an unrouted cache (the ordinary eager path),
with left padding, tails that fill at different steps, an HBM cache that evicts, pools that grow,
beam search, and forwards the route must leave to the model. tests/test_cuda.py runs
the route with real CUDA graphs.
"""

from __future__ import annotations

import gc
import inspect
import logging
import weakref
from dataclasses import replace

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from fake_graphs import FakeGraphs
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.generate_graphs import route_generate
from test_static_decode import static_config
from tiny_models import PAD, random_ids, tiny_model

NEW = 40  # every row's tail fills twice or more
PADS = (0, 9, 3)  # left padding per row: rows of different lengths


def prompts(length: int = 150) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(len(PADS), length, seed=3)
    mask = torch.ones_like(ids)
    for row, pads in enumerate(PADS):
        ids[row, :pads], mask[row, :pads] = PAD, 0
    return ids, mask


def generate(model, cache: SparseServeCache, new: int = NEW, **kwargs) -> torch.Tensor:
    ids, mask = prompts()
    kwargs = {"do_sample": False} | kwargs
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, **{cache_kwarg(model): cache}, **kwargs
        )
    return out[:, ids.shape[1] :]


def routed(model, config: SparseServeConfig, replay: bool) -> SparseServeCache:
    """A cache whose decode steps take the route: the static step eagerly, or replayed by FakeGraphs."""
    cache = SparseServeCache(model.config, config)
    assert route_generate(model, cache, capture=False)
    if replay:
        decoder = cache.generate_graphs.decoder
        decoder.capture, decoder.graphs = True, FakeGraphs(decoder)
    return cache


@pytest.fixture
def model():
    return tiny_model("llama")  # a fresh instance: the route wraps the instance's forward


@pytest.mark.core
@pytest.mark.parametrize("replay", [False, True], ids=["static-eager", "replayed"])
def test_routed_generate_returns_what_the_eager_path_returns(model, replay):
    config = static_config()
    want = generate(model, SparseServeCache(model.config, config))
    cache = routed(model, config, replay)
    got = generate(model, cache)
    assert torch.equal(got, want)
    route = cache.generate_graphs
    assert route.steps == NEW - 1  # every decode forward took the route, the prefill did not
    if replay:
        assert route.decoder.num_captures == 1 and route.decoder.capture_error is None
    plain = SparseServeCache(model.config, config)  # the same model, an unrouted cache: its own forward
    assert torch.equal(generate(model, plain), want) and plain.generate_graphs is None


class FillPoolAt(LogitsProcessor):
    """At decode step `step`, fill the cache's DRAM pool with blocks nobody reads: it grows, its tensors move."""

    def __init__(self, cache: SparseServeCache, step: int) -> None:
        self.cache, self.step, self.calls, self.spare = cache, step, 0, None

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            dram = self.cache.store.dram
            self.spare = self.cache.store.save(torch.randn(dram.capacity - dram.num_used, *dram.block_shape))
        return scores


@pytest.mark.parametrize("replay", [False, True], ids=["static-eager", "replayed"])
def test_growing_pools_and_an_unlimited_hbm_cache(model, replay):
    """The default pools: DRAM sized by the prompt and grown mid-decode, an unlimited HBM cache grown
    before replays; a graph of the old addresses must never replay."""
    config = SparseServeConfig(block_size=16, token_budget=64)
    plain = SparseServeCache(model.config, config)
    want = generate(model, plain, new=80, logits_processor=LogitsProcessorList([FillPoolAt(plain, 30)]))
    cache = routed(model, config, replay)
    fill = FillPoolAt(cache, 30)
    got = generate(model, cache, new=80, logits_processor=LogitsProcessorList([fill]))
    assert torch.equal(got, want)
    assert cache.generate_graphs.steps == 79
    if replay:
        assert cache.generate_graphs.decoder.num_captures >= 2  # captured again over the grown pool
    cache.store.free(fill.spare)


def test_sampling_draws_what_the_eager_path_draws(model):
    """The route returns the logits; generate's own sampler draws from them with the same generator."""
    config = static_config()
    draws = []
    for cache in (SparseServeCache(model.config, config), routed(model, config, replay=True)):
        torch.manual_seed(7)
        draws.append(generate(model, cache, new=24, do_sample=True, temperature=1.0, top_k=0))
    assert torch.equal(draws[0], draws[1]) and len(set(draws[0].flatten().tolist())) > 3


def test_a_second_prompt_and_beam_search_are_followed(model):
    """Whatever changes the rows between routed steps (a new prefill, beam reordering) is re-read."""
    config = static_config()
    plain = SparseServeCache(model.config, config)
    cache = routed(model, config, replay=True)
    for _ in range(2):  # the same cache again: reset by generate's new prefill? no: reused, as a user may
        plain.reset(), cache.reset()
        assert torch.equal(generate(model, cache, new=20), generate(model, plain, new=20))
    ids, mask = prompts()
    beams = dict(num_beams=2, max_new_tokens=12, do_sample=False, input_ids=ids[:1], attention_mask=mask[:1])
    plain, cache = SparseServeCache(model.config, config), routed(model, config, replay=True)
    with torch.no_grad():
        want = model.generate(**beams, **{cache_kwarg(model): plain})
        got = model.generate(**beams, **{cache_kwarg(model): cache})
    assert torch.equal(got, want)
    assert cache.generate_graphs.steps == 11


def test_a_route_used_inside_inference_mode_keeps_working_outside_it(model):
    config = static_config()
    want = generate(model, SparseServeCache(model.config, config))
    cache = routed(model, config, replay=True)
    with torch.inference_mode():
        assert torch.equal(generate(model, cache), want)
    cache.reset()
    assert torch.equal(generate(model, cache), want)  # the captured inputs are no inference tensors
    assert cache.generate_graphs.steps == 2 * (NEW - 1)


def test_positions_past_the_models_limit_go_the_eager_way(caplog):
    """Decode past `max_position_embeddings` runs on, as the eager path does (with its warning): the
    route hands those steps to the model's own forward."""
    model = tiny_model("llama")
    model.config.max_position_embeddings = 175  # rows of 141-150 tokens, 40 new: the last steps are past it
    config = static_config()
    want = generate(model, SparseServeCache(model.config, config))
    cache = routed(model, config, replay=True)
    assert torch.equal(generate(model, cache), want)
    assert 0 < cache.generate_graphs.steps < NEW - 1


def test_forwards_the_route_leaves_to_the_model(model):
    cache = routed(model, static_config(), replay=False)
    route = cache.generate_graphs
    ids, mask = prompts()
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **kw)  # the prefill
        step = dict(input_ids=ids[:, -1:], position_ids=mask.sum(-1, keepdim=True), **kw)
        model(**step, output_hidden_states=True)  # asks for more than the logits
        model(**step, attention_mask=torch.cat((mask, torch.zeros_like(mask[:, :1])), -1))  # a padded new token
        model(input_ids=ids[:, -1:], **kw)  # no position_ids
        assert route.steps == 0
        other = tiny_model("llama")
        other(**step | {cache_kwarg(other): cache})  # another model over this cache: the route is this model's
        assert route.steps == 0
        out = model(**step)
    assert route.steps == 1 and out.logits.shape == (3, 1, model.config.vocab_size)
    with torch.enable_grad():
        model(**step)
    assert route.steps == 1  # gradients: the model's own forward


def test_the_wrapper_keeps_the_signature_and_is_installed_once(model):
    before = inspect.signature(model.forward)
    first = routed(model, static_config(), replay=False)
    wrapper = model.forward
    second = routed(model, static_config(), replay=False)
    assert model.forward is wrapper and inspect.signature(model.forward) == before
    assert cache_kwarg(model) in inspect.signature(model.forward).parameters
    assert first.generate_graphs is not second.generate_graphs


def test_a_cache_from_the_model_on_cpu_routes_the_same_step_uncaptured(model):
    """By default a cache built from the model routes its decode steps through the decoder: captured
    where a CUDA graph can capture them, eagerly elsewhere (here), the same step either way."""
    config = static_config()
    want = generate(model, SparseServeCache(model.config, config))
    cache = SparseServeCache(model, config)
    assert cache.generate_graphs.decoder.capture is False and model.forward._sparseserve_routed_forward
    assert torch.equal(generate(model, cache), want) and cache.generate_graphs.steps == NEW - 1
    assert SparseServeCache(model, replace(config, generate_graphs=False)).generate_graphs is None
    assert SparseServeConfig().generate_graphs is True
    with pytest.raises(ValueError, match="generate_graphs must be a bool"):
        SparseServeConfig(generate_graphs=1)
    gemma = tiny_model("gemma3")  # sliding-window layers: no static step
    assert not route_generate(gemma, SparseServeCache(gemma.config, replace(static_config())), capture=False)


class FailingGraphs(FakeGraphs):
    def record(self, fn):
        raise RuntimeError("out of memory while capturing")


def test_a_failed_capture_keeps_the_step_and_falls_back_to_the_eager_path(model, caplog):
    config = static_config()
    want = generate(model, SparseServeCache(model.config, config))
    cache = routed(model, config, replay=False)
    decoder = cache.generate_graphs.decoder
    decoder.capture, decoder.graphs = True, FailingGraphs(decoder)
    with caplog.at_level(logging.WARNING, logger="sparseserve_hf.graph"):
        got = generate(model, cache)
    assert torch.equal(got, want)
    assert "capturing a decode step failed" in caplog.text and isinstance(decoder.capture_error, RuntimeError)
    assert cache.generate_graphs.steps == 1 and not cache.generate_graphs.enabled  # one warm-up, then eager


def test_a_routed_model_and_its_cache_are_freed_by_del_without_a_garbage_collection():
    """No reference cycle: their GiBs of weights and pools go when the user lets go of them."""
    model = tiny_model("llama")
    cache = routed(model, static_config(), replay=False)  # (the CPU stand-in for graphs refers to its decoder)
    generate(model, cache, new=3)
    alive = [weakref.ref(model), weakref.ref(cache)]
    gc.disable()
    try:
        del model, cache
        assert [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()
