"""Tensor-parallel twins of `eqx.nn` layers, made by `eqpar.parallelize`.

The layers live in one file per kind (`linear.py`, `attention.py`, `embedding.py`,
`sequence.py`); this module lists them (`PARALLEL_LAYERS`), converts back (`to_serial_layer`)
and keeps the import paths of earlier releases. Each twin subclasses the Equinox layer it
stands for and holds exactly that layer's
fields: the same parameter leaves, with the same global shapes and meaning (convention 1 of
the design), plus the mesh axis as a static field. So a model keeps its own classes' call
signatures, `isinstance(layer, eqx.nn.Linear)` still holds, a checkpoint of the converted
model loads into the original and back, and `to_serial()` returns the original class.

Inside `shard_map` each layer sees its own block of the parameters. Activations at the
boundaries are what the original layer takes and gives, replicated over the axis; inside a
block (between a column-parallel and a row-parallel layer, or the heads of an attention) they
are split over the axis on the feature dimension, and the block ends with one reduction:

| layer | split | takes | gives |
| --- | --- | --- | --- |
| `ColumnParallelLinear` | weight rows, bias | `[in]` | `[out / n]` (or `[out]`, gathered) |
| `RowParallelLinear` | weight columns | `[in / n]` | `[out]` (one `psum`) |
| `HeadParallelAttention` | heads | as `MultiheadAttention` | `[q_seq, out]` (one `psum`) |
| `VocabParallelEmbedding` | rows (vocabulary) | token ids | embeddings (one `psum`) |
| `FeatureParallelEmbedding` | columns (features) | token ids | embeddings (one gather) |
| `SequenceParallelDropout` | nothing | this device's tokens | its rows of the serial mask |
| `ParallelDropout` (every other dropout) | nothing | any block | its block of the serial mask |
| `ParallelRotaryEmbedding` | nothing | this device's tokens | rotated by global positions |
| `ContextParallelAttention` | the sequence | this device's tokens | its tokens' output |
| `ParallelBatchNorm` (`shard_map`) | nothing | its examples | normed by the batch's statistics |
| `ParallelSpectralNorm` (`shard_map`) | nothing | as `SpectralNorm` | as `SpectralNorm` |

Gradients need no help from the user: with `shard_map`'s default `check_vma=True`, JAX
types a replicated input that meets a split weight as varying, and the transpose of that
cast sums its cotangent over the axis.
"""

from jaxtyping import PyTree

from .attention import ContextParallelAttention as ContextParallelAttention
from .attention import HeadParallelAttention as HeadParallelAttention
from .dropout import ParallelDropout as ParallelDropout
from .embedding import FeatureParallelEmbedding as FeatureParallelEmbedding
from .embedding import VocabParallelEmbedding as VocabParallelEmbedding
from .embedding import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .linear import ColumnParallelLinear as ColumnParallelLinear
from .linear import RowParallelLinear as RowParallelLinear
from .rotary import ParallelRotaryEmbedding as ParallelRotaryEmbedding
from .sequence import SequenceParallelDropout as SequenceParallelDropout
from .sequence import gather_sequence as gather_sequence
from .sequence import scatter_sequence as scatter_sequence
from .stateful import ParallelBatchNorm, ParallelSpectralNorm

__all__ = [
    "ColumnParallelLinear",
    "ContextParallelAttention",
    "FeatureParallelEmbedding",
    "HeadParallelAttention",
    "ParallelDropout",
    "ParallelRotaryEmbedding",
    "RowParallelLinear",
    "SequenceParallelDropout",
    "VocabParallelEmbedding",
    "gather_sequence",
    "scatter_sequence",
    "to_serial_layer",
    "vocab_parallel_cross_entropy",
]


# Every twin of an `eqx.nn` layer (each has `to_serial()`).
PARALLEL_LAYERS = (
    ColumnParallelLinear,
    RowParallelLinear,
    HeadParallelAttention,
    VocabParallelEmbedding,
    FeatureParallelEmbedding,
    SequenceParallelDropout,
    ContextParallelAttention,
    ParallelDropout,
    ParallelRotaryEmbedding,
    ParallelBatchNorm,
    ParallelSpectralNorm,
)


def to_serial_layer(layer: PyTree) -> PyTree:
    """`layer.to_serial()` for the layers of this module; any other value as it is.

    **Arguments:**

    - `layer`: any value.

    **Returns:** the original `eqx.nn` layer for a converted one, else `layer` itself.

    ```python
    import equinox as eqx, jax
    from eqpar.nn import RowParallelLinear
    from eqpar.nn.parallel_layers import to_serial_layer
    linear = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    assert type(to_serial_layer(RowParallelLinear(linear))) is eqx.nn.Linear
    assert to_serial_layer(3) == 3
    ```
    """
    return layer.to_serial() if isinstance(layer, PARALLEL_LAYERS) else layer
