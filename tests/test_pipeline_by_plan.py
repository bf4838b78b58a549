"""Pipelines by plan: one entry on the model's list of blocks, the author's `__call__` kept.

The models are the ones nobody on the team wrote (`equinox_vit.py`, `equinox_bert.py`,
`llama_style.py`), unchanged: their loops over the blocks pass per-block dropout keys (the
ViT and BERT) or positions (the Llama), their losses `jax.vmap` the model per example, and
the Llama's layers differ in a static index. One plain-SGD step of the parallel model equals
the same step on one device (the gradient of the global loss: nothing divided by hand).
"""

import equinox as eqx
import equinox_bert as bert
import equinox_vit as vit
import jax
import jax.numpy as jnp
import llama_style as llama
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close
from test_any_model import LLAMA_TENSOR_PARALLEL, VIT_PLAN, mesh_of, serial_step, sharded_step

import eqpar
from eqpar.nn import PipelinedBlocks

MESH_DP_PP = ((2, 2), ("data", "pipe"))
LLAMA_LAYER = lambda index, key: llama.LlamaLayer(index, key=key)


def with_blocks(model, name: str, make, count: int):
    """`model` with its list of blocks `name` replaced by `count` fresh blocks (the models'
    loops run over the list, so this changes only the depth)."""
    keys = jax.random.split(jax.random.key(7), count)
    return eqx.tree_at(lambda m: getattr(m, name), model, [make(i, k) for i, k in enumerate(keys)])


def check_step(model, loss_fn, batch, plan, mesh_shape, names=MESH_DP_PP[1]):
    serial_loss, serial_model = serial_step(loss_fn, model, *batch)
    mesh = mesh_of(mesh_shape, names)
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    specs = (P("data"),) * len(batch)
    loss, updated = sharded_step(loss_fn, parallel, mesh, specs, *batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)
    return parallel


def test_vit_under_data_pipe_and_tensor_parallelism_by_plan():
    """3D: the ViT's blocks pipelined over `pipe`, the attention and the MLP (with its
    dropout between the two linears) split over `model` inside each stage, the batch over
    `data`: one plan, no model change."""
    model = vit.VisionTransformer(key=jax.random.key(0))
    plan = {**VIT_PLAN, "attention_blocks": eqpar.Pipeline(stages=2, microbatches=2)}
    parallel = check_step(model, vit.loss, vit.batch(8), plan, (2, 2, 2), ("data", "pipe", "model"))
    assert isinstance(parallel.attention_blocks, PipelinedBlocks)
    specs = eqpar.partition_specs(parallel).attention_blocks.pipeline.stages.layers
    assert specs.linear1.weight == P("pipe", None, "model", None)  # [S, L/S, out, in]


def test_bert_by_plan_with_remat():
    """The BERT encoder's loop splits a fresh key per layer from a chain and passes the
    padding mask to every layer: the keys are stacked (each block its own), the mask passed
    once; each block is rematerialized."""
    model = bert.Encoder(key=jax.random.key(0))
    style = eqpar.Pipeline(stages=2, microbatches=2, remat="full")
    check_step(model, bert.loss, bert.batch(8), {"layers": style}, MESH_DP_PP[0])


@pytest.mark.parametrize("repeats", [1, 2])
def test_llama_with_raw_arrays_and_a_static_layer_index_pipelined_by_plan(repeats):
    model = with_blocks(llama.Llama(key=jax.random.key(0)), "layers", LLAMA_LAYER, 4)
    style = eqpar.Pipeline(stages=2, microbatches=4, repeats=repeats)
    parallel = check_step(model, llama.loss, (llama.batch(8),), {"layers": style}, (2, 2))
    # The list comes back with the author's classes and static fields.
    serial = eqpar.unparallelize(parallel)
    assert [layer.layer_index for layer in serial.layers] == [0, 1, 2, 3]
    assert eqx.tree_equal(serial, model)


class BatchBlock(eqx.Module):
    """A block that takes the whole batch `[batch, dim]`, no vmap, a per-block scale and a
    per-example mask."""

    linear: eqx.nn.Linear
    gated: bool = eqx.field(static=True)

    def __call__(self, hidden, scale, mask, *, shift):
        out = jnp.tanh(jax.vmap(self.linear)(hidden) * scale + shift)
        return jnp.where(mask[:, None], out, hidden) if self.gated else out


class BatchModel(eqx.Module):
    blocks: tuple

    def __call__(self, x, mask):
        shift = jnp.linspace(0.0, 0.1, x.shape[-1])  # the same array for every block
        for index, block in enumerate(self.blocks):
            scale = 1.0 + 0.1 * jnp.asarray(index, x.dtype)  # a per-block array
            # The input by keyword, a block's setting read in the loop (all the same here).
            x = block(hidden=x, scale=scale, mask=mask if block.gated else None, shift=shift)
        return x


def batch_model():
    keys = jax.random.split(jax.random.key(3), 4)
    return BatchModel(tuple(BatchBlock(eqx.nn.Linear(6, 6, key=k), True) for k in keys))


def batch_loss(model, x, mask):
    return jnp.mean(model(x, mask) ** 2)


def batch_inputs():
    x = jax.random.normal(jax.random.key(4), (8, 6))
    return x, jax.random.bernoulli(jax.random.key(5), 0.7, (8,))


def microbatched_loss(model, x, mask):
    return batch_loss(model, x, eqpar.pipeline.Microbatched(mask))


def test_a_model_that_takes_the_batch_is_pipelined_on_its_leading_axis():
    """`batch_axis=0`: the model takes the batch; its per-example mask is wrapped in
    `Microbatched` (bare, an array as long as the batch is refused as ambiguous)."""
    model = batch_model()
    x, mask = batch_inputs()
    plan = {"blocks": eqpar.Pipeline(stages=2, microbatches=2, batch_axis=0)}
    serial_loss, serial_model = serial_step(batch_loss, model, x, mask)
    mesh = mesh_of((2, 2), MESH_DP_PP[1])
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    loss, updated = sharded_step(microbatched_loss, parallel, mesh, (P("data"),) * 2, x, mask)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)
    assert type(eqpar.unparallelize(parallel).blocks) is tuple
    # Outside shard_map the placed blocks open their own region and run as the pipeline
    # (the bare mask refused alike); not placed, they run one after another: the serial
    # twin (a `Microbatched` argument passed whole).
    assert_tree_close(microbatched_loss(parallel, x, mask), serial_loss, what="loss")
    with pytest.raises(ValueError, match=r"`kwargs/mask` has leading size 8.*Microbatched"):
        batch_loss(parallel, x, mask)
    unplaced = eqpar.parallelize(model, plan)
    assert_tree_close(batch_loss(unplaced, x, mask), batch_loss(model, x, mask), what="loss")
    assert_tree_close(microbatched_loss(unplaced, x, mask), serial_loss, what="loss")
    with pytest.raises(ValueError, match=r"`kwargs/mask` has leading size 4.*Microbatched"):
        _pipe_loss(batch_loss, parallel, mesh, x, mask)


def _pipe_loss(loss_fn, model, mesh, *batch):
    run = eqpar.shard_map(
        lambda m, *b: lax.pmean(loss_fn(m, *b), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(model), *(P("data") for _ in batch)),
        out_specs=P(),
    )
    return run(model, *batch)


@pytest.mark.parametrize("around", ["checkpoint", "lax.map"])
def test_blocks_called_per_example_without_a_vmap_are_refused(around):
    """`jax.vmap(jax.checkpoint(model))` or `lax.map(model, ...)`: the blocks see one example
    and no vmap, so a pipeline would take the example's tokens for the batch."""
    model = llama.Llama(key=jax.random.key(0))
    parallel = eqpar.parallelize(model, {"layers": eqpar.Pipeline(stages=2, microbatches=2)})

    def loss(m, tokens):
        if around == "checkpoint":
            return jnp.mean(jax.vmap(jax.checkpoint(lambda t: m(t)))(tokens[:, :-1]))
        return jnp.mean(lax.map(m, tokens[:, :-1]))

    with pytest.raises(ValueError, match=r"without a `jax.vmap` around them.*batch_axis=0"):
        _pipe_loss(loss, parallel, mesh_of((2, 2), MESH_DP_PP[1]), llama.batch(8))


def test_a_vmap_hidden_from_a_model_that_says_it_takes_the_batch_is_refused():
    """With `batch_axis=0` the blocks trust the first axis; were a vmap around the model
    hidden by a checkpoint, the pipeline would split each example's rows: refused when the
    vmap batches it."""
    model = batch_model()
    plan = {"blocks": eqpar.Pipeline(stages=2, microbatches=2, batch_axis=0)}
    parallel = eqpar.parallelize(model, plan)
    x, mask = jnp.ones((8, 4, 6)), jnp.ones((8, 4), bool)  # [batch, tokens, features]

    def hidden(m, x, mask):
        per_example = jax.checkpoint(lambda x, k: microbatched_loss(m, x, k))
        return jnp.mean(jax.vmap(per_example)(x, mask))

    with pytest.raises(ValueError, match=r"a `jax.vmap` that a `jax.jit` or `jax.checkpoint`"):
        _pipe_loss(hidden, parallel, mesh_of((2, 2), MESH_DP_PP[1]), x, mask)


class Misuse(eqx.Module):
    layers: list
    mode: str = eqx.field(static=True)

    def __call__(self, x):
        layers = self.layers
        if self.mode == "read between":
            x = layers[0](x)
            return layers[1](x * 2.0)
        if self.mode == "out of order":
            return layers[0](layers[1](x))
        if self.mode == "skip the last":
            return layers[0](x)
        if self.mode == "flag per block":
            for i, layer in enumerate(layers):
                x = layer(x, flag=i == 0)
            return x
        if self.mode == "slice":
            for layer in layers[:1]:
                x = layer(x)
            return x
        raise AssertionError(self.mode)


class Flagged(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x, flag=False):
        return self.linear(x)


@pytest.mark.parametrize(
    "mode, error, match",
    [
        ("read between", TypeError, "used as a value"),
        ("out of order", ValueError, "not on the output of block 0"),
        ("skip the last", TypeError, "pending output of block 0 of 2.*every block is called"),
        ("flag per block", ValueError, "non-array argument `kwargs/flag`"),
        ("slice", TypeError, "index the pipelined blocks with one int"),
    ],
)
def test_blocks_called_other_than_in_order_are_refused(mode, error, match):
    keys = jax.random.split(jax.random.key(0), 2)
    model = Misuse([Flagged(eqx.nn.Linear(3, 3, key=k)) for k in keys], mode)
    parallel = eqpar.parallelize(model, {"layers": eqpar.Pipeline(stages=2, microbatches=2)})
    mesh = mesh_of((1, 2), MESH_DP_PP[1])
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x))
    with pytest.raises(error, match=match):
        _pipe_loss(loss, parallel, mesh, jnp.ones((4, 3)))


def test_pipeline_plan_errors_name_the_key_and_the_fix():
    model = batch_model()
    with pytest.raises(ValueError, match=r"splits over axis 'pipe', which plan\['blocks'\]"):
        eqpar.parallelize(
            model,
            {
                "blocks": eqpar.Pipeline(stages=2, microbatches=2),
                r"blocks/\d+/linear": eqpar.ColumnParallel("pipe"),
            },
        )
    with pytest.raises(ValueError, match="batch_axis"):
        eqpar.parallelize(model, {"blocks": eqpar.Pipeline(stages=2, microbatches=2, batch_axis=1)})
    with pytest.raises(ValueError, match="'1f1b' runs 1 stage per device, but repeats=2"):
        eqpar.Pipeline(stages=2, microbatches=2, repeats=2, schedule="1f1b")
    with pytest.raises(ValueError, match="'zb-v' runs 2 stages per device, but repeats=1"):
        eqpar.Pipeline(stages=2, microbatches=2, schedule="zb-v")
    with pytest.raises(ValueError, match="'circular' several"):
        eqpar.Pipeline(stages=2, microbatches=2, schedule="circular")
    with pytest.raises(ValueError, match="positive int"):
        eqpar.Pipeline(stages=0, microbatches=2)
    with pytest.raises(TypeError, match=r"names 'blocks/0', a BatchBlock.*Name the list"):
        eqpar.parallelize(model, {"blocks/0": eqpar.Pipeline(stages=2, microbatches=2)})
    mesh = mesh_of((2, 4), MESH_DP_PP[1])
    with pytest.raises(ValueError, match=r"stages=2, but the mesh axis 'pipe' has 4 devices"):
        eqpar.parallelize(model, {"blocks": eqpar.Pipeline(stages=2, microbatches=2)}, mesh=mesh)
    with pytest.raises(ValueError, match=r"4 layers do not divide into .* 3 stages"):
        eqpar.parallelize(model, {"blocks": eqpar.Pipeline(stages=3, microbatches=1)})
    with pytest.raises(TypeError, match=r"`layers` is a tuple of 4 layers.*stack_layers"):
        eqpar.nn.PipelineModule.from_layers(model.blocks, num_stages=2, num_microbatches=1)


# --- 1F1B and ZB-H1: the loss inside the pipeline, through eqpar.value_and_grad ----------


def scheduled_step(loss_fn, model, plan, mesh, *batch, **options):
    """The documented recipe for a schedule that runs the loss inside the pipeline:
    `eqpar.value_and_grad(loss_fn)` inside shard_map, an SGD step outside."""
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    grad_specs = eqpar.partition_specs(eqx.filter(parallel, eqx.is_inexact_array))
    step = eqpar.shard_map(
        eqpar.value_and_grad(loss_fn, **options),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), *(P("data") for _ in batch)),
        out_specs=(P(), grad_specs),
    )
    loss, grads = eqx.filter_jit(step)(parallel, *batch)
    updated = eqx.apply_updates(parallel, jax.tree.map(lambda g: -0.5 * g, grads))
    return loss, eqpar.unparallelize(updated)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_vit_one_forward_one_backward_by_plan_with_tensor_parallel_stages(schedule):
    """3D under 1F1B and ZB-H1: the ViT's own forward is cut where its blocks are called;
    the patch embedding runs before the pipeline, the head and the loss as its loss on the
    last stage, dropout keys per block as the serial loop gives them."""
    model = vit.VisionTransformer(key=jax.random.key(0))
    batch = vit.batch(8)
    serial_loss, serial_model = serial_step(vit.loss, model, *batch)
    plan = {**VIT_PLAN, "attention_blocks": eqpar.Pipeline(2, 2, schedule=schedule)}
    mesh = mesh_of((2, 2, 2), ("data", "pipe", "model"))
    loss, updated = scheduled_step(vit.loss, model, plan, mesh, *batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


def test_bert_zero_bubble_by_plan():
    """BERT's chain of per-layer keys and its padding mask under ZB-H1 with data parallel."""
    model = bert.Encoder(key=jax.random.key(0))
    batch = bert.batch(8)
    serial_loss, serial_model = serial_step(bert.loss, model, *batch)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="zb-h1")}
    loss, updated = scheduled_step(bert.loss, model, plan, mesh_of((2, 2), MESH_DP_PP[1]), *batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


def test_llama_one_forward_one_backward_by_plan_with_a_tied_unembedding():
    """The Llama reads its embedding before the blocks and again as the unembedding after
    them: the two gradients are added."""
    model = llama.Llama(key=jax.random.key(0))
    tokens = llama.batch(8)
    serial_loss, serial_model = serial_step(llama.loss, model, tokens)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    loss, updated = scheduled_step(llama.loss, model, plan, mesh_of((2, 2), MESH_DP_PP[1]), tokens)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


def test_value_and_grad_without_a_scheduled_pipeline_is_the_global_loss():
    """With no blocks pipelined by 1F1B or ZB-H1, `eqpar.value_and_grad` is the global loss
    (the mean over the shards the loss differs by) and its gradients: the same rule."""
    model = batch_model()
    x, mask = batch_inputs()
    serial_loss, serial_model = serial_step(batch_loss, model, x, mask)
    mesh = mesh_of((8,), ("data",))
    step = eqpar.shard_map(
        eqpar.value_and_grad(batch_loss), mesh=mesh, in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P()),
    )  # fmt: skip
    loss, grads = step(model, x, mask)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqx.apply_updates(model, jax.tree.map(lambda g: -0.5 * g, grads)),
                        serial_model)  # fmt: skip


class Scaled(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x, scale):
        return jnp.tanh(self.linear(x)) * scale


class ScaledModel(eqx.Module):
    layers: list
    gain: jax.Array
    mode: str = eqx.field(static=True)

    def __call__(self, x):
        if self.mode == "from the parameters":
            scale = self.gain  # a float argument of the blocks that needs a gradient
        else:  # from the batch but the same for every example: one value per microbatch
            scale = jax.lax.stop_gradient(jnp.ones(()))
        for layer in self.layers:
            x = layer(x, scale)
        return x.sum()


@pytest.mark.parametrize("mode", ["from the parameters", "plain differentiation"])
def test_what_a_scheduled_pipeline_cannot_carry_is_refused(mode):
    keys = jax.random.split(jax.random.key(0), 2)
    layers = [Scaled(eqx.nn.Linear(3, 3, key=k)) for k in keys]
    model = ScaledModel(layers, jnp.ones(()), mode)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    parallel = eqpar.parallelize(model, plan)
    mesh = mesh_of((1, 2), MESH_DP_PP[1])
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x))
    x = jnp.ones((4, 3))
    if mode == "plain differentiation":
        with pytest.raises(ValueError, match=r"eqpar.value_and_grad\(loss_fn\)"):
            _pipe_loss(loss, parallel, mesh, x)
        return
    run = eqpar.shard_map(
        eqpar.value_and_grad(loss), mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data")), out_specs=(P(), P()),
    )  # fmt: skip
    with pytest.raises(ValueError, match="computed from the model's parameters"):
        run(parallel, x)


def test_llama_raw_arrays_data_pipe_and_tensor_parallel_by_plan():
    """3D for a model with raw weight arrays: `Sharded` keys split its weights over `model`
    (left to the compiler), `Pipeline` runs its blocks over `pipe`, the batch is split over
    `data`; `eqpar.shard_map` makes `data` and `pipe` manual and takes the model's whole
    layout as in_specs."""
    model = llama.Llama(key=jax.random.key(0))
    tokens = llama.batch(8)
    serial_loss, serial_model = serial_step(llama.loss, model, tokens)
    mesh = mesh_of((2, 2, 2), ("data", "pipe", "model"))
    plan = {**LLAMA_TENSOR_PARALLEL, "layers": eqpar.Pipeline(stages=2, microbatches=2)}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    specs = eqpar.partition_specs(parallel)
    assert specs.layers.pipeline.stages.layers.wq == P("pipe", None, None, "model")
    placed = eqx.filter_shard(parallel, eqpar.named_shardings(specs, mesh))
    step = eqpar.shard_map(
        lambda m, t: lax.pmean(llama.loss(m, t), "data"),
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=P(),
        axis_names={"data", "pipe"},
    )
    batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh.jax_mesh, P("data")))
    loss, updated = serial_step(step, placed, batch)
    assert (
        updated.layers.pipeline.stages.layers.wq.sharding.spec
        == specs.layers.pipeline.stages.layers.wq
    )
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)


class CrossBlock(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, h, context, gain):
        return jnp.tanh(self.linear(h) + context) * gain


class Latent(eqx.Module):
    """The blocks' input is a parameter (a learned latent); the batch reaches them only as a
    per-example argument (cross-attention style), and a gain with its gradient stopped."""

    latent: jax.Array
    gain: jax.Array
    layers: list
    head: eqx.nn.Linear

    def __call__(self, x):
        h, gain = self.latent, lax.stop_gradient(self.gain)
        for layer in self.layers:
            h = layer(h, x, gain)
        return self.head(h)


def test_one_forward_one_backward_when_the_batch_reaches_the_blocks_only_as_an_argument():
    keys = jax.random.split(jax.random.key(0), 5)
    layers = [CrossBlock(eqx.nn.Linear(4, 4, key=k)) for k in keys[:4]]
    model = Latent(jnp.ones(4), jnp.full((), 0.9), layers, eqx.nn.Linear(4, 2, key=keys[4]))
    x = jax.random.normal(jax.random.key(1), (8, 4))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    loss_fn = lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)
    serial_loss, serial_model = serial_step(loss_fn, model, x, y)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    loss, updated = scheduled_step(loss_fn, model, plan, mesh_of((2, 2), MESH_DP_PP[1]), x, y)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


def test_raw_arrays_laid_out_for_the_compiler_refuse_a_manual_axis():
    """`Sharded` keys split the Llama's weights over `model` for the compiler; inside a
    shard_map where `model` is manual the author's reshapes would see local pieces."""
    model = llama.Llama(key=jax.random.key(0))
    mesh = mesh_of((2, 4), ("data", "model"))
    parallel = eqpar.parallelize(model, LLAMA_TENSOR_PARALLEL, mesh=mesh)
    with pytest.raises(ValueError, match=r"over .model. for the compiler.*axis_names"):
        _pipe_loss(llama.loss, parallel, mesh, llama.batch(8))


class Chain(eqx.Module):
    embed: eqx.nn.Linear
    layers: list
    head: eqx.nn.Linear

    def __call__(self, x):  # one example
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)[0]


def chain_and_batch():
    keys = jax.random.split(jax.random.key(0), 6)
    model = Chain(eqx.nn.Linear(3, 4, key=keys[0]),
                  [eqx.nn.MLP(4, 4, 8, 1, key=k) for k in keys[1:5]],
                  eqx.nn.Linear(4, 1, key=keys[5]))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (8, 3))
    return model, x, jax.random.normal(jax.random.key(2), (8,))


def test_a_sum_over_examples_is_the_batch_sum_with_reduction_sum_and_refused_without():
    """1F1B takes the mean of its microbatches' losses: a loss that is a sum over examples
    used to come back divided by the number of microbatches (2 here), gradients too. With
    `reduction="sum"` it is the whole batch's sum (over 2 microbatches and 2 data shards);
    without, the trace-time check (the loss on a microbatch given twice over doubles)
    refuses it, and a mean declared a sum is refused alike."""
    model, x, y = chain_and_batch()
    sum_loss = lambda m, x, y: jnp.sum((jax.vmap(m)(x) - y) ** 2)
    mean_loss = lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    mesh = mesh_of((2, 2), MESH_DP_PP[1])
    for loss_fn, options in ((sum_loss, {"reduction": "sum"}), (mean_loss, {})):
        serial_loss, serial_model = serial_step(loss_fn, model, x, y)
        loss, updated = scheduled_step(loss_fn, model, plan, mesh, x, y, **options)
        assert_tree_close(loss, serial_loss, what="loss")
        assert_arrays_close(updated, serial_model)
    with pytest.raises(ValueError, match=r'sum over the examples.*divided by 2.*reduction="sum"'):
        scheduled_step(sum_loss, model, plan, mesh, x, y)
    with pytest.raises(ValueError, match=r"mean over the examples.*reduction='mean'"):
        scheduled_step(mean_loss, model, plan, mesh, x, y, reduction="sum")
    with pytest.raises(ValueError, match=r"`reduction` is 'mean'.*got 'total'"):
        eqpar.value_and_grad(sum_loss, reduction="total")


def test_value_and_grad_of_a_sum_without_a_schedule_sums_over_the_data_shards():
    """Without a scheduled pipeline, `reduction="sum"` is the `psum` of the shards' sums."""
    model, x, y = chain_and_batch()
    sum_loss = lambda m, x, y: jnp.sum((jax.vmap(m)(x) - y) ** 2)
    serial_loss, serial_model = serial_step(sum_loss, model, x, y)
    step = eqpar.shard_map(
        eqpar.value_and_grad(sum_loss, reduction="sum"), mesh=mesh_of((4,), ("data",)),
        in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()),
    )  # fmt: skip
    loss, grads = step(model, x, y)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqx.apply_updates(model, jax.tree.map(lambda g: -0.5 * g, grads)),
                        serial_model)  # fmt: skip


# --- V-shaped schedules (ZB-V, DualPipeV): two stages per device, the loss on device 0 ------


@pytest.mark.parametrize(
    ("schedule", "mesh_shape", "layers", "microbatches"),
    [("zb-v", (2, 2), 4, 2), ("dualpipe-v", (2, 2), 4, 4), ("zb-v", (2, 4), 8, 2)],
    ids=["zb-v-pipe2", "dualpipe-v-pipe2", "zb-v-pipe4"],
)
def test_llama_v_shaped_schedules_by_plan(schedule, mesh_shape, layers, microbatches):
    """The Llama (raw arrays, rotary positions, a tied unembedding) under data x pipe with a
    V-shaped schedule: stage d and stage 2S-1-d on device d, its own forward cut where the
    blocks are called, one SGD step equal to one device's."""
    model = with_blocks(llama.Llama(key=jax.random.key(0)), "layers", LLAMA_LAYER, layers)
    tokens = llama.batch(8)
    serial_loss, serial_model = serial_step(llama.loss, model, tokens)
    pipeline = eqpar.Pipeline(
        stages=mesh_shape[1], microbatches=microbatches, repeats=2, schedule=schedule
    )
    mesh = mesh_of(mesh_shape, MESH_DP_PP[1])
    loss, updated = scheduled_step(llama.loss, model, {"layers": pipeline}, mesh, tokens)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


def test_a_zb_v_checkpoint_restores_under_gpipe_and_on_one_device(tmp_path):
    """The stages of a V-shaped schedule are stored in model order, as the circular
    schedule's (the executor exchanges each device's up stage itself): a checkpoint of the
    ZB-V model restores bitwise into the circular model's structure, and its plain form
    into GPipe's and into the one-device model."""
    from eqpar.checkpoint import Checkpointer

    model = with_blocks(llama.Llama(key=jax.random.key(0)), "layers", LLAMA_LAYER, 4)
    mesh = mesh_of(MESH_DP_PP[0], MESH_DP_PP[1])
    zb_v = {"layers": eqpar.Pipeline(stages=2, microbatches=2, repeats=2, schedule="zb-v")}
    _, trained = scheduled_step(llama.loss, model, zb_v, mesh, llama.batch(8))
    saved = eqpar.parallelize(trained, zb_v, mesh=mesh)
    abstract = eqx.filter_eval_shape(lambda: model)

    def same(a, b):
        leaves_a, leaves_b = (jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (a, b))
        assert len(leaves_a) == len(leaves_b)
        for x, y in zip(leaves_a, leaves_b):
            assert x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))

    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, saved)
        circular = {"layers": eqpar.Pipeline(stages=2, microbatches=2, repeats=2)}
        target = eqpar.parallelize(abstract, circular, mesh=mesh)
        shardings = eqpar.named_shardings(eqpar.partition_specs(target), mesh)
        restored = checkpointer.restore(0, target=target, shardings=shardings)
        same(restored, saved)
        same(eqpar.unparallelize(restored), trained)
        checkpointer.save(1, eqpar.unparallelize(saved))
        plain = checkpointer.restore(1, target=abstract)
        same(plain, trained)
        gpipe = eqpar.parallelize(plain, {"layers": eqpar.Pipeline(stages=2, microbatches=2)})
        same(eqpar.unparallelize(gpipe), trained)
