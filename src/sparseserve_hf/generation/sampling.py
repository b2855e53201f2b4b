"""Next-token choice for a batch of rows that each have their own SamplingParams."""

from __future__ import annotations

import torch

from .params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own random stream (None for greedy requests, which need none)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample_next(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Pick one token per row; never raises over bad logits.

    A row whose logits are not all finite (NaN or inf: an overflow, a broken forward) gets -1
    instead of a token and is never sampled: `torch.multinomial` over NaN probabilities raises on
    CPU and trips a device-side assert on CUDA, which would poison every later CUDA call of the
    process. The caller ends such a request; the other rows' picks do not depend on it (each
    draws from its own generator), and nothing here reads the device back.

    Args:
        logits: (B, V) next-token logits.
        params: B SamplingParams, one per row.
        generators: B random streams (None for greedy rows).
    Returns:
        (B,) long token ids, -1 where the row's logits were not finite.
    """
    finite = torch.isfinite(logits).all(dim=-1)  # (B,)
    logits = torch.where(finite[:, None], logits, 0.0)  # bad rows: any valid distribution, discarded below
    tokens = logits.argmax(dim=-1)  # greedy rows are done here
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs, order = _filtered_probs(logits[rows].float(), [params[i] for i in rows])  # (R, V) each
        for j, row in enumerate(rows):
            # One draw per row from its own generator: a request's draws do not depend on its batch.
            pick = torch.multinomial(probs[j], 1, generator=generators[row])
            tokens[row] = order[j, pick[0]]
    return torch.where(finite, tokens, -1)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k and top-p per row. Returns probs over sorted tokens (R, V) and the sort order."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]  # (R, 1)
    top_k = torch.tensor([p.top_k or logits.shape[-1] for p in params], device=device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    ordered, order = (logits / temperature).sort(dim=-1, descending=True)  # (R, V)
    rank = torch.arange(logits.shape[-1], device=device)
    ordered = ordered.masked_fill(rank >= top_k, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    probs = probs.masked_fill(before >= top_p, 0.0)  # the most likely token always survives
    return probs, order
