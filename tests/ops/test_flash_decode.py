"""flash-attn-4 sparse decode (`ops.flash_decode`) and its plain-PyTorch helpers (`ops.flash_plan`).

Any machine (CI: CPU): the helpers against plain computations, and `flash_decode.sparse_decode`
end to end against the reference with a stand-in for `flash_attn.cute.flash_attn_varlen_func`
that follows fa4's semantics and asserts the input rules fa4 asserts (so the adapter's
reshapes, tables, chunks and merges are checked without fa4). GPU: the real fa4 kernel against the
reference; skipped unless CUDA, flash-attn-4 and a Hopper/Blackwell GPU are present.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from kernel_support import DEVICE, ON_GPU, tolerance
from sparseserve_hf import ops
from sparseserve_hf.ops import FLASH_ARCHS, flash_available, get_ops, reference
from sparseserve_hf.ops.flash_plan import MIN_PAGES_PER_SPLIT, merge_partials, num_chunks, page_tables, tail_attention
from sync_guard import forbid_host_syncs

FA4_DTYPES = [torch.bfloat16, torch.float16]
GPU_FA4 = ON_GPU and flash_available() and torch.cuda.get_device_capability()[0] in FLASH_ARCHS
on_fa4 = pytest.mark.skipif(not GPU_FA4, reason="needs flash-attn-4 on a Hopper or Blackwell CUDA GPU")


def flash_inputs(kv_heads, group, dim, dtype, masked, loaded=11, size=32):
    """Three rows: 0 a full tail, 1 an empty tail (tail_len 0), 2 a KV head with no loaded block.

    Slots have -1 holes (every third column from 1); column 0 stays valid except for row 2,
    KV head 0, whose page list is empty (its tail alone). With a head mask, every head of row 1
    sees column 0, so no head has neither a block nor a tail token.
    """
    batch = 3
    num_slots = batch * kv_heads * loaded + 5
    pool = torch.randn(num_slots, 2, size, dim).to(dtype)
    slots = torch.randperm(num_slots)[: batch * kv_heads * loaded].view(batch, kv_heads, loaded)
    if loaded:
        slots[..., 1::3] = -1
        slots[2, 0] = -1
    head_mask = None
    if masked:
        head_mask = torch.rand(batch, kv_heads * group, loaded) > 0.5
        if loaded:
            head_mask[1, :, 0] = True
    tail = torch.randn(batch, kv_heads, 2, size, dim).to(dtype)
    tail_len = torch.tensor([size, 0, size // 2 + 1])
    query = torch.randn(batch, kv_heads * group, dim).to(dtype)
    return query, pool, slots, head_mask, tail[:, :, 0], tail[:, :, 1], tail_len


def on_device(inputs):
    return [x.to(DEVICE) if x is not None else None for x in inputs]


# ---------------------------------------------------------------- helpers (CPU)


def test_num_chunks_fills_the_sms_with_a_few_pages_each():
    assert num_chunks(num_entries=8, num_loaded=63, num_sms=132) == 8  # ceil(63 / 8) caps ceil(132 / 8)
    assert num_chunks(num_entries=256, num_loaded=63, num_sms=132) == 1  # entries alone fill the GPU
    assert num_chunks(num_entries=8, num_loaded=MIN_PAGES_PER_SPLIT, num_sms=132) == 1
    assert num_chunks(num_entries=8, num_loaded=0, num_sms=132) == 1


@pytest.mark.parametrize("width", [1, 5, 11])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_page_tables_match_a_plain_loop(width, num_splits):
    slots = torch.randperm(100)[: 6 * width].view(6, width)
    slots[slots % 3 == 0] = -1  # holes anywhere
    slots[0] = -1  # an empty entry
    slots[1] = torch.arange(width)  # a full one
    table, pages = page_tables(slots, num_splits)
    cols = -(-width // num_splits)
    assert table.dtype == pages.dtype == torch.int32 and table.shape == (6 * num_splits, cols)
    for entry, row in enumerate(slots.tolist()):
        valid = [s for s in row if s >= 0]
        chunk = -(-len(valid) // num_splits)
        got = []
        for j in range(num_splits):
            k = entry * num_splits + j
            expected_pages = max(0, min(chunk, len(valid) - j * chunk))
            assert pages[k] == expected_pages
            got += table[k, :expected_pages].tolist()
            assert (table[k, expected_pages:] == 0).all()  # padding is a real slot, never -1
        assert sorted(got) == sorted(valid)


@pytest.mark.parametrize("tail_len", [[0, 5], [8, 1]])
def test_tail_attention_matches_a_plain_softmax(tail_len):
    query, keys, values = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)
    out, lse = tail_attention(query, keys, values, torch.tensor(tail_len), 0.3)
    assert out.shape == (2, 3, 4, 16) and lse.shape == (2, 3, 4)
    for row, n in enumerate(tail_len):
        if n == 0:
            assert (out[row] == 0).all() and torch.isneginf(lse[row]).all()
            continue
        logits = torch.einsum("hgd,hsd->hgs", query[row], keys[row, :, :n]) * 0.3
        torch.testing.assert_close(lse[row], torch.logsumexp(logits, -1))
        torch.testing.assert_close(out[row], torch.einsum("hgs,hsd->hgd", logits.softmax(-1), values[row, :, :n]))


def test_merge_partials_is_attention_over_the_union():
    logits, values = torch.randn(5, 30), torch.randn(5, 30, 16)  # 5 heads, 30 keys
    cuts = [(0, 7), (7, 7), (7, 19), (19, 30)]  # the second part is empty
    outs, lses = [], []
    for lo, hi in cuts:
        part = logits[:, lo:hi]
        if hi == lo:
            outs.append(torch.full((5, 16), float("nan")))  # an empty part's out may be anything
            lses.append(torch.full((5,), float("-inf")))
            continue
        outs.append(torch.einsum("hs,hsd->hd", part.softmax(-1), values[:, lo:hi]))
        lses.append(torch.logsumexp(part, -1))
    merged = merge_partials(torch.stack(outs, 1).half(), torch.stack(lses, 1))
    expected = torch.einsum("hs,hsd->hd", logits.softmax(-1), values)
    torch.testing.assert_close(merged, expected, **tolerance(torch.float16))


# ---------------------------------------------------------------- the adapter on CPU, fa4 stood in


class FakeFa4:
    """`flash_attn_varlen_func(q, k, v, seqused_k=, page_table=, softmax_scale=, return_lse=True)` in torch.

    Mirrors fa4's rules (flash_attn/cute/interface.py, `_flash_attn_fwd`): q (b, sq, h, d), k/v
    pages (num_pages, page_size, hk, d), h % hk == 0, fp16/bf16, int32 contiguous page_table
    (b, max_pages) and seqused_k (b,), 16-byte-aligned strides (else fa4 copies the pool). Reads a
    table entry only below seqused_k. Empty entries get garbage (NaN out, LSE 5): the adapter
    must not rely on fa4's output there.
    """

    def __init__(self):
        self.tables: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, q, k, v, *, seqused_k, page_table, softmax_scale, return_lse):
        batch, _, heads, dim = q.shape
        _, page_size, kv_heads, _ = k.shape
        assert return_lse and v.shape == k.shape and heads % kv_heads == 0 and k.shape[-1] == dim
        assert q.dtype in FA4_DTYPES and k.dtype == v.dtype == q.dtype
        for t in (k, v):
            assert t.stride(-1) == 1 and all(s % (16 // t.element_size()) == 0 for s in t.stride()[:-1])
        assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1 and page_table.shape[0] == batch
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (batch,) and seqused_k.stride(0) == 1
        self.tables.append((page_table.clone(), seqused_k.clone()))
        tokens = torch.arange(page_table.shape[1] * page_size, device=q.device)
        used = tokens < seqused_k[:, None]  # (b, T)
        pages = torch.where(used, page_table[:, tokens // page_size], 0).long()
        group = heads // kv_heads

        def gather(x):  # (b, T, h, d): query head h reads KV head h // group
            got = x[pages, tokens % page_size].float()  # (b, T, hk, d)
            return got[:, :, :, None].expand(-1, -1, -1, group, -1).flatten(2, 3)

        logits = torch.einsum("bqhd,bthd->bhqt", q.float(), gather(k)) * softmax_scale
        logits = logits.masked_fill(~used[:, None, None, :], float("-inf"))
        out = torch.einsum("bhqt,bthd->bqhd", logits.softmax(-1), gather(v)).to(q.dtype)
        lse = torch.logsumexp(logits, -1)  # (b, h, sq)
        empty = seqused_k == 0
        return out.masked_fill(empty[:, None, None, None], float("nan")), lse.masked_fill(empty[:, None, None], 5.0)


@pytest.fixture
def fake_flash(monkeypatch):
    """`ops.flash_decode` imported against a FakeFa4; the real module (if any) is restored after."""
    fake = FakeFa4()
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fake
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    name = "sparseserve_hf.ops.flash_decode"
    saved_module, saved_attr = sys.modules.pop(name, None), ops.__dict__.pop("flash_decode", None)
    try:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "_num_sms", lambda device: 16)
        yield module, fake
    finally:
        sys.modules.pop(name, None)
        ops.__dict__.pop("flash_decode", None)
        if saved_module is not None:
            sys.modules[name] = saved_module
        if saved_attr is not None:
            ops.flash_decode = saved_attr


@pytest.mark.parametrize("dtype", FA4_DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_adapter_matches_reference_with_fa4_stood_in(fake_flash, poisoned, dtype, kv_heads, group, masked, num_splits):
    flash_decode, fake = fake_flash
    inputs = flash_inputs(kv_heads, group, 16, dtype, masked, size=8)
    expected = reference.sparse_decode(*inputs, 0.3)
    got = flash_decode.sparse_decode(*on_device(inputs), 0.3, num_splits=num_splits).cpu()
    assert got.dtype == dtype and got.shape == expected.shape and not got.isnan().any()
    torch.testing.assert_close(got, expected, **tolerance(dtype))
    (table, seqused), pool_pages = fake.tables[-1], inputs[1].shape[0]
    assert ((table >= 0) & (table < pool_pages)).all() and (seqused % 8 == 0).all()


def test_adapter_attends_only_the_tail_when_nothing_is_loaded(fake_flash, poisoned):
    flash_decode, fake = fake_flash
    inputs = flash_inputs(2, 4, 16, torch.float16, False, loaded=0, size=8)
    inputs = (*inputs[:6], torch.tensor([8, 3, 1]))  # every row needs a tail token when U = 0
    got = flash_decode.sparse_decode(*on_device(inputs), 0.3).cpu()
    torch.testing.assert_close(got, reference.sparse_decode(*inputs, 0.3), **tolerance(torch.float16))
    assert fake.tables == []  # fa4 is not called with a zero-width table


def test_adapter_runs_fp32_on_the_triton_kernel(fake_flash):
    flash_decode, fake = fake_flash
    inputs = flash_inputs(2, 4, 16, torch.float32, True, size=8)
    got = flash_decode.sparse_decode(*on_device(inputs), 0.3).cpu()  # fa4 has no fp32: the Triton kernel
    torch.testing.assert_close(got, reference.sparse_decode(*inputs, 0.3), **tolerance(torch.float32))
    assert fake.tables == []


@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
def test_adapter_needs_no_host_sync(fake_flash, masked):
    flash_decode, _ = fake_flash
    inputs = on_device(flash_inputs(2, 4, 16, torch.float16, masked, size=8))
    with forbid_host_syncs() as seen:
        flash_decode.sparse_decode(*inputs, 0.3)
    assert seen == []


# ---------------------------------------------------------------- the real fa4 kernel (GPU)


@pytest.fixture
def flash():
    pytest.importorskip("flash_attn.cute")
    from sparseserve_hf.ops import flash_decode

    return flash_decode


def run_both(flash, inputs, scaling, num_splits=None):
    expected = reference.sparse_decode(*inputs, scaling)
    return flash.sparse_decode(*on_device(inputs), scaling, num_splits=num_splits), expected


@pytest.mark.gpu
@on_fa4
@pytest.mark.parametrize("dtype", FA4_DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
@pytest.mark.parametrize("dim", [64, 128])
def test_flash_decode_matches_reference(flash, poisoned, dtype, kv_heads, group, masked, dim):
    inputs = flash_inputs(kv_heads, group, dim, dtype, masked)
    got, expected = run_both(flash, inputs, dim**-0.5)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))


@pytest.mark.gpu
@on_fa4
@pytest.mark.parametrize("num_splits", [1, 3, 100])  # one, several, more chunks than pages
def test_flash_split_count_does_not_change_the_result(flash, poisoned, num_splits):
    inputs = flash_inputs(2, 4, 128, torch.bfloat16, False, loaded=37)
    got, expected = run_both(flash, inputs, 128**-0.5, num_splits=num_splits)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.bfloat16))


@pytest.mark.gpu
@on_fa4
def test_flash_only_the_tail_when_nothing_is_loaded(flash, poisoned):
    inputs = flash_inputs(2, 4, 128, torch.float16, False, loaded=0)
    inputs = (*inputs[:6], torch.tensor([32, 3, 1]))
    got, expected = run_both(flash, inputs, 128**-0.5)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float16))


@pytest.mark.gpu
@on_fa4
def test_flash_ignores_blocks_a_head_may_not_see(flash, poisoned):
    query, pool, slots, _, tail_k, tail_v, _ = flash_inputs(1, 4, 128, torch.float16, False)
    head_mask = torch.zeros(3, 4, slots.shape[2], dtype=torch.bool)
    head_mask[:, 1, 0] = True  # head 1 of every row sees one block (column 0: valid except row 2)
    seen = slots[:, 0, 0][slots[:, 0, 0] >= 0]
    poisoned_pool = torch.full_like(pool, 1e4)
    poisoned_pool[seen] = pool[seen]  # every block but the seen ones is huge
    inputs = (query, poisoned_pool, slots, head_mask, tail_k, tail_v, torch.tensor([32, 5, 1]))
    got, _ = run_both(flash, inputs, 128**-0.5)
    expected = reference.sparse_decode(query, pool, slots, head_mask, tail_k, tail_v, inputs[-1], 128**-0.5)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float16))


@pytest.mark.gpu
@on_fa4
@pytest.mark.parametrize("dtype", FA4_DTYPES, ids=str)
def test_flash_decode_llama_shape_without_host_sync(flash, dtype):
    """Llama-3-8B decode (Hq 32, Hkv 8, D 128, 32-token blocks, 64 loaded), as `get_ops("flash")` runs it."""
    decode = get_ops("flash", torch.device("cuda")).sparse_decode
    assert decode is flash.sparse_decode
    inputs = flash_inputs(8, 4, 128, dtype, False, loaded=64)
    cuda_inputs = on_device(inputs)
    decode(*cuda_inputs, 128**-0.5)  # compile outside the guard
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = decode(*cuda_inputs, 128**-0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = reference.sparse_decode(*inputs, 128**-0.5)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))
