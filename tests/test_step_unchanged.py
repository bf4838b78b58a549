"""The one-device training step, unchanged, on a parallelized model.

`step` below is written once, for one device: `eqx.filter_jit`, `eqx.filter_value_and_grad`
of the model's own loss (which `jax.vmap`s over the batch), a plain SGD update. The serial
run calls it on the model as its author wrote it; the parallel run calls the same function on
`eqpar.parallelize(model, plan, mesh=mesh)` (which places the model) with the batch placed by
one `jax.device_put`. Every converted layer called outside `shard_map` opens its own region
over its axis, so nothing inside the step changes: no `shard_map`, no `pmean`.

Meshes come three ways: `eqpar.DeviceMesh` (Auto axes), `jax.make_mesh` with the data axis
Auto and the model axis Explicit (mixed), and `jax.make_mesh`'s default (every axis
Explicit). With an Explicit data axis the author's own code must follow JAX's explicit
sharding rules, which a reshape of the vmapped batch breaks (the ViT's patch embedding fails
in JAX alone, without eqpar); the all-Explicit case runs on a model whose code JAX accepts.
"""

import math
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import equinox_bert as bert
import equinox_vit as vit
import gpt2_port as gpt
import jax
import jax.numpy as jnp
import pytest
from _hlo import collective_summary
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close
from test_plan import PLAN as BERT_PLAN
from test_plan import SEQUENCE_PLAN, loss_without_dropout

import eqpar

LR = 0.5


@eqx.filter_jit
def step(model, loss_fn, *batch):
    """One SGD step, written for one device."""
    value, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
    return value, eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def make_mesh(kind: str) -> eqpar.DeviceMesh | jax.sharding.Mesh:
    if kind == "auto":
        return eqpar.DeviceMesh((2, 4), ("data", "model"))
    if kind == "mixed":
        types = (AxisType.Auto, AxisType.Explicit)
        return jax.make_mesh((2, 4), ("data", "model"), axis_types=types)
    if kind == "mixed-explicit-data":
        types = (AxisType.Explicit, AxisType.Auto)
        return jax.make_mesh((2, 4), ("data", "model"), axis_types=types)
    return jax.make_mesh((2, 4), ("data", "model"))  # JAX's default: Explicit axes


def placed_batch(batch, mesh):
    jax_mesh = mesh.jax_mesh if isinstance(mesh, eqpar.DeviceMesh) else mesh
    return jax.device_put(batch, NamedSharding(jax_mesh, P("data")))


VIT_PLAN = {
    r"attention_blocks/\d+/attention": eqpar.HeadParallel(),
    r"attention_blocks/\d+/linear1": eqpar.ColumnParallel(),
    r"attention_blocks/\d+/linear2": eqpar.RowParallel(),
}
GPT_PLAN = {
    r"blocks/\d+/attn/(q|k|v)_proj": eqpar.ColumnParallel(),
    r"blocks/\d+/attn/c_proj": eqpar.RowParallel(),
    r"blocks/\d+/mlp/c_fc": eqpar.ColumnParallel(),
    r"blocks/\d+/mlp/c_proj": eqpar.RowParallel(),
    r"blocks/\d+/attn": eqpar.HeadParallel(fields=("n_head",)),
}


@pytest.fixture(scope="module")
def models():
    """Each model with its loss, a batch and the serial step's result."""
    cases = {
        "vit": (vit.VisionTransformer(key=jax.random.key(0)), vit.loss, vit.batch(4)),
        "bert": (bert.Encoder(key=jax.random.key(0)), bert.loss, bert.batch(4)),
        "gpt2": (gpt.GPT(key=jax.random.key(0)), gpt.loss, gpt.batch(4)),
    }
    return {
        name: (model, loss, batch, step(model, loss, *batch))
        for name, (model, loss, batch) in cases.items()
    }


def first_devices(shape: tuple[int, ...]) -> list:
    """As many of the simulated devices as a mesh of `shape` takes."""
    return jax.devices()[: math.prod(shape)]


def assert_step_equals_serial(parallel, loss, batch, serial, mesh):
    value, updated = step(parallel, loss, *placed_batch(batch, mesh))
    serial_value, serial_model = serial
    assert_tree_close(value, serial_value, what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)
    return updated


@pytest.mark.parametrize("mesh_kind", ["auto", "mixed"])
@pytest.mark.parametrize(
    ("name", "plan"),
    [("vit", VIT_PLAN), ("bert", BERT_PLAN), ("gpt2", GPT_PLAN)],
    ids=["vit", "bert", "gpt2"],
)
def test_data_and_tensor_parallel_with_the_one_device_step(models, name, plan, mesh_kind):
    """DP x TP on the team's test models (dropout on, where their authors put it): the
    one-device step on the parallelized, placed model equals the serial step."""
    model, loss, batch, serial = models[name]
    mesh = make_mesh(mesh_kind)
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    updated = assert_step_equals_serial(parallel, loss, batch, serial, mesh)
    # The update keeps the layout: the next step runs on it as it is.
    assert eqpar.partition_specs(updated) == eqpar.partition_specs(parallel)


def test_fsdp_tensor_parallel_and_remat_with_the_one_device_step(models):
    """FSDP over `data` on top of TP (one placement call, outside the step) and remat by
    plan entry."""
    model, loss, batch, serial = models["vit"]
    mesh = make_mesh("auto")
    plan = {"attention_blocks": eqpar.Remat("full"), **VIT_PLAN}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    storage = eqpar.FSDP(mesh, axis="data", min_size_bytes=0).partition_specs(parallel)
    parallel = eqx.filter_shard(parallel, eqpar.named_shardings(storage, mesh))
    assert parallel.attention_blocks[0].linear1.weight.sharding.spec == P("model", "data")
    assert_step_equals_serial(parallel, loss, batch, serial, mesh)


# XLA's CPU compiler widens a bfloat16 all-reduce to float32 (its all-reduce-promotion pass)
# and aborts the process on one inside a `jax.shard_map` that leaves some mesh axes to the
# compiler (`axis_names=` a subset: every converted layer's own region), in JAX alone (0.10.2
# and 0.12): `jax.shard_map(lambda x: lax.psum(x, "model"), ..., axis_names={"model"})` on a
# bfloat16 array is enough. Without that pass the CPU sums in bfloat16, as GPUs and TPUs do.
CPU_BFLOAT16_WORKAROUND = "--xla_disable_hlo_passes=all-reduce-promotion"


def bfloat16_gradients_match(name: str, mesh_kind: str) -> None:
    """bfloat16 compute on DP x TP: the author's loss casts the model and batch with
    `eqpar.Precision.bfloat16()`, and the one-device gradient step runs unchanged; the loss
    is within two units of bfloat16's epsilon of one device's bfloat16 step and each float32
    gradient within 3e-2 of its norm (other sums in another order), or of 1% of the whole
    gradient's norm where that is larger: a key bias's gradient is zero in exact arithmetic
    (softmax ignores a constant shift of a query's logits), so what is left is rounding."""
    model, loss, batch = {
        "vit": (vit.VisionTransformer(key=jax.random.key(0)), vit.loss, vit.batch(4)),
        "gpt2": (gpt.GPT(key=jax.random.key(0)), gpt.loss, gpt.batch(4)),
    }[name]
    plan = {"vit": VIT_PLAN, "gpt2": GPT_PLAN}[name]
    policy = eqpar.Precision.bfloat16()

    def bf16_loss(model, *batch):
        return policy.cast_to_output(loss(*policy.cast_to_compute((model, *batch))))

    gradient_step = eqx.filter_jit(eqx.filter_value_and_grad(bf16_loss))
    serial_value, serial_grads = gradient_step(model, *batch)
    mesh = make_mesh(mesh_kind)
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    value, grads = gradient_step(parallel, *placed_batch(batch, mesh))
    assert value.dtype == jnp.float32
    assert_tree_close(value, serial_value, rtol=2 * 2.0**-7)
    got = jax.tree.leaves(eqx.filter(eqpar.unparallelize(grads), eqx.is_array))
    want = jax.tree.leaves(eqx.filter(serial_grads, eqx.is_array))
    whole = float(jnp.sqrt(sum(jnp.sum(w**2) for w in want)))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == jnp.float32
        error = float(jnp.linalg.norm(g - w)) / max(float(jnp.linalg.norm(w)), 1e-2 * whole)
        assert error < 3e-2, (name, g.shape, error)


@pytest.mark.parametrize(("name", "mesh_kind"), [("vit", "auto"), ("gpt2", "mixed")])
def test_bfloat16_compute_with_the_one_device_step(name, mesh_kind):
    """`bfloat16_gradients_match` in a process of its own, with XLA's CPU workaround in
    `XLA_FLAGS` (without it, the compiler aborts the process that compiles the step). That
    process is not under pytest, so eqpar's runtime type checks (jaxtyping's pytest hook)
    do not run in it; the float32 tests above run the same code under them."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} {CPU_BFLOAT16_WORKAROUND}".strip()
    code = (
        "import conftest, test_step_unchanged as t; "
        f"t.bfloat16_gradients_match({name!r}, {mesh_kind!r}); print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=pathlib.Path(__file__).resolve().parent,
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


class MLPClassifier(eqx.Module):
    """A model whose code JAX's explicit sharding accepts as it is (per-example linears)."""

    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(8, 4, 32, depth=1, key=key)

    def __call__(self, x):
        return self.mlp(x)


def mlp_loss(model, x, labels):
    logits = jax.vmap(model)(x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


MLP_PLAN = {"mlp/layers/0": eqpar.ColumnParallel(), "mlp/layers/1": eqpar.RowParallel()}


@pytest.mark.parametrize("mesh_kind", ["auto", "mixed", "mixed-explicit-data", "explicit"])
def test_every_kind_of_mesh_compiles_to_the_shard_map_routes_collectives(mesh_kind):
    """On a mesh with every axis Explicit too, with the arrays' shardings in their types; and
    the unchanged step compiles to the collectives of the `eqpar.shard_map` route."""
    model = MLPClassifier(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    serial = step(model, mlp_loss, x, labels)
    mesh = make_mesh(mesh_kind)
    parallel = eqpar.parallelize(model, MLP_PLAN, mesh=mesh)
    if mesh_kind == "explicit":
        assert jax.typeof(parallel.mlp.layers[0].weight).sharding.spec == P("model", None)
    assert_step_equals_serial(parallel, mlp_loss, (x, labels), serial, mesh)

    batch = placed_batch((x, labels), mesh)
    unchanged = step.lower(parallel, mlp_loss, *batch).compile()
    routed = eqpar.shard_map(
        lambda m, *b: lax.pmean(mlp_loss(m, *b), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data"), P("data")),
        out_specs=P(),
    )
    manual = step.lower(parallel, routed, *batch).compile()
    assert collective_summary(unchanged).bytes == collective_summary(manual).bytes
    assert collective_summary(unchanged).counts == {"all-reduce": 2}  # the row layer's psum


def test_an_unplaced_model_outside_shard_map_says_how_to_place_it():
    parallel = eqpar.parallelize(MLPClassifier(jax.random.key(0)), MLP_PLAN)
    with pytest.raises(ValueError, match=r"not placed on a mesh.*parallelize\(model, plan, mesh"):
        jax.vmap(parallel)(jnp.ones((2, 8)))


def test_a_split_the_axis_does_not_divide_names_the_leaf():
    """Called under `jax.set_mesh` (the region's mesh then comes from the context) on a mesh
    whose axis does not divide the layer's 12 features."""
    model = {"up": eqx.nn.Linear(8, 12, key=jax.random.key(0))}
    parallel = eqpar.parallelize(model, {"up": eqpar.ColumnParallel()})
    mesh = eqpar.DeviceMesh((8,), ("model",))
    with (
        jax.set_mesh(mesh.jax_mesh),
        pytest.raises(
            ValueError, match=r"ColumnParallelLinear: `weight` has shape \(12, 8\).*over 'model'"
        ),
    ):
        parallel["up"](jnp.ones(8))


CONTEXT_PLANS = {
    "dp2xcp4": ((2, 4, 1), {r"blocks/\d+/attention": eqpar.ContextParallel()}),
    "dp2xcp2xtp2": (
        (2, 2, 2),
        {
            r"blocks/\d+/attention": eqpar.ContextParallel(head_axis_name="model"),
            r"blocks/\d+/up": eqpar.ColumnParallel(),
            r"blocks/\d+/down": eqpar.RowParallel(),
        },
    ),
    "dp2xcp4-ulysses": (
        (2, 4, 1),
        {r"blocks/\d+/attention": eqpar.ContextParallel(strategy="ulysses")},
    ),
    # The sequence split once, where the blocks begin: each block opens one region.
    "dp2xcp4-split": (
        (2, 4, 1),
        {
            "blocks": eqpar.SplitSequence("context"),
            r"blocks/\d+/attention": eqpar.ContextParallel(),
        },
    ),
}


@pytest.mark.parametrize(
    ("case", "mesh_kind"),
    [
        ("dp2xcp4", "auto"),
        ("dp2xcp2xtp2", "auto"),
        ("dp2xcp2xtp2", "explicit"),
        ("dp2xcp4-ulysses", "explicit"),
        ("dp2xcp4-split", "explicit"),
    ],
)
def test_context_parallel_attention_with_the_one_device_step(case, mesh_kind):
    """The rotary encoder (rotary positions in `process_heads`, dropouts on the sequence and
    between the MLP's linears): each attention splits the sequence over `context` on entry
    and joins it on exit, its rotary taking global positions inside."""
    from test_any_model import RotaryEncoder, rotary_loss

    model = RotaryEncoder(key=jax.random.key(3))
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    batch = (
        jax.random.normal(k1, (4, 16, 16)),
        jax.random.normal(k2, (4, 16, 16)),
        jax.random.split(k3, 4),
    )
    serial = step(model, rotary_loss, *batch)
    shape, plan = CONTEXT_PLANS[case]
    names = ("data", "context", "model")
    # On Explicit axes the sequence enters each attention's region resharded to its split.
    mesh = eqpar.DeviceMesh(shape, names) if mesh_kind == "auto" else jax.make_mesh(shape, names)
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    assert_step_equals_serial(parallel, rotary_loss, batch, serial, mesh)
    if case.endswith("-split"):
        # Each block's region splits the batch over `data` too: the gradients are reduced
        # over `data` and `context` in one all-reduce, as the route's pmean does (with a
        # region per attention, the compiler reduces them once per axis).
        placed = placed_batch(batch, mesh)
        routed = eqpar.shard_map(
            lambda m, *b: lax.pmean(rotary_loss(m, *b), "data"),
            mesh=mesh,
            in_specs=(eqpar.partition_specs(parallel), P("data"), P("data"), P("data")),
            out_specs=P(),
        )
        unchanged = step.lower(parallel, rotary_loss, *placed).compile()
        manual = step.lower(parallel, routed, *placed).compile()
        assert collective_summary(unchanged).bytes == collective_summary(manual).bytes


@pytest.mark.parametrize(
    ("shape", "names", "tensor_parallel", "mesh_kind"),
    [
        ((2, 2), ("data", "pipe"), False, "auto"),
        ((2, 2, 2), ("data", "pipe", "model"), True, "auto"),
        ((2, 2, 2), ("data", "pipe", "model"), True, "mixed"),
    ],
    ids=["dp-pp", "3d", "3d-mixed"],
)
def test_gpipe_by_plan_runs_as_the_shard_map_routes_pipeline(
    models, shape, names, tensor_parallel, mesh_kind
):
    """A GPipe entry on the ViT's blocks (per-example dropout keys, one per block), the step
    unchanged, on Auto and mixed meshes: the blocks open one region over the pipe, model and
    data axes and run as the pipeline, equal to one device and compiled to the
    `eqpar.shard_map` route's collectives (without the region the compiler brought every
    stage's weights to every device)."""
    model, loss, _, _ = models["vit"]
    batch = vit.batch(8)
    serial = step(model, loss, *batch)
    # Mixed: pipe and model Explicit, data Auto (the ViT's patch embedding reshapes the
    # per-example image, which JAX refuses on an Explicit batch split; see the module's text).
    types = (AxisType.Auto, AxisType.Explicit, AxisType.Explicit)
    mesh = (
        eqpar.DeviceMesh(shape, names, devices=first_devices(shape))
        if mesh_kind == "auto"
        else jax.make_mesh(shape, names, devices=first_devices(shape), axis_types=types)
    )
    plan = {"attention_blocks": eqpar.Pipeline(stages=2, microbatches=2)}
    if tensor_parallel:
        plan.update(VIT_PLAN)
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    assert_step_equals_serial(parallel, loss, batch, serial, mesh)

    placed = placed_batch(batch, mesh)
    unchanged = collective_summary(step.lower(parallel, loss, *placed).compile())
    routed = eqpar.shard_map(
        lambda m, *b: lax.pmean(loss(m, *b), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data"), P("data"), P("data")),
        out_specs=P(),
    )
    manual = collective_summary(step.lower(parallel, routed, *placed).compile())
    sends = "collective-permute"
    assert unchanged.counts.get(sends) == manual.counts.get(sends), (unchanged, manual)
    assert unchanged.total_bytes <= 1.01 * manual.total_bytes, (unchanged, manual)


@eqx.filter_jit
def scheduled_step(model, loss_fn, *batch):
    """The one-device step with `eqpar.value_and_grad` in place of Equinox's (a schedule
    that runs its own backward pass computes the loss and gradients itself)."""
    value, grads = eqpar.value_and_grad(loss_fn)(model, *batch)
    return value, eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


@pytest.mark.parametrize(
    ("schedule", "shape", "names", "tensor_parallel"),
    [
        ("1f1b", (2, 2, 2), ("data", "pipe", "model"), True),
        ("zb-h1", (2, 2), ("data", "pipe"), False),
    ],
    ids=["1f1b-3d", "zb-h1-dp-pp"],
)
def test_scheduled_pipelines_without_shard_map(models, schedule, shape, names, tensor_parallel):
    """1F1B and ZB-H1 by plan on the ViT's blocks: `eqpar.value_and_grad` called outside
    `shard_map` opens the schedule's region itself (over the pipe axis and the axes the
    layers split over), and the step equals one device's."""
    model, loss, _, _ = models["vit"]
    batch = vit.batch(8)
    serial = step(model, loss, *batch)
    mesh = eqpar.DeviceMesh(shape, names, devices=first_devices(shape))
    plan = {"attention_blocks": eqpar.Pipeline(stages=2, microbatches=2, schedule=schedule)}
    if tensor_parallel:
        plan.update(VIT_PLAN)
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    value, updated = scheduled_step(parallel, loss, *placed_batch(batch, mesh))
    assert_tree_close(value, serial[0], what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial[1])


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
def test_v_shaped_schedules_without_shard_map(schedule):
    """ZB-V and DualPipeV by plan on a Llama of 4 layers (raw arrays, rotary positions, a tied
    unembedding), two stages per device on an explicit `jax.make_mesh` data x pipe mesh:
    `eqpar.value_and_grad` outside `shard_map`, the step equal to one device's."""
    import llama_style as llama

    keys = jax.random.split(jax.random.key(7), 4)
    model = llama.Llama(key=jax.random.key(0))
    layers = [llama.LlamaLayer(i, key=k) for i, k in enumerate(keys)]
    model = eqx.tree_at(lambda m: m.layers, model, layers)
    tokens = llama.batch(8)
    serial = step(model, llama.loss, tokens)
    mesh = jax.make_mesh((2, 2), ("data", "pipe"))
    microbatches = 4 if schedule == "dualpipe-v" else 2  # DualPipeV needs M >= 2S
    pipeline = eqpar.Pipeline(stages=2, microbatches=microbatches, repeats=2, schedule=schedule)
    parallel = eqpar.parallelize(model, {"layers": pipeline}, mesh=mesh)
    value, updated = scheduled_step(parallel, llama.loss, *placed_batch((tokens,), mesh))
    assert_tree_close(value, serial[0], what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial[1])


@pytest.mark.parametrize("mesh_kind", ["mixed", "explicit"])
def test_a_row_parallel_layer_whose_input_is_whole_enters_its_block(mesh_kind):
    """A row-parallel layer alone (its input whole, not split over `model` by a column
    layer before it): on Explicit axes the input is resharded to its block on entry."""
    model = MLPClassifier(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    serial = step(model, mlp_loss, x, labels)
    mesh = make_mesh(mesh_kind)
    parallel = eqpar.parallelize(model, {"mlp/layers/1": eqpar.RowParallel()}, mesh=mesh)
    assert_step_equals_serial(parallel, mlp_loss, (x, labels), serial, mesh)


def test_a_layer_inside_a_region_that_leaves_its_axis_to_the_compiler_is_refused():
    mesh = make_mesh("auto")
    parallel = eqpar.parallelize(MLPClassifier(jax.random.key(0)), MLP_PLAN, mesh=mesh)
    forward = eqpar.shard_map(
        lambda m, x: jax.vmap(m)(x),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
        axis_names={"data"},
    )
    with pytest.raises(ValueError, match=r"manual region over \('data',\) that leaves 'model'"):
        forward(parallel, jnp.ones((4, 8)))


class RawBlock(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class RawModel(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_scheduled_pipeline_of_raw_arrays_laid_out_for_the_compiler():
    """1F1B on blocks whose raw weights `Sharded` keys split over `model` (the compiled
    route): `eqpar.value_and_grad` outside `shard_map` leaves `model` to the compiler and
    makes the other axes manual, the batch split over `data`."""
    keys = jax.random.split(jax.random.key(0), 4)
    model = RawModel([RawBlock(0.3 * jax.random.normal(k, (8, 8))) for k in keys])
    loss = lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)
    x, y = jax.random.normal(jax.random.key(1), (2, 8, 8))
    serial = step(model, loss, x, y)
    plan = {
        "layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b"),
        r"layers/\d+/w": eqpar.Sharded(P(None, "model")),
    }
    mesh = eqpar.DeviceMesh((2, 2, 2), ("data", "pipe", "model"))
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    value, updated = scheduled_step(parallel, loss, *placed_batch((x, y), mesh))
    assert_tree_close(value, serial[0], what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial[1])


class RoutedBlock(eqx.Module):
    """A residual block of experts on a batch of tokens `[batch, features]`, its router's
    load-balancing and z-losses added to the model's loss."""

    norm: eqx.nn.LayerNorm
    moe: eqpar.nn.MixtureOfExperts

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(8)
        self.moe = eqpar.nn.MixtureOfExperts(8, 16, 8, top_k=2, use_bias=True, key=key)

    def __call__(self, x):
        y, losses = self.moe(jax.vmap(self.norm)(x))
        return x + y, 0.01 * losses.load_balancing + 0.001 * losses.z_loss


def routed_loss(model, x):
    y, router = model(x)
    return jnp.mean(y**2) + router


@pytest.mark.parametrize(
    ("model_name", "shape", "names", "mesh_kind"),
    [
        ("hand-written", (2, 4), ("data", "expert"), "explicit"),
        ("routed", (2, 4), ("data", "expert"), "auto"),
        ("routed", (2, 2, 2), ("data", "expert", "model"), "auto"),
        ("routed", (2, 2, 2), ("data", "expert", "model"), "explicit"),
    ],
    ids=["hand-written-explicit", "dp2xep4", "dp2xep2xtp2", "dp2xep2xtp2-explicit"],
)
def test_experts_with_the_one_device_step(model_name, shape, names, mesh_kind):
    """Expert parallelism with the one-device step: the converted layer called outside
    `shard_map` opens one region over the mesh, the tokens split over the data and expert
    axes (a sort along an axis the compiler splits would gather it whole), each expert's
    hidden units over `model` where the plan says so; the router losses are the whole
    batch's. The hand-written experts (a list of MLPs the layer's author stacked by hand)
    return their output alone."""
    from test_experts import HandWrittenModel

    if model_name == "hand-written":
        model, loss = HandWrittenModel(jax.random.key(2)), lambda m, x: jnp.mean(m(x) ** 2)
    else:
        model, loss = RoutedBlock(jax.random.key(2)), routed_loss
    x = jax.random.normal(jax.random.key(1), (64, 8))
    serial = step(model, loss, x)
    mesh = (
        eqpar.DeviceMesh(shape, names, devices=first_devices(shape))
        if mesh_kind == "auto"
        else jax.make_mesh(shape, names, devices=first_devices(shape))
    )
    style = eqpar.ExpertParallel(model_axis_name="model" if "model" in names else None)
    parallel = eqpar.parallelize(model, {"moe": style}, mesh=mesh)
    assert_step_equals_serial(parallel, loss, (x,), serial, mesh)


def test_experts_move_what_the_shard_map_route_moves():
    """The region's token split is the route's batch split: the same all-to-all bytes (a
    split over the expert axis alone would exchange twice as many tokens per device)."""
    model = RoutedBlock(jax.random.key(2))
    x = jax.random.normal(jax.random.key(1), (64, 8))
    mesh = eqpar.DeviceMesh((2, 4), ("data", "expert"))
    parallel = eqpar.parallelize(model, {"moe": eqpar.ExpertParallel()}, mesh=mesh)
    batch = jax.device_put(x, NamedSharding(mesh.jax_mesh, P(("data", "expert"))))
    unchanged = step.lower(parallel, routed_loss, batch).compile()
    routed = eqpar.shard_map(
        lambda m, x: lax.pmean(routed_loss(m, x), ("data", "expert")),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(("data", "expert"))),
        out_specs=P(),
    )
    manual = step.lower(parallel, routed, batch).compile()
    got, want = collective_summary(unchanged), collective_summary(manual)
    assert want.bytes["all-to-all"] > 0
    assert got.bytes["all-to-all"] == want.bytes["all-to-all"]
    assert got.total_bytes <= want.total_bytes


def test_a_gpipe_pipeline_of_expert_blocks_with_the_one_device_step():
    """GPipe over `pipe` whose blocks hold experts split over `expert`: the pipeline's region
    splits the batch over the expert axis as over a data axis (each expert device brings its
    own tokens), and the step equals one device's."""
    from test_experts import MoEBlock, MoEStack

    keys = jax.random.split(jax.random.key(5), 4)
    model = MoEStack(tuple(MoEBlock(k) for k in keys))
    x = jax.random.normal(jax.random.key(1), (32, 8))
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    serial = step(model, loss, x)
    mesh = eqpar.DeviceMesh((2, 4), ("pipe", "expert"))
    pipeline = eqpar.Pipeline(stages=2, microbatches=2, batch_axis=0)
    plan = {"blocks": pipeline, r"blocks/\d+/moe": eqpar.ExpertParallel()}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    value, updated = step(parallel, loss, x)
    assert_tree_close(value, serial[0], what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial[1])


SEQUENCE_PARALLEL_PLAN = {**SEQUENCE_PLAN, "layers": eqpar.SplitSequence("model")}


@pytest.mark.parametrize("mesh_kind", ["auto", "mixed", "explicit"])
def test_sequence_parallelism_with_the_one_device_step(models, mesh_kind):
    """TP + SP on BERT (heads, MLP columns and rows with `sequence_parallel=True`; the
    sequence split where the list of layers begins by the plan, not by lines in the author's
    `__call__`; the padding mask per example): equal to one device."""
    model, _, batch, _ = models["bert"]
    batch = batch[:2]  # the tokens and labels: SP's per-token dropouts are refused either way
    serial = step(model, loss_without_dropout, *batch)
    mesh = make_mesh(mesh_kind)
    parallel = eqpar.parallelize(model, SEQUENCE_PARALLEL_PLAN, mesh=mesh)
    assert_step_equals_serial(parallel, loss_without_dropout, batch, serial, mesh)


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_sequence_parallel_blocks_move_what_the_shard_map_route_moves(mesh_kind):
    """Blocks returning `(x, cache)` under TP + SP: the one-device step's loss, caches and
    update are one device's, and it compiles to the route's collectives: each block's
    region splits the batch over `data` too (left to the compiler, XLA gathers the batch
    whole around every block: 2.3x the route's bytes here)."""
    from test_split_sequence_blocks import SEQUENCE_PARALLEL, CachingBlock, CachingModel

    def loss_and_caches(model, x):
        # One mean: the one-device step's loss is then one all-reduce, as the route's pmean.
        out, caches = jax.vmap(model)(x)
        return jnp.mean(out**2 + 0.1 * sum(c**2 for c in caches)), caches

    model = CachingModel([CachingBlock(k) for k in jax.random.split(jax.random.key(0), 3)])
    x = jax.random.normal(jax.random.key(1), (4, 8, 8))

    @eqx.filter_jit
    def caching_step(model, loss_fn, x):
        (value, caches), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, x)
        return value, caches, eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))

    serial_value, serial_caches, serial_model = caching_step(model, loss_and_caches, x)
    mesh = make_mesh(mesh_kind)
    parallel = eqpar.parallelize(model, SEQUENCE_PARALLEL, mesh=mesh)
    (placed,) = placed_batch((x,), mesh)
    value, caches, updated = caching_step(parallel, loss_and_caches, placed)
    assert_tree_close(value, serial_value, what="loss")
    assert_tree_close(caches, serial_caches, what="caches")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)

    def local(m, x):
        value, caches = loss_and_caches(m, x)
        return lax.pmean(value, "data"), caches

    routed = eqpar.shard_map(
        local,
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data")),
        out_specs=(P(), P("data")),
    )
    unchanged = caching_step.lower(parallel, loss_and_caches, placed).compile()
    manual = caching_step.lower(parallel, routed, placed).compile()
    assert collective_summary(unchanged).bytes == collective_summary(manual).bytes


def test_sequence_parallel_blocks_on_a_batch_the_data_axis_does_not_divide():
    """3 examples on `data` = 2: each block's region leaves the batch to the compiler (no
    data axis divides it) and the step is still one device's."""
    from test_split_sequence_blocks import SEQUENCE_PARALLEL, CachingBlock, CachingModel

    model = CachingModel([CachingBlock(k) for k in jax.random.split(jax.random.key(0), 2)])
    x = jax.random.normal(jax.random.key(1), (3, 8, 8))
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x)[0] ** 2)
    serial = step(model, loss, x)
    mesh = make_mesh("auto")
    parallel = eqpar.parallelize(model, SEQUENCE_PARALLEL, mesh=mesh)
    value, updated = step(parallel, loss, x)
    assert_tree_close(value, serial[0], what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial[1])
