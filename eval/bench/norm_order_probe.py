"""Whether `reference.cuda_row_mean` adds a mean's terms in the order PyTorch's CUDA kernel does.

    python -m eval.bench.norm_order_probe     # on a GPU; prints one line per shape, exits 1 on a mismatch
"""

from __future__ import annotations

import sys

import torch

from sparseserve_hf.ops import reference


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = 0
    for width in (576, 960, 2048, 2560, 4096, 5120, 8192):
        for rows in (1, 2, 3, 4, 5, 8, 12, 16, 17, 32, 64, 128):
            x = torch.randn(rows, 1, width, device="cuda", generator=gen) * torch.rand(rows, 1, 1, device="cuda", generator=gen) * 10
            squares = x.pow(2)
            want = squares.mean(-1, keepdim=True)
            got = reference.cuda_row_mean(squares)
            same = torch.equal(got, want)
            off = (got != want).sum().item()
            bad += not same
            print(f"width {width:5d} rows {rows:4d} lanes {reference.cuda_reduce_lanes(rows, width):4d} equal {same} rows_differing {off}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
