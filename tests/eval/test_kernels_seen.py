"""KernelsFirstSeen: the Triton specializations a process meets while a run is timed."""

from __future__ import annotations

import pytest
import torch
from eval.serving.kernels_seen import KernelsFirstSeen

triton = pytest.importorskip("triton")


def test_every_first_seen_specialization_is_recorded_and_the_earlier_hook_still_answers():
    calls, before = [], triton.knobs.runtime.jit_cache_hook

    def earlier(**kwargs):  # answers None: Triton compiles
        calls.append(kwargs["repr"])

    triton.knobs.runtime.jit_cache_hook = earlier
    try:
        with KernelsFirstSeen() as seen:
            hook = triton.knobs.runtime.jit_cache_hook  # what Triton calls on an in-process cache miss
            key = "[('*bf16', 'D'), ('i32', '')]CUDAOptions(num_warps=4, extern_libs=None)"  # Triton 3.6's form
            assert hook(key=key, repr="_score_kernel[num_warps=4](q: *bf16)", fn=None, compile={}) is None
            assert hook(key=2, repr="_combine_kernel[num_warps=8](x: *fp32)", fn=None, compile={}) is None
        assert triton.knobs.runtime.jit_cache_hook is earlier
        with pytest.raises(RuntimeError, match="mid-run"), KernelsFirstSeen():
            raise RuntimeError("mid-run")
        assert triton.knobs.runtime.jit_cache_hook is earlier  # put back on an exception too
        triton.knobs.runtime.jit_cache_hook = lambda **kwargs: True  # an earlier hook that skips the launch
        with KernelsFirstSeen():
            assert triton.knobs.runtime.jit_cache_hook(key=3, repr="k", fn=None, compile={}) is True
    finally:
        triton.knobs.runtime.jit_cache_hook = before
    assert [e["kernel"] for e in seen.events] == [
        "_score_kernel[num_warps=4](q: *bf16)",
        "_combine_kernel[num_warps=8](x: *fp32)",
    ]
    assert calls == [e["kernel"] for e in seen.events] and 0 <= seen.events[0]["t_s"] <= seen.events[1]["t_s"]
    assert [e["specialization"] for e in seen.events] == ["[('*bf16', 'D'), ('i32', '')]", "2"]


@pytest.mark.gpu
def test_a_kernel_first_launched_inside_is_seen_once_and_not_after():
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

    x = torch.zeros(8, device="cuda")
    with KernelsFirstSeen() as seen:
        _add_one[(1,)](x, 8, BLOCK=8)
        _add_one[(1,)](x, 8, BLOCK=8)  # the same specialization: no second event
    with KernelsFirstSeen() as again:
        _add_one[(1,)](x, 8, BLOCK=8)
    names = [e["kernel"].split("[")[0].rsplit(".", 1)[-1] for e in seen.events]  # Triton names it by qualname
    assert names == ["_add_one"] and again.events == []
    assert "i32" in seen.events[0]["specialization"] and "Options(" not in seen.events[0]["specialization"]
    assert torch.equal(x, torch.full((8,), 3.0, device="cuda"))
