"""A CPU stand-in for `graph.CudaGraphs` that does to state what a real CUDA graph does."""

from __future__ import annotations

import contextlib
import weakref

import torch

from sparseserve_hf.graph import StaticDecoder


class FakeGraphs:
    """CPU stand-in for `graph.CudaGraphs`, with what a real graph does to state.

    A capture runs the step's Python but no kernel: it runs on the state before the warm-up (so
    that, as on a GPU, no kernel ever sees the warmed-up state twice, e.g. a tail the warm-up
    filled) and every tensor is put back to the warmed-up state afterwards. A replay
    runs the kernels but no Python: Python counters are put back afterwards, and it refuses to
    run once a tensor it holds has moved (a real graph would read the old address).
    """

    def __init__(self, decoder: StaticDecoder) -> None:
        self.decoder = decoder
        self.pool: weakref.WeakSet | None = None  # the graphs captured into the current pool

    def new_pool(self) -> None:
        self.pool = None

    def warm_up(self, fn):
        self._before_warm_up = {name: (t, t.clone()) for name, t in self._tensors().items()}
        return fn()

    def record(self, fn):
        # Like PyTorch: a pool whose graphs are all gone is released, and capturing into it asserts.
        assert self.pool is None or len(self.pool) > 0, "captured into a released graph pool"
        tensors = self._tensors()
        saved = [t.clone() for t in tensors.values()]
        for name, (t, value) in self._before_warm_up.items():
            if tensors.get(name) is t:  # one the warm-up allocated (a pool it grew) starts as it left it
                t.copy_(value)
        out = fn()
        for t, value in zip(tensors.values(), saved):
            t.copy_(value)
        self.pool = weakref.WeakSet() if self.pool is None else self.pool
        # No kernel ran: what the capture produced holds nothing yet (here: zeros) until a replay.
        out.zero_()
        for layer in self.decoder.layers:
            for t in layer.last_pick or ():
                if isinstance(t, torch.Tensor):
                    t.zero_()
        graph = FakeGraph(self, fn, out, {name: t.data_ptr() for name, t in tensors.items()})
        graph.picks = [layer.last_pick for layer in self.decoder.layers]  # outputs a replay writes into
        self.pool.add(graph)
        return graph, out

    def _tensors(self) -> dict[str, torch.Tensor]:
        return self.decoder.cache.graph_tensors() | {"ids": self.decoder._ids, "positions": self.decoder._positions}


class FakeGraph:
    def __init__(self, graphs: FakeGraphs, fn, out: torch.Tensor, held: dict[str, int]) -> None:
        self.graphs, self.fn, self.out, self.held = graphs, fn, out, held
        self.replays = 0

    def replay(self) -> None:
        moved = [name for name, t in self.graphs._tensors().items() if t.data_ptr() != self.held[name]]
        assert not moved, f"replayed a graph whose tensors moved: {moved}"
        layers = self.graphs.decoder.layers
        counters = [(layer.num_positions, layer._known_counts, layer.last_pick) for layer in layers]
        self.out.copy_(self.fn())
        for layer, static in zip(layers, self.picks):  # kernels write the captured outputs in place
            for fresh, held in zip(layer.last_pick, static):
                if isinstance(held, torch.Tensor):
                    held.copy_(fresh)
        for layer, (positions, known, pick) in zip(layers, counters):  # no Python ran
            layer.num_positions, layer._known_counts, layer.last_pick = positions, known, pick
        self.replays += 1


class FakePieceCapture:
    """CPU stand-in for `layer_graphs.PieceCapture`, with what a real capture and replay do to state.

    Like `FakeGraphs`, but for one layer's attention piece: a capture runs the piece's Python on
    the state before its warm-up (the store's and the layers' tensors) and then puts the warmed-up
    state back, and its outputs hold nothing (zeros) until a replay; a replay runs the piece again
    (the kernels), writes into the captured outputs, and refuses to run once a store tensor or a
    tensor of its layer that it holds has moved.
    """

    def __init__(self, cache) -> None:
        self.cache = cache
        self.pools = 1
        self.replays = 0
        self.live: dict[int, weakref.WeakSet] = {}  # per layer: the pieces captured into its pool

    def new_pools(self) -> None:
        self.pools += 1
        self.live = {}

    def forget_pool(self, layer_idx: int) -> None:
        self.live.pop(layer_idx, None)

    def on_device(self):
        return contextlib.nullcontext()

    def warm_up(self, fn):
        self._before_warm_up = {name: (t, t.clone()) for name, t in self._tensors().items()}
        return fn()

    def record(self, fn, layer_idx: int):
        # Like PyTorch: a pool whose graphs are all gone is released, and capturing into it asserts.
        pool = self.live.get(layer_idx)
        assert pool is None or len(pool) > 0, f"captured into the released pool of layer {layer_idx}"
        tensors = self._tensors()
        saved = [t.clone() for t in tensors.values()]
        for name, (t, value) in self._before_warm_up.items():
            if tensors.get(name) is t:  # one the warm-up allocated (a pool it grew) starts as it left it
                t.copy_(value)
        picks = [id(layer.last_pick) for layer in self.cache.layers]
        out = fn()
        layer = next(lay for lay, pick in zip(self.cache.layers, picks) if id(getattr(lay, "last_pick", None)) != pick)
        for t, value in zip(tensors.values(), saved):
            t.copy_(value)
        out.zero_()
        for t in layer.last_pick:
            if isinstance(t, torch.Tensor):
                t.zero_()
        held = {n: t.data_ptr() for n, t in self._tensors(layer).items()}
        piece = FakePiece(self, fn, out, layer, layer.last_pick, held)
        self.live.setdefault(layer_idx, weakref.WeakSet()).add(piece)
        return piece, out

    def _tensors(self, layer=None) -> dict[str, torch.Tensor]:
        """The store's tensors and every layer's (the channel feedback a piece writes is the layer's), or
        only `layer`'s beside the store's: what one layer's piece holds."""
        if layer is None:
            return self.cache.graph_tensors()
        return {f"store.{n}": t for n, t in self.cache.store.graph_tensors().items()} | {
            f"layer.{n}": t for n, t in layer.graph_tensors().items()
        }


class FakePiece:
    def __init__(self, capture: FakePieceCapture, fn, out, layer, pick, held: dict[str, int]) -> None:
        self.capture, self.fn, self.out, self.layer, self.pick, self.held = capture, fn, out, layer, pick, held

    def replay(self) -> None:
        moved = [name for name, t in self.capture._tensors(self.layer).items() if t.data_ptr() != self.held.get(name)]
        assert not moved, f"replayed a piece whose store or layer tensors moved: {moved}"
        self.out.copy_(self.fn())
        for fresh, held in zip(self.layer.last_pick, self.pick):
            if isinstance(held, torch.Tensor):
                held.copy_(fresh)
        self.capture.replays += 1
