"""State under every route: a model with `eqx.nn.BatchNorm` and `eqx.nn.SpectralNorm`, its loss
threading an `eqx.nn.State` as Equinox's docs write it, runs unchanged inside `eqpar.shard_map`
(DP, TP+DP, FSDP) and through `eqpar.value_and_grad`, with the serial whole-batch statistics by
default and per-shard ones as an option, each against its serial twin (one SGD step: loss,
gradients, updated parameters and state); pipelines refuse state with the route that works.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import FLOAT32_RTOL, assert_tree_close

import eqpar

BATCH, CHANNELS, SIZE, CLASSES = 8, 2, 4, 3
LEARNING_RATE = 0.1


class ConvNet(eqx.Module):
    """A small ConvNet as Equinox's stateful example writes one: batch norms named by the
    per-example vmap's axis, a spectral norm around a linear, the state threaded through."""

    conv: eqx.nn.Conv2d
    norm1: eqx.nn.BatchNorm
    spectral: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        # No bias before a batch norm: it cancels (its gradient is zero but for rounding).
        self.conv = eqx.nn.Conv2d(CHANNELS, 4, kernel_size=3, padding=1, use_bias=False, key=k1)
        self.norm1 = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
        self.spectral = eqx.nn.SpectralNorm(
            eqx.nn.Linear(4 * SIZE * SIZE, 16, key=k2), weight_name="weight", key=k3
        )
        self.norm2 = eqx.nn.BatchNorm(16, axis_name="batch", mode="ema")
        self.linear1 = eqx.nn.Linear(16, 16, key=k4)
        self.linear2 = eqx.nn.Linear(16, CLASSES, key=k5)

    def __call__(self, x, state):
        x = self.conv(x)
        x, state = self.norm1(x, state)
        x = jnp.ravel(jax.nn.relu(x))
        x, state = self.spectral(x, state)
        x, state = self.norm2(jax.nn.relu(x), state)
        x = jax.nn.relu(self.linear1(x))
        return self.linear2(x), state


def loss_fn(model, state, x, y):
    batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred, state = batch_model(x, state)
    return jnp.mean((pred - y) ** 2), state


def make():
    model, state = eqx.nn.make_with_state(ConvNet)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, CHANNELS, SIZE, SIZE))
    y = jax.random.normal(jax.random.key(2), (BATCH, CLASSES))
    return model, state, x, y


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LEARNING_RATE * g, grads))


def serial_step(model, state, x, y):
    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state, x, y)
    return loss, state, grads


def assert_step_close(got, want, model):
    loss, state, grads = got
    serial_loss, serial_state, serial_grads = want
    grads = eqpar.unparallelize(grads)
    assert_tree_close(loss, serial_loss, what="loss")
    # A batch norm's backward subtracts from each example's cotangent the batch mean of the
    # cotangents and of their products with the normalized input: three terms of one size
    # that largely cancel, so the gradient of every layer before one carries the rounding of
    # those terms, a few times a plain sum's (measured: 1.05e-5 of the leaf's scale on
    # JAX 0.12 for the spectral-norm layer before `norm2`).
    assert_tree_close(grads, serial_grads, rtol=4 * FLOAT32_RTOL, what="grads")
    assert_tree_close(state, serial_state, what="state")
    model = eqpar.unparallelize(model)
    assert_tree_close(sgd(model, grads), sgd(model, serial_grads), what="updated")


TP_PLAN = {"linear1": eqpar.ColumnParallel(), "linear2": eqpar.RowParallel()}


def explicit_mesh(shape, names, *trees_and_specs):
    """A `jax.make_mesh` mesh (Explicit axes), and the trees placed on it by their specs."""
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])
    placed = [
        jax.tree.map(
            lambda a, spec=spec: (
                jax.device_put(a, NamedSharding(mesh, spec)) if eqx.is_array(a) else a
            ),
            tree,
        )
        for tree, spec in trees_and_specs
    ]
    return mesh, placed


@pytest.mark.parametrize(
    ("shape", "names", "plan", "route"),
    [
        ((2,), ("data",), None, "value_and_grad"),
        ((2,), ("data",), None, "grad_outside"),
        ((4,), ("data",), None, "explicit_axes"),
        ((2, 2), ("data", "model"), TP_PLAN, "value_and_grad"),
        ((2,), ("data",), None, "fsdp"),
    ],
    ids=["dp2", "dp2-grad-outside", "dp4-explicit-axes", "dp2xtp2", "fsdp2"],
)
def test_one_sgd_step_in_shard_map_matches_one_device(shape, names, plan, route):
    """Whole-batch statistics by default: loss, gradients, the updated parameters and state
    as on one device with the whole batch. On the old code the model crashed inside
    `eqpar.shard_map` (JAX's replication typing of BatchNorm's `pmean` over the vmap axis,
    and `State.set` refusing a constant written inside `shard_map`)."""
    model, state, x, y = make()
    want = serial_step(model, state, x, y)
    mesh = eqpar.DeviceMesh(shape, names, devices=jax.devices()[: math.prod(shape)])
    if route == "explicit_axes":  # a mesh of Explicit axes, the arrays placed on it
        mesh, (model, state, x, y) = explicit_mesh(
            shape, names, (model, P()), (state, P()), (x, P("data")), (y, P("data"))
        )
        route = "value_and_grad"
    parallel = eqpar.parallelize(model, plan) if plan else model
    specs = eqpar.partition_specs(parallel)
    grad_specs = eqpar.partition_specs(eqx.filter(parallel, eqx.is_inexact_array))
    batch = P("data")
    if route == "value_and_grad":
        step = eqpar.shard_map(
            eqpar.value_and_grad(loss_fn, has_aux=True),
            mesh=mesh,
            in_specs=(specs, P(), batch, batch),
            out_specs=((P(), P()), grad_specs),
        )
        (loss, new_state), grads = eqx.filter_jit(step)(parallel, state, x, y)
    else:
        stored = None
        if route == "fsdp":
            fsdp = eqpar.FSDP(mesh, min_size_bytes=0)
            specs, stored = fsdp.compute_specs(parallel), fsdp.partition_specs(parallel)
            parallel = eqx.filter_shard(parallel, eqpar.named_shardings(stored, mesh))
            stored = (stored, P(), batch, batch)

        def global_loss(model, state, x, y):
            loss, state = loss_fn(model, state, x, y)
            return jax.lax.pmean(loss, "data"), state

        sharded = eqpar.shard_map(
            global_loss,
            mesh=mesh,
            in_specs=(specs, P(), batch, batch),
            out_specs=(P(), P()),
            stored_specs=stored,
        )
        value_and_grad = eqx.filter_value_and_grad(sharded, has_aux=True)
        (loss, new_state), grads = eqx.filter_jit(value_and_grad)(parallel, state, x, y)
    assert_step_close((loss, new_state, grads), want, parallel)


def test_per_shard_statistics_match_a_serial_run_per_shard():
    """`batch_stats="per_shard"`: each device's examples normalised by their own statistics,
    against one device running each shard on its own; the loss and gradients are the mean of
    the shards', the running statistics the mean of each shard's (the state stays replicated)."""
    model, state, x, y = make()
    n = 2
    shards = [
        serial_step(model, state, xs, ys)
        for xs, ys in zip(jnp.split(x, n), jnp.split(y, n), strict=True)
    ]
    mean = lambda *leaves: sum(leaves) / n
    average = lambda tree_leaves: jax.tree.map(
        lambda *ls: mean(*ls) if jnp.issubdtype(ls[0].dtype, jnp.inexact) else ls[0],
        *tree_leaves,
    )
    want = tuple(average([shard[i] for shard in shards]) for i in range(3))
    mesh = eqpar.DeviceMesh((n,), ("data",), devices=jax.devices()[:n])
    step = eqpar.shard_map(
        eqpar.value_and_grad(loss_fn, has_aux=True),
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=((P(), P()), P()),
        batch_stats="per_shard",
    )
    (loss, new_state), grads = eqx.filter_jit(step)(model, state, x, y)
    assert_step_close((loss, new_state, grads), want, model)
    # Not the whole-batch numbers: the option changes the statistics.
    serial_loss = serial_step(model, state, x, y)[0]
    assert abs(float(loss) - float(serial_loss)) > 1e-4 * abs(float(serial_loss))


def test_batch_stats_named_axes_without_vma_checks():
    """With `check_vma=False` JAX does not say how the batch is split: the default refuses at
    trace time with the fix, and `batch_stats=("data",)` gives the whole-batch statistics."""
    model, state, x, y = make()
    mesh = eqpar.DeviceMesh((2,), ("data",), devices=jax.devices()[:2])

    def global_loss(model, state, x, y):
        loss, state = loss_fn(model, state, x, y)
        return jax.lax.pmean(loss, "data"), state

    def sharded(**options):
        return eqpar.shard_map(
            global_loss,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P()),
            check_vma=False,
            **options,
        )

    with pytest.raises(ValueError, match=r"check_vma=False.*batch_stats=\('data',\)"):
        sharded()(model, state, x, y)
    loss, new_state = eqx.filter_jit(sharded(batch_stats=("data",)))(model, state, x, y)
    serial_loss, serial_state = loss_fn(model, state, x, y)
    assert_tree_close((loss, new_state), (serial_loss, serial_state))
    with pytest.raises(ValueError, match="batch_stats names 'model'"):
        sharded(batch_stats=("model",))


def test_statistics_over_two_vmap_axes():
    """A batch norm named by two vmaps (`axis_name=("batch", "time")`), inside `shard_map`:
    the statistics over both and over the data axis, as on one device."""
    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, ("batch", "time"), mode="batch")
    x = jax.random.normal(jax.random.key(3), (8, 3, 4)) * 2 + 1

    def forward(norm, state, x):
        per_step = jax.vmap(norm, axis_name="time", in_axes=(0, None), out_axes=(0, None))
        return jax.vmap(per_step, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            x, state
        )

    mesh = eqpar.DeviceMesh((2,), ("data",), devices=jax.devices()[:2])
    sharded = eqpar.shard_map(
        forward, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P("data"), P())
    )
    assert_tree_close(sharded(norm, state, x), forward(norm, state, x))


def test_statistics_over_a_batch_and_a_sequence_split_over_devices():
    """Channels-first examples split over `data` (the batch) and `context` (the sequence):
    the statistics over both, as on one device, read off the input's replication types."""
    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="ema")
    x = jax.random.normal(jax.random.key(4), (4, 3, 8)) * 3 - 1

    def forward(norm, state, x):
        batched = jax.vmap(norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return batched(x, state)

    mesh = eqpar.DeviceMesh((2, 2), ("data", "context"), devices=jax.devices()[:4])
    split = P("data", None, "context")
    sharded = eqpar.shard_map(
        forward, mesh=mesh, in_specs=(P(), P(), split), out_specs=(split, P())
    )
    assert_tree_close(sharded(norm, state, x), forward(norm, state, x))
    _, state = forward(norm, state, x)  # running statistics to use
    inference = eqx.nn.inference_mode(norm)
    assert_tree_close(sharded(inference, state, x), forward(inference, state, x))


def test_a_stateful_layer_of_ones_own_gets_the_fix():
    """A layer of the author's own that stores a statistic of this device's examples: Equinox's
    `State.set` error comes with what it means inside `shard_map` and the fix."""

    class Counter(eqx.Module):
        index: eqx.nn.StateIndex

        def __init__(self):
            self.index = eqx.nn.StateIndex(jnp.zeros(()))

        def __call__(self, x, state):
            return x, state.set(self.index, jnp.mean(x))  # this device's mean

    layer, state = eqx.nn.make_with_state(Counter)()
    mesh = eqpar.DeviceMesh((2,), ("data",), devices=jax.devices()[:2])
    run = eqpar.shard_map(
        lambda layer, state, x: layer(x, state),
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=(P("data"), P()),
    )
    with pytest.raises(ValueError, match=r"differ between devices.*pmean\(value, 'data'\)"):
        run(layer, state, jnp.arange(4.0))

    class Flag(Counter):  # a constant: not typed with the mesh as the state that came in
        def __call__(self, x, state):
            return x, state.set(self.index, jnp.array(1.0))

    flag, state = eqx.nn.make_with_state(Flag)()
    with pytest.raises(ValueError, match=r"fresh constant.*jnp\.zeros_like\(old\)"):
        run(flag, state, jnp.arange(4.0))


def test_spectral_norm_around_a_split_layer_is_refused():
    model, state, x, y = make()
    parallel = eqpar.parallelize(model, {"spectral/layer": eqpar.ColumnParallel()})
    mesh = eqpar.DeviceMesh((2,), ("model",), devices=jax.devices()[:2])
    run = eqpar.shard_map(
        lambda m, s, x, y: loss_fn(m, s, x, y),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(), P(), P()),
        out_specs=(P(), P()),
    )
    with pytest.raises(ValueError, match="leave that layer out of the plan"):
        eqx.filter_eval_shape(run, parallel, state, x, y)


class StatefulBlock(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 4, key=key)
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


class StatefulBlocks(eqx.Module):
    layers: list

    def __call__(self, x, state):
        for layer in self.layers:
            x, state = layer(x, state)
        return x, state


def test_pipelines_refuse_state_naming_the_routes_that_work():
    make_net = lambda: StatefulBlocks(
        [StatefulBlock(k) for k in jax.random.split(jax.random.key(0), 4)]
    )
    model, _ = eqx.nn.make_with_state(make_net)()
    with pytest.raises(ValueError, match=r"block 0 at 'norm'.*stateless.*eqpar\.shard_map"):
        eqpar.parallelize(model, {"layers": eqpar.Pipeline(stages=2, microbatches=2)})


def test_value_and_grad_with_aux_refuses_loss_inside_the_pipeline():
    blocks = [eqx.nn.Linear(4, 4, key=k) for k in jax.random.split(jax.random.key(0), 4)]
    model = eqx.nn.Sequential(blocks)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    parallel = eqpar.parallelize(model, plan)
    loss = lambda m, x: (jnp.mean(jax.vmap(m)(x) ** 2), None)
    with pytest.raises(ValueError, match=r"has_aux=True.*'1f1b'.*schedule='gpipe'"):
        eqpar.value_and_grad(loss, has_aux=True)(parallel, jnp.ones((4, 4)))


class StemNet(eqx.Module):
    """A batch norm in the stem, before blocks a plan pipelines: the stem runs on the whole
    batch (each data shard's rows, replicated over the pipeline axis)."""

    stem: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    layers: list
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 6)
        self.stem = eqx.nn.Linear(3, 4, use_bias=False, key=keys[0])
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
        self.layers = [eqx.nn.MLP(4, 4, 8, 1, key=k) for k in keys[1:5]]
        self.head = eqx.nn.Linear(4, 1, key=keys[5])

    def __call__(self, x, state):
        x, state = self.norm(self.stem(x), state)
        for layer in self.layers:
            x = layer(x)
        return self.head(x), state


def test_state_outside_the_pipelined_blocks_trains_as_on_one_device():
    model, state = eqx.nn.make_with_state(StemNet)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 3))
    y = jax.random.normal(jax.random.key(2), (8, 1))
    want = serial_step(model, state, x, y)
    parallel = eqpar.parallelize(model, {"layers": eqpar.Pipeline(stages=2, microbatches=2)})
    mesh = eqpar.DeviceMesh((2, 2), ("data", "pipe"), devices=jax.devices()[:4])
    step = eqpar.shard_map(
        eqpar.value_and_grad(loss_fn, has_aux=True),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(), P("data"), P("data")),
        out_specs=((P(), P()), eqpar.partition_specs(eqx.filter(parallel, eqx.is_inexact_array))),
    )
    (loss, new_state), grads = eqx.filter_jit(step)(parallel, state, x, y)
    assert_step_close((loss, new_state, grads), want, parallel)
