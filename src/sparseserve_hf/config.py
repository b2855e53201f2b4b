"""SparseServeConfig: the one frozen, validated configuration of sparseserve_hf."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from .scoring import SCORERS, SELECTIONS

METADATA_KINDS = tuple(SCORERS)
METADATA_DTYPES = ("auto", "kv", "float8_e4m3fn")
KV_DTYPES = ("auto", "float8_e4m3fn")
SELECTION_GRANULARITIES = tuple(SELECTIONS)
GROUP_AGGREGATIONS = ("max", "sum")
BACKENDS = ("auto", "torch", "triton", "flash")
PREFILL_MODES = ("layer_segmented", "chunked", "full")
TRANSFERS = ("kernel", "copy")
SAVE_PATHS = ("scatter", "flash_d2h")
INT_FIELDS = (
    "block_size",
    "token_budget",
    "load_budget",
    "sink_blocks",
    "window_blocks",
    "metadata_sub_blocks",
    "hbm_cache_bytes",
    "dram_bytes",
    "max_batch",
    "max_batch_tokens",
    "working_set_window",
    "max_inject_tokens",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SparseServeConfig:
    """How the tiered KV cache stores blocks and how sparse decode selects them.

    Attributes:
        block_size: tokens per KV block (a power of two). One head-block is
            `block_size x head_dim` keys plus as many values, for one KV head.
        token_budget: tokens each KV head loads and attends at decode with the default
            `selection="kv_head"`, counting the sink, window and top-k blocks and the partial
            tail block. With "group_union" or "query_head" it is each query head's pick, and a
            KV head loads the union of its group's picks (up to G x this).
        sink_blocks: leading blocks always selected (attention sinks).
        window_blocks: most recent full blocks always selected (the partial tail block
            is always attended on top of these).
        dense_layers: layer indices that keep all their KV in device memory and attend
            densely (no offload, no selection). Any sequence of non-negative ints (a list, a
            tuple, a range); stored as a sorted tuple without repeats.
        metadata: per-block summary used to score blocks: "quest" (per-channel key
            min/max, an upper bound on q.k), "cuboid" (per-channel key mean, ArkVale) or
            "hybrid" (the block's quest min/max plus the cuboid mean of each sub-block; the
            two rankings interleaved: Quest keeps diffuse layers' mass, the sub-block means find
            the few tokens a retrieval head reads): on the real model it keeps more of dense's
            accuracy than either alone, for 3x quest's metadata vectors.
            "channels" (the default): each block keeps a 2-bit copy of the `channel_share` of its keys' channels
            where its keys spread most, weighted by the size of recent prompts' queries (whole RoPE
            pairs, with a minimum and a step per channel, `ops.channels`); each step estimates every
            query head's attention over every token from them and scores a block by that estimate's
            mass on it. Token-level, so a needle is not averaged into its block; with the default
            `selection="kv_head"` and `group_aggregation="sum"` each KV head loads the blocks of most
            estimated attention of its group, exactly the budget: at a sixteenth of the context
            loaded it keeps far more of dense's accuracy than the block summaries. Stored in 8 bits on every device
            (`metadata_dtype` "auto" or "float8_e4m3fn"); at the default share and 32-token blocks,
            4 rows of head_dim bytes per block: 1/32 of 16-bit KV.
        metadata_sub_blocks: summaries per block (a power of two dividing block_size): Quest
            min/max or cuboid mean per block_size // metadata_sub_blocks tokens, the block
            scoring the max over its sub-blocks. Blocks are still loaded and attended whole;
            only the metadata grows (x metadata_sub_blocks). 1 = one summary per block.
            None (default) = the kind's default, read through `sub_blocks`: 4 for "hybrid" (a
            cuboid mean per 8 tokens of a 32-token block; capped at block_size), 1 for "quest"
            and "cuboid" (so `dataclasses.replace(config, metadata="quest")` is plain Quest).
        metadata_dtype: how the metadata is stored (it lives in device memory for every block,
            and every decode step reads all of it): "float8_e4m3fn" (one byte per value, rounded
            to nearest, saturated at +-448; blocks and attention are unchanged, only the scores
            see the rounding), "kv" (the KV cache's dtype) or "auto" (the default: float8_e4m3fn
            on the CPU and on CUDA GPUs of compute capability 8.9 or newer, whose kernels convert
            it natively; "kv" on older GPUs; with metadata="channels" float8_e4m3fn everywhere, its
            kernel decoding the 8-bit values from their bits where the GPU cannot). 8-bit metadata
            halves that memory and read against
            16-bit KV (docs/metadata.md measures what the rounding costs in selection).
        channel_share: metadata="channels" only: the share of head_dim's channels each block keeps
            and each decode step reads (rounded down to whole RoPE pairs, at least one pair).
        channel_feedback: metadata="channels" only: each decode step's attention also writes its
            exact log-sum-exp over every block it attended (per query head), and the next step's
            channel estimate of those blocks is raised to it where lower (`ops.channels.with_feedback`):
            no byte more is read. None (the default) = on for channel metadata wherever the decode
            attention writes those numbers (every backend but "flash"); read it through `feeds_back`.
        kv_dtype: how full blocks are stored, in DRAM and in the HBM block cache: "auto" (the
            default: the model's dtype, exactly) or "float8_e4m3fn" (one byte per value, each
            head-block's keys and its values scaled by their own fp32 scale so that their largest
            magnitude is 448): half the DRAM, PCIe bytes and HBM cache of 16-bit KV. Attention
            dequantizes inside its kernel (and the dense past is dequantized when read back);
            block metadata is computed from the unrounded keys; tail blocks keep the model's
            dtype. Not with backend="flash" (fa4's paged kernel reads the pool as it is).
        selection: "query_head" (every query head selects its own blocks; a KV head
            loads the union of its group's selections), "group_union" (the same selections,
            but every query head attends to the whole union its KV head loaded: no more
            transfers, up to G x the attention work) or "kv_head" (one selection per
            KV head from its query heads' scores, aggregated by `group_aggregation`: the
            default, it loads exactly `token_budget`). At the same nominal budget "group_union"
            keeps more needles, for 1.5-3x the loads; at the same loads one pick per KV head of
            the summed channel estimates keeps the most.
        group_aggregation: "sum" (the default) or "max", how query-head scores combine for
            "kv_head".
        load_budget: "group_union" only: tokens each KV head loads per decode step at most,
            counted as `token_budget` is (full blocks plus the tail block). Where the union of
            its query heads' picks is larger, the KV head loads the union of each head's k best
            blocks for the largest k whose union fits (every head's sink and window blocks
            first): the per-head ranking is kept, its tail cut evenly. It bounds what one row can
            ask of an HBM cache partition, so a cache serves rows by this load instead of the
            union's worst case, G x `token_budget`. At least `token_budget`; None = no cap.
        hbm_cache_bytes: bytes of the device block cache, split evenly into one LRU partition
            per (sparse layer, KV head), each shared by all requests. None = unlimited: no
            selected block is ever evicted.
        dram_bytes: bytes of the block pool (host DRAM; device memory with offload=False).
            None = grow on demand.
        backend: "auto" ("triton" on CUDA when triton is installed, else "torch"), "torch"
            (the plain-PyTorch reference), "triton" (Triton kernels) or "flash" (the Triton
            kernels with decode attention on flash-attn-4's paged kernel: fp16/bf16 on a Hopper
            or datacenter Blackwell GPU, `pip install 'sparseserve_hf[flash]'`).
        max_batch: most requests one `Generator` iteration decodes (the paper's R_max).
        max_batch_tokens: most tokens one `Generator` iteration processes (T_max): one per
            decoding request, the rest (times the number of layers) is the iteration's prefill
            work in token-layers. None = no cap (prefill then bounded only by the prefill mode).
        working_set_window: decode steps whose block selections make up a request's working
            set (w; 12 in the paper: the overlap with the next step barely grows past it).
        admission: working-set-aware admission (the paper's Algorithm 1): a request joins an
            iteration only while the working sets admitted so far plus its own fit in
            `hbm_cache_bytes`. False turns it off (the ablation); hard limits still apply.
        reserve_decode: admission starts a waiting request only while the requests in flight
            (decoding, sitting out or prefilling) leave it a decode row and their decode working
            sets (the first estimate for those not decoding yet) plus its own fit in
            `hbm_cache_bytes`, so that a prefilled request decodes next to the older ones instead
            of waiting, after its first token, for one of them to end. False: a request starts
            once its prefill working set fits (the paper's rule: under saturation its first token
            can come seconds before its second). The first request in flight always starts.
        prefill_mode: how the `Generator` prefills a new prompt: "layer_segmented" (the
            paper's: a segment of decoder layers per iteration over the whole prompt, each
            layer's KV leaving HBM before the next layer runs), "chunked" (chunks of the prompt,
            each through all layers, earlier chunks' KV read back) or "full" (the whole prompt
            through all layers in one iteration). The last two are the ablation baselines.
        max_inject_tokens: prefill work per iteration in token-layers (the paper's
            maxInjectToken; B x num_layers does the work of one B-token chunk). Same unit in
            every mode so that switching `prefill_mode` alone is a fair ablation:
            "layer_segmented" splits a layer whose prompt exceeds it into chunks, "chunked"
            uses chunks of max_inject_tokens // num_layers tokens. None = no cap.
        target_tbt_ms: `Generator`: the time between a decoding row's tokens that prefill work
            beside decoding rows is sized to (milliseconds). Each iteration with decoding rows
            runs the token-layers of prefill that fit the target beside its decode step, from
            times measured as it serves (`generation.pacing.PrefillPacer`). A layer of a prompt too
            long for that room is split into chunks that fit it (layer_segmented; none below
            `generation.prefill.PACED_MIN_CHUNK_TOKENS`, 4,096 tokens: each chunk reads its layer's
            earlier chunks back); the iteration's first unit of prefill always runs, so prompts
            progress. None = prefill work is not paced (only `max_inject_tokens` / `max_batch_tokens`).
        offload: True keeps every full block in (pinned) host DRAM and only an LRU cache of
            selected blocks on the device. False is the "sparse attention without offload"
            ablation: the block pool itself lives in device memory (sized by `dram_bytes`),
            selection and sparse attention are unchanged, nothing crosses PCIe (every lookup
            hits, no H2D bytes) and `stats()` counts those blocks as HBM. There is no separate
            block cache then, so `hbm_cache_bytes` must be None and `save_path` "scatter".
        transfer: how blocks move between the tiers: "kernel" (the backend's gather/scatter:
            FlashH2D and a UVA scatter with Triton, index copies with the torch reference) or
            "copy" (one `copy_` per block, the paper's per-block cudaMemcpy baseline, far below
            PCIe bandwidth at 16 KiB blocks). "copy" saves through it too, so it needs
            `save_path="scatter"`.
        save_path: how new full blocks reach DRAM with transfer="kernel": "scatter" (one
            GPU-direct UVA scatter launch, close to bulk D2H bandwidth) or "flash_d2h" (the paper's
            FlashD2H: one contiguous D2H copy into pinned staging, CPU threads scatter it; slower,
            as the CPU scatter bounds it).
        cuda_graphs: whether the `Generator`'s decode step (`graph.StaticDecoder`'s static
            step, the one step every decode of the engine runs) is replayed as a captured CUDA
            graph instead of launching ~100 kernels per layer from Python. True needs a CUDA
            model, the "triton" or "flash" backend and `transfer="kernel"` (checked; on CPU True
            runs the same step eagerly). None (the default) captures wherever it can (those, and
            one process: not tensor parallel), eagerly elsewhere; False runs the step eagerly
            (an ablation). It captures once per batch size and table width and copies changed
            rows into the captured tensors; a captured step holds every pool by address, so a
            pool that grows (`dram_bytes` or `hbm_cache_bytes` None) is captured again after it
            moved: fixed sizes capture once.
        layer_graphs: eager decode steps of `model.generate` over a cache built from a config
            (which has no model to replay whole) on CUDA with the "triton" or "flash" backend and
            transfer="kernel" replay each sparse layer's decode attention as a CUDA graph
            (`layer_graphs.LayerGraphs`): one launch per layer instead of ~20, the rest of the
            model eager. Captured per (layer, rows, table width) at the first step of each and
            again when the layer's rows change. No effect elsewhere. A capture that fails switches
            it off for the store, with a warning.
        decode_ahead: the `Generator` launches the next decode step before reading the current
            one's tokens back, where the next iteration would decode the same rows and nothing
            else (the scheduler, on working sets one step old, keeps the same rows and starts or
            continues no prefill; no row ends by length; one process, no prefix cache): the
            host's work between steps and the launch of a captured step then overlap the
            device's work. A row that a stop token ends decodes one token more, dropped; a
            request submitted meanwhile waits one iteration more. Tokens are the same either
            way.
        generate_graphs: a cache built from the model itself (`SparseServeCache(model, ...)`) runs
            each decode step of `model.generate` as the `Generator`'s step
            (`generate_graphs.GenerateGraphs`): one CUDA graph of the whole model on CUDA with the
            "triton" or "flash" backend and transfer="kernel", the same step eagerly elsewhere.
            Needs every layer sparse (no `dense_layers`, no sliding-window layers); forwards the
            step does not compute exactly (the prefill, hidden states asked for, a padded new
            token) run the model's own forward. No effect on a cache built from a config.
        fused_rope: a decode step that runs as one CUDA graph (`cuda_graphs`, `generate_graphs`)
            with the "triton" or "flash" backend rotates q and k with one fused kernel per layer
            (`fused_ops`) instead of eager PyTorch's ten, bit for bit the model's own rotary
            embedding (Llama's, and the families that copy it). An ablation switch: off only
            to measure what it saves.
        fused_norms: a decode step that runs as one CUDA graph (`cuda_graphs`, `generate_graphs`)
            runs the model's RMSNorms (Llama's, and the families that copy it) as one fused kernel
            each instead of eager PyTorch's eight small ones, bit for bit the model's own norm on
            a GPU (the mean square's additions in the order PyTorch's CUDA reduction makes them).
            Checked once against the model's norm like `fused_rope`. The residual add before each
            norm joins its launch (in a decoder layer whose forward is Llama's), checked the same
            way. An ablation switch. Outside the captured step the model runs its own norms.
        fused_activation: a decode step that runs as one CUDA graph (`cuda_graphs`, `generate_graphs`)
            with the "triton" or "flash" backend computes the MLP's `silu(gate) * up` (Llama's MLP,
            and the families that copy it) as one kernel instead of two, bit for bit the model's
            own; checked once like `fused_norms`. An ablation switch.
        projections_beside: a decode step that runs as one CUDA graph (`cuda_graphs`,
            `generate_graphs`) on CUDA runs the attention's k and v projections on a second CUDA
            stream beside q's (Llama's attention, and the families that copy it), and with
            `fused_activation` the MLP's up projection beside its gate's: the same kernels on the
            same inputs, bit for bit; checked once like `fused_norms`. An ablation switch.
        lookup_beside_attention: with offload and the "torch" or "triton" backend, a decode step
            attends the blocks already in the HBM cache (and the tails) while the lookup (LRU
            update, victims) and the copy of the misses run beside it on a second CUDA stream, then
            attends the misses and merges both halves (`ops.begin_decode`): the lookup leaves the
            critical path. The same attention up to the order of float additions. An ablation
            switch.
        prefix_caching: the `Generator` keeps the full KV blocks of earlier requests' prompts (and
            their outputs) in the DRAM pool, addressed by the tokens before and in each block
            (`cache.prefix_index`), and a new request whose prompt starts with cached blocks
            adopts them and prefills only the rest: many questions over one document cost one
            prefill of it. Cached blocks live only in pool room no request needs: a save that
            lacks room drops the least recently used ones first, never one a live request holds.
            Needs every layer sparse (no `dense_layers`).
    """

    block_size: int = 32
    token_budget: int = 2048
    sink_blocks: int = 1
    window_blocks: int = 1
    dense_layers: tuple[int, ...] = ()
    metadata: str = "channels"
    metadata_sub_blocks: int | None = None
    metadata_dtype: str = "auto"
    channel_share: float = 0.375
    channel_feedback: bool | None = None
    kv_dtype: str = "auto"
    selection: str = "kv_head"
    group_aggregation: str = "sum"
    load_budget: int | None = None
    hbm_cache_bytes: int | None = None
    dram_bytes: int | None = None
    backend: str = "auto"
    max_batch: int = 32
    max_batch_tokens: int | None = None
    working_set_window: int = 12
    admission: bool = True
    reserve_decode: bool = True
    prefill_mode: str = "layer_segmented"
    max_inject_tokens: int | None = None
    target_tbt_ms: float | None = None
    offload: bool = True
    transfer: str = "kernel"
    save_path: str = "scatter"
    cuda_graphs: bool | None = None
    layer_graphs: bool = True
    generate_graphs: bool = True
    decode_ahead: bool = True
    prefix_caching: bool = False
    fused_rope: bool = True
    fused_norms: bool = True
    fused_activation: bool = True
    projections_beside: bool = True
    lookup_beside_attention: bool = True

    def __post_init__(self) -> None:
        for name in INT_FIELDS:  # numpy and other integral types become plain ints (JSON, hashing)
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        _check_positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_positive_int("token_budget", self.token_budget)
        if self.token_budget < self.block_size:
            raise ValueError(
                f"token_budget ({self.token_budget}) is smaller than one block (block_size={self.block_size})"
            )
        _check_non_negative_int("sink_blocks", self.sink_blocks)
        _check_non_negative_int("window_blocks", self.window_blocks)
        if self.budget_blocks < self.sink_blocks + self.window_blocks + 1:
            raise ValueError(
                f"token_budget ({self.token_budget}) holds {self.budget_blocks} blocks, fewer than sink_blocks "
                f"({self.sink_blocks}) + window_blocks ({self.window_blocks}) + the tail block"
            )
        object.__setattr__(self, "dense_layers", _layer_indices("dense_layers", self.dense_layers))
        _check_choice("metadata", self.metadata, METADATA_KINDS)
        _check_choice("metadata_dtype", self.metadata_dtype, METADATA_DTYPES)
        if not isinstance(self.channel_share, numbers.Real) or not 0 < self.channel_share <= 1:
            raise ValueError(f"channel_share must be a number in (0, 1], got {self.channel_share!r}")
        SCORERS[self.metadata].check(self)
        if self.channel_feedback is not None:
            _check_bool("channel_feedback", self.channel_feedback)
        if self.channel_feedback and self.metadata != "channels":
            raise ValueError(f"channel_feedback applies to metadata='channels', not {self.metadata!r}")
        if self.channel_feedback and self.backend == "flash":
            raise NotImplementedError(
                "channel_feedback needs the Triton or torch decode attention (it writes each block's "
                "log-sum-exp): use backend='auto' or 'triton'"
            )
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        if self.kv_dtype != "auto" and self.backend == "flash":
            raise NotImplementedError(
                f"kv_dtype={self.kv_dtype!r} needs the Triton or torch decode attention (it dequantizes "
                "each block); flash-attn-4's paged kernel reads the pool as stored: use backend='auto' or 'triton'"
            )
        _check_choice("selection", self.selection, SELECTION_GRANULARITIES)
        _check_choice("group_aggregation", self.group_aggregation, GROUP_AGGREGATIONS)
        self._check_load_budget()
        _check_choice("backend", self.backend, BACKENDS)
        for name in ("hbm_cache_bytes", "dram_bytes"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        _check_positive_int("max_batch", self.max_batch)
        if self.max_batch_tokens is not None:
            _check_positive_int("max_batch_tokens", self.max_batch_tokens)
            if self.max_batch_tokens <= self.max_batch:
                raise ValueError(
                    f"max_batch_tokens ({self.max_batch_tokens}) must exceed max_batch ({self.max_batch}), "
                    "or a full batch of decodes would leave no tokens for prefill"
                )
        _check_positive_int("working_set_window", self.working_set_window)
        _check_bool("admission", self.admission)
        _check_bool("reserve_decode", self.reserve_decode)
        _check_choice("prefill_mode", self.prefill_mode, PREFILL_MODES)
        if self.max_inject_tokens is not None:
            _check_positive_int("max_inject_tokens", self.max_inject_tokens)
        if self.target_tbt_ms is not None and (
            not isinstance(self.target_tbt_ms, numbers.Real)
            or isinstance(self.target_tbt_ms, bool)
            or not 0 < self.target_tbt_ms < math.inf
        ):
            raise ValueError(f"target_tbt_ms must be a positive number of milliseconds, got {self.target_tbt_ms!r}")
        self._check_transfer_fields()
        self._check_graph_fields()
        _check_bool("prefix_caching", self.prefix_caching)
        if self.prefix_caching and self.dense_layers:
            raise ValueError(
                f"prefix_caching=True shares blocks in the DRAM pool, which dense_layers {list(self.dense_layers)} never "
                "write: use dense_layers=()"
            )

    def _check_load_budget(self) -> None:
        if self.load_budget is None:
            return
        _check_positive_int("load_budget", self.load_budget)
        if self.selection != "group_union":
            raise ValueError(
                f"load_budget caps the union a KV head loads for selection='group_union', got selection={self.selection!r}"
            )
        if self.load_budget < self.token_budget:
            raise ValueError(
                f"load_budget ({self.load_budget}) is below token_budget ({self.token_budget}): a KV head loads at "
                "least one query head's whole selection"
            )

    def _check_transfer_fields(self) -> None:
        _check_bool("offload", self.offload)
        _check_choice("transfer", self.transfer, TRANSFERS)
        _check_choice("save_path", self.save_path, SAVE_PATHS)
        if not self.offload and self.hbm_cache_bytes is not None:
            raise ValueError(
                f"hbm_cache_bytes must be None with offload=False (got {self.hbm_cache_bytes}): every block "
                "already lives in device memory, there is no block cache to size; size the pool with dram_bytes"
            )
        if self.save_path == "flash_d2h" and not self.offload:
            raise ValueError("save_path='flash_d2h' stages saves in host memory; with offload=False use 'scatter'")
        if self.save_path == "flash_d2h" and self.transfer == "copy":
            raise ValueError(
                "save_path='flash_d2h' is a kernel save path, but transfer='copy' saves with one copy_ per block: "
                "use save_path='scatter'"
            )

    def _check_graph_fields(self) -> None:
        if self.cuda_graphs is not None:
            _check_bool("cuda_graphs", self.cuda_graphs)
        _check_bool("layer_graphs", self.layer_graphs)
        _check_bool("generate_graphs", self.generate_graphs)
        _check_bool("decode_ahead", self.decode_ahead)
        _check_bool("fused_rope", self.fused_rope)
        _check_bool("fused_norms", self.fused_norms)
        _check_bool("fused_activation", self.fused_activation)
        _check_bool("projections_beside", self.projections_beside)
        _check_bool("lookup_beside_attention", self.lookup_beside_attention)
        if self.cuda_graphs is not True:  # None decides per engine: off wherever a capture cannot follow
            return
        needs = []  # pools may grow (captured again when they move); these a captured step cannot follow
        if self.transfer != "kernel":
            needs.append("transfer='kernel' (transfer='copy' reads ids back to the host)")
        if self.dense_layers:
            needs.append("no dense_layers (their KV grows with torch.cat)")
        if needs:
            raise ValueError(f"cuda_graphs=True needs {'; '.join(needs)}")

    @property
    def feeds_back(self) -> bool:
        """Whether decode steps raise the channel estimates of the blocks they attended to their exact
        log-sum-exps (`channel_feedback`, resolved: None is on for channel metadata on every backend
        but "flash")."""
        if self.channel_feedback is not None:
            return self.channel_feedback
        return self.metadata == "channels" and self.backend != "flash"

    @property
    def budget_blocks(self) -> int:
        """Blocks of `token_budget` (what a KV head attends at decode; with the group union, each query
        head), the partial tail block included."""
        return self.token_budget // self.block_size

    @property
    def selected_full_blocks(self) -> int:
        """Full blocks selected per query head (or KV head): sink + window + top-k."""
        return self.budget_blocks - 1

    @property
    def load_blocks(self) -> int | None:
        """Full blocks a KV head loads per decode step at most (`load_budget`); None = no cap."""
        return None if self.load_budget is None else self.load_budget // self.block_size - 1

    @property
    def topk_blocks(self) -> int:
        """Full blocks chosen by score, on top of the always-kept sink and window blocks."""
        return self.selected_full_blocks - self.sink_blocks - self.window_blocks

    @property
    def sub_blocks(self) -> int:
        """Summaries per block: `metadata_sub_blocks`, or the metadata kind's default when it is None."""
        if self.metadata_sub_blocks is not None:
            return self.metadata_sub_blocks
        return SCORERS[self.metadata].default_sub_blocks(self.block_size)

    @property
    def metadata_vectors(self) -> int:
        """Metadata rows (each head_dim wide) per block, as the metadata kind lays them out
        (`scoring.SCORERS`): 2 (min, max) or 1 (mean) per sub-block; "hybrid" one min/max pair and a
        mean per sub-block; "channels" the packed 2-bit codes' rows, then the stored channels, minima and steps."""
        return SCORERS[self.metadata].metadata_rows(self)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, ready for `json.dumps` (`dense_layers` goes out as a list)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SparseServeConfig:
        """Inverse of `to_dict` (lists from JSON are fine); unknown keys raise ValueError, not ignored."""
        if not isinstance(values, Mapping):
            raise TypeError(f"from_dict takes a mapping of field names to values, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown SparseServeConfig fields: {unknown}; known: {sorted(known)}")
        return cls(**values)  # dense_layers from JSON is a list: accepted as any sequence


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):  # a ValueError like every other bad field, not a TypeError
        raise ValueError(f"{name} must be a bool, got {value!r}")  # noqa: TRY004


def _check_non_negative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:  # str first: `in` on an array compares elementwise
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _layer_indices(name: str, value: object) -> tuple[int, ...]:
    """`value` as a sorted tuple of distinct non-negative ints; ValueError naming `name` otherwise.

    Any sequence is fine (a list from JSON or a caller, a tuple, a range): they all mean a set of
    layers. A str is refused (a sequence, but of characters), and so are bools (ints in Python).
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)):
        raise ValueError(f"{name} must be a sequence of non-negative ints, got {value!r}")  # noqa: TRY004  as every field
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f"{name} must be a sequence of non-negative ints, got {value!r}")
    return tuple(sorted({int(i) for i in value}))
