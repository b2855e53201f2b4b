"""StaticDecoder: the decode step at fixed addresses and shapes, captured in a CUDA graph where it can be
(`capture=False` runs the very same static step eagerly: the CPU path and the reference of a replay).

Eager PyTorch spends most of a sparse decode step launching ~100 small kernels per layer from
Python; a CUDA graph replays them with one launch. A captured step may not sync with the host,
change a shape, allocate where the graph does not expect it or take a Python branch on data, so a
step splits in three:

1. pre-step, eager: refuse positions past the model's limit; keep the block table at a fixed width
   (`table_width`: `table_step` x 1, 2, 3, 4, 6, 8, ... blocks, room for every row's next block);
   save every full tail block to DRAM (`SparseServeCache.roll_full_tails`: a host allocation, once per block_size
   tokens of a row); drop the graphs if a store tensor they hold by address has moved. The rows'
   own tensors (tail, lengths, block table) stay where they are while a batch cache's slots change
   hands (`SparseServeCache.place_rows` / `take_rows`: a vacant slot rides along storing
   nothing); where they do move (another row count, a table width left and taken again, rows
   rebuilt by the caller), a replay first copies them into the ones its graph holds.
2. the static step: `model(ids, position_ids=positions)` over the cache with no attention mask,
   the greedy pick written back into `ids`, positions + 1. Fixed shapes, no host sync, no
   Python decision that depends on the data: captured once per (rows, table width), then replayed.
3. post-step, eager: what a replay does not advance, because no Python runs in it: each layer's
   `num_positions` and the host tail lengths.

`capture=False` runs the very same static step eagerly: wherever a capture cannot run (CPU, a
tensor-parallel rank, a rope that reads positions on the host), and as the reference a graph's
tokens must equal. Every decode of the `Generator`, and of `model.generate` over a cache built from
the model, is this step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .cache.cache import SparseServeCache
from .cache.grow import geometric_size
from .cache.layer import SparseServeLayer
from .cache.plain import plain_tensors
from .compat import cache_kwarg
from .fused_ops import FusedModelOps
from .layer_graphs import garbage_collection_paused
from .ops import resolve_backend

logger = logging.getLogger(__name__)
DEFAULT_TABLE_STEP = 128  # blocks (4K tokens at block_size 32): widths are 128 x (1, 2, 3, 4, 6, 8, ...)
EAGER_TABLE_STEP = 8  # uncaptured, a new width costs only a reallocation: tables stay near the rows' need
DEFAULT_MAX_GRAPHS = 64  # graphs kept (least recently replayed dropped first): bounds their memory pools
HOST_SYNCING_ROPE = ("dynamic", "longrope")  # their forward compares max(position_ids) on the host


def table_width(blocks: int, step: int) -> int:
    """The block-table width that holds `blocks`: `geometric_size(blocks, step)`.

    Every width is one more graph per batch size. Geometric widths keep the captures logarithmic in
    the context: linear 4K-token steps gave 14 widths between 10K and 64K tokens, these give 6, at the
    price of a table under 1.5x the `step`-rounded need: scoring and top-k work grows with the width.
    """
    return geometric_size(blocks, step)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph (a stand-in in CPU tests)
    logits: torch.Tensor  # (B, V) in the graph's memory pool, overwritten by every replay
    picks: list[Any]  # each layer's `last_pick` as captured: tensors every replay overwrites
    ids: torch.Tensor  # (B, 1) the inputs it reads (and writes the greedy pick into)
    positions: torch.Tensor  # (B, 1)
    rows: list[dict[str, torch.Tensor]]  # each layer's per-row tensors (`SparseServeLayer.graph_tensors`)


class CudaGraphs:
    """The CUDA side of capturing: a warm-up on a side stream, then a capture into a shared pool.

    Apart from the decoder so that tests can stand a fake in for it on CPU.
    """

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()  # shared by every graph of one decoder

    def new_pool(self) -> None:
        """Capture later graphs into a fresh pool: once every graph of a pool is gone, PyTorch
        releases the pool and refuses to capture into it again (an internal assert)."""
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, fn) -> torch.Tensor:
        """Run `fn` for real on a side stream (Triton compiles, cuBLAS sets up), as capture requires."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def record(self, fn) -> tuple[Any, torch.Tensor]:
        """Capture `fn`'s kernels without running them; returns the graph and `fn`'s (static) output.

        "thread_local": the FlashD2H saver's threads may call CUDA while this thread captures;
        this thread's garbage collector waits (`garbage_collection_paused`).
        """
        graph = torch.cuda.CUDAGraph()
        with garbage_collection_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out


class StaticDecoder:
    """Greedy decode of every row of a prefilled SparseServeCache, one token per row per `step()`.

    With `capture` a step is a CUDA-graph replay (captured on the first step and again whenever
    the table width or a tensor the graph points at changes); without it the same static step
    runs eagerly. Either way the rows keep their cache: afterwards `model(...)` can go on with it.

    Args:
        model: a causal LM loaded with attn_implementation="sparseserve".
        cache: the SparseServeCache holding the rows (prefilled, every layer a SparseServeLayer).
        capture: True replays CUDA graphs (a CUDA model, backend "triton" or "flash"); False runs
            the static step eagerly; None follows `cache.config.cuda_graphs` (for None there:
            wherever a capture can run).
        table_step: block-table widths are this many blocks times 1, 2, 3, 4, 6, 8, ... (`table_width`).
            Unused entries add scoring and top-k work; crossing a width reallocates the tables and
            recaptures. None: `DEFAULT_TABLE_STEP` when capturing, `EAGER_TABLE_STEP` when not.
        max_graphs: graphs kept, one per (rows, table width) seen; past it the least recently
            replayed one is dropped (with its memory), so a long-running server stays bounded.

    Example:
        >>> decoder = StaticDecoder(model, cache)
        >>> decoder.start(first_tokens)  # (B, 1); positions default to each row's stored length
        >>> tokens = [decoder.step().clone() for _ in range(32)]  # (B, 1) greedy picks each
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SparseServeCache,
        *,
        capture: bool | None = None,
        table_step: int | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        if capture is None:
            wanted = cache.config.cuda_graphs
            capture = wanted if wanted is not None else can_capture(model, cache)
        self.capture = capture
        check_graph_ready(model, cache, self.capture)
        if table_step is None:
            table_step = DEFAULT_TABLE_STEP if capture else EAGER_TABLE_STEP
        for name, value in (("table_step", table_step), ("max_graphs", max_graphs)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_graphs = max_graphs
        self.model, self.cache, self.table_step = model, cache, table_step
        self.layers: list[SparseServeLayer] = list(cache.layers)
        self.graphs = CudaGraphs() if self.capture else None
        self.num_captures = 0
        self.capture_s = 0.0  # host seconds in `_capture`: each eager warm-up step and its recording
        self.capture_error: Exception | None = None  # why capturing was switched off, if it was
        self.logits: torch.Tensor | None = None  # (B, V) of the last step; a replay overwrites it
        self._captured: OrderedDict[tuple[int, int], _Captured] = OrderedDict()  # least recently replayed first
        self._state: tuple | None = None  # what the captured graphs point at (`TieredBlockStore.graph_state`)
        self._ids: torch.Tensor | None = None  # (B, 1) static inputs, set by `start`
        self._kwargs = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
        self._fused: FusedModelOps | None = None  # the model's ops the static step runs fused, set by `start`
        self._fused_checked = False

    @plain_tensors  # a caller under inference_mode must not leave inference tensors in the captured inputs
    def start(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Begin decoding: `tokens` (B, 1) are the next inputs, at `positions` (B, 1).

        positions: None = each row's stored length (rows of a SparseServeCache hold no padding).
        Reads the rows' tail lengths and block counts back once; from here on the decoder keeps
        them on the host, and the caller must not change the cache's rows between steps. A row
        that holds nothing (a vacant slot) stays empty: its token and position are ignored.
        """
        layer = self.layers[0]
        if not layer.is_initialized:
            raise ValueError("StaticDecoder.start needs a prefilled cache (run the prompt through the model first)")
        batch = layer.tail.shape[0]
        if tokens.numel() != batch:
            raise ValueError(f"the cache holds {batch} rows, got tokens of shape {tuple(tokens.shape)}")
        device = layer.tail.device
        if positions is None:
            positions = layer.row_lengths()
        if not self._fused_checked:  # the store (and its op set) exists once the cache holds rows
            ops, config = self.cache.store.ops, self.cache.config
            rope = ops.rope if config.fused_rope else None
            head_dim = self.cache.shape.head_dim
            silu_mul = ops.silu_mul if config.fused_activation else None
            self._fused = (
                FusedModelOps(
                    self.model,
                    ops.rms_norm,
                    rope,
                    config.fused_norms,
                    head_dim,
                    silu_mul,
                    config.projections_beside,
                    ops.add_rms_norm,
                )
                or None
            )
            self._fused_checked = True
        self._ids = tokens.reshape(batch, 1).to(device, torch.long).clone()  # static: the graph reads and writes it
        self._positions = positions.reshape(batch, 1).to(device, torch.long).clone()
        host = torch.cat((layer.tail_len.long(), layer.num_blocks.long(), self._positions.flatten())).tolist()
        self._tail_len: list[int] = host[:batch]  # one readback for all three
        self._num_blocks: list[int] = host[batch : 2 * batch]
        # A row that holds nothing is a vacant slot (`SparseServeCache.take_rows`): the step stores nothing there.
        self._holds = [length > 0 or blocks > 0 for length, blocks in zip(self._tail_len, self._num_blocks)]
        self._last_position = max(host[2 * batch :])
        # Graphs of an earlier start stay: over a batch cache whose slots changed hands the rows'
        # tensors are the ones they captured; where they moved, a replay copies them back (`_seat`).
        # Either way a (rows, table width) seen before captures nothing new.

    @plain_tensors  # no autograd; under inference_mode, tensors it creates stay usable outside it
    def step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per row; returns the (B, 1) greedy picks (a static buffer: clone to keep).

        tokens: (B, 1) inputs for this step instead of the last step's greedy picks (a sampler's).
        """
        if self._ids is None:
            raise RuntimeError("call StaticDecoder.start(tokens) before step()")
        self._pre_step()
        if tokens is not None:
            self._ids.copy_(tokens.reshape(self._ids.shape), non_blocking=True)
        self.logits = self._replay() if self.capture else self._static_step()
        self._post_step()
        return self._ids

    # ---- the three parts of a step ----------------------------------------------------------------

    def _pre_step(self) -> None:
        # the cache's own check runs only at capture
        self.cache.shape.positions.check(self._last_position, "the next decode step")
        width = table_width(max(self._num_blocks) + 1, self.table_step)  # room for each row's next block
        for layer in self.layers:  # every layer: a prompt prefilled in paced chunks joins with its own widths
            if layer.block_ids.shape[2] != width:
                layer.set_table_width(width)
        full = [row for row, length in enumerate(self._tail_len) if length == self.cache.config.block_size]
        if full:
            self.cache.roll_full_tails(full, table_width=width)
            for row in full:
                self._tail_len[row], self._num_blocks[row] = 0, self._num_blocks[row] + 1
        self.cache.store.wait_for_saves()  # a replay reads the pool with no fetch of its own: saves land first
        if self.capture:  # only graphs hold the store's tensors by address
            self._prepare_lookups((len(self._tail_len), width))
            self._check_state()

    def _prepare_lookups(self, key: tuple[int, int]) -> None:
        """What each layer's lookup does on the host that a replay of `key`'s graph skips: an unlimited
        HBM cache grows to hold every live block (which moves it: the state check then recaptures)."""
        captured = self._captured.get(key)
        store = self.cache.store
        if captured is None or not store.hbm.unlimited:
            return
        for layer, pick in zip(self.layers, captured.picks):
            store.prepare_fetch(tuple(pick[0].shape), layer.first_partition)

    def _check_state(self) -> None:
        state = self.cache.store.graph_state()  # the rows' own tensors `_seat` puts back in place
        if state != self._state:
            self._drop_graphs()
            self._state = state

    def _drop_graphs(self) -> None:
        if self._captured and self.graphs is not None:
            self.graphs.new_pool()
        self._captured.clear()

    def _static_step(self) -> torch.Tensor:
        """What a graph captures: one forward at fixed shapes, greedy pick fed back. Returns (B, V) logits."""
        if self._fused is not None:
            self._fused.enter()
        try:
            with self.cache.static_step():  # the pre-step rolled full tails: commits only append
                logits = self.model(input_ids=self._ids, position_ids=self._positions, **self._kwargs).logits[:, -1]
        finally:
            if self._fused is not None:
                self._fused.exit()
        self._ids.copy_(logits.argmax(-1, keepdim=True))
        self._positions.add_(1)
        return logits

    def _post_step(self) -> None:
        self._tail_len = [length + held for length, held in zip(self._tail_len, self._holds)]
        self._last_position += 1
        for layer in self.layers:
            layer.forget_host_counts()

    # ---- graphs -----------------------------------------------------------------------------------

    def _replay(self) -> torch.Tensor:
        key = (len(self._tail_len), self.layers[0].block_ids.shape[2])  # (rows, table width)
        captured = self._captured.get(key)
        if captured is None:
            return self._capture(key)
        self._captured.move_to_end(key)
        self._seat(captured)
        captured.graph.replay()
        for layer in self.layers:
            layer.num_positions += 1  # what `update` counts when the Python runs
        self._set_picks(captured.picks)  # a replay runs no Python: point `last_pick` at what it wrote
        return captured.logits

    def _capture(self, key: tuple[int, int]) -> torch.Tensor:
        """Run this step for real (the warm-up capture needs), then capture it for the next ones.

        A capture that fails (out of memory, a kernel that cannot be captured) keeps the warm-up's
        result and switches capturing off, with one warning: later steps run the static step
        eagerly (`capture_error` says why). A warm-up that fails is the step's own failure.
        Its host time, compilation of kernels first met included, adds to `capture_s`."""
        start = time.perf_counter()
        try:
            return self._warm_up_and_record(key)
        finally:
            self.capture_s += time.perf_counter() - start

    def _warm_up_and_record(self, key: tuple[int, int]) -> torch.Tensor:
        logits = self.graphs.warm_up(self._static_step)
        self._check_state()  # the warm-up may have grown an unlimited cache: older graphs are stale
        step_picks = [layer.last_pick for layer in self.layers]  # this step's selections (the warm-up ran it)
        positions = [layer.num_positions for layer in self.layers]
        try:
            graph, static_logits = self.graphs.record(self._static_step)
        except Exception as exc:  # noqa: BLE001  the step itself ran (the warm-up): go on without graphs
            self._give_up_capturing(exc, positions, step_picks)
            return logits
        for layer in self.layers:
            layer.num_positions -= 1  # the capture ran the Python (`update` counted) but no kernel
        picks, rows = [layer.last_pick for layer in self.layers], [layer.graph_tensors() for layer in self.layers]
        if len(self._captured) >= self.max_graphs:  # the new graph keeps the pool alive: never all dropped
            self._captured.popitem(last=False)
        self._captured[key] = _Captured(graph, static_logits, picks, self._ids, self._positions, rows)
        self._set_picks(step_picks)  # the captured ones hold nothing yet
        self.num_captures += 1
        return logits

    def _give_up_capturing(self, exc: Exception, positions: list[int], picks: list[Any]) -> None:
        """After a failed capture: the layers as the warm-up left them, no graphs, eager steps from now on."""
        for layer, count, pick in zip(self.layers, positions, picks):
            layer.num_positions, layer.staged, layer.last_pick = count, None, pick
        self._drop_graphs()
        self.capture, self.graphs, self.capture_error = False, None, exc
        logger.warning("StaticDecoder: capturing a decode step failed (%s); decoding without CUDA graphs", exc)

    def _seat(self, captured: _Captured) -> None:
        """Put the current rows into the tensors `captured` reads and writes (copies where they differ).

        The rows' tensors move whenever the batch changes (rows joined or left); the graph's do not.
        """
        if self._ids is not captured.ids:
            captured.ids.copy_(self._ids)
            captured.positions.copy_(self._positions)
            self._ids, self._positions = captured.ids, captured.positions
        for layer, rows in zip(self.layers, captured.rows):
            layer.move_into(rows)

    def _set_picks(self, picks: list[Any]) -> None:
        """Each layer's `last_pick` (what the working-set tracker reads after a step)."""
        for layer, pick in zip(self.layers, picks):
            layer.last_pick = pick


def check_graph_ready(model: torch.nn.Module, cache: SparseServeCache, capture: bool) -> None:
    """Raise ValueError / NotImplementedError naming what keeps `model` + `cache` from a static decode step."""
    obstacle = graph_obstacle(model, cache, capture)
    if obstacle is not None:
        raise obstacle


def can_capture(model: torch.nn.Module, cache: SparseServeCache) -> bool:
    """True when a CUDA graph can capture the decode step of `model` over `cache`."""
    return graph_obstacle(model, cache, capture=True) is None


def graph_obstacle(model: torch.nn.Module, cache: SparseServeCache, capture: bool) -> Exception | None:
    """What keeps `model` + `cache` from a static decode step (captured when `capture`), as the
    exception to raise, or None when nothing does. Pools may grow: the decoder recaptures then."""
    if getattr(model.config, "_attn_implementation", None) != "sparseserve":
        return ValueError("StaticDecoder needs a model loaded with attn_implementation='sparseserve'")
    if not all(isinstance(layer, SparseServeLayer) for layer in cache.layers):
        return NotImplementedError(
            "graph mode needs every layer to be a SparseServeLayer: dense_layers and sliding-window layers "
            "grow their KV with torch.cat every step, which a captured step cannot follow"
        )
    if not capture:
        return None
    syncing = sorted(_rope_types(cache.model_config) & set(HOST_SYNCING_ROPE))
    if syncing:
        return NotImplementedError(
            f"graph mode cannot capture rope_type {syncing}: it reads max(position_ids) on the host every step"
        )
    if cache.config.transfer != "kernel":
        return ValueError(
            "CUDA-graph capture needs transfer='kernel': transfer='copy' reads block ids back to the host"
        )
    device = next(model.parameters()).device
    if device.type != "cuda":
        return ValueError(f"CUDA-graph capture needs a model on a CUDA device, not {device}; use capture=False")
    backend = resolve_backend(cache.config.backend, device)
    if backend not in ("triton", "flash"):
        return ValueError(
            f"CUDA-graph capture needs backend 'triton' or 'flash' on CUDA, not {backend!r}: the torch "
            "reference's block copy filters entries with a boolean mask (a host sync)"
        )
    return None


def _rope_types(text_config: Any) -> set[str]:
    """Every rope_type of a config: one dict, or one per layer type (Gemma-3), or none (default)."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if "rope_type" in params or "type" in params:
        return {params.get("rope_type", params.get("type"))}
    return {p.get("rope_type", "default") for p in params.values() if isinstance(p, dict)} or {"default"}
