"""The seed's tensor-parallel layers, kept at this import path.

`TPDense`, `TPAsyncDense` and `scale_init` live in `eqpar.nn.linear` (beside the one
column/row core they share with the plan's `ColumnParallelLinear` / `RowParallelLinear`),
`ModelParallelismWrapper` in `eqpar.nn.model_parallel`.
"""

from .linear import TPAsyncDense as TPAsyncDense
from .linear import TPDense as TPDense
from .linear import scale_init as scale_init
from .model_parallel import ModelParallelismWrapper as ModelParallelismWrapper

__all__ = ["ModelParallelismWrapper", "TPAsyncDense", "TPDense", "scale_init"]
