"""Equinox modules built from eqpar's primitives."""

from .attention import ContextParallelAttention as ContextParallelAttention
from .attention import HeadParallelAttention as HeadParallelAttention
from .blocks import TPAttentionBlock as TPAttentionBlock
from .blocks import TPLayerNorm as TPLayerNorm
from .blocks import TPMLPBlock as TPMLPBlock
from .embedding import FeatureParallelEmbedding as FeatureParallelEmbedding
from .embedding import VocabParallelEmbedding as VocabParallelEmbedding
from .embedding import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .linear import ColumnParallelLinear as ColumnParallelLinear
from .linear import RowParallelLinear as RowParallelLinear
from .linear import TPAsyncDense as TPAsyncDense
from .linear import TPDense as TPDense
from .linear import scale_init as scale_init
from .model_parallel import ModelParallelismWrapper as ModelParallelismWrapper
from .pipeline import PipelineModule as PipelineModule
from .pipeline import ScannedLayers as ScannedLayers
from .pipeline import gather_layers as gather_layers
from .pipeline import stack_layers as stack_layers
from .pipeline import unstack_layers as unstack_layers
from .sequence import SequenceParallelDropout as SequenceParallelDropout
from .sequence import gather_sequence as gather_sequence
from .sequence import scatter_sequence as scatter_sequence

__all__ = [
    "ColumnParallelLinear",
    "ContextParallelAttention",
    "FeatureParallelEmbedding",
    "HeadParallelAttention",
    "ModelParallelismWrapper",
    "PipelineModule",
    "RowParallelLinear",
    "ScannedLayers",
    "SequenceParallelDropout",
    "TPAsyncDense",
    "TPAttentionBlock",
    "TPDense",
    "TPLayerNorm",
    "TPMLPBlock",
    "VocabParallelEmbedding",
    "gather_layers",
    "gather_sequence",
    "scale_init",
    "scatter_sequence",
    "stack_layers",
    "unstack_layers",
    "vocab_parallel_cross_entropy",
]
