"""SamplingParams: how one request samples and when it stops (validated at construction)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Sampling divides the logits by the temperature in float32 (`sampling.py`). Below 1e-5 a positive
# temperature either rounds to 0 (1e-50 -> inf / nan logits) or blows finite logits past float32's
# range (1e-40: logit 40 -> 4e41 = inf); either way no token can be drawn. 1e-5 keeps logits up to
# ~3e33 finite, and near-greedy sampling is what such a temperature asks for anyway.
MIN_TEMPERATURE = 1e-5
# Above this a temperature is inf in float32 (every logit / inf = 0, and -inf / inf = nan).
MAX_TEMPERATURE = 3.0e38
# top_p is compared with float32 cumulative probabilities: under ~1e-45 it is 0 there, and then even
# the most likely token is filtered out. 1e-30 is a round bound well inside float32's normal range.
MIN_TOP_P = 1e-30
# `torch.Generator.manual_seed` takes seeds in [-2**63, 2**64); negative ones alias 2**64 + seed, so
# only the non-negative half is accepted (one seed, one stream).
SEED_LIMIT = 2**64
# top_k travels to the sampler as an int64 tensor.
TOP_K_LIMIT = 2**63


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request decoding options.

    Every field is checked at construction; a bad one raises ValueError naming the field (like
    `SparseServeConfig`), so a request never reaches the engine with values the sampler cannot use.

    Attributes:
        max_new_tokens: most tokens to generate (an int >= 1).
        temperature: 0 = greedy (argmax); otherwise divides the logits before sampling, a number
            in [1e-5, 3e38] (`MIN_TEMPERATURE`, `MAX_TEMPERATURE`: sampling runs in float32,
            where a smaller temperature turns the logits into inf or nan).
        top_k: keep the k most likely tokens before sampling; 0 = off (an int in [0, 2**63)).
        top_p: keep the smallest set of tokens whose probability reaches p (nucleus); 1 = off
            (a number in [1e-30, 1]).
        seed: seeds this request's own `torch.Generator`, so its random draws do not depend on
            the other requests in the batch (its logits still may, in their last bits: a batched
            matrix product rounds differently from a single row's, and a sampled token or a block
            selection near a tie can follow); an int in [0, 2**64), or None = a fresh random seed.
        stop: strings that end generation when they appear in the text (needs a tokenizer);
            the returned text stops before the first of them, `token_ids` keep the tokens that
            produced it. A list or tuple of non-empty strings, or one string (= one stop string,
            as in vLLM); stored as a tuple.
        stop_token_ids: extra token ids that end generation (kept in `token_ids`): a list or
            tuple of ints >= 0, stored as a tuple.
        ignore_eos: keep generating past the model's EOS token (a bool).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        _check_temperature(self.temperature)
        if not _is_int(self.top_k) or not 0 <= self.top_k < TOP_K_LIMIT:
            raise ValueError(f"top_k must be an int in [0, 2**63) (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            raise ValueError(f"top_p must be a number in [{MIN_TOP_P:g}, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {self.seed!r}")
        # frozen: the normalized tuples are written past the dataclass's own __setattr__.
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):  # "no" or 0 would silently mean something
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")  # noqa: TRY004

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0


def _check_temperature(value: object) -> None:
    # Written so that NaN (which fails every comparison) is refused too.
    if not _is_number(value) or not (value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise ValueError(
            f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (sampling "
            f"divides the logits in float32, where a smaller one turns them into inf/nan), got {value!r}"
        )


def _stop_strings(value: object) -> tuple[str, ...]:
    """`stop` as a tuple: one string is one stop string; a list or tuple of non-empty strings."""
    strings = (value,) if isinstance(value, str) else _as_tuple(value)
    if strings is None or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop must be a non-empty string or a list/tuple of non-empty strings, got {value!r}")
    return strings


def _stop_token_ids(value: object) -> tuple[int, ...]:
    ids = _as_tuple(value)
    if ids is None or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids must be a list/tuple of ints >= 0, got {value!r}")
    return ids


def _as_tuple(value: object) -> tuple[object, ...] | None:
    """A list, tuple or other sequence as a tuple; None for anything else (a str is not a list)."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        return None
    return tuple(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
