"""Parallelization plans: convert the layers of an existing Equinox model in place.

A plan maps module paths (the `/`-joined paths `LayoutMap` keys use, e.g.
`layers/0/attention`, or a regular expression such as `layers/\\d+/mlp/up`) to a *style*:
how that layer is split over a mesh axis. `parallelize(model, plan)` returns the same model
with each planned layer replaced by its tensor-parallel twin from `eqpar.nn` (same
parameters, same call signature, same class by `isinstance`), so the author's own
`__call__` methods run unchanged inside `eqpar.shard_map`. `unparallelize` gives the
original classes back.
"""

import dataclasses
import math
import warnings
from collections.abc import Hashable, Mapping
from typing import Any

import equinox as eqx
import jax
from jax.core import Tracer
from jax.sharding import PartitionSpec

from ._axis_types import gather_explicit
from ._checks import check_column_options, check_context_options, columns_in_a_row_fix
from ._matching import compile_key, single_match, unused_key_hints
from ._paths import children, map_children, path_to_str
from ._schedule_tables import check_stages_per_device
from ._specs import check_spec
from ._typing import PyTree
from .layout import named_shardings, partition_specs
from .mesh import DeviceMesh, as_jax_mesh
from .nn._plan_blocks import (
    BlockOptions,
    author_declared_specs,
    block_options,
    convert_block,
    mark_head_checks,
    serial_block,
)
from .nn.attention import ContextParallelAttention, HeadParallelAttention
from .nn.dropout import ParallelDropout
from .nn.embedding import FeatureParallelEmbedding, VocabParallelEmbedding
from .nn.experts import MixtureOfExperts, check_single_axes, experts_layer, serial_experts
from .nn.linear import ColumnParallelLinear, RowParallelLinear
from .nn.parallel_layers import PARALLEL_LAYERS, to_serial_layer
from .nn.pipelined import PipelinedBlocks
from .nn.rotary import ParallelRotaryEmbedding
from .nn.sequence import SequenceParallelDropout
from .nn.stacks import remat_policy
from .schedule import SCHEDULES

__all__ = [
    "ColumnParallel",
    "ContextParallel",
    "ExpertParallel",
    "FeatureParallel",
    "HeadParallel",
    "Pipeline",
    "Remat",
    "Replicated",
    "RowParallel",
    "SequenceParallel",
    "Sharded",
    "SplitSequence",
    "Style",
    "VocabParallel",
    "parallelize",
    "unparallelize",
]

# The layers a plan can name: everything else is reached by its path but not converted.
_PLANNABLE = (
    eqx.nn.Linear,
    eqx.nn.MultiheadAttention,
    eqx.nn.Embedding,
    eqx.nn.LayerNorm,
    eqx.nn.RMSNorm,
    eqx.nn.Dropout,
    eqx.nn.RotaryPositionalEmbedding,
)


class Style:
    """How one layer is split; the styles are `ColumnParallel`, `RowParallel`,
    `HeadParallel`, `ContextParallel`, `VocabParallel`, `FeatureParallel`, `SequenceParallel`
    and `Replicated`.

    A style says which layers it accepts, converts one, and names the sizes it splits.

    ```python
    import equinox as eqx, jax, eqpar
    style = eqpar.ColumnParallel()
    assert isinstance(style, eqpar.Style) and style.accepts == (eqx.nn.Linear,)
    layer = eqx.nn.Linear(4, 8, key=jax.random.key(0))
    assert style.split_sizes(layer) == {"out_features": 8}
    ```
    """

    accepts: tuple[type, ...] = ()

    def convert(self, layer: PyTree) -> PyTree:
        """The converted layer (`layer` is already in its original class)."""
        raise NotImplementedError

    def split_sizes(self, layer: PyTree) -> dict[str, int]:
        """The sizes that must divide by the axis size, by name."""
        return {}

    def axis_splits(self, layer: PyTree) -> dict[Hashable, dict[str, int]]:
        """`split_sizes` by the mesh axis that splits them (one axis for most styles)."""
        return {self.axis: self.split_sizes(layer)}

    def convert_list(self, layers: list | tuple) -> list | tuple:
        """A key naming a list (of blocks) converts each (`SplitSequence` also marks the
        first and the last)."""
        return type(layers)(self.convert(layer) for layer in layers)

    @property
    def axis(self) -> Hashable | None:
        return getattr(self, "axis_name", None)


@dataclasses.dataclass(frozen=True)
class ColumnParallel(Style):
    """Split an `eqx.nn.Linear`'s output features over `axis_name` (`ColumnParallelLinear`).

    It takes the replicated input and gives this device's block of the output, for a
    following `RowParallel` layer; with `gather_output=True` it gives the whole output. With
    `sequence_parallel=True` it takes this device's token of a sequence-sharded activation
    (see "Sequence parallelism" in `parallelize`).

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    mlp = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    parallel = eqpar.parallelize(mlp, {"layers/0": eqpar.ColumnParallel(axis_name="model")})
    assert eqpar.partition_specs(parallel).layers[0].weight == P("model", None)
    ```
    """

    axis_name: Hashable = "model"
    gather_output: bool = False
    sequence_parallel: bool = False
    accepts = (eqx.nn.Linear,)

    def __post_init__(self) -> None:
        check_column_options("ColumnParallel", self.gather_output, self.sequence_parallel)

    def convert(self, layer: PyTree) -> PyTree:
        return ColumnParallelLinear(
            layer,
            axis_name=self.axis_name,
            gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel,
        )

    def split_sizes(self, layer: PyTree) -> dict[str, int]:
        return {"out_features": layer.out_features}


@dataclasses.dataclass(frozen=True)
class RowParallel(Style):
    """Split an `eqx.nn.Linear`'s input features over `axis_name` (`RowParallelLinear`): it
    takes this device's block and gives the whole output (one `psum`; with
    `sequence_parallel=True` one reduce-scatter that leaves each device its own tokens).

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    mlp = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    parallel = eqpar.parallelize(mlp, {"layers/1": eqpar.RowParallel()})
    specs = eqpar.partition_specs(parallel).layers[1]
    assert specs.weight == P(None, "model") and specs.bias == P()
    ```
    """

    axis_name: Hashable = "model"
    sequence_parallel: bool = False
    accepts = (eqx.nn.Linear,)

    def convert(self, layer: PyTree) -> PyTree:
        return RowParallelLinear(
            layer, axis_name=self.axis_name, sequence_parallel=self.sequence_parallel
        )

    def split_sizes(self, layer: PyTree) -> dict[str, int]:
        return {"in_features": layer.in_features}


@dataclasses.dataclass(frozen=True)
class HeadParallel(Style):
    """Split attention heads over `axis_name`.

    On an `eqx.nn.MultiheadAttention` (`HeadParallelAttention`): replicated in, replicated
    out, one `psum`; with `sequence_parallel=True`, sequence-sharded in and out (one
    all-gather, one reduce-scatter).

    On a hand-written attention block that keeps its head counts in int fields
    (`fields=("n_heads",)`, also `"n_kv_heads"` for grouped-query attention): the block
    sees each of those fields divided by the axis size inside a region that is manual over
    `axis_name`, and the global count everywhere else (`unparallelize`, checkpoints, the
    serial model), so `q.reshape(seq, self.n_heads, -1)` splits this device's features of a
    `ColumnParallel` projection into its own heads. Its linears take `ColumnParallel` /
    `RowParallel` keys of their own. Without it, such a reshape is refused at trace time
    (the error names the field and this style).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from eqpar.nn import HeadParallelAttention
    attention = eqx.nn.MultiheadAttention(4, 16, key=jax.random.key(0))
    parallel = eqpar.parallelize({"attention": attention}, {"attention": eqpar.HeadParallel()})
    assert isinstance(parallel["attention"], HeadParallelAttention)

    class Attention(eqx.Module):  # hand-written, the head count in an int field
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        n_heads: int = eqx.field(static=True)
        def __call__(self, x):
            q, k, v = (y.reshape(x.shape[0], self.n_heads, -1)
                       for y in jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1))
            return jax.vmap(self.out)(jax.nn.dot_product_attention(q, k, v).reshape(x.shape[0], -1))

    k1, k2 = jax.random.split(jax.random.key(0))
    block = Attention(eqx.nn.Linear(16, 48, key=k1), eqx.nn.Linear(16, 16, key=k2), 4)
    plan = {"": eqpar.HeadParallel(fields=("n_heads",))}
    assert eqpar.unparallelize(eqpar.parallelize(block, plan)).n_heads == 4
    ```
    """

    axis_name: Hashable = "model"
    sequence_parallel: bool = False
    fields: tuple[str, ...] = ()
    accepts = (eqx.nn.MultiheadAttention,)

    def __post_init__(self) -> None:
        if isinstance(self.fields, str) or not all(isinstance(f, str) for f in self.fields):
            raise TypeError(
                f"HeadParallel: `fields` must be a tuple of field names, e.g. "
                f"fields=('n_heads',); got {self.fields!r}."
            )
        if self.fields and self.sequence_parallel:
            raise ValueError(
                "HeadParallel: `sequence_parallel` applies to an eqx.nn.MultiheadAttention; "
                "with `fields`, the block's own linears take sequence_parallel=True in "
                "their ColumnParallel / RowParallel keys."
            )

    def convert(self, layer: PyTree) -> PyTree:
        if self.fields:
            self.split_sizes(layer)  # every field an int of the block
            local = tuple((name, self.axis_name) for name in self.fields)
            return convert_block(layer, "HeadParallel", local_fields=local)
        return HeadParallelAttention(
            layer, axis_name=self.axis_name, sequence_parallel=self.sequence_parallel
        )

    def split_sizes(self, layer: PyTree) -> dict[str, int]:
        if not self.fields:
            return {"num_heads": layer.num_heads}
        sizes = {}
        for name in self.fields:
            value = getattr(layer, name, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"HeadParallel(fields={self.fields!r}): the block, a "
                    f"{type(layer).__name__}, has no int field {name!r} (got "
                    f"{type(value).__name__}); name the int fields that count its heads."
                )
            sizes[name] = value
        return sizes


@dataclasses.dataclass(frozen=True)
class ContextParallel(Style):
    """Split an `eqx.nn.MultiheadAttention`'s sequence over `axis_name` (context
    parallelism, `ContextParallelAttention`): it takes this device's block of the sequence
    (`[seq / n, size]`) and gives that block of the output, attending to the whole sequence
    by ring attention (`strategy="ring"`), by all-gathering the keys and values
    (`strategy="all_gather"`, for short sequences), or by Ulysses all-to-alls that split the
    heads instead of the sequence for the attention itself (`strategy="ulysses"`: the
    heads must divide over the axis; the least traffic when they are many). `causal=True`
    makes it causal over the whole sequence; the layer's `mask` is a per-key padding mask of
    this device's keys. `layout="balanced"` evens out causal work (store the sequence in
    `eqpar.context.balance_sequence` order). `head_axis_name` also splits the heads over a
    tensor-parallel axis.

    Keyed by a hand-written attention block (an `eqx.Module` of the author's that calls
    `jax.nn.dot_product_attention`), the block's own call becomes ring attention (or Ulysses
    attention, `strategy="ulysses"`, which also takes keys and values with fewer heads) over
    the axis on its block of the sequence (`causal` is then the call's `is_causal`); split the
    sequence where the blocks begin with `SplitSequence(axis_name)`. Attention written as an
    einsum and a softmax is refused when traced, naming this route.

    The parameters stay whole on every device of the context axis; the rest of a
    transformer (norms, MLPs, embeddings of this device's tokens) runs on its tokens
    unchanged, so the author's model runs with its sequence split by `shard_map`'s
    in_specs (`P("data", "context")` for `[batch, seq]` tokens).

    ```python
    import equinox as eqx, jax, eqpar
    from eqpar.nn.parallel_layers import ContextParallelAttention
    attention = eqx.nn.MultiheadAttention(4, 16, key=jax.random.key(0))
    plan = {"attention": eqpar.ContextParallel(causal=True)}
    parallel = eqpar.parallelize({"attention": attention}, plan)
    assert isinstance(parallel["attention"], ContextParallelAttention)
    assert type(eqpar.unparallelize(parallel)["attention"]) is eqx.nn.MultiheadAttention
    ```
    """

    axis_name: Hashable = "context"
    causal: bool = False
    layout: str = "contiguous"
    strategy: str = "ring"
    head_axis_name: Hashable | None = None
    accepts = (eqx.nn.MultiheadAttention,)

    def __post_init__(self) -> None:
        check_context_options(
            "ContextParallel", self.layout, self.strategy, self.axis_name, self.head_axis_name
        )

    def check_block(self) -> None:
        """Refuse the options that a hand-written attention block cannot take."""
        if self.strategy == "all_gather" or self.head_axis_name is not None:
            raise ValueError(
                f"parallelize: {self!r} names a hand-written attention block, whose "
                f"jax.nn.dot_product_attention becomes ring or Ulysses attention: "
                f"strategy='ring' or 'ulysses', and no head_axis_name (split its heads with "
                f"ColumnParallel keys and HeadParallel(fields=...))."
            )

    def convert(self, layer: PyTree) -> PyTree:
        if not isinstance(layer, eqx.nn.MultiheadAttention):  # a hand-written block
            context = (self.axis_name, self.layout, self.strategy)
            return convert_block(layer, "ContextParallel", context=context)
        return ContextParallelAttention(
            layer,
            axis_name=self.axis_name,
            causal=self.causal,
            layout=self.layout,
            strategy=self.strategy,
            head_axis_name=self.head_axis_name,
        )


@dataclasses.dataclass(frozen=True)
class VocabParallel(Style):
    """Split an `eqx.nn.Embedding`'s rows over `axis_name` (`VocabParallelEmbedding`).

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    table = eqx.nn.Embedding(32, 8, key=jax.random.key(0))
    parallel = eqpar.parallelize(table, {"": eqpar.VocabParallel()})  # "" is the root
    assert eqpar.partition_specs(parallel).weight == P("model", None)
    ```
    """

    axis_name: Hashable = "model"
    accepts = (eqx.nn.Embedding,)

    def convert(self, layer: PyTree) -> PyTree:
        return VocabParallelEmbedding(layer, axis_name=self.axis_name)

    def split_sizes(self, layer: PyTree) -> dict[str, int]:
        return {"num_embeddings": layer.num_embeddings}


@dataclasses.dataclass(frozen=True)
class FeatureParallel(Style):
    """Split an `eqx.nn.Embedding`'s columns over `axis_name` (`FeatureParallelEmbedding`).

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    table = eqx.nn.Embedding(10, 32, key=jax.random.key(0))
    parallel = eqpar.parallelize(table, {"": eqpar.FeatureParallel()})
    assert eqpar.partition_specs(parallel).weight == P(None, "model")
    ```
    """

    axis_name: Hashable = "model"
    accepts = (eqx.nn.Embedding,)

    def convert(self, layer: PyTree) -> PyTree:
        return FeatureParallelEmbedding(layer, axis_name=self.axis_name)

    def split_sizes(self, layer: PyTree) -> dict[str, int]:
        return {"embedding_size": layer.embedding_size}


@dataclasses.dataclass(frozen=True)
class SequenceParallel(Style):
    """An `eqx.nn.Dropout` that runs on activations split over the sequence
    (`SequenceParallelDropout`): it applies this device's rows of the mask the serial layer
    draws for the whole sequence, so dropout between sequence-parallel blocks equals the
    serial model's. Norms need no style: they run on this device's tokens as they are.

    ```python
    import equinox as eqx, eqpar
    from eqpar.nn import SequenceParallelDropout
    block = {"dropout": eqx.nn.Dropout(0.1), "norm": eqx.nn.LayerNorm(8)}
    parallel = eqpar.parallelize(block, {"dropout": eqpar.SequenceParallel()})
    assert isinstance(parallel["dropout"], SequenceParallelDropout)
    ```
    """

    axis_name: Hashable = "model"
    accepts = (eqx.nn.Dropout,)

    def convert(self, layer: PyTree) -> PyTree:
        return SequenceParallelDropout(layer, axis_name=self.axis_name)


@dataclasses.dataclass(frozen=True)
class Replicated(Style):
    """Keep the layer whole on every device (its original class; norms, small heads). A
    layer already converted goes back to its original class.

    ```python
    import equinox as eqx, jax, eqpar
    mlp = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    parallel = eqpar.parallelize(mlp, {"layers/0": eqpar.ColumnParallel()})
    again = eqpar.parallelize(parallel, {"layers/0": eqpar.Replicated()})
    assert type(again.layers[0]) is eqx.nn.Linear
    ```
    """

    accepts = _PLANNABLE

    def convert(self, layer: PyTree) -> PyTree:
        return layer


@dataclasses.dataclass(frozen=True)
class Remat(Style):
    """Recompute a block's activations in the backward pass instead of keeping them
    (`jax.checkpoint`), named on the model's own blocks: the key is the path of a block
    (an `eqx.Module` with a `__call__`, e.g. `layers/\\d+`) or of a list of them
    (`layers`). The block keeps its fields and its author's `__call__`, which now runs
    under `jax.checkpoint` with the policy: `"full"` keeps only the block's inputs,
    `"matmuls"` also keeps the results of its matrix products, `"none"` keeps everything
    (no remat). The block's class becomes a subclass of the author's (`isinstance` holds;
    `unparallelize` gives the author's class back). Layers inside the block can have
    styles of their own in the same plan.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    mlp = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
    plan = {"": eqpar.Remat("full")}  # "" is the root: the whole MLP
    remat = eqpar.parallelize(mlp, plan)
    assert isinstance(remat, eqx.nn.MLP) and type(remat) is not eqx.nn.MLP
    x = jnp.ones(4)
    grad = eqx.filter_grad(lambda m: m(x).sum())
    assert jnp.allclose(grad(remat).layers[0].weight, grad(mlp).layers[0].weight)
    assert type(eqpar.unparallelize(remat)) is eqx.nn.MLP
    ```
    """

    policy: str = "full"
    accepts = (eqx.Module,)

    def __post_init__(self) -> None:
        remat_policy(self.policy, "Remat")

    def convert(self, layer: PyTree) -> PyTree:
        return convert_block(layer, "Remat", remat=remat_policy(self.policy, "Remat"))


@dataclasses.dataclass(frozen=True)
class SplitSequence(Style):
    """Split the sequence over `axis_name` where the model's list of blocks begins, and
    gather it where the list ends, so the author's `__call__` needs no
    `scatter_sequence` / `gather_sequence` lines (sequence parallelism with
    `sequence_parallel=True` styles on the blocks' layers, or context parallelism with
    `ContextParallel` attention). The key is the path of the list (or of one block, split
    on entry and gathered on exit). The first block's first positional argument must be the
    sequence, `[seq, ...]` per example; its length must divide by the axis size (pad it and
    mask the padding otherwise: the error says so). Everything before the list (embeddings,
    which need whole positions) and after it (the head) sees the whole sequence. Blocks that
    return `(x, aux...)` have `x` split and gathered, and their per-token auxiliary outputs
    (a cache, `[seq, ...]`) gathered on exit, so the loop collects the serial ones. Outside
    `shard_map` over `axis_name` (the user's one-device step), a block whose converted
    layers work over `axis_name` opens a region of its own over it, its layers' axes and
    the data axes (the batch split over them, the sequence over `axis_name`), so it runs as
    inside `shard_map` and moves what it moves there; blocks of raw arrays laid out by
    `Sharded` (run under `jax.jit`, on the mesh the model is placed on or the one
    `jax.set_mesh` sets) get a sharding constraint the compiler honours.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P

    class Block(eqx.Module):
        norm: eqx.nn.LayerNorm
        def __call__(self, x):
            return x + jax.vmap(self.norm)(x)

    model = [Block(eqx.nn.LayerNorm(4)), Block(eqx.nn.LayerNorm(4))]
    parallel = eqpar.parallelize(model, {"": eqpar.SplitSequence("model")})
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])

    def forward(blocks, x):
        for block in blocks:
            x = block(x)
        return x

    x = jnp.arange(32.0).reshape(8, 4)
    run = eqpar.shard_map(forward, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    assert jnp.allclose(run(parallel, x), forward(model, x))
    ```
    """

    axis_name: Hashable = "model"
    accepts = (eqx.Module,)

    def convert(self, layer: PyTree) -> PyTree:
        axis = self.axis_name
        return convert_block(
            layer, "SplitSequence", split_on_entry=axis, gather_on_exit=axis, gather_aux=axis
        )

    def convert_list(self, layers: list | tuple) -> list | tuple:
        if not layers:
            raise TypeError("SplitSequence applies to a non-empty list of blocks; got none.")
        axis = self.axis_name
        # Every block gathers the per-token outputs it returns beside the activation.
        converted = [convert_block(block, "SplitSequence", gather_aux=axis) for block in layers]
        converted[0] = convert_block(converted[0], "SplitSequence", split_on_entry=axis)
        converted[-1] = convert_block(converted[-1], "SplitSequence", gather_on_exit=axis)
        return type(layers)(converted)


@dataclasses.dataclass(frozen=True)
class Sharded(Style):
    """Lay out a raw array leaf of the model (a weight the author keeps as a plain
    `jax.Array`, not in an `eqx.nn` layer) by a `PartitionSpec`. The key is the leaf's path
    (`layers/\\d+/wq`). This is the compiled route, as `ModelParallel` takes: the module
    that holds the array declares the spec (its class becomes a subclass of the author's),
    so `eqpar.partition_specs(model)` gives it; place the model by those specs and run the
    serial step under `jax.jit`, whose partitioner inserts the collectives the author's
    own code needs, whatever it does with the array (reshapes into heads included). The
    model runs outside `shard_map` on this route (or inside one whose `axis_names` leave the
    spec's axes to the compiler: a pipeline over `pipe` with the weights split over `model`;
    a block called where its spec's axis is manual refuses), so keep the styles that convert
    layers for models run inside it.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P

    class MLP(eqx.Module):  # raw arrays
        w_in: jax.Array
        w_out: jax.Array
        def __call__(self, x):
            return jax.nn.gelu(x @ self.w_in) @ self.w_out

    k1, k2 = jax.random.split(jax.random.key(0))
    mlp = MLP(jax.random.normal(k1, (8, 32)), jax.random.normal(k2, (32, 8)))
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    plan = {"w_in": eqpar.Sharded(P(None, "model")), "w_out": eqpar.Sharded(P("model", None))}
    parallel = eqpar.parallelize(mlp, plan, mesh=mesh)
    placed = eqx.filter_shard(
        parallel, eqpar.named_shardings(eqpar.partition_specs(parallel), mesh)
    )
    assert placed.w_in.sharding.spec == P(None, "model")
    x = jnp.ones((4, 8))
    assert jnp.allclose(eqx.filter_jit(lambda m, x: m(x))(placed, x), mlp(x), rtol=1e-5)
    ```
    """

    spec: PartitionSpec = dataclasses.field(default_factory=PartitionSpec)
    accepts = (jax.Array,)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, PartitionSpec):
            raise TypeError(
                f"Sharded: spec must be a jax.sharding.PartitionSpec, e.g. "
                f"Sharded(P(None, 'model')); got {type(self.spec).__name__}."
            )


@dataclasses.dataclass(frozen=True)
class Pipeline(Style):
    """Run the model's list of blocks as a pipeline over `axis_name`, the author's
    `__call__` kept: the key is the path of the list (`layers`). The list becomes an
    `eqpar.nn.PipelinedBlocks`: the blocks stacked in model order and cut into `stages *
    repeats` stages of equal depth, stored split over the axis. The author's loop over the
    list (per-block dropout keys, a mask every block takes, the per-example `jax.vmap` around
    the model) runs as written; the last block's call runs every block as one pipeline over
    the batch cut into `microbatches` (GPipe with `repeats=1`, the circular schedule with
    `repeats` stages per device), and differentiating the loss trains it: the gradient of the
    global loss, as on one device. Other plan keys convert layers inside the blocks (tensor
    parallelism within each stage); blocks that differ only in integer static fields stack,
    and so do blocks whose other static fields differ where their calls trace to the same
    program (a per-instance `cache_key`). Blocks may return `(x, aux...)` (a cache, an
    auxiliary loss): the pipeline carries `x` and the auxiliary outputs with it, and the
    loop receives each block's as the serial loop would (`caches.append(cache)`,
    `aux_loss += aux`), computed when the last block is called. A residual written around
    the call, `x = x + block(x)` for every block, runs inside each stage.

    **Arguments:**

    - `stages`: the size of the pipeline axis (one stage per device per repeat).
    - `microbatches`: how many pieces each device's batch is cut into; it must divide it.
    - `repeats`: stages per device (the circular schedule when > 1); the number of blocks
      must divide by `stages * repeats`.
    - `axis_name`: the mesh axis of the pipeline.
    - `remat`: what each block keeps for the backward pass (`"none"`, `"full"`,
      `"matmuls"`).
    - `batch_axis`: `None` (the default) when the model runs one example per call under
      `jax.vmap`, as Equinox's models do; `0` when it takes the whole batch, leading axis
      first (then per-example arguments of the blocks are wrapped in
      `eqpar.pipeline.Microbatched`).
    - `schedule`: `"gpipe"` or `"circular"` (the default follows `repeats`): train by
      differentiating the loss as on one device. `"1f1b"` or `"zb-h1"` (one stage per
      device), `"zb-v"` or `"dualpipe-v"` (V-shaped, `repeats=2`): the schedule runs the
      loss inside the pipeline, on the last stage, so it computes the loss and the
      gradients itself: take them with `eqpar.value_and_grad(loss_fn)(model, *batch)`
      (which cuts the loss where the blocks are called).

    ```python
    import equinox as eqx, jax, eqpar
    blocks = [eqx.nn.Linear(4, 4, key=k) for k in jax.random.split(jax.random.key(0), 4)]
    model = eqx.nn.Sequential(blocks)
    parallel = eqpar.parallelize(model, {"layers": eqpar.Pipeline(stages=2, microbatches=2)})
    assert len(parallel.layers) == 4 and isinstance(parallel.layers, eqpar.nn.PipelinedBlocks)
    assert eqx.tree_equal(eqpar.unparallelize(parallel), model)
    ```
    """

    stages: int
    microbatches: int
    repeats: int = 1
    axis_name: Hashable = "pipe"
    remat: str = "none"
    schedule: str | None = None
    batch_axis: int | None = None
    accepts = (list, tuple)

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Pipeline: `{name}` must be a positive int, got {value!r}.")
        remat_policy(self.remat, "Pipeline")
        expected = "gpipe" if self.repeats == 1 else "circular"
        training = ("1f1b", "zb-h1", "zb-v", "dualpipe-v")
        if self.schedule not in (None, expected, *training):
            raise ValueError(
                f"Pipeline: schedule={self.schedule!r} does not fit repeats={self.repeats}: "
                f"'gpipe', '1f1b' and 'zb-h1' run one stage per device (repeats=1), 'zb-v' "
                f"and 'dualpipe-v' two (repeats=2), 'circular' several (repeats > 1). Pass "
                f"schedule={expected!r} or leave it out."
            )
        if self.schedule in training:
            check_stages_per_device(
                self.schedule,
                SCHEDULES[self.schedule].stages_per_device,
                self.repeats,
                "Pipeline",
                argument="repeats",
            )

    def convert(self, layer: PyTree) -> PyTree:
        raise TypeError(
            "Pipeline applies to the model's list (or tuple) of blocks, e.g. the key "
            "'layers' for `model.layers`, not to one block."
        )

    def convert_list(self, layers: list | tuple) -> PyTree:
        return PipelinedBlocks(
            layers,
            num_stages=self.stages,
            num_microbatches=self.microbatches,
            num_repeats=self.repeats,
            axis_name=self.axis_name,
            remat=remat_policy(self.remat, "Pipeline"),
            batch_axis=self.batch_axis,
            schedule=self.schedule,
        )


@dataclasses.dataclass(frozen=True)
class ExpertParallel(Style):
    """Split a mixture of experts over `axis_name`: each device of the axis holds
    `E / n` experts and routes its own tokens to every expert, each (token, expert)
    assignment sent to the device that holds the expert and its result sent back. The key is
    the path of an `eqpar.nn.MixtureOfExperts`, or of the common hand-written form: a module
    with a `router` (`eqx.nn.Linear`, features -> experts) and `experts` (a list of depth-1
    `eqx.nn.MLP`s), which becomes a `MixtureOfExperts` with the same weights, top-`top_k`
    softmax routing, and the author's return value (the output alone; `unparallelize` gives
    the author's module back). The conversion runs the author's layer and the converted one
    on a few tokens and refuses if they differ (e.g. routing weights not renormalized:
    `normalize_weights=False`).

    The tokens are split over `axis_name` as over a data axis (put it in the batch's spec,
    with the data axis: `P(("data", "expert"))`, or use the data axis itself); the layers
    outside the experts stay replicated over it. Dropless by default: one round of the
    exchange carries `buffer_factor` times each device pair's balanced share, and a step whose
    routing overflows that runs more rounds instead of dropping tokens (on CPU each expert
    has its own slot of a pair's rows, `buffer_factor` times its balanced share, so that
    the experts run as one batched matmul: see `eqpar.nn.experts.expert_buffer_rows`). With
    `capacity_factor`, each expert takes at most `ceil(c * T * top_k / E)` of a device's `T`
    tokens and `RouterLosses.dropped` counts the rest. With `model_axis_name`, each expert's
    hidden features are split over that axis too (tensor parallelism inside each expert).
    Called outside `shard_map` on a model placed by `parallelize(..., mesh=)` (the one-device
    step), the layer opens one region over the mesh, with its tokens split over every axis
    but `model_axis_name` (place the batch over the data axes and `axis_name`); a capacity
    then counts one device's tokens of that split. Not with a pipe axis outside
    `shard_map`.

    **Arguments:**

    - `axis_name`: the mesh axis the experts are split over (`"expert"`, or the data axis).
    - `model_axis_name`: an axis to split each expert's hidden features over, or `None`.
    - `buffer_factor`: one round's buffer, a finite multiple of the balanced share (>= 1 keeps
      balanced routing to one round); `None` keeps the layer's own (1.25 by default).
    - `capacity_factor`: a capacity per expert, as above; `None` keeps the layer's own
      (dropless by default).
    - `top_k`: experts per token, for the hand-written form when the author's module has
      no int `top_k` field of its own (a `MixtureOfExperts` keeps its own).
    - `normalize_weights`: for the hand-written form: whether the author renormalizes the
      top-k probabilities to sum to 1 (`False`: Switch-style, each output scaled by its
      probability).

    ```python
    import jax, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.nn import MixtureOfExperts

    moe = MixtureOfExperts(8, 16, num_experts=8, key=jax.random.key(0))
    parallel = eqpar.parallelize(moe, {"": eqpar.ExpertParallel(axis_name="expert")})
    assert eqpar.partition_specs(parallel).up == P("expert", None, None)
    assert eqpar.unparallelize(parallel).expert_axis_name is None
    ```
    """

    axis_name: Hashable = "expert"
    model_axis_name: Hashable | None = None
    buffer_factor: float | None = None
    capacity_factor: float | None = None
    top_k: int | None = None
    normalize_weights: bool = True
    accepts = (eqx.Module,)

    def __post_init__(self) -> None:
        for name in ("buffer_factor", "capacity_factor"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value > 0
            ):
                raise ValueError(
                    f"ExpertParallel: `{name}` must be None (the layer's own) or a finite "
                    f"number > 0, got {value!r}."
                    + (" For no capacity limit pass None." if name == "capacity_factor" else "")
                )
        check_single_axes(
            "ExpertParallel", axis_name=self.axis_name, model_axis_name=self.model_axis_name
        )
        if self.axis_name == self.model_axis_name:
            raise ValueError(
                f"ExpertParallel: `axis_name` and `model_axis_name` are both "
                f"{self.axis_name!r}; the experts and their hidden features need two axes."
            )

    def _layer(self, layer: PyTree, *, check: bool = False) -> MixtureOfExperts:
        return experts_layer(
            layer, top_k=self.top_k, normalize_weights=self.normalize_weights, check=check
        )

    def convert(self, layer: PyTree) -> PyTree:
        moe = self._layer(layer, check=True)
        if moe.origin is not None and self.capacity_factor is not None:
            raise ValueError(
                f"ExpertParallel: capacity_factor={self.capacity_factor} would drop tokens "
                f"the author's {type(layer).__name__} keeps (and `unparallelize` could not "
                f"give that back). Convert it dropless, or write the layer as a "
                f"MixtureOfExperts with its own capacity_factor."
            )
        options: dict[str, Any] = {
            "expert_axis_name": self.axis_name,
            "model_axis_name": self.model_axis_name,
        }
        if self.buffer_factor is not None:
            options["buffer_factor"] = float(self.buffer_factor)
        if self.capacity_factor is not None:
            options["capacity_factor"] = float(self.capacity_factor)
        # The layer's own values, for `unparallelize` (kept from a first conversion).
        before = dict(moe.options_before)
        for name in ("buffer_factor", "capacity_factor"):
            if name in options:
                before.setdefault(name, getattr(moe, name))
        options["options_before"] = tuple(sorted(before.items()))
        return moe.replace(**options)

    def split_sizes(self, layer: PyTree) -> dict[str, int]:
        return {"num_experts": self._layer(layer).num_experts}

    def axis_splits(self, layer: PyTree) -> dict[Hashable, dict[str, int]]:
        splits: dict[Hashable, dict[str, int]] = {self.axis_name: self.split_sizes(layer)}
        if self.model_axis_name is not None:
            splits[self.model_axis_name] = {"hidden": self._layer(layer).up.shape[-1]}
        return splits


_BLOCK_STYLES = (Remat, SplitSequence, ExpertParallel)


def _is_block_style(style: Style) -> bool:
    """Whether a style converts a block of the model (or a list of them), not a layer."""
    return isinstance(style, (*_BLOCK_STYLES, ContextParallel)) or (
        isinstance(style, HeadParallel) and bool(style.fields)
    )


def _is_plannable(node: object) -> bool:
    return isinstance(node, _PLANNABLE)


def _check_plan(plan: object) -> dict[str, Any]:
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"parallelize: plan must be a mapping from module paths to styles, e.g. "
            f"{{'layers/\\\\d+/mlp/up': eqpar.ColumnParallel()}}; got {type(plan).__name__}."
        )
    patterns = {}
    for key, style in plan.items():
        patterns[key] = compile_key(key, "parallelize: plan")
        if not isinstance(style, Style):
            raise TypeError(
                f"parallelize: plan[{key!r}] must be a style (ColumnParallel(), RowParallel(), "
                f"HeadParallel(), ContextParallel(), VocabParallel(), FeatureParallel(), "
                f"SequenceParallel(), Replicated(), Remat(), SplitSequence(), ExpertParallel(), "
                f"Sharded(spec)); got "
                f"{type(style).__name__}."
            )
    return patterns


def parallelize(
    model: PyTree,
    plan: Mapping[str, Any],
    *,
    mesh: DeviceMesh | jax.sharding.Mesh | None = None,
    strict: bool = True,
) -> PyTree:
    """The model with the layers the plan names converted to their tensor-parallel twins.

    Keys are matched against the paths of the model's `eqx.nn.Linear`,
    `eqx.nn.MultiheadAttention`, `eqx.nn.Embedding`, `eqx.nn.LayerNorm` and `eqx.nn.RMSNorm`
    layers, wherever they sit (fields of your modules, lists, dicts, and layer stacks inside
    `eqpar.nn.ScannedLayers` or `PipelineModule`, which index one layer per call): a key equal to
    the path wins, else exactly one key may match it as a
    regular expression (`re.fullmatch`), as for `LayoutMap`. Layers no key names stay as
    they are (replicated over the axis). Each converted layer keeps its parameters (the
    global view: same leaves, shapes and meaning) and its call signature, and declares its
    sharding, so `eqpar.partition_specs(model)` gives the `shard_map` in_specs. A layer
    that is already converted is converted afresh from its original class.

    **Sequence parallelism.** Between blocks a tensor-parallel model holds every token on
    every device of the axis. With `sequence_parallel=True` on a block's `ColumnParallel` /
    `RowParallel` pair and its `HeadParallel` attention, the activations between blocks stay
    split over the sequence on the same axis: the block all-gathers the tokens it needs on
    entry and reduce-scatters on exit (the same bytes as the `psum` it replaces), so the norms,
    residual adds and dropout in between run on `seq / n` tokens, and their activation memory
    falls by `n`. The norms need no conversion: their parameters stay replicated, and
    `shard_map` sums their gradients over the axis. The model's trunk must receive its own
    tokens: call `eqpar.nn.scatter_sequence(x)` where the trunk begins (after the
    embeddings, which need whole positions) and `eqpar.nn.gather_sequence(x)` where it ends,
    two lines in the author's `__call__`. The attention mask stays whole. Mixing split and whole
    activations (a missing `scatter_sequence`, or a style without `sequence_parallel=True`
    in a sequence-parallel trunk) is an error, not a silent mix of tokens.

    **Randomness and positions.** Every `eqx.nn.Dropout` that no key names becomes a
    `ParallelDropout`: where its input is a block of the activation the serial layer saw
    (the features between a `ColumnParallel` and a `RowParallel` layer, the sequence under
    sequence or context parallelism) it applies that block of the serial mask; where eqpar
    cannot say which block, it refuses at trace time. With a `ContextParallel` style in the
    plan, every `eqx.nn.RotaryPositionalEmbedding` becomes a `ParallelRotaryEmbedding`,
    which rotates each token by its global position. `Replicated()` keeps either layer as
    it is.

    **Placement and the one-device step.** With `mesh`, the converted model comes back
    placed on it by its layout (`eqpar.partition_specs`). A converted layer called outside
    `shard_map` over its axis opens its own region there (`jax.shard_map` over that axis
    only, on the mesh its parameters live on, or the one `jax.set_mesh` set) and returns
    the whole output, so the training step written for one device runs unchanged under
    `jax.jit`, with the batch placed over the data axis by `jax.device_put` (with a `1f1b` /
    `zb-h1` pipeline, through `eqpar.value_and_grad`, which then opens the schedule's region).
    A `gpipe` / `circular` pipeline opens one region over the pipe axis, its blocks' axes
    and the data axes (the batch split over them), and runs as inside `shard_map`.
    An `ExpertParallel` layer opens one region over the whole mesh, its tokens split over
    every axis but its model axis. Sequence parallel styles run inside `eqpar.shard_map`
    only.

    **Blocks.** `Remat(policy)` on a block of the model (or a list of blocks) runs the
    block's own `__call__` under `jax.checkpoint`. `Pipeline(stages, microbatches)` on a
    list of blocks runs them as a pipeline while the model's own loop over them runs as
    written (an `eqpar.nn.PipelinedBlocks`); the other keys convert the layers inside. With
    `schedule="1f1b"` or `"zb-h1"`, train through `eqpar.value_and_grad(loss_fn)`.

    **Arguments:**

    - `model`: any Equinox model (or pytree of them); arrays may be abstract.
    - `plan`: `{path or regex: style}`; the styles are `ColumnParallel`, `RowParallel`,
      `HeadParallel`, `ContextParallel` (attention over a split sequence), `VocabParallel`,
      `FeatureParallel`, `SequenceParallel` (dropout), `Replicated`, for blocks `Remat`
      and `SplitSequence`, for mixtures of experts `ExpertParallel`, for a list of blocks
      `Pipeline`, and for raw array leaves `Sharded` (the compiled route).
    - `mesh`: optional; when given, the styles' axes must be mesh axes and every size the
      plan splits must divide by its axis size (checked here rather than at trace time), and
      the converted model's concrete arrays are placed on it.
    - `strict`: a plan key that matches no layer raises (`True`) or warns (`False`).

    **Returns:** the converted model (a new pytree; `model` is unchanged).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar

    class MLP(eqx.Module):  # written without eqpar in mind
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up, self.down = eqx.nn.Linear(8, 32, key=k1), eqx.nn.Linear(32, 8, key=k2)
        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    model = MLP(jax.random.key(0))
    plan = {"up": eqpar.ColumnParallel(), "down": eqpar.RowParallel()}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    forward = eqpar.shard_map(
        lambda m, x: jax.vmap(m)(x), mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data")), out_specs=P("data"),
    )
    x = jnp.ones((4, 8))
    assert jnp.allclose(forward(parallel, x), jax.vmap(model)(x), atol=1e-5)
    assert eqx.tree_equal(eqpar.unparallelize(parallel), model)
    ```
    """
    all_patterns = _check_plan(plan)
    block_patterns = {k: p for k, p in all_patterns.items() if _is_block_style(plan[k])}
    _check_block_styles(plan)
    array_patterns = {k: p for k, p in all_patterns.items() if isinstance(plan[k], Sharded)}
    pipeline_patterns = {k: p for k, p in all_patterns.items() if isinstance(plan[k], Pipeline)}
    patterns = {  # ContextParallel keys name attention layers or hand-written blocks
        k: p
        for k, p in all_patterns.items()
        if (k not in block_patterns or isinstance(plan[k], ContextParallel))
        and k not in array_patterns
        and k not in pipeline_patterns
    }
    axis_sizes = None if mesh is None else dict(as_jax_mesh(mesh).shape)
    used: set[str] = set()
    paths: list[str] = []
    split_axes, sequence_axes = _plan_axes(plan)

    def convert_blocks(node: PyTree, path: tuple) -> PyTree:
        if block_patterns:
            where = path_to_str(path)
            key = single_match(block_patterns, where, "parallelize")
            if key is not None and isinstance(plan[key], ContextParallel):
                if _is_plannable(node) or not isinstance(node, eqx.Module):
                    key = None  # an eqx.nn.MultiheadAttention: converted as a layer below
                else:
                    plan[key].check_block()
            if key is not None:
                used.add(key)
                style = plan[key]
                if isinstance(style, ExpertParallel | HeadParallel) and axis_sizes is not None:
                    _check_axis(style, node, where, axis_sizes)
                try:
                    if isinstance(node, list | tuple):
                        node = style.convert_list(node)
                    else:
                        node = style.convert(node)
                except TypeError as error:
                    raise TypeError(
                        f"parallelize: plan[{key!r}] = {style!r} cannot convert {where!r}: {error}"
                    ) from error
        # Keys for blocks inside this one (or for each block of a converted list) still apply.
        return map_children(node, path, convert_blocks)

    if block_patterns:
        model = convert_blocks(model, ())
    if array_patterns:
        model = _attach_array_specs(model, plan, array_patterns, used, axis_sizes)

    chosen: dict[str, str] = {}  # layer path -> the plan key that converts it

    def convert(path: tuple, node: PyTree) -> PyTree:
        if not _is_plannable(node):
            return node
        where = path_to_str(path)
        paths.append(where)
        key = single_match(patterns, where, "parallelize")
        if key is None:
            return _split_aware(node, split_axes, sequence_axes)
        used.add(key)
        chosen[where] = key
        style = plan[key]
        options = block_options(node)
        if options is not None and options.specs and not isinstance(style, Replicated):
            raise ValueError(
                f"parallelize: plan[{key!r}] = {style!r} converts the layer at {where!r}, whose "
                f"leaves {[name for name, _ in options.specs]} Sharded keys lay out: the two "
                f"layouts conflict. Keep one: the layer's style (inside shard_map) or the "
                f"Sharded keys (the compiled route)."
            )
        serial = to_serial_layer(node)
        if not isinstance(serial, style.accepts):
            names = ", ".join(f"eqx.nn.{t.__name__}" for t in style.accepts)
            raise TypeError(
                f"parallelize: plan[{key!r}] = {style!r} applies to {names}, but the layer at "
                f"{where!r} is a {type(serial).__name__}. Narrow the key, or choose a style "
                f"for that layer."
            )
        if axis_sizes is not None and style.axis is not None:
            _check_axis(style, serial, where, axis_sizes)
        try:
            return style.convert(serial)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"parallelize: plan[{key!r}] = {style!r} cannot convert the layer at "
                f"{where!r}: {error}"
            ) from error

    converted = jax.tree_util.tree_map_with_path(convert, model, is_leaf=_is_plannable)
    _check_columns_in_a_row(converted, plan, chosen)
    converted = mark_head_checks(converted)
    if pipeline_patterns:
        converted = _pipeline_lists(converted, plan, pipeline_patterns, used, axis_sizes)
    unused = [key for key in plan if key not in used]
    if unused:
        hints = unused_key_hints(unused, paths)
        message = (
            f"parallelize: plan keys that match no layer: {hints}. Keys are "
            f"matched against the paths of Linear, MultiheadAttention, Embedding, LayerNorm, "
            f"RMSNorm, Dropout and RotaryPositionalEmbedding layers, Remat / SplitSequence "
            f"keys against the paths of blocks (modules) and lists of them, ExpertParallel "
            f"keys against the paths of mixtures of experts, Pipeline keys "
            f"against the paths of lists of blocks, and Sharded keys against the paths of "
            f"array leaves "
            f"(`eqpar.leaf_paths(model)` lists leaf paths; drop the last part such as "
            f"'/weight'). The projections inside a MultiheadAttention are "
            f"not layers of their own here: HeadParallel() on the attention splits them all. "
            f"A hand-written attention block that keeps its head count in an int field "
            f"takes HeadParallel(fields=('n_heads',)) keyed by the block's path."
        )
        if strict:
            raise ValueError(message + " Pass strict=False to only warn.")
        warnings.warn(message, stacklevel=2)
    if mesh is not None:
        converted = _placed(converted, mesh)
    return converted


def _placed(model: PyTree, mesh: DeviceMesh | jax.sharding.Mesh) -> PyTree:
    """`model`'s concrete arrays (NumPy's too) placed on `mesh` by its layout: what the
    converted layers need to open their own regions. Abstract leaves and tracers stay as
    they are, and so does an array already on this mesh (laid out by the user, e.g. split
    for FSDP as well)."""
    specs = partition_specs(model, mesh=mesh)
    shardings = named_shardings(specs, mesh)
    jax_mesh = as_jax_mesh(mesh)

    def place(leaf: Any, sharding: Any) -> Any:
        if not eqx.is_array(leaf) or isinstance(leaf, Tracer):
            return leaf
        if getattr(getattr(leaf, "sharding", None), "mesh", None) == jax_mesh:
            return leaf
        return jax.device_put(leaf, sharding)

    return jax.tree.map(place, model, shardings, is_leaf=lambda x: x is None)


# Layers a split activation passes through unchanged on its way to the next linear. Not
# `eqx.nn.Lambda`: it may gather the features again (the layer then refuses at trace time if
# it does not).
_ELEMENTWISE = (eqx.nn.Dropout, eqx.nn.Identity)


def _check_columns_in_a_row(model: PyTree, plan: Mapping, chosen: dict[str, str]) -> None:
    """Refuse a column-parallel linear right after another in an `eqx.nn.MLP` or
    `eqx.nn.Sequential` (whose layers run in order): the second would get the first's block
    of features, not the whole input it needs."""

    def visit(node: PyTree, path: tuple) -> None:
        if isinstance(node, eqx.nn.MLP | eqx.nn.Sequential):
            check_in_order(node, path)
        if _is_plannable(node):
            return
        flat, treedef = children(node)
        if not jax.tree_util.treedef_is_leaf(treedef):
            for key, child in flat:
                visit(child, (*path, *key))

    def named(where: str) -> str:
        key = chosen.get(where)
        style = "a ColumnParallel style" if key is None else f"plan[{key!r}] = {plan[key]!r}"
        return f"{where!r} ({style})"

    def check_in_order(container: PyTree, path: tuple) -> None:
        # The column layer whose block of features reaches the next layer, and its path.
        split_by: tuple[str, ColumnParallelLinear] | None = None
        for i, layer in enumerate(container.layers):
            where = path_to_str((*path, jax.tree_util.GetAttrKey("layers"), i))
            if isinstance(layer, ColumnParallelLinear):
                if split_by is not None:
                    first, column = split_by
                    at = repr(path_to_str(path)) if path else "the root"
                    runs = f"the {type(container).__name__} at {at} runs"
                    key = chosen.get(first)
                    if key is not None and key == chosen.get(where):
                        what = (
                            f"plan[{key!r}] = {plan[key]!r} matches both {first!r} and "
                            f"{where!r}, and {runs} them in a row"
                        )
                    else:
                        what = f"{runs} {named(first)} and then {named(where)} on its output"
                    raise ValueError(
                        f"parallelize: {what}. The first leaves its output split over "
                        f"{column.axis_name!r} (this device's block of features), but a "
                        f"ColumnParallel layer needs the whole input. "
                        + columns_in_a_row_fix(repr(where), repr(first))
                    )
                split_by = None if layer.gather_output else (where, layer)
            elif not isinstance(layer, _ELEMENTWISE):
                split_by = None

    visit(model, ())


def _attach_array_specs(
    model: PyTree, plan: Mapping, patterns: dict, used: set, axis_sizes: dict | None
) -> PyTree:
    """Each raw array a `Sharded` key names, declared by the innermost module holding it."""
    owned: dict[tuple, dict[str, PartitionSpec]] = {}

    def visit(node: PyTree, path: tuple, owner: tuple | None) -> PyTree:
        if eqx.is_array(node) or isinstance(node, jax.ShapeDtypeStruct):
            where = path_to_str(path)
            key = single_match(patterns, where, "parallelize")
            if key is None:
                return node
            used.add(key)
            spec = plan[key].spec
            if owner is None:
                raise ValueError(
                    f"parallelize: plan[{key!r}] = {plan[key]!r} names {where!r}, which no "
                    f"eqx.Module holds; Sharded lays out arrays that a module of the model "
                    f"holds (the module declares their specs)."
                )
            check_spec(where, spec, tuple(node.shape), axis_sizes, source=f"plan[{key!r}]")
            relative = path_to_str(path[len(owner) :])
            owned.setdefault(owner, {})[relative] = spec
            return node
        if isinstance(node, eqx.Module):
            node = map_children(node, path, lambda child, p: visit(child, p, path))
            specs = owned.get(path)
            if specs:
                clash = sorted(set(specs) & set(author_declared_specs(node)))
                if clash:
                    raise ValueError(
                        f"parallelize: a Sharded key names {clash} of the module at "
                        f"{path_to_str(path)!r}, whose class declares their layout itself "
                        f"(`__partition_specs__`); drop the key."
                    )
                earlier = dict((block_options(node) or BlockOptions()).specs)  # a former call's
                merged = tuple(sorted({**earlier, **specs}.items()))
                node = convert_block(node, "Sharded", specs=merged)
            return node
        return map_children(node, path, lambda child, p: visit(child, p, owner))

    return visit(model, (), None)


def _pipeline_lists(
    model: PyTree,
    plan: Mapping[str, Style],
    patterns: dict,
    used: set[str],
    axis_sizes: dict | None,
) -> PyTree:
    """The lists that `Pipeline` keys name, each made a `PipelinedBlocks` (last, so that the
    layers inside the blocks are converted by the other keys first)."""

    def visit(node: PyTree, path: tuple) -> PyTree:
        where = path_to_str(path)
        key = single_match(patterns, where, "parallelize")
        if key is None:
            return map_children(node, path, visit)
        style = plan[key]
        assert isinstance(style, Pipeline)
        if not isinstance(node, list | tuple):
            raise TypeError(
                f"parallelize: plan[{key!r}] = {style!r} names {where!r}, a "
                f"{type(node).__name__}; Pipeline applies to the model's list (or tuple) of "
                f"blocks. Name the list (e.g. 'layers' rather than 'layers/0')."
            )
        used.add(key)
        if axis_sizes is not None:
            axis = style.axis_name
            if axis not in axis_sizes:
                raise ValueError(
                    f"parallelize: plan[{key!r}] = {style!r} names axis {axis!r}, which the "
                    f"mesh {tuple(axis_sizes)} does not have."
                )
            if axis_sizes[axis] != style.stages:
                raise ValueError(
                    f"parallelize: plan[{key!r}] = {style!r} has stages={style.stages}, but "
                    f"the mesh axis {axis!r} has {axis_sizes[axis]} devices; pass "
                    f"stages={axis_sizes[axis]} (more stages per device: repeats)."
                )
        try:
            return style.convert_list(node)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"parallelize: plan[{key!r}] = {style!r} cannot pipeline {where!r}: {error}"
            ) from error

    return visit(model, ())


def _check_block_styles(plan: Mapping[str, Style]) -> None:
    pipes = {s.axis_name: k for k, s in plan.items() if isinstance(s, Pipeline)}
    for key, style in plan.items():
        names = style.axis if isinstance(style.axis, tuple) else (style.axis,)
        clash = [name for name in names if name in pipes and not isinstance(style, Pipeline)]
        if clash:
            raise ValueError(
                f"parallelize: plan[{key!r}] = {style!r} splits over axis {clash[0]!r}, which "
                f"plan[{pipes[clash[0]]!r}] pipelines over; a pipeline's devices each hold "
                f"other blocks, so they cannot also split one layer. Use another mesh axis."
            )
    split = {s.axis_name for s in plan.values() if isinstance(s, SplitSequence)}
    for key, style in plan.items():
        if isinstance(style, ContextParallel) and style.axis_name in split:
            if style.layout != "contiguous":
                raise ValueError(
                    f"parallelize: plan[{key!r}] = {style!r} expects the sequence in the "
                    f"{style.layout!r} layout, but SplitSequence({style.axis_name!r}) splits "
                    f"it into contiguous blocks. Use layout='contiguous', or split the "
                    f"sequence yourself in that layout (eqpar.context.balance_sequence) and "
                    f"drop SplitSequence."
                )


def _plan_axes(plan: Mapping[str, Style]) -> tuple[tuple, tuple]:
    """The mesh axes the plan splits activations over, and its context-parallel
    `(axis, layout)` pairs (over which the sequence is split from the inputs onwards)."""
    split_axes: dict = {}
    sequence_axes: dict = {}
    for style in plan.values():
        if isinstance(style, Pipeline | ExpertParallel):
            continue  # whole activations per device (a stage's; tokens as over a data axis)
        for axis in (style.axis, getattr(style, "head_axis_name", None)):
            if axis is not None:  # a tuple of axes splits over their product: kept whole
                split_axes[axis] = None
        if isinstance(style, ContextParallel):
            sequence_axes[(style.axis_name, style.layout)] = None
    return tuple(split_axes), tuple(sequence_axes)


def _split_aware(node: PyTree, split_axes: tuple, sequence_axes: tuple) -> PyTree:
    """A layer no plan key names, made right on split activations where that matters: every
    dropout draws the serial mask (`ParallelDropout`), and a rotary embedding uses global
    positions where the plan splits the sequence (`ParallelRotaryEmbedding`)."""
    if isinstance(node, eqx.nn.Dropout) and split_axes:
        if isinstance(node, ParallelDropout):  # converted before: keep the axes it knew
            split_axes = tuple(dict.fromkeys((*node.axis_names, *split_axes)))
            sequence_axes = tuple(dict.fromkeys((*node.sequence_axes, *sequence_axes)))
        elif type(node) is not eqx.nn.Dropout:
            return node  # SequenceParallelDropout, or the author's own subclass
        return ParallelDropout(
            to_serial_layer(node), axis_names=split_axes, sequence_axes=sequence_axes
        )
    if isinstance(node, eqx.nn.RotaryPositionalEmbedding) and sequence_axes:
        if isinstance(node, ParallelRotaryEmbedding):
            sequence_axes = tuple(dict.fromkeys((*node.sequence_axes, *sequence_axes)))
        elif type(node) is not eqx.nn.RotaryPositionalEmbedding:
            return node
        return ParallelRotaryEmbedding(to_serial_layer(node), sequence_axes=sequence_axes)
    return node


def _check_axis(style: Style, layer: PyTree, where: str, axis_sizes: dict) -> None:
    for axis, sizes in style.axis_splits(layer).items():
        _check_one_axis(style, axis, sizes, where, axis_sizes)


def _check_one_axis(
    style: Style, axis: Hashable, sizes: dict, where: str, axis_sizes: dict
) -> None:
    # A tuple of axes splits over all of them at once (their product), as in a PartitionSpec.
    names = axis if isinstance(axis, tuple) else (axis,)
    missing = [name for name in names if name not in axis_sizes]
    if missing:
        raise ValueError(
            f"parallelize: {style!r} for the layer at {where!r} names axis "
            f"{missing[0]!r}, which the mesh {tuple(axis_sizes)} does not have."
        )
    n = math.prod(axis_sizes[name] for name in names)
    for label, size in sizes.items():
        if size % n:
            raise ValueError(
                f"parallelize: the layer at {where!r} has {label}={size}, which does not "
                f"divide by the size of axis {axis!r} ({n}); {style!r} splits it. Choose "
                f"another style for this layer (Replicated() keeps it whole) or a smaller axis."
            )


def unparallelize(model: PyTree) -> PyTree:
    """The inverse of `parallelize`: every converted layer back in its original class.

    **Arguments:**

    - `model`: a model returned by `parallelize` (or any pytree).

    **Returns:** the model with `eqx.nn.Linear`, `MultiheadAttention` and `Embedding` layers
    where `parallelize` put their tensor-parallel twins; the parameters are the same arrays,
    except on a mesh with Explicit axes (`jax.make_mesh`'s default), where an array split over
    one comes back whole over it: there the split is part of the array's type, and the
    serial layers' code, written for one device, could not take it.

    ```python
    import equinox as eqx, jax, eqpar
    mlp = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    plan = {"layers/0": eqpar.ColumnParallel(), "layers/1": eqpar.RowParallel()}
    parallel = eqpar.parallelize(mlp, plan)
    assert type(eqpar.unparallelize(parallel).layers[0]) is eqx.nn.Linear
    ```
    """

    def serial(node: PyTree) -> PyTree:
        if isinstance(node, MixtureOfExperts):
            return serial_experts(node)
        if isinstance(node, PipelinedBlocks):
            return unparallelize(node.serial())
        if block_options(node) is not None:
            return unparallelize(serial_block(node))
        return to_serial_layer(node)

    model = jax.tree.map(gather_explicit, model)  # before unstacking: indexing takes them
    return jax.tree.map(
        serial,
        model,
        is_leaf=lambda node: (
            isinstance(node, (*PARALLEL_LAYERS, PipelinedBlocks, MixtureOfExperts))
            or block_options(node) is not None
        ),
    )
