"""dgemma-sampler: a fused Triton sampler for DiffusionGemma that drops into vLLM."""

from .config import SamplerConfig
from .ops import row_stats, soft_embedding
from .reference import RowStats
from .sampler import DiffusionSampler
from .state import DiffusionState
from .step import StepOutput

__all__ = [
    "SamplerConfig", "RowStats", "row_stats", "soft_embedding",
    "DiffusionState", "DiffusionSampler", "StepOutput",
]
__version__ = "0.1.0"
