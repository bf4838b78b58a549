"""Rematerialization policies of `ScannedLayers` (and so of `PipelineModule.from_layers`):
the same values and gradients, and activation memory that grows by what the policy keeps."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import memory_figures
from jax import lax
from numerics import assert_tree_close
from residual_block import Block

from eqpar.nn import PipelineModule, ScannedLayers

DIM, TOKENS = 16, 32  # the block is 16 wide (MLP 64)


def layers(depth):
    return eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), depth))


def step(model, x):
    return eqx.filter_value_and_grad(lambda m, x: jnp.sum(jnp.tanh(m(x))))(model, x)


X = jax.random.normal(jax.random.key(1), (TOKENS, DIM))


def test_every_policy_gives_the_same_values_and_gradients():
    value, grads = eqx.filter_jit(step)(ScannedLayers(layers(4)), X)
    for remat in ("full", "matmuls", True):
        got_value, got_grads = eqx.filter_jit(step)(ScannedLayers(layers(4), remat=remat), X)
        # A float32 sum of 512 tanh values, in an order each policy's fusion picks: the float32
        # tolerance (1e-6 measured 0.69 of itself on AVX2), not a tighter one.
        assert_tree_close(got_value, value, what=f"{remat} value")
        assert_tree_close(got_grads, grads, what=f"{remat} gradients")


def test_activation_memory_grows_by_what_the_policy_keeps():
    """From the compiled programs (exact figures): with "full", each extra layer adds at most
    its input; "matmuls" adds more but less than storing everything ("none")."""

    def temp(depth, remat):
        compiled = eqx.filter_jit(step).lower(ScannedLayers(layers(depth), remat=remat), X)
        return memory_figures(compiled.compile())["temp"]

    per_layer = {
        remat: (temp(8, remat) - temp(4, remat)) / 4 for remat in ("none", "full", "matmuls")
    }
    layer_input = TOKENS * DIM * 4
    assert per_layer["full"] <= layer_input, per_layer
    assert per_layer["full"] < per_layer["matmuls"] < per_layer["none"], per_layer


def test_from_layers_gives_each_layer_the_policy_and_refuses_unknown_ones():
    pipeline = PipelineModule.from_layers(
        layers(4), num_stages=1, num_microbatches=1, remat="matmuls"
    )
    assert pipeline.stages.remat == "matmuls" and pipeline.remat == "none"
    with pytest.raises(
        ValueError,
        match=r"PipelineModule.from_layers: `remat` must be one of \['none', 'full', 'matmuls'\]",
    ):
        PipelineModule.from_layers(layers(2), num_stages=1, num_microbatches=1, remat="all")
    with pytest.raises(TypeError):  # the annotation already says which strings
        ScannedLayers(layers(2), remat="some")  # type: ignore[arg-type]


def test_circular_pipeline_keeps_the_layers_policy():
    """Differentiated, the circular schedule runs its training table's backward (which keeps
    no copy of the stage's weights per step) under the policy of the layers inside: with
    "full" its temp falls as GPipe's does, and stays within 1.1x of GPipe's plus one batch of
    activations (exact compiler figures; at this small size the tables differ by 1.09x, and
    `jax.grad` adds the outputs it returns to each)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import eqpar

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    x = jax.random.normal(jax.random.key(2), (4 * TOKENS, DIM))  # 4 microbatches of X's shape

    def temp(repeats, remat):
        pipeline = PipelineModule.from_layers(
            layers(8), num_stages=4, num_repeats=repeats, num_microbatches=4, remat=remat,
            axis_name="pipe", broadcast_output=True,
        )  # fmt: skip
        specs = eqpar.partition_specs(pipeline)
        run = eqpar.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(specs, P()), out_specs=P())
        train = eqx.filter_value_and_grad(lambda m, x: jnp.sum(jnp.tanh(run(m, x))))
        compiled = eqx.filter_jit(train).lower(pipeline, x).compile()
        return memory_figures(compiled)["temp"]

    circular = {remat: temp(2, remat) for remat in ("none", "full")}
    gpipe_full = temp(1, "full")
    assert circular["full"] < circular["none"] / 2, circular
    assert circular["full"] <= 1.1 * gpipe_full + x.nbytes, (circular, gpipe_full)


def test_data_parallel_layers_reduce_each_gradient_inside_the_backward_scan():
    """A one-stage, one-microbatch `PipelineModule` (data parallel, no pipeline) calls its
    stage directly: the gradient of each layer is summed over `data` inside the backward
    scan, so the stacked gradients are never held unreduced and each extra layer adds at
    most its input to the temp (exact compiler figures), with the gradients of the serial
    twin."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import eqpar

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("data", "pipe"))
    x = jax.random.normal(jax.random.key(3), (4 * TOKENS, DIM))

    def build(depth):
        return PipelineModule.from_layers(
            layers(depth), num_stages=1, num_microbatches=1, remat="full", axis_name="pipe",
            broadcast_output=True,
        )  # fmt: skip

    def train(pipeline):
        specs = eqpar.partition_specs(pipeline)
        run = eqpar.shard_map(
            lambda m, x: lax.psum(jnp.sum(jnp.tanh(m(x))), "data"),
            mesh=mesh, in_specs=(specs, P("data")), out_specs=P(),
        )  # fmt: skip
        return eqx.filter_jit(eqx.filter_value_and_grad(run))

    def temp(depth):
        pipeline = build(depth)
        return memory_figures(train(pipeline).lower(pipeline, x).compile())["temp"]

    per_layer = (temp(8) - temp(4)) / 4
    layer_input = TOKENS * DIM * 4  # this device's rows
    layer_params = sum(leaf.nbytes for leaf in jax.tree.leaves(eqx.filter(layers(1), eqx.is_array)))
    assert layer_params > layer_input  # so held gradients would show
    assert per_layer <= layer_input, (per_layer, layer_input, layer_params)

    pipeline = build(4)
    value, grads = train(pipeline)(pipeline, x)
    serial_value, serial_grads = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, x: jnp.sum(jnp.tanh(m.apply_serially(x))))
    )(pipeline, x)
    assert_tree_close(value, serial_value, what="value")
    assert_tree_close(grads, serial_grads, what="gradients")
