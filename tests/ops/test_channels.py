"""Triton channel scores against `ops.channels` (the spec)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernel_support import DEVICE, DTYPES, ON_GPU
from sparseserve_hf.ops import channels, triton_channels

FP8 = torch.float8_e4m3fn


def ragged_table(batch: int, kv_heads: int, width: int, pool_size: int, counts: list[int]) -> torch.Tensor:
    """(B, Hkv, N) distinct random DRAM ids, row b using its first counts[b] entries, -1 after."""
    ids = torch.randperm(pool_size)[: batch * kv_heads * width].view(batch, kv_heads, width)
    return ids.masked_fill(torch.arange(width) >= torch.tensor(counts)[:, None, None], -1)


def channel_pool(size: int, block_size: int, dim: int, share: float) -> torch.Tensor:
    """(C, M, D) metadata of random blocks whose channels have different ranges, under a random profile."""
    keys = torch.randn(size, block_size, dim) * torch.rand(dim) * 4
    return channels.channel_metadata(keys, share, FP8, torch.rand(size, dim))


CASES = [  # (kv_heads, group, dim, share): every group shape, head size and share, each dtype at the step's shape
    *[(1, 4, 128, 0.375, dtype) for dtype in DTYPES],
    (2, 1, 16, 0.375, torch.float32),
    (2, 3, 64, 0.375, torch.float32),
    (2, 3, 64, 1.0, DTYPES[0]),
    (1, 4, 24, 0.5, torch.float32),
    (2, 1, 128, 0.375, DTYPES[-1]),
]


@pytest.fixture(autouse=True)
def fma_kernel(monkeypatch):
    """The tests here check the FMA kernel, exact to fp32's rounding; the tensor-core form (the default
    where its shape fits a GPU) has its own test, which turns it back on."""
    monkeypatch.setattr(triton_channels, "MMA", False)


@pytest.mark.parametrize("kv_heads,group,dim,share,dtype", CASES, ids=str)
def test_block_logsumexp_matches_reference(poisoned, dtype, kv_heads, group, dim, share):
    torch.manual_seed(dim + group)
    counts = [37, 5, 0]  # odd, short and empty rows; N = 37 spans three 16-block tiles
    table = ragged_table(3, kv_heads, 37, 400, counts)
    metadata = channel_pool(400, 32, dim, share)  # (C, M, D)
    stored = channels.stored_channels(share, dim)
    query = torch.randn(3, kv_heads * group, dim).to(dtype)
    expected = channels.block_logsumexp(query, metadata, table, 32, stored, dim**-0.5)
    got = triton_channels.block_logsumexp(
        query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), 32, stored, dim**-0.5
    )
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(torch.isneginf(got).cpu(), table.repeat_interleave(group, 1) < 0)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-5)


KNOB_SETTINGS = [{"PREFETCH": False, "HOIST_Q": False}, {"BLOCK_N": 8}, {"PREFETCH": False, "STAGES": 2},
                 {"HOIST_Q": False}, {"PREFETCH": False, "BLOCK_N": 8}, {"NATIVE_FP8": True},
                 {"NATIVE_FP8": False}, {"NATIVE_FP8": False, "WORDS": False}, {"Q_AHEAD": True},
                 {"Q_AHEAD": True, "BLOCK_N": 8}]  # fmt: skip


@pytest.mark.parametrize("knobs", KNOB_SETTINGS, ids=str)
def test_launch_forms_match_reference(poisoned, monkeypatch, knobs):
    for name, value in knobs.items():
        monkeypatch.setattr(triton_channels, name, value)
    torch.manual_seed(11)
    table = ragged_table(3, 2, 37, 400, [37, 5, 0])
    metadata = channel_pool(400, 32, 128, 0.375)
    query = torch.randn(3, 8, 128).to(DTYPES[-1])
    expected = channels.block_logsumexp(query, metadata, table, 32, 48, 128**-0.5)
    got = triton_channels.block_logsumexp(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), 32, 48, 128**-0.5)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 64])
def test_other_block_sizes_match_reference(poisoned, block_size):
    torch.manual_seed(block_size)
    table = ragged_table(2, 2, 20, 100, [20, 7])
    metadata = channel_pool(100, block_size, 64, 0.375)
    query = torch.randn(2, 6, 64)
    expected = channels.block_logsumexp(query, metadata, table, block_size, 24, 0.125)
    got = triton_channels.block_logsumexp(
        query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), block_size, 24, 0.125
    )
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-5)


def test_score_channels_matches_reference_with_strided_tables_and_queries(poisoned):
    torch.manual_seed(5)
    metadata = channel_pool(300, 32, 64, 0.375)
    wide = ragged_table(2, 3, 48, 300, [48, 20])
    table = wide[:, :, :40]  # a view: rows strided past its width, as a graph step's fixed-width tables
    query = torch.randn(2, 64, 9).transpose(1, 2)  # (B, Hq, D) strided on every dim
    expected = channels.score_channels(query, metadata, table, 32, 24, 0.125)
    estimate = triton_channels.block_logsumexp(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), 32, 24, 0.125)
    got = channels.block_mass(estimate)  # as the channel scorer composes them
    torch.testing.assert_close(got.cpu(), expected, atol=1e-6, rtol=1e-4)
    assert torch.allclose(got[0].sum(-1).cpu(), torch.ones(9))


def test_empty_table_returns_empty():
    metadata = channel_pool(4, 32, 16, 0.375).to(DEVICE)
    query = torch.zeros(0, 4, 16, device=DEVICE)
    out = triton_channels.block_logsumexp(
        query, metadata, torch.zeros(0, 2, 5, dtype=torch.long, device=DEVICE), 32, 6, 0.25
    )
    assert out.shape == (0, 4, 5)


@pytest.mark.parametrize("with_feedback", [False, True])
def test_feedback_mass_matches_reference(poisoned, monkeypatch, with_feedback):
    monkeypatch.setattr(triton_channels, "MASS_BLOCK", 16)  # rows of 37 blocks take three passes
    torch.manual_seed(3)
    estimate = torch.randn(3, 8, 37) * 4
    estimate[0, :, 30:] = float("-inf")  # past a row's table
    estimate[2] = float("-inf")  # a row without blocks
    picked = torch.randint(0, 37, (3, 2, 9))
    picked[0, 0, :3] = torch.tensor([31, 5, 5])  # outside the table, then a repeated position
    exact = torch.randn(3, 8, 9) * 6
    exact[1, :, ::2] = float("-inf")  # heads that attended none of those blocks
    fed_back = (picked, exact) if with_feedback else None
    expected = channels.feedback_mass(estimate, fed_back)
    on_device = None if fed_back is None else (picked.to(DEVICE), exact.to(DEVICE))
    got = triton_channels.feedback_mass(estimate.to(DEVICE), on_device)
    assert torch.equal(torch.isneginf(got).cpu(), torch.isneginf(expected))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-7, rtol=1e-5)
    assert torch.allclose(got[:2].clamp(min=0).sum(-1).cpu(), torch.ones(2, 8), atol=1e-6)  # -inf: no mass


@pytest.mark.parametrize("native", [False, True] if not ON_GPU or triton_channels.native_fp8(DEVICE) else [False])
def test_every_8bit_value_decodes_as_torch_reads_it(native):
    """Each of the 254 non-NaN float8_e4m3fn bytes (zeros, subnormals, both signs, +-448), from its
    bits or in hardware, is the value torch gives it."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.int32)
    out = torch.empty(codes.shape, dtype=torch.float32, device=DEVICE)
    _decode_bytes[(1,)](codes.to(DEVICE), out, codes.numel(), NATIVE=native, BLOCK=256)
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu(), expected)


@triton.jit
def _decode_bytes(codes_ptr, out_ptr, count, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    byte = tl.load(codes_ptr + i, mask=i < count, other=0)
    tl.store(out_ptr + i, triton_channels._fp8_value(byte, NATIVE), mask=i < count)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the tensor-core form is inline PTX: CUDA only")
@pytest.mark.parametrize("kv_heads,group,dim,share", [(1, 4, 128, 0.375), (2, 3, 64, 1.0), (2, 1, 128, 0.375)], ids=str)
def test_tensor_core_form_matches_reference(poisoned, monkeypatch, kv_heads, group, dim, share):
    """`triton_channels.MMA`: the products on tensor cores with fp16 weights, within fp16's rounding of them."""
    from sparseserve_hf.ops import triton_channels_mma

    monkeypatch.setattr(triton_channels, "MMA", True)
    torch.manual_seed(dim + group)
    stored = channels.stored_channels(share, dim)
    assert triton_channels_mma.fits(32, stored, group, DEVICE)
    table = ragged_table(3, kv_heads, 37, 400, [37, 5, 0])  # 37 blocks: programs of 16, 16 and 5
    metadata = channel_pool(400, 32, dim, share)
    query = torch.randn(3, kv_heads * group, dim, dtype=torch.bfloat16)
    expected = channels.block_logsumexp(query, metadata, table, 32, stored, dim**-0.5)
    got = triton_channels.block_logsumexp(
        query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), 32, stored, dim**-0.5
    )
    assert torch.equal(torch.isneginf(got).cpu(), table.repeat_interleave(group, 1) < 0)
    finite = ~torch.isneginf(expected)
    torch.testing.assert_close(got.cpu()[finite], expected[finite], atol=5e-2, rtol=5e-3)  # a wrong lane: O(1)


def _tensor_core_lanes(block: torch.Tensor, scaled: torch.Tensor, stored: int) -> torch.Tensor:
    """The tensor-core kernel's lane arithmetic for one block, on the CPU in fp32: the words each lane
    of `triton_channels_mma` loads, where each value lands in the MMA's fragments (lane 4g + t holds
    A's row g and B's column g at k positions 2t, 2t + 1, 2t + 8, 2t + 9, for its channels 4t, 4t + 2,
    4t + 1, 4t + 3 of a 16-channel step), and the products PTX defines on them. block (M, D) metadata,
    scaled (G, D) queries times the softmax scale -> (G,) the block's log-sum-exps."""
    group, dim = scaled.shape
    words = block.view(torch.uint8).flatten().view(torch.int32).tolist()
    header = channels.header_start(32, stored, dim) // 4

    def byte(word: int, k: int) -> int:
        return ((word & 0xFFFFFFFF) >> (8 * k)) & 0xFF

    def fp8(value: int) -> float:
        return torch.tensor([value], dtype=torch.uint8).view(FP8).float().item()

    logits, offset, kept = torch.zeros(group, 32), torch.zeros(group), torch.zeros(group)
    for step in range(stored // 16):
        weights, sums = (
            torch.zeros(16, 16),
            torch.zeros(16, 16),
        )  # A of the codes' product; of the sums' (rows g, g + 8)
        codes = torch.zeros(4, 16, 8)  # B of each 8-token tile
        for lane in range(32):
            g, t = lane // 4, lane % 4
            first = step * 16 + 4 * t
            pairs = words[header + (first % (stored // 2)) // 4]
            lows, steps = (
                words[header + (stored // 2 + first) // 4],
                words[header + (stored // 2 + stored + first) // 4],
            )
            half = (first // (stored // 2)) * (dim // 2)
            for k, position in enumerate((2 * t, 2 * t + 8, 2 * t + 1, 2 * t + 9)):  # channel first + k
                q = scaled[g, half + byte(pairs, k)].item() if g < group else 0.0
                weights[g, position] = q * fp8(byte(steps, k))
                sums[g, position], sums[g + 8, position] = q * fp8(byte(lows, k)), abs(q)
                for tile in range(4):  # token 8 * tile + g: code row 2 * tile + g // 4, bits 2 * (g % 4)
                    word = words[((2 * tile + g // 4) * stored) // 4 + 4 * step + t]
                    codes[tile, position, g] = (byte(word, k) >> (2 * (g % 4))) & 3
        totals = sums @ torch.ones(16, 8)
        offset += totals[:group, 0]
        kept += totals[8 : 8 + group, 0]
        for tile in range(4):
            logits[:, 8 * tile : 8 * tile + 8] += (weights @ codes[tile])[:group]
    correction = 1 / (kept / scaled.abs().sum(-1)).clamp(min=1e-6).sqrt()
    return torch.logsumexp((logits + offset[:, None]) * correction[:, None], dim=-1)


@pytest.mark.parametrize("group,dim,share", [(4, 128, 0.375), (3, 64, 1.0)], ids=str)
def test_tensor_core_lanes_compute_the_spec(group, dim, share):
    """The index arithmetic of `triton_channels_mma` (which word each lane reads, which k position each
    byte takes in A and B, which code row and bits a token has) gives the spec's estimate, in fp32 on
    the CPU (the kernel itself runs PTX: its test is GPU-only)."""
    torch.manual_seed(group + dim)
    stored = channels.stored_channels(share, dim)
    metadata = channel_pool(8, 32, dim, share)
    query = torch.randn(1, group, dim)
    expected = channels.block_logsumexp(query, metadata, torch.tensor([[[5]]]), 32, stored, dim**-0.5)[0, :, 0]
    got = _tensor_core_lanes(metadata[5], query[0] * dim**-0.5, stored)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
