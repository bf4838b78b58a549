"""Equinox modules built from eqpar's primitives."""

from .blocks import TPAttentionBlock as TPAttentionBlock
from .blocks import TPLayerNorm as TPLayerNorm
from .blocks import TPMLPBlock as TPMLPBlock
from .parallel_layers import ColumnParallelLinear as ColumnParallelLinear
from .parallel_layers import ContextParallelAttention as ContextParallelAttention
from .parallel_layers import FeatureParallelEmbedding as FeatureParallelEmbedding
from .parallel_layers import HeadParallelAttention as HeadParallelAttention
from .parallel_layers import RowParallelLinear as RowParallelLinear
from .parallel_layers import SequenceParallelDropout as SequenceParallelDropout
from .parallel_layers import VocabParallelEmbedding as VocabParallelEmbedding
from .parallel_layers import gather_sequence as gather_sequence
from .parallel_layers import scatter_sequence as scatter_sequence
from .parallel_layers import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .pipeline import PipelineModule as PipelineModule
from .pipeline import ScannedLayers as ScannedLayers
from .pipeline import gather_layers as gather_layers
from .pipeline import stack_layers as stack_layers
from .pipeline import unstack_layers as unstack_layers
from .tensor_parallel import ModelParallelismWrapper as ModelParallelismWrapper
from .tensor_parallel import TPAsyncDense as TPAsyncDense
from .tensor_parallel import TPDense as TPDense
from .tensor_parallel import scale_init as scale_init

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
