"""LayerGraphs: each sparse layer's decode attention replayed as a CUDA graph by eager callers.

An eager forward (`model.generate`, the `Generator` without `cuda_graphs`) would launch a sparse
layer's decode attention (scoring, top-k, GQA union, block-cache lookup, loading the misses,
sparse attention) as ~20 kernels from Python, for every layer and token. Here each
(layer, query shape, table width) captures that work once; later calls copy the query into the
captured input and launch one graph. The model around it stays eager: the code captured is the
attention call of the very step the whole-step graph (`graph.StaticDecoder`) captures.

A captured piece reads, by address, the layer's tail, lengths and block table (the caller
changes them only between calls: appending the new token, linking a saved block) and the
store's pools and tables (which it updates in place: LRU, HBM slots, counters). So a piece
replays only while those are the very tensors it captured:
- the store's tensors moved (its epoch or an address changed): every piece is dropped;
- the layer's own tensors were replaced (rows joined or left, the table grew): that piece is
  captured again. Pieces never write the layer's tensors, so none is ever copied.
What a replay skips because no Python runs in it happens eagerly first
(`TieredBlockStore.prepare_fetch`: asynchronous saves finished, an unlimited cache grown).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
DEFAULT_MAX_PIECES = 256  # captured pieces kept (least recently replayed dropped first)


@dataclass
class _Piece:
    graph: Any  # torch.cuda.CUDAGraph (a stand-in in CPU tests)
    query: torch.Tensor  # (B, Hq, D) the input it reads; a call copies its query here
    out: torch.Tensor  # (B, Hq, D) written by every replay
    pick: Any  # the layer's `last_pick` as captured: tensors every replay overwrites
    rows: tuple[torch.Tensor, ...]  # the layer's tensors it reads by address
    selection_shape: tuple[int, ...]  # (B, Hkv, U) of its lookups, for `prepare_fetch`


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """No automatic Python garbage collection inside (as it was after): a collection that runs
    while this thread captures may finalize an unreachable cache, whose pinned pool's release
    (`cudaHostUnregister`, `cudaFreeHost`) the capture forbids on this thread. That invalidates
    the capture and leaves the CUDA context in an error state. Costs no sync."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class PieceCapture:
    """The CUDA side: a warm-up on a side stream, then a capture into the pool of the piece's layer.

    Pieces of one layer share a memory pool, pieces of different layers never do: a piece's
    outputs (its pick, read after the whole step) may sit where another piece of its pool keeps
    intermediates, and of one layer's pieces only one replays per step. Captures with
    `capture_begin`/`capture_end` on the side stream rather than through `torch.cuda.graph`,
    which synchronizes the device and empties the allocator's cache: a capture then costs the
    eager model no sync and no fresh allocations. Apart from `LayerGraphs` so that tests can
    stand a fake in for it on CPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pools: dict[int, Any] = {}
        self.stream = torch.cuda.Stream(self.device)

    def new_pools(self) -> None:
        """Capture later pieces into fresh pools (a pool whose graphs are all gone is released)."""
        self.pools = {}

    def forget_pool(self, layer_idx: int) -> None:
        """The layer's pieces are all gone (or its capture failed): its next capture needs a fresh pool."""
        self.pools.pop(layer_idx, None)

    def on_device(self):
        """A context with the pieces' device current: replays launch on its current stream."""
        return torch.cuda.device(self.device)

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run `fn` for real on the side stream (Triton compiles, the result is this call's)."""
        return self._on_side_stream(fn)

    def record(self, fn: Callable[[], torch.Tensor], layer_idx: int) -> tuple[Any, torch.Tensor]:
        """Capture `fn`'s kernels without running them; returns the graph and `fn`'s static output."""
        graph = torch.cuda.CUDAGraph()
        with self.on_device():
            pool = self.pools.setdefault(layer_idx, torch.cuda.graph_pool_handle())

        def captured() -> torch.Tensor:
            with garbage_collection_paused():
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    return fn()
                finally:
                    graph.capture_end()

        return graph, self._on_side_stream(captured)

    def _on_side_stream(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`fn()` on the side stream, ordered after and before the device's current stream (also
        when it raises: what it launched must finish before the caller undoes anything)."""
        with self.on_device():
            main = torch.cuda.current_stream()
            self.stream.wait_stream(main)
            try:
                with torch.cuda.stream(self.stream):
                    return fn()
            finally:
                main.wait_stream(self.stream)


class LayerGraphs:
    """The captured decode-attention pieces of every sparse layer over one `TieredBlockStore`.

    Args:
        store: the store whose pools and tables the pieces hold by address.
        capture: the capturing side (`PieceCapture` on CUDA; None builds one).
        max_pieces: pieces kept; past it the least recently replayed one is dropped.
    """

    def __init__(self, store: Any, capture: Any | None = None, max_pieces: int = DEFAULT_MAX_PIECES) -> None:
        self.store = store
        self.capture = capture if capture is not None else PieceCapture(store.device)
        self.max_pieces = max_pieces
        self.num_captures = 0
        self.enabled = True  # False once a capture failed: every call then runs eagerly
        self._pieces: OrderedDict[tuple, _Piece] = OrderedDict()
        self._state: tuple | None = None

    def attend(self, layer: Any, query: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`attend(query)` for `layer`, (B, Hq, D) -> (B, Hq, D), as a replay once captured.

        `attend` must be the layer's selection and sparse attention at fixed shapes with no host
        sync. The output of a replay is the piece's static buffer: the layer's next call
        overwrites it, so it is to be consumed before then (the model's output projection does).
        """
        if not self.enabled:
            return attend(query)
        key = (layer.layer_idx, tuple(query.shape), query.dtype, layer.block_ids.shape[2])
        piece = self._pieces.get(key)
        if piece is not None:
            self.store.prepare_fetch(piece.selection_shape)  # may grow an unlimited cache (a new epoch)
        self._check_store()
        piece = self._pieces.get(key)
        if piece is None or any(held is not now for held, now in zip(piece.rows, _rows(layer))):
            return self._capture(key, layer, query, attend)
        self._pieces.move_to_end(key)
        piece.query.copy_(query)
        with self.capture.on_device():
            piece.graph.replay()
        layer.last_pick = piece.pick  # a replay runs no Python: point the layer at what it wrote
        return piece.out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Calls inside run eagerly, capturing and replaying nothing (the pieces are kept): for a
        caller whose Python must run at every step, such as a selection override that records."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def drop(self) -> None:
        """Forget every piece (the next calls capture again, into fresh pools)."""
        self.capture.new_pools()
        self._pieces.clear()

    def _check_store(self) -> None:
        state = self.store.graph_state()
        if state != self._state:
            self.drop()
            self._state = state

    def _capture(
        self, key: tuple, layer: Any, query: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Run this call for real (its result), then capture it for the next ones.

        A capture that fails (out of memory, a kernel that cannot be captured) leaves no piece, a
        fresh pool for the layer (a half-made graph takes its pool with it) and pieces switched off
        for this store, with one warning: the call's result is the warm-up's, later calls run
        eagerly. A warm-up that fails is the step's own failure and propagates."""
        replaced = self._pieces.pop(key, None)  # alive until the capture: its pool must not be released
        static_query = query.clone()
        try:
            out = self.capture.warm_up(lambda: attend(static_query))  # a failure here is the step's own
        except BaseException:
            self.capture.forget_pool(layer.layer_idx)
            raise
        self._check_store()  # the warm-up may have grown an unlimited cache: older pieces are stale
        pick = layer.last_pick
        try:
            graph, static_out = self.capture.record(lambda: attend(static_query), layer.layer_idx)
        except Exception as exc:  # noqa: BLE001  the step itself ran (the warm-up): go on without pieces
            self.capture.forget_pool(layer.layer_idx)
            self._drop_layer(layer.layer_idx)
            self.enabled = False
            logger.warning("layer_graphs: capturing layer %d failed (%s); decoding without them", key[0], exc)
            layer.last_pick = pick
            return out
        rows = _rows(layer)
        piece = _Piece(graph, static_query, static_out, layer.last_pick, rows, tuple(layer.last_pick[0].shape))
        self._drop_layer(layer.layer_idx, keep_rows=rows)  # pieces of the layer's old rows never replay again
        while len(self._pieces) >= self.max_pieces:
            evicted, _ = self._pieces.popitem(last=False)
            if all(other[0] != evicted[0] for other in self._pieces) and evicted[0] != key[0]:
                self.capture.forget_pool(evicted[0])  # its last graph goes: PyTorch releases the pool
        self._pieces[key] = piece
        del replaced
        layer.last_pick = pick  # the warm-up's: the captured tensors hold nothing until a replay
        self.num_captures += 1
        return out

    def _drop_layer(self, layer_idx: int, keep_rows: tuple[torch.Tensor, ...] | None = None) -> None:
        """Forget the layer's pieces (those over other tensors than `keep_rows`, when given)."""
        for key in [k for k, p in self._pieces.items() if k[0] == layer_idx]:
            rows = self._pieces[key].rows
            if keep_rows is None or any(a is not b for a, b in zip(rows, keep_rows)):
                del self._pieces[key]


def _rows(layer: Any) -> tuple[torch.Tensor, ...]:
    return tuple(layer.graph_tensors().values())
