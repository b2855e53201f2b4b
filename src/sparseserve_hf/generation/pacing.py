"""PrefillPacer: the prefill work an iteration may run beside decoding rows, sized by a time target.

A decoding request's next token waits for everything its iteration runs: the batch's decode step
and the prefill work run in the same iteration. With `SparseServeConfig.target_tbt_ms` the
`Generator` asks the pacer how many token-layers of prefill an iteration with decoding rows may
run. The pacer keeps two running means, both measured by the engine as it serves: the decode
part of an iteration (from its start to the decode step's read-back) and the time of one
token-layer of prefill (an iteration's prefill work, timed to its end on the device, over the
token-layers it ran). The budget is what fits the target beside the decode part:

    budget = (target - decode part) / time per token-layer

Before it has timed any prefill the pacer answers one token-layer, so that an iteration runs one
unit of prefill and the cost is learnt. `BudgetedPrefill.advance` always runs at least one unit
(a layer over the prompt, or over one chunk of it), so prompts progress whatever the target; a
unit larger than the target's room overshoots it, and `max_inject_tokens` bounds the unit.
An iteration with no decoding row has nobody waiting: its prefill is not paced.
"""

from __future__ import annotations

import math

NEWEST_WEIGHT = 0.25  # weight of the newest measurement in each running mean


class PrefillPacer:
    """Token-layers of prefill per iteration for a target time between a decoding row's tokens.

    Args:
        target_s: the target time between tokens, in seconds (> 0).

    Example:
        >>> pacer = PrefillPacer(0.050)
        >>> pacer.decode_seconds(0.020); pacer.prefill_seconds(0.030, token_layers=1000)
        >>> pacer.budget(decode_rows=8)  # (0.050 - 0.020) / 3e-5
        1000
    """

    def __init__(self, target_s: float) -> None:
        if not isinstance(target_s, (int, float)) or isinstance(target_s, bool) or not 0 < target_s < math.inf:
            raise ValueError(f"target_s must be a positive number of seconds, got {target_s!r}")
        self.target_s = float(target_s)
        self.decode_s: float | None = None  # running mean: an iteration's start to its decode read-back
        self.token_layer_s: float | None = None  # running mean: one token-layer of prefill

    def budget(self, decode_rows: int) -> int | None:
        """Token-layers of prefill for an iteration with `decode_rows` decoding rows (None: unpaced)."""
        if decode_rows == 0:
            return None
        if self.token_layer_s is None:
            return 1  # one unit: its time teaches the cost
        room = self.target_s - (self.decode_s or 0.0)
        return max(1, int(room / self.token_layer_s)) if self.token_layer_s > 0 else None

    def totals(self) -> dict[str, float | None]:
        """What the pacer works from, for `Generator.metrics()`: the target, the decode part's and one
        token-layer's running means (None until measured)."""
        return {
            "pacing_target_ms": self.target_s * 1e3,
            "pacing_decode_ms": None if self.decode_s is None else self.decode_s * 1e3,
            "pacing_token_layer_us": None if self.token_layer_s is None else self.token_layer_s * 1e6,
        }

    def decode_seconds(self, seconds: float) -> None:
        """Record one iteration's decode part: from its start to its decode step's read-back."""
        self.decode_s = _running_mean(self.decode_s, seconds)

    def prefill_seconds(self, seconds: float, token_layers: int) -> None:
        """Record one iteration's prefill work: `token_layers` (> 0) done in `seconds`, to its end on the device."""
        if token_layers > 0:
            self.token_layer_s = _running_mean(self.token_layer_s, max(seconds, 0.0) / token_layers)


def _running_mean(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - NEWEST_WEIGHT) * mean + NEWEST_WEIGHT * value
