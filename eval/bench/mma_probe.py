"""Can a plain Triton kernel hand its own registers to a tensor-core instruction? (a GPU probe)

    python -m eval.bench.mma_probe          # on a CUDA GPU of compute capability 8.0 or newer

The channel scorer's multiply-adds would move to tensor cores if each lane could decode its codes
straight into an MMA operand's registers: plain `tl.dot` takes operands in a layout of its own and
moves them there through shared memory, which cost what the tensor cores saved. Here one warp holds
a 16 x 16 fp16 A and a 16 x 8 fp16 B in exactly PTX's `mma.m16n8k16` fragment layout (lane = 4 x
group + thread in group; lane-indexed tensors of 32 elements on one warp, one element per lane) and
runs the instruction through `tl.inline_asm_elementwise`. The probe prints whether the product
matches torch's and the SASS's count of HMMA instructions.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _mma_kernel(a_ptr, b_ptr, d_ptr):
    """One warp: D (16, 8) fp32 = A (16, 16) fp16 @ B (16, 8) fp16, A row-major and B stored as its
    (8, 16) transpose, both read as pairs of fp16 in int32 words."""
    lane = tl.arange(0, 32)
    group = lane // 4  # the fragment's row (A, D) or column (B)
    pair = lane % 4  # which pair of columns (A, D) or rows (B)
    a_words = a_ptr + group * 8 + pair  # A as (16, 8) words
    a0 = tl.load(a_words)
    a1 = tl.load(a_words + 64)  # row + 8
    a2 = tl.load(a_words + 4)  # column + 8
    a3 = tl.load(a_words + 68)
    b_words = b_ptr + group * 8 + pair  # B's transpose as (8, 8) words
    b0 = tl.load(b_words)
    b1 = tl.load(b_words + 4)  # row + 8
    zero = tl.zeros([32], tl.float32)
    d0, d1, d2, d3 = tl.inline_asm_elementwise(  # a kernel reads no global string: the instruction is spelled here
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, zero, zero, zero, zero],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
    )  # fmt: skip
    out = d_ptr + group * 8 + pair * 2  # D (16, 8)
    tl.store(out, d0)
    tl.store(out + 1, d1)
    tl.store(out + 64, d2)
    tl.store(out + 65, d3)


def probe() -> dict:
    """Run the kernel on random inputs; the largest difference from torch's product and the HMMA count."""
    torch.manual_seed(0)
    a = torch.randn(16, 16, device="cuda", dtype=torch.float16)
    b = torch.randn(16, 8, device="cuda", dtype=torch.float16)
    d = torch.empty(16, 8, device="cuda", dtype=torch.float32)
    compiled = _mma_kernel[(1,)](a.view(torch.int32), b.t().contiguous().view(torch.int32), d, num_warps=1)
    torch.cuda.synchronize()
    expected = a.float() @ b.float()
    sass = compiled.asm.get("sass", "") if hasattr(compiled, "asm") else ""
    return {
        "device": torch.cuda.get_device_name(),
        "triton": triton.__version__,
        "max_abs_diff": float((d - expected).abs().max()),
        "matches": bool(torch.allclose(d, expected, atol=1e-3, rtol=1e-3)),
        "hmma_in_sass": sass.count("HMMA"),
    }


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("mma_probe needs a CUDA GPU")
    print(json.dumps(probe()))


if __name__ == "__main__":
    main()
