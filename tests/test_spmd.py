import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

from eqpar.layout import partition_specs
from eqpar.mesh import DeviceMesh
from eqpar.spmd import build_sharded, gather_stored, shard_map


@pytest.fixture(scope="module")
def mesh():
    return DeviceMesh((8,), ("data",))


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(4, 3, 8, 2, activation=jax.nn.gelu, key=jax.random.key(0))


def batch(n=16):
    x = jnp.sin(jnp.arange(n * 4, dtype=jnp.float32)).reshape(n, 4)
    y = jnp.cos(jnp.arange(n * 3, dtype=jnp.float32)).reshape(n, 3)
    return x, y


def loss_sum(model, x, y):
    return jnp.sum((jax.vmap(model)(x) - y) ** 2)


def test_module_argument_forward_and_gradients_match_serial(mesh, mlp):
    x, y = batch()

    @shard_map(mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
    def data_parallel_grad(model, x, y):
        # The model is replicated (invariant over "data"), so with check_vma the gradient
        # arrives already summed over the devices; only the loss needs a psum.
        loss, grads = eqx.filter_value_and_grad(loss_sum)(model, x, y)
        return jax.lax.psum(loss, "data"), grads

    loss, grads = eqx.filter_jit(data_parallel_grad)(mlp, x, y)
    serial_loss, serial_grads = eqx.filter_value_and_grad(loss_sum)(mlp, x, y)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_tree_close(grads, serial_grads, what="gradients")
    # The gradient is a module like `mlp` (filter_grad puts None at non-array leaves), rebuilt
    # around the arrays that crossed the shard_map boundary.
    assert isinstance(grads, eqx.nn.MLP) and grads.activation is None
    assert grads.layers[0].in_features == mlp.layers[0].in_features


def test_function_form_under_jit_with_jax_mesh(mesh, mlp):
    x, _ = batch()
    apply = shard_map(
        lambda model, x: jax.vmap(model)(x),
        mesh=mesh.jax_mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )
    out = eqx.filter_jit(apply)(mlp, x)
    assert_tree_close(out, jax.vmap(mlp)(x))
    assert out.sharding.spec == P("data")


def test_module_result_keeps_static_leaves(mesh, mlp):
    specs = partition_specs(mlp)

    @shard_map(mesh=mesh, in_specs=specs, out_specs=specs)
    def scale(model):
        return jax.tree.map(lambda leaf: 2 * leaf if eqx.is_array(leaf) else leaf, model)

    doubled = scale(mlp)
    assert doubled.activation is mlp.activation
    assert doubled.layers[0].in_features == 4
    np.testing.assert_allclose(doubled.layers[1].weight, 2 * mlp.layers[1].weight)


def test_one_spec_for_all_arguments_and_static_arguments(mesh):
    @shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def add(a, b, scale):
        return (a + b) * scale

    a = jnp.arange(16.0)
    np.testing.assert_allclose(add(a, a, 3), 6 * a)


def test_spec_pytree_prefix_per_argument(mesh):
    x = {"rows": jnp.ones((8, 2)), "table": jnp.arange(4.0), "name": "batch"}

    @shard_map(
        mesh=mesh, in_specs=({"rows": P("data"), "table": P(), "name": None},), out_specs=P("data")
    )
    def f(tree):
        assert tree["name"] == "batch" and tree["rows"].shape == (1, 2)
        return tree["rows"] * tree["table"].sum()

    np.testing.assert_allclose(f(x), 6 * jnp.ones((8, 2)))


def test_none_spec_for_an_argument_with_arrays_names_it(mesh):
    f = shard_map(lambda a, b: a, mesh=mesh, in_specs=(P("data"), {"w": None}), out_specs=P("data"))
    with pytest.raises(
        ValueError, match=r"shard_map: argument 1\['w'\] is an array but its spec is None"
    ):
        f(jnp.ones(8), {"w": jnp.ones(3)})


def test_wrong_number_of_specs_raises(mesh):
    f = shard_map(lambda a, b: a, mesh=mesh, in_specs=(P("data"),), out_specs=P("data"))
    with pytest.raises(ValueError, match="in_specs has 1 entries but <lambda> got 2 positional"):
        f(jnp.ones(8), jnp.ones(8))


def test_specs_not_fitting_the_argument_raise(mesh):
    f = shard_map(lambda t: t, mesh=mesh, in_specs=({"a": P("data")},), out_specs=P("data"))
    with pytest.raises(ValueError, match="the specs for argument 0 do not fit its structure"):
        f({"b": jnp.ones(8)})


def test_keyword_arguments_raise(mesh):
    f = shard_map(lambda a: a, mesh=mesh, in_specs=(P("data"),), out_specs=P("data"))
    with pytest.raises(TypeError, match=r"keyword arguments \['a'\]"):
        f(a=jnp.ones(8))


def test_in_specs_pytree_for_several_arguments_raises(mesh):
    f = shard_map(lambda a, b: a, mesh=mesh, in_specs={"a": P()}, out_specs=P("data"))
    with pytest.raises(TypeError, match="in_specs is a dict but <lambda> got 2 positional"):
        f(jnp.ones(8), jnp.ones(8))


def test_manual_over_some_axes_only():
    mesh = DeviceMesh((2, 4), ("data", "model"))

    @shard_map(mesh=mesh, in_specs=P("data"), out_specs=P(), axis_names={"data"})
    def total(x):
        return jax.lax.psum(x.sum(keepdims=True), "data")

    x = jnp.arange(8.0)
    np.testing.assert_allclose(jax.jit(total)(x), jnp.array([28.0]))


def test_stored_specs_gather_inside_on_every_split_axis():
    """An array stored more split than its in_spec enters as stored and is gathered over the
    axes its stored entries add (several on one dimension, or on several dimensions): `fn`
    sees the in_spec's block, and the gradient (the gather's transpose) is the serial one,
    in the stored layout."""
    mesh = DeviceMesh((2, 2, 2), ("data", "pipe", "model"))
    w = jnp.sin(jnp.arange(8 * 12, dtype=jnp.float32)).reshape(8, 12)
    x = jnp.cos(jnp.arange(8 * 8, dtype=jnp.float32)).reshape(8, 8)
    stored, inside = P(("model", "data"), "pipe"), P("model", None)

    @shard_map(
        mesh=mesh,
        in_specs=(inside, P("data")),
        out_specs=P(),
        stored_specs=(stored, P("data")),
    )
    def loss(w, x):
        assert w.shape == (4, 12)  # the in_spec's block: rows over model, columns whole
        partial = jnp.sum(jnp.tanh(x[:, :4] @ w) ** 2)  # this device's rows of x and w
        # The same on each device of pipe, but counted as varying over it (w was gathered
        # over pipe): pmean it, so each device's gradient is its share.
        return jax.lax.pmean(jax.lax.psum(partial, ("data", "model")), "pipe")

    def serial(w, x):
        return sum(jnp.sum(jnp.tanh(x[:, :4] @ w[4 * i : 4 * i + 4]) ** 2) for i in range(2))

    placed = jax.device_put(w, jax.sharding.NamedSharding(mesh.jax_mesh, stored))
    value, grad = jax.jit(jax.value_and_grad(loss))(placed, x)
    want_value, want_grad = jax.value_and_grad(serial)(w, x)
    assert_tree_close(value, want_value, what="loss")
    assert_tree_close(grad, want_grad, what="gradient")
    assert grad.sharding.spec == stored


def test_stored_specs_that_do_not_extend_the_in_specs_are_refused(mesh):
    f = shard_map(
        lambda w: jnp.sum(w), mesh=mesh, in_specs=P(None, None), out_specs=P(),
        stored_specs=P(None, "data"), check_vma=False,
    )  # fmt: skip
    f(jnp.ones((4, 8)))  # gathered over data on dimension 1
    g = shard_map(
        lambda w: jnp.sum(w), mesh=mesh, in_specs=P(None, "data"), out_specs=P(),
        stored_specs=P("data", None), check_vma=False,
    )  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"argument 0 of <lambda>, the array: stored as P\('data', None\) but in_specs "
        r"gives P\(None, 'data'\); dimension 1 is split over 'data' inside and over None as "
        r"stored. An in_spec must be its stored spec with mesh axes left off",
    ):
        g(jnp.ones((8, 8)))
    with pytest.raises(ValueError, match=r"gather_stored, leaf 'w': stored as P\(\) but"):
        gather_stored({"w": jnp.ones(8)}, stored_specs=P(), in_specs=P("data"))
    h = shard_map(lambda a, b: a, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                  stored_specs=(P(),))  # fmt: skip
    with pytest.raises(ValueError, match="stored_specs has 1 entries but <lambda> got 2"):
        h(jnp.ones(8), jnp.ones(8))


# --- build_sharded -----------------------------------------------------------------------------


def make_mlp(key):
    return eqx.nn.MLP(16, 8, 32, 1, key=key)


def test_build_sharded_equals_eager_construction_and_places_shards(mesh):
    key = jax.random.key(3)

    def specs(abstract_model):
        def spec(leaf):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                return P("data") if leaf.shape[0] % 8 == 0 else P()
            return None

        return jax.tree.map(spec, abstract_model)

    built = build_sharded(make_mlp, key, mesh=mesh, specs=specs)
    eager = make_mlp(key)
    assert built.activation is eager.activation
    for got, want in zip(jax.tree.leaves(built), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(got, want)
    assert built.layers[0].weight.sharding.spec == P("data")
    assert built.layers[0].weight.addressable_shards[0].data.shape == (4, 16)


def test_build_sharded_default_and_spec_tree(mesh):
    key = jax.random.key(4)
    replicated = build_sharded(make_mlp, key, mesh=mesh)
    assert replicated.layers[1].weight.sharding.spec == P()
    assert replicated.layers[1].weight.sharding.mesh == mesh.jax_mesh
    specs = partition_specs(make_mlp(key))
    specs = eqx.tree_at(lambda s: s.layers[0].weight, specs, P(None, "data"))
    built = build_sharded(make_mlp, key, mesh=mesh, specs=specs)
    assert built.layers[0].weight.sharding.spec == P(None, "data")


def test_build_sharded_refuses_a_missing_spec(mesh):
    specs = eqx.tree_at(
        lambda s: s.layers[1].bias,
        partition_specs(make_mlp(jax.random.key(0))),
        None,
        is_leaf=lambda x: x is None,
    )
    with pytest.raises(
        ValueError,
        match=r"build_sharded: model\.layers\[1\]\.bias is an array but its spec is None",
    ):
        build_sharded(make_mlp, jax.random.key(0), mesh=mesh, specs=specs)


def test_build_sharded_checks_each_spec_against_the_mesh_before_compiling(mesh):
    """An unknown axis or a dimension the axis does not divide is refused naming the leaf,
    its spec, the axis and its size, before the constructor is traced for compiling."""
    calls = []

    def make(key):
        calls.append(None)
        return eqx.nn.Linear(16, 6, key=key)  # weight [6, 16]: 8 does not divide 6

    def with_weight_spec(spec):
        return lambda model: eqx.tree_at(lambda m: (m.weight, m.bias), model, (spec, P()))

    with pytest.raises(
        ValueError,
        match=r"build_sharded: specs gives P\('model',\) for leaf 'weight', naming mesh axes "
        r"\['model'\] that the mesh does not have; its axes are \('data',\)\. Use those names",
    ):
        build_sharded(make, jax.random.key(0), mesh=mesh, specs=with_weight_spec(P("model")))
    with pytest.raises(
        ValueError,
        match=r"build_sharded: specs gives P\('data',\) for leaf 'weight' of shape \(6, 16\): "
        r"dimension 0 \(size 6\) does not divide by 8 \(mesh axes \('data',\): 'data' of size "
        r"8\); leave that dimension whole \(None\), split another one",
    ):
        build_sharded(make, jax.random.key(0), mesh=mesh, specs=with_weight_spec(P("data")))
    assert len(calls) == 2  # one abstract trace each; nothing reached jax.jit
