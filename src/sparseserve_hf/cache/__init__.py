"""Tiered KV storage: DRAM head-block pool, HBM block cache, per-block metadata, HF Cache classes."""

from .cache import SUPPORTED_MODEL_TYPES, SparseServeCache
from .layer import SparseServeLayer

__all__ = ["SUPPORTED_MODEL_TYPES", "SparseServeCache", "SparseServeLayer"]
