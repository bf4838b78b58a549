"""Mixture of experts: the layer against a dense reference, and expert parallelism against
the serial layer (outputs, auxiliary losses, gradients, one plain-SGD step), alone and with
data, FSDP, tensor and pipeline parallelism, under balanced and skewed routing.

The reference runs every expert on every token and picks the chosen ones: no sorting, no
grouped matmul, no exchange, so it shares no code with the layer.
"""

import functools
import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close
from test_any_model import mesh_of, serial_step, sgd

import eqpar
from eqpar.nn import MixtureOfExperts

FEATURES, HIDDEN = 8, 16


@functools.cache  # layers are immutable; building one eagerly costs seconds
def make_moe(num_experts=8, *, top_k=2, skew=0.0, **options) -> MixtureOfExperts:
    """A layer whose router bias adds `skew` to the logits of experts 0 and 1 (0: balanced
    routing at random; large: nearly every token picks experts 0 and 1)."""
    moe = MixtureOfExperts(
        FEATURES,
        HIDDEN,
        num_experts,
        top_k=top_k,
        use_router_bias=True,
        key=jax.random.key(0),
        **options,
    )
    bias = jnp.zeros(num_experts).at[:2].set(skew)
    return eqx.tree_at(lambda m: m.router.bias, moe, bias)


@functools.cache
def tokens(count=64, key=1):
    return jax.random.normal(jax.random.key(key), (count, FEATURES))


def reference(moe: MixtureOfExperts, x, kept=None):
    """Every expert on every token; the output mixes the chosen ones (`kept`: [k, T] mask of
    the assignments a capacity keeps)."""
    logits = jax.vmap(moe.router)(x)
    probs = jax.nn.softmax(logits)
    top, chosen = lax.top_k(probs, moe.top_k)
    weights = top / top.sum(-1, keepdims=True) if moe.normalize_weights else top

    def expert(e, v):
        h = v @ moe.up[e] + (0 if moe.up_bias is None else moe.up_bias[e])
        h = moe.activation(v @ moe.gate[e]) * h if moe.gate is not None else moe.activation(h)
        return h @ moe.down[e] + (0 if moe.down_bias is None else moe.down_bias[e])

    every = jax.vmap(lambda e: jax.vmap(lambda v: expert(e, v))(x))(jnp.arange(moe.num_experts))
    picked = every[chosen, jnp.arange(x.shape[0])[:, None]]  # [T, k, features]
    if kept is not None:
        weights = weights * kept.T
    return jnp.einsum("tk,tkf->tf", weights, picked), logits, probs, chosen


def reference_losses(moe, x):
    _, logits, probs, chosen = reference(moe, x)
    share = jnp.bincount(chosen.reshape(-1), length=moe.num_experts) / chosen.size
    balance = moe.num_experts * jnp.sum(share * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return balance, z


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"gated": True, "activation": jax.nn.silu},
        {"use_bias": True, "top_k": 1, "normalize_weights": False},  # Switch-style weights
    ],
    ids=["plain", "gated", "bias-top1"],
)
def test_layer_equals_every_expert_on_every_token(options):
    moe = make_moe(**options)
    x = tokens().reshape(4, 16, FEATURES)  # any leading shape
    flat = x.reshape(-1, FEATURES)

    @eqx.filter_jit
    def layer_and_reference(moe):
        y, losses = moe(x)
        expected = reference(moe, flat)[0].reshape(x.shape)
        # The gradients of the grouped matmuls against the dense reference's.
        grad = jax.grad(lambda m: jnp.sum(m(x)[0] ** 2))(moe)
        dense = jax.grad(lambda m: jnp.sum(reference(m, flat)[0] ** 2))(moe)
        return (y, losses, grad), (expected, reference_losses(moe, flat), dense)

    (y, losses, grad), (expected, (balance, z), dense) = layer_and_reference(moe)
    assert_arrays_close(y, expected)
    assert_tree_close((losses.load_balancing, losses.z_loss), (balance, z), what="aux")
    assert int(losses.dropped) == 0
    assert_arrays_close(grad, dense)


@pytest.mark.parametrize(
    "options", [{}, {"gated": True, "use_bias": True}], ids=["plain", "gated-bias"]
)
def test_the_cpu_loop_over_experts_and_the_ragged_dot_give_the_same_values(options):
    """On CPU the layer runs each grouped matmul as a scan over its experts; on GPU and TPU
    as `lax.ragged_dot` over rows sorted by expert. CPUs lower only the first, so the second
    (also runnable on CPU, through JAX's generic rule) is checked against it here: outputs
    and the gradients of rows and every weight, rows in any order and rows with an id past
    the last expert (unused buffer rows) giving zeros."""
    from eqpar.nn import experts as experts_module

    moe = make_moe(4, **options)
    params = experts_module._ExpertParams(moe.up, moe.gate, moe.down, moe.up_bias, moe.down_bias)
    static = moe._static(1, 0)
    rows = tokens(24, key=3)
    expert_of_row = jax.random.randint(jax.random.key(4), (24,), 0, 5)  # 4: no expert
    cotangent = jax.random.normal(jax.random.key(5), (24, FEATURES))

    def through(apply):
        def loss(params, rows):
            return jnp.sum(apply(params, rows, expert_of_row, static) * cotangent)

        out = apply(params, rows, expert_of_row, static)
        return out, jax.grad(loss, argnums=(0, 1))(params, rows)

    by_loop = jax.jit(lambda: through(experts_module._experts_by_loop))()
    ragged = functools.partial(experts_module._experts_by_ragged_dot, grouped=False)
    by_ragged_dot = jax.jit(lambda: through(ragged))()
    assert_tree_close(by_loop, by_ragged_dot, what="loop against ragged_dot")
    assert not np.any(np.asarray(by_loop[0])[np.asarray(expert_of_row) == 4])

    # Rows already grouped (the serial layer's route), and bfloat16 rows against float32
    # experts: both mix in float32, as the serial layer does.
    order = jnp.argsort(expert_of_row, stable=True)
    rows, expert_of_row = rows[order].astype(jnp.bfloat16), expert_of_row[order]
    grouped = functools.partial(experts_module._experts_by_ragged_dot, grouped=True)
    by_loop = jax.jit(lambda: through(experts_module._experts_by_loop))()
    by_ragged_dot = jax.jit(lambda: through(grouped))()
    assert by_loop[0].dtype == by_ragged_dot[0].dtype == jnp.float32
    assert_tree_close(by_loop, by_ragged_dot, what="grouped bfloat16 rows")


def test_the_step_holds_no_copy_of_the_rows_per_expert_on_cpu():
    """JAX's CPU rule for `lax.ragged_dot` masks the rows into one copy per expert, so a
    layer's temp grew with its experts (16 experts: 839 KB against 161 KB for 2 in this
    step). The scan over experts holds one expert's product at a time: from 2 to 16 experts
    temp grows only with what scales with the weights (their gradients, the scan's
    stacked per-expert values), here by 2.7x the added weights' bytes; 4x is the bound."""

    def temp(num_experts: int) -> int:
        moe = MixtureOfExperts(16, 32, num_experts, key=jax.random.key(0))
        step = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x)[0] ** 2)))
        compiled = step.lower(moe, jnp.ones((64, 16))).compile()
        return compiled.compiled.memory_analysis().temp_size_in_bytes

    def weight_bytes(num_experts: int) -> int:
        return num_experts * 2 * 16 * 32 * 4  # up and down, float32

    growth = temp(16) - temp(2)
    assert growth <= 4 * (weight_bytes(16) - weight_bytes(2)), (growth, temp(2))


def capacity_reference(chosen, num_experts, capacity):
    """Which assignments a capacity keeps: first choices first, then token order."""
    kept = np.zeros(chosen.T.shape, bool)  # [k, T]
    seen = np.zeros(num_experts, int)
    for c in range(chosen.shape[1]):
        for t in range(chosen.shape[0]):
            e = int(chosen[t, c])
            kept[c, t] = seen[e] < capacity
            seen[e] += 1
    return kept


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_drops_exactly_the_assignments_past_it_and_counts_them(factor):
    moe = make_moe(skew=1.5, capacity_factor=factor)
    x = tokens()
    y, losses = eqx.filter_jit(lambda m: m(x))(moe)
    _, _, _, chosen = eqx.filter_jit(reference)(moe, x)
    capacity = math.ceil(factor * 64 * 2 / 8)
    kept = capacity_reference(np.asarray(chosen), 8, capacity)
    assert int(losses.dropped) == int((~kept).sum()) > 0
    assert_arrays_close(y, eqx.filter_jit(reference)(moe, x, jnp.asarray(kept))[0])


def loss_fn(model, x):
    y, losses = model(x)
    return jnp.mean(y**2) + 0.01 * losses.load_balancing + 0.001 * losses.z_loss


def check_expert_parallel_step(model, x, mesh, *, token_axes, fsdp=None):
    """One SGD step of the expert-parallel layer equals the serial step; returns the
    parallel outputs and losses."""
    serial_loss, serial_model = serial_step(loss_fn, eqpar.unparallelize(model), x)
    specs = eqpar.partition_specs(model)
    stored = None
    if fsdp is not None:
        specs, stored = fsdp.compute_specs(model), (fsdp.partition_specs(model), P(token_axes))
    sharded = eqpar.shard_map(
        lambda m, x: lax.pmean(loss_fn(m, x), token_axes),
        mesh=mesh,
        in_specs=(specs, P(token_axes)),
        out_specs=P(),
        stored_specs=stored,
    )
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(sharded))(model, x)
    assert_tree_close(value, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(sgd(model, grads)), serial_model)
    forward = eqpar.shard_map(
        lambda m, x: m(x),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(model), P(token_axes)),
        out_specs=(P(token_axes), P()),
    )
    y, losses = eqx.filter_jit(forward)(model, x)
    serial_y, serial_losses = eqpar.unparallelize(model)(x)
    assert_arrays_close(y, serial_y)
    assert_tree_close(losses, serial_losses, what="router losses")
    return grads


def rounds_needed(moe, x, devices, n, buffer_factor, slots):
    """The rounds of the exchange the layer runs over an expert axis of size `n` with `x`
    split over `devices` and `slots` slots per device pair: the largest (source, slot)
    count over one round's rows (a slot's share of a pair's balanced load, times the
    factor)."""
    _, _, _, chosen = eqx.filter_jit(reference)(moe, x)
    per_device = np.asarray(chosen).reshape(devices, -1)  # each device's tokens, all choices
    bins = n * slots
    slot = per_device // (moe.num_experts // bins)
    most = max(int(np.sum(row == b)) for row in slot for b in range(bins))
    rows = math.ceil(buffer_factor * per_device.shape[1] / bins)
    return math.ceil(most / rows)


@pytest.fixture
def one_slot_per_pair(monkeypatch):
    """The exchange as it runs on GPU and TPU (a device's experts share one slot per pair
    of devices, their rows in any mix, through the ragged dot's route), here on CPU."""
    from eqpar.nn import experts as experts_module

    monkeypatch.setattr(experts_module, "_slots_per_destination", lambda local: 1)


@pytest.mark.parametrize(
    ("shape", "names", "skew", "buffer_factor", "slot", "rounds"),
    [
        ((8,), ("expert",), 0.0, 4.0, "per expert", 1),
        ((4, 2), ("data", "expert"), 6.0, 1.25, "per expert", 3),
        ((2, 4), ("data", "expert"), 6.0, 1.25, "per expert", 3),
        ((2, 4), ("data", "expert"), 6.0, 1.25, "per pair", 4),
    ],
    ids=[
        "expert8",
        "data4-expert2-skewed",
        "data2-expert4-skewed",
        "data2-expert4-skewed-one-slot-per-pair",
    ],
)
def test_expert_parallel_step_equals_serial(
    shape, names, skew, buffer_factor, slot, rounds, request
):
    if slot == "per pair":
        request.getfixturevalue("one_slot_per_pair")
    mesh = mesh_of(shape, names)
    moe = make_moe(skew=skew, gated=True)
    x = tokens()
    # The cases run one round (the plain autodiff path) or several (the loop's own VJP).
    slots = 1 if slot == "per pair" else moe.num_experts // shape[-1]
    assert rounds_needed(moe, x, math.prod(shape), shape[-1], buffer_factor, slots) == rounds
    style = eqpar.ExpertParallel(buffer_factor=buffer_factor)
    parallel = eqpar.parallelize(moe, {"": style}, mesh=mesh)
    assert eqpar.partition_specs(parallel).up == P("expert", None, None)
    check_expert_parallel_step(parallel, x, mesh, token_axes=names)


def test_expert_parallel_holds_what_a_capacity_exchange_holds_on_cpu():
    """On CPU each local expert has its own slot in the exchange's buffers, so the rows a
    device receives come in one fixed block per expert and the experts run as one batched
    matmul: the one-round step (a capacity factor) holds what the textbook sort-and-gather
    exchange of `benchmarks/moe.py` holds at the same buffer, within 2% (its router losses);
    with one shared slot per device pair (the GPU and TPU layout, whose rows come in any mix
    of experts) the dropless step held 1.6x what it holds now (each matmul a loop over the
    experts, with a product and a weight slice per expert)."""
    import moe as bench  # benchmarks/moe.py (benchmarks/ is on the path, see conftest)
    from _hlo import memory_figures

    _, shape, names = bench.MESHES[0]  # data=2,expert=4: two experts per device
    mesh = bench._mesh(shape, names)
    x = bench._tokens(mesh, names)

    def temp(layer, loss) -> int:
        return memory_figures(bench._compiled_step(loss, layer, mesh, x)[0])["temp"]

    capped = bench._layer(bench.EXPERTS, 1.25, capacity_factor=1.25)
    baseline = temp(capped, bench._sort_and_gather_loss(capped, mesh, names, 1.25))
    assert temp(capped, bench._moe_loss(capped, mesh, names)) <= 1.02 * baseline
    dropless = bench._layer(bench.EXPERTS, 1.25)
    per_expert = temp(dropless, bench._moe_loss(dropless, mesh, names))
    with bench._one_slot_per_pair():
        shared = temp(dropless, bench._moe_loss(dropless, mesh, names))
    assert per_expert < 0.75 * shared, (per_expert, shared)


def test_data_groups_that_need_different_rounds_do_not_wait_on_each_other():
    """One data group's tokens all go to expert 0 (several rounds), the other's are spread
    (one round): the weights' gradients are summed over `data` outside the rounds, so
    neither group waits on a sum the other never reaches."""
    mesh = mesh_of((2, 4), ("data", "expert"))
    moe = make_moe(num_experts=4, top_k=1)
    x = tokens(32).reshape(8, 4, FEATURES)
    x = x.at[4:].set(jnp.broadcast_to(moe.router.weight[0] * 10, (4, 4, FEATURES)))
    parallel = eqpar.parallelize(moe, {"": eqpar.ExpertParallel()}, mesh=mesh)
    check_expert_parallel_step(parallel, x, mesh, token_axes=("data", "expert"))


def test_bfloat16_tokens_with_float32_experts_mix_in_float32_as_the_serial_layer():
    mesh = mesh_of((2, 4), ("data", "expert"))
    moe = make_moe(skew=2.0)
    x = tokens().astype(jnp.bfloat16)
    parallel = eqpar.parallelize(moe, {"": eqpar.ExpertParallel(buffer_factor=0.5)}, mesh=mesh)
    forward = eqpar.shard_map(
        lambda m, x: m(x)[0],
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(("data", "expert"))),
        out_specs=P(("data", "expert")),
    )
    y = eqx.filter_jit(forward)(parallel, x)
    expected = eqx.filter_jit(lambda m, x: m(x)[0])(moe, x)
    assert y.dtype == expected.dtype == jnp.bfloat16
    # Both mix in float32 and round once: equal but for the order of the float32 sums.
    assert_arrays_close(y.astype(jnp.float32), expected.astype(jnp.float32), rtol=1e-2)


def test_the_data_axis_can_hold_the_experts():
    mesh = mesh_of((8,), ("data",))
    moe = make_moe(skew=3.0)
    parallel = eqpar.parallelize(moe, {"": eqpar.ExpertParallel(axis_name="data")}, mesh=mesh)
    check_expert_parallel_step(parallel, tokens(), mesh, token_axes=("data",))


def test_expert_parallel_with_tensor_parallel_experts():
    """Each expert's hidden features split over `model` (column `up`/`gate`, row `down`)."""
    mesh = mesh_of((4, 2), ("expert", "model"))
    moe = make_moe(skew=2.0, gated=True, use_bias=True)
    style = eqpar.ExpertParallel(model_axis_name="model")
    parallel = eqpar.parallelize(moe, {"": style}, mesh=mesh)
    specs = eqpar.partition_specs(parallel)
    assert (specs.up, specs.down, specs.up_bias) == (
        P("expert", None, "model"),
        P("expert", "model", None),
        P("expert", "model"),
    )
    check_expert_parallel_step(parallel, tokens(), mesh, token_axes=("expert",))


def test_sequence_parallel_tokens_with_tensor_parallel_experts():
    """Tokens split over `model` too (sequence parallelism between blocks): the experts,
    whose hidden features `model` splits, gather the axis's tokens and keep their own rows."""
    mesh = mesh_of((4, 2), ("expert", "model"))
    moe = make_moe(skew=2.0, gated=True)
    style = eqpar.ExpertParallel(model_axis_name="model")
    parallel = eqpar.parallelize(moe, {"": style}, mesh=mesh)
    check_expert_parallel_step(parallel, tokens(), mesh, token_axes=("expert", "model"))


def test_expert_parallel_with_fsdp_splits_expert_weights_over_data_too():
    mesh = mesh_of((2, 4), ("data", "expert"))
    moe = make_moe(skew=1.0)
    parallel = eqpar.parallelize(moe, {"": eqpar.ExpertParallel()}, mesh=mesh)
    fsdp = eqpar.FSDP(mesh, axis="data", min_size_bytes=0)
    stored = fsdp.partition_specs(parallel)
    assert stored.up == P("expert", None, "data") and stored.down == P("expert", "data", None)
    placed = eqx.filter_shard(parallel, eqpar.named_shardings(stored, mesh))
    grads = check_expert_parallel_step(
        placed, tokens(), mesh, token_axes=("data", "expert"), fsdp=fsdp
    )
    assert grads.up.sharding.spec == P("expert", None, "data")  # reduce-scattered


@pytest.mark.parametrize("factor", [0.5])
def test_expert_parallel_capacity_counts_drops_as_the_serial_layer_per_device(factor):
    """A capacity applies to each device's tokens: the parallel layer equals the serial one
    run on each device's share, dropped counts summed."""
    mesh = mesh_of((8,), ("expert",))
    moe = make_moe(skew=1.5, capacity_factor=factor)
    x = tokens()
    style = eqpar.ExpertParallel(capacity_factor=factor)
    parallel = eqpar.parallelize(moe, {"": style}, mesh=mesh)
    forward = eqpar.shard_map(
        lambda m, x: m(x),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("expert")),
        out_specs=(P("expert"), P()),
    )
    y, losses = eqx.filter_jit(forward)(parallel, x)
    shares = [eqx.filter_jit(lambda m, x: m(x))(moe, share) for share in x.reshape(8, -1, FEATURES)]
    assert_arrays_close(y, jnp.concatenate([share[0] for share in shares]))
    assert int(losses.dropped) == sum(int(share[1].dropped) for share in shares) > 0


class HandWrittenExperts(eqx.Module):
    """The common hand-written form: a router and a list of expert MLPs, every expert run
    on every token (no eqpar in mind)."""

    router: eqx.nn.Linear
    experts: list
    top_k: int = eqx.field(static=True)

    def __init__(self, key, top_k=2, container=list, **biases):
        keys = jax.random.split(key, 9)
        self.router = eqx.nn.Linear(FEATURES, 8, use_bias=False, key=keys[0])
        self.experts = container(
            eqx.nn.MLP(FEATURES, FEATURES, HIDDEN, 1, activation=jax.nn.relu, key=k, **biases)
            for k in keys[1:]
        )
        self.top_k = top_k

    def __call__(self, x):
        probs = jax.nn.softmax(jax.vmap(self.router)(x))
        weights, chosen = lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(-1, keepdims=True)
        every = jnp.stack([jax.vmap(expert)(x) for expert in self.experts], axis=1)
        return jnp.einsum("tk,tkf->tf", weights, jnp.take_along_axis(every, chosen[..., None], 1))


class HandWrittenModel(eqx.Module):
    moe: HandWrittenExperts
    head: eqx.nn.Linear

    def __init__(self, key, **form):
        k1, k2 = jax.random.split(key)
        self.moe, self.head = HandWrittenExperts(k1, **form), eqx.nn.Linear(FEATURES, 4, key=k2)

    def __call__(self, x):
        return jax.vmap(self.head)(x + self.moe(x))


@pytest.mark.parametrize(
    "form",
    [
        {},
        {"container": tuple, "use_bias": False},  # a final bias only
        {"use_bias": False, "use_final_bias": False},
    ],
    ids=["list-biases", "tuple-final-bias", "no-biases"],
)
def test_the_hand_written_form_is_converted_and_given_back(form):
    model = HandWrittenModel(jax.random.key(2), **form)
    mesh = mesh_of((2, 4), ("data", "expert"))
    parallel = eqpar.parallelize(model, {"moe": eqpar.ExpertParallel()}, mesh=mesh)
    assert isinstance(parallel.moe, MixtureOfExperts) and parallel.moe.top_k == 2
    assert eqx.tree_equal(eqpar.unparallelize(parallel), model)
    if form:  # the other forms: converted, checked on tokens and given back (above)
        return
    x = tokens()

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    serial_loss, serial_model = serial_step(loss, model, x)
    sharded = eqpar.shard_map(
        lambda m, x: lax.pmean(loss(m, x), ("data", "expert")),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(("data", "expert"))),
        out_specs=P(),
    )
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(sharded))(parallel, x)
    assert_tree_close(value, serial_loss, what="loss")
    updated = eqpar.unparallelize(sgd(parallel, grads))
    assert type(updated.moe) is HandWrittenExperts
    assert_arrays_close(updated, serial_model)


def test_an_abstract_hand_written_layer_converts_without_running():
    """`parallelize` takes abstract models (`eqx.filter_eval_shape`): the conversion reshapes
    the ShapeDtypeStructs as it would the arrays, and has nothing to run to check."""
    abstract = eqx.filter_eval_shape(HandWrittenExperts, jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel = eqpar.parallelize(abstract, {"": eqpar.ExpertParallel()})
    assert parallel.up.shape == (8, FEATURES, HIDDEN) and isinstance(
        parallel.up, jax.ShapeDtypeStruct
    )
    back = eqpar.unparallelize(parallel)
    shapes = lambda m: [
        (a.shape, a.dtype) for a in jax.tree.leaves(m) if isinstance(a, jax.ShapeDtypeStruct)
    ]
    assert type(back) is HandWrittenExperts and shapes(back) == shapes(abstract)


class MoEBlock(eqx.Module):
    """A residual block with experts, taking the whole batch `[batch, features]`; its router
    losses are used (scaled to nothing), so they are computed inside the stage."""

    norm: eqx.nn.LayerNorm
    moe: MixtureOfExperts

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(FEATURES)
        self.moe = MixtureOfExperts(FEATURES, HIDDEN, 8, top_k=2, key=key)

    def __call__(self, x):
        y, losses = self.moe(jax.vmap(self.norm)(x))
        return x + y + 0.0 * (losses.load_balancing + losses.z_loss)


class MoEStack(eqx.Module):
    blocks: tuple

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_holding_experts(schedule):
    """Two pipeline stages over `pipe`, each block's experts split over `expert` inside them:
    GPipe by differentiating the loss, 1F1B through `eqpar.value_and_grad` (each device
    runs its own step of the schedule; the router losses are summed over `data` and
    `expert` only, never over `pipe`)."""
    keys = jax.random.split(jax.random.key(5), 4)
    model = MoEStack(tuple(MoEBlock(k) for k in keys))
    x = tokens(32)

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    serial_loss, serial_model = serial_step(loss, model, x)
    mesh = mesh_of((2, 4), ("pipe", "expert"))
    pipeline = eqpar.Pipeline(stages=2, microbatches=2, batch_axis=0, schedule=schedule)
    plan = {"blocks": pipeline, "blocks/\\d+/moe": eqpar.ExpertParallel()}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    specs = eqpar.partition_specs(parallel)
    if schedule == "gpipe":
        step = eqpar.shard_map(
            lambda m, x: lax.pmean(loss(m, x), "expert"),
            mesh=mesh,
            in_specs=(specs, P("expert")),
            out_specs=P(),
        )
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(step))(parallel, x)
    else:
        step = eqpar.shard_map(
            eqpar.value_and_grad(lambda m, x: lax.pmean(loss(m, x), "expert")),
            mesh=mesh,
            in_specs=(specs, P("expert")),
            out_specs=(P(), eqpar.partition_specs(eqx.filter(parallel, eqx.is_inexact_array))),
        )
        value, grads = eqx.filter_jit(step)(parallel, x)
    assert_tree_close(value, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(sgd(parallel, grads)), serial_model)


class SwitchExperts(HandWrittenExperts):
    """Top-1, each output scaled by its probability (not renormalized)."""

    def __call__(self, x):
        probs = jax.nn.softmax(jax.vmap(self.router)(x))
        weight, chosen = lax.top_k(probs, 1)
        every = jnp.stack([jax.vmap(expert)(x) for expert in self.experts], axis=1)
        return weight * jnp.take_along_axis(every, chosen[..., None], 1)[:, 0]


def test_a_conversion_that_would_compute_something_else_is_refused():
    switch = SwitchExperts(jax.random.key(3), top_k=1)
    with pytest.raises(ValueError, match=r"differ on 8 tokens.*normalize_weights=False"):
        eqpar.parallelize(switch, {"": eqpar.ExpertParallel()})
    parallel = eqpar.parallelize(switch, {"": eqpar.ExpertParallel(normalize_weights=False)})
    x = tokens(8)
    forward = eqx.filter_jit(lambda m, x: m(x))
    assert_arrays_close(forward(eqpar.unparallelize(parallel), x), forward(switch, x))
    # A MixtureOfExperts keeps its own options where the style leaves them out.
    own = make_moe(capacity_factor=1.5, buffer_factor=2.0)
    kept = eqpar.parallelize(own, {"": eqpar.ExpertParallel()})
    assert (kept.capacity_factor, kept.buffer_factor) == (1.5, 2.0)
    assert eqpar.unparallelize(kept).capacity_factor == 1.5
    # Options the style sets belong to the parallel layout: unparallelize gives the layer's.
    style = eqpar.ExpertParallel(capacity_factor=0.5, buffer_factor=3.0)
    styled = eqpar.parallelize(own, {"": style})
    assert (styled.capacity_factor, styled.buffer_factor) == (0.5, 3.0)
    assert eqx.tree_equal(eqpar.unparallelize(styled), own)


def test_bad_inputs_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match="top_k` must be between 1 and num_experts=4"):
        MixtureOfExperts(8, 16, 4, top_k=5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="capacity_factor"):
        MixtureOfExperts(8, 16, 4, capacity_factor=0.0, key=jax.random.key(0))
    moe = make_moe()
    with pytest.raises(ValueError, match=r"input must be \[\.\.\., 8\]"):
        moe(jnp.ones((4, 3)))
    with pytest.raises(TypeError, match="no field"):
        moe.replace(experts=3)
    with pytest.raises(ValueError, match="buffer_factor"):
        eqpar.ExpertParallel(buffer_factor=0.0)
    with pytest.raises(ValueError, match="two axes"):
        eqpar.ExpertParallel(axis_name="x", model_axis_name="x")
    mesh = mesh_of((8,), ("expert",))
    six = MixtureOfExperts(8, 16, 6, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"num_experts=6, which does not divide by the size of axis .expert. \(8\)"
    ):
        eqpar.parallelize(six, {"": eqpar.ExpertParallel()}, mesh=mesh)
    with pytest.raises(TypeError, match="router"):
        eqpar.parallelize(
            eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0)), {"": eqpar.ExpertParallel()}
        )
    three = HandWrittenExperts(jax.random.key(0), top_k=3)
    with pytest.raises(ValueError, match=r"top_k=2\) disagrees"):
        eqpar.parallelize(three, {"": eqpar.ExpertParallel(top_k=2)})
    with pytest.raises(TypeError, match=r"under `jax.vmap`.*on the batch"):
        jax.vmap(moe)(jnp.ones((2, 4, 8)))
    # The batch not split over the expert axis: every device would bring the same tokens.
    mesh = mesh_of((2, 4), ("data", "expert"))
    parallel = eqpar.parallelize(moe, {"": eqpar.ExpertParallel()}, mesh=mesh)
    forward = eqpar.shard_map(
        lambda m, x: m(x)[0],
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data")),
        out_specs=P("data"),
    )
    with pytest.raises(ValueError, match=r"Split the batch over it.*P\(\('data', 'expert'\)\)"):
        forward(parallel, tokens())
    with pytest.raises(TypeError, match="must name one mesh axis"):
        eqpar.ExpertParallel(axis_name=("data", "expert"))
    with pytest.raises(TypeError, match="must name one mesh axis"):
        moe.replace(expert_axis_name=("data", "expert"))
    with pytest.raises(ValueError, match=r"capacity_factor=0.5 would drop tokens"):
        eqpar.parallelize(
            HandWrittenExperts(jax.random.key(0)), {"": eqpar.ExpertParallel(capacity_factor=0.5)}
        )
    unchecked = jax.shard_map(
        lambda m, x: m(x)[0],
        mesh=jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert")),
        in_specs=(eqpar.partition_specs(parallel), P(("data", "expert"))),
        out_specs=P(("data", "expert")),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="check_vma=False"):
        unchecked(parallel, tokens())
    # Without an expert axis too: the router losses would be each device's alone.
    data_only = jax.shard_map(
        lambda m, x: m(x)[1].load_balancing,
        mesh=jax.sharding.Mesh(np.array(jax.devices()), ("data",)),
        in_specs=(P(), P("data")),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="check_vma=False"):
        data_only(moe, tokens())
    keys = jax.random.split(jax.random.key(0), 3)
    clipped = [eqx.nn.MLP(8, 8, 16, 1, final_activation=jax.nn.hard_tanh, key=k) for k in keys[1:]]
    with pytest.raises(TypeError, match="has a final activation"):
        MixtureOfExperts.from_experts(eqx.nn.Linear(8, 2, key=keys[0]), clipped, top_k=1)
    # Activations that are separate objects but compute the same are one activation.
    exact = functools.partial(jax.nn.gelu, approximate=False)
    gelu = [eqx.nn.MLP(8, 8, 16, 1, activation=exact, key=k) for k in keys[1:]]
    assert MixtureOfExperts.from_experts(eqx.nn.Linear(8, 2, key=keys[0]), gelu, top_k=1).top_k == 1
    deep = [eqx.nn.MLP(8, 8, 16, 2, key=k) for k in keys[1:]]
    with pytest.raises(TypeError, match=r"experts/0 must be an eqx\.nn\.MLP of depth 1"):
        MixtureOfExperts.from_experts(eqx.nn.Linear(8, 2, key=keys[0]), deep, top_k=1)


def test_an_integer_batch_is_refused_naming_the_argument_and_the_cast():
    """The layer returns its output in the input's dtype: an integer batch would come back
    with its mixed values truncated, so it is refused (a float batch of the same values
    gives the float result)."""
    moe = make_moe()
    for dtype in (jnp.int32, jnp.bool_):
        with pytest.raises(TypeError, match=r"`x` has dtype (int32|bool).*x\.astype\(float32\)"):
            eqx.filter_eval_shape(moe, jnp.ones((4, FEATURES), dtype))  # refused while tracing
    y, _ = eqx.filter_eval_shape(moe, jnp.ones((4, FEATURES), jnp.float32))
    assert y.dtype == jnp.float32


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0])
@pytest.mark.parametrize("name", ["capacity_factor", "buffer_factor"])
def test_non_finite_factors_are_refused_naming_the_option(name, value):
    """`inf` (and nan) used to reach `math.ceil` and fail as a bare OverflowError."""
    with pytest.raises(ValueError, match=rf"ExpertParallel: `{name}` must be .*finite"):
        eqpar.ExpertParallel(**{name: value})
    with pytest.raises(ValueError, match=rf"MixtureOfExperts: `{name}` must be .*finite"):
        MixtureOfExperts(FEATURES, HIDDEN, 4, key=jax.random.key(0), **{name: value})
    with pytest.raises(ValueError, match=rf"MixtureOfExperts: `{name}` must be .*finite"):
        make_moe().replace(**{name: value})


def test_a_capacity_past_every_token_drops_nothing():
    """A finite factor too large for int32 arithmetic caps at the tokens: nothing dropped."""
    x = tokens(16)
    y, losses = eqx.filter_jit(make_moe(4).replace(capacity_factor=1e30))(x)
    want, _ = eqx.filter_jit(make_moe(4))(x)
    assert int(losses.dropped) == 0
    assert_arrays_close(y, want)
