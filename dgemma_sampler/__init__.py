"""dgemma-sampler: a fused Triton sampler for DiffusionGemma that drops into vLLM."""

from .config import SamplerConfig
from .ops import row_stats, soft_embedding
from .reference import RowStats

__all__ = ["SamplerConfig", "RowStats", "row_stats", "soft_embedding"]
__version__ = "0.1.0"
