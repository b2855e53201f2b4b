"""GenerateGraphs: `model.generate`'s decode steps over a cache built from the model, as CUDA-graph replays.

Eager, a decode step of the drop-in launches every kernel of the whole model from Python (HF's
own layers as much as ours), and at a few rows that launching, not the GPU, sets the step time.
A cache built from the model itself (`SparseServeCache(model, ...)`) can do better: it routes
each decode forward of that model through the step the batching Generator replays
(`graph.StaticDecoder`), one CUDA-graph launch for the whole model.

The route is a wrapper around the model instance's `forward` (installed once per model; it
keeps the signature, so `generate` prepares the same inputs). A forward takes the route only
when it is a plain decode step the static step computes exactly: one new real token per row of
a prefilled cache, explicit `position_ids`, no gradients, nothing asked for but the last
logits. Anything else (the prefill, a new prompt, hidden states, a padded new token, a position
past `max_position_embeddings`) runs the model's own forward, untouched. Every routed step
re-reads the rows' lengths (one small host readback, where `generate` syncs anyway), so whatever
changed the rows in between (an eager forward, `crop`, beam reordering) is followed.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache.cache import SparseServeCache
from .cache.layer import SparseServeLayer
from .compat import OUTPUT_CACHE_FIELD
from .graph import StaticDecoder, can_capture, graph_obstacle

CACHE_KWARGS = ("past_key_values", "cache")  # transformers 5.17 / 5.24 names of the cache argument
ROUTED_KWARGS = frozenset(("input_ids", "position_ids", "attention_mask", "logits_to_keep", "use_cache", "return_dict"))
ROUTED_MARK = "_sparseserve_routed_forward"


class GenerateGraphs:
    """Runs the decode forwards of one model over one cache as CUDA-graph replays.

    Args:
        model: the causal LM (attn_implementation="sparseserve") whose forwards are routed.
        cache: the SparseServeCache those forwards carry.
        capture: True replays CUDA graphs; False runs the very same static step eagerly (the
            reference a replay's tokens must equal, and the CPU path of tests).
    """

    def __init__(self, model: torch.nn.Module, cache: SparseServeCache, *, capture: bool = True) -> None:
        self.model = model
        self.cache = weakref.proxy(cache)  # the cache holds this route: a strong reference back would be a cycle
        self.decoder = StaticDecoder(model, self.cache, capture=capture)
        self.steps = 0  # decode forwards this route ran
        self._running = False  # inside `forward`: the decoder's own call of the model is not routed again

    @property
    def enabled(self) -> bool:
        """False once capturing failed (`decoder.capture_error`): forwards run the model's own again."""
        return self.decoder.capture or self.decoder.capture_error is None

    def takes(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """True when this forward is a decode step the static step computes exactly (see the module doc)."""
        if args or self._running or not self.enabled or torch.is_grad_enabled():
            return False
        if any(name not in ROUTED_KWARGS and name not in CACHE_KWARGS for name in kwargs):
            return False
        if kwargs.get("use_cache") is False or kwargs.get("return_dict") is False:
            return False
        keep = kwargs.get("logits_to_keep", 1)
        if not isinstance(keep, int) or keep not in (0, 1):
            return False
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            return False
        if not isinstance(positions, torch.Tensor) or positions.shape != ids.shape:
            return False
        layer = self.cache.layers[0]
        if not isinstance(layer, SparseServeLayer) or not layer.is_initialized or layer.tail.shape[0] != ids.shape[0]:
            return False
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            return False
        checks = [] if mask is None else [mask[:, -1].bool().all()]  # every new token real
        limit = self.cache.shape.positions.limit
        if limit is not None:  # past it the model's own forward decides (the cache warns once and goes on)
            checks.append(positions.max() < limit)
        return not checks or bool(torch.stack(checks).all())  # one small readback

    def forward(self, kwargs: dict[str, Any]) -> CausalLMOutputWithPast:
        """The decode step of `kwargs` (accepted by `takes`) through the decoder: (B, 1, V) logits."""
        self._running = True
        try:
            self.decoder.start(kwargs["input_ids"], kwargs["position_ids"])
            self.decoder.step()
        finally:
            self._running = False
        self.steps += 1
        cache = next(kwargs[name] for name in CACHE_KWARGS if name in kwargs)
        return CausalLMOutputWithPast(logits=self.decoder.logits[:, None].clone(), **{OUTPUT_CACHE_FIELD: cache})


def route_generate(model: torch.nn.Module, cache: SparseServeCache, capture: bool | None = None) -> bool:
    """Route `model`'s decode forwards over `cache` through the decoder's static step, if it can
    serve them: returns whether they are. `capture`: None = as CUDA graphs wherever one can
    capture them (a CUDA model, the "triton" or "flash" backend), else eagerly; False = eagerly."""
    if capture is None:
        capture = can_capture(model, cache)
    if graph_obstacle(model, cache, capture) is not None:
        return False
    cache.generate_graphs = GenerateGraphs(model, cache, capture=capture)
    _install_forward(model)
    return True


def _install_forward(model: torch.nn.Module) -> None:
    """Wrap the instance's `forward` once: forwards carrying a routed cache go to its route.

    The wrapper holds the model weakly (the class's own `forward` is called with it): a model
    referring to itself through its `forward` would outlive `del model` until a garbage
    collection, GiBs of weights with it. It shows the signature of the forward it wraps
    (`generate` inspects it to prepare inputs)."""
    if getattr(model.forward, ROUTED_MARK, False):
        return
    own, this = model.forward, weakref.ref(model)
    if getattr(own, "__self__", None) is model:  # the class's method: keep its function, not the bound method
        func = own.__func__

        def call_own(*args, **kwargs):
            return func(this(), *args, **kwargs)
    else:  # an instance attribute set by someone else (e.g. accelerate's hooks) already holds the model
        func = call_own = own

    def forward(*args, **kwargs):
        cache = next((kwargs[name] for name in CACHE_KWARGS if name in kwargs), None)
        route = getattr(cache, "generate_graphs", None)
        if route is not None and route.model is this() and route.takes(args, kwargs):
            return route.forward(kwargs)
        return call_own(*args, **kwargs)

    functools.update_wrapper(forward, func)
    del forward.__wrapped__  # `__signature__` instead: the bound signature, holding nothing
    forward.__signature__ = inspect.signature(own)
    setattr(forward, ROUTED_MARK, True)
    model.forward = forward
