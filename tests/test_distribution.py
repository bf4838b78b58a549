import functools
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqpar.distributions import (
    FSDP,
    DataParallel,
    ModelParallel,
    distribution,
    fsdp_spec,
    match_param_specs,
    set_distribution,
)
from eqpar.layout import LayoutMap, named_shardings
from eqpar.mesh import DeviceMesh

# --- models ------------------------------------------------------------------------------------

FEATURES, WIDTH, SEQ, DIM, HEADS, HIDDEN = 64, 512, 8, 64, 4, 256


def make_mlp(key):
    return eqx.nn.MLP(FEATURES, FEATURES, WIDTH, 2, activation=jax.nn.tanh, key=key)


class Block(eqx.Module):
    """A pre-norm transformer block acting on one sequence `[SEQ, DIM]`."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.up = eqx.nn.Linear(DIM, HIDDEN, key=k2)
        self.down = eqx.nn.Linear(HIDDEN, DIM, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


MODELS = {"mlp": make_mlp, "block": Block}


def data(name):
    rows = 16
    shape = (rows, FEATURES) if name == "mlp" else (rows, SEQ, DIM)
    size = int(np.prod(shape))
    x = np.sin(np.arange(size, dtype=np.float32) * 0.37).reshape(shape)
    y = np.cos(np.arange(size, dtype=np.float32) * 0.11).reshape(shape)
    return x, y


def megatron_layout_map(mesh):
    """Column-parallel then row-parallel (Megatron-LM) over the "model" axis."""
    layout_map = LayoutMap(mesh)
    # MLP: layers 0 and 2 split their outputs, layer 1 its inputs.
    layout_map["layers/[02]/weight"] = ("model", None)
    layout_map["layers/[02]/bias"] = ("model",)
    layout_map["layers/1/weight"] = (None, "model")
    # Transformer block: heads split over "model" in q/k/v, joined in the output projection.
    layout_map["attn/(query|key|value)_proj/weight"] = ("model", None)
    layout_map["attn/output_proj/weight"] = (None, "model")
    layout_map["up/weight"] = ("model", None)
    layout_map["up/bias"] = ("model",)
    layout_map["down/weight"] = (None, "model")
    return layout_map


def make_distribution(name):
    if name == "data_parallel":
        return DataParallel()
    if name == "model_parallel":
        mesh = DeviceMesh((2, 4), ("data", "model"))
        return ModelParallel(layout_map=megatron_layout_map(mesh), batch_dim_name="data")
    return FSDP()


# SGD with momentum: its state (the trace) mirrors the parameters, like Adam's moments, but it
# is linear in the gradients. Adam divides by sqrt(nu), which turns reduction-order rounding
# (1e-7) of near-zero gradients into update differences far above any rtol.
OPTIMIZER = optax.sgd(1e-2, momentum=0.9)


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(static, out_shardings=None):
    def step(params, opt_state, x, y):
        model = eqx.combine(params, static)
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)


@functools.cache
def trained(model_name, distribution_name):
    """Three optimizer steps; returns (params, opt_state, static, distribution, compiled)."""
    model = MODELS[model_name](jax.random.key(0))
    x, y = data(model_name)
    if distribution_name == "serial":
        d = None
        x, y = jnp.asarray(x), jnp.asarray(y)
    else:
        d = make_distribution(distribution_name)
        model = d.distribute_model(model)
        x, y = d.distribute_input(x), d.distribute_input(y)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = OPTIMIZER.init(params)
    out_shardings = None
    if d is not None:
        opt_state = d.distribute_opt_state(opt_state, model)
        # Without out_shardings the compiler picks the results' shardings itself.
        out_shardings = (
            d.shardings(params),
            named_shardings(d.opt_state_specs(opt_state, model), d.device_mesh),
        )
    compiled = make_step(static, out_shardings).lower(params, opt_state, x, y).compile()
    for _ in range(3):
        params, opt_state = compiled(params, opt_state, x, y)
    return params, opt_state, static, d, compiled


@pytest.fixture(autouse=True)
def no_current_distribution():
    set_distribution(None)
    yield
    set_distribution(None)


# --- training equals the single-device run ----------------------------------------------------


@pytest.mark.parametrize("model_name", ["mlp", "block"])
@pytest.mark.parametrize("distribution_name", ["data_parallel", "model_parallel", "fsdp"])
def test_three_optax_steps_match_single_device(model_name, distribution_name):
    want, *_ = trained(model_name, "serial")
    got, opt_state, _, d, _ = trained(model_name, distribution_name)
    specs = d.partition_specs(got)
    mesh = d.device_mesh.jax_mesh
    leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    assert len(leaves) == len(spec_leaves) == len(jax.tree.leaves(want))
    for (path, leaf), spec, expected in zip(leaves, spec_leaves, jax.tree.leaves(want)):
        # atol only matters for the few weights within 1e-6 of zero (rounding ~1e-11).
        np.testing.assert_allclose(
            leaf, expected, rtol=1e-5, atol=1e-9, err_msg=jax.tree_util.keystr(path)
        )
        # Each parameter keeps the sharding its layout asked for through the steps.
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
            jax.tree_util.keystr(path),
            leaf.sharding,
            spec,
        )
    trace = opt_state[0].trace
    for leaf, spec in zip(jax.tree.leaves(trace), spec_leaves):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)


def has_spec(leaf, spec):
    return leaf.sharding.is_equivalent_to(NamedSharding(leaf.sharding.mesh, spec), leaf.ndim)


def test_layouts_are_what_each_distribution_asks_for():
    mlp, *_ = trained("mlp", "model_parallel")
    assert has_spec(mlp.layers[0].weight, P("model", None))
    assert has_spec(mlp.layers[1].weight, P(None, "model"))
    assert has_spec(mlp.layers[1].bias, P())
    block, *_ = trained("block", "model_parallel")
    assert has_spec(block.attn.query_proj.weight, P("model", None))
    assert has_spec(block.down.weight, P(None, "model"))
    assert has_spec(block.norm1.weight, P())
    mlp, *_ = trained("mlp", "fsdp")
    assert has_spec(mlp.layers[1].weight, P("data", None))
    assert has_spec(mlp.layers[0].bias, P())  # 2 KiB: under the 16 KiB default
    mlp, *_ = trained("mlp", "data_parallel")
    assert all(has_spec(leaf, P()) for leaf in jax.tree.leaves(mlp))


def test_constrain_keeps_layouts_under_filter_jit():
    d = FSDP()
    model = d.build_model(make_mlp, jax.random.key(0))
    opt_state = d.distribute_opt_state(OPTIMIZER.init(eqx.filter(model, eqx.is_array)), model)
    x, y = (d.distribute_input(a) for a in data("mlp"))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return d.constrain(model), d.constrain(opt_state, model)

    for _ in range(2):
        model, opt_state = step(model, opt_state, x, y)
    specs = jax.tree.leaves(d.partition_specs(model), is_leaf=lambda s: isinstance(s, P))
    for leaf, spec in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)), specs):
        assert has_spec(leaf, spec)
    for leaf, spec in zip(jax.tree.leaves(opt_state[0].trace), specs):
        assert has_spec(leaf, spec)


# --- memory per device -------------------------------------------------------------------------


def bytes_on_each_device(tree):
    per_device = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device


@pytest.mark.parametrize("distribution_name, ways", [("model_parallel", 4), ("fsdp", 8)])
def test_parameter_bytes_per_device(distribution_name, ways):
    params, opt_state, _, d, compiled = trained("mlp", distribution_name)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    per_device = bytes_on_each_device(params)
    assert len(per_device) == 8
    for nbytes in per_device.values():
        assert abs(nbytes - total / ways) <= 0.05 * total / ways, (nbytes, total / ways)
    # The compiled step's arguments are the params and the momentum trace (+ the batch): two
    # parameter-sized trees, each split `ways` ways.
    x, y = data("mlp")
    batch_per_device = (x.nbytes + y.nbytes) / d.device_mesh.axis_size(d.batch_dim_name)
    arguments = compiled.memory_analysis().argument_size_in_bytes
    from_compiler = arguments - batch_per_device
    assert abs(from_compiler - 2 * total / ways) <= 0.05 * 2 * total / ways, (
        from_compiler,
        2 * total / ways,
    )
    assert bytes_on_each_device(opt_state[0].trace) == per_device


def test_data_parallel_replicates():
    params, *_ = trained("mlp", "data_parallel")
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert set(bytes_on_each_device(params).values()) == {total}


# --- building sharded --------------------------------------------------------------------------


@pytest.mark.parametrize("distribution_name", ["data_parallel", "model_parallel", "fsdp"])
def test_build_model_is_sharded_at_birth_and_equals_eager(distribution_name):
    d = make_distribution(distribution_name)
    key = jax.random.key(7)
    built = d.build_model(Block, key)
    eager = Block(key)
    specs = d.partition_specs(eager)
    mesh = d.device_mesh.jax_mesh
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    assert len(arrays(built)) == len(arrays(eager)) == len(spec_leaves)
    for got, want, spec in zip(arrays(built), arrays(eager), spec_leaves):
        np.testing.assert_array_equal(got, want)
        assert got.sharding.is_equivalent_to(NamedSharding(mesh, spec), got.ndim)
    assert built.attn.num_heads == HEADS and built.norm1.eps == eager.norm1.eps


# --- inputs ------------------------------------------------------------------------------------


def test_distribute_input_splits_dimension_zero():
    d = DataParallel()
    batch = {"x": np.ones((16, 3), np.float32), "y": jnp.zeros(16, jnp.int32)}
    placed = d.distribute_input(batch)
    assert placed["x"].sharding.spec == P("data", None)
    assert placed["y"].sharding.spec == P("data")
    assert placed["x"].addressable_shards[0].data.shape == (2, 3)
    mp = make_distribution("model_parallel")
    assert mp.distribute_input(np.ones((6, 2))).sharding.spec == P("data", None)


def test_distribute_input_not_divisible_says_so():
    with pytest.raises(ValueError, match=r"batch size 12 does not divide by 8 .*'data'.*pad=True"):
        DataParallel().distribute_input(np.ones((12, 3)))


def test_distribute_input_pad_returns_mask():
    d = DataParallel()
    x = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    (placed, labels), mask = d.distribute_input((x, jnp.arange(12)), pad=True)
    assert placed.shape == (16, 3) and labels.shape == (16,)
    np.testing.assert_array_equal(placed[:12], x)
    np.testing.assert_array_equal(placed[12:], 0)
    np.testing.assert_array_equal(mask, np.arange(16) < 12)
    assert mask.sharding.spec == P("data") and placed.sharding.spec == P("data", None)
    _, full_mask = d.distribute_input(np.ones((8, 2)), pad=True)
    assert bool(full_mask.all())


def test_distribute_input_bad_batches():
    d = DataParallel()
    with pytest.raises(ValueError, match=r"leaves disagree on the batch size .*'a': 8, 'b': 16"):
        d.distribute_input({"a": np.ones(8), "b": np.ones(16)})
    with pytest.raises(ValueError, match="leaf 'scale' has no batch dimension"):
        d.distribute_input({"scale": np.float32(2.0)})
    with pytest.raises(ValueError, match="batch has no array leaves"):
        d.distribute_input({})


# --- optimizer state ---------------------------------------------------------------------------


def test_opt_state_specs_follow_the_parameters():
    d = FSDP(min_size_bytes=0)
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    state = optax.chain(optax.clip(1.0), optax.adam(1e-3)).init(params)
    specs = d.opt_state_specs(state, model)
    param_specs = d.partition_specs(model)
    assert specs[1][0].mu.layers[0].weight == param_specs.layers[0].weight == P("data", None)
    assert specs[1][0].nu.layers[1].bias == P("data")
    assert specs[1][0].count == P()
    # A leaf that mirrors a parameter with another shape (factored statistics) is replicated.
    odd = {"stats": jax.tree.map(lambda p: jnp.zeros(p.shape[:1]), params), "step": jnp.zeros(())}
    odd_specs = match_param_specs(odd, model, param_specs)
    assert odd_specs["stats"].layers[0].weight == P()
    assert odd_specs["stats"].layers[0].bias == P("data")
    assert odd_specs["step"] == P()


def test_match_param_specs_refuses_specs_of_another_model():
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    other = FSDP().partition_specs(eqx.nn.Linear(8, 8, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="param_specs has 2 specs for 4 array leaves"):
        match_param_specs({}, model, other)


# --- FSDP rule ---------------------------------------------------------------------------------


def test_fsdp_spec_rule():
    f32 = jnp.float32
    assert fsdp_spec((64, 512), f32, axis="data", axis_size=8) == P(None, "data")
    assert fsdp_spec((512, 512), f32, axis="data", axis_size=8) == P("data", None)
    assert fsdp_spec((12, 4096), f32, axis="data", axis_size=8) == P(None, "data")
    assert fsdp_spec((4096,), f32, axis="data", axis_size=8) == P("data")
    assert fsdp_spec((4095,), f32, axis="data", axis_size=8) == P()  # no dividing dimension
    assert fsdp_spec((1024,), f32, axis="data", axis_size=8) == P()  # 4 KiB < 16 KiB
    assert fsdp_spec((1024,), f32, axis="data", axis_size=8, min_size_bytes=4096) == P("data")


def test_fsdp_with_a_layout_map_keeps_explicit_layouts():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    layout_map = LayoutMap(mesh)
    layout_map["layers/1/weight"] = (None, "model")
    d = FSDP(layout_map=layout_map, min_size_bytes=0)
    assert d.device_mesh == mesh and d.batch_dim_name == "data"
    specs = d.partition_specs(eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0)))
    assert specs.layers[1].weight == P(None, "model")
    assert specs.layers[0].weight == P("data", None)


# --- construction errors -----------------------------------------------------------------------


def test_data_parallel_construction():
    assert DataParallel().device_mesh.shape == (8,)
    dp = DataParallel(devices=jax.devices()[:4])
    assert dp.device_mesh.shape == (4,) and dp.batch_dim_name == "data"
    with pytest.raises(ValueError, match="give device_mesh or devices, not both"):
        DataParallel(DeviceMesh((8,), ("data",)), devices=jax.devices())
    with pytest.raises(ValueError, match="devices is empty"):
        DataParallel(devices=[])


def test_data_parallel_on_a_2d_mesh_warns_and_uses_the_first_axis():
    mesh = DeviceMesh((2, 4), ("replica", "model"))
    with pytest.warns(UserWarning, match="split over the first, 'replica'"):
        dp = DataParallel(mesh)
    assert dp.batch_dim_name == "replica"
    assert dp.distribute_input(np.ones((4, 2))).sharding.spec == P("replica", None)
    with pytest.warns(UserWarning, match="replicated over the others"):
        assert DataParallel(mesh.jax_mesh).device_mesh == mesh


def test_model_parallel_construction_errors():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    layout_map = LayoutMap(mesh)
    assert ModelParallel(layout_map=layout_map).batch_dim_name == "data"
    with pytest.raises(ValueError, match=r"batch_dim_name='batch' is not an axis of the mesh"):
        ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['device_mesh'\]"):
        ModelParallel(layout_map=layout_map, device_mesh=mesh)
    with pytest.raises(TypeError, match="layout_map"):
        ModelParallel(layout_map={"w": ("model",)})  # type: ignore[arg-type]


def test_fsdp_construction_errors():
    with pytest.raises(ValueError, match=r"axis='model' is not an axis of the mesh \('data',\)"):
        FSDP(axis="model")
    with pytest.raises(ValueError, match="min_size_bytes must be >= 0; got -1"):
        FSDP(min_size_bytes=-1)
    layout_map = LayoutMap(DeviceMesh((2, 4), ("data", "model")))
    with pytest.raises(ValueError, match="layout_map is defined on another mesh"):
        FSDP(DeviceMesh((8,), ("data",)), layout_map=layout_map)
    with pytest.raises(ValueError, match="give device_mesh or devices, not both"):
        FSDP(DeviceMesh((8,), ("data",)), devices=jax.devices())


def test_distribution_rejects_a_layout_that_does_not_fit():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    layout_map = LayoutMap(mesh)
    layout_map["layers/2/weight"] = ("model", None)
    mp = ModelParallel(layout_map=layout_map)
    with pytest.raises(ValueError, match=r"leaf 'layers/2/weight' of shape \(3, 16\)"):
        mp.distribute_model(eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0)))


# --- current distribution ----------------------------------------------------------------------


def test_set_distribution_and_scopes_nest_and_restore():
    outer, inner = DataParallel(), FSDP()
    assert distribution() is None
    set_distribution(outer)
    assert distribution() is outer
    with inner.scope() as entered:
        assert entered is inner and distribution() is inner
        with outer.scope():
            assert distribution() is outer
        assert distribution() is inner
        replaced = DataParallel()
        set_distribution(replaced)  # replaces the scope's distribution until it ends
        assert distribution() is replaced
    assert distribution() is outer
    with pytest.raises(RuntimeError, match="boom"), inner.scope():
        raise RuntimeError("boom")
    assert distribution() is outer


def test_scope_is_visible_from_other_threads():
    d = FSDP()
    seen = []
    with d.scope():
        worker = threading.Thread(target=lambda: seen.append(distribution()))
        worker.start()
        worker.join()
    assert seen == [d]


def test_set_distribution_refuses_other_objects():
    with pytest.raises(TypeError, match="value"):
        set_distribution("data_parallel")  # type: ignore[arg-type]


def test_optimizer_state_of_the_inexact_part_still_gets_parameter_specs():
    import optax

    from eqpar.distributions import match_param_specs

    class WithIndex(eqx.Module):
        weight: jax.Array
        index: jax.Array  # an integer array: not a parameter

    model = WithIndex(jnp.ones((8, 4)), jnp.arange(3))
    specs = WithIndex(P("data", None), P())  # type: ignore[arg-type]
    for keep in (eqx.is_array, eqx.is_inexact_array):
        state = optax.adam(1e-3).init(eqx.filter(model, keep))
        state_specs = match_param_specs(state, model, specs)
        assert state_specs[0].mu.weight == P("data", None)
        assert state_specs[0].count == P()
