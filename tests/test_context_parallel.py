"""Context parallelism: ring and all-gather attention against serial attention, the
`ContextParallel` plan style against `eqx.nn.MultiheadAttention`, and the compiled program's
buffers and collective bytes."""

import functools
import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import _ARRAY, collective_summary
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close

import eqpar
from eqpar.context import (
    all_gather_attention,
    balance_sequence,
    ring_attention,
    sequence_positions,
    ulysses_attention,
    unbalance_sequence,
)
from eqpar.nn.parallel_layers import ContextParallelAttention

B, S, H, D = 2, 48, 4, 8  # S divides by 2n for n = 2, 4, 8; no other size is a multiple of S
STRATEGIES = {
    "ring": ring_attention,
    "all_gather": all_gather_attention,
    "ulysses": ulysses_attention,
}
LR = 0.5


def context_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("context",))


def serial_attention(q, k, v, causal, key_mask):
    """Plain float32 softmax attention on one device, [B, S, H, D]."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    mask = jnp.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
    if causal:
        mask = mask & jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def inputs(value_size=D):
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(k1, (B, S, H, D))
    k = jax.random.normal(k2, (B, S, H, D))
    v = jax.random.normal(k3, (B, S, H, value_size))
    # Padding keys everywhere but position 0, so every query sees at least one key.
    key_mask = jax.random.bernoulli(k4, 0.7, (B, S)).at[:, 0].set(True)
    cotangent = jax.random.normal(k5, (B, S, H, value_size))
    return q, k, v, key_mask, cotangent


CASES = {
    "causal-balanced-padded": dict(causal=True, layout="balanced", padded=True),
    "causal-contiguous": dict(causal=True, layout="contiguous", padded=False),
    "padded": dict(causal=False, layout="contiguous", padded=True),
}


PAIRS = [
    (strategy, n, "causal-balanced-padded")
    for strategy in STRATEGIES
    for n in (2, 4, 8)
    if strategy != "ulysses" or H % n == 0  # Ulysses splits the H heads over the axis
]
PAIRS += [("ring", 8, "causal-contiguous"), ("ring", 4, "padded"), ("all_gather", 4, "padded")]
PAIRS += [("ulysses", 4, "causal-contiguous"), ("ulysses", 2, "padded")]


@functools.partial(jax.jit, static_argnums=5)
def serial_value_and_grads(q, k, v, key_mask, cotangent, causal):
    out, pullback = jax.vjp(lambda q, k, v: serial_attention(q, k, v, causal, key_mask), q, k, v)
    return out, pullback(cotangent)


@pytest.mark.parametrize(("strategy", "n", "case"), PAIRS)
def test_attention_matches_serial(strategy, n, case):
    """Outputs and gradients (query, key, value) equal serial attention."""
    causal, layout, padded = (CASES[case][name] for name in ("causal", "layout", "padded"))
    q, k, v, key_mask, cotangent = inputs(value_size=2 * D)
    attend = STRATEGIES[strategy]

    def order(x):
        return balance_sequence(x, n, axis=1) if layout == "balanced" else x

    def restore(x):
        return unbalance_sequence(x, n, axis=1) if layout == "balanced" else x

    sharded = jax.shard_map(
        lambda q, k, v, m: attend(
            q, k, v, axis_name="context", causal=causal, key_mask=m, layout=layout
        ),
        mesh=context_mesh(n),
        in_specs=P(None, "context"),
        out_specs=P(None, "context"),
    )

    @jax.jit
    def parallel(q, k, v, key_mask, cotangent):
        def attention(q, k, v):
            mask = None if key_mask is None else order(key_mask)
            return restore(sharded(order(q), order(k), order(v), mask))

        out, pullback = jax.vjp(attention, q, k, v)
        return out, pullback(cotangent)

    key_mask = key_mask if padded else None
    got = parallel(q, k, v, key_mask, cotangent)
    expected = serial_value_and_grads(q, k, v, key_mask, cotangent, causal)
    assert_tree_close(got, expected)


def grouped_serial_attention(q, k, v, causal, key_mask):
    """`serial_attention` with each key/value head serving `H / kv_heads` query heads."""
    group = q.shape[2] // k.shape[2]
    return serial_attention(q, jnp.repeat(k, group, 2), jnp.repeat(v, group, 2), causal, key_mask)


def check_against_serial(sharded, inputs, causal, *, n=None):
    """Outputs and gradients of `sharded(q, k, v, key_mask)` against
    `grouped_serial_attention`; with `n`, the inputs go in balanced order over n devices."""
    q, k, v, key_mask, cotangent = inputs

    def order(x):
        return x if n is None else balance_sequence(x, n, axis=1)

    def restore(x):
        return x if n is None else unbalance_sequence(x, n, axis=1)

    @jax.jit
    def parallel(q, k, v, key_mask, cotangent):
        def attention(q, k, v):
            return restore(sharded(order(q), order(k), order(v), order(key_mask)))

        out, pullback = jax.vjp(attention, q, k, v)
        return out, pullback(cotangent)

    @jax.jit
    def serial(q, k, v, key_mask, cotangent):
        def attention(q, k, v):
            return grouped_serial_attention(q, k, v, causal, key_mask)

        out, pullback = jax.vjp(attention, q, k, v)
        return out, pullback(cotangent)

    assert_tree_close(parallel(q, k, v, key_mask, cotangent), serial(q, k, v, key_mask, cotangent))


@pytest.mark.parametrize(("kv_heads", "n"), [(2, 4), (1, 4), (2, 2)])
def test_ulysses_grouped_query_attention_matches_serial(kv_heads, n):
    """Keys and values with fewer heads than the queries (4): on 4 devices 2 or 1 heads do
    not divide the axis, so each is repeated to lcm(kv_heads, 4) = 4 heads before the
    all-to-all; on 2 devices 2 heads cross as they are. Causal, balanced, padded; outputs
    and gradients."""
    q, k, v, key_mask, cotangent = inputs(value_size=2 * D)
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    sharded = jax.shard_map(
        lambda q, k, v, m: ulysses_attention(
            q, k, v, axis_name="context", causal=True, key_mask=m, layout="balanced"
        ),
        mesh=context_mesh(n),
        in_specs=P(None, "context"),
        out_specs=P(None, "context"),
    )
    check_against_serial(sharded, (q, k, v, key_mask, cotangent), True, n=n)


def test_ulysses_hybrid_runs_heads_that_do_not_divide_the_devices():
    """4 heads on 8 devices: the sequence split over ring=2 x heads=4, the all-to-all over
    the 4 and the ring over the 2. Causal and padded; outputs and gradients."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("ring", "heads"))
    q, k, v, key_mask, cotangent = inputs(value_size=2 * D)
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query attention as well
    sequence = P(None, ("ring", "heads"))
    sharded = jax.shard_map(
        lambda q, k, v, m: ulysses_attention(
            q, k, v, axis_name="heads", ring_axis_name="ring", causal=True, key_mask=m
        ),
        mesh=mesh,
        in_specs=sequence,
        out_specs=sequence,
    )
    check_against_serial(sharded, (q, k, v, key_mask, cotangent), True)


def test_ulysses_through_the_plan_refuses_heads_that_do_not_divide_naming_the_layer():
    attention = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    layer = ContextParallelAttention(attention, strategy="ulysses")
    f = eqpar.shard_map(
        lambda m, x: m(x, x, x),
        mesh=eqpar.DeviceMesh((4,), ("context",), devices=jax.devices()[:4]),
        in_specs=(P(), P("context")),
        out_specs=P("context"),
    )
    with pytest.raises(ValueError, match=r"ContextParallelAttention.*2 heads.*strategy='ring'"):
        jax.eval_shape(f, layer, jnp.zeros((8, 16)))


def test_ulysses_refuses_heads_it_cannot_split_naming_the_fix():
    q = jnp.zeros((1, 8, 4, 2))
    cases = [
        (q[:, :, :2], dict(axis_name="context"), "2 query heads do not divide over the 4"),
        (q, dict(axis_name="context", kv=q[:, :, :3]), "divides query's 4"),
        (q, dict(axis_name="context", ring_axis_name="ring", layout="balanced"), "contiguous"),
        (q, dict(axis_name="context", ring_axis_name="context"), "shares a mesh axis"),
        (q, dict(axis_name="context", kv=q[:, :, :0]), "divides query's 4"),
    ]
    for query, options, message in cases:
        kv = options.pop("kv", query)
        f = jax.shard_map(
            functools.partial(
                lambda q, kv, options: inspect.unwrap(ulysses_attention)(q, kv, kv, **options),
                options=options,
            ),
            mesh=context_mesh(4),
            in_specs=P(None, "context"),
            out_specs=P(None, "context"),
        )
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(f, query, kv)


def test_balance_sequence_round_trip_and_positions():
    n = 4
    x = jnp.arange(S)
    balanced = balance_sequence(x, n)
    assert (unbalance_sequence(balanced, n) == x).all()
    blocks = balanced.reshape(n, -1)
    chunk = S // (2 * n)
    for i in range(n):  # device i holds chunks i and 2n-1-i
        first, second = i * chunk, (2 * n - 1 - i) * chunk
        assert blocks[i].tolist() == [*range(first, first + chunk), *range(second, second + chunk)]
    for layout, expected in (("balanced", balanced), ("contiguous", x)):
        positions = jax.shard_map(
            functools.partial(
                lambda _, layout: sequence_positions(S // n, axis_name="context", layout=layout),
                layout=layout,
            ),
            mesh=context_mesh(n),
            in_specs=P("context"),
            out_specs=P("context"),
        )(jnp.zeros(S))
        assert (positions == expected).all()


# ----------------------------------------------------------------------------------------
# The plan style on a model written the way Equinox's docs write one.


class Block(eqx.Module):
    """A pre-norm transformer block, per example: [seq, dim] in and out."""

    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp: eqx.nn.Linear

    def __init__(self, dim, heads, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.mlp = eqx.nn.Linear(dim, dim, key=k2)

    def __call__(self, x, mask=None):
        h = jax.vmap(self.norm)(x)
        x = x + self.attention(h, h, h, mask)
        return x + jax.vmap(jax.nn.gelu)(jax.vmap(self.mlp)(x))


DIM, HEADS = 16, 4


def per_example_loss(model, x, mask):
    return jnp.sum(jax.vmap(model)(x, mask) ** 2)


def serial_step(model, x, key_mask, causal):
    pair = jnp.broadcast_to(key_mask[:, None, :], (x.shape[0], S, S))
    if causal:
        pair = pair & jnp.tril(jnp.ones((S, S), bool))
    loss, grads = eqx.filter_value_and_grad(per_example_loss)(model, x, pair)
    return loss / x.shape[0], grads


def parallel_step(model, mesh, x, key_mask, batch_axis=None):
    specs = eqpar.partition_specs(model)

    def local_loss(model, x, mask):
        loss = per_example_loss(model, x, mask)
        return lax.psum(loss, ("context",) if batch_axis is None else ("context", batch_axis))

    loss_fn = eqpar.shard_map(
        local_loss,
        mesh=mesh,
        in_specs=(specs, P(batch_axis, "context"), P(batch_axis, "context")),
        out_specs=P(),
    )
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, key_mask)
    return loss / x.shape[0], grads


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def block_inputs():
    model = Block(DIM, HEADS, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (4, S, DIM))
    key_mask = jax.random.bernoulli(jax.random.key(3), 0.8, (4, S)).at[:, 0].set(True)
    return model, x, key_mask


@pytest.mark.parametrize(
    ("mesh_shape", "style"),
    [
        ({"context": 4}, eqpar.ContextParallel(causal=True, layout="balanced")),
        ({"data": 2, "context": 4}, eqpar.ContextParallel(causal=True)),
        ({"data": 2, "context": 4}, eqpar.ContextParallel(strategy="all_gather")),
        ({"context": 4, "model": 2}, eqpar.ContextParallel(causal=True, head_axis_name="model")),
        ({"data": 2, "context": 4}, eqpar.ContextParallel(causal=True, strategy="ulysses")),
        (
            {"context": 2, "model": 2},
            eqpar.ContextParallel(
                causal=True, layout="balanced", strategy="ulysses", head_axis_name="model"
            ),
        ),
    ],
    ids=[
        "context4-balanced",
        "data2-context4-ring",
        "data2-context4-gather",
        "context4-model2",
        "data2-context4-ulysses",
        "context2-model2-ulysses-balanced",
    ],
)
def test_plan_matches_multihead_attention(mesh_shape, style):
    """A block with eqx.nn.MultiheadAttention, converted by ContextParallel: loss, gradients
    and an SGD step equal the serial block's (the serial mask is causal & padding)."""
    model, x, key_mask = block_inputs()
    mesh = eqpar.DeviceMesh(
        tuple(mesh_shape.values()),
        tuple(mesh_shape),
        devices=jax.devices()[: math.prod(mesh_shape.values())],
    )
    parallel = eqpar.parallelize(model, {"attention": style}, mesh=mesh)
    assert isinstance(parallel.attention, ContextParallelAttention)
    assert isinstance(parallel.attention, eqx.nn.MultiheadAttention)

    n = mesh_shape["context"]
    balanced = style.layout == "balanced"
    x_in = balance_sequence(x, n, axis=1) if balanced else x
    mask_in = balance_sequence(key_mask, n, axis=1) if balanced else key_mask
    batch_axis = "data" if "data" in mesh_shape else None
    loss, grads = parallel_step(parallel, mesh, x_in, mask_in, batch_axis)
    serial_loss, serial_grads = serial_step(model, x, key_mask, style.causal)
    assert_tree_close(float(loss), float(serial_loss), what="loss")
    assert_tree_close(eqpar.unparallelize(grads), serial_grads, what="grads")
    updated = eqpar.unparallelize(sgd(parallel, grads))
    # The update cancels large terms for a few weights: compared relative to each parameter's
    # scale, not elementwise (see numerics.py).
    assert_arrays_close(updated, sgd(model, serial_grads), what="SGD step")
    assert eqx.tree_equal(eqpar.unparallelize(parallel), model)


def test_plan_refuses_what_it_cannot_split():
    mesh = eqpar.DeviceMesh((4,), ("context",), devices=jax.devices()[:4])
    model, x, _ = block_inputs()
    parallel = eqpar.parallelize(model, {"attention": eqpar.ContextParallel(causal=True)})
    square = jnp.ones((4, S, S), bool)
    forward = eqpar.shard_map(
        lambda m, x, mask: jax.vmap(m)(x, mask),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(None, "context"), P(None, "context")),
        out_specs=P(None, "context"),
    )
    with pytest.raises(ValueError, match="per-key padding mask"):
        forward(parallel, x, square)
    dropout = eqx.nn.MultiheadAttention(HEADS, DIM, dropout_p=0.1, key=jax.random.key(0))
    layer = ContextParallelAttention(dropout)
    with pytest.raises(ValueError, match="dropout"):
        eqpar.shard_map(
            lambda m, x: m(x, x, x, key=jax.random.key(1)),
            mesh=mesh,
            in_specs=(P(), P("context")),
            out_specs=P("context"),
        )(layer, x[0])
    with pytest.raises(ValueError, match="layout"):
        eqpar.ContextParallel(layout="zigzag")
    with pytest.raises(ValueError, match="strategy"):
        eqpar.ContextParallel(strategy="tree")
    with pytest.raises(ValueError, match="2 \\* num_devices"):
        balance_sequence(jnp.arange(10), 4)


# ----------------------------------------------------------------------------------------
# The compiled program.


def compiled_training(attend, n, layout="balanced"):
    """Forward and backward of `attend` at n devices, compiled; [B, S, H, 2D] inputs."""
    shape = jax.ShapeDtypeStruct((B, S, H, 2 * D), jnp.float32)
    sharded = jax.shard_map(
        lambda q, k, v, c: jnp.sum(
            attend(q, k, v, axis_name="context", causal=True, layout=layout) * c
        )[None],
        mesh=context_mesh(n),
        in_specs=P(None, "context"),
        out_specs=P("context"),
    )
    grad = jax.jit(jax.grad(lambda q, k, v, c: sharded(q, k, v, c).sum(), argnums=(0, 1, 2)))
    return grad.lower(shape, shape, shape, shape).compile()


def buffer_shapes(text):
    return [tuple(int(d) for d in match["dims"].split(",") if d) for match in _ARRAY.finditer(text)]


@pytest.mark.parametrize("n", [4, 8])
def test_ring_program_holds_no_whole_sequence(n):
    """No [seq, seq] scores and no full-length key/value anywhere in the compiled ring
    program (forward and backward); the all-gather program, as a control, has them."""
    full_kv = B * S * H * 2 * D

    def whole_sequence(shapes):
        return [s for s in shapes if S in s or math.prod(s) >= full_kv]

    ring = compiled_training(ring_attention, n)
    assert whole_sequence(buffer_shapes(ring.as_text())) == []
    gather = compiled_training(all_gather_attention, n)
    assert whole_sequence(buffer_shapes(gather.as_text()))

    # Bytes each device receives: the key/value blocks travel n - 1 steps forward and again
    # backward, and their float32 gradients one full turn (n steps).
    block = B * (S // n) * H * 2 * D * 4
    summary = collective_summary(ring)
    assert set(summary.counts) == {"collective-permute"}
    assert summary.bytes["collective-permute"] == (n - 1) * 2 * block * 2 + n * 2 * block


@pytest.mark.parametrize("n", [2, 4])
def test_ulysses_moves_the_formula_bytes_by_all_to_all_only(n):
    """Per device: forward, the queries, keys, values and output each cross once, `(n - 1)
    / n` of `B (S / n) H 2D` floats received; backward, their four gradients likewise."""
    shape = jax.ShapeDtypeStruct((B, S, H, 2 * D), jnp.float32)
    sharded = jax.shard_map(
        lambda q, k, v, c: jnp.sum(
            ulysses_attention(q, k, v, axis_name="context", causal=True) * c
        )[None],
        mesh=context_mesh(n),
        in_specs=P(None, "context"),
        out_specs=P("context"),
    )
    # The loss too, as a training step returns it: without it the forward output's
    # all-to-all is dead code (its gradient does not need it).
    step = jax.value_and_grad(lambda q, k, v, c: sharded(q, k, v, c).sum(), argnums=(0, 1, 2))
    summary = collective_summary(jax.jit(step).lower(shape, shape, shape, shape).compile())
    block = B * (S // n) * H * 2 * D * 4
    # Besides the all-to-alls, only the loss's sum over the devices (one float each).
    assert set(summary.counts) == {"all-to-all", "all-reduce"}
    assert summary.bytes["all-reduce"] <= 16
    assert summary.bytes["all-to-all"] == pytest.approx(8 * (n - 1) / n * block, rel=0.01)


def test_every_attention_refuses_a_non_bool_mask():
    """An additive float mask (0 = attend, -inf = hide) read by `where(mask, ...)` is
    inverted: ring, all-gather, context- and head-parallel attention all refuse it, naming
    the argument, the dtype and the conversion (the runtime type check the tests add is
    bypassed with `inspect.unwrap`, as a user without one calls them)."""
    mesh = context_mesh(2)
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    additive = jnp.zeros((1, 8)).at[:, 5:].set(-jnp.inf)
    for name, attend in STRATEGIES.items():
        f = jax.shard_map(
            functools.partial(
                lambda attend, q, m: attend(q, q, q, axis_name="context", key_mask=m),
                inspect.unwrap(attend),
            ),
            mesh=mesh,
            in_specs=P(None, "context"),
            out_specs=P(None, "context"),
        )
        # Traced, not run: the check is at trace time (run op by op, the four took 8 s).
        with pytest.raises(TypeError, match=r"`key_mask` must be a bool mask.*float32.*== 0"):
            jax.eval_shape(f, q, additive)
        assert jax.eval_shape(f, q, additive == 0).shape == q.shape, name

    attention = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (8, 8))
    context = ContextParallelAttention(attention)
    call = inspect.unwrap(type(context).__call__)
    with pytest.raises(TypeError, match=r"ContextParallelAttention: `mask` must be a bool.*int32"):
        eqx.filter_eval_shape(
            jax.shard_map(
                lambda m, x, mask: call(m, x, x, x, mask),
                mesh=mesh,
                in_specs=(P(), P("context"), P("context")),
                out_specs=P("context"),
            ),
            context, x, jnp.ones(8, jnp.int32),
        )  # fmt: skip
    heads = eqpar.parallelize(attention, {"": eqpar.HeadParallel("context")})
    call = inspect.unwrap(type(heads).__call__)
    with pytest.raises(TypeError, match=r"HeadParallelAttention: `mask` must be a bool.*float32"):
        eqx.filter_eval_shape(
            eqpar.shard_map(
                lambda m, x, mask: call(m, x, x, x, mask),
                mesh=mesh,
                in_specs=(eqpar.partition_specs(heads), P(), P()),
                out_specs=P(),
            ),
            heads, x, jnp.zeros((8, 8)),
        )  # fmt: skip
