"""Parallelization plans on a model written without eqpar in mind, against its serial twin."""

import io

import equinox as eqx
import equinox_bert as bert
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collective_summary
from jax import lax
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close

import eqpar
from eqpar.nn import (
    ColumnParallelLinear,
    FeatureParallelEmbedding,
    HeadParallelAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
)

PLAN = {
    "embedder_block/token_embedder": eqpar.VocabParallel(),
    r"layers/\d+/attention_block/attention": eqpar.HeadParallel(),
    r"layers/\d+/ff_block/mlp": eqpar.ColumnParallel(),
    r"layers/\d+/ff_block/output": eqpar.RowParallel(),
    "classifier": eqpar.ColumnParallel(gather_output=True),
}
LR = 0.5


def mesh_of(data: int, model: int) -> eqpar.DeviceMesh:
    return eqpar.DeviceMesh((data, model), ("data", "model"), devices=jax.devices()[: data * model])


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def serial_step(model, tokens, labels, keys):
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(bert.loss))(model, tokens, labels, keys)
    return value, sgd(model, grads)


def global_loss(model, tokens, labels, keys):
    """Inside shard_map: this shard's mean loss, averaged over the data axis."""
    return lax.pmean(bert.loss(model, tokens, labels, keys), "data")


def parallel_step(model, mesh, tokens, labels, keys):
    """The documented recipe: the loss inside shard_map, gradients taken outside."""
    specs = eqpar.partition_specs(model)
    loss_fn = eqpar.shard_map(
        global_loss, mesh=mesh, in_specs=(specs, P("data"), P("data"), P("data")), out_specs=P()
    )

    @eqx.filter_jit
    def step(model, tokens, labels, keys):
        value, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, labels, keys)
        return value, sgd(model, grads)

    return step(model, tokens, labels, keys)


def assert_models_close(got, expected, **kwargs):
    """The float arrays of the parallel model `got` (unparallelized) against the serial model's,
    each relative to its scale (`numerics.assert_tree_close`)."""
    assert_arrays_close(eqpar.unparallelize(got), expected, **kwargs)


@pytest.fixture(scope="module")
def setup():
    model = bert.Encoder(key=jax.random.key(0))
    tokens, labels, keys = bert.batch(8)
    serial_loss, serial_model = serial_step(model, tokens, labels, keys)
    return model, (tokens, labels, keys), serial_loss, serial_model


def test_plan_converts_layers_in_place_and_back(setup):
    model = setup[0]
    parallel = eqpar.parallelize(model, PLAN, mesh=mesh_of(2, 4))
    layer = parallel.layers[1]
    assert type(layer.attention_block.attention) is HeadParallelAttention
    assert type(layer.ff_block.mlp) is ColumnParallelLinear
    assert type(layer.ff_block.output) is RowParallelLinear
    assert type(parallel.embedder_block.token_embedder) is VocabParallelEmbedding
    assert type(parallel.pooler) is eqx.nn.Linear  # not in the plan: replicated
    # The author's classes are unchanged, and each converted layer is still its original.
    assert type(layer) is bert.TransformerLayer
    assert isinstance(layer.ff_block.mlp, eqx.nn.Linear)
    # The global view: the same leaves, so either checkpoint loads into the other.
    assert jax.tree.structure(eqx.filter(parallel, eqx.is_array)) != jax.tree.structure(model)
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, parallel)
    buffer.seek(0)
    loaded = eqx.tree_deserialise_leaves(buffer, model)
    assert eqx.tree_equal(loaded, model)
    assert eqx.tree_equal(eqpar.unparallelize(parallel), model)
    specs = eqpar.partition_specs(parallel)
    assert specs.layers[0].attention_block.attention.query_proj.weight == P("model", None)
    assert specs.layers[0].attention_block.attention.output_proj.weight == P(None, "model")
    assert specs.layers[0].ff_block.output.bias == P()
    assert specs.embedder_block.token_embedder.weight == P("model", None)


@pytest.mark.parametrize(("data", "model_size"), [(1, 8), (2, 4)], ids=["tp8", "dp2xtp4"])
def test_sgd_step_with_dropout_equals_serial(setup, data, model_size):
    model, batch, serial_loss, serial_model = setup
    mesh = mesh_of(data, model_size)
    parallel = eqpar.parallelize(model, PLAN, mesh=mesh)
    loss, updated = parallel_step(parallel, mesh, *batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_models_close(updated, serial_model)


def test_fsdp_x_tp_step_equals_serial_and_splits_every_weight(setup):
    model, batch, serial_loss, serial_model = setup
    mesh = mesh_of(2, 4)
    parallel = eqpar.parallelize(model, PLAN, mesh=mesh)
    fsdp = eqpar.FSDP(mesh, axis="data", min_size_bytes=0)
    storage = fsdp.partition_specs(parallel)
    # Each tensor-parallel weight keeps its split over `model` and gains one over `data`.
    assert storage.layers[0].ff_block.mlp.weight == P("model", "data")
    assert storage.layers[0].ff_block.output.weight == P("data", "model")
    placed = eqx.filter_shard(parallel, eqpar.named_shardings(storage, mesh))
    loss, updated = parallel_step(placed, mesh, *batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_models_close(updated, serial_model)


def test_gradients_inside_shard_map_need_no_reduction(setup):
    """The gradient rule: differentiate the data-averaged loss; never reduce gradients."""
    model, batch, _, serial_model = setup
    mesh = mesh_of(2, 4)
    parallel = eqpar.parallelize(model, PLAN, mesh=mesh)
    specs = eqpar.partition_specs(parallel)
    grad_specs = eqpar.partition_specs(eqx.filter(parallel, eqx.is_inexact_array))

    # Differentiating this shard's own loss instead gives the sum over data shards: a step
    # `data` times too large for replicated parameters (what the rule guards against). Both
    # in one program: the two share their forward pass, and one compile costs half of two.
    def local_step(model, tokens, labels, keys):
        return (
            eqx.filter_grad(global_loss)(model, tokens, labels, keys),
            eqx.filter_grad(bert.loss)(model, tokens, labels, keys),
        )

    grads, summed = eqx.filter_jit(
        eqpar.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(specs, P("data"), P("data"), P("data")),
            out_specs=(grad_specs, grad_specs),
        )
    )(parallel, *batch)
    assert_models_close(sgd(parallel, grads), serial_model)
    assert_tree_close(summed.pooler.weight, 2 * grads.pooler.weight)


# --- the layers one by one, against eqx.nn --------------------------------------------------


def run(mesh, fn, layer, *args):
    """`fn(layer, *args)` inside shard_map, compiled (eager shard_map dispatches op by op)."""
    specs = eqpar.partition_specs(layer)
    mapped = eqpar.shard_map(fn, mesh=mesh, in_specs=(specs, *([P()] * len(args))), out_specs=P())
    return eqx.filter_jit(mapped)(layer, *args)


@pytest.mark.parametrize("n", [2, 8])
def test_attention_cross_masks_dropout_and_gradients(n):
    mesh = eqpar.DeviceMesh((n,), ("model",), devices=jax.devices()[:n])
    attention = eqx.nn.MultiheadAttention(
        8, 16, key_size=12, value_size=10, output_size=6, qk_size=4, vo_size=3,
        use_key_bias=True, use_value_bias=True, use_output_bias=True, dropout_p=0.25,
        key=jax.random.key(1),
    )  # fmt: skip
    keys = jax.random.split(jax.random.key(2), 4)
    query = jax.random.normal(keys[0], (5, 16))
    memory = jax.random.normal(keys[1], (7, 12))  # cross attention: another length
    value = jax.random.normal(keys[2], (7, 10))
    per_head = jax.random.bernoulli(keys[3], 0.7, (8, 5, 7)).at[:, :, 0].set(True)
    layer = eqpar.parallelize(attention, {"": eqpar.HeadParallel()})
    dropout_key = jax.random.key(3)

    # No mask without dropout; a per-head and a shared mask with dropout on.
    for mask, inference in ((None, True), (per_head, False), (per_head[0], False)):
        got = run(
            mesh,
            lambda m, q, k, v, mask, key, inference=inference: m(
                q, k, v, mask, key=key, inference=inference
            ),
            layer, query, memory, value, mask, dropout_key,
        )  # fmt: skip
        expected = attention(query, memory, value, mask, key=dropout_key, inference=inference)
        assert_tree_close(got, expected)

    # process_heads that treats every head alike (as rotary embeddings do).
    def scale_queries(q, k, v):
        return 2.0 * q, k, v

    options = dict(process_heads=scale_queries, inference=True)
    got = run(mesh, lambda m, q, k, v: m(q, k, v, **options), layer, query, memory, value)
    expected = attention(query, memory, value, **options)
    assert_tree_close(got, expected)

    def parallel_loss(m):
        out = run(mesh, lambda m, q, k, v, key: m(q, k, v, per_head, key=key), m,
                  query, memory, value, dropout_key)  # fmt: skip
        return jnp.sum(out**2)

    def serial_loss(m):
        return jnp.sum(m(query, memory, value, per_head, key=dropout_key) ** 2)

    got = eqpar.unparallelize(eqx.filter_jit(eqx.filter_grad(parallel_loss))(layer))
    expected = eqx.filter_jit(eqx.filter_grad(serial_loss))(attention)
    # The key bias's gradient is zero but for rounding (softmax ignores what the bias adds to
    # all of a query's scores): its error is that of the terms summed into it, which are the
    # size of the key weight's gradient, not of the cancelled result.
    key_bias = lambda m: m.key_proj.bias
    terms = float(jnp.max(jnp.abs(expected.key_proj.weight)))
    assert_tree_close(key_bias(got), key_bias(expected), scale=terms, what="key bias gradient")
    without_key_bias = lambda m: eqx.tree_at(key_bias, m, jnp.zeros_like(key_bias(m)))
    assert_models_close(without_key_bias(got), without_key_bias(expected))


# --- sequence parallelism -----------------------------------------------------------------

SEQUENCE_PLAN = {
    **PLAN,
    r"layers/\d+/attention_block/attention": eqpar.HeadParallel(sequence_parallel=True),
    r"layers/\d+/ff_block/mlp": eqpar.ColumnParallel(sequence_parallel=True),
    r"layers/\d+/ff_block/output": eqpar.RowParallel(sequence_parallel=True),
}


class SequenceShardedEncoder(bert.Encoder):
    """The author's Encoder with the two lines sequence parallelism asks for."""

    def __call__(self, token_ids, *, enable_dropout=False, key=None):
        embed_key, layer_key = (None, None) if key is None else jax.random.split(key)
        x = self.embedder_block(token_ids, enable_dropout=enable_dropout, key=embed_key)
        x = eqpar.nn.scatter_sequence(x)  # added: the trunk holds this device's tokens
        mask = token_ids != 0
        for layer in self.layers:
            this_key, layer_key = (None, None) if layer_key is None else jax.random.split(layer_key)
            x = layer(x, mask, enable_dropout=enable_dropout, key=this_key)
        x = eqpar.nn.gather_sequence(x)  # added: the head reads the whole sequence
        pooled = jnp.tanh(self.pooler(x[0]))
        return self.classifier(pooled)


def loss_without_dropout(model, tokens, labels):
    logits = jax.vmap(model)(tokens)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


@pytest.mark.parametrize(("data", "model_size"), [(1, 8), (2, 4)], ids=["tp8", "dp2xtp4"])
def test_sequence_parallel_sgd_step_equals_serial(data, model_size):
    serial = bert.Encoder(key=jax.random.key(0))
    sharded = SequenceShardedEncoder(key=jax.random.key(0))  # the same parameters
    tokens, labels, _ = bert.batch(8)
    # Compiled: BERT's serial gradient op by op took longer than the parallel step's compile.
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_without_dropout))(
        serial, tokens, labels
    )
    expected = sgd(serial, grads)

    mesh = mesh_of(data, model_size)
    parallel = eqpar.parallelize(sharded, SEQUENCE_PLAN, mesh=mesh)
    loss_fn = eqpar.shard_map(
        lambda m, t, y: lax.pmean(loss_without_dropout(m, t, y), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data"), P("data")),
        out_specs=P(),
    )
    got_value, got_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(
        parallel, tokens, labels
    )
    assert_tree_close(got_value, value, what="loss")
    assert_models_close(sgd(parallel, got_grads), expected)


def test_sequence_parallel_attention_cross_masks_dropout_and_gradients():
    n = 4
    mesh = eqpar.DeviceMesh((n,), ("model",), devices=jax.devices()[:n])
    attention = eqx.nn.MultiheadAttention(
        8, 16, key_size=12, value_size=12, output_size=6, use_output_bias=True,
        dropout_p=0.25, key=jax.random.key(1),
    )  # fmt: skip
    keys = jax.random.split(jax.random.key(2), 3)
    query = jax.random.normal(keys[0], (8, 16))
    memory = jax.random.normal(keys[1], (4, 12))  # cross attention: another length
    per_head = jax.random.bernoulli(keys[2], 0.7, (8, 8, 4)).at[:, :, 0].set(True)
    layer = eqpar.parallelize(attention, {"": eqpar.HeadParallel(sequence_parallel=True)})
    dropout_key = jax.random.key(3)

    def parallel_out(m):
        # Query, key and value arrive split over the sequence; the mask is whole.
        return eqpar.shard_map(
            lambda m, q, kv, mask, k: m(q, kv, kv, mask, key=k),
            mesh=mesh,
            in_specs=(eqpar.partition_specs(m), P("model"), P("model"), P(), P()),
            out_specs=P("model"),
        )(m, query, memory, per_head, dropout_key)

    def serial_out(m):
        return m(query, memory, memory, per_head, key=dropout_key)

    assert_tree_close(eqx.filter_jit(parallel_out)(layer), serial_out(attention))
    got = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(parallel_out(m) ** 2)))(layer)
    expected = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(serial_out(m) ** 2)))(attention)
    assert_models_close(got, expected)


def test_sequence_parallel_errors_name_the_fix():
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    linear = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    with pytest.raises(ValueError, match="gather_output=True and sequence_parallel=True"):
        eqpar.parallelize(
            linear, {"": eqpar.ColumnParallel(gather_output=True, sequence_parallel=True)}
        )
    mlp = eqx.nn.MLP(8, 8, 8, 1, key=jax.random.key(0))
    mixed = eqpar.parallelize(
        mlp,
        {"layers/0": eqpar.ColumnParallel(sequence_parallel=True), "layers/1": eqpar.RowParallel()},
    )
    with pytest.raises(ValueError, match=r"set sequence_parallel=True on this layer too"):
        eqpar.shard_map(
            lambda m, x: jax.vmap(m)(x), mesh=mesh,
            in_specs=(eqpar.partition_specs(mixed), P("model")), out_specs=P("model"),
        )(mixed, jnp.ones((8, 8)))  # fmt: skip
    with pytest.raises(ValueError, match=r"scatter_sequence: .*got shape \(6, 2\)\. Pad"):
        eqpar.shard_map(eqpar.nn.scatter_sequence, mesh=mesh, in_specs=P(), out_specs=P("model"))(
            jnp.ones((6, 2))
        )


def test_sequence_parallel_dropout_and_a_whole_memory_equal_the_serial_layers():
    n = 4
    mesh = eqpar.DeviceMesh((n,), ("model",), devices=jax.devices()[:n])
    dropout = eqx.nn.Dropout(0.5)
    layer = eqpar.parallelize({"d": dropout}, {"d": eqpar.SequenceParallel()})["d"]
    assert type(eqpar.unparallelize(layer)) is eqx.nn.Dropout
    x, key = jax.random.normal(jax.random.key(0), (8, 3)), jax.random.key(1)
    blocks = eqx.filter_jit(
        eqpar.shard_map(
            lambda x, k: layer(x, key=k), mesh=mesh, in_specs=(P("model"), P()),
            out_specs=P("model"),
        )
    )(x, key)  # fmt: skip
    np.testing.assert_array_equal(blocks, dropout(x, key=key))

    # Cross attention to a memory every device holds whole: used as it is, dropout on.
    attention = eqx.nn.MultiheadAttention(4, 8, dropout_p=0.3, key=jax.random.key(2))
    parallel = eqpar.parallelize(attention, {"": eqpar.HeadParallel(sequence_parallel=True)})
    query, memory = jax.random.normal(key, (8, 8)), jax.random.normal(jax.random.key(3), (6, 8))

    def parallel_out(m):
        return eqpar.shard_map(
            lambda m, q, kv, k: m(q, kv, kv, key=k), mesh=mesh,
            in_specs=(eqpar.partition_specs(m), P("model"), P(), P()), out_specs=P("model"),
        )(m, query, memory, key)  # fmt: skip

    assert_tree_close(
        eqx.filter_jit(parallel_out)(parallel), attention(query, memory, memory, key=key)
    )


def test_sequence_parallel_refuses_split_and_whole_activations_mixed():
    mesh = mesh_of(1, 4)
    model = SequenceShardedEncoder(key=jax.random.key(0))
    tokens, labels, _ = bert.batch(2)

    def run(plan, model=model):
        # The errors come while tracing: compile once rather than run op by op.
        parallel = eqpar.parallelize(model, plan, mesh=mesh)
        return eqx.filter_jit(eqpar.shard_map(
            lambda m, t, y: loss_without_dropout(m, t, y), mesh=mesh,
            in_specs=(eqpar.partition_specs(parallel), P("data"), P("data")), out_specs=P(),
        ))(parallel, tokens, labels)  # fmt: skip

    # The attention is sequence-parallel, the MLP is not: its input is split.
    attention_only = {**PLAN, r"layers/\d+/attention_block/attention": SEQUENCE_PLAN[
        r"layers/\d+/attention_block/attention"]}  # fmt: skip
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: `x` differs between the devices"):
        run(attention_only)
    # scatter_sequence in the model, no sequence-parallel styles at all.
    with pytest.raises(ValueError, match=r"HeadParallelAttention: `query` differs"):
        run(PLAN)
    # Sequence-parallel styles on a model that never splits the sequence.
    with pytest.raises(ValueError, match=r"`query` is the same on every device.*scatter_sequence"):
        run(SEQUENCE_PLAN, bert.Encoder(key=jax.random.key(0)))


@pytest.mark.parametrize("style", [eqpar.VocabParallel(), eqpar.FeatureParallel()])
def test_embeddings_and_their_gradients(style):
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    table = eqx.nn.Embedding(16, 8, key=jax.random.key(0))
    layer = eqpar.parallelize(table, {"": style})
    assert type(layer) is (
        VocabParallelEmbedding
        if isinstance(style, eqpar.VocabParallel)
        else FeatureParallelEmbedding
    )
    ids = jnp.array([[0, 5, 15], [3, -1, 16]])  # out of range: as the serial layer's weight[x]
    weights = jnp.arange(6.0).reshape(2, 3, 1)

    def parallel_loss(m):
        out = run(mesh, lambda m, ids: jax.vmap(jax.vmap(m))(ids), m, ids)
        return jnp.sum(out * weights)

    def serial_loss(m):
        return jnp.sum(jax.vmap(jax.vmap(m))(ids) * weights)

    assert_tree_close(parallel_loss(layer), serial_loss(table), rtol=1e-6)
    got = eqx.filter_grad(parallel_loss)(layer)
    # Sums of a few small integers (the weights): exact in any order.
    assert_tree_close(got.weight, eqx.filter_grad(serial_loss)(table).weight, rtol=1e-7)


def test_a_style_splits_over_a_tuple_of_axes():
    """`VocabParallel(("model", "pipe"))` and `ColumnParallel(("model", "pipe"))` split over
    both axes at once, as a PartitionSpec does; the lookup and the vocabulary-parallel loss
    agree with the serial layers."""
    from eqpar.nn import vocab_parallel_cross_entropy

    axes = ("model", "pipe")
    mesh = eqpar.DeviceMesh((2, 2), ("pipe", "model"), devices=jax.devices()[:4])
    k1, k2 = jax.random.split(jax.random.key(0))
    model = {"embed": eqx.nn.Embedding(16, 8, key=k1), "head": eqx.nn.Linear(8, 16, key=k2)}
    plan = {"embed": eqpar.VocabParallel(axes), "head": eqpar.ColumnParallel(axes)}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    assert type(parallel["embed"]) is VocabParallelEmbedding
    assert type(parallel["head"]) is ColumnParallelLinear
    specs = eqpar.partition_specs(parallel)
    assert specs["embed"].weight == P(axes, None)
    assert specs["head"].weight == P(axes, None) and specs["head"].bias == P(axes)
    ids = jnp.array([0, 5, 11, 15])

    def loss(m, ids):
        logits = jax.vmap(lambda i: m["head"](m["embed"](i)))(ids)
        return jnp.mean(vocab_parallel_cross_entropy(logits, ids[::-1], axis_name=axes))

    def serial_loss(m, ids):
        logits = jax.vmap(lambda i: m["head"](m["embed"](i)))(ids)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, ids[::-1, None], axis=-1))

    assert_tree_close(run(mesh, loss, parallel, ids), serial_loss(model, ids))


def test_a_tuple_of_axes_must_be_on_the_mesh_and_divide_by_their_product():
    model = {"embed": eqx.nn.Embedding(12, 8, key=jax.random.key(0))}
    style = eqpar.VocabParallel(("model", "pipe"))
    with pytest.raises(ValueError, match=r"names axis 'pipe', which the mesh \('data', 'model'\)"):
        eqpar.parallelize(model, {"embed": style}, mesh=mesh_of(2, 4))
    # 12 divides by each of 2 and 4, not by their product.
    mesh = eqpar.DeviceMesh((2, 4), ("pipe", "model"))
    with pytest.raises(
        ValueError, match=r"num_embeddings=12, .* size of axis \('model', 'pipe'\) \(8\)"
    ):
        eqpar.parallelize(model, {"embed": style}, mesh=mesh)
    head = {"head": eqx.nn.Linear(8, 12, key=jax.random.key(0))}
    with pytest.raises(ValueError, match=r"out_features=12, .*\('model', 'pipe'\) \(8\)"):
        eqpar.parallelize(head, {"head": eqpar.ColumnParallel(("model", "pipe"))}, mesh=mesh)
    # 12 divides by 2 x 2: accepted on a mesh with a third axis the style does not name.
    mesh = eqpar.DeviceMesh((2, 2, 2), ("data", "pipe", "model"))
    parallel = eqpar.parallelize(model, {"embed": style}, mesh=mesh)
    assert eqpar.partition_specs(parallel)["embed"].weight == P(("model", "pipe"), None)


# --- errors ---------------------------------------------------------------------------------


def test_plan_errors_name_the_key_the_path_and_the_fix(setup):
    model = setup[0]
    with pytest.raises(
        ValueError,
        match=r"no layer: 'layers/.*/ff/mlp' \(closest paths: \['layers/1/ff_block/mlp'",
    ):
        eqpar.parallelize(model, {r"layers/\d+/ff/mlp": eqpar.ColumnParallel()})
    with pytest.warns(UserWarning, match="match no layer"):
        eqpar.parallelize(model, {"nothing": eqpar.RowParallel()}, strict=False)
    with pytest.raises(
        TypeError, match=r"'layers/0/attention_block/attention' is a MultiheadAttention"
    ):
        eqpar.parallelize(model, {r"layers/0/attention_block/.*": eqpar.ColumnParallel()})
    with pytest.raises(ValueError, match=r"'layers/1' has out_features=6.*axis 'model' \(8\)"):
        eqpar.parallelize(
            eqx.nn.MLP(4, 4, 6, 2, key=jax.random.key(0)),
            {"layers/1": eqpar.ColumnParallel()},
            mesh=eqpar.DeviceMesh((8,), ("model",)),
        )
    with pytest.raises(ValueError, match="names axis 'tensor'"):
        eqpar.parallelize(
            model, {"pooler": eqpar.RowParallel(axis_name="tensor")}, mesh=mesh_of(2, 4)
        )
    with pytest.raises(ValueError, match="matches several keys"):
        eqpar.parallelize(model, {"pool.*": eqpar.RowParallel(), ".*er": eqpar.Replicated()})
    with pytest.raises(TypeError, match="must be a style"):
        eqpar.parallelize(model, {"pooler": "column"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="plan"):
        eqpar.parallelize(model, [("pooler", eqpar.RowParallel())])  # type: ignore[arg-type]
    parallel = eqpar.parallelize(model, PLAN)
    # Not placed on a mesh (no mesh= given) and called outside shard_map: the layer cannot
    # open its own region.
    with pytest.raises(
        ValueError, match=r"mesh axis 'model' is not bound here.*not placed.*eqpar\.unparallelize"
    ):
        parallel.classifier(jnp.ones(bert.DIM))


def test_conversion_errors_name_the_plan_key_and_the_path():
    model = {"proj": eqx.nn.Linear(8, "scalar", key=jax.random.key(0))}
    with pytest.raises(ValueError, match=r"plan\['p.*'\] = ColumnParallel.* at 'proj': .*'scalar'"):
        eqpar.parallelize(model, {"p.*": eqpar.ColumnParallel()})
    with pytest.raises(ValueError, match="gather_output=True and sequence_parallel=True"):
        eqpar.ColumnParallel(gather_output=True, sequence_parallel=True)


def test_layer_errors_outside_the_declared_layout():
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    layer = eqpar.parallelize(eqx.nn.Linear(8, 8, key=jax.random.key(0)), {"": eqpar.RowParallel()})
    with pytest.raises(ValueError, match=r"input must be this device's block \[in_features / n\]"):
        run(mesh, lambda m, x: m(x), layer, jnp.ones(8))
    with pytest.raises(ValueError, match=r"local block of weight has shape \(8, 8\)"):
        eqpar.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(P(), P()), out_specs=P())(
            layer, jnp.ones(2)
        )
    for mesh_option in (None, mesh):
        with pytest.raises(ValueError, match="'scalar' has nothing to split"):
            eqpar.parallelize(
                eqx.nn.Linear("scalar", 4, key=jax.random.key(0)),
                {"": eqpar.ColumnParallel()},
                mesh=mesh_option,
            )
    column = eqpar.parallelize(
        eqx.nn.Linear(8, 8, key=jax.random.key(0)), {"": eqpar.ColumnParallel()}
    )
    with pytest.raises(ValueError, match=r"one example's features \[in_features\] = \[8\]"):
        run(mesh, lambda m, x: m(x), column, jnp.ones((2, 8)))
    # A stack made by a bare filter_vmap is called as one layer: say so, and what to use.
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
        jax.random.split(jax.random.key(0), 4)
    )
    stack = eqpar.parallelize(stack, {"": eqpar.ColumnParallel()})
    with pytest.raises(ValueError, match=r"a stack of layers called as one.*ScannedLayers"):
        run(mesh, lambda m, x: m(x), stack, jnp.ones(8))


def test_column_parallel_twice_in_a_row_names_both_layers_and_the_fix():
    """A key matching two consecutive linears gives both ColumnParallel: the second would
    get the first's block of features. Not a batch (no jax.vmap advice): name both layers
    and say to give the second RowParallel or narrow the key."""
    mlp = eqx.nn.MLP(8, 8, 16, 2, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"plan\['layers/\\\\d\+'\] = ColumnParallel\(.*\) matches both 'layers/0' and "
        r"'layers/1', and the MLP at the root runs them in a row\. The first leaves its output "
        r"split over 'model'.*Give 'layers/1' RowParallel\(\).*names only 'layers/0'",
    ):
        eqpar.parallelize(mlp, {r"layers/\d+": eqpar.ColumnParallel()})

    def sequential_with(between):
        layers = [eqx.nn.Linear(8, 16, key=jax.random.key(1)), between]
        return {"net": eqx.nn.Sequential([*layers, eqx.nn.Linear(16, 8, key=jax.random.key(2))])}

    columns = {"net/layers/0": eqpar.ColumnParallel(), "net/layers/2": eqpar.ColumnParallel()}
    # A Lambda may gather the features again, so it is not taken for elementwise: converted
    # (the second layer refuses a block of features when traced, as below).
    eqpar.parallelize(sequential_with(eqx.nn.Lambda(jax.nn.gelu)), columns)
    sequential = sequential_with(eqx.nn.Dropout(0.1))
    with pytest.raises(
        ValueError,
        match=r"the Sequential at 'net' runs 'net/layers/0' \(plan\['net/layers/0'\] = "
        r"ColumnParallel.*and then 'net/layers/2' \(plan\['net/layers/2'\] = ColumnParallel",
    ):
        eqpar.parallelize(sequential, columns)
    # A gathered output is whole: two column layers in a row are then right.
    eqpar.parallelize(mlp, {r"layers/\d+": eqpar.ColumnParallel(gather_output=True)})

    # In the author's own module eqpar cannot see the order; the layer says it at trace time.
    class TwoUp(eqx.Module):
        up1: eqx.nn.Linear
        up2: eqx.nn.Linear

        def __call__(self, x):
            return self.up2(jax.nn.gelu(self.up1(x)))

    model = TwoUp(
        eqx.nn.Linear(8, 16, key=jax.random.key(3)), eqx.nn.Linear(16, 8, key=jax.random.key(4))
    )
    parallel = eqpar.parallelize(model, {"up.": eqpar.ColumnParallel()})
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"\[in_features\] = \[16\].*got shape \(4,\)\.") as info:
        run(mesh, lambda m, x: m(x), parallel, jnp.ones(8))
    message = str(info.value)
    assert "split over axis 'model' (4 devices)" in message
    assert "Give this layer RowParallel()" in message and "vmap" not in message


def test_self_attention_sums_its_input_gradient_over_the_axis_once():
    """Query, key and value read one array: its gradient is reduced over `model` once (one
    all-reduce forward for the heads' sum, one backward), not once per projection."""
    mesh = eqpar.DeviceMesh((8,), ("model",))
    attention = eqx.nn.MultiheadAttention(8, 16, key=jax.random.key(1))
    layer = eqpar.parallelize(attention, {"": eqpar.HeadParallel()})
    x = jax.random.normal(jax.random.key(2), (5, 16))

    def input_grad(layer, x):
        return jax.grad(lambda x: jnp.sum(layer(x, x, x) ** 2))(x)

    serial = jax.grad(lambda x: jnp.sum(attention(x, x, x) ** 2))(x)
    specs = eqpar.partition_specs(layer)
    mapped = eqpar.shard_map(input_grad, mesh=mesh, in_specs=(specs, P()), out_specs=P())
    compiled = eqx.filter_jit(mapped).lower(layer, x).compile()
    assert_tree_close(compiled(layer, x), serial)
    # Two all-reduces of one [5, 16] float32 array each (the compiler may fuse several
    # reductions into one instruction, so the bytes say how many arrays are reduced).
    one = 2 * x.size * 4 * 7 / 8
    assert collective_summary(compiled).bytes == {"all-reduce": 2 * one}
