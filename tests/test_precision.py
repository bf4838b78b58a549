"""Mixed precision (`eqpar.Precision`): casting semantics, parallel paths against their serial
twin under the same policy, and the bytes of the data-parallel gradient reduction."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collective_ops
from jax import lax
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

import eqpar

BF16 = eqpar.Precision.bfloat16()
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7: one unit in the last place at 1.0
F32 = eqpar.Precision.float32()
DIM, HEADS, HIDDEN, SEQ, BATCH = 32, 4, 64, 8, 8


class Net(eqx.Module):
    """Written the way Equinox's docs write a model: `eqx.nn` layers, one example at a time."""

    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm = eqx.nn.LayerNorm(DIM)
        self.attention = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.up = eqx.nn.Linear(DIM, HIDDEN, key=k2)
        self.down = eqx.nn.Linear(HIDDEN, DIM, key=k3)

    def example(self, x):
        y = jax.vmap(self.norm)(x)
        x = x + self.attention(y, y, y)
        return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(x)

    def __call__(self, x):
        return jax.vmap(self.example)(x)


def loss(model, x, y):
    """The mean squared error in float32 whatever the compute dtype."""
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def mesh_of(data, model=1):
    return eqpar.DeviceMesh((data, model), ("data", "model"), devices=jax.devices()[: data * model])


@pytest.fixture(scope="module")
def problem():
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, SEQ, DIM))
    y = jax.random.normal(ky, (BATCH, SEQ, DIM))
    return Net(jax.random.key(0)), x, y


@pytest.fixture(scope="module")
def serial_bfloat16(problem):
    """The serial twin's loss and gradients under the bfloat16 policy."""
    return serial_value_and_grad(BF16, *problem)


def serial_value_and_grad(policy, model, x, y):
    def f(model, x, y):
        model, x = policy.cast_to_compute((model, x))
        return policy.cast_to_output(loss(model, x, y))

    return eqx.filter_jit(eqx.filter_value_and_grad(f))(model, x, y)


def parallel_value_and_grad(policy, model, mesh, x, y):
    """The cast outside `shard_map`, so the backward pass's collectives run in compute dtype."""
    sharded = eqpar.shard_map(
        lambda m, x, y: lax.pmean(loss(m, x, y), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(model), P("data"), P("data")),
        out_specs=P(),
    )

    def f(model, x, y):
        model, x = policy.cast_to_compute((model, x))
        return policy.cast_to_output(sharded(model, x, y))

    return eqx.filter_jit(eqx.filter_value_and_grad(f))(model, x, y)


def leaves(tree):
    return jax.tree.leaves(eqx.filter(eqpar.unparallelize(tree), eqx.is_inexact_array))


def assert_close_in_norm(got_tree, want_tree, tolerance):
    """Each leaf's error relative to its norm within `tolerance`. Elementwise tolerances do
    not suit bfloat16: a gradient element that is a sum of cancelling terms keeps the
    rounding of its terms (2**-9 of each), which is large against the small sum."""
    for got, want in zip(leaves(got_tree), leaves(want_tree), strict=True):
        assert got.dtype == want.dtype
        error = np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(want)
        assert error < tolerance, (got.shape, error)


# --- the policy ------------------------------------------------------------------------------


def test_casts_only_floating_array_leaves():
    tree = {
        "ids": jnp.arange(3),
        "mask": jnp.ones(3, bool),
        "x": jnp.ones(3),
        "host": np.ones(2, np.float32),
        "scale": 0.5,
        "name": "layer",
    }
    cast = BF16.cast_to_compute(tree)
    assert cast["ids"].dtype == jnp.int32 and cast["mask"].dtype == jnp.bool_
    assert cast["x"].dtype == jnp.bfloat16 and cast["host"].dtype == jnp.bfloat16
    assert cast["scale"] == 0.5 and cast["name"] == "layer"  # non-array leaves pass through
    back = BF16.cast_to_param(cast)
    assert back["x"].dtype == jnp.float32 and back["ids"].dtype == jnp.int32
    assert BF16.cast_to_output(cast)["host"].dtype == jnp.float32
    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    same = F32.cast_to_compute(model)  # nothing to cast: the very same arrays
    assert same.weight is model.weight and same.bias is model.bias


def test_presets_and_names():
    assert BF16 == eqpar.Precision(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16)
    assert BF16.output_dtype == jnp.float32  # defaults to the parameter dtype
    assert eqpar.Precision.from_name("float32") == F32 and F32.name == "float32"
    assert hash(BF16) == hash(eqpar.Precision.bfloat16())
    custom = eqpar.Precision(compute_dtype="bfloat16", output_dtype=jnp.bfloat16)
    assert custom.name == "params=float32,compute=bfloat16,output=bfloat16"


def test_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"compute_dtype=float16 is not supported.*loss scaling"):
        eqpar.Precision(compute_dtype=jnp.float16)
    with pytest.raises(
        ValueError, match="param_dtype must be float32, bfloat16 or float64; got int32"
    ):
        eqpar.Precision(param_dtype=jnp.int32)
    with pytest.raises(TypeError, match="output_dtype must be a floating dtype"):
        eqpar.Precision(output_dtype="not a dtype")
    with pytest.raises(
        ValueError, match=r"name must be one of \('float32', 'bfloat16'\); got 'fp8'"
    ):
        eqpar.Precision.from_name("fp8")


def test_none_and_float64_without_x64_are_refused_naming_the_argument():
    # None is not a dtype: NumPy would read it as float64.
    for argument in ("param_dtype", "compute_dtype"):
        with pytest.raises(TypeError, match=rf"{argument}=None is not a dtype.*jnp.float32"):
            eqpar.Precision(**{argument: None})
    assert eqpar.Precision(output_dtype=None).output_dtype == jnp.float32  # follows params
    # float64 with 64-bit mode off would be cast to float32 behind the user's back.
    assert not jax.config.read("jax_enable_x64")
    for argument in ("param_dtype", "compute_dtype", "output_dtype"):
        with pytest.raises(
            ValueError,
            match=rf"{argument}=float64 needs JAX's 64-bit mode.*"
            r'jax\.config\.update\("jax_enable_x64", True\)',
        ):
            eqpar.Precision(**{argument: jnp.float64})
    # A policy built with 64-bit mode on refuses to cast once it is off.
    with jax.enable_x64(True):
        policy = eqpar.Precision(param_dtype=jnp.float64, compute_dtype=jnp.float64)
        assert policy.cast_to_compute(jnp.ones(2, jnp.float32)).dtype == jnp.float64
    with pytest.raises(ValueError, match=r"compute_dtype=float64 needs JAX's 64-bit mode"):
        policy.cast_to_compute(jnp.ones(2))


def test_gradients_come_back_in_the_parameter_dtype(problem, serial_bfloat16):
    model, x, y = problem
    value, grads = serial_bfloat16
    assert value.dtype == jnp.float32
    assert {g.dtype for g in leaves(grads)} == {jnp.dtype(jnp.float32)}
    # bfloat16 compute is an approximation of the float32 result, not something else
    value32, grads32 = serial_value_and_grad(F32, model, x, y)
    # bfloat16 rounds each product to 2**-9 (2e-3) of itself; the mean averages that down.
    assert_tree_close(value, value32, rtol=1e-3)
    assert_close_in_norm(grads, grads32, 3e-2)  # measured: at most 1.2e-2


# --- serial twins under the same policy -----------------------------------------------------


def test_data_parallel_equals_serial_under_bfloat16(problem, serial_bfloat16):
    model, x, y = problem
    mesh = mesh_of(8)
    # The forward pass of each row is the same ops on one device and on eight, but in two
    # programs, which the compiler may tile and fuse differently: a matmul's float32
    # accumulation in another order can move its bfloat16 result by one unit in the last
    # place (BF16_EPS of its magnitude), which the layers after it carry on. Two such units
    # of the output's scale (the same bits on JAX 0.10 and 0.12 today).
    forward = eqpar.shard_map(
        lambda m, x: m(x), mesh=mesh, in_specs=(eqpar.partition_specs(model), P("data")),
        out_specs=P("data"),
    )  # fmt: skip
    cast_model, cast_x = BF16.cast_to_compute((model, x))
    assert_tree_close(
        eqx.filter_jit(forward)(cast_model, cast_x),
        eqx.filter_jit(cast_model)(cast_x),
        rtol=2 * BF16_EPS,
    )
    # Gradients: each device rounds its shard's sum to bfloat16 before the reduction over
    # `data`, while one device rounds the whole sum once. Even the layer norm's, whose
    # parameters are float32 (on JAX 0.10 their gradients came out the same bits; on 0.12
    # they are summed from bfloat16 terms, 15 of 32 elements differ, by 3.2e-3 of the
    # leaf's scale): each rounding moves a partial sum by at most half a unit in the last
    # place (BF16_EPS / 2 of it, and a partial is at most the leaf's scale where the
    # devices' terms do not cancel), once on the device and once in the total.
    value, grads = parallel_value_and_grad(BF16, model, mesh, x, y)
    serial_value, serial_grads = serial_bfloat16
    assert_tree_close(value, serial_value, rtol=1e-6)
    assert_tree_close(grads.norm.weight, serial_grads.norm.weight, rtol=BF16_EPS)
    assert_close_in_norm(grads, serial_grads, 3e-2)  # measured: at most 1.3e-2


PLAN = {
    "attention": eqpar.HeadParallel("model"),
    "up": eqpar.ColumnParallel("model"),
    "down": eqpar.RowParallel("model"),
}


def test_tensor_parallel_equals_serial_under_bfloat16(problem, serial_bfloat16):
    model, x, y = problem
    mesh = mesh_of(2, 4)
    parallel = eqpar.parallelize(model, PLAN, mesh=mesh)
    value, grads = parallel_value_and_grad(BF16, parallel, mesh, x, y)
    serial_value, serial_grads = serial_bfloat16
    # Each device rounds its partial sums to bfloat16 (2**-9) before the reduction over
    # `model`: a bfloat16 tolerance, not float32's.
    assert_tree_close(value, serial_value, rtol=5e-4)  # measured: 6e-5
    assert_close_in_norm(grads, serial_grads, 3e-2)  # measured: at most 1.1e-2


# --- the bytes of the gradient reduction ----------------------------------------------------


def lowered_collectives(lowered):
    """The collectives of the program JAX hands to XLA (before the backend's passes).

    XLA's CPU compiler promotes every bfloat16 all-reduce to float32 (its collectives have no
    bfloat16 reduction), so on CPU the compiled program moves float32 either way; GPU and TPU
    compilers keep the dtype JAX asked for, which is what this reads."""
    text = lowered.as_text(dialect="hlo")
    # Unoptimized HLO text writes computations without parameter lists: `ENTRY main.9 {`.
    text = re.sub(r"^((?:ENTRY )?\S+) \{$", r"\1 () {", text, flags=re.MULTILINE)
    return collective_ops(text)


def data_parallel_reduction_bytes(policy, model, mesh, x, y):
    """Per device, bytes of the gradient all-reduces over `data` (the loss's scalar left out)."""

    def f(model, x, y):
        return parallel_value_and_grad(policy, model, mesh, x, y)

    lowered = eqx.filter_jit(f).lower(model, x, y).lowered
    ops = [op for op in lowered_collectives(lowered) if op.kind == "all-reduce"]
    return sum(op.array_bytes for op in ops if op.group_size == 8 and op.array_bytes > 4)


def test_bfloat16_halves_the_data_parallel_gradient_reduction():
    mlp = eqx.nn.MLP(DIM, DIM, HIDDEN, 2, key=jax.random.key(0))
    model = eqx.filter_vmap(lambda m, x: m(x), in_axes=(None, 0))  # a per-example vmap
    x = jnp.ones((BATCH, DIM))

    class PerExample(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, x):
            return model(self.mlp, x)

    net = PerExample(mlp)
    mesh = mesh_of(8)
    parameter_bytes = sum(a.nbytes for a in leaves(net))
    float32 = data_parallel_reduction_bytes(F32, net, mesh, x, x)
    bfloat16 = data_parallel_reduction_bytes(BF16, net, mesh, x, x)
    assert float32 == parameter_bytes  # every gradient summed over `data` once
    assert bfloat16 * 2 == float32
