"""Equinox modules built from eqpar's primitives."""

from .blocks import TPAttentionBlock as TPAttentionBlock
from .blocks import TPLayerNorm as TPLayerNorm
from .blocks import TPMLPBlock as TPMLPBlock
from .pipeline import PipelineModule as PipelineModule
from .pipeline import ScannedLayers as ScannedLayers
from .tensor_parallel import ModelParallelismWrapper as ModelParallelismWrapper
from .tensor_parallel import TPAsyncDense as TPAsyncDense
from .tensor_parallel import TPDense as TPDense
from .tensor_parallel import scale_init as scale_init

__all__ = [
    "ModelParallelismWrapper",
    "PipelineModule",
    "ScannedLayers",
    "TPAsyncDense",
    "TPAttentionBlock",
    "TPDense",
    "TPLayerNorm",
    "TPMLPBlock",
    "scale_init",
]
