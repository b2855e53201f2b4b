"""The fused RMSNorm kernel against `reference.rms_norm`, bit for bit; the reference against
Llama's own module; and the reference's CUDA order against PyTorch's own CUDA mean (GPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernel_support import DEVICE, DTYPES, ON_GPU
from sparseserve_hf.ops import reference, triton_norm


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose magnitudes span decades (so the mean's order shows in its last bits) and a weight."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** (torch.rand(*shape[:-1], 1, generator=gen) * 4 - 2)
    hidden = (torch.randn(shape, generator=gen) * scale).to(dtype)
    weight = (1 + torch.randn(shape[-1], generator=gen) / 4).to(dtype)
    return hidden, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",  # decode steps of 16 and 1 rows (32 and 512 lanes a row), a prefill, a small model's width, H not 2^k
    [(16, 1, 4096), (1, 1, 4096), (3, 5, 576), (2, 1, 1000), (64, 1, 2048)],
)
def test_kernel_equals_the_cuda_order_reference_bit_for_bit(shape, dtype):
    hidden, weight = _inputs(shape, dtype, shape[-1] + shape[0])
    hidden, weight = hidden.to(DEVICE), weight.to(DEVICE)
    want = reference.rms_norm(hidden, weight, 1e-5, cuda_order=True)  # on the kernel's device: its rsqrt
    got = triton_norm.fused_rms_norm(hidden, weight, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 40])
def test_cuda_order_mean_is_a_mean_and_its_lanes_follow_the_rows(rows):
    x = torch.rand(rows, 4096, dtype=torch.float64)
    got = reference.cuda_row_mean(x.float().pow(2))
    torch.testing.assert_close(got.double(), x.float().double().pow(2).mean(-1, keepdim=True), rtol=1e-6, atol=0)
    assert reference.cuda_reduce_lanes(rows, 4096) == min(512, 512 // min(1 << (rows.bit_length() - 1), 16))


def test_inputs_outside_the_cuda_order_run_the_models_ops():
    """Widths the CUDA order does not describe (not a multiple of 4, <= 128), strided rows and CPU
    rows (PyTorch's CPU mean adds in another order) take the reference op for op: the model's norm."""
    rows = (torch.randn(3, 1, 130), torch.randn(3, 1, 96), torch.randn(4, 2, 256)[:, 1], torch.randn(3, 1, 256))
    for hidden in rows:
        hidden = hidden.to(DEVICE) if hidden.is_contiguous() else torch.randn(4, 2, 256, device=DEVICE)[:, 1]
        weight = torch.rand(hidden.shape[-1], device=DEVICE) + 0.5
        assert triton_norm.exact(hidden) == (ON_GPU and hidden.shape[-1] == 256 and hidden.is_contiguous())
        if not triton_norm.exact(hidden):
            assert torch.equal(triton_norm.rms_norm(hidden, weight, 1e-6), reference.rms_norm(hidden, weight, 1e-6))
    with pytest.raises(NotImplementedError, match="multiple of 4"):
        reference.cuda_row_mean(torch.rand(2, 130))


def test_kernel_promotes_to_the_weights_dtype():
    hidden, _ = _inputs((4, 1, 256), torch.float16, 3)
    weight = torch.rand(256, dtype=torch.float32) + 0.5
    hidden, weight = hidden.to(DEVICE), weight.to(DEVICE)
    got = triton_norm.fused_rms_norm(hidden, weight, 1e-6)
    assert got.dtype == torch.float32
    assert torch.equal(got, reference.rms_norm(hidden, weight, 1e-6, cuda_order=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_llamas_norm_bit_for_bit(dtype):
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    hidden = torch.randn(5, 3, 48).to(dtype)
    assert torch.equal(reference.rms_norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("width", [576, 2048, 3584, 4096, 5120, 8192])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 17, 64, 128])
def test_cuda_order_is_pytorchs_cuda_mean_and_the_kernel_llamas_norm(rows, width):
    """8192 is past the order's reach: there the norm runs the model's own ops."""
    hidden, weight = _inputs((rows, 1, width), torch.bfloat16, rows * width)
    hidden = hidden.cuda()
    assert triton_norm.exact(hidden) == (width < 8192)
    if width < 8192:
        squares = hidden.float().pow(2)
        assert torch.equal(reference.cuda_row_mean(squares), squares.mean(-1, keepdim=True))
    norm = LlamaRMSNorm(width, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    assert torch.equal(triton_norm.rms_norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden))


def test_the_probes_fitting_order_is_the_reference_and_its_rivals_differ():
    """`eval.bench.norm_order_probe` finds the order that fits PyTorch's CUDA mean on a GPU (4-vector
    loads, the lanes folded by halves down to one, the running sums chained); that candidate is
    `reference.cuda_row_mean`, and the probe's other candidates give other bits on some rows."""
    from eval.bench.norm_order_probe import candidate_mean

    x = (torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * 3).pow(2)
    for rows in (1, 2, 4, 8, 16):
        lanes = reference.cuda_reduce_lanes(rows, 4096)
        part = x[:rows]
        assert torch.equal(candidate_mean(part, lanes, True, True, False), reference.cuda_row_mean(part).view(-1))
    lanes = reference.cuda_reduce_lanes(64, 4096)
    for rival in (
        (lanes, True, False, False),
        (lanes, False, True, False),
        (lanes, True, True, True),
        (64, True, True, False),
    ):
        assert not torch.equal(candidate_mean(x, *rival), reference.cuda_row_mean(x).view(-1)), rival


def test_the_probe_runs(capsys, monkeypatch):
    from eval.bench import norm_order_probe

    monkeypatch.setattr("sys.argv", ["norm_order_probe", "--device", "cpu", "--rows", "2", "--widths", "576"])
    norm_order_probe.main()
    assert "width 576 rows 2:" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 1, 4096), (1, 1, 4096), (3, 5, 576)])
def test_the_residual_add_folded_into_the_kernel_is_the_models_add_then_norm(shape, dtype):
    hidden, weight = _inputs(shape, dtype, shape[-1] + 7)
    residual, _ = _inputs(shape, dtype, shape[-1] + 8)
    hidden, residual, weight = hidden.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE)
    want_normed, want_sum = reference.add_rms_norm(hidden, residual, weight, 1e-5, cuda_order=True)
    got_normed, got_sum = triton_norm.fused_add_rms_norm(hidden, residual, weight, 1e-5)
    assert torch.equal(got_sum, residual + hidden) and torch.equal(got_sum, want_sum)
    assert got_normed.dtype == want_normed.dtype and torch.equal(got_normed, want_normed)
    normed, summed = triton_norm.add_rms_norm(hidden, residual, weight, 1e-5)  # the op: the kernel on a GPU
    assert torch.equal(summed, want_sum) and torch.equal(normed, reference.rms_norm(summed, weight, 1e-5, ON_GPU))
