"""Tensor-parallel layers against their serial twin, eqx.nn.Linear, with the same weights."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collective_bytes, collective_ops, memory_figures
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

from eqpar import collectives
from eqpar._declare import declared_partition_specs
from eqpar._paths import path_to_str
from eqpar.nn import ModelParallelismWrapper, TPAsyncDense, TPDense, scale_init

IN, OUT = 16, 24  # divisible by 1, 2, 4, 8


def mesh_of(n: int, name: str = "model") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (name,))


def module_specs(module):
    declared = declared_partition_specs(module)
    flat, treedef = jax.tree_util.tree_flatten_with_path(module)
    specs = [
        declared.get(path_to_str(path), P()) if eqx.is_array(leaf) else None for path, leaf in flat
    ]
    return jax.tree_util.tree_unflatten(treedef, specs)


def sharded_apply(module, x, mesh, x_spec, out_spec, fn=lambda m, x: m(x)):
    """fn(module, x) inside shard_map, the module's arrays sharded as they declare."""
    arrays, static = eqx.partition(module, eqx.is_array)
    specs = jax.tree.map(lambda a, s: s, arrays, module_specs(module))

    def inner(arrays, x):
        return fn(eqx.combine(arrays, static), x)

    # Compiled: eager shard_map dispatches op by op (a compile per new op and shape).
    mapped = jax.shard_map(inner, mesh=mesh, in_specs=(specs, x_spec), out_specs=out_spec)
    return jax.jit(mapped)(arrays, x)


def feature_spec(ndim):
    """Features (the last axis) sharded over 'model'."""
    return P(*([None] * (ndim - 1)), "model")


def layer_specs(tp_mode, ndim):
    """(input spec, output spec) for an x of rank `ndim` with features last."""
    if tp_mode == "none":
        return P(), P()
    return feature_spec(ndim), feature_spec(ndim)


VARIANTS = [
    ("dense", TPDense, {}),
    ("async", TPAsyncDense, {}),
    ("async-bidir-gather", TPAsyncDense, {"use_bidirectional_gather": True}),
    ("async-bidir-scatter", TPAsyncDense, {"use_bidirectional_scatter": True}),
]


def build(cls, options, tp_mode, key=0):
    linear = eqx.nn.Linear(IN, OUT, key=jax.random.key(key))
    return linear, cls.from_linear(linear, tp_mode=tp_mode, **options)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("tp_mode", ["gather", "scatter", "none"])
@pytest.mark.parametrize(("name", "cls", "options"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_forward_and_gradients_match_linear(n, tp_mode, name, cls, options):
    if tp_mode == "none" and name != "dense" and n not in (1, 8):
        return  # mode "none" communicates nothing; the async options cannot change it
    linear, layer = build(cls, options, tp_mode)
    mesh = mesh_of(n)
    x_spec, out_spec = layer_specs(tp_mode, 3)
    x = jax.random.normal(jax.random.key(1), (2, 3, IN))  # extra leading dims
    cotangent = jax.random.normal(jax.random.key(2), (2, 3, OUT))

    def parallel_loss(layer, x):
        return jnp.sum(sharded_apply(layer, x, mesh, x_spec, out_spec) * cotangent)

    def serial_loss(linear, x):
        return jnp.sum(
            jnp.einsum("...i,oi->...o", x, linear.weight) * cotangent + linear.bias * cotangent
        )

    @jax.jit
    def parallel(layer, x):
        out = sharded_apply(layer, x, mesh, x_spec, out_spec)
        return out, jax.grad(parallel_loss, argnums=(0, 1))(layer, x)

    got, (g_layer, g_x) = parallel(layer, x)
    assert_tree_close(got, jax.vmap(jax.vmap(linear))(x), what="output")
    (g_linear, g_x_ref) = jax.grad(serial_loss, argnums=(0, 1))(linear, x)
    assert_tree_close(g_layer.weight, g_linear.weight, what="weight gradient")
    assert_tree_close(g_layer.bias, g_linear.bias, what="bias gradient")
    assert_tree_close(g_x, g_x_ref, what="input gradient")


@pytest.mark.parametrize(("name", "cls", "options"), VARIANTS, ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("tp_mode", ["gather", "scatter"])
def test_unbatched_input(name, cls, options, tp_mode):
    linear, layer = build(cls, options, tp_mode)
    x = jax.random.normal(jax.random.key(3), (IN,))
    got = jax.jit(lambda m, x: sharded_apply(m, x, mesh_of(4), P("model"), P("model")))(layer, x)
    assert_tree_close(got, linear(x))


def test_declared_specs():
    gather = TPDense(IN, OUT, tp_mode="gather", key=jax.random.key(0))
    scatter = TPAsyncDense(IN, OUT, tp_mode="scatter", model_axis_name="tp", key=jax.random.key(0))
    none = TPDense(IN, OUT, tp_mode="none", use_bias=False, key=jax.random.key(0))
    assert declared_partition_specs(gather) == {"weight": P("model", None), "bias": P("model")}
    assert declared_partition_specs(scatter) == {"weight": P(None, "tp"), "bias": P("tp")}
    assert declared_partition_specs(none) == {"weight": P()}


def test_same_init_as_linear_and_round_trip():
    layer = TPDense(IN, OUT, tp_mode="gather", key=jax.random.key(5))
    linear = eqx.nn.Linear(IN, OUT, key=jax.random.key(5))
    assert (layer.weight == linear.weight).all() and (layer.bias == linear.bias).all()
    back = layer.to_linear()
    assert (back.weight == linear.weight).all()
    assert isinstance(TPAsyncDense.from_linear(linear, tp_mode="gather"), TPAsyncDense)


def test_kernel_init_and_scale_init():
    init = scale_init(jax.nn.initializers.ones, 0.25)
    layer = TPDense(4, 2, tp_mode="none", kernel_init=init, key=jax.random.key(0))
    np.testing.assert_array_equal(layer.weight, 0.25 * np.ones((2, 4)))
    with pytest.raises(TypeError, match="init_fn"):
        scale_init(3.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kernel_init returned shape \(4, 2\); expected \(2, 4\)"):
        TPDense(
            4,
            2,
            tp_mode="none",
            kernel_init=lambda k, s, d: jnp.ones(s[::-1]),
            key=jax.random.key(0),
        )


def test_skip_communication_shares_one_gather_and_leaves_reduction_to_caller():
    from jax import lax

    n, mesh = 4, mesh_of(4)
    q_lin = eqx.nn.Linear(IN, OUT, key=jax.random.key(0))
    k_lin = eqx.nn.Linear(IN, OUT, key=jax.random.key(1))
    q = TPDense.from_linear(q_lin, tp_mode="gather", skip_communication=True)
    k = TPDense.from_linear(k_lin, tp_mode="gather", skip_communication=True)
    x = jax.random.normal(jax.random.key(2), (3, IN))

    def fn(pair, x):
        full = lax.all_gather(x, "model", axis=1, tiled=True)
        return pair[0](full) + pair[1](full)

    got = sharded_apply((q, k), x, mesh, P(None, "model"), P(None, "model"), fn)
    assert_tree_close(got, jax.vmap(q_lin)(x) + jax.vmap(k_lin)(x))

    row = eqx.nn.Linear(IN, OUT, use_bias=False, key=jax.random.key(3))
    partial = TPAsyncDense.from_linear(row, tp_mode="scatter", skip_communication=True)
    reduce = lambda m, x: lax.psum(m(x), "model")
    got = sharded_apply(partial, x, mesh, P(None, "model"), P(), reduce)
    assert_tree_close(got, jax.vmap(row)(x))
    del n


def test_validation_errors():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"tp_mode must be one of .* got 'column'"):
        TPDense(4, 4, tp_mode="column", key=key)
    with pytest.raises(ValueError, match="`in_features` must be at least 1, got 0"):
        TPDense(0, 4, tp_mode="gather", key=key)
    with pytest.raises(ValueError, match="Pass use_bias=False"):
        TPDense(4, 4, tp_mode="scatter", skip_communication=True, key=key)
    with pytest.raises(TypeError, match="linear"):
        TPDense.from_linear(eqx.nn.MLP(2, 2, 2, 1, key=key), tp_mode="gather")  # type: ignore[arg-type]
    layer = TPDense(6, 8, tp_mode="gather", key=key)
    with pytest.raises(
        ValueError,
        match=r"TPDense\(6 -> 8, tp_mode='gather'\): in_features=6 does not divide by the "
        r"size of axis 'model' \(4\)",
    ):
        sharded_apply(layer, jnp.ones((2, 8)), mesh_of(4), P(None, "model"), P(None, "model"))
    with pytest.raises(ValueError, match="model_axis_name='tp'` is not a mesh axis bound here"):
        bad = TPDense(8, 8, tp_mode="gather", model_axis_name="tp", key=key)
        jax.shard_map(
            lambda x: bad(x), mesh=mesh_of(2), in_specs=P(None, "model"), out_specs=P(None, "model")
        )(jnp.ones((2, 8)))
    with pytest.raises(
        ValueError, match=r"local weight block has shape \(8, 8\).*expects \(4, 8\)"
    ):
        ok = TPDense(8, 8, tp_mode="gather", key=key)  # closed over: not sharded
        jax.shard_map(
            lambda x: ok(x), mesh=mesh_of(2), in_specs=P(None, "model"), out_specs=P(None, "model")
        )(jnp.ones((2, 8)))


def test_checkpoint_trained_at_8_loads_at_2_and_serial(tmp_path):
    layer = TPAsyncDense(
        IN, OUT, tp_mode="scatter", use_bidirectional_scatter=True, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (4, IN))
    target = jax.random.normal(jax.random.key(2), (4, OUT))
    mesh8 = mesh_of(8)

    @jax.jit
    def step(layer):
        def loss(layer):
            y = sharded_apply(layer, x, mesh8, P(None, "model"), P(None, "model"))
            return jnp.mean((y - target) ** 2)

        grads = jax.grad(loss)(layer)
        return jax.tree.map(lambda p, g: p - 0.1 * g, layer, grads)

    for _ in range(3):
        layer = step(layer)
    path = tmp_path / "layer.eqx"
    eqx.tree_serialise_leaves(path, layer)

    at2 = eqx.tree_deserialise_leaves(
        path, TPDense(IN, OUT, tp_mode="scatter", key=jax.random.key(9))
    )
    serial = eqx.tree_deserialise_leaves(path, eqx.nn.Linear(IN, OUT, key=jax.random.key(9)))
    expected = sharded_apply(layer, x, mesh8, P(None, "model"), P(None, "model"))
    assert_tree_close(
        sharded_apply(at2, x, mesh_of(2), P(None, "model"), P(None, "model")), expected
    )
    assert_tree_close(jax.vmap(serial)(x), expected)
    assert not np.allclose(serial.weight, eqx.nn.Linear(IN, OUT, key=jax.random.key(0)).weight)


def test_model_parallelism_wrapper():
    n, mesh = 4, mesh_of(4)
    make = lambda k: eqx.nn.Linear(3, 2, key=k)
    wrapper = ModelParallelismWrapper(
        make, model_axis_name="model", axis_size=n, key=jax.random.key(0)
    )
    assert declared_partition_specs(wrapper) == {
        "module/weight": P("model"),
        "module/bias": P("model"),
    }
    x = jnp.arange(3.0)
    got = sharded_apply(wrapper, x, mesh, P(), P("model"), lambda m, x: m(x)[None])
    keys = jax.random.split(jax.random.key(0), n)
    for i in range(n):
        assert_tree_close(got[i], make(keys[i])(x), rtol=1e-6)
    assert not np.allclose(got[0], got[1])

    same = ModelParallelismWrapper(
        make, model_axis_name="model", axis_size=n, key=jax.random.key(0), split_keys=False
    )
    got = sharded_apply(same, x, mesh, P(), P("model"), lambda m, x: m(x)[None])
    np.testing.assert_allclose(got, jnp.broadcast_to(got[0], got.shape))

    masked = ModelParallelismWrapper(
        make, model_axis_name="model", axis_size=n, key=jax.random.key(0), mask_except_model_idx=2
    )
    got = sharded_apply(masked, x, mesh, P(), P("model"), lambda m, x: m(x)[None])
    assert_tree_close(got[2], make(keys[2])(x), rtol=1e-6)
    assert float(jnp.abs(got[jnp.array([0, 1, 3])]).max()) == 0.0

    with pytest.raises(
        ValueError, match=r"mask_except_model_idx must be in \[0, axis_size\) = \[0, 4\); got 4"
    ):
        ModelParallelismWrapper(
            make,
            model_axis_name="model",
            axis_size=4,
            key=jax.random.key(0),
            mask_except_model_idx=4,
        )
    with pytest.raises(ValueError, match="built with axis_size=4 but axis 'model' has size 2"):
        sharded_apply(wrapper, x, mesh_of(2), P(), P("model"), lambda m, x: m(x)[None])


# --- what moves and what is held ------------------------------------------------------------


def compiled_layer(layer, n, batch=32):
    x = jnp.ones((batch, IN * 4))
    mesh = mesh_of(n)
    fn = jax.jit(lambda layer, x: sharded_apply(layer, x, mesh, P(None, "model"), P(None, "model")))
    return fn.lower(layer, x).compile()


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("cls", [TPDense, TPAsyncDense])
def test_hlo_bytes_moved_per_device(n, cls):
    batch, d_in, d_out = 32, IN * 4, OUT * 4
    for tp_mode, full_bytes in (("gather", batch * d_in * 4), ("scatter", batch * d_out * 4)):
        layer = cls(d_in, d_out, tp_mode=tp_mode, key=jax.random.key(0))
        ops = collective_ops(compiled_layer(layer, n).as_text())
        moved = sum(op.bytes_per_device * op.executions for op in ops)
        assert moved == pytest.approx(full_bytes * (n - 1) / n), (tp_mode, ops)


def test_async_gather_holds_less_than_dense_at_8():
    d_in, d_out = IN * 4, OUT * 4
    dense = TPDense(d_in, d_out, tp_mode="gather", key=jax.random.key(0))
    ring = TPAsyncDense.from_linear(dense.to_linear(), tp_mode="gather")
    temp_dense = memory_figures(compiled_layer(dense, 8, batch=256))["temp"]
    temp_ring = memory_figures(compiled_layer(ring, 8, batch=256))["temp"]
    assert temp_ring < temp_dense, (temp_ring, temp_dense)


def test_rings_at_sizes_that_are_not_powers_of_two_match_linear():
    """Odd rings and the lone first step of even bidirectional ones, every path of TPAsyncDense:
    its forward without gradients, and its custom gradients."""
    d_in, d_out = 30, 60  # divisible by 1 .. 6
    linear = eqx.nn.Linear(d_in, d_out, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, d_in))
    cotangent = jax.random.normal(jax.random.key(2), (2, d_out))
    serial = jax.grad(lambda m, x: jnp.sum(jax.vmap(m)(x) * cotangent), argnums=(0, 1))
    g_linear, g_x_ref = serial(linear, x)
    layers = {
        (mode, both): TPAsyncDense.from_linear(
            linear,
            tp_mode=mode,
            use_bidirectional_gather=both,
            use_bidirectional_scatter=both,
        )
        for mode in ("gather", "scatter")
        for both in (False, True)
    }
    # n = 3: both directions are odd rings; n = 6: the even bidirectional rings' lone step.
    for n, runs in ((3, layers), (6, {k: m for k, m in layers.items() if k[1]})):
        mesh = mesh_of(n)

        def apply(layer, x, mesh=mesh):
            return sharded_apply(layer, x, mesh, P(None, "model"), P(None, "model"))

        @jax.jit
        def run(layers, x):
            loss = lambda layer, x: jnp.sum(apply(layer, x) * cotangent)
            return {
                k: (apply(m, x), jax.grad(loss, argnums=(0, 1))(m, x)) for k, m in layers.items()
            }

        for key, (out, (g_layer, g_x)) in run(runs, x).items():
            assert_tree_close(
                (out, g_layer.weight, g_layer.bias, g_x),
                (jax.vmap(linear)(x), g_linear.weight, g_linear.bias, g_x_ref),
                what=f"{n} {key} (output, weight, bias and input gradients)",
            )


@pytest.mark.parametrize("walk", [True, False], ids=["walk", "gather-once"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("tp_mode", ["gather", "scatter"])
def test_async_training_paths_match_dense_and_linear(monkeypatch, walk, n, tp_mode):
    """Both training paths of TPAsyncDense's custom gradients, forced either way: every
    collective a ring (the gather-mode input walked round again in the backward pass for the
    weight gradient, the scatter-mode output gradient walked round for both gradients), or the
    one all-gather where a ring would hold more. Output, input/weight/bias gradients and one
    SGD step against TPDense and to_linear(), one way round and both."""
    monkeypatch.setattr(collectives, "_walk_holds_less", lambda *_: walk)
    linear = eqx.nn.Linear(IN, OUT, key=jax.random.key(4))
    x = jax.random.normal(jax.random.key(5), (2, 3, IN))
    target = jax.random.normal(jax.random.key(6), (2, 3, OUT))
    mesh, spec = mesh_of(n), feature_spec(3)
    layers = {
        "dense": TPDense.from_linear(linear, tp_mode=tp_mode),
        "async": TPAsyncDense.from_linear(linear, tp_mode=tp_mode),
        "async both ways": TPAsyncDense.from_linear(
            linear, tp_mode=tp_mode, use_bidirectional_gather=True, use_bidirectional_scatter=True
        ),
    }

    def sgd_step(model, x, apply):
        def loss(model, x):
            y = apply(model, x)
            return jnp.mean((y - target) ** 2), y

        (_, y), (g_model, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
        updated = jax.tree.map(lambda p, g: p - 0.1 * g, model, g_model)
        return y, g_model, g_x, updated

    serial = sgd_step(linear, x, lambda m, x: jax.vmap(jax.vmap(m))(x))
    parallel = jax.jit(
        lambda layers, x: {
            name: sgd_step(m, x, lambda m, x: sharded_apply(m, x, mesh, spec, spec))
            for name, m in layers.items()
        }
    )(layers, x)
    y_ref, g_ref, g_x_ref, updated_ref = serial
    for name, (y, g_layer, g_x, updated) in parallel.items():
        assert_tree_close(
            (y, g_x, g_layer.weight, g_layer.bias, updated.to_linear().weight, updated.bias),
            (y_ref, g_x_ref, g_ref.weight, g_ref.bias, updated_ref.weight, updated_ref.bias),
            what=f"{name} {tp_mode} n={n} walk={walk} (output, gradients, SGD step)",
        )


def _training_collectives(layer, n, tokens=16):
    """The collectives of a compiled training step (gradients of the layer and the input)."""
    x = jnp.ones((tokens, layer.in_features))
    spec = P(None, "model")

    def loss(layer, x):
        return jnp.mean(sharded_apply(layer, x, mesh_of(n), spec, spec) ** 2)

    compiled = jax.jit(jax.grad(loss, (0, 1))).lower(layer, x).compile()
    return collective_ops(compiled.as_text())


@pytest.mark.parametrize("tp_mode", ["gather", "scatter"])
def test_async_training_step_holds_no_gathered_input_or_gradient(tp_mode):
    """Where a ring holds less (a square layer at n = 4), TPAsyncDense's training step runs
    every collective as ring steps: no all-gather of the input (gather mode) or of the output
    gradient (scatter mode); only collective-permutes. Gather mode walks its input round
    again in the backward pass (up to a third transfer of the input's size, where TPDense
    keeps the gathered input from the forward pass); scatter mode moves what TPDense moves."""
    d, n = 32, 4
    ring = TPAsyncDense(d, d, tp_mode=tp_mode, key=jax.random.key(0))
    dense = TPDense.from_linear(ring.to_linear(), tp_mode=tp_mode)
    ops = _training_collectives(ring, n)
    assert {op.kind for op in ops} == {"collective-permute"}, ops
    moved = sum(op.bytes_per_device * op.executions for op in ops)
    dense_moved = sum(op.bytes_per_device * op.executions for op in _training_collectives(dense, n))
    if tp_mode == "scatter":
        assert moved == dense_moved, (moved, dense_moved)
    else:  # at most the input's blocks once more (the compiler may share the first step's)
        assert dense_moved < moved <= 1.5 * dense_moved, (moved, dense_moved)
    # Where a ring would hold more (an up projection at n = 2), the gather stays one collective.
    wide = TPAsyncDense(d, 4 * d, tp_mode=tp_mode, key=jax.random.key(0))
    if tp_mode == "scatter":
        wide = TPAsyncDense(4 * d, d, tp_mode=tp_mode, key=jax.random.key(0))
    kinds = [op.kind for op in _training_collectives(wide, 2)]
    assert kinds.count("all-gather") == 1, kinds


def test_ring_training_step_copies_no_weight_and_holds_no_more_than_tpdense():
    """A training step of the MLP block on rings (as in benchmarks/tensor_parallel.py): each
    ring step slices one weight block in place (no gather of the weight into ring order), the
    same bytes cross the interconnect as with TPDense, and the step holds no more temporary
    memory."""
    from eqpar.nn import TPMLPBlock

    d_model, d_hidden, tokens = 32, 128, 64
    x = jnp.ones((tokens, d_model))
    dense_block = TPMLPBlock(d_model, d_hidden, key=jax.random.key(0))
    ring_block = TPMLPBlock(d_model, d_hidden, use_ring=True, key=jax.random.key(0))

    def compiled_step(block, n, argnums: int | tuple[int, ...] = 0):
        def loss(block, x):
            y = sharded_apply(block, x, mesh_of(n), P(None, "model"), P(None, "model"))
            return jnp.mean(y**2)

        return jax.jit(jax.grad(loss, argnums)).lower(block, x).compile()

    for n in (2, 4, 8):
        ring, dense = compiled_step(ring_block, n), compiled_step(dense_block, n)
        assert memory_figures(ring)["temp"] <= memory_figures(dense)["temp"], n
    # With the input gradient too, every ring of the block is in the program.
    text = str(compiled_step(ring_block, 4, (0, 1)).as_text())
    assert " gather(" not in text
    slices = [
        int(np.prod([int(s) for s in sizes.split(",")]))
        for sizes in re.findall(r"dynamic_slice_sizes=\{([\d,]+)\}", text)
    ]
    assert slices and max(slices) == d_model * d_hidden // 4**2, slices  # one weight block
    dense_text = str(compiled_step(dense_block, 4, (0, 1)).as_text())
    assert collective_bytes(text) == collective_bytes(dense_text)
