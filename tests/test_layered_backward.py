"""The layer-by-layer backward of the training schedules (`eqpar/pipeline/_layered.py`) and
the loss seed 1/(M x shards): schedules on data=2 x pipe=2 against the serial twin and
`jax.grad` for layers and stages of many kinds (integer and key fields stacked per layer,
integer activations, masks, keys and keyword arguments, bfloat16, stage-level recompute, a
vocabulary-parallel head), and what the forward keeps: values the same in every layer once."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_pipeline import layout
from test_pipeline_residuals import spy_layered_backward

from eqpar.nn.pipeline import PipelineModule, ScannedLayers
from eqpar.pipeline import Microbatched, _layered

F = 4
ROWS = 16  # 2 data shards x 4 microbatches x 2 rows


def mse(y, t):
    y = y[0] if isinstance(y, tuple) else y
    return jnp.mean((y.astype(jnp.float32) - t) ** 2)


def _compare(
    module,
    x,
    t,
    *,
    schedule,
    args=(),
    arg_specs=(),
    serial_args=None,
    kwargs=None,
    rtol=1e-5,
    loss_fn=mse,
):
    """value_and_grad(return_all_grads=True) on data=2 x pipe=2 against jax.grad of the
    serial twin (`apply_serially`) with the same loss."""
    kwargs = kwargs or {}
    serial_args = args if serial_args is None else serial_args
    arrays, static, specs = layout(module)

    diff, rest = eqx.partition(arrays, eqx.is_inexact_array)
    x_diff, x_rest = eqx.partition(x, eqx.is_inexact_array)

    def serial_loss(diff, x_diff):
        model = eqx.combine(diff, rest, static)
        y = model.apply_serially(eqx.combine(x_diff, x_rest), *serial_args, **kwargs)
        return loss_fn(y, t)

    loss_ref, (grads_ref, x_grads_ref) = jax.value_and_grad(serial_loss, argnums=(0, 1))(
        diff, x_diff
    )

    def step(arrays, x, t, *args):
        model = eqx.combine(arrays, static)
        value, (grads, _, x_grads) = model.value_and_grad(
            loss_fn, x, t, *args, schedule=schedule, return_all_grads=True, **kwargs
        )
        return value, eqx.filter(grads, eqx.is_inexact_array), x_grads

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "pipe"))
    x_spec = jax.tree.map(lambda _: P("data"), x)
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, x_spec, P("data"), *arg_specs),
            out_specs=(P(), specs, x_spec),
        )
    )
    loss, grads, x_grads = fn(arrays, x, t, *args)
    numerics.assert_tree_close(loss, loss_ref, rtol=rtol)
    numerics.assert_tree_close(eqx.filter(grads, eqx.is_inexact_array), grads_ref, rtol=rtol)
    numerics.assert_tree_close(
        eqx.filter(x_grads, eqx.is_inexact_array),
        eqx.filter(x_grads_ref, eqx.is_inexact_array),
        rtol=rtol,
    )


def _pipelined(layers, schedule, *, remat):
    """`layers` in 2 stages (2 per device with the circular schedule), 4 microbatches."""
    return PipelineModule.from_layers(
        layers,
        num_stages=2,
        num_microbatches=4,
        num_repeats=2 if schedule == "circular" else 1,
        remat=remat,
    )


def _data(key=1, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(key))
    x = jax.random.normal(k1, (ROWS, F)).astype(dtype)
    t = jax.random.normal(k2, (ROWS, F))
    return x, t


# --- layers with an integer leaf stacked per layer (a layer index) ----------------------


class IndexedLayer(eqx.Module):
    linear: eqx.nn.Linear
    index: jax.Array  # int32, one per layer

    def __init__(self, key, index):
        self.linear = eqx.nn.Linear(F, F, key=key)
        self.index = jnp.asarray(index, jnp.int32)

    def __call__(self, x):
        gain = 1.0 + 0.25 * self.index.astype(x.dtype)
        return x + gain * jnp.tanh(jax.vmap(self.linear)(x))


def _indexed_layers(n=8):
    keys = jax.random.split(jax.random.key(3), n)
    return eqx.filter_vmap(IndexedLayer)(keys, jnp.arange(n))


@pytest.mark.parametrize(
    ("schedule", "remat"),
    [("circular", "none"), ("circular", "full"), ("zb-h1", "none"), ("gpipe", "matmuls")],
)
def test_layer_index_stacked_per_layer(schedule, remat, monkeypatch):
    calls = spy_layered_backward(monkeypatch)
    module = _pipelined(_indexed_layers(), schedule, remat=remat)
    x, t = _data()
    _compare(module, x, t, schedule=schedule)
    assert calls


# --- an integer leaf in the activations ---------------------------------------------------


class CountingLayer(eqx.Module):
    """Takes and returns `(h, count)`; `count` (int32 per row) grows by one per layer and
    scales the update, so the integer leaf matters to every layer's gradient."""

    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(F, F, key=key)

    def __call__(self, hc):
        h, count = hc
        gain = 1.0 + 0.1 * count.astype(h.dtype)[:, None]
        return h + gain * jnp.tanh(jax.vmap(self.linear)(h)), count + 1


@pytest.mark.parametrize(("schedule", "remat"), [("1f1b", "none"), ("circular", "full")])
def test_integer_leaf_in_the_activations(schedule, remat, monkeypatch):
    calls = spy_layered_backward(monkeypatch)
    layers = eqx.filter_vmap(CountingLayer)(jax.random.split(jax.random.key(3), 8))
    module = _pipelined(layers, schedule, remat=remat)
    h, t = _data()
    count = jnp.arange(ROWS, dtype=jnp.int32) % 3
    _compare(module, (h, count), t, schedule=schedule)
    assert calls


# --- extra stage arguments: a Microbatched mask, a keyword, a PRNG key ----------------------


class MaskedDropoutLayer(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(F, F, key=key)

    def __call__(self, x, mask, *, key, gain):
        keep = jax.random.bernoulli(key, 0.7, (F,))  # per feature: the same in every microbatch
        update = jnp.tanh(jax.vmap(self.linear)(x)) * keep / 0.7
        return x + gain * jnp.where(mask[:, None], update, 0.0)


@pytest.mark.parametrize(
    ("schedule", "remat"), [("1f1b", "none"), ("1f1b", "full"), ("circular", "full")]
)
def test_mask_key_and_keyword_arguments(schedule, remat, monkeypatch):
    calls = spy_layered_backward(monkeypatch)
    layers = eqx.filter_vmap(MaskedDropoutLayer)(jax.random.split(jax.random.key(3), 8))
    module = _pipelined(layers, schedule, remat=remat)
    x, t = _data()
    mask = jax.random.bernoulli(jax.random.key(8), 0.6, (ROWS,))
    key = jax.random.key(11)
    gain = jnp.float32(0.5)
    _compare(
        module,
        x,
        t,
        schedule=schedule,
        args=(Microbatched(mask),),
        arg_specs=(P("data"),),
        kwargs=dict(key=key, gain=gain),
    )
    assert calls


def test_loop_invariant_arguments_are_stored_once_per_layer():
    """What the layers' pullbacks keep of a stage argument that is the same for every layer
    (a mask) is stored once per slot, as autodiff of the whole stage's scan keeps it (it
    hoists loop-invariant residuals out of the scan), not once per layer ([L, rows, 1024])."""
    layers = eqx.filter_vmap(MaskedDropoutLayer)(jax.random.split(jax.random.key(3), 4))
    mask = jnp.ones((2, 1024), bool)  # big, to find it

    class Wide(eqx.Module):  # a layer whose mask is [rows, 1024]
        inner: MaskedDropoutLayer

        def __call__(self, x, mask, *, key, gain):
            return self.inner(x, mask[:, 0], key=key, gain=gain + 0 * mask.sum())

    stack = ScannedLayers(Wide(layers), remat="full")
    layered = _layered_of(stack)
    shapes = layered.residual_shapes(
        stack, jnp.ones((2, F)), (mask,), dict(key=jax.random.key(0), gain=jnp.float32(1))
    )
    stored_masks = [s.shape for s in shapes if s.ndim and s.shape[-1] == 1024]
    assert stored_masks in ([], [(2, 1024)])  # once per layer it would be [(4, 2, 1024)]


class CausalLayer(eqx.Module):
    """Attention-like: a causal mask built inside the layer (as examples/lm.py's Block
    does), constant across layers and microbatches."""

    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(F, F, key=key)

    def __call__(self, x):  # x: [rows, seq, F]
        seq = x.shape[1]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        q = jax.vmap(jax.vmap(self.linear))(x)
        scores = jnp.einsum("bqf,bkf->bqk", q, x)
        scores = jnp.where(causal, scores, jnp.finfo(x.dtype).min)
        return x + jnp.einsum("bqk,bkf->bqf", jax.nn.softmax(scores, axis=-1), x)


def _layered_of(stack):
    layer_stack = stack.__pipeline_layers__()
    assert layer_stack is not None
    return _layered.LayeredStage(layer_stack, 1)


def _whole_stage_residual_bytes(stack, h):
    """What the whole-stage path (`_loop._Residuals`) stores per slot: the pullback's leaves
    other than the parameters and the input."""
    diff, static = eqx.partition(stack, eqx.is_inexact_array)

    def probe(diff, h):
        _, pullback = jax.vjp(lambda d, h: eqx.combine(d, static)(h), diff, h)
        inputs = jax.tree.leaves((diff, h))
        return [r for r in jax.tree.leaves(pullback) if not any(r is a for a in inputs)]

    return sum(s.size * s.dtype.itemsize for s in jax.eval_shape(probe, diff, h))


def test_layered_residuals_no_larger_than_the_whole_stages():
    """Per residual slot the layered forward stores no more than the whole stage's pullback
    keeps (remat none): a constant built inside the layer (a causal mask, the fill of the
    masked scores) is kept once, not once per layer (8 layers, seq 64 here; kept per layer,
    GPT-2-small blocks stored 1.26x the whole stage's per slot)."""
    layers = eqx.filter_vmap(CausalLayer)(jax.random.split(jax.random.key(3), 8))
    stack = ScannedLayers(layers)
    h = jnp.ones((2, 64, F))
    layered = _layered_of(stack)
    shapes = layered.residual_shapes(stack, h, (), {})
    stored = sum(s.size * s.dtype.itemsize for s in shapes)
    assert stored <= _whole_stage_residual_bytes(stack, h)


# --- bfloat16 parameters, float32 loss ------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "circular"])
def test_bfloat16_layers_float32_loss(schedule, monkeypatch):
    calls = spy_layered_backward(monkeypatch)
    layers = eqx.filter_vmap(CountingLayer)(jax.random.split(jax.random.key(3), 8))
    layers = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, layers
    )
    module = _pipelined(layers, schedule, remat="none")
    h, t = _data(dtype=jnp.bfloat16)
    count = jnp.zeros(ROWS, jnp.int32)
    _compare(module, (h, count), t, schedule=schedule, rtol=5e-2)
    assert calls


# --- stage-level recompute ----------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["zb-h1", "circular"])
def test_stage_recompute_of_layers(schedule, monkeypatch):
    calls = spy_layered_backward(monkeypatch)
    layers = _indexed_layers()
    stacked = ScannedLayers(
        jax.tree.map(
            lambda a: a.reshape(4 if schedule == "circular" else 2, -1, *a.shape[1:]), layers
        )
    )
    module = PipelineModule(
        stacked,
        num_stages=2,
        num_microbatches=4,
        num_repeats=2 if schedule == "circular" else 1,
        remat="full",
    )
    x, t = _data()
    _compare(module, x, t, schedule=schedule)
    assert calls


# --- a vocabulary-parallel head (the loss on every device) over a data axis ----------------

VOCAB = 16


class VocabHead(eqx.Module):
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __call__(self, h, t):
        from eqpar.nn import ColumnParallelLinear, vocab_parallel_cross_entropy

        logits = jax.vmap(self.unembed)(jax.vmap(self.norm)(h))
        if isinstance(self.unembed, ColumnParallelLinear):
            return jnp.mean(vocab_parallel_cross_entropy(logits, t, axis_name="pipe"))
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, t[:, None], axis=-1))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "circular"])
def test_vocab_parallel_head_over_a_data_axis(schedule, monkeypatch):
    """`return_all_grads=True` with the loss on every device (`loss_everywhere`) and the
    batch split over `data`: the head's and the input's gradients carry the 1/(M x shards)
    seed once (not twice, not never)."""
    import eqpar

    calls = spy_layered_backward(monkeypatch)
    module = _pipelined(_indexed_layers(), schedule, remat="none")
    k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
    norm = eqx.tree_at(
        lambda n: (n.weight, n.bias),
        eqx.nn.LayerNorm(F),
        (1 + jax.random.normal(k1, (F,)) / 4, jax.random.normal(k2, (F,)) / 4),
    )
    head = VocabHead(norm, eqx.nn.Linear(F, VOCAB, key=k3))
    x, _ = _data()
    t = jax.random.randint(k4, (ROWS,), 0, VOCAB)
    arrays, static, specs = layout(module)
    parallel = eqpar.parallelize(head, {"unembed": eqpar.ColumnParallel("pipe")})
    head_arrays, head_static = eqx.partition(parallel, eqx.is_array)
    head_specs = eqpar.partition_specs(parallel)

    def serial_loss(arrays, head, x):
        y = eqx.combine(arrays, static).apply_serially(x)
        return head(y, t)

    loss_ref, (grads_ref, head_ref, x_ref) = jax.value_and_grad(
        serial_loss, argnums=(0, 1, 2), allow_int=True
    )(arrays, head, x)

    def step(arrays, head_arrays, x, t):
        model = eqx.combine(arrays, static)
        value, (grads, head_grads, x_grads) = model.value_and_grad(
            eqx.combine(head_arrays, head_static), x, t, schedule=schedule,
            return_all_grads=True,
        )  # fmt: skip
        head_grads = eqx.filter(head_grads, eqx.is_array)
        return value, eqx.filter(grads, eqx.is_array), head_grads, x_grads

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "pipe"))
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, head_specs, P("data"), P("data")),
            out_specs=(P(), specs, head_specs, P("data")),
        )
    )
    loss, grads, head_grads, x_grads = fn(arrays, head_arrays, x, t)
    assert calls
    numerics.assert_tree_close(loss, loss_ref, rtol=1e-5)
    numerics.assert_tree_close(
        eqx.filter(grads, eqx.is_inexact_array),
        eqx.filter(grads_ref, eqx.is_inexact_array),
        rtol=1e-5,
    )
    numerics.assert_tree_close(x_grads, x_ref, rtol=1e-5)
    numerics.assert_tree_close(
        (head_grads.norm.weight, head_grads.norm.bias, head_grads.unembed.weight),
        (head_ref.norm.weight, head_ref.norm.bias, head_ref.unembed.weight),
        rtol=1e-5,
    )


# --- a layer whose pullback keeps nothing but its parameters --------------------------------


class BiasLayer(eqx.Module):
    bias: jax.Array

    def __call__(self, x):
        return x + self.bias


@pytest.mark.parametrize("schedule", ["1f1b", "circular"])
def test_layers_without_stored_residuals(schedule, monkeypatch):
    calls = spy_layered_backward(monkeypatch)
    layers = BiasLayer(jax.random.normal(jax.random.key(3), (8, F)))
    module = _pipelined(layers, schedule, remat="none")
    x, t = _data()
    _compare(module, x, t, schedule=schedule)
    assert calls


# --- layers with no inexact parameter -------------------------------------------------------


class IntShiftLayer(eqx.Module):
    shift: jax.Array  # int32 per layer: nothing to train

    def __call__(self, x):
        # A quarter step per unit of shift: a shift of 2 would drive tanh into saturation,
        # where `1 - tanh(z) ** 2` cancels and the input's gradient (a product of eight such
        # factors) keeps only ~1e-4 of its relative precision, on any machine.
        return jnp.tanh(x + 0.25 * self.shift.astype(x.dtype))


def test_layers_without_parameters():
    """A stack whose layers hold only integer arrays (nothing to train; the input's gradient
    still wanted, `return_all_grads=True`)."""
    layers = IntShiftLayer(jnp.arange(8, dtype=jnp.int32) % 3)
    module = PipelineModule.from_layers(layers, num_stages=2, num_microbatches=4)
    x, t = _data()
    _compare(module, x, t, schedule="1f1b")


# --- a batch split over data through its targets alone --------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_targets_split_over_data_input_replicated(schedule, monkeypatch):
    """`x` the same on both data shards, the targets split: the loss is the mean of the
    shards' losses and `x`'s gradient is summed over the shards (seeded by 1/(M x 2))."""
    calls = spy_layered_backward(monkeypatch)
    module = PipelineModule.from_layers(_indexed_layers(), num_stages=2, num_microbatches=4)
    x = jax.random.normal(jax.random.key(1), (ROWS // 2, F))
    t = jax.random.normal(jax.random.key(2), (ROWS, F))
    arrays, static, specs = layout(module)
    diff, rest = eqx.partition(arrays, eqx.is_inexact_array)

    def serial_loss(diff, x):
        y = eqx.combine(diff, rest, static).apply_serially(x)
        return (mse(y, t[: ROWS // 2]) + mse(y, t[ROWS // 2 :])) / 2

    loss_ref, (grads_ref, x_ref) = jax.value_and_grad(serial_loss, argnums=(0, 1))(diff, x)

    def step(arrays, x, t):
        value, (grads, _, x_grads) = eqx.combine(arrays, static).value_and_grad(
            mse, x, t, schedule=schedule, return_all_grads=True
        )
        return value, eqx.filter(grads, eqx.is_inexact_array), x_grads

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "pipe"))
    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(specs, P(), P("data")), out_specs=(P(), specs, P())
        )
    )
    loss, grads, x_grads = fn(arrays, x, t)
    assert calls
    numerics.assert_tree_close(loss, loss_ref, rtol=1e-5)
    numerics.assert_tree_close(eqx.filter(grads, eqx.is_inexact_array), grads_ref, rtol=1e-5)
    numerics.assert_tree_close(x_grads, x_ref, rtol=1e-5)


# --- a PRNG key stacked per layer (a field of each layer) ----------------------------------


class KeyedLayer(eqx.Module):
    linear: eqx.nn.Linear
    key: jax.Array  # a typed PRNG key per layer: a non-inexact stacked array

    def __init__(self, key):
        self.linear = eqx.nn.Linear(F, F, key=key)
        self.key = jax.random.fold_in(key, 1)

    def __call__(self, x):
        keep = jax.random.bernoulli(self.key, 0.7, (F,))
        return x + jnp.tanh(jax.vmap(self.linear)(x)) * keep


@pytest.mark.parametrize(("schedule", "remat"), [("1f1b", "none"), ("circular", "full")])
def test_prng_key_stacked_per_layer(schedule, remat, monkeypatch):
    calls = spy_layered_backward(monkeypatch)
    layers = eqx.filter_vmap(KeyedLayer)(jax.random.split(jax.random.key(3), 8))
    module = _pipelined(layers, schedule, remat=remat)
    x, t = _data()
    _compare(module, x, t, schedule=schedule)
    assert calls


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_constant_built_in_the_layer_trains_like_the_serial_model(schedule):
    """Layers that build a causal mask inside (kept once, not per layer) give the serial
    loss and gradients."""
    layers = eqx.filter_vmap(CausalLayer)(jax.random.split(jax.random.key(3), 4))
    module = PipelineModule.from_layers(layers, num_stages=2, num_microbatches=4)
    k1, k2 = jax.random.split(jax.random.key(1))
    # Small inputs: the unscaled attention scores grow the activations layer by layer, and
    # float32 rounding with them; at this size the gradients stay of order one.
    x = 0.3 * jax.random.normal(k1, (ROWS, 6, F))
    t = jax.random.normal(k2, (ROWS, 6, F))
    _compare(module, x, t, schedule=schedule)
