"""The reference ops against brute-force definitions on random inputs."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf.ops import reference


@pytest.mark.core
@pytest.mark.parametrize("group", [1, 3, 4])
def test_quest_score_is_the_elementwise_upper_bound(group):
    batch, kv_heads, blocks, size, dim = 2, 2, 5, 8, 16
    keys = torch.randn(batch, kv_heads, blocks, size, dim)
    query = torch.randn(batch, kv_heads * group, dim)
    scores = reference.score_blocks(query, reference.block_metadata(keys, "quest"), "quest")
    for b in range(batch):
        for h in range(kv_heads * group):
            for n in range(blocks):
                block = keys[b, h // group, n]  # (S, D)
                bound = torch.maximum(query[b, h] * block.min(0).values, query[b, h] * block.max(0).values).sum()
                torch.testing.assert_close(scores[b, h, n], bound)
                assert scores[b, h, n] >= (block @ query[b, h]).max() - 1e-5


def test_cuboid_score_is_the_dot_with_the_mean_key():
    keys = torch.randn(1, 2, 3, 8, 16)
    query = torch.randn(1, 4, 16)
    scores = reference.score_blocks(query, reference.block_metadata(keys, "cuboid"), "cuboid")
    expected = torch.einsum("hd,hnd->hn", query[0], keys[0].mean(-2).repeat_interleave(2, 0))
    torch.testing.assert_close(scores[0], expected)


def brute_force_selection(scores, count, k, sink, window):
    if count <= k:
        return list(range(count))
    forced = set(range(min(sink, count))) | set(range(max(count - window, 0), count))
    rest = sorted((i for i in range(count) if i not in forced), key=lambda i: -scores[i])
    return sorted(forced | set(rest[: k - len(forced)]))


@pytest.mark.core
@pytest.mark.parametrize("counts", [[0, 1, 3], [9, 17, 4], [40, 40, 2]])
@pytest.mark.parametrize("sink,window", [(1, 1), (0, 2), (2, 0)])
def test_select_blocks_matches_brute_force(counts, sink, window):
    k, heads = 6, 3
    scores = torch.randn(len(counts), heads, max(counts) + 3)
    index, valid = reference.select_blocks(scores, torch.tensor(counts), k, sink, window)
    assert index.shape == valid.shape == (len(counts), heads, k)
    for b, count in enumerate(counts):
        for h in range(heads):
            got = index[b, h][valid[b, h]].tolist()
            assert got == brute_force_selection(scores[b, h].tolist(), count, k, sink, window)


@pytest.mark.core
def test_aggregate_group_scores():
    scores = torch.randn(2, 6, 5)
    torch.testing.assert_close(reference.aggregate_group_scores(scores, 2, "max"), scores.view(2, 2, 3, 5).amax(2))
    torch.testing.assert_close(reference.aggregate_group_scores(scores, 2, "sum"), scores.view(2, 2, 3, 5).sum(2))


@pytest.mark.core
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_head_mask", [False, True])
def test_sparse_decode_equals_naive_attention_over_the_gathered_tokens(dtype, with_head_mask):
    batch, q_heads, kv_heads, size, dim, slots, loaded = 2, 6, 2, 8, 16, 12, 5
    pool = torch.randn(slots, 2, size, dim).to(dtype)
    chosen = torch.randint(0, slots, (batch, kv_heads, loaded))
    chosen[0, 1, 3:] = -1  # unused entries
    head_mask = torch.rand(batch, q_heads, loaded) > 0.3 if with_head_mask else None
    tail = torch.randn(batch, kv_heads, 2, size, dim).to(dtype)
    tail_len = torch.tensor([3, 8])
    query = torch.randn(batch, q_heads, dim).to(dtype)
    out = reference.sparse_decode(query, pool, chosen, head_mask, tail[:, :, 0], tail[:, :, 1], tail_len, 0.25)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // 3
            used = [
                s for u, s in enumerate(chosen[b, kv].tolist()) if s >= 0 and (head_mask is None or head_mask[b, h, u])
            ]
            keys = torch.cat([pool[s, 0] for s in used] + [tail[b, kv, 0, : tail_len[b]]]).float()
            values = torch.cat([pool[s, 1] for s in used] + [tail[b, kv, 1, : tail_len[b]]]).float()
            weights = torch.softmax(keys @ query[b, h].float() * 0.25, dim=0)
            torch.testing.assert_close(out[b, h].float(), weights @ values, **tolerance)


@pytest.mark.core
def test_sparse_decode_ignores_what_unused_entries_would_read():
    """Unused entries (-1) read slot 0; garbage there (a NaN in uninitialized pool memory) must not leak in."""
    batch, q_heads, kv_heads, size, dim = 1, 4, 2, 8, 16
    pool = torch.randn(4, 2, size, dim)
    slots = torch.tensor([[[2, -1], [3, -1]]])  # (B, Hkv, U): every row has an unused entry
    tail = torch.randn(batch, kv_heads, 2, size, dim)
    query, tail_len = torch.randn(batch, q_heads, dim), torch.tensor([5])
    clean = reference.sparse_decode(query, pool, slots, None, tail[:, :, 0], tail[:, :, 1], tail_len, 0.25)
    pool[0] = float("nan")  # slot 0 is not attended by anyone
    out = reference.sparse_decode(query, pool, slots, None, tail[:, :, 0], tail[:, :, 1], tail_len, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean)


@pytest.mark.core
def test_union_over_group_matches_sets():
    index = torch.tensor([[[0, 3, 5], [1, 3, 0], [2, 4, 0], [4, 6, 0]]])  # (B=1, Hq=4, K=3)
    valid = torch.tensor([[[True, True, True], [True, True, False], [True, True, False], [True, True, True]]])
    union, union_valid, head_mask = reference.union_over_group(index, valid, num_kv_heads=2, capacity=8)
    assert union.shape == (1, 2, 6) and head_mask.shape == (1, 4, 6)
    for kv_head, expected in enumerate([[0, 1, 3, 5], [0, 2, 4, 6]]):
        assert union[0, kv_head][union_valid[0, kv_head]].tolist() == expected
    for head in range(4):
        own = set(index[0, head][valid[0, head]].tolist())
        assert set(union[0, head // 2][head_mask[0, head]].tolist()) == own
    bare = reference.union_over_group(index, valid, num_kv_heads=2, capacity=8, with_head_mask=False)
    assert torch.equal(bare[0], union) and torch.equal(bare[1], union_valid) and bare[2] is None


@pytest.mark.core
@pytest.mark.parametrize("capacity", [3, 7])  # below and above G*K = 6
def test_union_width_does_not_depend_on_the_table_width(capacity):
    """U = G*K for any table width N: the attention's split over U (its float summation order), and so
    a graph step (fixed-width tables) and the eager step (tables grown on demand), see the same union."""
    index = torch.tensor([[[0, 1, 2], [1, 2, 0], [0, 2, 1], [1, 0, 2]]])  # (B=1, Hq=4, K=3), ids < 3
    valid = torch.tensor([[[True, True, True], [True, True, False], [True, False, False], [True, True, True]]])
    got = reference.union_over_group(index, valid, num_kv_heads=2, capacity=capacity)
    wide = reference.union_over_group(index, valid, num_kv_heads=2, capacity=300)
    assert got[0].shape == (1, 2, 6) and all(torch.equal(a, b) for a, b in zip(got, wide))
    assert got[1].sum(-1).tolist() == [[3, 3]]


@pytest.mark.parametrize("counts", [[12, 3], [5, 12]])
def test_select_blocks_unordered_picks_the_same_set(counts):
    """ordered=False (a union follows) skips only the sort: the same blocks, validity per entry."""
    scores = torch.randn(2, 3, 12)
    want_index, want_valid = reference.select_blocks(scores, torch.tensor(counts), 6, 1, 1)
    index, valid = reference.select_blocks(scores, torch.tensor(counts), 6, 1, 1, ordered=False)
    for row in range(2):
        for head in range(3):
            got = sorted(index[row, head][valid[row, head]].tolist())
            assert got == want_index[row, head][want_valid[row, head]].tolist()
    assert (index[~valid] == 0).all()


@pytest.mark.core
@pytest.mark.parametrize("with_head_mask", [False, True])
def test_dropping_the_columns_nobody_uses_keeps_the_attention(with_head_mask):
    """`attention.used_columns` (the eager CPU decode's trim of a mostly empty group union) changes no output."""
    from sparseserve_hf.attention import used_columns

    batch, q_heads, kv_heads, size, dim = 2, 6, 2, 8, 16
    pool = torch.randn(10, 2, size, dim)
    slots = torch.full((batch, kv_heads, 9), -1)
    slots[0, 0, :3], slots[1, 1, 2:5], slots[0, 1, 6] = torch.tensor([4, 1, 7]), torch.tensor([0, 9, 2]), 5
    head_mask = torch.rand(batch, q_heads, 9) > 0.3 if with_head_mask else None
    tail, tail_len, query = (
        torch.randn(batch, kv_heads, 2, size, dim),
        torch.tensor([3, 8]),
        torch.randn(batch, q_heads, dim),
    )
    stored, block_scales = reference.quantize_blocks(pool, torch.float8_e4m3fn)
    scales = block_scales[slots.clamp(min=0)]  # (B, Hkv, U, 2): trimmed along with the slots
    kept, kept_mask, kept_scales = used_columns(slots, head_mask, scales)
    assert kept.shape[-1] == 6 and (kept >= 0).sum() == (slots >= 0).sum()  # columns 0-4 and 6
    assert torch.equal(kept_scales, block_scales[kept.clamp(min=0)])
    args = (tail[:, :, 0], tail[:, :, 1], tail_len, 0.25)
    full = reference.sparse_decode(query, pool, slots, head_mask, *args)
    torch.testing.assert_close(reference.sparse_decode(query, pool, kept, kept_mask, *args), full)
    full_8bit = reference.sparse_decode(query, stored, slots, head_mask, *args, scales=scales)
    torch.testing.assert_close(
        reference.sparse_decode(query, stored, kept, kept_mask, *args, scales=kept_scales), full_8bit
    )
    assert used_columns(kept, kept_mask)[0] is kept  # nothing left to drop: the same tensors


@pytest.mark.core
def test_8bit_blocks_round_each_value_to_its_nearest_scaled_float8():
    """Each block's keys and its values get their own scale; the largest magnitude comes back
    exactly, every value within half a float8 step of itself, an all-zero part stays zero."""
    blocks = torch.randn(5, 2, 8, 16) * torch.tensor([0.01, 1.0, 30.0, 1e3, 1.0]).view(5, 1, 1, 1)
    blocks[4, 1] = 0.0
    stored, scales = reference.quantize_blocks(blocks, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn and stored.shape == blocks.shape and scales.shape == (5, 2)
    assert scales[4, 1] == 1.0 and torch.equal(scales[:4], blocks[:4].abs().amax(dim=(-2, -1)) / 448)
    back = reference.dequantize_blocks(stored, scales, torch.float32)
    largest = blocks.abs().flatten(2).argmax(-1, keepdim=True)
    torch.testing.assert_close(back.flatten(2).gather(-1, largest), blocks.flatten(2).gather(-1, largest))
    step = torch.maximum(blocks.abs() * 2.0**-3, scales[..., None, None] * 2.0**-9)  # normal / subnormal spacing
    assert ((back - blocks).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[4, 1], torch.zeros(8, 16))
