"""eqpar on meshes of every axis type: Explicit (`jax.make_mesh`'s default, where an array's
sharding is part of its type), Auto (`eqpar.DeviceMesh`'s default) and a mix of the two.

Each route is compared with one device: the home page's quick start as a reader would run
it with `jax.make_mesh`, `eqpar.shard_map` over a model placed by the user (tensor parallel)
and over FSDP's stored split, `eqpar.placement.with_sharding_constraint` under `jax.jit`, a
distribution's placement and `constrain`, `eqpar.check`, and `unparallelize`.
"""

import contextlib
import io
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

import eqpar
from eqpar.placement import with_sharding_constraint

ROOT = Path(__file__).resolve().parents[1]
E, A = AxisType.Explicit, AxisType.Auto
KINDS = {"explicit": (E, E), "auto": (A, A), "explicit-data": (E, A), "explicit-model": (A, E)}


def make_mesh(kind: str) -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=KINDS[kind])


def mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(16, 8, width_size=32, depth=1, key=jax.random.key(0))


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (8, 16)), jax.random.normal(ky, (8, 8))


def sgd_update(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))


PLAN = {"layers/0": eqpar.ColumnParallel(), "layers/1": eqpar.RowParallel()}


def test_quick_start_runs_as_printed_on_explicit_and_mixed_meshes():
    """The page's code block, its mesh line as written (`jax.make_mesh`: Explicit axes) and
    with one axis of each type; each prints the page's own output."""
    page = (ROOT / "docs" / "index.md").read_text()
    code, shown = re.search(r"```python\n(.*?)```\s*```text\n(.*?)```", page, re.S).groups()
    code = code.replace('jax.config.update("jax_num_cpu_devices", 8)', "")  # set by conftest
    mesh_line = 'mesh = jax.make_mesh((2, 4), ("data", "model"))'
    assert mesh_line in code
    mixed = (
        'mesh = jax.make_mesh((2, 4), ("data", "model"), '
        "axis_types=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto))"
    )
    for variant in (code, code.replace(mesh_line, mixed)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(variant, "docs/index.md", "exec"), {"__name__": "quick_start"})
        assert printed.getvalue().split() == shown.split()


@pytest.mark.parametrize("kind", KINDS)
def test_shard_map_takes_arguments_typed_otherwise_and_equals_one_device(kind):
    """A tensor-parallel model placed by the user and a batch nobody placed: over Explicit
    axes `jax.shard_map` refuses arguments whose type differs from in_specs, so
    `eqpar.shard_map` reshards them first. Loss and gradients equal one device's."""
    mesh = make_mesh(kind)
    parallel = eqpar.parallelize(mlp(), PLAN, mesh=mesh)
    specs = eqpar.partition_specs(parallel)
    params, static = eqx.partition(parallel, eqx.is_array)
    parallel = eqx.combine(jax.device_put(params, eqpar.named_shardings(specs, mesh)), static)
    sharded_loss = eqpar.shard_map(
        lambda m, x, y: jax.lax.pmean(loss_fn(m, x, y), "data"),
        mesh=mesh,
        in_specs=(specs, P("data"), P("data")),
        out_specs=P(),
    )
    x, y = batch()
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(sharded_loss))(parallel, x, y)
    want_loss, want_grads = eqx.filter_value_and_grad(loss_fn)(mlp(), x, y)
    assert_tree_close(loss, want_loss, what="loss")
    assert_tree_close(eqpar.unparallelize(grads), want_grads, what="grads")
    if kind == "explicit":  # the gradient's split is in its type
        assert jax.typeof(grads.layers[0].weight).sharding.spec == P("model", None)


@pytest.mark.parametrize("kind", ["explicit", "explicit-data"])
def test_shard_map_gathers_fsdp_stored_weights_on_explicit_axes(kind):
    mesh = make_mesh(kind)
    fsdp = eqpar.FSDP(mesh, min_size_bytes=0)
    model = fsdp.distribute_model(mlp())
    sharded_loss = eqpar.shard_map(
        lambda m, x, y: jax.lax.pmean(loss_fn(m, x, y), "data"),
        mesh=mesh,
        in_specs=(fsdp.compute_specs(model), P("data"), P("data")),
        out_specs=P(),
        stored_specs=(fsdp.partition_specs(model), P("data"), P("data")),
    )
    x, y = batch()
    grads = eqx.filter_jit(eqx.filter_grad(sharded_loss))(model, x, y)
    assert_tree_close(grads, eqx.filter_grad(loss_fn)(mlp(), x, y), what="grads")
    stored = fsdp.partition_specs(model).layers[0].weight
    assert grads.layers[0].weight.sharding.is_equivalent_to(NamedSharding(mesh, stored), 2)


@pytest.mark.parametrize("kind", KINDS)
def test_with_sharding_constraint_lays_out_over_either_axis_type(kind):
    mesh = make_mesh(kind)

    @jax.jit
    def layer(w, x):
        return with_sharding_constraint(x @ w, NamedSharding(mesh, P("data", "model")))

    w, x = jnp.ones((16, 8)), jnp.ones((8, 16))
    with jax.set_mesh(mesh):  # inputs on one device: the mesh says which devices jit uses
        out = layer(w, x)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 2)
    assert jnp.array_equal(out, x @ w)
    placed = with_sharding_constraint(x, NamedSharding(mesh, P(None, "model")))  # outside jit
    assert placed.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    if A in KINDS[kind]:  # (JAX refuses UNCONSTRAINED on a mesh without Auto axes)
        # UNCONSTRAINED keeps what is there, outside jit too (device_put takes no such entry)
        kept = with_sharding_constraint(placed, NamedSharding(mesh, P("data", P.UNCONSTRAINED)))
        assert jnp.array_equal(kept, x)
        assert kept.sharding.shard_shape(x.shape)[0] == 4  # rows over data


def test_shard_map_with_the_mesh_set_by_jax_set_mesh_reshards_too():
    mesh = make_mesh("explicit")
    double = eqpar.shard_map(lambda b: 2 * b, mesh=None, in_specs=P("data"), out_specs=P("data"))
    with jax.set_mesh(mesh):
        out = double(jnp.ones((8, 4)))  # an unplaced argument
    assert jax.typeof(out).sharding.spec == P("data", None)
    assert jnp.array_equal(out, 2 * jnp.ones((8, 4)))


@pytest.mark.parametrize("kind", ["explicit", "explicit-model"])
def test_distribution_placement_and_constrain_on_explicit_axes(kind):
    """FSDP through the compiler, given a `jax.make_mesh` mesh: placement, a jitted SGD step
    with `constrain`, equal to one device, the parameters where the layout says."""
    mesh = make_mesh(kind)
    fsdp = eqpar.FSDP(mesh, min_size_bytes=0)
    # Through the compiler: the same devices with Auto axes (under Explicit ones the MLP's
    # own matmul of a batch split over data by weights split over data has no legal type).
    assert fsdp.device_mesh.jax_mesh.axis_types == (A, A)
    assert (fsdp.device_mesh.devices == mesh.devices).all()
    model = fsdp.distribute_model(mlp())
    x, y = (fsdp.distribute_input(a) for a in batch())

    @eqx.filter_jit
    def sgd(model, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        return fsdp.constrain(sgd_update(model, grads))

    serial = sgd_update(mlp(), eqx.filter_grad(loss_fn)(mlp(), *batch()))
    stepped = sgd(model, x, y)
    assert_tree_close(eqpar.unparallelize(stepped), serial, what="params")
    spec = fsdp.partition_specs(stepped).layers[0].weight
    assert stepped.layers[0].weight.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)


@pytest.mark.parametrize("kind", ["explicit", "explicit-data", "explicit-model"])
def test_check_and_unparallelize_on_explicit_axes(kind):
    mesh = make_mesh(kind)
    assert eqpar.check(loss_fn, mlp(), *batch(), mesh=mesh, plan=PLAN).ok
    parallel = eqpar.parallelize(mlp(), PLAN, mesh=mesh)
    specs = eqpar.named_shardings(eqpar.partition_specs(parallel), mesh)
    params, static = eqx.partition(parallel, eqx.is_array)
    placed = eqx.combine(jax.device_put(params, specs), static)
    serial = eqpar.unparallelize(placed)  # whole over the Explicit axes: one-device code runs
    x, y = batch()
    assert_tree_close(loss_fn(serial, x, y), loss_fn(mlp(), x, y), what="loss")


def test_device_mesh_axis_types():
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    assert mesh.jax_mesh.axis_types == (A, A)  # the default
    mixed = eqpar.DeviceMesh((2, 4), ("data", "model"), axis_types=(E, A))
    assert mixed.jax_mesh.axis_types == (E, A)
    with pytest.raises(ValueError, match="axis_types has 1; give one type per axis"):
        eqpar.DeviceMesh((2, 4), ("data", "model"), axis_types=(E,))
    with pytest.raises(TypeError, match="Manual axes are what shard_map makes"):
        eqpar.DeviceMesh((8,), ("data",), axis_types=AxisType.Manual)


def test_vit_3d_one_forward_one_backward_by_plan_on_explicit_axes():
    """Equinox's ViT under data x pipe x tensor parallelism by plan, 1F1B through
    `eqpar.value_and_grad`, on a `jax.make_mesh` mesh (every axis Explicit): one SGD step
    equals one device's. (Pipeline stages are unstacked by `unparallelize` after the
    arrays are whole over the Explicit axes: indexing a stack split over one is ambiguous.)"""
    import equinox_vit as vit
    from test_any_model import VIT_PLAN, serial_step
    from test_pipeline_by_plan import scheduled_step

    mesh = jax.make_mesh((2, 2, 2), ("data", "pipe", "model"))
    model = vit.VisionTransformer(key=jax.random.key(0))
    batch = vit.batch(8)
    serial_loss, serial_model = serial_step(vit.loss, model, *batch)
    plan = {**VIT_PLAN, "attention_blocks": eqpar.Pipeline(2, 2, schedule="1f1b")}
    loss, updated = scheduled_step(vit.loss, model, plan, mesh, *batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_tree_close(updated, serial_model, what="updated")


def test_checkpoint_written_on_an_auto_mesh_restores_onto_an_explicit_one(tmp_path):
    """Bitwise, with the target's sharding in the restored array's type."""
    from eqpar.checkpoint import Checkpointer

    auto = eqpar.DeviceMesh((2, 4), ("data", "model"))
    weight = jnp.arange(64.0).reshape(8, 8)
    placed = jax.device_put(weight, NamedSharding(auto.jax_mesh, P("data", "model")))
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": placed}, force=True)
    explicit = jax.make_mesh((4, 2), ("data", "model"))
    where = NamedSharding(explicit, P("model", "data"))
    with Checkpointer(tmp_path) as checkpointer:
        target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=where)}
        restored = checkpointer.restore(target=target)["w"]
    assert jax.typeof(restored).sharding.spec == P("model", "data")
    assert (jax.device_get(restored) == jax.device_get(weight)).all()
