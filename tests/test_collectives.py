"""Ring collectives against their definitions and against lax.all_gather / lax.psum_scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collective_ops
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

from eqpar import collectives as C

SIZES = [1, 2, 4, 8]
GATHERS = [C.async_gather, C.async_gather_bidirectional, C.async_gather_split]
SCATTERS = [C.async_scatter, C.async_scatter_split, C.async_scatter_bidirectional]


def mesh_of(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def run(fn, n, *args):
    mapped = jax.shard_map(fn, mesh=mesh_of(n), in_specs=P("x"), out_specs=P("x"), check_vma=False)
    return jax.jit(mapped)(*args)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gather", GATHERS)
@pytest.mark.parametrize("shift_up", [True, False])
def test_gather_item_sources(n, gather, shift_up):
    # each device's block is [own index, own index + 0.5]: every item names its source
    def fn(block):
        items = gather(block[0], "x", shift_up)
        assert len(items) == n
        return jnp.stack(items)[None]

    blocks = jnp.stack([jnp.arange(n, dtype=jnp.float32), jnp.arange(n) + 0.5], axis=1)
    out = np.asarray(run(fn, n, blocks[:, None, :]))  # [n, n, 1, 2]
    for d in range(n):
        for i in range(n):
            source = (d - i) % n if shift_up else (d + i) % n
            np.testing.assert_array_equal(out[d, i, 0], [source, source + 0.5])


@pytest.mark.parametrize("gather", GATHERS)
def test_gather_accepts_pytrees_and_odd_features(gather):
    n = 4

    def fn(a, b):
        items = gather({"a": a, "b": (b,)}, "x")
        return jnp.stack([t["a"] for t in items])[None], jnp.stack([t["b"][0] for t in items])[None]

    a = jnp.arange(n * 5.0).reshape(n, 5)  # odd feature size
    b = jnp.arange(n * 2 * 3.0).reshape(n, 2, 3)
    mapped = jax.shard_map(
        fn, mesh=mesh_of(n), in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))
    )
    out_a, out_b = mapped(a, b)
    for d in range(n):
        for i in range(n):
            np.testing.assert_array_equal(out_a[d, i, 0], a[(d - i) % n])
            np.testing.assert_array_equal(out_b[d, i, 0], b[(d - i) % n])


def test_split_of_scalar_leaf_is_a_clear_error():
    def fn(x):
        return jnp.stack(C.async_gather_split(x[0, 0], "x"))[None]

    with pytest.raises(ValueError, match="scalar leaf"):
        run(fn, 2, jnp.zeros((2, 1)))


def test_feature_size_one_splits_into_empty_and_full_half():
    def fn(x):
        return jnp.stack(C.async_gather_split(x, "x"))[None]

    out = run(fn, 4, jnp.arange(4.0).reshape(4, 1))
    np.testing.assert_array_equal(out[3, :, 0, 0], [3.0, 2.0, 1.0, 0.0])


def test_unknown_axis_name_is_a_clear_error():
    def fn(x):
        return jnp.stack(C.async_gather(x, "model"))[None]

    with pytest.raises(ValueError, match="async_gather: `axis_name='model'` is not a mesh axis"):
        run(fn, 2, jnp.zeros((2, 1)))


def ring_order(chunks_by_destination, d, n, shift_up=True):
    """The list to hand to async_scatter so that chunk `c` (meant for device c) lands on c."""
    if shift_up:
        return [jnp.take(chunks_by_destination, (d - 1 - k) % n, axis=0) for k in range(n)]
    return [jnp.take(chunks_by_destination, (d + 1 + k) % n, axis=0) for k in range(n)]


SCATTER_CASES = [(s, True) for s in SCATTERS] + [(C.async_scatter, False)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("scatter", "shift_up"), SCATTER_CASES)
def test_scatter_equals_psum_scatter(n, scatter, shift_up):

    def fn(block):  # [1, n, 3]: chunk c is meant for device c
        d = lax.axis_index("x")
        xs = ring_order(block[0], d, n, shift_up)
        ring = scatter(xs, "x", shift_up) if scatter is C.async_scatter else scatter(xs, "x")
        reference = lax.psum_scatter(block[0], "x", scatter_dimension=0, tiled=False)
        return jnp.stack([ring, reference])[None]

    x = jax.random.normal(jax.random.key(n), (n, n, 3))
    out = run(fn, n, x)
    assert_tree_close(out[:, 0], out[:, 1], rtol=1e-6, what="ring against psum_scatter")
    assert_tree_close(out[:, 0], x.sum(axis=0), what="ring against the sum")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_scatter_definition_by_index(n):
    # result on d = sum over j of xs[k] on j with (j - 1 - k) % n == d (shift up)
    # and (j + 1 + k) % n == d (shift down); xs[k] on j is 10 ** j * (k + 1).
    def fn(_, up):
        j = lax.axis_index("x").astype(jnp.float32)
        xs = [(10.0**j) * (k + 1) * jnp.ones((1,)) for k in range(n)]
        return C.async_scatter(xs, "x", up)[None]

    for up in (True, False):
        out = run(lambda z, up=up: fn(z, up), n, jnp.zeros((n, 1)))
        for d in range(n):
            expected = 0.0
            for j in range(n):
                for k in range(n):
                    hit = (j - 1 - k) % n == d if up else (j + 1 + k) % n == d
                    expected += hit * (10.0**j) * (k + 1)
            assert_tree_close(out[d, 0], jnp.float32(expected), rtol=1e-6)


@pytest.mark.parametrize("scatter", SCATTERS)
def test_scatter_length_mismatch(scatter):
    def fn(x):
        return scatter([x, x, x], "x")

    with pytest.raises(
        ValueError, match=r"len\(xs\) must equal the size of the mesh axis \(2\).*got 3"
    ):
        run(fn, 2, jnp.zeros((2, 1)))


@pytest.mark.parametrize("scatter", SCATTERS)
def test_scatter_accepts_pytrees(scatter):
    n = 4

    def fn(a, b):
        d = lax.axis_index("x")
        xs = [
            {"a": a_k, "b": b_k} for a_k, b_k in zip(ring_order(a[0], d, n), ring_order(b[0], d, n))
        ]
        out = scatter(xs, "x")
        return out["a"][None], out["b"][None]

    a = jax.random.normal(jax.random.key(1), (n, n, 5))
    b = jax.random.normal(jax.random.key(2), (n, n, 2, 2))
    mapped = jax.shard_map(fn, mesh=mesh_of(n), in_specs=P("x"), out_specs=P("x"))
    out_a, out_b = mapped(a, b)
    assert_tree_close((out_a, out_b), (a.sum(0), b.sum(0)))


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("gather", GATHERS)
def test_gather_gradients_equal_all_gather(n, gather):
    weights = jax.random.normal(jax.random.key(0), (n, n, 3))

    def loss(x, collective):
        def fn(block, w):
            d = lax.axis_index("x")
            if collective == "ring":
                items = jnp.stack(gather(block[0], "x"))
                full = jnp.take(items, (d - jnp.arange(n)) % n, axis=0)  # by source
            else:
                full = lax.all_gather(block[0], "x")
            return jnp.sum(jnp.sin(full) * w[0])[None]

        out = jax.shard_map(fn, mesh=mesh_of(n), in_specs=(P("x"), P("x")), out_specs=P("x"))(
            x, weights
        )
        return out.sum()

    x = jax.random.normal(jax.random.key(1), (n, 1, 3))
    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (ring, ring_grad), (ref, ref_grad) = value_and_grad(x, "ring"), value_and_grad(x, "ref")
    assert_tree_close((ring, ring_grad), (ref, ref_grad), what="(value, gradient)")


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("scatter", SCATTERS)
def test_scatter_gradients_equal_psum_scatter(n, scatter):
    weights = jax.random.normal(jax.random.key(0), (n, 3))

    def loss(x, collective):
        def fn(block, w):
            d = lax.axis_index("x")
            chunks = jnp.tanh(block[0])  # [n, 3], chunk c for device c
            if collective == "ring":
                out = scatter(ring_order(chunks, d, n), "x")
            else:
                out = lax.psum_scatter(chunks, "x", scatter_dimension=0, tiled=False)
            return jnp.sum(out * w[0] ** 2)[None]

        out = jax.shard_map(fn, mesh=mesh_of(n), in_specs=(P("x"), P("x")), out_specs=P("x"))(
            x, weights
        )
        return out.sum()

    x = jax.random.normal(jax.random.key(1), (n, n, 3))
    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (ring, ring_grad), (ref, ref_grad) = value_and_grad(x, "ring"), value_and_grad(x, "ref")
    assert_tree_close((ring, ring_grad), (ref, ref_grad), what="(value, gradient)")


# --- what the compiler is asked to move ------------------------------------------------------


def permute_sends(fn, n, x):
    """Bytes of each collective-permute in the compiled HLO, in program order."""
    mapped = jax.shard_map(fn, mesh=mesh_of(n), in_specs=P("x"), out_specs=P("x"))
    ops = collective_ops(jax.jit(mapped).lower(x).compile())
    assert {op.kind for op in ops} <= {"collective-permute"}, ops
    return [op.array_bytes for op in ops]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_hlo_one_direction_gather_sends_n_minus_1_full_blocks(n):
    block = 16 * 64 * 4  # [16, 64] float32 per device
    x = jnp.ones((n * 16, 64))
    sends = permute_sends(lambda b: jnp.stack(C.async_gather(b, "x")).sum(0), n, x)
    assert sends == [block] * (n - 1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_hlo_split_gather_sends_half_blocks_each_way(n):
    half = 16 * 32 * 4
    x = jnp.ones((n * 16, 64))
    sends = permute_sends(lambda b: jnp.stack(C.async_gather_split(b, "x")).sum(0), n, x)
    assert sorted(sends) == [half] * (2 * (n - 1))


@pytest.mark.parametrize("n", [4, 8])
def test_hlo_bidirectional_gather_same_bytes_fewer_steps(n):
    block = 16 * 64 * 4
    x = jnp.ones((n * 16, 64))
    sends = permute_sends(lambda b: jnp.stack(C.async_gather_bidirectional(b, "x")).sum(0), n, x)
    assert sends == [block] * (n - 1)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize(
    ("scatter", "expected"),
    [
        (C.async_scatter, lambda n, c: [c] * (n - 1)),
        (C.async_scatter_split, lambda n, c: [c // 2] * (2 * (n - 1))),
        (C.async_scatter_bidirectional, lambda n, c: [c] * (n - 1)),
    ],
)
def test_hlo_scatter_sends(n, scatter, expected):
    chunk = 8 * 64 * 4  # each chunk [8, 64] float32

    def fn(b):  # b: [n * 8, 64] local
        xs = [b[8 * k : 8 * (k + 1)] for k in range(n)]
        return scatter(xs, "x")

    x = jnp.ones((n * n * 8, 64))
    assert sorted(permute_sends(fn, n, x)) == expected(n, chunk)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_ring_matmuls_on_a_ring_of_one(bidirectional):
    """A ring of one device multiplies its own block once (the walk used to add it twice)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    x = jax.random.normal(jax.random.key(0), (3, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))
    for fn, w_spec in (
        (C.ring_gather_matmul, P("model")),
        (C.ring_matmul_scatter, P(None, "model")),
    ):
        f = jax.shard_map(
            lambda x, w, fn=fn: fn(x, w, "model", bidirectional=bidirectional),
            mesh=mesh,
            in_specs=(P(None, "model"), w_spec),
            out_specs=P(None, "model"),
        )
        assert_tree_close(f(x, w), x @ w.T, what=fn.__name__)
        assert_tree_close(
            jax.grad(lambda x, w, f=f: jnp.sum(f(x, w) ** 2), argnums=(0, 1))(x, w),
            jax.grad(lambda x, w: jnp.sum((x @ w.T) ** 2), argnums=(0, 1))(x, w),
            what=f"{fn.__name__} gradients",
        )
