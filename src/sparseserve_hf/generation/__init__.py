"""The batching Generator: requests, admission, layer-segmented prefill, the continuous-batching loop.

Created with the prefill exports only; the Generator loop's names join these (that file is owned
by the Generator's author).
"""

from .prefill import DecoderStack, PrefillJob, SegmentedPrefill

__all__ = ["DecoderStack", "PrefillJob", "SegmentedPrefill"]
