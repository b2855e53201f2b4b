"""Registration of the "sparseserve" attention backend and its mask function with transformers."""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import sparseserve_attention_forward

ATTENTION_NAME = "sparseserve"


def register() -> None:
    """Make `attn_implementation="sparseserve"` available; safe to call any number of times.

    The mask entry is required: without one, transformers builds no mask for a custom backend,
    and left-padded batches and prefill over a past silently go wrong.
    """
    AttentionInterface.register(ATTENTION_NAME, sparseserve_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
