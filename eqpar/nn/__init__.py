"""Equinox modules built from eqpar's primitives."""

from .attention import ContextParallelAttention as ContextParallelAttention
from .attention import HeadParallelAttention as HeadParallelAttention
from .blocks import TPAttentionBlock as TPAttentionBlock
from .blocks import TPLayerNorm as TPLayerNorm
from .blocks import TPMLPBlock as TPMLPBlock
from .dropout import ParallelDropout as ParallelDropout
from .embedding import FeatureParallelEmbedding as FeatureParallelEmbedding
from .embedding import VocabParallelEmbedding as VocabParallelEmbedding
from .embedding import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .experts import MixtureOfExperts as MixtureOfExperts
from .experts import RouterLosses as RouterLosses
from .linear import ColumnParallelLinear as ColumnParallelLinear
from .linear import RowParallelLinear as RowParallelLinear
from .linear import TPAsyncDense as TPAsyncDense
from .linear import TPDense as TPDense
from .linear import scale_init as scale_init
from .model_parallel import ModelParallelismWrapper as ModelParallelismWrapper
from .pipeline import PipelineModule as PipelineModule
from .pipelined import PipelinedBlocks as PipelinedBlocks
from .rotary import ParallelRotaryEmbedding as ParallelRotaryEmbedding
from .sequence import SequenceParallelDropout as SequenceParallelDropout
from .sequence import gather_sequence as gather_sequence
from .sequence import scatter_sequence as scatter_sequence
from .stacks import ScannedLayers as ScannedLayers
from .stacks import stack_layers as stack_layers
from .stacks import unstack_layers as unstack_layers
from .stateful import ParallelBatchNorm as ParallelBatchNorm
from .stateful import ParallelSpectralNorm as ParallelSpectralNorm

__all__ = [
    "ColumnParallelLinear",
    "ContextParallelAttention",
    "FeatureParallelEmbedding",
    "HeadParallelAttention",
    "MixtureOfExperts",
    "ModelParallelismWrapper",
    "ParallelBatchNorm",
    "ParallelDropout",
    "ParallelRotaryEmbedding",
    "ParallelSpectralNorm",
    "PipelineModule",
    "PipelinedBlocks",
    "RouterLosses",
    "RowParallelLinear",
    "ScannedLayers",
    "SequenceParallelDropout",
    "TPAsyncDense",
    "TPAttentionBlock",
    "TPDense",
    "TPLayerNorm",
    "TPMLPBlock",
    "VocabParallelEmbedding",
    "gather_layers",  # pyright: ignore[reportUnsupportedDunderAll] (see __getattr__)
    "gather_sequence",
    "scale_init",
    "scatter_sequence",
    "stack_layers",
    "unstack_layers",
    "vocab_parallel_cross_entropy",
]


def __getattr__(name: str) -> object:
    # `gather_layers` (FSDP layer by layer) lives with FSDP in `eqpar.distributions`, which
    # builds on this package; it stays importable from here, where it was first published,
    # through this lazy lookup (an import at the top would be circular).
    if name == "gather_layers":
        from ..distributions import gather_layers

        return gather_layers
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
