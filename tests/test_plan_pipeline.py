"""Pipelines over the layers of a model written without eqpar in mind, with and without a plan.

The BERT-style encoder of `equinox_bert.py` keeps its classes: its Python list of
`TransformerLayer`s is stacked (`eqpar.nn.stack_layers`) into a `PipelineModule` that sits
between the embedding and the head of a small driver module. Each layer runs per example
(`jax.vmap`) with dropout on; the padding mask and the dropout keys are per-example arguments
(`eqpar.pipeline.Microbatched`). One SGD step under GPipe, 1F1B and the circular schedule, and
under data x pipe x tensor parallelism, equals the same step on one device.
"""

import equinox as eqx
import equinox_bert as bert
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array
from numerics import assert_tree_close

import eqpar
from eqpar.nn import PipelineModule, stack_layers
from eqpar.pipeline import Microbatched

NUM_LAYERS = 4
LR = 0.5
PLAN = {
    "embedder_block/token_embedder": eqpar.VocabParallel(),
    r"body/.*/attention": eqpar.HeadParallel(),
    r"body/.*/ff_block/mlp": eqpar.ColumnParallel(),
    r"body/.*/ff_block/output": eqpar.RowParallel(),
}


class PerExample(eqx.Module):
    """Runs one of the encoder's layers on a microbatch, example by example."""

    layer: bert.TransformerLayer
    index: Array  # the layer's place in the model, to give it its own dropout keys

    def __call__(self, x: Array, mask: Array, keys: Array) -> Array:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, self.index))(keys)
        return jax.vmap(lambda h, m, k: self.layer(h, m, enable_dropout=True, key=k))(x, mask, keys)


class Head(eqx.Module):
    pooler: eqx.nn.Linear
    classifier: eqx.nn.Linear

    def __call__(self, h: Array, labels: Array) -> Array:
        logits = jax.vmap(lambda x: self.classifier(jnp.tanh(self.pooler(x[0]))))(h)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


class PipelinedEncoder(eqx.Module):
    embedder_block: bert.EmbedderBlock
    body: PipelineModule
    head: Head

    def __init__(self, encoder: bert.Encoder, **pipeline_options):
        self.embedder_block = encoder.embedder_block
        per_example = [PerExample(layer, jnp.asarray(i)) for i, layer in enumerate(encoder.layers)]
        self.body = PipelineModule.from_layers(
            stack_layers(per_example), broadcast_output=True, **pipeline_options
        )
        self.head = Head(encoder.pooler, encoder.classifier)

    def embed(self, tokens: Array, keys: Array) -> Array:
        return jax.vmap(lambda t, k: self.embedder_block(t, enable_dropout=True, key=k))(
            tokens, keys
        )

    def loss(self, tokens: Array, labels: Array, keys: Array, *, serial: bool = False) -> Array:
        mask = tokens != 0
        x = self.embed(tokens, keys)
        run = self.body.apply_serially if serial else self.body
        return self.head(run(x, Microbatched(mask), Microbatched(keys)), labels)


def encoder() -> bert.Encoder:
    model = bert.Encoder(key=jax.random.key(0))
    layer_keys = jax.random.split(jax.random.key(7), NUM_LAYERS)
    return eqx.tree_at(
        lambda m: m.layers, model, [bert.TransformerLayer(key=k) for k in layer_keys]
    )


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def model_order(model: PipelinedEncoder) -> list[np.ndarray]:
    """The parameters in a form that does not depend on the pipeline layout."""
    canonical = eqx.tree_at(lambda m: m.body, model, model.body.to_layers())
    inexact = eqx.filter(eqpar.unparallelize(canonical), eqx.is_inexact_array)
    return [np.asarray(a) for a in jax.tree.leaves(inexact)]


@pytest.fixture(scope="module")
def serial():
    model = PipelinedEncoder(encoder(), num_stages=1, num_microbatches=1)
    tokens, labels, keys = bert.batch(16)
    value, grads = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m: m.loss(tokens, labels, keys, serial=True))
    )(model)
    return (tokens, labels, keys), value, model_order(sgd(model, grads))


def mesh_of(data: int, pipe: int, model: int) -> eqpar.DeviceMesh:
    devices = jax.devices()[: data * pipe * model]
    return eqpar.DeviceMesh((data, pipe, model), ("data", "pipe", "model"), devices=devices)


def gpipe_step(model, mesh, batch):
    specs = eqpar.partition_specs(model)
    loss_fn = eqpar.shard_map(
        lambda m, t, y, k: lax.pmean(m.loss(t, y, k), "data"),
        mesh=mesh,
        in_specs=(specs, P("data"), P("data"), P("data")),
        out_specs=P(),
    )
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, *batch)
    return value, sgd(model, grads)


def one_f_one_b_step(model, mesh, batch):
    """1F1B's own backward, with the embedding before it differentiated by its vjp."""
    specs = eqpar.partition_specs(model)
    grad_specs = eqpar.partition_specs(eqx.filter(model, eqx.is_inexact_array))

    def local(model, tokens, labels, keys):
        mask = tokens != 0

        def embed(block):
            return eqx.tree_at(lambda m: m.embedder_block, model, block).embed(tokens, keys)

        x, embed_vjp = eqx.filter_vjp(embed, model.embedder_block)
        loss, (body_grads, head_grads, x_grads) = model.body.value_and_grad(
            model.head,
            x,
            labels,
            Microbatched(mask),
            Microbatched(keys),
            schedule="1f1b",
            return_all_grads=True,
        )
        (embed_grads,) = embed_vjp(x_grads)
        grads = eqx.tree_at(
            lambda m: (m.embedder_block, m.body, m.head),
            eqx.filter(model, eqx.is_inexact_array),
            (embed_grads, body_grads, head_grads),
            is_leaf=lambda x: x is None,
        )
        # The loss of the whole batch and its gradients (the one gradient rule).
        return loss, grads

    step = eqpar.shard_map(
        local,
        mesh=mesh,
        in_specs=(specs, P("data"), P("data"), P("data")),
        out_specs=(P(), grad_specs),
    )
    value, grads = eqx.filter_jit(step)(model, *batch)
    return value, sgd(model, grads)


@pytest.mark.parametrize(
    ("shape", "options", "plan", "step"),
    [
        ((2, 4, 1), {"num_stages": 4, "num_microbatches": 2}, None, gpipe_step),
        ((2, 4, 1), {"num_stages": 4, "num_microbatches": 4}, None, one_f_one_b_step),
        ((2, 2, 1), {"num_stages": 2, "num_repeats": 2, "num_microbatches": 2}, None, gpipe_step),
        ((2, 2, 2), {"num_stages": 2, "num_microbatches": 2}, PLAN, gpipe_step),
        ((1, 2, 4), {"num_stages": 2, "num_microbatches": 2}, PLAN, one_f_one_b_step),
    ],
    ids=["gpipe", "1f1b", "circular", "dp-pp-tp", "pp-tp-1f1b"],
)
def test_sgd_step_with_dropout_equals_one_device(serial, shape, options, plan, step):
    batch, serial_loss, serial_params = serial
    mesh = mesh_of(*shape)
    model = PipelinedEncoder(encoder(), **options)
    if plan is not None:
        model = eqpar.parallelize(model, plan, mesh=mesh)
        assert type(model.body.stages.layers.layer) is bert.TransformerLayer
    value, updated = step(model, mesh, batch)
    assert_tree_close(value, serial_loss, what="loss")
    assert_tree_close(model_order(updated), serial_params, what="parameters after the step")
