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
from numerics import assert_tree_close

from eqpar.distributions import (
    FSDP,
    DataParallel,
    ModelParallel,
    build_model,
    distribute_input,
    distribute_model,
    distribute_opt_state,
    distribution,
    fsdp_spec,
    match_param_specs,
    set_distribution,
)
from eqpar.layout import LayoutMap, named_shardings
from eqpar.mesh import DeviceMesh
from eqpar.nn import TPDense
from eqpar.nn.pipeline import ScannedLayers
from eqpar.spmd import build_sharded, shard_map

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
        assert_tree_close(leaf, expected, what=jax.tree_util.keystr(path))
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


def test_fsdp_spec_adds_the_axis_to_a_base_layout():
    f32 = jnp.float32
    rule = functools.partial(fsdp_spec, dtype=f32, axis="data", axis_size=2)
    # Column- and row-parallel weights keep their split and gain "data" on the other dim.
    assert rule((1024, 256), base=P("model", None)) == P("model", "data")
    assert rule((256, 1024), base=P(None, "model")) == P("data", "model")
    assert rule((1024, 256), base=P("model")) == P("model", "data")  # short specs pad
    # Stacked: the largest free dimension wins over a small layer axis; ties take the first.
    assert rule((4, 512, 128), base=P(None, "model", None)) == P(None, "model", "data")
    assert rule((256, 256, 8), base=P(None, None, "model")) == P("data", None, "model")
    # Left alone: already on the axis, too small (the whole leaf counts), nothing divides.
    assert rule((1024, 256), base=P("data", "model")) == P("data", "model")
    assert rule((1024, 256), base=P(("data", "model"), None)) == P(("data", "model"), None)
    assert rule((1024,), base=P("model")) == P("model")  # 4 KiB
    assert rule((1024, 255), base=P("model", None)) == P("model", None)
    assert rule((1024, 256), base=P(None, "model"), axis_size=1) == P(None, "model")
    with pytest.raises(ValueError, match=r"base=.* has 3 entries for a leaf of shape \(8, 8\)"):
        rule((8, 8), base=P("model", None, None))


def test_fsdp_with_a_layout_map_adds_the_data_axis_to_explicit_layouts():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    layout_map = LayoutMap(mesh)
    layout_map["layers/1/weight"] = (None, "model")
    d = FSDP(layout_map=layout_map, min_size_bytes=0)
    assert d.device_mesh == mesh and d.batch_dim_name == "data"
    mlp = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    specs = d.partition_specs(mlp)
    assert specs.layers[1].weight == P("data", "model")  # [8, 16]
    assert specs.layers[0].weight == P("data", None)  # [16, 8]
    compute = d.compute_specs(mlp)
    assert compute.layers[1].weight == P(None, "model") and compute.layers[0].weight == P()


def test_compute_specs_equal_the_layout_without_fsdp():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    mp = ModelParallel(layout_map=megatron_layout_map(mesh))
    mlp = make_mlp(jax.random.key(0))
    assert mp.compute_specs(mlp) == mp.partition_specs(mlp)
    assert DataParallel().compute_specs(mlp) == DataParallel().partition_specs(mlp)
    fsdp = FSDP(layout_map=megatron_layout_map(mesh))
    assert fsdp.compute_specs(mlp) == mp.partition_specs(mlp)
    assert fsdp.partition_specs(mlp).layers[1].weight == P("data", "model")


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


# --- FSDP x tensor parallelism -----------------------------------------------------------------

TP_IN, TP_HIDDEN, TP_LAYERS, TP_ROWS = 128, 256, 2, 16  # every weight >= 64 KiB


class TPMLP(eqx.Module):
    """A plain `Linear` (laid out by FSDP alone or a layout map), then a Megatron pair."""

    pre: eqx.nn.Linear
    up: TPDense
    down: TPDense

    def __init__(self, key):
        k0, k1, k2 = jax.random.split(key, 3)
        self.pre = eqx.nn.Linear(TP_IN, TP_IN, key=k0)
        self.up = TPDense(TP_IN, TP_HIDDEN, tp_mode="gather", skip_communication=True, key=k1)
        self.down = TPDense(TP_HIDDEN, TP_IN, tp_mode="scatter", key=k2)

    def __call__(self, x):  # [rows, in] -> [rows, in / model] (inside shard_map)
        return self.down(jnp.tanh(self.up(jax.vmap(self.pre)(x))))

    def serial(self, x):
        up, down = self.up.to_linear(), self.down.to_linear()
        return jax.vmap(down)(jnp.tanh(jax.vmap(up)(jax.vmap(self.pre)(x))))


class TPBlock(eqx.Module):
    up: TPDense
    down: TPDense

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = TPDense(TP_IN, TP_HIDDEN, tp_mode="gather", key=k1)
        self.down = TPDense(TP_HIDDEN, TP_IN, tp_mode="scatter", key=k2)

    def __call__(self, x):  # [rows, in / model] -> [rows, in / model]
        return x + self.down(jnp.tanh(self.up(x)))

    def serial(self, x):
        return x + jax.vmap(self.down.to_linear())(jnp.tanh(jax.vmap(self.up.to_linear())(x)))


class TPStack(eqx.Module):
    blocks: ScannedLayers

    def __init__(self, key):
        keys = jax.random.split(key, TP_LAYERS)
        self.blocks = ScannedLayers(eqx.filter_vmap(TPBlock)(keys))

    def __call__(self, x):
        return self.blocks(x)

    def serial(self, x):
        for i in range(TP_LAYERS):
            x = self.blocks.layer(i).serial(x)
        return x


TP_MODELS = {
    # model class, input spec, output spec inside shard_map
    "tp_mlp": (TPMLP, P("data", None), P("data", "model")),
    "tp_block": (TPBlock, P("data", "model"), P("data", "model")),
    "scanned": (TPStack, P("data", "model"), P("data", "model")),
}


def fsdp_tp(layout: str) -> FSDP:
    mesh = DeviceMesh((2, 4), ("data", "model"))
    if layout == "mesh":
        return FSDP(device_mesh=mesh, axis="data")
    layout_map = LayoutMap(mesh)
    layout_map["pre/weight"] = (None, None)
    layout_map["pre/bias"] = None
    layout_map["up/weight"] = ("model", None)  # agrees with what TPDense declares
    return FSDP(layout_map=layout_map, axis="data")


def tp_batch():
    x = np.sin(np.arange(TP_ROWS * TP_IN, dtype=np.float32) * 0.37).reshape(TP_ROWS, TP_IN)
    y = np.cos(np.arange(TP_ROWS * TP_IN, dtype=np.float32) * 0.11).reshape(TP_ROWS, TP_IN)
    return x, y


def tp_train_step(d, model, optimizer, in_spec, out_spec, *, stored=True):
    """The FSDP x TP recipe: storage by `partition_specs`, `shard_map` by `compute_specs`,
    gathered inside from the stored split (`stored_specs`; `stored=False`: entering whole)."""
    forward = shard_map(
        lambda m, x: m(x),
        mesh=d.device_mesh,
        in_specs=(d.compute_specs(model), in_spec),
        out_specs=out_spec,
        stored_specs=(d.partition_specs(model), in_spec) if stored else None,
    )
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, opt_state, x, y):
        loss_fn = lambda p: jnp.mean((forward(eqx.combine(p, static), x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
        return d.constrain(params), d.constrain(opt_state, params), loss

    return jax.jit(step), params


def place_tp(d, name):
    return d.build_model(TP_MODELS[name][0], jax.random.key(0))


@pytest.mark.parametrize("layout", ["mesh", "layout_map"])
def test_fsdp_keeps_tensor_parallel_splits_and_adds_the_data_axis(layout):
    d = fsdp_tp(layout)
    mlp = d.build_model(TPMLP, jax.random.key(0))
    assert has_spec(mlp.pre.weight, P("data", None))  # [128, 128]: nothing declared
    assert has_spec(mlp.pre.bias, P())  # 512 bytes
    assert has_spec(mlp.up.weight, P("model", "data"))  # declared P("model", None)
    assert has_spec(mlp.down.weight, P("data", "model"))  # declared P(None, "model")
    assert has_spec(mlp.up.bias, P("model"))  # 1 KiB: under the floor
    compute = d.compute_specs(mlp)
    assert compute.up.weight == P("model", None)
    assert compute.pre.weight in (P(), P(None, None))  # as the layout map writes it
    stack = d.distribute_model(TPStack(jax.random.key(0))) if layout == "mesh" else None
    if stack is not None:
        assert has_spec(stack.blocks.layers.up.weight, P(None, "model", "data"))
        assert has_spec(stack.blocks.layers.down.weight, P(None, "data", "model"))
        assert has_spec(stack.blocks.layers.up.bias, P(None, "model"))


@pytest.mark.parametrize(
    "name, layout", [("tp_mlp", "mesh"), ("tp_mlp", "layout_map"), ("scanned", "mesh")]
)
def test_fsdp_tp_sgd_step_equals_the_serial_step(name, layout):
    cls, in_spec, out_spec = TP_MODELS[name]
    d = fsdp_tp(layout)
    optimizer = optax.sgd(0.1)
    model = place_tp(d, name)
    x, y = tp_batch()
    step, params = tp_train_step(d, model, optimizer, in_spec, out_spec)
    opt_state = d.distribute_opt_state(optimizer.init(params), model)
    new_params, _, loss = step(params, opt_state, d.distribute_input(x), d.distribute_input(y))

    serial = cls(jax.random.key(0))
    serial_loss_fn = lambda m: jnp.mean((m.serial(jnp.asarray(x)) - jnp.asarray(y)) ** 2)
    serial_loss, grads = eqx.filter_value_and_grad(serial_loss_fn)(serial)
    updates, _ = optimizer.update(grads, optimizer.init(eqx.filter(serial, eqx.is_array)))
    want = eqx.apply_updates(serial, updates)

    assert_tree_close(loss, serial_loss, what="loss")
    specs = jax.tree.leaves(d.partition_specs(model), is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_flatten_with_path(new_params)[0]
    assert len(flat) == len(specs) == len(jax.tree.leaves(eqx.filter(want, eqx.is_array)))
    for (path, got), expected, spec in zip(
        flat, jax.tree.leaves(eqx.filter(want, eqx.is_array)), specs
    ):
        where = jax.tree_util.keystr(path)
        assert_tree_close(got, expected, what=where)
        assert has_spec(got, spec), (where, got.sharding, spec)


def test_fsdp_tp_sgd_step_entering_whole_equals_the_serial_step_too():
    """Without `stored_specs` the parameters enter `shard_map` whole (the compiler gathers
    them): the same step, by all-reduce."""
    _, in_spec, out_spec = TP_MODELS["tp_mlp"]
    d = fsdp_tp("mesh")
    optimizer = optax.sgd(0.1)
    model = place_tp(d, "tp_mlp")
    x, y = (d.distribute_input(a) for a in tp_batch())
    results = []
    for stored in (True, False):
        step, params = tp_train_step(d, model, optimizer, in_spec, out_spec, stored=stored)
        results.append(step(params, d.distribute_opt_state(optimizer.init(params), model), x, y))
    assert_tree_close(results[1][0], results[0][0], what="params")
    assert_tree_close(results[1][2], results[0][2], what="loss")


def ways(spec, sizes):
    """The number of blocks `spec` splits an array into on a mesh of `sizes`."""
    names = [n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,))]
    return int(np.prod([sizes[n] for n in names if n is not None]))


def test_fsdp_gradients_leave_by_reduce_scatter_not_all_reduce():
    """From the compiled step (exact): with `stored_specs` no all-reduce over `data` is as
    large as a split parameter's gradient block; every such gradient is reduce-scattered.
    Entering `shard_map` whole, the compiler all-reduces those gradients and slices them."""
    from _hlo import collective_ops, group_axes

    _, in_spec, out_spec = TP_MODELS["tp_mlp"]
    d = fsdp_tp("mesh")
    optimizer = optax.sgd(0.1)
    model = place_tp(d, "tp_mlp")
    sizes = dict(d.device_mesh.jax_mesh.shape)
    stored_specs = jax.tree.leaves(d.partition_specs(model), is_leaf=lambda s: isinstance(s, P))
    compute_specs = jax.tree.leaves(d.compute_specs(model), is_leaf=lambda s: isinstance(s, P))
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    # A split parameter's gradient inside shard_map: its block under the compute spec.
    blocks = [
        leaf.nbytes // ways(spec, sizes)
        for leaf, stored, spec in zip(leaves, stored_specs, compute_specs, strict=True)
        if stored != spec
    ]
    assert len(blocks) == 3, blocks  # pre, up and down weights
    x, y = (d.distribute_input(a) for a in tp_batch())
    largest_all_reduce, scattered = {}, {}
    for stored in (True, False):
        step, params = tp_train_step(d, model, optimizer, in_spec, out_spec, stored=stored)
        opt_state = d.distribute_opt_state(optimizer.init(params), model)
        ops = collective_ops(step.lower(params, opt_state, x, y).compile())
        over_data = [op for op in ops if "data" in group_axes(op.groups, sizes)]
        largest_all_reduce[stored] = max(
            op.array_bytes for op in over_data if op.kind == "all-reduce"
        )
        # A reduce-scatter's result is its input / the group: the gradient block / data.
        scattered[stored] = sum(
            op.array_bytes * op.group_size for op in over_data if op.kind == "reduce-scatter"
        )
    assert largest_all_reduce[True] < min(blocks), largest_all_reduce  # the loss, small biases
    assert scattered[True] == sum(blocks), (scattered, blocks)
    assert largest_all_reduce[False] >= sum(blocks) and scattered[False] == 0


@pytest.mark.parametrize("name", ["tp_block", "scanned"])  # only TPDense layers
def test_fsdp_tp_parameter_and_adam_bytes_per_device(name):
    _, in_spec, out_spec = TP_MODELS[name]
    d = fsdp_tp("mesh")
    ways = 8  # data x model
    optimizer = optax.adam(1e-3)
    model = place_tp(d, name)
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    weights = [leaf for path, leaf in flat if jax.tree_util.keystr(path).endswith(".weight")]
    assert len(weights) == 2 and min(w.nbytes for w in weights) >= 16 * 1024
    step, params = tp_train_step(d, model, optimizer, in_spec, out_spec)
    opt_state = d.distribute_opt_state(optimizer.init(params), model)
    if name == "tp_block":  # Adam's moments follow the parameters
        assert has_spec(opt_state[0].mu.up.weight, P("model", "data"))
    else:
        assert has_spec(opt_state[0].nu.blocks.layers.down.weight, P(None, "data", "model"))
    state = (params, opt_state)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    per_device = bytes_on_each_device(state)
    assert len(per_device) == 8
    assert max(per_device.values()) <= 1.05 * total / ways, (per_device, total / ways)
    # The compiled step's arguments: the stored parameters and Adam state, plus the batch.
    x, y = (d.distribute_input(a) for a in tp_batch())
    compiled = step.lower(params, opt_state, x, y).compile()
    batch_per_device = (x.nbytes + y.nbytes) / d.device_mesh.axis_size("data")
    from_compiler = compiled.memory_analysis().argument_size_in_bytes - batch_per_device
    assert from_compiler == pytest.approx(max(per_device.values()), rel=0.01)
    assert from_compiler <= 1.05 * total / ways, (from_compiler, total / ways)


# --- functions that read the current distribution ----------------------------------------------


def small_mlp(key):
    return eqx.nn.MLP(8, 8, 64, 1, key=key)  # layers/0/weight [64, 8]: 2 KiB


def test_module_functions_use_the_current_distribution():
    dp = DataParallel()
    fsdp = FSDP(min_size_bytes=0)
    mesh = DeviceMesh((2, 4), ("data", "model"))
    tp_only = ModelParallel(layout_map=megatron_layout_map(mesh), split_batch=False)
    set_distribution(dp)
    model = build_model(small_mlp, jax.random.key(0))
    assert has_spec(model.layers[0].weight, P())
    assert distribute_input(np.ones((8, 2))).sharding.spec == P("data", None)
    with fsdp.scope():
        model = build_model(small_mlp, jax.random.key(0))
        assert has_spec(model.layers[0].weight, P("data", None))
        state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
        state = distribute_opt_state(state, model)
        assert has_spec(state[0].mu.layers[0].weight, P("data", None))
        with tp_only.scope():  # the innermost scope wins
            placed = distribute_model(make_mlp(jax.random.key(0)))
            assert has_spec(placed.layers[1].weight, P(None, "model"))
            x = distribute_input(np.ones((7, 2)))  # replicated: any batch size
            assert has_spec(x, P()) and x.addressable_shards[0].data.shape == (7, 2)
            # An explicit distribution wins over the current one.
            assert distribute_input(np.ones((8, 2)), distribution=dp).sharding.spec == P(
                "data", None
            )
            built = build_model(small_mlp, jax.random.key(0), distribution=fsdp)
            assert has_spec(built.layers[0].weight, P("data", None))
        x, mask = distribute_input(np.ones((6, 2)), pad=True)
        assert x.shape == (8, 2) and int(mask.sum()) == 6
    assert distribute_model(model).layers[0].weight.sharding.spec == P()  # dp again


def test_build_sharded_uses_the_current_distribution():
    fsdp = FSDP(min_size_bytes=0)
    with fsdp.scope():
        model = build_sharded(small_mlp, jax.random.key(0))
        assert has_spec(model.layers[0].weight, P("data", None))
        # Own specs on the current distribution's mesh.
        replicated = build_sharded(small_mlp, jax.random.key(0), specs=P())
        assert has_spec(replicated.layers[0].weight, P())
        assert replicated.layers[0].weight.sharding.mesh == fsdp.device_mesh.jax_mesh
    eager = small_mlp(jax.random.key(0))
    np.testing.assert_array_equal(model.layers[0].weight, eager.layers[0].weight)


def test_without_a_distribution_the_functions_say_how_to_set_one():
    assert distribution() is None
    message = (
        r"no distribution given and none is current: pass distribution=\.\.\. or call "
        r"eqpar\.set_distribution\(\.\.\.\) / use `with d\.scope\(\):`"
    )
    model = small_mlp(jax.random.key(0))
    with pytest.raises(ValueError, match="build_model: " + message):
        build_model(small_mlp, jax.random.key(0))
    with pytest.raises(ValueError, match="distribute_model: " + message):
        distribute_model(model)
    with pytest.raises(ValueError, match="distribute_input: " + message):
        distribute_input(np.ones((8, 2)))
    with pytest.raises(ValueError, match="distribute_opt_state: " + message):
        distribute_opt_state({}, model)
    with pytest.raises(ValueError, match="build_sharded: mesh is None and no distribution"):
        build_sharded(small_mlp, jax.random.key(0))


# --- an unsplit batch --------------------------------------------------------------------------


def test_model_parallel_can_leave_the_batch_unsplit():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    layout_map = megatron_layout_map(mesh)
    mp = ModelParallel(layout_map=layout_map, split_batch=False)
    assert mp.batch_dim_name is None and not mp.split_batch
    assert mp.batch_sharding(3).spec == P()
    batch = {"x": np.ones((5, 3), np.float32), "y": np.arange(5)}
    placed = mp.distribute_input(batch)
    for leaf in jax.tree.leaves(placed):
        assert has_spec(leaf, P()) and leaf.addressable_shards[0].data.shape == leaf.shape
    placed, mask = mp.distribute_input(np.ones((5, 3)), pad=True)  # nothing to pad
    assert placed.shape == (5, 3) and bool(mask.all())
    assert "split_batch=False" in repr(mp)
    # The default still splits over the first axis.
    assert ModelParallel(layout_map=layout_map).batch_sharding(2).spec == P("data", None)
    with pytest.raises(ValueError, match=r"split_batch=False replicates the batch.*'data'"):
        ModelParallel(layout_map=layout_map, batch_dim_name="data", split_batch=False)
