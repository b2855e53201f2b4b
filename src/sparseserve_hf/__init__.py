"""sparseserve_hf: tiered, block-sparse KV caching for HuggingFace Transformers.

Importing the package registers `attn_implementation="sparseserve"`.
"""

from .cache import SparseServeCache
from .config import SparseServeConfig
from .generation import Generator, GeneratorGroup, RequestOutput, SamplingParams, StreamEvent
from .registry import register

register()

__all__ = [
    "Generator",
    "GeneratorGroup",
    "RequestOutput",
    "SamplingParams",
    "SparseServeCache",
    "SparseServeConfig",
    "StreamEvent",
    "register",
]
__version__ = "0.1.0"
