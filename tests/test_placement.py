"""Placement in one process with 8 simulated CPU devices (the 2-process tests live in
`test_placement_multiprocess.py`)."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

from eqpar.placement import (
    DataPartitionType,
    global_to_host_array,
    host_to_global_device_array,
    with_sharding_constraint,
)

FULL = DataPartitionType.FULL
REPLICATED = DataPartitionType.REPLICATED


def mesh_2x4() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def nested_batch(rows: int = 8) -> dict:
    rng = np.random.default_rng(0)
    return {
        "inputs": (
            rng.normal(size=(rows, 3)).astype(np.float32),
            np.arange(rows * 2, dtype=np.int32).reshape(rows, 2),
        ),
        "mask": rng.random(rows) > 0.5,
        "extras": [rng.normal(size=(rows, 2, 2)).astype(np.float32), None],
    }


def assert_trees_equal(actual, expected):
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        assert type(a) is np.ndarray
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(a, e)


# --------------------------------------------------------------------------------------------
# host_to_global_device_array / global_to_host_array


def test_full_splits_the_batch_over_all_mesh_axes():
    mesh = mesh_2x4()
    batch = nested_batch(rows=16)
    placed = host_to_global_device_array(batch, mesh=mesh)
    assert jax.tree_util.tree_structure(placed) == jax.tree_util.tree_structure(batch)
    for array, host in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(batch)):
        assert isinstance(array, jax.Array)
        assert array.shape == host.shape  # one process: global batch == local batch
        assert array.dtype == host.dtype
        assert array.sharding == NamedSharding(mesh, P(("data", "model")))
        # device k of the flattened mesh holds rows [2k, 2k + 2)
        for k, device in enumerate(mesh.devices.flat):
            (shard,) = [s for s in array.addressable_shards if s.device == device]
            np.testing.assert_array_equal(np.asarray(shard.data), host[2 * k : 2 * k + 2])
        np.testing.assert_array_equal(np.asarray(array), host)


def test_full_round_trip_gives_the_rows_back():
    mesh = mesh_2x4()
    batch = nested_batch(rows=8)
    back = global_to_host_array(host_to_global_device_array(batch, mesh=mesh), mesh=mesh)
    assert_trees_equal(back, batch)


def test_full_round_trip_on_a_mesh_with_permuted_devices():
    devices = np.array(jax.devices()[:8])[[5, 2, 7, 0, 3, 6, 1, 4]].reshape(4, 2)
    mesh = Mesh(devices, ("data", "model"))
    batch = {"x": np.arange(32, dtype=np.float32).reshape(16, 2)}
    placed = host_to_global_device_array(batch, mesh=mesh)
    for k, device in enumerate(mesh.devices.flat):
        (shard,) = [s for s in placed["x"].addressable_shards if s.device == device]
        np.testing.assert_array_equal(np.asarray(shard.data), batch["x"][2 * k : 2 * k + 2])
    assert_trees_equal(global_to_host_array(placed, mesh=mesh), batch)


def test_replicated_puts_the_whole_array_on_every_device_and_returns_it_once():
    mesh = mesh_2x4()
    table = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "step": np.int32(7)}
    placed = host_to_global_device_array(table, REPLICATED, mesh=mesh)
    for array, host in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(table)):
        assert array.shape == np.shape(host)
        assert array.sharding.is_fully_replicated
        assert len(array.addressable_shards) == 8
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), host)
    back = global_to_host_array(placed, REPLICATED, mesh=mesh)
    assert back["w"].shape == (3, 2)  # not 8 stacked copies
    assert_trees_equal(back, {"w": table["w"], "step": np.asarray(table["step"])})


def test_both_partitions_return_the_same_kind_of_tree():
    mesh = mesh_2x4()
    batch = nested_batch(rows=8)
    full = global_to_host_array(
        host_to_global_device_array(batch, FULL, mesh=mesh), FULL, mesh=mesh
    )
    replicated = global_to_host_array(
        host_to_global_device_array(batch, REPLICATED, mesh=mesh), REPLICATED, mesh=mesh
    )
    assert jax.tree_util.tree_structure(full) == jax.tree_util.tree_structure(replicated)
    assert_trees_equal(full, batch)
    assert_trees_equal(replicated, batch)


def test_jitted_reduction_over_the_global_batch_matches_numpy():
    mesh = mesh_2x4()
    batch = nested_batch(rows=16)
    placed = host_to_global_device_array(batch, mesh=mesh)

    def loss(tree):
        x, ids = tree["inputs"]
        weights = jnp.where(tree["mask"], 1.0, 0.5)
        return jnp.sum(weights[:, None] * x**2) + jnp.sum(ids) + jnp.sum(tree["extras"][0])

    sharded = jax.jit(loss)(placed)
    on_one_device = jax.device_put(batch, jax.devices()[0])
    serial = jax.jit(loss)(on_one_device)
    assert_tree_close(sharded, serial, what="value")
    grad_sharded = jax.grad(lambda t: loss({**batch, "inputs": (t, batch["inputs"][1])}))(
        placed["inputs"][0]
    )
    grad_serial = jax.grad(lambda t: loss({**batch, "inputs": (t, batch["inputs"][1])}))(
        on_one_device["inputs"][0]
    )
    assert_tree_close(grad_sharded, grad_serial, what="gradient")


def test_global_to_host_reshards_arrays_laid_out_differently():
    mesh = mesh_2x4()
    x = np.arange(48, dtype=np.float32).reshape(16, 3)
    on_data_axis = jax.device_put(x, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    back = global_to_host_array({"a": on_data_axis, "b": replicated}, mesh=mesh)
    np.testing.assert_array_equal(back["a"], x)
    np.testing.assert_array_equal(back["b"], x)
    sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "model"))))
    np.testing.assert_array_equal(global_to_host_array(sharded, REPLICATED, mesh=mesh), x)


def test_python_numbers_and_local_jax_arrays_are_accepted():
    mesh = mesh_2x4()
    placed = host_to_global_device_array(
        {"lr": 0.5, "ids": jnp.arange(8, dtype=jnp.int32)}, REPLICATED, mesh=mesh
    )
    assert placed["lr"].shape == () and float(placed["lr"]) == 0.5
    np.testing.assert_array_equal(np.asarray(placed["ids"]), np.arange(8))


def test_prng_key_arrays_are_placed_like_any_leaf():
    """Typed PRNG keys (one dropout key per row) have an extended dtype, not a number kind."""
    keys = jax.random.split(jax.random.key(0), 8)
    placed = host_to_global_device_array({"keys": keys}, FULL, mesh=mesh_2x4())["keys"]
    assert placed.shape == (8,) and jax.dtypes.issubdtype(placed.dtype, jax.dtypes.extended)
    np.testing.assert_array_equal(jax.random.key_data(placed), jax.random.key_data(keys))


def test_values_that_do_not_fit_the_dtype_are_an_error_not_a_wrap():
    assert not jax.config.jax_enable_x64
    mesh = mesh_2x4()
    too_big = {"ids": np.arange(8, dtype=np.int64) + 2**40}
    with pytest.raises(ValueError, match=r"leaf 'ids'.*jax_enable_x64"):
        host_to_global_device_array(too_big, mesh=mesh)
    overflow = {"x": np.full(8, 1e300)}
    with pytest.raises(ValueError, match=r"leaf 'x'"):
        host_to_global_device_array(overflow, mesh=mesh)
    fits = host_to_global_device_array({"ids": np.arange(8, dtype=np.int64)}, mesh=mesh)
    assert fits["ids"].dtype == jnp.int32


def test_an_empty_batch_round_trips():
    mesh = mesh_2x4()
    empty = np.zeros((0, 3), np.float32)
    placed = host_to_global_device_array(empty, mesh=mesh)
    assert placed.shape == (0, 3)
    assert global_to_host_array(placed, mesh=mesh).shape == (0, 3)


# --------------------------------------------------------------------------------------------
# Which mesh


def test_mesh_comes_from_jax_set_mesh():
    mesh = mesh_2x4()
    batch = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    with jax.set_mesh(mesh):
        placed = host_to_global_device_array(batch)
        back = global_to_host_array(placed)
    assert placed.sharding == NamedSharding(mesh, P(("data", "model")))
    np.testing.assert_array_equal(back, batch)


def test_legacy_with_mesh_context_is_refused_with_the_fix():
    # JAX has no public reader of the deprecated `with mesh:` block, and eqpar reads no JAX
    # internals: the error names `jax.set_mesh` instead of placing on a guessed mesh.
    mesh = mesh_2x4()
    batch = np.arange(8.0, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` is deprecated in JAX
        with mesh, pytest.raises(ValueError, match=r"jax\.set_mesh.*legacy `with mesh:`"):
            host_to_global_device_array(batch)


def test_explicit_mesh_wins_over_the_context_mesh():
    small = Mesh(np.array(jax.devices()[:2]), ("data",))
    with jax.set_mesh(mesh_2x4()):
        placed = host_to_global_device_array(np.zeros((4, 1), np.float32), mesh=small)
    assert placed.sharding == NamedSharding(small, P(("data",)))


@pytest.mark.parametrize("function", [host_to_global_device_array, global_to_host_array])
def test_no_mesh_is_a_clear_error(function):
    with pytest.raises(ValueError, match=r"no device mesh.*mesh=.*jax\.set_mesh\(mesh\)"):
        function(np.zeros((8, 2), np.float32))


def _without_runtime_checks(function):
    """The function as plain Python (the suite's jaxtyping hook wraps it with a type check
    that would answer first), to test the function's own argument checks."""
    return getattr(function, "__wrapped__", function)


def test_an_abstract_mesh_is_refused():
    abstract = mesh_2x4().abstract_mesh
    with pytest.raises(TypeError, match="mesh"):
        host_to_global_device_array(np.zeros(8), mesh=abstract)  # type: ignore[arg-type]
    unchecked = _without_runtime_checks(host_to_global_device_array)
    with pytest.raises(TypeError, match=r"`mesh` must be a concrete `jax.sharding.Mesh`"):
        unchecked(np.zeros(8), mesh=abstract)


def test_placing_inside_jit_is_refused():
    with pytest.raises(ValueError, match=r"must be called outside `jax.jit`"):
        jax.jit(lambda x: host_to_global_device_array(x))(jnp.zeros(8))


# --------------------------------------------------------------------------------------------
# Validation


def test_local_batch_that_does_not_divide_names_the_leaf():
    batch = {"inputs": (np.zeros((8, 3)), np.zeros((6, 3)))}
    message = re.escape("leaf 'inputs/1' has a local batch of 6 rows (shape (6, 3))")
    with pytest.raises(ValueError, match=message + r".*8 local devices of the mesh"):
        host_to_global_device_array(batch, mesh=mesh_2x4())


def test_full_scalar_leaf_names_the_leaf():
    with pytest.raises(ValueError, match=re.escape("leaf 'step' is a scalar")):
        host_to_global_device_array({"step": np.int32(3)}, mesh=mesh_2x4())


def test_non_numeric_leaf_is_a_type_error():
    with pytest.raises(TypeError, match=re.escape("leaf 'name' has dtype <U")):
        host_to_global_device_array({"name": np.array(["a"] * 8)}, REPLICATED, mesh=mesh_2x4())
    with pytest.raises(TypeError, match=re.escape("leaf 'name' must be a NumPy array")):
        host_to_global_device_array({"name": "tokens"}, REPLICATED, mesh=mesh_2x4())


def test_partition_must_be_the_enum():
    # Under the test suite's runtime type checking the annotation already refuses it; without
    # it the function's own check does. Either way it is a TypeError naming `partition`.
    with pytest.raises(TypeError, match="partition"):
        host_to_global_device_array(np.zeros(8), "full", mesh=mesh_2x4())  # type: ignore[arg-type]
    for function in (host_to_global_device_array, global_to_host_array):
        with pytest.raises(TypeError, match=r"`partition` must be a `DataPartitionType`"):
            _without_runtime_checks(function)(np.zeros(8), "full", mesh=mesh_2x4())


def test_global_to_host_rejects_host_arrays():
    with pytest.raises(TypeError, match=re.escape("leaf 'x' must be a `jax.Array`")):
        global_to_host_array({"x": np.zeros(8)}, mesh=mesh_2x4())


def test_global_to_host_rejects_arrays_on_other_devices():
    on_four = Mesh(np.array(jax.devices()[:4]), ("data",))
    x = host_to_global_device_array(np.zeros((8, 2), np.float32), mesh=on_four)
    with pytest.raises(ValueError, match=r"leaf '<root>' lives on devices \[0, 1, 2, 3\]"):
        global_to_host_array(x, mesh=mesh_2x4())


def test_global_to_host_full_needs_a_batch_that_divides_over_the_mesh():
    mesh = mesh_2x4()
    x = jax.device_put(np.zeros((6, 2), np.float32), NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=r"global batch of 6 rows .* 8 global devices of the mesh"):
        global_to_host_array({"x": x}, mesh=mesh)
    with pytest.raises(ValueError, match=re.escape("leaf 's' is a scalar")):
        global_to_host_array({"s": jax.device_put(1.0, NamedSharding(mesh, P()))}, mesh=mesh)


# --------------------------------------------------------------------------------------------
# with_sharding_constraint


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum((h @ params["w2"]) ** 2)


def _mlp_constrained(params, x):
    params = with_sharding_constraint(params, {"w1": P(None, "model"), "w2": P("model", None)})
    h = with_sharding_constraint(jnp.tanh(x @ params["w1"]), P("data", "model"))
    return jnp.sum((h @ params["w2"]) ** 2)


def test_constraint_matches_the_unconstrained_twin_with_gradients():
    mesh = mesh_2x4()
    key_1, key_2, key_3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(key_1, (4, 8)),
        "w2": jax.random.normal(key_2, (8, 2)),
    }
    x = jax.random.normal(key_3, (6, 4))
    with jax.set_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(_mlp_constrained))(params, x)
    serial_value, serial_grads = jax.jit(jax.value_and_grad(_mlp))(params, x)
    assert_tree_close(value, serial_value, what="value")
    # Each gradient relative to its largest entry: summed in another order on older JAX.
    assert_tree_close(grads, serial_grads, what="gradients")


def test_constraint_sets_the_sharding_on_a_multi_device_mesh():
    mesh = mesh_2x4()

    def f(x):
        return with_sharding_constraint(x * 2, P("model", "data"))

    with jax.set_mesh(mesh):
        y = jax.jit(f)(jnp.ones((8, 4)))
        jaxpr = str(jax.make_jaxpr(f)(jnp.ones((8, 4))))
    assert y.sharding == NamedSharding(mesh, P("model", "data"))
    assert "sharding_constraint" in jaxpr


def test_constraint_with_named_shardings_and_none_entries():
    mesh = mesh_2x4()
    shardings = {"a": NamedSharding(mesh, P("data")), "b": None}

    @jax.jit
    def f(tree):
        return with_sharding_constraint(tree, shardings)

    out = f({"a": jnp.ones((4, 2)), "b": (jnp.ones(3), jnp.zeros(5))})
    assert out["a"].sharding == NamedSharding(mesh, P("data"))
    jaxpr = str(jax.make_jaxpr(f)({"a": jnp.ones((4, 2)), "b": (jnp.ones(3), jnp.zeros(5))}))
    assert jaxpr.count("sharding_constraint") == 1


def test_constraint_under_legacy_with_mesh_asks_for_set_mesh():
    mesh = mesh_2x4()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh, pytest.raises(ValueError, match=r"jax\.set_mesh"):
            jax.jit(lambda x: with_sharding_constraint(x, P("data")))(jnp.ones((4, 2)))


def test_bare_spec_outside_jit_uses_the_concrete_context_mesh():
    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        y = with_sharding_constraint(jnp.ones((8, 4)), P("data", "model"))
    assert y.sharding == NamedSharding(mesh, P("data", "model"))


def test_constraint_is_a_no_op_on_one_device():
    x = jnp.arange(4.0)
    assert with_sharding_constraint(x, jax.sharding.SingleDeviceSharding(jax.devices()[0])) is x
    assert with_sharding_constraint(x, NamedSharding(one_device_mesh(), P("data"))) is x
    with jax.set_mesh(one_device_mesh()):
        assert with_sharding_constraint(x, P("data")) is x
        jaxpr = str(jax.make_jaxpr(lambda v: with_sharding_constraint(v, P("data")))(x))
    assert "sharding_constraint" not in jaxpr


@pytest.mark.parametrize("mesh_factory", [one_device_mesh, mesh_2x4])
def test_unknown_axis_is_an_error_even_on_one_device(mesh_factory):
    x = {"h": jnp.ones((4, 2))}
    with jax.set_mesh(mesh_factory()), pytest.raises(ValueError) as info:
        jax.jit(lambda t: with_sharding_constraint(t, {"h": P("batch")}))(x)
    message = str(info.value)
    assert "'h'" in message and "'batch'" in message and "the mesh does not have" in message


def test_a_single_spec_for_a_whole_tree_names_the_leaf_at_fault():
    tree = {"a": jnp.ones((8, 4)), "b": jnp.ones(4)}
    with jax.set_mesh(mesh_2x4()), pytest.raises(ValueError, match=re.escape("for leaf 'b' of")):
        with_sharding_constraint(tree, P("data", "model"))
    with jax.set_mesh(mesh_2x4()), pytest.raises(ValueError, match=re.escape("for the array of")):
        with_sharding_constraint(jnp.ones(4), P("data", "model"))


def test_repeated_axis_and_too_long_spec_are_errors():
    with jax.set_mesh(one_device_mesh()):
        with pytest.raises(ValueError, match=r"P\('data', 'data'\).*axes 'data' more than once"):
            with_sharding_constraint(jnp.ones((2, 2)), P("data", "data"))
        with pytest.raises(ValueError, match=r"2 entries but only 1 dimensions"):
            with_sharding_constraint(jnp.ones(2), P("data", None))


def test_bare_spec_without_a_mesh_is_an_error():
    with pytest.raises(ValueError, match=r"bare `PartitionSpec`.*jax\.set_mesh\(mesh\)"):
        with_sharding_constraint(jnp.ones(4), P("data"))


def test_shardings_not_a_prefix_of_x_is_an_error():
    with jax.set_mesh(mesh_2x4()), pytest.raises(ValueError, match=r"prefix of the structure"):
        with_sharding_constraint({"a": jnp.ones(8)}, {"b": P("data")})


def test_non_sharding_leaf_is_a_type_error():
    with pytest.raises(TypeError, match=r"`shardings` at 'a' must be a `PartitionSpec`"):
        with_sharding_constraint({"a": jnp.ones(8)}, {"a": "data"})
