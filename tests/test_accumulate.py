"""Gradient accumulation on any mesh: `eqpar.value_and_grad(loss_fn, microbatches=N)` against
the whole batch on one device (loss, and an SGD update from the gradients)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from _hlo import collective_summary, memory_figures
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close
from residual_block import Block

import eqpar
from eqpar.nn import ScannedLayers, gather_layers

DIM, DEPTH, ROWS = 16, 4, 64
X = jax.random.normal(jax.random.key(1), (ROWS, 8, DIM))  # [rows, tokens, features]
Y = jax.random.normal(jax.random.key(2), (ROWS, 8, DIM))


def stack() -> ScannedLayers:
    return ScannedLayers(eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), DEPTH)))


def mean_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def sum_loss(model, x, y):
    return jnp.sum((jax.vmap(model)(x) - y) ** 2)


def sgd(model, grads, lr=0.5):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -lr * g, grads))


REPLICATED = P()


def accumulated_step(loss_fn, model, mesh, *, microbatches, specs=REPLICATED, **options):
    return eqx.filter_jit(
        eqpar.shard_map(
            eqpar.value_and_grad(loss_fn, microbatches=microbatches, **options),
            mesh=mesh,
            in_specs=(specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
    )


@pytest.mark.parametrize("microbatches", [2, 8])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_accumulation_on_a_data_mesh_equals_the_whole_batch(microbatches, reduction):
    model = stack()
    loss_fn = mean_loss if reduction == "mean" else sum_loss
    serial_loss, serial_grads = eqx.filter_value_and_grad(loss_fn)(model, X, Y)
    mesh = eqpar.DeviceMesh((8,), ("data",))
    step = accumulated_step(loss_fn, model, mesh, microbatches=microbatches, reduction=reduction)
    loss, grads = step(model, X, Y)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(sgd(model, grads), sgd(model, serial_grads))


def test_a_loss_that_reduces_over_the_shards_itself_is_not_divided_twice():
    """`loss_fn` may take the mean over the data shards itself (`lax.pmean`), as the
    example's does: the rule then leaves the loss as it is."""
    model = stack()
    serial_loss, serial_grads = eqx.filter_value_and_grad(mean_loss)(model, X, Y)
    mesh = eqpar.DeviceMesh((8,), ("data",))
    own = lambda m, x, y: jax.lax.pmean(mean_loss(m, x, y), "data")
    loss, grads = accumulated_step(own, model, mesh, microbatches=4)(model, X, Y)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(sgd(model, grads), sgd(model, serial_grads))


def test_accumulation_under_fsdp_layer_by_layer_equals_the_whole_batch():
    """FSDP (`gather_layers`): each microbatch gathers the layers and reduce-scatters their
    gradients into the split sums."""
    serial = stack()
    serial_loss, serial_grads = eqx.filter_value_and_grad(mean_loss)(serial, X, Y)
    mesh = eqpar.DeviceMesh((8,), ("data",))
    model = gather_layers(serial, mesh, min_size_bytes=0)
    specs = eqpar.partition_specs(model)
    placed = eqx.filter_shard(model, eqpar.named_shardings(specs, mesh))
    loss, grads = accumulated_step(mean_loss, model, mesh, microbatches=4, specs=specs)(
        placed, X, Y
    )
    assert grads.layers.up.weight.sharding.spec == specs.layers.up.weight
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(sgd(placed, grads)), sgd(serial, serial_grads))


def test_accumulation_holds_one_microbatch_and_reduces_once():
    """From the compiled programs (exact): with 8 microbatches the step's temp falls below
    the whole batch's, and the gradients are still all-reduced once per step (the same
    all-reduce bytes)."""
    model = stack()
    mesh = eqpar.DeviceMesh((8,), ("data",))
    figures = {}
    for microbatches in (1, 8):
        step = accumulated_step(mean_loss, model, mesh, microbatches=microbatches)
        compiled = step.lower(model, X, Y).compile()
        figures[microbatches] = (
            memory_figures(compiled)["temp"],
            collective_summary(compiled).bytes.get("all-reduce", 0),
        )
    assert figures[8][0] < figures[1][0], figures
    assert figures[8][1] == figures[1][1], figures


def test_aux_comes_back_per_microbatch():
    model = stack()
    mesh = eqpar.DeviceMesh((8,), ("data",))
    with_aux = lambda m, x, y: (mean_loss(m, x, y), jnp.mean(x))
    step = eqpar.shard_map(
        eqpar.value_and_grad(with_aux, has_aux=True, microbatches=4),
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=((P(), P("data")), P()),
    )
    (_, aux), _ = eqx.filter_jit(step)(model, X, Y)
    assert aux.shape == (8 * 4,)  # 4 per device, one per microbatch
    expected = X.reshape(8, 4, 2, 8, DIM).mean(axis=(2, 3, 4)).reshape(-1)
    assert_tree_close(aux, expected, what="aux")


def test_bad_microbatches_are_named():
    model = stack()
    mesh = eqpar.DeviceMesh((8,), ("data",))
    with pytest.raises(Exception, match="microbatches"):
        eqpar.value_and_grad(mean_loss, microbatches=0)
    with pytest.raises(ValueError, match=r"8 rows on this device does not divide into "):
        accumulated_step(mean_loss, model, mesh, microbatches=3)(model, X, Y)
    layers = [Block(k) for k in jax.random.split(jax.random.key(0), 4)]
    plan = {"": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    pipelined = eqpar.parallelize(layers, plan)
    pipe_mesh = eqpar.DeviceMesh((4, 2), ("data", "pipe"))
    loss = lambda m, x, y: mean_loss(lambda h: _chain(m, h), x, y)
    step = eqpar.shard_map(
        eqpar.value_and_grad(loss, microbatches=2),
        mesh=pipe_mesh,
        in_specs=(eqpar.partition_specs(pipelined), P("data"), P("data")),
        out_specs=(P(), eqpar.partition_specs(pipelined)),
    )
    with pytest.raises(ValueError, match=r"microbatches=2 with blocks pipelined by"):
        jax.eval_shape(step, pipelined, X, Y)


def _chain(layers, h):
    for layer in layers:
        h = layer(h)
    return h
