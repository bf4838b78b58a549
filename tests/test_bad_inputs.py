"""Primitives refuse inconsistent input with a message that names it and the fix.

Where the runtime type checker (jaxtyping + beartype, active in this suite) would refuse an
argument first, the test calls the function without it (`inspect.unwrap`), as a user who runs
eqpar without the checker does: the function's own message is what that user sees.
"""

import inspect
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqpar
from eqpar import collectives, ragged
from eqpar.mesh import as_jax_mesh
from eqpar.nn import TPDense


def mesh_of(n: int) -> eqpar.DeviceMesh:
    return eqpar.DeviceMesh((n,), ("model",), devices=jax.devices()[:n])


@pytest.mark.parametrize(
    "scatter",
    [collectives.async_scatter, collectives.async_scatter_split,
     collectives.async_scatter_bidirectional],
)  # fmt: skip
def test_scatter_refuses_chunks_of_different_shapes_or_dtypes(scatter):
    mesh = mesh_of(4)

    def run(chunks):
        return eqpar.shard_map(
            lambda x: scatter(chunks(x), "model"), mesh=mesh, in_specs=P(), out_specs=P("model")
        )(jnp.ones((4, 4)))

    with pytest.raises(ValueError, match=r"chunk 3 has shape \(1, 4\).*chunk 0 has \(2, 4\)"):
        run(lambda x: [x[:2], x[:2], x[:2], x[:1]])  # would broadcast into a wrong sum
    with pytest.raises(ValueError, match=r"chunk 1 .*dtype int32.*float32"):
        run(lambda x: [x, x.astype(jnp.int32), x, x])
    with pytest.raises(ValueError, match=r"chunk 2 at leaf 'b' has shape"):
        run(lambda x: [{"a": x, "b": x}] * 2 + [{"a": x, "b": x[:1]}, {"a": x, "b": x}])
    assert run(lambda x: [x[:1]] * 4).shape == (4, 4)  # equal chunks still work


def test_layout_map_key_that_matches_nothing_warns_with_the_closest_paths():
    mesh = mesh_of(4)
    mlp = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    layout_map = eqpar.LayoutMap(mesh)
    layout_map["layers/0/weights"] = ("model", None)  # typo: weight
    with pytest.warns(
        UserWarning, match=r"'layers/0/weights' \(closest paths: \['layers/0/weight'"
    ):
        specs = eqpar.partition_specs(mlp, layout_map)
    assert specs.layers[0].weight == P()
    layout_map = eqpar.LayoutMap(mesh)
    layout_map["layers/0/weight"] = ("model", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key used: no warning
        eqpar.partition_specs(mlp, layout_map)


def test_leaf_paths_that_collide_once_joined_are_refused():
    tree = {"a/b": jnp.ones(4), "a": {"b": jnp.ones(4)}}
    with pytest.raises(ValueError, match=r"two leaves have the path 'a/b'.*Rename the dict key"):
        eqpar.partition_specs(tree)


def test_kernel_init_with_a_non_float_dtype_is_refused():
    def integer_init(key, shape, dtype):
        return jnp.zeros(shape, jnp.int32)

    with pytest.raises(ValueError, match=r"kernel_init returned dtype int32.*floating point"):
        TPDense(8, 8, tp_mode="gather", kernel_init=integer_init, key=jax.random.key(0))


def test_device_mesh_shape_must_be_a_tuple():
    mesh = object.__new__(eqpar.DeviceMesh)
    with pytest.raises(TypeError, match=r"shape must be a tuple.*Write \(8,\)"):
        inspect.unwrap(eqpar.DeviceMesh.__init__)(mesh, 8, ("model",))
    with pytest.raises(TypeError):  # the checker in this suite refuses it first
        eqpar.DeviceMesh(8, ("model",))  # type: ignore[arg-type]


def test_specs_longer_than_the_rank_are_refused_everywhere_in_one_voice():
    mesh = mesh_of(4)
    too_long = P(None, "model")
    message = r"2 entries but only 1 dimensions"
    with pytest.raises(ValueError, match=r"shard_map: in_specs for argument 0 .*" + message):
        eqpar.shard_map(lambda x: x, mesh=mesh, in_specs=too_long, out_specs=P())(jnp.ones(8))
    with pytest.raises(ValueError, match=r"leaf 'b'.*" + message):
        eqpar.shard_map(lambda t: t, mesh=mesh, in_specs=({"b": too_long},), out_specs=P())(
            {"b": jnp.ones(8)}
        )

    class Declares(eqx.Module):
        b: jax.Array

        def __partition_specs__(self):
            return {"b": too_long}

    with pytest.raises(ValueError, match=r"__partition_specs__ gives .* leaf 'b'.*" + message):
        eqpar.partition_specs(Declares(jnp.ones(8)))
    sharding = jax.sharding.NamedSharding(as_jax_mesh(mesh), too_long)
    with pytest.raises(ValueError, match="entries"):
        eqpar.placement.with_sharding_constraint(jnp.ones(8), sharding)


def test_split_batch_refuses_a_python_list():
    unchecked = inspect.unwrap(ragged.split_batch)
    with pytest.raises(TypeError, match=r"`input` must be a jax.Array or numpy.*np.asarray"):
        unchecked(jax.devices()[:2], [1, 2, 3, 4], [0, 2, 4], [0, 1, 2])
    pieces, _ = unchecked(jax.devices()[:2], np.arange(4), [0, 2, 4], [0, 1, 2])
    assert [p.tolist() for p in pieces] == [[0, 1], [2, 3]]


def test_attention_refuses_zero_length_sequences():
    mesh = mesh_of(4)
    attention = eqx.nn.MultiheadAttention(4, 8, key=jax.random.key(0))
    layer = eqpar.parallelize(attention, {"": eqpar.HeadParallel()})
    specs = eqpar.partition_specs(layer)
    for query_length, key_length in ((0, 3), (3, 0)):
        expected = rf"zero-length sequence \(query length {query_length}"
        with pytest.raises(ValueError, match=expected):
            eqpar.shard_map(
                lambda m, q, k: m(q, k, k), mesh=mesh, in_specs=(specs, P(), P()), out_specs=P()
            )(layer, jnp.ones((query_length, 8)), jnp.ones((key_length, 8)))


def test_build_model_names_a_static_field_holding_an_array():
    """A per-instance table stored as a static field (common in ported models) cannot be
    built on the devices; the error names the leaf paths and the fix, not a tracer leak."""
    from eqpar.distributions import build_model

    class Layer(eqx.Module):
        weight: jax.Array
        index: int = eqx.field(static=True)  # a static int per instance is fine
        table: jax.Array = eqx.field(static=True)

        def __init__(self, index, key):
            self.weight = jax.random.normal(key, (8, 8))
            self.index = index
            self.table = jnp.arange(4.0) * index

    def make(key):
        return [Layer(i, k) for i, k in enumerate(jax.random.split(key, 2))]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Equinox warns about arrays set as static
        with eqpar.FSDP(min_size_bytes=0).scope():
            expected = r"static fields at \['0/table', '1/table'\].*drop `static=True`"
            with pytest.raises(ValueError, match=expected):
                build_model(make, jax.random.key(0))


def test_a_tied_unembedding_after_vocab_parallel_is_named_under_filter_value_and_grad():
    """Reading the split table directly gives this device's rows only; the loss then differs
    between devices, and the error says so through `eqx.filter_value_and_grad`."""

    class TiedLM(eqx.Module):
        embed: eqx.nn.Embedding

        def __call__(self, tokens):
            return jax.vmap(self.embed)(tokens) @ self.embed.weight.T

    def loss(model, tokens):
        return jnp.mean(jax.nn.log_softmax(model(tokens))[:, 0])

    model = TiedLM(eqx.nn.Embedding(32, 8, key=jax.random.key(0)))
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    parallel = eqpar.parallelize(model, {"embed": eqpar.VocabParallel()}, mesh=mesh)
    run = eqpar.shard_map(
        loss, mesh=mesh, in_specs=(eqpar.partition_specs(parallel), P()), out_specs=P()
    )
    expected = r"the result returned by loss differs .* axis 'model'.*vocab_parallel_cross_entropy"
    with pytest.raises(ValueError, match=expected):
        eqx.filter_value_and_grad(run)(parallel, jnp.arange(4))


def test_out_specs_that_do_not_fit_the_result_name_the_mismatch():
    mesh = eqpar.DeviceMesh((2,), ("data",), devices=jax.devices()[:2])
    run = eqpar.shard_map(
        lambda x: (jnp.sum(x), jnp.sum(x)), mesh=mesh, in_specs=P(), out_specs=(P(),)
    )
    with pytest.raises(ValueError, match=r"out_specs does not fit what <lambda> returns"):
        eqx.filter_value_and_grad(lambda x: run(x)[0])(jnp.ones(4))
