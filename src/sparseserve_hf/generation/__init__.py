"""The batching Generator: requests, admission, layer-segmented prefill, the continuous-batching loop."""

from .generator import Generator
from .group import GeneratorGroup
from .outputs import RequestOutput, StreamEvent
from .params import SamplingParams
from .prefill import BudgetedPrefill, DecoderStack, PrefillJob

__all__ = [
    "BudgetedPrefill",
    "DecoderStack",
    "Generator",
    "GeneratorGroup",
    "PrefillJob",
    "RequestOutput",
    "SamplingParams",
    "StreamEvent",
]
