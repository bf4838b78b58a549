"""Pipelines by plan over blocks that return more than one array, hold per-instance static
fields, or are called with a residual around them: the author's loop as written.

The Llama of `llama_style.py` in its cached form: each decoder layer returns `(x, (k, v))`
and keys its cache by `str(id(self))`, and the model's loop collects the caches. Under GPipe,
the circular schedule and 1F1B on a `data x pipe` mesh, one plain-SGD step and the caches the
model returns equal the serial ones. A block that returns an auxiliary loss, added up by the
author's loop (and the loop adding each block's input to its output), trains as on one device.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import llama_style as llama
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close
from test_any_model import mesh_of, sgd
from test_pipeline_by_plan import MESH_DP_PP, scheduled_step

import eqpar
from eqpar.nn import PipelinedBlocks


@pytest.fixture(scope="module")
def cached_setup():
    model = llama.CachedLlama(key=jax.random.key(0), layers=4)
    tokens = llama.batch(8)
    step = eqx.filter_jit(eqx.filter_value_and_grad(llama.cached_loss, has_aux=True))
    (loss, caches), grads = step(model, tokens)
    return model, tokens, (loss, caches, sgd(model, grads))


@pytest.mark.parametrize("repeats", [1, 2], ids=["gpipe", "circular"])
def test_llama_layers_returning_caches_pipelined_by_plan(cached_setup, repeats):
    """The caches come back per block, as the serial loop collects them (the batch put back
    together from the microbatches); the loss and the SGD step are the serial ones; the
    layers' per-instance `cache_key`s do not stop them stacking, and come back unchanged."""
    model, tokens, (serial_loss, serial_caches, serial_model) = cached_setup
    mesh = mesh_of(*MESH_DP_PP)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, repeats=repeats)}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    assert isinstance(parallel.layers, PipelinedBlocks)
    assert [layer.cache_key for layer in parallel.layers] == [
        layer.cache_key for layer in model.layers
    ]

    def local(m, tokens):
        loss, caches = llama.cached_loss(m, tokens)
        return lax.pmean(loss, "data"), caches

    run = eqpar.shard_map(
        local,
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data")),
        out_specs=(P(), P("data")),
    )
    step = eqx.filter_jit(eqx.filter_value_and_grad(run, has_aux=True))
    (loss, caches), grads = step(parallel, tokens)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_tree_close(caches, serial_caches, what="caches")
    updated = eqpar.unparallelize(sgd(parallel, grads))
    assert_arrays_close(updated, serial_model)
    assert eqx.tree_equal(eqpar.unparallelize(parallel), model)


def test_llama_layers_returning_caches_one_forward_one_backward(cached_setup):
    """1F1B through `eqpar.value_and_grad`: the caches travel with the activations to the
    last stage, where the loss runs; the step is the serial one."""
    model, tokens, (serial_loss, _, serial_model) = cached_setup
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    loss_only = lambda m, t: llama.cached_loss(m, t)[0]
    loss, updated = scheduled_step(loss_only, model, plan, mesh_of(*MESH_DP_PP), tokens)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


class AuxBlock(eqx.Module):
    """One example `[dim]`: the block's update and an auxiliary loss (as a mixture of experts
    returns its balance loss); the residual is the loop's."""

    linear: eqx.nn.Linear

    def __call__(self, x):
        h = jnp.tanh(self.linear(x))
        return h, jnp.mean(h**2)


class AuxModel(eqx.Module):
    blocks: list

    def __call__(self, x):
        aux_loss = jnp.zeros(())
        for block in self.blocks:
            h, aux = block(x)
            x = x + h
            aux_loss = aux_loss + aux
        return x, aux_loss


def aux_loss_fn(model, x, y):
    out, aux = jax.vmap(model)(x)
    return jnp.mean((out - y) ** 2) + 0.1 * jnp.mean(aux)


def aux_model():
    keys = jax.random.split(jax.random.key(5), 4)
    return AuxModel([AuxBlock(eqx.nn.Linear(6, 6, key=k)) for k in keys])


def aux_batch():
    kx, ky = jax.random.split(jax.random.key(6))
    return jax.random.normal(kx, (8, 6)), jax.random.normal(ky, (8, 6))


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_an_auxiliary_loss_added_up_by_the_loop_and_a_residual_around_the_call(schedule):
    """`h, aux = block(x); x = x + h; aux_loss = aux_loss + aux`: the residual runs inside
    every stage, the auxiliary losses travel with the activations, and the author's sum is
    the serial one, its gradient included (under ZB-H1 the loss runs on the last stage)."""
    model, batch = aux_model(), aux_batch()
    step = eqx.filter_jit(eqx.filter_value_and_grad(aux_loss_fn))
    serial_loss, grads = step(model, *batch)
    serial_model = sgd(model, grads)
    mesh = mesh_of(*MESH_DP_PP)
    plan = {"blocks": eqpar.Pipeline(stages=2, microbatches=2, schedule=schedule)}
    if schedule == "zb-h1":
        loss, updated = scheduled_step(aux_loss_fn, model, plan, mesh, *batch)
    else:
        parallel = eqpar.parallelize(model, plan, mesh=mesh)
        run = eqpar.shard_map(
            lambda m, x, y: lax.pmean(aux_loss_fn(m, x, y), "data"),
            mesh=mesh,
            in_specs=(eqpar.partition_specs(parallel), P("data"), P("data")),
            out_specs=P(),
        )
        loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(run))(parallel, *batch)
        updated = eqpar.unparallelize(sgd(parallel, grads))
        # Outside shard_map the blocks run one after another (the serial twin).
        assert_tree_close(aux_loss_fn(parallel, *batch), serial_loss, what="serial twin")
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


class Styled(eqx.Module):
    """A block whose static field picks its computation: blocks that differ in it cannot
    run as one stacked program."""

    linear: eqx.nn.Linear
    style: str = eqx.field(static=True)

    def __call__(self, x):
        h = self.linear(x)
        return (jnp.tanh(h) if self.style == "tanh" else jnp.sin(h)), jnp.sum(h)


class Loop(eqx.Module):
    blocks: list
    mode: str = eqx.field(static=True)

    def __call__(self, x):
        total = 0.0
        for index, block in enumerate(self.blocks):
            h, aux = block(x)
            last = index == len(self.blocks) - 1
            if self.mode == "residual on the first block only":
                x = x + h if index == 0 else h
            elif self.mode == "residual but not on the last block":
                x = h * 2.0 if last else x + h
            elif self.mode == "aux read before the last block":
                x, aux = h, aux if index else aux.sum()
            else:
                x = h
            total = total + aux
        return x, total


def mean_of_outputs(out):
    return sum(jnp.mean(leaf) for leaf in jax.tree.leaves(out))


@pytest.mark.parametrize(
    "mode, styles, error, match",
    [
        ("loop", ("tanh",) * 3 + ("sin",), ValueError, r"block 3 differs from block 0 in the "
         r"static field `style` \('sin' vs 'tanh'\).*different programs"),
        ("residual on the first block only", ("tanh",) * 4, ValueError,
         r"adds the input of block\(s\) \[0\] to their output .* not that of block\(s\) \[1\]"),
        ("residual but not on the last block", ("tanh",) * 4, TypeError,
         r"x = x \+ block\(x\)`\), so the pipeline ran that residual inside every stage"),
        ("aux read before the last block", ("tanh",) * 4, ValueError,
         r"auxiliary output 0 of block 0 was used before the last block was called"),
    ],
    ids=["static field read", "residual for some blocks", "last block without it",
         "aux read early"],
)  # fmt: skip
def test_what_the_loop_does_that_a_pipeline_cannot_run_is_refused(mode, styles, error, match):
    keys = jax.random.split(jax.random.key(0), 4)
    blocks = [Styled(eqx.nn.Linear(3, 3, key=k), s) for k, s in zip(keys, styles)]
    parallel = eqpar.parallelize(
        Loop(blocks, mode), {"blocks": eqpar.Pipeline(stages=2, microbatches=2)}
    )
    run = eqpar.shard_map(
        lambda m, x: mean_of_outputs(jax.vmap(m)(x)),
        mesh=mesh_of((1, 2), MESH_DP_PP[1]),
        in_specs=(eqpar.partition_specs(parallel), P()),
        out_specs=P(),
    )
    with pytest.raises(error, match=match):
        jax.eval_shape(run, parallel, jnp.ones((4, 3)))


class WholeBatchAux(eqx.Module):
    linear: eqx.nn.Linear
    returns: str = eqx.field(static=True)

    def __call__(self, x):  # the whole batch [batch, dim]
        h = jnp.tanh(jax.vmap(self.linear)(x))
        if self.returns == "a mean over the batch":
            return h, jnp.mean(h**2)
        if self.returns == "per example":
            return h, jnp.mean(h**2, axis=-1)
        return h[:, :2], h  # the activation is not what the block takes


def test_whole_batch_blocks_return_per_example_outputs_and_nothing_else():
    """With `batch_axis=0` a block's auxiliary output per example comes back with the batch
    put together from the microbatches; a mean over the batch (each microbatch's would
    differ), or a first output that is not what the next block takes, is refused."""
    mesh = mesh_of((1, 2), MESH_DP_PP[1])
    keys = jax.random.split(jax.random.key(0), 2)
    model = Loop([WholeBatchAux(eqx.nn.Linear(3, 3, key=k), "per example") for k in keys], "")
    plan = {"blocks": eqpar.Pipeline(stages=2, microbatches=2, batch_axis=0)}
    parallel = eqpar.parallelize(model, plan)
    run = eqpar.shard_map(
        lambda m, x: m(x),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P()),
        out_specs=P(),
    )
    x = jax.random.normal(jax.random.key(1), (4, 3))
    assert_tree_close(eqx.filter_jit(run)(parallel, x), model(x), what="outputs")
    for returns, match in [
        ("a mean over the batch", r"shape \[\], which has not the batch as its leading axis"),
        ("another activation", r"must return what it takes \(float32\[4, 3\]\).*float32\[4, 2\]"),
    ]:
        keys = jax.random.split(jax.random.key(0), 2)
        blocks = [WholeBatchAux(eqx.nn.Linear(3, 3, key=k), returns) for k in keys]
        plan = {"blocks": eqpar.Pipeline(stages=2, microbatches=2, batch_axis=0)}
        parallel = eqpar.parallelize(Loop(blocks, "loop"), plan)
        run = eqpar.shard_map(
            lambda m, x: mean_of_outputs(m(x)),
            mesh=mesh,
            in_specs=(eqpar.partition_specs(parallel), P()),
            out_specs=P(),
        )
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(run, parallel, jnp.ones((4, 3)))
