"""Which order of additions reproduces PyTorch's float32 mean over a row, bit for bit (GPU: ~1 min).

    python -m eval.bench.norm_order_probe > eval/results/norm_order/probe_h200.txt
    python -m eval.bench.norm_order_probe --device cpu --rows 1 2 --widths 576   # runs anywhere

`reference.cuda_row_mean` (the spec of the fused RMSNorm) models PyTorch's CUDA reduction: each
of a row's lanes adds every lane-th 4-vector into four running sums, combined first to last, and
the lanes are folded into one. This script tries the candidate orders (lanes per row, 4-vector or
element-strided loads, the last 32 lanes folded by halves or by neighbours, the four running sums
combined in a chain or pairwise) against `x.mean(-1)` on eight draws of rows whose magnitudes
span decades, and prints, per (width, rows), every candidate that matched all of them.
"""

from __future__ import annotations

import argparse
import itertools

import torch

VECTOR = 4
LANE_CHOICES = (16, 32, 64, 128, 256, 512)
DRAWS = 8


def candidate_mean(x: torch.Tensor, lanes: int, vectorized: bool, halves: bool, pairwise: bool) -> torch.Tensor:
    """(R, H) -> (R,): the row means under one candidate order."""
    rows, width = x.shape
    per_round = lanes * VECTOR
    rounds = -(-width // per_round)
    padded = torch.zeros(rows, rounds * per_round, dtype=x.dtype, device=x.device)
    padded[:, :width] = x  # zeros add nothing to a sum of squares
    if vectorized:  # [round, lane, i] = 4 (lane + lanes * round) + i
        chunks = padded.view(rows, rounds, lanes, VECTOR)
    else:  # [round, lane, i] = lane + lanes (4 round + i)
        chunks = padded.view(rows, rounds, VECTOR, lanes).transpose(2, 3)
    running = chunks[:, 0]
    for step in range(1, rounds):
        running = running + chunks[:, step]
    if pairwise:
        total = (running[..., 0] + running[..., 1]) + (running[..., 2] + running[..., 3])
    else:
        total = ((running[..., 0] + running[..., 1]) + running[..., 2]) + running[..., 3]
    while total.shape[1] > 1:
        half = total.shape[1] // 2
        by_halves = half >= 32 or halves
        total = total[:, :half] + total[:, half:] if by_halves else total[:, 0::2] + total[:, 1::2]
    scale = (torch.tensor(1.0) / torch.tensor(float(width))).item()
    return total[:, 0] * scale


def matching_orders(width: int, rows: int, device: torch.device, gen: torch.Generator) -> list[tuple]:
    """The candidates (lanes, vectorized, halves, pairwise) that equal `mean` on every draw."""
    fits = None
    for _ in range(DRAWS):
        scale = 10 ** (torch.rand(rows, 1, generator=gen) * 4 - 2)
        squares = (torch.randn(rows, width, generator=gen) * scale).to(device).pow(2)
        want = squares.mean(-1)
        ok = {
            choice
            for choice in itertools.product(LANE_CHOICES, (True, False), (True, False), (False, True))
            if torch.equal(candidate_mean(squares, *choice), want)
        }
        fits = ok if fits is None else fits & ok
    return sorted(fits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--widths", type=int, nargs="+", default=[576, 4096])
    args = parser.parse_args()
    device, gen = torch.device(args.device), torch.Generator().manual_seed(1)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print("candidates that matched all draws: (lanes, 4-vector loads, last 32 lanes by halves, pairwise combine)")
    for width in args.widths:
        for rows in args.rows:
            print(f"width {width} rows {rows}: {matching_orders(width, rows, device, gen)}")


if __name__ == "__main__":
    main()
