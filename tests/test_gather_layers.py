"""FSDP layer by layer (`eqpar.nn.gather_layers`) against the serial model and against FSDP
that gathers every parameter at the `shard_map` boundary."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from _hlo import collective_summary, memory_figures
from jax import lax
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close
from residual_block import Block

import eqpar
from eqpar.nn import PipelineModule, ScannedLayers, gather_layers

DIM, TOKENS, DEPTH = 16, 8, 4  # the block is 16 wide (MLP 64)
LR = 0.5


def stack(remat="none"):
    return ScannedLayers(
        eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), DEPTH)), remat=remat
    )


def serial_loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


X = jax.random.normal(jax.random.key(1), (8, TOKENS, DIM))


def fsdp_step(model, mesh):
    """Store by FSDP, compute inside shard_map with the layout the model declares."""
    storage = eqpar.FSDP(mesh, axis="data", min_size_bytes=0).partition_specs(model)
    placed = eqx.filter_shard(model, eqpar.named_shardings(storage, mesh))
    loss = eqpar.shard_map(
        lambda m, x: lax.pmean(serial_loss(m, x), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(model), P("data")),
        out_specs=P(),
    )
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    return step, placed


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def assert_close(got, expected):
    """The float arrays of `got` (unparallelized) against the serial model's, each relative to
    its scale (`numerics.assert_tree_close`)."""
    assert_arrays_close(eqpar.unparallelize(got), expected)


@pytest.mark.parametrize(
    ("mesh_shape", "remat"), [((8, 1), "none"), ((2, 4), "full")], ids=["fsdp8", "fsdp2xtp4"]
)
def test_sgd_step_equals_serial(mesh_shape, remat):
    mesh = eqpar.DeviceMesh(mesh_shape, ("data", "model"))
    serial = stack(remat)
    value, grads = eqx.filter_value_and_grad(serial_loss)(serial, X)
    model = serial
    if mesh_shape[1] > 1:  # tensor parallel inside every layer, FSDP over data on top
        plan = {"layers/up": eqpar.ColumnParallel(), "layers/down": eqpar.RowParallel()}
        model = eqpar.parallelize(model, plan, mesh=mesh)
    model = gather_layers(model, mesh, min_size_bytes=0)
    specs = eqpar.partition_specs(model)
    if mesh_shape[1] > 1:
        assert specs.layers.up.weight == P(None, "model", "data")
        assert specs.layers.down.weight == P(None, "data", "model")
    else:
        assert specs.layers.up.weight == P(None, "data")
    step, placed = fsdp_step(model, mesh)
    got_value, got_grads = step(placed, X)
    assert_tree_close(got_value, value, what="loss")
    assert got_grads.layers.up.weight.sharding.spec == specs.layers.up.weight
    assert_close(sgd(placed, got_grads), sgd(serial, grads))


def test_per_layer_gathering_reduce_scatters_and_holds_less_than_gathering_at_the_boundary():
    """From the compiled programs (exact figures): the gradient is reduce-scattered per layer
    instead of all-reduced whole, and temp memory falls."""
    mesh = eqpar.DeviceMesh((8,), ("data",))
    figures = {}
    for name, model in (
        ("boundary", stack("full")),
        ("per layer", gather_layers(stack("full"), mesh, min_size_bytes=0)),
    ):
        step, placed = fsdp_step(model, mesh)
        compiled = step.lower(placed, X).compile()
        figures[name] = (memory_figures(compiled)["temp"], collective_summary(compiled).bytes)
    boundary, per_layer = figures["boundary"], figures["per layer"]
    assert per_layer[1].get("reduce-scatter", 0) > 0, figures
    assert per_layer[1].get("all-reduce", 0) < boundary[1].get("all-reduce", 0) / 100, figures
    assert per_layer[0] < boundary[0], figures


def test_pipeline_stages_gather_per_layer_and_errors_name_the_fix():
    layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), DEPTH))
    pipeline = PipelineModule.from_layers(
        layers, num_stages=2, num_microbatches=2, broadcast_output=True
    )
    mesh = eqpar.DeviceMesh((4, 2), ("data", "pipe"))
    gathered = gather_layers(pipeline, mesh, min_size_bytes=0)
    specs = eqpar.partition_specs(gathered)
    assert specs.stages.layers.up.weight == P("pipe", None, "data")  # [S, L/S, out, in]
    rows = X.reshape(-1, DIM)  # the blocks treat the rows as one sequence of tokens
    value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m.apply_serially(rows) ** 2))(
        pipeline
    )
    storage = eqpar.FSDP(mesh, axis="data", min_size_bytes=0).partition_specs(gathered)
    placed = eqx.filter_shard(gathered, eqpar.named_shardings(storage, mesh))
    loss = eqpar.shard_map(
        lambda m, x: lax.pmean(jnp.mean(m(x) ** 2), "data"),
        mesh=mesh, in_specs=(specs, P("data")), out_specs=P(),
    )  # fmt: skip
    got_value, got_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(placed, rows)
    assert_tree_close(got_value, value, what="loss")
    assert_close(got_grads, grads)
    with pytest.raises(ValueError, match="holds no ScannedLayers"):
        gather_layers({"w": jnp.ones(4)}, mesh)
    with pytest.raises(ValueError, match="axis='batch' is not an axis"):
        gather_layers(pipeline, mesh, axis="batch")


@pytest.mark.parametrize("remat", ["none", "full", "matmuls"])
def test_backward_gathers_again_unless_asked_to_keep(remat):
    """Under every remat policy the backward pass gathers each layer again (ZeRO-3: two
    all-gathers of the layers per step, one reduce-scatter) and keeps no gathered copy:
    `keep_gathered=True` gathers once and holds every layer's gathered parameters instead.
    From the compiled programs (exact figures)."""
    mesh = eqpar.DeviceMesh((8,), ("data",))
    figures = {}
    for keep in (False, True):
        model = gather_layers(stack(remat), mesh, min_size_bytes=0, keep_gathered=keep)
        step, placed = fsdp_step(model, mesh)
        compiled = step.lower(placed, X).compile()
        summary = collective_summary(compiled)
        figures[keep] = (memory_figures(compiled)["temp"], summary.bytes)
    leaves = jax.tree.leaves(stack().layers)
    layer_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)  # all layers, whole
    # The weight matrices ([L, out, in]): what the backward pass reads of the parameters
    # (a bias's gradient does not need the bias, so biases are gathered once).
    matrix_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves if leaf.ndim == 3)
    freed, kept = figures[False], figures[True]
    # min_size_bytes=0: every leaf is gathered in the forward pass, (n-1)/n of its bytes per
    # device; the backward pass gathers again at least the weight matrices unless they are
    # kept (and, recomputing the forward pass under "full" or "matmuls", what it reads).
    assert kept[1]["all-gather"] == pytest.approx(layer_bytes * 7 / 8), figures
    again = freed[1]["all-gather"] - kept[1]["all-gather"]
    assert matrix_bytes * 7 / 8 <= again <= layer_bytes * 7 / 8, figures
    assert freed[1]["reduce-scatter"] == kept[1]["reduce-scatter"], figures
    # Keeping the gathered copies holds at least the layers' whole weight matrices beyond
    # one layer's (the stored split is an argument, not temp).
    assert kept[0] - freed[0] >= matrix_bytes * (DEPTH - 1) / DEPTH, figures


def test_keep_gathered_is_checked():
    mesh = eqpar.DeviceMesh((8,), ("data",))
    # beartype (as in these tests) or the function itself names the option
    with pytest.raises(Exception, match="keep_gathered"):
        gather_layers(stack(), mesh, keep_gathered="yes")  # pyright: ignore[reportArgumentType]
