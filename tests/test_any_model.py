"""Models nobody on the team wrote, with dropout where their authors put it, against the
same SGD step on one device: randomness and positions are right by construction.

- The Vision Transformer of `equinox_vit.py` (Equinox's documented style) has a dropout
  between the two linears of its MLP: under tensor parallelism every device holds a block of
  that activation's features, and each must apply its block of the serial mask.
- A rotary encoder in Equinox's documented pattern (`eqx.nn.RotaryPositionalEmbedding` in
  `process_heads`, dropouts on the sequence) under context parallelism: each device holds a
  block of the sequence, so its rows need their global positions and their rows of the mask.
"""

import equinox as eqx
import equinox_vit as vit
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray
from numerics import assert_arrays_close, assert_tree_close

import eqpar
from eqpar.nn import ParallelDropout, ParallelRotaryEmbedding

LR = 0.5
VIT_PLAN = {
    r"attention_blocks/\d+/attention": eqpar.HeadParallel(),
    r"attention_blocks/\d+/linear1": eqpar.ColumnParallel(),
    r"attention_blocks/\d+/linear2": eqpar.RowParallel(),
}


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> eqpar.DeviceMesh:
    size = 1
    for n in shape:
        size *= n
    return eqpar.DeviceMesh(shape, names, devices=jax.devices()[:size])


def serial_step(loss_fn, model, *batch):
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, *batch)
    return value, sgd(model, grads)


def sharded_step(loss_fn, model, mesh, batch_specs, *batch, mean_over=("data",)):
    """The documented recipe: the loss averaged over the axes that split the batch (and the
    sequence) inside shard_map, gradients taken outside."""
    specs = eqpar.partition_specs(model)
    sharded = eqpar.shard_map(
        lambda m, *b: lax.pmean(loss_fn(m, *b), mean_over),
        mesh=mesh,
        in_specs=(specs, *batch_specs),
        out_specs=P(),
    )
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(sharded))(model, *batch)
    return value, eqpar.unparallelize(sgd(model, grads))


@pytest.fixture(scope="module")
def vit_setup():
    model = vit.VisionTransformer(key=jax.random.key(0))
    batch = vit.batch(4)
    return model, batch, serial_step(vit.loss, model, *batch)


def vit_step(model, mesh, batch, *, fsdp: bool = False):
    if fsdp:
        storage = eqpar.FSDP(mesh, axis="data", min_size_bytes=0).partition_specs(model)
        model = eqx.filter_shard(model, eqpar.named_shardings(storage, mesh))
    return sharded_step(vit.loss, model, mesh, (P("data"),) * 3, *batch)


@pytest.mark.parametrize(
    ("shape", "fsdp"),
    [((1, 4), False), ((2, 4), False), ((2, 4), True)],
    ids=["tp4", "dp2xtp4", "fsdp2xtp4"],
)
def test_vit_dropout_inside_the_tensor_parallel_mlp_draws_the_serial_mask(vit_setup, shape, fsdp):
    model, batch, (serial_loss, serial_model) = vit_setup
    mesh = mesh_of(shape, ("data", "model"))
    parallel = eqpar.parallelize(model, VIT_PLAN, mesh=mesh)
    # Every dropout is converted without a plan entry; the author's classes stay.
    assert type(parallel.attention_blocks[0].dropout1) is ParallelDropout
    assert type(parallel.attention_blocks[0]) is vit.AttentionBlock
    assert type(eqpar.unparallelize(parallel).attention_blocks[0].dropout1) is eqx.nn.Dropout
    loss, updated = vit_step(parallel, mesh, batch, fsdp=fsdp)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


def test_vit_step_is_wrong_with_one_mask_per_device(vit_setup):
    """What the conversion fixes: a plain dropout (kept by `Replicated()`) repeats its mask
    on every device's block of the MLP's features."""
    model, batch, (serial_loss, _) = vit_setup
    mesh = mesh_of((1, 4), ("data", "model"))
    plan = {**VIT_PLAN, r"attention_blocks/\d+/dropout1": eqpar.Replicated()}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    assert type(parallel.attention_blocks[0].dropout1) is eqx.nn.Dropout
    loss, _ = vit_step(parallel, mesh, batch)
    assert abs(float(loss) - float(serial_loss)) > 1e-3 * abs(float(serial_loss))


SEQ, DIM, HEADS, HIDDEN, LAYERS = 16, 16, 4, 32, 2


class RotaryBlock(eqx.Module):
    """Attention with rotary positions in `process_heads` (Equinox's documented pattern),
    dropouts on the sequence and between the MLP's linears."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    rotary: eqx.nn.RotaryPositionalEmbedding
    dropout: eqx.nn.Dropout
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    mlp_dropout: eqx.nn.Dropout
    down: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.attention = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.rotary = eqx.nn.RotaryPositionalEmbedding(DIM // HEADS)
        self.dropout, self.mlp_dropout = eqx.nn.Dropout(0.3), eqx.nn.Dropout(0.3)
        self.up, self.down = eqx.nn.Linear(DIM, HIDDEN, key=k2), eqx.nn.Linear(HIDDEN, DIM, key=k3)

    def __call__(self, x: Float[Array, "seq dim"], key: PRNGKeyArray) -> Float[Array, "seq dim"]:
        def process_heads(q, k, v):
            rotate = jax.vmap(self.rotary, in_axes=1, out_axes=1)
            return rotate(q), rotate(k), v

        k1, k2 = jax.random.split(key)
        normed = jax.vmap(self.norm1)(x)
        attended = self.attention(normed, normed, normed, process_heads=process_heads)
        x = x + self.dropout(attended, key=k1)
        hidden = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x)))
        return x + jax.vmap(self.down)(self.mlp_dropout(hidden, key=k2))


class RotaryEncoder(eqx.Module):
    blocks: list[RotaryBlock]

    def __init__(self, *, key: PRNGKeyArray):
        self.blocks = [RotaryBlock(key=k) for k in jax.random.split(key, LAYERS)]

    def __call__(self, x: Float[Array, "seq dim"], key: PRNGKeyArray) -> Float[Array, "seq dim"]:
        for block, block_key in zip(self.blocks, jax.random.split(key, LAYERS)):
            x = block(x, block_key)
        return x


def rotary_loss(model, x, targets, keys):
    out = jax.vmap(model)(x, keys)
    return jnp.mean((out - targets) ** 2)


def context_step(model, mesh, batch):
    """The rotary encoder's step with each sequence split over `context` by the in_specs
    (inputs and targets; the keys are per example), the loss averaged over both axes."""
    specs = (P("data", "context"), P("data", "context"), P("data"))
    return sharded_step(rotary_loss, model, mesh, specs, *batch, mean_over=("data", "context"))


@pytest.fixture(scope="module")
def rotary_setup():
    model = RotaryEncoder(key=jax.random.key(3))
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    batch = (
        jax.random.normal(k1, (4, SEQ, DIM)),
        jax.random.normal(k2, (4, SEQ, DIM)),
        jax.random.split(k3, 4),
    )
    return model, batch, serial_step(rotary_loss, model, *batch)


@pytest.mark.parametrize(
    ("shape", "plan"),
    [
        ((2, 4, 1), {r"blocks/\d+/attention": eqpar.ContextParallel()}),
        (
            (2, 2, 2),
            {
                r"blocks/\d+/attention": eqpar.ContextParallel(head_axis_name="model"),
                r"blocks/\d+/up": eqpar.ColumnParallel(),
                r"blocks/\d+/down": eqpar.RowParallel(),
            },
        ),
        # Ulysses: the 4 heads split over the 4 devices of `context` for attention
        ((2, 4, 1), {r"blocks/\d+/attention": eqpar.ContextParallel(strategy="ulysses")}),
    ],
    ids=["dp2xcp4", "dp2xcp2xtp2", "dp2xcp4-ulysses"],
)
def test_rotary_positions_and_dropout_on_a_context_parallel_sequence(rotary_setup, shape, plan):
    model, batch, (serial_loss, serial_model) = rotary_setup
    mesh = mesh_of(shape, ("data", "context", "model"))
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    assert type(parallel.blocks[0].rotary) is ParallelRotaryEmbedding
    assert type(parallel.blocks[0].dropout) is ParallelDropout
    loss, updated = context_step(parallel, mesh, batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


class SequenceParallelBlock(eqx.Module):
    """A block whose author marks where the trunk's tokens are split (TP+SP), with dropouts
    between the MLP's linears (features split, tokens gathered) and after the block (the
    sequence split)."""

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    inner_dropout: eqx.nn.Dropout
    down: eqx.nn.Linear
    outer_dropout: eqx.nn.Dropout

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(DIM)
        self.up, self.down = eqx.nn.Linear(DIM, HIDDEN, key=k1), eqx.nn.Linear(HIDDEN, DIM, key=k2)
        self.inner_dropout, self.outer_dropout = eqx.nn.Dropout(0.3), eqx.nn.Dropout(0.3)

    def __call__(self, x: Float[Array, "seq dim"], key: PRNGKeyArray) -> Float[Array, "seq dim"]:
        k1, k2 = jax.random.split(key)
        x = eqpar.nn.scatter_sequence(x)
        hidden = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm)(x)))
        out = jax.vmap(self.down)(self.inner_dropout(hidden, key=k1))
        return eqpar.nn.gather_sequence(x + self.outer_dropout(out, key=k2))


def test_tensor_and_sequence_parallel_dropouts_need_no_plan_entry():
    block = SequenceParallelBlock(key=jax.random.key(5))
    x = jax.random.normal(jax.random.key(6), (SEQ, DIM))
    key = jax.random.key(7)

    def loss(model, x, key):
        return jnp.mean(model(x, key) ** 2)

    def step(model, mesh):
        run = eqpar.shard_map(
            loss, mesh=mesh, in_specs=(eqpar.partition_specs(model), P(), P()), out_specs=P()
        )
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(run))(model, x, key)
        return value, eqpar.unparallelize(sgd(model, grads))

    # One device: scatter and gather are the identity, the dropouts the plain layer's.
    want_loss, want = step(block, mesh_of((1,), ("model",)))
    mesh = mesh_of((4,), ("model",))
    plan = {
        "up": eqpar.ColumnParallel(sequence_parallel=True),
        "down": eqpar.RowParallel(sequence_parallel=True),
    }
    got_loss, got = step(eqpar.parallelize(block, plan, mesh=mesh), mesh)
    assert_tree_close(got_loss, want_loss, what="loss")
    assert_arrays_close(got, want)


def test_a_dropout_on_a_split_activation_eqpar_cannot_place_is_refused():
    """The author reshapes the MLP's hidden features before the dropout: eqpar cannot say
    which block of the serial mask this is, so it refuses rather than repeat one mask."""

    class Reshaping(eqx.Module):
        up: eqx.nn.Linear
        dropout: eqx.nn.Dropout
        down: eqx.nn.Linear

        def __call__(self, x, key):
            hidden = jax.vmap(self.up)(x)
            dropped = self.dropout(hidden.reshape(-1), key=key).reshape(hidden.shape)
            return jax.vmap(self.down)(dropped)

    k1, k2 = jax.random.split(jax.random.key(0))
    model = Reshaping(
        eqx.nn.Linear(4, 16, key=k1), eqx.nn.Dropout(0.5), eqx.nn.Linear(16, 4, key=k2)
    )
    mesh = mesh_of((4,), ("model",))
    plan = {"up": eqpar.ColumnParallel(), "down": eqpar.RowParallel()}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    run = eqpar.shard_map(
        lambda m, x, k: m(x, k),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(), P()),
        out_specs=P(),
    )
    with pytest.raises(
        ValueError, match=r"ParallelDropout.*differs between the devices of axis 'model'.*fold_in"
    ):
        run(parallel, jnp.ones((3, 4)), jax.random.key(1))


def test_context_parallel_positions_and_masks_are_wrong_without_the_conversion(rotary_setup):
    """What the conversion fixes: kept as they are (`Replicated()`), the rotary embedding
    numbers every device's tokens from 0 and the dropouts repeat one mask per block."""
    model, batch, (serial_loss, _) = rotary_setup
    mesh = mesh_of((2, 4, 1), ("data", "context", "model"))
    for kept in (r"blocks/\d+/rotary", r"blocks/\d+/(dropout|mlp_dropout)"):
        plan = {r"blocks/\d+/attention": eqpar.ContextParallel(), kept: eqpar.Replicated()}
        parallel = eqpar.parallelize(model, plan, mesh=mesh)
        loss, _ = context_step(parallel, mesh, batch)
        assert abs(float(loss) - float(serial_loss)) > 1e-4 * abs(float(serial_loss)), kept
    # eqpar.check names the layer: the rotary embedding kept plain (its block of the sequence
    # rotated by local positions matches no block of the serial output).
    plan = {
        r"blocks/\d+/attention": eqpar.ContextParallel(),
        r"blocks/\d+/rotary": eqpar.Replicated(),
    }
    specs = (P("data", "context"), P("data", "context"), P("data"))
    report = eqpar.check(
        rotary_loss, model, *batch, mesh=mesh, plan=plan, batch_specs=specs, raise_on_mismatch=False
    )
    assert not report.ok and report.first_kind == "RotaryPositionalEmbedding", str(report)


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for inner in value if isinstance(value, list | tuple) else (value,):
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
                elif hasattr(inner, "jaxpr") and hasattr(inner.jaxpr, "eqns"):
                    names |= _primitives(inner.jaxpr)
    return names


@pytest.mark.parametrize("policy", ["full", "matmuls"])
def test_remat_by_plan_keeps_the_authors_forward(vit_setup, policy):
    """`Remat` on the model's list of blocks: each block's own `__call__` runs under
    `jax.checkpoint`, with the tensor-parallel styles of its layers in the same plan."""
    model, batch, (serial_loss, serial_model) = vit_setup
    mesh = mesh_of((2, 4), ("data", "model"))
    plan = {"attention_blocks": eqpar.Remat(policy), **VIT_PLAN}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    block = parallel.attention_blocks[0]
    assert isinstance(block, vit.AttentionBlock) and type(block) is not vit.AttentionBlock
    assert type(block.dropout1) is ParallelDropout  # the layers inside are converted too
    serial_blocks = eqpar.unparallelize(parallel).attention_blocks
    assert type(serial_blocks[0]) is vit.AttentionBlock
    assert type(serial_blocks[0].linear1) is eqx.nn.Linear
    loss, updated = vit_step(parallel, mesh, batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)
    jaxpr, *_ = eqx.filter_make_jaxpr(lambda m: eqx.filter_grad(vit.loss)(m, *batch))(
        eqpar.parallelize(model, {"attention_blocks": eqpar.Remat(policy)})
    )
    assert {"checkpoint", "remat2", "remat"} & _primitives(jaxpr.jaxpr)


def test_remat_refuses_what_is_not_a_block(vit_setup):
    model = vit_setup[0]
    with pytest.raises(TypeError, match=r"plan\['cls_token'\].*Remat applies to a block"):
        eqpar.parallelize(model, {"cls_token": eqpar.Remat()})
    with pytest.raises(ValueError, match=r"`remat` must be one of"):
        eqpar.Remat("everything")


class RawRotaryAttention(eqx.Module):
    """Causal attention from raw weight arrays with its own rotary code, as Llama ports
    write it; `positions` and `attend` are the two things context parallelism changes."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.wq, self.wk, self.wv, self.wo = (
            jax.random.normal(k, (DIM, DIM)) / DIM**0.5 for k in keys
        )

    @staticmethod
    def rotate(x, positions):
        half = x.shape[-1] // 2
        freqs = 1.0 / (10000.0 ** (jnp.arange(half) / half))
        angles = positions[:, None, None] * freqs
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate(
            [
                x1 * jnp.cos(angles) - x2 * jnp.sin(angles),
                x1 * jnp.sin(angles) + x2 * jnp.cos(angles),
            ],
            axis=-1,
        )

    def __call__(self, x, positions, attend):
        heads = lambda w: (x @ w).reshape(x.shape[0], HEADS, DIM // HEADS)
        q = self.rotate(heads(self.wq), positions)
        k = self.rotate(heads(self.wk), positions)
        return attend(q, k, heads(self.wv)).reshape(x.shape[0], DIM) @ self.wo


def test_ring_attention_with_a_models_own_rotary_code_takes_global_positions():
    """The documented recipe: positions from `sequence_positions`, attention by
    `ring_attention`; the weights, the rotary code and the loss are the author's."""
    from eqpar.context import ring_attention, sequence_positions

    model = RawRotaryAttention(jax.random.key(8))
    x = jax.random.normal(jax.random.key(9), (2, SEQ, DIM))

    def serial_loss(model, x):
        def one(x):
            positions = jnp.arange(x.shape[0])
            attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
            return model(x, positions, attend)

        return jnp.mean(jax.vmap(one)(x) ** 2)

    def context_loss(model, x):
        def one(x):
            positions = sequence_positions(x.shape[0], axis_name="context")
            attend = lambda q, k, v: ring_attention(q, k, v, axis_name="context", causal=True)
            return model(x, positions, attend)

        return lax.pmean(jnp.mean(jax.vmap(one)(x) ** 2), "context")

    # Compiled: run op by op, the ring's loop and its backward took 20 s more.
    want = eqx.filter_jit(eqx.filter_value_and_grad(serial_loss))(model, x)
    mesh = mesh_of((4,), ("context",))
    run = eqpar.shard_map(
        context_loss, mesh=mesh, in_specs=(P(), P(None, "context")), out_specs=P()
    )
    got = eqx.filter_jit(eqx.filter_value_and_grad(run))(model, x)
    assert_tree_close(got, want, what="loss and gradients")


def test_split_sequence_by_plan_under_context_parallelism(rotary_setup):
    """`SplitSequence` on the list of blocks: the model takes whole sequences (no in_specs
    split over `context`), the blocks run on this device's block of each, and the output
    comes back whole, so the loss needs no average over `context`."""
    model, batch, (serial_loss, serial_model) = rotary_setup
    mesh = mesh_of((2, 4), ("data", "context"))
    plan = {
        "blocks": eqpar.SplitSequence("context"),
        r"blocks/\d+/attention": eqpar.ContextParallel(),
    }
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    assert isinstance(parallel.blocks[0], RotaryBlock)
    assert type(eqpar.unparallelize(parallel).blocks[0]) is RotaryBlock
    loss, updated = sharded_step(rotary_loss, parallel, mesh, (P("data"),) * 3, *batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


def test_split_sequence_refuses_a_length_the_axis_does_not_divide(vit_setup):
    """The ViT's 2 x 2 patches and class token make 5 tokens: refused, with the fix."""
    model, batch, _ = vit_setup
    mesh = mesh_of((1, 4), ("data", "model"))
    parallel = eqpar.parallelize(
        model, {"attention_blocks": eqpar.SplitSequence("model")}, mesh=mesh
    )
    with pytest.raises(ValueError, match=r"scatter_sequence.*divides.*Pad the sequence"):
        vit_step(parallel, mesh, batch)


def test_split_sequence_and_a_balanced_context_layout_are_refused():
    model = RotaryEncoder(key=jax.random.key(3))
    plan = {
        "blocks": eqpar.SplitSequence("context"),
        r"blocks/\d+/attention": eqpar.ContextParallel(layout="balanced", causal=True),
    }
    with pytest.raises(ValueError, match=r"contiguous blocks.*balance_sequence"):
        eqpar.parallelize(model, plan)


class IndexedLayer(eqx.Module):
    """A layer that knows its place, as a static field (as ported Llamas often do), and
    uses it to pick its randomness."""

    weight: jax.Array
    layer_index: int = eqx.field(static=True)

    def __init__(self, layer_index: int, key: PRNGKeyArray):
        self.weight = jax.random.normal(key, (DIM, DIM)) / DIM**0.5
        self.layer_index = layer_index

    def __call__(self, x: Array, key: PRNGKeyArray) -> Array:
        noise = jax.random.normal(jax.random.fold_in(key, self.layer_index), x.shape[-1:])
        return jnp.tanh(x @ self.weight) + 0.1 * noise


def test_layers_that_differ_in_integer_static_fields_stack_scan_and_pipeline():
    from eqpar.nn import PipelineModule, ScannedLayers, stack_layers, unstack_layers

    layers = [IndexedLayer(i, k) for i, k in enumerate(jax.random.split(jax.random.key(0), 4))]
    x, key = jax.random.normal(jax.random.key(1), (8, DIM)), jax.random.key(2)
    want = x
    for layer in layers:
        want = layer(want, key)

    stacked = stack_layers(layers)
    assert isinstance(stacked, IndexedLayer) and stacked.layer_index.tolist() == [0, 1, 2, 3]
    back = unstack_layers(stacked)
    assert type(back[3]) is IndexedLayer and back[3].layer_index == 3
    assert eqx.tree_equal(back, layers)
    assert_tree_close(ScannedLayers(stacked)(x, key), want, what="scanned")

    mesh = mesh_of((4,), ("pipe",))
    body = PipelineModule.from_layers(
        stacked, num_stages=4, num_microbatches=2, broadcast_output=True
    )
    run = eqpar.shard_map(
        lambda m, x, k: m(x, k),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(body), P(), P()),
        out_specs=P(),
    )
    assert_tree_close(run(body, x, key), want, what="pipelined")


def test_layers_that_differ_in_a_float_static_field_are_still_refused():
    class Scaled(eqx.Module):
        weight: jax.Array
        scale: float = eqx.field(static=True)

    layers = [Scaled(jnp.ones(2), 1.0), Scaled(jnp.ones(2), 2.0)]
    with pytest.raises(ValueError, match=r"layers\[1\].*at `scale`.*integer or boolean static"):
        eqpar.nn.stack_layers(layers)


def test_vit_under_a_bfloat16_policy_equals_the_serial_bfloat16_step(vit_setup):
    """Tensor x data parallel with dropout, under `Precision.bfloat16()`, against the serial
    step under the same policy. Each device rounds its partial sums to bfloat16 (2**-9 of
    each) before the reduction over `model`, so the tolerance is bfloat16's, relative to each
    gradient's norm (as in test_precision.py)."""
    import numpy as np

    model, (images, labels, keys), _ = vit_setup
    policy = eqpar.Precision.bfloat16()

    def with_policy(loss_fn):
        def f(model, images, labels, keys):
            model, images = policy.cast_to_compute((model, images))
            return policy.cast_to_output(loss_fn(model, images, labels, keys))

        return eqx.filter_jit(eqx.filter_value_and_grad(f))

    want_loss, want_grads = with_policy(vit.loss)(model, images, labels, keys)
    mesh = mesh_of((2, 4), ("data", "model"))
    parallel = eqpar.parallelize(model, VIT_PLAN, mesh=mesh)
    sharded = eqpar.shard_map(
        lambda m, *b: lax.pmean(vit.loss(m, *b), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data"), P("data"), P("data")),
        out_specs=P(),
    )
    got_loss, got_grads = with_policy(sharded)(parallel, images, labels, keys)
    # The author's loss runs in bfloat16 too: its value may differ by a rounding or two of
    # its last step, 2**-7 of itself each.
    assert_tree_close(got_loss, want_loss, rtol=2 * 2**-7, what="loss")
    got = jax.tree.leaves(eqx.filter(eqpar.unparallelize(got_grads), eqx.is_inexact_array))
    want = jax.tree.leaves(eqx.filter(want_grads, eqx.is_inexact_array))
    errors = [
        float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(w))
        for g, w in zip(got, want, strict=True)
    ]
    assert max(errors) < 3e-2, errors  # measured: at most 8.7e-3


# --- a Llama-style model with raw weight arrays -----------------------------------------


@pytest.fixture(scope="module")
def llama_setup():
    import llama_style as llama

    model = llama.Llama(key=jax.random.key(0))
    tokens = llama.batch(8)
    return llama, model, tokens, serial_step(llama.loss, model, tokens)


@pytest.mark.parametrize("mode", ["dp", "fsdp", "remat"])
def test_llama_with_raw_arrays_under_dp_fsdp_and_remat_by_plan(llama_setup, mode):
    """Data parallelism and FSDP place the arrays (the step is the serial one, partitioned
    by `jax.jit`); remat is one plan entry on the list of layers, whose raw arrays need no
    layer conversion."""
    llama, model, tokens, (serial_loss, serial_model) = llama_setup
    mesh = mesh_of((8,), ("data",))
    if mode == "remat":
        model = eqpar.parallelize(model, {"layers": eqpar.Remat("full")})
        assert isinstance(model.layers[1], llama.LlamaLayer) and model.layers[1].layer_index == 1
        loss, updated = sharded_step(llama.loss, model, mesh, (P("data"),), tokens)
    else:
        distribution = (
            eqpar.DataParallel(mesh) if mode == "dp" else eqpar.FSDP(mesh, min_size_bytes=0)
        )
        placed = distribution.distribute_model(model)
        loss, updated = serial_step(llama.loss, placed, distribution.distribute_input(tokens))
        if mode == "fsdp":
            assert updated.layers[0].w_up.sharding.spec != P()  # stored split over data
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)


# --- cases a review found -----------------------------------------------------------------


def test_balanced_context_layout_with_rotary_and_dropout(rotary_setup):
    """With `layout="balanced"` each device holds two chunks of the sequence: the rotary
    positions and the dropout rows are those chunks' (the loss, a mean over every token,
    does not see the order)."""
    from eqpar.context import balance_sequence

    model, (x, targets, keys), (serial_loss, serial_model) = rotary_setup
    mesh = mesh_of((2, 4), ("data", "context"))
    plan = {r"blocks/\d+/attention": eqpar.ContextParallel(layout="balanced")}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    balanced = (balance_sequence(x, 4, axis=1), balance_sequence(targets, 4, axis=1), keys)
    loss, updated = context_step(parallel, mesh, balanced)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(updated, serial_model)


class GroupedQueryMLP(eqx.Module):
    """Two column-parallel projections of different widths (as the queries and the fewer
    keys of grouped-query attention) closed by one row-parallel layer, then a dropout on
    the whole output: the record must hold no split after the row layer."""

    wide: eqx.nn.Linear
    narrow: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x, key):
        wide = jax.vmap(self.wide)(x)
        narrow = jax.vmap(self.narrow)(x)  # opens a second, narrower split
        hidden = wide + 0.0 * jnp.sum(narrow)
        return self.dropout(jax.vmap(self.down)(hidden), key=key)


def test_every_feature_split_closes_at_the_row_layer_and_tuple_axes_work():
    keys = jax.random.split(jax.random.key(0), 3)
    model = GroupedQueryMLP(
        eqx.nn.Linear(8, 16, key=keys[0]),
        eqx.nn.Linear(8, 8, key=keys[1]),
        eqx.nn.Linear(16, 8, key=keys[2]),
        eqx.nn.Dropout(0.5),
    )
    x, key = jax.random.normal(jax.random.key(1), (4, 8)), jax.random.key(2)
    want = eqx.filter_jit(model)(x, key)  # compiled: op by op cost seconds
    for axis, mesh in [
        ("model", mesh_of((2,), ("model",))),
        (("a", "b"), mesh_of((2, 2), ("a", "b"))),
    ]:
        plan = {
            "wide": eqpar.ColumnParallel(axis_name=axis),
            "narrow": eqpar.ColumnParallel(axis_name=axis),
            "down": eqpar.RowParallel(axis_name=axis),
        }
        parallel = eqpar.parallelize(model, plan, mesh=mesh)
        run = eqpar.shard_map(
            lambda m, x, k: m(x, k),
            mesh=mesh,
            in_specs=(eqpar.partition_specs(parallel), P(), P()),
            out_specs=P(),
        )
        assert_tree_close(eqx.filter_jit(run)(parallel, x, key), want, what=f"axis {axis}")


def test_remat_and_split_sequence_in_one_plan_and_pickling():
    import pickle

    model = RotaryEncoder(key=jax.random.key(3))
    plan = {
        "blocks": eqpar.SplitSequence("context"),
        r"blocks/\d+": eqpar.Remat("full"),
        r"blocks/\d+/attention": eqpar.ContextParallel(),
    }
    parallel = eqpar.parallelize(model, plan)
    assert all(isinstance(b, RotaryBlock) and type(b) is not RotaryBlock for b in parallel.blocks)
    again = pickle.loads(pickle.dumps(parallel))
    assert type(again.blocks[0]) is type(parallel.blocks[0])
    assert eqx.tree_equal(eqpar.unparallelize(again), model)
    stacked = eqpar.nn.stack_layers(
        [IndexedLayer(i, k) for i, k in enumerate(jax.random.split(jax.random.key(0), 2))]
    )
    assert eqx.tree_equal(pickle.loads(pickle.dumps(stacked)), stacked)


# The Llama's raw weights split as tensor parallelism splits them: the projections into the
# heads and the MLP by columns, the projections out by rows.
LLAMA_TENSOR_PARALLEL = {
    r"layers/\d+/(wq|wk|wv|w_gate|w_up)": eqpar.Sharded(P(None, "model")),
    r"layers/\d+/(wo|w_down)": eqpar.Sharded(P("model", None)),
}


def test_llama_raw_arrays_by_plan_on_the_compiled_route(llama_setup):
    """`Sharded` keys lay out the raw weights (columns of the projections in, rows out, the
    tensor-parallel split); the serial step under `jax.jit` on the placed model and a batch
    split over `data` equals the serial step: the compiler inserts the collectives, through
    the author's own reshapes into heads."""
    llama, model, tokens, (serial_loss, serial_model) = llama_setup
    mesh = mesh_of((2, 4), ("data", "model"))
    parallel = eqpar.parallelize(model, LLAMA_TENSOR_PARALLEL, mesh=mesh)
    assert isinstance(parallel.layers[0], llama.LlamaLayer)
    specs = eqpar.partition_specs(parallel)
    assert specs.layers[1].wo == P("model", None) and specs.embedding == P()
    placed = eqx.filter_shard(parallel, eqpar.named_shardings(specs, mesh))
    batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh.jax_mesh, P("data")))
    loss, updated = serial_step(llama.loss, placed, batch)
    assert updated.layers[0].wq.sharding.spec == P(None, "model")
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)
    assert type(eqpar.unparallelize(updated).layers[0]) is llama.LlamaLayer


def test_sharded_errors_name_the_key_and_the_fix(llama_setup):
    _, model, _, _ = llama_setup
    mesh = mesh_of((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"plan\['layers/0/wq'\].*leaf 'layers/0/wq'"):
        eqpar.parallelize(model, {"layers/0/wq": eqpar.Sharded(P("nope"))}, mesh=mesh)
    with pytest.raises(TypeError, match="spec"):  # beartype's check in the test suite, else ours
        eqpar.Sharded(("model",))


def test_llama_raw_arrays_fsdp_x_tp_on_the_compiled_route(llama_setup):
    """FSDP over `data` on top of the `Sharded` tensor-parallel layout: each weight keeps
    its split over `model` and gains one over `data`; the step is still the serial one."""
    llama, model, tokens, (serial_loss, serial_model) = llama_setup
    mesh = mesh_of((2, 4), ("data", "model"))
    parallel = eqpar.parallelize(model, LLAMA_TENSOR_PARALLEL, mesh=mesh)
    fsdp = eqpar.FSDP(mesh, axis="data", min_size_bytes=0)
    storage = fsdp.partition_specs(parallel)
    assert storage.layers[0].w_up == P("data", "model")
    placed = eqx.filter_shard(parallel, eqpar.named_shardings(storage, mesh))
    loss, updated = serial_step(llama.loss, placed, fsdp.distribute_input(tokens))
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)


class PerHeadDropout(eqx.Module):
    """A dropout on the queries inside `process_heads` ([seq, heads, size] per example)."""

    attention: eqx.nn.MultiheadAttention
    dropout: eqx.nn.Dropout

    def __call__(self, x, key):
        def process_heads(q, k, v):
            return self.dropout(q, key=key), k, v

        return self.attention(x, x, x, process_heads=process_heads)


def test_context_parallel_dropout_on_per_head_queries_and_per_token_refusal():
    model = PerHeadDropout(
        eqx.nn.MultiheadAttention(HEADS, DIM, key=jax.random.key(0)), eqx.nn.Dropout(0.5)
    )
    x, key = jax.random.normal(jax.random.key(1), (SEQ, DIM)), jax.random.key(2)
    mesh = mesh_of((4,), ("context",))
    parallel = eqpar.parallelize(model, {"attention": eqpar.ContextParallel()}, mesh=mesh)
    run = eqpar.shard_map(
        lambda m, x, k: m(x, k),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("context"), P()),
        out_specs=P("context"),
    )
    # Compiled (op by op, the ring and the serial twin took 6 s more).
    got = eqx.filter_jit(run)(parallel, x, key)
    assert_tree_close(got, eqx.filter_jit(model)(x, key), what="per-head queries")

    per_token = eqpar.shard_map(
        lambda m, x, k: jax.vmap(lambda t, kk: m.dropout(t, key=kk))(
            x, jax.random.split(k, x.shape[0])
        ),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("context"), P()),
        out_specs=P("context"),
    )
    with pytest.raises(ValueError, match=r"not one token at a time under jax.vmap"):
        eqx.filter_eval_shape(per_token, parallel, x, key)  # refused while tracing


def test_sharded_keeps_what_the_author_declares_merges_calls_and_refuses_conflicts():
    mesh = mesh_of((2, 4), ("data", "model"))

    class Declares(eqx.Module):
        a: jax.Array
        b: jax.Array

        def __partition_specs__(self):
            return {"a": P("model", None)}

    module = Declares(jnp.ones((8, 8)), jnp.ones((8, 8)))
    parallel = eqpar.parallelize(module, {"b": eqpar.Sharded(P(None, "model"))}, mesh=mesh)
    specs = eqpar.partition_specs(parallel)
    assert (specs.a, specs.b) == (P("model", None), P(None, "model"))

    layer = eqx.nn.Linear(8, 16, key=jax.random.key(0))
    once = eqpar.parallelize({"up": layer}, {"up/weight": eqpar.Sharded(P("model"))}, mesh=mesh)
    twice = eqpar.parallelize(once, {"up/bias": eqpar.Sharded(P("model"))}, mesh=mesh)
    specs = eqpar.partition_specs(twice)["up"]
    assert (specs.weight, specs.bias) == (P("model"), P("model"))
    with pytest.raises(ValueError, match=r"plan\['up'\].*Sharded keys lay out"):
        eqpar.parallelize(twice, {"up": eqpar.ColumnParallel()}, mesh=mesh)


def test_a_varying_static_field_declared_before_other_fields_stacks():
    class IndexFirst(eqx.Module):
        index: int = eqx.field(static=True)
        weight: jax.Array

    stacked = eqpar.nn.stack_layers([IndexFirst(0, jnp.ones(2)), IndexFirst(1, jnp.ones(2))])
    assert stacked.index.tolist() == [0, 1]
    assert [layer.index for layer in eqpar.nn.unstack_layers(stacked)] == [0, 1]
