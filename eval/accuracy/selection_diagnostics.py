"""Why does sparse decode lose needles? Block-selection quality against the true attention, per layer and head.

For a few real RULER-style prompts this runs the default model densely: greedy answer tokens,
then one forward over prompt + answer that records every layer's post-RoPE queries (of the
decode positions) and keys. At each decode step, layer and query head it then compares the
blocks a selector picks (the package's own `ops.reference` score/select path and
`attention.pick_blocks`, so it measures exactly what the sparse path would attend) with the
oracle: the same number of full blocks, chosen by true attention mass of that query.

Reported, per selector variant (SparseServeConfig overrides) and budget:
- recall: attention mass of the attended full blocks / mass of the oracle's top blocks;
- attended: attention mass the sparse step keeps (attended blocks + tail); 1 - attended is what
  the sparse softmax drops;
- needle capture: of the attention the dense model puts on the needle's value tokens, the part
  that lies in attended blocks (summed over heads, so the heads that read the needle weigh most);
- per (layer, head): dense needle mass and whether the selection kept the needle's blocks.

Every variant is scored on the same recorded queries/keys, so one dense forward per prompt serves
all of them. Seeded (the RULER sample seed); the command line is recorded in the JSON.

    python -m eval.accuracy.selection_diagnostics --tasks niah_single_2,niah_single_1 --length 4096 \
        --samples 3 --budgets 256 --out eval/results/selection_diagnostics
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from eval.accuracy.oracle_attention import top_blocks
from eval.common import HYBRID_UNION
from eval.results_io import save_plot
from sparseserve_hf import SparseServeConfig
from sparseserve_hf.attention import pick_blocks
from sparseserve_hf.ops import reference

CAPTURE = "selection_diagnostics_capture"
# Selector variants: name -> overrides of BASE (token_budget from --budgets). "default" is BASE, the
# hybrid group union these diagnostics were written around (the package default until channel scores
# replaced it; channel variants set metadata="channels"); the others change one lever each (the quest
# ones: from the Quest selector that was the default when eval/results/selection_diagnostics.md was written).
BASE = SparseServeConfig(**HYBRID_UNION)
VARIANTS: dict[str, dict] = {
    "default": {},  # hybrid metadata with a cuboid mean per 8 tokens (= "hybrid_s8"), the group union
    "quest": dict(metadata="quest"),  # the default until the 8K accuracy runs (eval/results/accuracy.md)
    "query_head": dict(metadata="quest", selection="query_head"),
    "kv_head_max": dict(metadata="quest", selection="kv_head", group_aggregation="max"),
    "cuboid": dict(metadata="cuboid"),
    "sink2_window2": dict(metadata="quest", sink_blocks=2, window_blocks=2),
    # Finer metadata: "_s16" = one summary per 16 tokens (metadata_sub_blocks=2 at block_size 32), etc.
    "quest_s16": dict(metadata="quest", metadata_sub_blocks=2),
    "quest_s8": dict(metadata="quest", metadata_sub_blocks=4),
    "quest_s4": dict(metadata="quest", metadata_sub_blocks=8),
    "cuboid_s8": dict(metadata="cuboid", metadata_sub_blocks=4),
    "cuboid_s4": dict(metadata="cuboid", metadata_sub_blocks=8),
    "quest_s8_query_head": dict(metadata="quest", metadata_sub_blocks=4, selection="query_head"),
    "hybrid": dict(metadata="hybrid", metadata_sub_blocks=1),
    "hybrid_s8": dict(metadata="hybrid", metadata_sub_blocks=4),
    "hybrid_s4": dict(metadata="hybrid", metadata_sub_blocks=8),
    "block16": dict(block_size=16),  # finer blocks: 2x the blocks (and metadata) per budget
    # Metadata precision: "_kv" stores it in the KV dtype (bf16), the rest in 8 bits ("auto" on the CPU).
    "hybrid_s8_kv": dict(metadata="hybrid", metadata_sub_blocks=4, metadata_dtype="kv"),
    "hybrid_s16": dict(metadata="hybrid", metadata_sub_blocks=2),
    "hybrid_s16_kv": dict(metadata="hybrid", metadata_sub_blocks=2, metadata_dtype="kv"),
    "cuboid_s8_kv": dict(metadata="cuboid", metadata_sub_blocks=4, metadata_dtype="kv"),
    "quest_kv": dict(metadata="quest", metadata_dtype="kv"),
}
# Selectors that read the true attention (ceilings, not implementable): name -> how they pick.
# "oracle": per KV head, the top blocks by the group's summed attention mass (`oracle_blocks`),
# loading exactly the budget's blocks per KV head (selection="kv_head" accounting).
ORACLES = {"oracle"}
VARIANTS["oracle"] = dict(selection="kv_head")
# Selectors not in the package yet, built here from its metadata to measure them first.
# "mass_s8" / "mass_s4": per KV head, the blocks with the most *estimated* attention mass of the
# group (`estimated_mass_blocks`: each query head's softmax over the sub-block mean keys, scaled
# as the model scales its logits, summed per block and over the group); exactly the budget's
# blocks per KV head, as `selection="kv_head"` loads.
ESTIMATES = {"mass_s8", "mass_s4"}
VARIANTS["mass_s8"] = dict(metadata="cuboid", metadata_sub_blocks=4, selection="kv_head")
VARIANTS["mass_s4"] = dict(metadata="cuboid", metadata_sub_blocks=8, selection="kv_head")
# "twostage_q4": Quest (8-bit) over every block picks a quarter of them as candidates per KV head (the
# group's best bound); a 4-bit copy of the candidates' keys then estimates each query head's
# attention over them (`two_stage_blocks`); exactly the budget per KV head. Bytes read per step:
# 1/64 of the KV for Quest + a quarter of the blocks' 4-bit keys (1/8 of their K and V in bf16) = 3/64.
# "twostage_q4_half" keeps half of the blocks as candidates (1/64 + 1/32 of the KV read per step).
# "twostage_hybrid_q4": stage 1 ranks by the default's hybrid metadata instead (its bytes on top).
# Within the 1/32 metadata budget (8-bit stage-1 vectors + the candidates' key copies): "_quest_q4_8th"
# Quest (1/64) + an eighth of the blocks in 4 bits (1/64); "_quest_q2" Quest + a quarter in 2 bits;
# "_cuboid16_*" the same with two sub-block means (1/64) as stage 1; "_cuboid_q4" one mean (1/128)
# + 3/16 of the blocks in 4 bits (3/128).
TWO_STAGE = {  # variant -> (1 in this many blocks are candidates, key bits, stage-1 metadata)
    "twostage_q4": (4, 4, dict(metadata="quest")),
    "twostage_q4_half": (2, 4, dict(metadata="quest")),
    "twostage_hybrid_q4": (4, 4, dict(metadata="hybrid")),
    "twostage_quest_q4_8th": (8, 4, dict(metadata="quest")),
    "twostage_quest_q2": (4, 2, dict(metadata="quest")),
    "twostage_cuboid16_q4_8th": (8, 4, dict(metadata="cuboid", metadata_sub_blocks=2)),
    "twostage_cuboid16_q2": (4, 2, dict(metadata="cuboid", metadata_sub_blocks=2)),
    "twostage_cuboid_q4": (16 / 3, 4, dict(metadata="cuboid")),
}
ESTIMATES.update(TWO_STAGE)
for _name, (_share, _bits, _stage1) in TWO_STAGE.items():
    VARIANTS[_name] = dict(_stage1, selection="kv_head")
KEY_BITS = 4
# "channels_r{R}_q{B}": token-level scores from a few key channels (SparQ's idea, per KV head). A copy
# of every key in B bits per value, quantized per (block, channel) with a min and a scale (keys
# carry their outliers in a few channels), stored channel-major so that one channel of a block is
# contiguous. At each step the KV head reads the R channels where its group's queries are largest
# (summed |q| over the group), estimates each query head's attention over every token from them
# (the softmax temperature corrected for the |q| mass left out, as SparQ does) and loads the blocks
# of most estimated mass, exactly the budget. Read per step: R/D of the keys in B bits plus two
# 16-bit numbers per (block, channel read): at D = 64, R = 12 and 4 bits, 240 bytes per 8 KiB
# block-head (1/34 of the KV); at D = 128 (Llama-3-8B), R = 16 and 4 bits, 320 per 16 KiB (1/51).
CHANNEL_SCORES = {  # variant -> (channels read per KV head, bits per value)
    "channels_r8_q4": (8, 4),
    "channels_r12_q4": (12, 4),
    "channels_r16_q4": (16, 4),
    "channels_r16_q2": (16, 2),
    "channels_r16_q3": (16, 3),
    "channels_r20_q3": (20, 3),
    "channels_r24_q2_s8": (24, 2),  # min and scale in 8 bits: 192 + 48 bytes per 8 KiB block-head (2.9%)
    "channels_r24_q2": (24, 2),
    "channels_r32_q2_s8": (32, 2),
    "channels_r64_q2_s8": (64, 2),  # every channel of the default model's head_dim: what a read of whole blocks allows
    "channels_r24_q2_s8_pairs": (24, 2),
    "channels_r24_q2_s8_quads": (24, 2),
}
# "_pairs" / "_quads": the channels are chosen as whole RoPE rotation pairs (d, d + D/2), or as two
# neighbouring pairs, so that what a step reads is whole runs of stored bytes (a quad's 2-bit codes
# are 32 bytes, one memory sector) rather than single channels scattered over every sector.
CHANNEL_GROUPS = {"_pairs": 2, "_quads": 4}
# "twostage_channels_rR_Nth": the channel scores (R channels in 4 bits) as stage 1 of the two-stage
# selector, keeping 1 in N blocks as candidates for the 4-bit per-token re-score. Read per step at
# head_dim 64: R = 8 is 1.9% of the KV, a candidate block's 4-bit keys with per-token scales 14% of
# its KV: 2.8% in all with a 16th of the blocks, 3.7% with an 8th.
TWO_STAGE_CHANNELS = {  # variant -> (stage-1 channels, 1 in this many blocks re-scored)
    "twostage_channels_r8_16th": (8, 16),
    "twostage_channels_r8_8th": (8, 8),
    "twostage_channels_r12_16th": (12, 16),
}
CHANNEL_SCORES.update({name: (channels, 4) for name, (channels, _) in TWO_STAGE_CHANNELS.items()})
# "calib_{source}_p{P}[_r{R}]_q{B}": channel scores from P channels per (layer, KV head) chosen once per
# request, before decode, so that only those channels' codes are stored and every step reads exactly
# them (contiguous runs, no scattered channel reads; a per-step choice among all D channels reads whole
# sectors of every channel). At each step the R of them where the group's |q| is largest are used (R = P
# unless given). The choice, by RoPE rotation pair (d, d + D/2), whose summed magnitude a rotation keeps:
# "keys": mean |k| over the prompt's keys; "pq": mean |q| over the prompt's last PROMPT_QUERIES queries,
# summed over the group; "pqk": the product of the two per channel (an estimate of |q_d k_d|). "pq1":
# as "pq" by single channels. Min and scale per (block, channel) in 8 bits. Read per step at D = 64:
# P = 24 in 2 bits, 240 bytes per 8 KiB block-head (2.9%); P = 32, 320 (3.9%); P = 16 in 3 bits, 224 (2.7%).
CALIBRATED = {  # variant -> (source, channels stored P, channels used per step R)
    "calib_keys_p24_q2": ("keys", 24, 24),
    "calib_pq_p24_q2": ("pq", 24, 24),
    "calib_pqk_p24_q2": ("pqk", 24, 24),
    "calib_pq1_p24_q2": ("pq1", 24, 24),
    "calib_pqk_p32_q2": ("pqk", 32, 32),
    "calib_pqk_p32_r24_q2": ("pqk", 32, 24),
    "calib_pqk_p16_q3": ("pqk", 16, 16),
    "calib_pqk_p20_q3": ("pqk", 20, 20),
}
# "blockch_{source}_p{P}_q{B}": the P channels are chosen per block, when it fills, from its own keys
# (and stored with it: P bytes of channel numbers per block-head), so a block's metadata describes itself
# (a shared prefix needs no per-request state). "std": the block's per-channel standard deviation of
# keys (what tells its tokens apart); "stdq": that times the request's prompt-query |q| (as "pq" above);
# "abs", "absq": mean |k| instead of the deviation; "std1": by single channels, not RoPE pairs.
BLOCK_CHANNELS = {  # variant -> (source, channels stored P)
    "blockch_std_p24_q2": ("std", 24),
    "blockch_stdq_p24_q2": ("stdq", 24),
    "blockch_absq_p24_q2": ("absq", 24),
    "blockch_abs_p24_q2": ("abs", 24),
    "blockch_std1_p24_q2": ("std1", 24),
    "blockch_std_p32_q2": ("std", 32),
    "blockch_std_p16_q3": ("std", 16),
    "blockch_std_p16_q4": ("std", 16),
    "blockch_std_p12_q4": ("std", 12),
    "blockch_stdq_p32_q2": ("stdq", 32),
    "blockch_stdq_p16_q3": ("stdq", 16),
    "blockch_stdq1_p24_q2": ("stdq1", 24),
    "blockch_stdq_p32_q1": ("stdq", 32),
    "blockch_stdq_p40_q1": ("stdq", 40),
    "blockch_stdq_p20_q3": ("stdq", 20),
}
CHANNEL_SCORES.update({name: (stored, int(name[-1])) for name, (_, stored) in BLOCK_CHANNELS.items()})
CHANNEL_SCORES.update({name: (used, int(name[-1])) for name, (_, _, used) in CALIBRATED.items()})
ESTIMATES.update(CHANNEL_SCORES)
for _name in CHANNEL_SCORES:
    VARIANTS[_name] = dict(selection="kv_head")
VARIANTS["kv_head"] = dict(selection="kv_head")  # the default metadata, one pick per KV head (max over the group)
# One layer's exact attention chooses for the layers after it (TidalDecode, OmniKV): at every step, layer L
# scores every block by its true attention (reading all of that layer's keys: 1/(2 x layers) of the KV, the
# metadata this selector reads), and each later layer loads those blocks; the layers before L select with
# the default metadata, one pick per KV head. "pool": one set for every KV head (the mass of all of layer
# L's query heads summed); "head": KV head h of every later layer takes layer L's KV head h's set.
REUSED = {
    "reuse_l2_pool": (2, "pool"),
    "reuse_l4_pool": (4, "pool"),
    "reuse_l8_pool": (8, "pool"),
    "reuse_l4_head": (4, "head"),
    "reuse_l8_head": (8, "head"),
}
VARIANTS |= {name: dict(selection="kv_head") for name in REUSED}


def _derive(name: str, base: str) -> None:
    """Register variant `name`, built on `base`: its config and, for a block-channel base, its channels."""
    VARIANTS[name] = VARIANTS[base]
    if base in ORACLES:
        ORACLES.add(name)
        return
    BLOCK_CHANNELS[name] = BLOCK_CHANNELS[base]
    CHANNEL_SCORES[name] = CHANNEL_SCORES[base]
    ESTIMATES.add(name)


# "{oracle or block-channel variant}_pooled{C}": a layer's KV heads share one budget (Twilight's and
# top-p's point: heads need different numbers of blocks). Each KV head keeps its sink and window; the
# rest, Hkv x (the budget's blocks - those), go to the (KV head, block) pairs of most group mass (true or
# estimated) across the layer, at most C x one head's share to any head (what its HBM partition must
# hold). The same tokens loaded per layer as a fixed per-head budget, spent where the attention is.
_BLOCK_CHANNEL_BASES = list(BLOCK_CHANNELS)  # the variants the two modifiers below apply to
POOLED = {f"{base}_pooled{cap}": (base, cap) for base in ("oracle", *_BLOCK_CHANNEL_BASES) for cap in (2, 4)}
# "{block-channel variant}_fb{max,exact}": the last step's exact attention feeds this step's choice. The
# attention of step t - 1 ran exactly over the blocks it loaded, so their true mass then is known; at
# step t a block loaded at t - 1 scores the larger of its estimate and that mass ("max"), or that mass
# alone ("exact"); the other blocks keep their estimates. (Idealized: the mass is normalized over the
# whole context, which a sparse step can only approximate with the estimate's normalizer.)
# "_fblse": what a sparse step can do: the estimate's per-block log-sum-exp, where the block was loaded at
# t - 1 raised to that step's exact log-sum-exp if larger, then one softmax over the blocks.
# "_fbprefill": as "_fblse", and the first step starts from the prompt's last query's exact attention over
# every block (the dense prefill computes it; the recording keeps that query).
# "_fbnow": as "_fblse", with this step's exact log-sum-exp of those blocks (this step's query re-scores
# the last step's blocks from their keys, which a sparse step would have to read again for it).
# "_fbstick{B}": no exact numbers: the blocks loaded at t - 1 get B nats more in the estimate's per-block
# log-sum-exp (their estimated mass times e^B) before the softmax: a preference for what is already loaded.
STICKY_BONUS = {"stick05": 0.5, "stick1": 1.0, "stick2": 2.0}
FEEDBACK = {
    f"{base}_fb{mode}": (base, mode)
    for base in _BLOCK_CHANNEL_BASES
    for mode in ("max", "exact", "lse", "now", "prefill", *STICKY_BONUS)
}
# the modes that score by the estimate's log-sum-exp with something of the last step's added, as a sparse step can
LSE_FEEDBACK = ("lse", "now", "prefill", *STICKY_BONUS)
for _name, (_base, _) in (POOLED | FEEDBACK).items():
    _derive(_name, _base)
PROMPT_QUERIES = 64  # the prompt's last queries a calibrated channel choice may look at
NEEDLE_HEAD_MASS = 0.05  # a head "reads the needle" when dense puts >= this attention on its value tokens


# --------------------------------------------------------------------------- recording


@dataclass
class Recording:
    """One prompt's dense decode, as the selectors see it.

    Attributes:
        queries: per layer (Hq, T, D) fp32 queries of the T decode steps (post-RoPE).
        keys: per layer (Hkv, L, D) fp32 keys of every position (post-RoPE), L = prompt + T.
        positions: (T,) position of each decode step's token; step t attends keys [0, positions[t]].
        needle: (L,) bool, True on the tokens of the needle's value(s).
        scaling: softmax scale of the model's attention.
        answer: the dense greedy answer text.
        prompt_query_abs: per layer (Hq, D) mean |q| over the prompt's last `PROMPT_QUERIES` positions
            (what a prefill sees before decode starts); None in recordings made before it was kept.
    """

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    positions: torch.Tensor
    needle: torch.Tensor
    scaling: float
    answer: str
    prompt_query_abs: list[torch.Tensor] | None = None
    prompt_last_query: list[torch.Tensor] | None = None


def _register_capture(store: dict) -> None:
    """An attention backend that records query/key and then runs stock SDPA (so outputs are dense)."""

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if store.get("on"):
            steps = store["steps"]
            store["q"][module.layer_idx] = query[0, :, -steps:].float().cpu().clone()  # (Hq, T, D)
            prompt = query[0, :, -steps - PROMPT_QUERIES : -steps].float()  # (Hq, W, D)
            store["q_prompt"][module.layer_idx] = prompt.abs().mean(1).cpu()  # (Hq, D)
            store["q_last"][module.layer_idx] = query[0, :, -steps - 1].float().cpu().clone()  # (Hq, D)
            store["k"][module.layer_idx] = key[0].float().cpu().clone()  # (Hkv, L, D)
            store["scaling"] = scaling if scaling is not None else query.shape[-1] ** -0.5
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    AttentionInterface.register(CAPTURE, capture)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)


def record(model, tokenizer, prompt: str, references: list[str], steps: int) -> Recording:
    """Dense greedy `steps` answer tokens, then one capturing forward over prompt + answer."""
    store: dict = dict(q={}, k={}, q_prompt={}, q_last={}, steps=steps, on=False)
    _register_capture(store)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        return _record(model, tokenizer, prompt, references, steps, store)
    finally:
        model.set_attn_implementation(previous)


def _record(model, tokenizer, prompt: str, references: list[str], steps: int, store: dict) -> Recording:
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True, return_tensors="pt")
    ids = enc["input_ids"].to(model.device)
    with torch.inference_mode():
        # steps + 1 tokens: the first comes from the prefill (dense in the real path too); decode step t
        # feeds answer token t and its query picks token t + 1.
        out = model.generate(ids, max_new_tokens=steps + 1, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answer_ids = out[0, ids.shape[1] :].cpu()
        if answer_ids.numel() < steps + 1:  # stopped early (EOS): pad with EOS so the step count is fixed
            pad = answer_ids.new_full((steps + 1 - answer_ids.numel(),), tokenizer.eos_token_id)
            answer_ids = torch.cat((answer_ids, pad))
        full = torch.cat((ids[0].cpu(), answer_ids[:steps]))[None].to(model.device)  # (1, P + T)
        store["on"] = True
        model(full)
    layers = sorted(store["q"])
    prompt_len = ids.shape[1]
    positions = torch.arange(prompt_len, prompt_len + steps)  # decode step t's token sits at P + t
    queries = [store["q"][i] for i in layers]  # (Hq, T, D)
    return Recording(
        queries=queries,
        keys=[store["k"][i] for i in layers],
        positions=positions,
        needle=needle_token_mask(enc["offset_mapping"][0], prompt, references, full.shape[1]),
        scaling=float(store["scaling"]),
        answer=tokenizer.decode(answer_ids, skip_special_tokens=True),
        prompt_query_abs=[store["q_prompt"][i] for i in layers],
        prompt_last_query=[store["q_last"][i] for i in layers],
    )


def needle_token_mask(offsets: torch.Tensor, prompt: str, references: list[str], length: int) -> torch.Tensor:
    """(length,) True on prompt tokens overlapping any occurrence of a reference string (the needle values)."""
    mask = torch.zeros(length, dtype=torch.bool)
    for ref in references:
        start = prompt.find(ref)
        while start >= 0:
            end = start + len(ref)
            hit = (offsets[:, 0] < end) & (offsets[:, 1] > start)  # (P,)
            mask[: hit.shape[0]] |= hit
            start = prompt.find(ref, end)
    return mask


def cached_record(cache_dir: Path | None, model, tokenizer, sample, steps: int) -> Recording:
    """`record` of a RulerSample, read from / written to `cache_dir` (keyed by task, index, length, steps)."""
    path = None if cache_dir is None else cache_dir / f"{sample.task}_{sample.length}_{sample.index}_{steps}.pt"
    if path is not None and path.is_file():
        return Recording(**torch.load(path))
    rec = record(model, tokenizer, sample.prompt, sample.references, steps)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rec.__dict__, path)
    return rec


# --------------------------------------------------------------------------- scoring one step


def layer_metadata(config: SparseServeConfig, keys: torch.Tensor) -> torch.Tensor:
    """(Hkv, N, M, D) metadata of every full block of `keys` (Hkv, L, D); a step slices its first blocks."""
    size = config.block_size
    num_kv_heads, length, dim = keys.shape
    num_full = length // size
    blocks = keys[:, : num_full * size].reshape(num_kv_heads, num_full, size, dim)
    stored = reference.metadata_dtype(config.metadata_dtype, torch.bfloat16)  # as on the GPU: bf16 KV
    return reference.block_metadata(blocks, config.metadata, config.sub_blocks, stored).float()


def attended_blocks(
    config: SparseServeConfig, layer: int, q: torch.Tensor, meta: torch.Tensor, num_full: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full blocks each query head attends at one decode step (tail excluded), (Hq, N) bool,
    and how many blocks each KV head loads for it, (Hkv,).

    q: (Hq, D) the step's queries; meta: (Hkv, >= N, M, D) block metadata; num_full: N, the
    full blocks stored at this step. Mirrors the sparse path: with L tokens stored (the current one
    included) the first (L-1)//S blocks are full, the rest is the tail (always attended).
    """
    num_kv_heads = meta.shape[0]
    if layer in config.dense_layers or num_full <= config.selected_full_blocks:
        return _all_blocks(q.shape[0], num_full, num_kv_heads)
    scores = reference.score_blocks(q[None], meta[None, :, :num_full], config.metadata)  # (1, Hq, N)
    picked, valid, head_mask = pick_blocks(
        reference, config, scores, torch.tensor([num_full]), num_kv_heads, num_full
    )  # (1, Hkv, U) each, head_mask (1, Hq, U) or None
    group = q.shape[0] // num_kv_heads
    use = valid.repeat_interleave(group, dim=1)  # (1, Hq, U)
    if head_mask is not None:
        use = use & head_mask
    out = torch.zeros(q.shape[0], num_full + 1, dtype=torch.bool)
    index = torch.where(use, picked.repeat_interleave(group, dim=1), num_full)[0]  # (Hq, U); dump slot N
    out.scatter_(1, index, True)
    return out[:, :num_full], valid[0].sum(-1)


def estimated_mass_blocks(
    config: SparseServeConfig, q: torch.Tensor, meta: torch.Tensor, num_full: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`oracle_blocks` with the true mass replaced by an estimate from the metadata alone: query
    head h's weight of sub-block s is softmax_s(scaling * q_h . mean_s) over every sub-block of the
    row; a block's mass is the sum over its sub-blocks, the group's the sum over its query heads.
    meta: (Hkv, >= N, sub, D) cuboid sub-block means. Same returns as `attended_blocks`."""
    num_kv_heads, _, sub, dim = meta.shape
    heads = q.shape[0]
    if num_full <= config.selected_full_blocks:
        return _all_blocks(heads, num_full, num_kv_heads)
    means = meta[:, :num_full].reshape(num_kv_heads, num_full * sub, dim)  # (Hkv, N*sub, D)
    logits = q.view(num_kv_heads, heads // num_kv_heads, dim) @ means.transpose(1, 2)  # (Hkv, G, N*sub)
    weights = torch.softmax(logits * scaling, dim=-1).view(num_kv_heads, -1, num_full, sub)
    return top_blocks_by_mass(config, weights.sum(-1).reshape(heads, num_full), num_kv_heads)  # mass (Hq, N)


def quantized_keys(keys: torch.Tensor, bits: int = KEY_BITS) -> torch.Tensor:
    """(Hkv, L, D) keys rounded to `bits` per value with a per-token min/max scale (dequantized)."""
    return _rounded(keys, -1, bits)


def _rounded(values: torch.Tensor, dim: int, bits: int, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` rounded to `bits` per value with a min and a scale over `dim`, dequantized;
    `scale_dtype` (e.g. float8_e4m3fn): the min and the scale are stored in it (rounded through it)."""
    low = values.amin(dim=dim, keepdim=True)
    scale = (values.amax(dim=dim, keepdim=True) - low).clamp(min=1e-8) / (2**bits - 1)
    if scale_dtype is not None:  # rounded as stored; the codes are then taken against the stored pair
        low, scale = low.to(scale_dtype).float(), scale.to(scale_dtype).float().clamp(min=1e-8)
    return ((values - low) / scale).round().clamp(0, 2**bits - 1) * scale + low


def two_stage_blocks(
    config: SparseServeConfig,
    q: torch.Tensor,
    meta: torch.Tensor,
    coarse_keys: torch.Tensor,
    num_full: int,
    scaling: float,
    share: float = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: each KV head keeps the N / `share` blocks with the best score of its group under
    `config.metadata` (sink and window included); stage 2: each query head's softmax over the
    candidates' tokens with `coarse_keys` (Hkv, >= N*S, D), summed per block and over the group;
    `oracle_blocks` on that. meta: (Hkv, >= N, M, D). Same returns as `attended_blocks`."""
    num_kv_heads, heads = coarse_keys.shape[0], q.shape[0]
    if num_full <= config.selected_full_blocks:
        return _all_blocks(heads, num_full, num_kv_heads)
    bounds = reference.score_blocks(q[None], meta[None, :, :num_full], config.metadata)[0]  # (Hq, N)
    group = bounds.view(num_kv_heads, heads // num_kv_heads, num_full).amax(1)  # (Hkv, N)
    return rescored_candidates(config, q, group, coarse_keys, num_full, scaling, share)


def rescored_candidates(
    config: SparseServeConfig,
    q: torch.Tensor,
    group: torch.Tensor,
    coarse_keys: torch.Tensor,
    num_full: int,
    scaling: float,
    share: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 of a two-stage selection: the N / `share` blocks of best stage-1 `group` score (Hkv, N)
    per KV head (sink and window included) are re-scored by each query head's softmax over their
    tokens with `coarse_keys` (Hkv, >= N*S, D), summed per block and over the group;
    `top_blocks_by_mass` on that. Same returns as `attended_blocks`."""
    num_kv_heads, _, dim = coarse_keys.shape
    heads, size = q.shape[0], config.block_size
    count = max(config.selected_full_blocks, math.ceil(num_full / share))
    candidates = torch.where(_forced(config, num_full), float("inf"), group).topk(count, dim=-1).indices  # (Hkv, C)
    keys = coarse_keys[:, : num_full * size].view(num_kv_heads, num_full, size, dim)
    picked = torch.gather(keys, 1, candidates[..., None, None].expand(-1, -1, size, dim))  # (Hkv, C, S, D)
    logits = q.view(num_kv_heads, heads // num_kv_heads, dim) @ picked.flatten(1, 2).transpose(1, 2)  # (Hkv, G, C*S)
    weights = torch.softmax(logits * scaling, dim=-1).view(num_kv_heads, -1, count, size).sum(-1)  # (Hkv, G, C)
    block_mass = torch.zeros(num_kv_heads, weights.shape[1], num_full)
    block_mass.scatter_(2, candidates[:, None].expand_as(weights), weights)
    return top_blocks_by_mass(config, block_mass.reshape(heads, num_full), num_kv_heads)


def channel_quantized_keys(
    keys: torch.Tensor, size: int, bits: int, scale_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """(Hkv, L, D) keys rounded to `bits` per value with a min and a scale per (block of `size`
    tokens, channel), dequantized; tokens past the last full block are kept as they are.
    `scale_dtype` (e.g. float8_e4m3fn): the min and the scale are stored in it (rounded through it)."""
    num_kv_heads, length, dim = keys.shape
    full = length // size * size
    rounded = _rounded(keys[:, :full].reshape(num_kv_heads, -1, size, dim), 2, bits, scale_dtype)
    return torch.cat((rounded.reshape(num_kv_heads, full, dim), keys[:, full:]), dim=1)


def channel_score_blocks(
    config: SparseServeConfig,
    q: torch.Tensor,
    coarse_keys: torch.Tensor,
    num_full: int,
    scaling: float,
    channels: int,
    group: int = 1,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each KV head loads the blocks of most attention its group puts on them as `channel_mass`
    estimates it from `channels` channels of `coarse_keys` (Hkv, >= N*S, D) (among `allowed`, if
    given), exactly the budget. Same returns as `attended_blocks`."""
    num_kv_heads, heads = coarse_keys.shape[0], q.shape[0]
    if num_full <= config.selected_full_blocks:
        return _all_blocks(heads, num_full, num_kv_heads)
    mass = channel_mass(q, coarse_keys, num_full, config.block_size, scaling, channels, group, allowed)
    return top_blocks_by_mass(config, mass.reshape(heads, num_full), num_kv_heads)


def chosen_channels(weight: torch.Tensor, channels: int, group: int = 1) -> torch.Tensor:
    """(Hkv, D) per-channel |q| mass -> (Hkv, R) the `channels` channels of most of it, chosen one by one
    (`group` 1), by RoPE rotation pair (d, d + D/2) (2) or by two neighbouring pairs (4)."""
    if group == 1:
        return weight.topk(channels, dim=-1).indices
    half = weight.shape[-1] // 2
    pairs = weight[:, :half] + weight[:, half:]  # (Hkv, D/2)
    units = pairs.view(pairs.shape[0], -1, group // 2).sum(-1)  # (Hkv, D/group)
    first = units.topk(channels // group, dim=-1).indices * (group // 2)  # (Hkv, R/group) first pair of each
    members = first[..., None] + torch.arange(group // 2)  # (Hkv, R/group, group/2) pairs
    return torch.cat((members, members + half), dim=-1).flatten(1)  # (Hkv, R)


def calibrated_channels(
    source: str, stored: int, keys: torch.Tensor, prompt_queries: torch.Tensor | None
) -> torch.Tensor:
    """(Hkv, P) the `stored` channels a request keeps codes of, chosen before decode from the prompt:
    keys (Hkv, L, D) are the prompt's (and the steps'; their first L - T are the prompt), prompt_queries
    (Hq, D) its last queries' mean |q|. See `CALIBRATED` for the sources."""
    num_kv_heads, _, dim = keys.shape
    key_abs = keys.abs().mean(1)  # (Hkv, D)
    if source == "keys":
        weight = key_abs
    else:
        if prompt_queries is None:
            raise ValueError(f"calibrated source {source!r} needs a recording with prompt_query_abs: record again")
        weight = prompt_queries.view(num_kv_heads, -1, dim).sum(1)  # (Hkv, D)
        if source == "pqk":
            weight = weight * key_abs
    return chosen_channels(weight, stored, 1 if source == "pq1" else 2).sort(dim=-1).values


def block_channels(
    source: str, stored: int, keys: torch.Tensor, size: int, prompt_queries: torch.Tensor | None
) -> torch.Tensor:
    """(Hkv, N, D) bool: the `stored` channels each full block keeps codes of, by RoPE pair, from the
    block's own keys (Hkv, >= N*size, D) (see `BLOCK_CHANNELS`)."""
    num_kv_heads, length, dim = keys.shape
    blocks = keys[:, : length // size * size].reshape(num_kv_heads, -1, size, dim)  # (Hkv, N, S, D)
    weight = blocks.std(2) if source.startswith("std") else blocks.abs().mean(2)  # (Hkv, N, D)
    if "q" in source:
        if prompt_queries is None:
            raise ValueError(f"block channel source {source!r} needs a recording with prompt_query_abs")
        weight = weight * prompt_queries.view(num_kv_heads, -1, dim).sum(1)[:, None]
    if source.endswith("1"):
        top = weight.topk(stored, dim=-1).indices
        return torch.zeros_like(weight, dtype=torch.bool).scatter_(-1, top, True)
    half = dim // 2
    pairs = weight[..., :half] + weight[..., half:]  # (Hkv, N, D/2)
    top = pairs.topk(stored // 2, dim=-1).indices
    mask = torch.zeros_like(pairs, dtype=torch.bool).scatter_(-1, top, True)
    return torch.cat((mask, mask), dim=-1)


def block_channel_mass(
    q: torch.Tensor, coarse_keys: torch.Tensor, num_full: int, size: int, scaling: float, mask: torch.Tensor
) -> torch.Tensor:
    """(Hkv, G, N) as `channel_mass`, each block scored from its own stored channels `mask` (Hkv, >= N, D):
    the softmax of `block_channel_lse` over the blocks."""
    lse = block_channel_lse(q, coarse_keys, num_full, size, scaling, mask)  # (Hq, N)
    return torch.softmax(lse, dim=-1).view(coarse_keys.shape[0], -1, num_full)


def block_channel_lse(
    q: torch.Tensor, coarse_keys: torch.Tensor, num_full: int, size: int, scaling: float, mask: torch.Tensor
) -> torch.Tensor:
    """(Hq, N): each block's log-sum-exp of its tokens' logits estimated from its stored channels `mask`
    (Hkv, >= N, D) of `coarse_keys` (Hkv, >= N*size, D), the temperature scaled by 1 / sqrt(the share of
    |q| those channels hold) (SparQ)."""
    num_kv_heads, _, dim = coarse_keys.shape
    grouped = q.view(num_kv_heads, q.shape[0] // num_kv_heads, dim)  # (Hkv, G, D)
    mask = mask[:, :num_full].float()  # (Hkv, N, D)
    keys = coarse_keys[:, : num_full * size].view(num_kv_heads, num_full, size, dim) * mask[:, :, None]
    logits = torch.einsum("hgd,hnsd->hgns", grouped, keys)  # (Hkv, G, N, S)
    kept = (grouped.abs() @ mask.transpose(1, 2)) / grouped.abs().sum(-1, keepdim=True).clamp(min=1e-30)  # (Hkv, G, N)
    return (logits * scaling / kept.clamp(min=1e-6).sqrt()[..., None]).logsumexp(-1).flatten(0, 1)


def exact_block_lse(q: torch.Tensor, keys: torch.Tensor, num_full: int, size: int, scaling: float) -> torch.Tensor:
    """(Hq, N): each full block's log-sum-exp of q's exact logits (what a sparse step's attention computes
    for the blocks it loads). q (Hq, D); keys (Hkv, >= N*S, D)."""
    num_kv_heads, _, dim = keys.shape
    grouped = q.view(num_kv_heads, -1, dim)  # (Hkv, G, D)
    blocks = keys[:, : num_full * size].view(num_kv_heads, num_full, size, dim)
    return (torch.einsum("hgd,hnsd->hgns", grouped, blocks) * scaling).logsumexp(-1).flatten(0, 1)


def channel_group(variant: str) -> int:
    """Channels chosen together by a channel-score `variant` (see `CHANNEL_GROUPS`)."""
    return next((size for suffix, size in CHANNEL_GROUPS.items() if variant.endswith(suffix)), 1)


def channel_mass(
    q: torch.Tensor,
    coarse_keys: torch.Tensor,
    num_full: int,
    size: int,
    scaling: float,
    channels: int,
    group: int = 1,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """(Hkv, G, N): each query head's attention over the N full blocks (blocks of `size` tokens)
    estimated from the `channels` channels of `coarse_keys` (Hkv, >= N*size, D) where its group's
    |q| is largest, the softmax temperature scaled by 1 / sqrt(the share of |q| kept) (SparQ).
    `allowed` (Hkv, P): the channels are chosen among these only (a calibrated, stored subset)."""
    num_kv_heads, _, dim = coarse_keys.shape
    grouped = q.view(num_kv_heads, q.shape[0] // num_kv_heads, dim)  # (Hkv, G, D)
    if allowed is None:
        chosen = chosen_channels(grouped.abs().sum(1), channels, group)  # (Hkv, R)
    else:  # the step's choice among the channels stored
        weight = torch.gather(grouped.abs().sum(1), 1, allowed)  # (Hkv, P)
        chosen = torch.gather(allowed, 1, weight.topk(min(channels, allowed.shape[1]), dim=-1).indices)
    q_part = torch.gather(grouped, 2, chosen[:, None].expand(-1, grouped.shape[1], -1))  # (Hkv, G, R)
    keys = coarse_keys[:, : num_full * size]
    k_part = torch.gather(keys, 2, chosen[:, None].expand(-1, keys.shape[1], -1))  # (Hkv, N*S, R)
    kept = q_part.abs().sum(-1, keepdim=True) / grouped.abs().sum(-1, keepdim=True).clamp(min=1e-30)  # (Hkv, G, 1)
    logits = (q_part @ k_part.transpose(1, 2)) * scaling / kept.clamp(min=1e-6).sqrt()  # (Hkv, G, N*S)
    return torch.softmax(logits, dim=-1).view(num_kv_heads, -1, num_full, size).sum(-1)


def two_stage_channel_blocks(
    config: SparseServeConfig,
    q: torch.Tensor,
    channel_keys: torch.Tensor,
    token_keys: torch.Tensor,
    num_full: int,
    scaling: float,
    channels: int,
    share: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: the group's `channel_mass` from `channels` channels of `channel_keys`; stage 2:
    `rescored_candidates` over 1 in `share` blocks with `token_keys` (both (Hkv, >= N*S, D))."""
    num_kv_heads, heads = token_keys.shape[0], q.shape[0]
    if num_full <= config.selected_full_blocks:
        return _all_blocks(heads, num_full, num_kv_heads)
    group = channel_mass(q, channel_keys, num_full, config.block_size, scaling, channels).sum(1)  # (Hkv, N)
    return rescored_candidates(config, q, group, token_keys, num_full, scaling, share)


def oracle_blocks(
    config: SparseServeConfig, mass: StepMass, num_kv_heads: int, pool_cap: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-KV-head block oracle: each KV head loads the sink, the window and the top blocks by
    the true attention mass its query heads put on them (summed over the group), as many in all as
    `config.selected_full_blocks`; every query head of the group attends them. Same returns as
    `attended_blocks`: the ceiling of any selector that loads exactly that many blocks per KV head.
    With `pool_cap` the layer's KV heads share the budget instead (`pooled_blocks`)."""
    return top_blocks_by_mass(config, mass.block_mass, num_kv_heads, pool_cap)


def top_blocks_by_mass(
    config: SparseServeConfig, block_mass: torch.Tensor, num_kv_heads: int, pool_cap: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each KV head loads the sink, the window and the blocks of most `block_mass` (Hq, N) summed
    over its group, `config.selected_full_blocks` in all; with `pool_cap`, the layer's KV heads share
    that budget (`pooled_blocks`). Same returns as `attended_blocks`."""
    heads, num_full = block_mass.shape
    if num_full <= config.selected_full_blocks:
        return _all_blocks(heads, num_full, num_kv_heads)
    group_mass = block_mass.view(num_kv_heads, heads // num_kv_heads, num_full).sum(1)  # (Hkv, N)
    if pool_cap is not None:
        chosen = pooled_blocks(config, group_mass, pool_cap)
        return chosen.repeat_interleave(heads // num_kv_heads, dim=0), chosen.sum(-1)
    chosen = top_blocks(group_mass[None], torch.tensor([num_full]), config)[0]  # (Hkv, N): the oracle's rule
    counts = torch.full((num_kv_heads,), config.selected_full_blocks)
    return chosen.repeat_interleave(heads // num_kv_heads, dim=0), counts


def pooled_blocks(config: SparseServeConfig, group_mass: torch.Tensor, cap: int) -> torch.Tensor:
    """(Hkv, N) bool: every KV head's sink and window, and Hkv x (the budget's blocks - those) more, the
    (head, block) pairs of most `group_mass` (Hkv, N) over the whole layer, at most `cap` x a head's
    share (the budget's blocks - those) to one head."""
    num_kv_heads, num_full = group_mass.shape
    forced = _forced(config, num_full)  # (N,)
    num_forced = int(forced.sum())
    share = config.selected_full_blocks - num_forced
    most = min(cap * share, num_full - num_forced)
    candidates = group_mass.masked_fill(forced, float("-inf")).topk(most, dim=-1)  # (Hkv, C) each head's best
    top = candidates.values.flatten().topk(num_kv_heads * share).indices  # of the layer's Hkv x C candidates
    chosen = forced.expand(num_kv_heads, num_full).clone()
    rows = torch.div(top, most, rounding_mode="floor")
    chosen[rows, candidates.indices.flatten()[top]] = True
    return chosen


def fed_back(estimate: torch.Tensor, chosen: torch.Tensor, true_mass: torch.Tensor, mode: str) -> torch.Tensor:
    """(Hq, N) block scores of this step from its `estimate` and the last step's attended blocks `chosen`
    (Hq, N') with their true mass (Hq, N'), N' <= N: "max" keeps the larger, "exact" the true mass."""
    width = chosen.shape[1]
    known = estimate[:, :width]
    mixed = torch.maximum(known, true_mass) if mode == "max" else true_mass
    return torch.cat((torch.where(chosen, mixed, known), estimate[:, width:]), dim=1)


def block_channel_scores(
    rec: Recording, layer: int, t: int, mode: str | None, keys: torch.Tensor, args: tuple, before: tuple | None
) -> torch.Tensor:
    """(Hq, N) what a block-channel variant picks by at step `t` of `layer`: its estimated mass, with
    `mode` (a `FEEDBACK` mode; None: none) the last step's `before` = (chosen, its numbers) fed back.
    `args`: `block_channel_mass`'s (q, coarse keys, N, block size, scaling, channel mask)."""
    q, _, num_full, size, scaling, _ = args
    if mode not in LSE_FEEDBACK:
        estimate = block_channel_mass(*args).reshape(-1, num_full)
        return estimate if mode is None or before is None else fed_back(estimate, *before, mode)
    lse = block_channel_lse(*args)  # (Hq, N)
    if t == 0 and mode == "prefill":  # the prompt's last query attended every block densely
        last = rec.prompt_last_query[layer]
        before = (
            torch.ones(last.shape[0], num_full, dtype=torch.bool),
            exact_block_lse(last, keys, num_full, size, scaling),
        )
    if before is not None and mode in STICKY_BONUS:
        chosen = before[0]
        width = chosen.shape[1]
        lse = torch.cat((lse[:, :width] + STICKY_BONUS[mode] * chosen, lse[:, width:]), dim=1)
    elif before is not None:
        chosen, exact = before
        if mode == "now":  # this step's query re-scores the last step's blocks
            exact = exact_block_lse(q, keys, chosen.shape[1], size, scaling)
        lse = fed_back(lse, chosen, exact, "max")
    return torch.softmax(lse, dim=-1)


def after_step(
    mode: str, chosen: torch.Tensor, mass: StepMass, q: torch.Tensor, keys: torch.Tensor,
    config: SparseServeConfig, rec: Recording,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """What a `FEEDBACK` variant keeps of step t for step t + 1: the blocks attended, with their exact
    log-sum-exps ("lse", "prefill"), their true mass ("max", "exact"), or nothing ("now" re-scores)."""
    if mode in ("lse", "prefill"):
        return chosen, exact_block_lse(q, keys, chosen.shape[1], config.block_size, rec.scaling)
    return chosen, None if mode == "now" or mode in STICKY_BONUS else mass.block_mass


def pool_cap(name: str) -> int | None:
    """A `_pooled{C}` variant's C (`POOLED`), None for any other variant."""
    return POOLED[name][1] if name in POOLED else None


def _forced(config: SparseServeConfig, num_full: int) -> torch.Tensor:
    """(N,) True on the sink and window blocks, which every selection keeps."""
    forced = torch.zeros(num_full, dtype=torch.bool)
    forced[: config.sink_blocks] = True
    forced[num_full - config.window_blocks :] = True
    return forced


def _all_blocks(heads: int, num_full: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every full block, attended by every head (a budget that covers them all)."""
    return torch.ones(heads, num_full, dtype=torch.bool), torch.full((num_kv_heads,), num_full)


@dataclass
class StepMass:
    """True attention of one decode step (all per query head): what every selector is judged against."""

    block_mass: torch.Tensor  # (Hq, N) attention mass per full block
    tail_mass: torch.Tensor  # (Hq,) mass on the tail (always attended)
    needle_blocks: torch.Tensor  # (Hq, N) mass on needle tokens per full block
    needle_tail: torch.Tensor  # (Hq,)
    needle_mass: torch.Tensor  # (Hq,) total mass on needle tokens


def step_mass(q: torch.Tensor, keys: torch.Tensor, needle: torch.Tensor, scaling: float, size: int) -> StepMass:
    """Dense attention of q (Hq, D) over keys (Hkv, L, D), summed per block of `size` tokens."""
    num_kv_heads, length, _ = keys.shape
    heads = q.shape[0]
    logits = (q.view(num_kv_heads, heads // num_kv_heads, -1) @ keys.transpose(1, 2)).flatten(0, 1)  # (Hq, L)
    probs = torch.softmax(logits * scaling, dim=-1)
    num_full = (length - 1) // size
    needle_probs = probs * needle[:length]
    return StepMass(
        block_mass=probs[:, : num_full * size].reshape(heads, num_full, size).sum(-1),
        tail_mass=probs[:, num_full * size :].sum(-1),
        needle_blocks=needle_probs[:, : num_full * size].reshape(heads, num_full, size).sum(-1),
        needle_tail=needle_probs[:, num_full * size :].sum(-1),
        needle_mass=needle_probs.sum(-1),
    )


def step_stats(
    config: SparseServeConfig, mass: StepMass, chosen: torch.Tensor, loaded: torch.Tensor, length: int
) -> dict[str, torch.Tensor]:
    """Per query head (Hq,) recall, attended mass, dense needle mass, captured needle mass and the
    fraction of the `length` stored tokens its KV head loads (`loaded` (Hkv,) blocks + the tail)."""
    # Oracle: as many full blocks as the head's own budget, by true mass (group_union may attend more,
    # so its recall is capped at 1).
    k = min(config.selected_full_blocks, mass.block_mass.shape[1])
    oracle = mass.block_mass.topk(k, dim=-1).values.sum(-1)  # (Hq,)
    kept = (mass.block_mass * chosen).sum(-1)
    heads, num_full = mass.block_mass.shape
    tail = length - num_full * config.block_size
    loaded_fraction = ((loaded * config.block_size + tail) / length).repeat_interleave(heads // loaded.shape[0])
    return dict(
        loaded_fraction=loaded_fraction.float(),
        recall=torch.where(oracle > 0, kept.clamp(max=oracle) / oracle.clamp(min=1e-30), torch.ones_like(oracle)),
        attended=kept + mass.tail_mass,
        needle_mass=mass.needle_mass,
        needle_kept=(mass.needle_blocks * chosen).sum(-1) + mass.needle_tail,
    )


def reused_blocks(rec: Recording, config: SparseServeConfig, source: int, mode: str) -> list[torch.Tensor]:
    """Per decode step, the (Hkv, N) blocks layer `source`'s exact attention picks for the layers
    after it (`REUSED`): the sink, the window and the blocks of most true mass, pooled over all of
    its query heads ("pool", the same set for every KV head) or summed over each KV head's group
    ("head"), `config.selected_full_blocks` in all."""
    queries, keys = rec.queries[source], rec.keys[source]
    num_kv_heads = keys.shape[0]
    picks = []
    for t, position in enumerate(rec.positions.tolist()):
        mass = step_mass(queries[:, t], keys[:, : position + 1], rec.needle, rec.scaling, config.block_size)
        num_full = mass.block_mass.shape[1]
        group_mass = mass.block_mass.view(num_kv_heads, -1, num_full).sum(1)  # (Hkv, N)
        if mode == "pool":
            group_mass = group_mass.sum(0, keepdim=True).expand(num_kv_heads, num_full)
        picks.append(top_blocks(group_mass[None], torch.tensor([num_full]), config)[0])
    return picks


def evaluate_recording(rec: Recording, configs: dict[str, SparseServeConfig]) -> dict[str, dict[str, torch.Tensor]]:
    """variant -> stat -> (layers, Hq, T) tensors over every decode step."""
    sizes = {c.block_size for c in configs.values()}
    out: dict[str, dict[str, list]] = {name: defaultdict(list) for name in configs}
    reused = {name: reused_blocks(rec, config, *REUSED[name]) for name, config in configs.items() if name in REUSED}
    for layer, (queries, keys) in enumerate(zip(rec.queries, rec.keys)):
        metas = {name: layer_metadata(config, keys) for name, config in configs.items()}
        coarse = {name: quantized_keys(keys, TWO_STAGE[name][1]) for name in configs if name in TWO_STAGE}
        coarse |= {
            name: channel_quantized_keys(
                keys,
                config.block_size,
                CHANNEL_SCORES[name][1],
                torch.float8_e4m3fn if "_s8" in name or name in CALIBRATED else None,
            )
            for name, config in configs.items()
            if name in CHANNEL_SCORES
        }
        per_token = quantized_keys(keys, KEY_BITS) if any(name in TWO_STAGE_CHANNELS for name in configs) else None
        prompt_keys = keys[:, : int(rec.positions[0])]
        prompt_queries = None if rec.prompt_query_abs is None else rec.prompt_query_abs[layer]
        block_masks = {
            name: block_channels(*BLOCK_CHANNELS[name], keys, config.block_size, prompt_queries)
            for name, config in configs.items()
            if name in BLOCK_CHANNELS
        }
        allowed = {
            name: calibrated_channels(CALIBRATED[name][0], CALIBRATED[name][1], prompt_keys, prompt_queries)
            for name in configs
            if name in CALIBRATED
        }
        per_step: dict[str, dict[str, list]] = {name: defaultdict(list) for name in configs}
        previous: dict[str, tuple] = {}  # FEEDBACK variants: what the last step kept (`after_step`)
        for t, position in enumerate(rec.positions.tolist()):
            visible = keys[:, : position + 1]
            masses = {size: step_mass(queries[:, t], visible, rec.needle, rec.scaling, size) for size in sizes}
            for name, config in configs.items():
                mass = masses[config.block_size]
                num_full = mass.block_mass.shape[1]
                if name in ORACLES:
                    chosen, loaded = oracle_blocks(config, mass, keys.shape[0], pool_cap(name))
                elif name in REUSED and layer >= REUSED[name][0]:
                    if num_full <= config.selected_full_blocks:
                        chosen, loaded = _all_blocks(queries.shape[0], num_full, keys.shape[0])
                    else:
                        picks = reused[name][t]  # (Hkv, N)
                        chosen = picks.repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
                        loaded = picks.sum(-1)
                elif name in TWO_STAGE:
                    chosen, loaded = two_stage_blocks(
                        config, queries[:, t], metas[name], coarse[name], num_full, rec.scaling, TWO_STAGE[name][0]
                    )
                elif name in TWO_STAGE_CHANNELS:
                    chosen, loaded = two_stage_channel_blocks(
                        config, queries[:, t], coarse[name], per_token, num_full, rec.scaling, *TWO_STAGE_CHANNELS[name]
                    )
                elif name in BLOCK_CHANNELS:
                    if num_full <= config.selected_full_blocks:
                        chosen, loaded = _all_blocks(queries.shape[0], num_full, keys.shape[0])
                    else:
                        args = (
                            queries[:, t],
                            coarse[name],
                            num_full,
                            config.block_size,
                            rec.scaling,
                            block_masks[name],
                        )
                        mode = FEEDBACK[name][1] if name in FEEDBACK else None
                        group_mass = block_channel_scores(rec, layer, t, mode, keys, args, previous.get(name))
                        chosen, loaded = top_blocks_by_mass(config, group_mass, keys.shape[0], pool_cap(name))
                    if name in FEEDBACK:
                        previous[name] = after_step(FEEDBACK[name][1], chosen, mass, queries[:, t], keys, config, rec)
                elif name in CHANNEL_SCORES:
                    chosen, loaded = channel_score_blocks(
                        config,
                        queries[:, t],
                        coarse[name],
                        num_full,
                        rec.scaling,
                        CHANNEL_SCORES[name][0],
                        channel_group(name),
                        allowed.get(name),
                    )
                elif name in ESTIMATES:
                    chosen, loaded = estimated_mass_blocks(config, queries[:, t], metas[name], num_full, rec.scaling)
                else:
                    chosen, loaded = attended_blocks(config, layer, queries[:, t], metas[name], num_full)
                for stat, value in step_stats(config, mass, chosen, loaded, position + 1).items():
                    per_step[name][stat].append(value)
        for name in configs:
            for stat, values in per_step[name].items():
                out[name][stat].append(torch.stack(values, dim=-1))  # (Hq, T)
    return {name: {stat: torch.stack(v) for stat, v in stats.items()} for name, stats in out.items()}


# --------------------------------------------------------------------------- summaries


def summarize(stats: dict[str, torch.Tensor]) -> dict:
    """Scalar and per-layer / per-(layer, head) summaries of one variant's (S, layers, Hq, T) stats."""
    needle_mass = stats["needle_mass"]  # (S, Ly, Hq, T)
    reads = needle_mass >= NEEDLE_HEAD_MASS
    lost = reads & (stats["needle_kept"] < 0.5 * needle_mass)  # a needle-reading head kept < half its needle mass
    return dict(
        loaded_fraction=float(stats["loaded_fraction"].mean()),
        recall=float(stats["recall"].mean()),
        attended=float(stats["attended"].mean()),
        needle_capture=float(stats["needle_kept"].sum() / needle_mass.sum().clamp(min=1e-30)),
        needle_heads=int(reads.sum()),
        needle_heads_lost=int(lost.sum()),
        recall_per_layer=[round(float(x), 4) for x in stats["recall"].mean(dim=(0, 2, 3))],
        attended_per_layer=[round(float(x), 4) for x in stats["attended"].mean(dim=(0, 2, 3))],
        needle_capture_per_layer=[
            round(float(k / m), 4) if m > 0 else None
            for k, m in zip(stats["needle_kept"].sum(dim=(0, 2, 3)), needle_mass.sum(dim=(0, 2, 3)))
        ],
        needle_mass_per_layer_head=needle_mass.mean(dim=(0, 3)).round(decimals=4).tolist(),  # (Ly, Hq)
        needle_lost_per_layer_head=lost.float().mean(dim=(0, 3)).round(decimals=3).tolist(),
        recall_per_layer_head=stats["recall"].mean(dim=(0, 3)).round(decimals=3).tolist(),
    )


def worst(summary: dict, key: str, count: int = 5) -> list[tuple[int, float]]:
    """The `count` layers with the lowest per-layer value of `key` (None entries skipped)."""
    values = [(i, v) for i, v in enumerate(summary[key]) if v is not None]
    return sorted(values, key=lambda iv: iv[1])[:count]


def markdown(result: dict) -> str:
    """Tables: one row per (task, budget, variant); then the default's worst layers and needle heads."""
    lines = [
        f"Selection diagnostics: {result['meta']['command']}",
        "",
        "| task | budget | variant | loaded | recall | attended | needle capture | needle heads lost | worst recall layers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, summary in result["summaries"].items():
        task, budget, variant = key.split("|")
        bad = ", ".join(f"L{i} {v:.2f}" for i, v in worst(summary, "recall_per_layer", 3))
        lines.append(
            f"| {task} | {budget} | {variant} | {summary['loaded_fraction']:.4f} | {summary['recall']:.3f} | "
            f"{summary['attended']:.3f} | "
            f"{summary['needle_capture']:.3f} | {summary['needle_heads_lost']}/{summary['needle_heads']} | {bad} |"
        )
    lines += [
        "",
        "loaded: tokens a KV head loads (blocks + tail) / tokens stored, mean over steps, heads, layers, samples.",
        "recall: attended full-block mass / oracle top-k mass (same k), mean over steps, heads, layers, samples.",
        "attended: attention mass the sparse step keeps (attended blocks + tail). needle capture: needle-token",
        "mass in attended blocks / dense needle-token mass, summed over heads. needle heads: (sample, layer, head,",
        f"step) with dense needle mass >= {NEEDLE_HEAD_MASS}; lost: those keeping < half of it.",
    ]
    for key, summary in result["summaries"].items():
        task, budget, variant = key.split("|")
        if variant != "default":
            continue
        mass = torch.tensor(summary["needle_mass_per_layer_head"])  # (Ly, Hq)
        lost = torch.tensor(summary["needle_lost_per_layer_head"])
        top = [divmod(int(i), mass.shape[1]) for i in mass.flatten().argsort(descending=True)[:8]]
        lines += ["", f"**{task}, budget {budget}, default selector: the heads that read the needle most**", ""]
        lines += ["| layer | head | dense needle mass | share of steps lost | recall |", "|---|---|---|---|---|"]
        recall = summary["recall_per_layer_head"]
        lines += [
            f"| {layer} | {head} | {mass[layer, head]:.3f} | {lost[layer, head]:.2f} | {recall[layer][head]:.3f} |"
            for layer, head in top
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Per-layer recall of every variant (one panel per task and budget) and the default's needle heads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(result["summaries"])
    panels = sorted({tuple(k.split("|")[:2]) for k in keys})
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.2 * len(panels)), squeeze=False)
    for row, (task, budget) in enumerate(panels):
        ax = axes[row][0]
        for key in keys:
            t, b, variant = key.split("|")
            if (t, b) == (task, budget):
                ax.plot(result["summaries"][key]["recall_per_layer"], marker=".", label=variant)
        ax.set_title(f"{task} budget {budget}: mass recall per layer")
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize="x-small", ncol=2)
        default = result["summaries"].get(f"{task}|{budget}|default")
        ax = axes[row][1]
        if default is not None:
            mass = torch.tensor(default["needle_mass_per_layer_head"])
            lost = torch.tensor(default["needle_lost_per_layer_head"])
            image = ax.imshow((mass * lost).T, aspect="auto", cmap="Reds")
            fig.colorbar(image, ax=ax)
            ax.set_title("default: needle mass x share of steps lost")
            ax.set_xlabel("layer")
            ax.set_ylabel("query head")
    fig.tight_layout()
    save_plot(fig, path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- real sparse path


def real_answers(
    model, tokenizer, samples: list, configs: dict[str, SparseServeConfig], max_new_tokens: int
) -> list[dict]:
    """Greedy answers through the real path (SparseServeCache, sparse decode) vs dense, RULER-scored.

    `configs` maps a method name ("<variant>_<budget>") to its config; samples of one task are
    answered in one left-padded batch per method (`eval.common.answer_batch`).
    """
    from eval.accuracy.ruler import score
    from eval.common import DENSE, Method, answer_batch

    methods = [Method(DENSE)] + [Method(name, config) for name, config in configs.items()]
    by_task: dict[str, list] = defaultdict(list)
    for sample in samples:
        by_task[sample.task].append(sample)
    rows = []
    for task, group in by_task.items():
        prompts = [tokenizer(s.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0] for s in group]
        for method in methods:
            start = time.time()
            predictions = answer_batch(model, tokenizer, prompts, method, max_new_tokens)[0]
            rows += [
                dict(task=task, index=s.index, method=method.name, score=score(s, text), prediction=text)
                for s, text in zip(group, predictions)
            ]
            print(
                f"  {task} {method.name}: {[round(r['score']) for r in rows[-len(group) :]]} ({time.time() - start:.0f} s)"
            )
    return rows


def answers_markdown(rows: list[dict]) -> str:
    """Mean RULER score per (method, task) of the real-path answers."""
    tasks = sorted({r["task"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = ["| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for method in methods:
        cells = []
        for task in tasks:
            scores = [r["score"] for r in rows if r["method"] == method and r["task"] == task]
            cells.append(f"{sum(scores) / len(scores):.0f} (n={len(scores)})")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI


def variant_configs(names: list[str], budget: int) -> dict[str, SparseServeConfig]:
    """name -> SparseServeConfig at `budget`; a name may also be "name=field:value;field:value" (ints parsed)."""
    configs = {}
    for name in names:
        if name in VARIANTS:
            overrides = VARIANTS[name]
        elif "=" in name:
            name, spec = name.split("=", 1)
            overrides = dict(_parse_override(part) for part in spec.split(";") if part)
        else:
            raise ValueError(f"--variants: unknown variant {name!r}; known: {sorted(VARIANTS)} or name=field:value")
        configs[name] = replace(BASE, token_budget=budget, **overrides)
    return configs


def _prompt_profile(rec: Recording) -> torch.Tensor:
    """(layers, Hq, D) a recording's prompt-query |q| (`Recording.prompt_query_abs`)."""
    if rec.prompt_query_abs is None:
        raise ValueError("--profile-from-others needs recordings with prompt_query_abs: record again")
    return torch.stack(rec.prompt_query_abs)


def _parse_override(text: str) -> tuple[str, object]:
    field, _, raw = text.partition(":")
    if field == "dense_layers":
        return field, tuple(int(x) for x in raw.split(",") if x)
    try:
        return field, int(raw)
    except ValueError:
        try:
            return field, float(raw)
        except ValueError:
            return field, raw


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="niah_single_2,niah_single_1")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=3, help="samples per task (RULER sample indices 0..n-1)")
    parser.add_argument("--seed", type=int, default=42, help="RULER suite seed")
    parser.add_argument("--steps", type=int, default=4, help="decode steps (answer tokens) per prompt")
    parser.add_argument("--budgets", default="256")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated (see VARIANTS); ',' inside a spec: use '+'"
    )
    parser.add_argument("--out", type=Path, default=Path("eval/results/selection_diagnostics"))
    parser.add_argument("--device", default="cpu", help="where the model runs (fp32); the analysis runs on the CPU")
    parser.add_argument("--cache-dir", type=Path, default=None, help="keep recordings (~100 MB per 4K prompt) here")
    parser.add_argument("--skip-diagnostics", action="store_true", help="only the real-path answers")
    parser.add_argument(
        "--answers", type=int, default=0, help="samples per task answered through the real sparse path (0: none)"
    )
    parser.add_argument(
        "--answer-variants", default=None, help="variants for the real-path answers (default: --variants)"
    )
    parser.add_argument("--answer-budgets", default=None, help="budgets for the real-path answers (default: --budgets)")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="answer tokens of the real-path check")
    parser.add_argument(
        "--profile-from-others",
        action="store_true",
        help="the prompt-query |q| that calibrated channel choices read: each prompt gets the mean of the "
        "other prompts' (a profile of the model, not of the request)",
    )
    args = parser.parse_args(argv)
    command = "python -m eval.accuracy.selection_diagnostics " + " ".join(argv if argv is not None else sys.argv[1:])

    from eval.accuracy.ruler import generate_sample
    from sparseserve_hf.data.models import load_default

    torch.manual_seed(args.seed)
    model, tokenizer = load_default(torch.float32, attn_implementation="sparseserve", device=args.device)
    budgets = [int(b) for b in args.budgets.split(",")]
    names = [n.replace("+", ",") for n in args.variants.split(",") if n]
    per_key: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    answers, start = [], time.time()
    tasks = args.tasks.split(",") if not args.skip_diagnostics else []
    profiles = (
        {
            (task, index): _prompt_profile(
                cached_record(
                    args.cache_dir,
                    model,
                    tokenizer,
                    generate_sample(task, tokenizer, args.length, index, args.seed),
                    args.steps,
                )
            )
            for task in tasks
            for index in range(args.samples)
        }
        if args.profile_from_others
        else {}
    )
    for task in tasks:
        for index in range(args.samples):
            sample = generate_sample(task, tokenizer, args.length, index, args.seed)
            rec = cached_record(args.cache_dir, model, tokenizer, sample, args.steps)
            if profiles:  # the prompt-query profile as a model-level calibration: the other prompts' mean
                others = torch.stack([p for key, p in profiles.items() if key != (task, index)]).mean(0)
                rec.prompt_query_abs = list(others)
            answers.append(
                dict(
                    task=task,
                    index=index,
                    answer=rec.answer,
                    references=sample.references,
                    needle_tokens=int(rec.needle.sum()),
                    prompt_tokens=int(rec.positions[0]),
                )
            )
            print(f"{task}#{index}: dense answer {rec.answer!r} refs {sample.references} ({time.time() - start:.0f} s)")
            for budget in budgets:
                for name, stats in evaluate_recording(rec, variant_configs(names, budget)).items():
                    for stat, value in stats.items():
                        per_key[f"{task}|{budget}|{name}"][stat].append(value)
    summaries = {key: summarize({s: torch.stack(v) for s, v in stats.items()}) for key, stats in per_key.items()}
    real_rows = []
    if args.answers:
        samples = [
            generate_sample(t, tokenizer, args.length, i, args.seed)
            for t in args.tasks.split(",")
            for i in range(args.answers)
        ]
        answer_names = [n.replace("+", ",") for n in (args.answer_variants or args.variants).split(",") if n]
        configs = {
            f"{name}_{budget}": config
            for budget in [int(b) for b in (args.answer_budgets or args.budgets).split(",")]
            for name, config in variant_configs(answer_names, budget).items()
        }
        real_rows = real_answers(model, tokenizer, samples, configs, args.max_new_tokens)
    result = dict(
        meta=dict(
            command=command,
            seed=args.seed,
            length=args.length,
            steps=args.steps,
            samples=args.samples,
            device=args.device if args.device != "cpu" else (platform.processor() or "cpu"),
            dtype="float32",
            torch=torch.__version__,
            seconds=round(time.time() - start, 1),
            variants={n: variant_configs([n], budgets[0])[n.split("=")[0]].to_dict() for n in names},
        ),
        answers=answers,
        summaries=summaries,
        real_answers=real_rows,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnostics.json").write_text(json.dumps(result, indent=1))
    text = markdown(result) if summaries else f"Selection diagnostics: {command}\n"
    if real_rows:
        text += "\n**Real sparse path (SparseServeCache), RULER score**\n\n" + answers_markdown(real_rows)
    (args.out / "diagnostics.md").write_text(text)
    if summaries:
        plot(result, args.out / "recall_per_layer.png")
    print(text)
    return result


if __name__ == "__main__":
    main()
