"""`vocab_parallel_cross_entropy` against the serial cross entropy: values and gradients, a
head converted by `ColumnParallel(gather_output=False)`, a vocabulary split over two axes,
and the bytes it moves (a few numbers per token, not the logits)."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import collective_bytes
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

import eqpar
from eqpar.nn import vocab_parallel_cross_entropy

VOCAB, WIDTH, TOKENS = 32, 8, 6


def serial_cross_entropy(logits, targets):
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("axes", [("model",), ("model", "pipe")])
def test_values_and_gradients_match_serial(axes):
    sizes = (4,) if len(axes) == 1 else (2, 2)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(sizes), axes)
    axis = axes if len(axes) > 1 else axes[0]
    logits = 3 * jax.random.normal(jax.random.key(0), (2, TOKENS, VOCAB))
    targets = jax.random.randint(jax.random.key(1), (2, TOKENS), 0, VOCAB)

    def parallel(logits):
        loss = jax.shard_map(
            lambda z, t: jnp.mean(vocab_parallel_cross_entropy(z, t, axis_name=axis)),
            mesh=mesh,
            in_specs=(P(None, None, axis), P()),
            out_specs=P(),
        )
        return loss(logits, targets)

    def serial(logits):
        return jnp.mean(serial_cross_entropy(logits, targets))

    value, grad = jax.jit(jax.value_and_grad(parallel))(logits)
    expected, expected_grad = jax.jit(jax.value_and_grad(serial))(logits)
    assert_tree_close(value, expected, rtol=1e-6, what="value")
    assert_tree_close(grad, expected_grad, what="gradient")


def test_column_parallel_head_trains_like_the_serial_head():
    """An `eqx.nn.Linear` head converted by the plan, its logits never gathered: loss and
    weight gradients equal the serial head's, and only a few numbers per token move."""
    head = eqx.nn.Linear(WIDTH, VOCAB, key=jax.random.key(2))
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    parallel = eqpar.parallelize(head, {"": eqpar.ColumnParallel("model", gather_output=False)})
    h = jax.random.normal(jax.random.key(3), (TOKENS, WIDTH))
    targets = jax.random.randint(jax.random.key(4), (TOKENS,), 0, VOCAB)

    def parallel_loss(head, h):
        logits = jax.vmap(head)(h)
        return jnp.mean(vocab_parallel_cross_entropy(logits, targets, axis_name="model"))

    loss = eqpar.shard_map(
        parallel_loss, mesh=mesh, in_specs=(eqpar.partition_specs(parallel), P()), out_specs=P()
    )
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = step(parallel, h)
    expected, expected_grads = eqx.filter_value_and_grad(
        lambda head: jnp.mean(serial_cross_entropy(jax.vmap(head)(h), targets))
    )(head)
    assert_tree_close(value, expected, rtol=1e-6, what="value")
    assert_tree_close(
        (grads.weight, grads.bias), (expected_grads.weight, expected_grads.bias), what="gradients"
    )
    moved = collective_bytes(step.lower(parallel, h).compile())
    gathered_logits = TOKENS * VOCAB * 4 * 3 / 4  # what gather_output=True would receive
    assert moved < gathered_logits


def test_bad_inputs():
    """The checks of its own, behind the runtime type check the tests add (which rejects the
    same inputs first, from the annotations)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    unchecked = inspect.unwrap(vocab_parallel_cross_entropy)

    def call(logits, targets):
        return jax.shard_map(
            lambda z, t: unchecked(z, t, axis_name="model"),
            mesh=mesh,
            in_specs=(P(None, "model"), P()),
            out_specs=P(),
        )(logits, targets)

    with pytest.raises(ValueError, match="`targets` must have the shape of `logits`"):
        call(jnp.zeros((3, 8)), jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="must be integer token ids"):
        call(jnp.zeros((3, 8)), jnp.zeros((3,)))
    with pytest.raises(TypeError, match="`ignore_index` must be an int, got bool"):
        jax.shard_map(
            lambda z, t: unchecked(z, t, axis_name="model", ignore_index=True),
            mesh=mesh,
            in_specs=(P(None, "model"), P()),
            out_specs=P(),
        )(jnp.zeros((3, 8)), jnp.zeros((3,), jnp.int32))


def vocab_loss(mesh, logits_spec=None, axis="model", **options):
    """The loss inside shard_map, compiled (run eagerly, shard_map dispatches op by op)."""
    logits_spec = P(None, "model") if logits_spec is None else logits_spec
    return jax.jit(
        jax.shard_map(
            lambda z, t: vocab_parallel_cross_entropy(z, t, axis_name=axis, **options),
            mesh=mesh,
            in_specs=(logits_spec, P()),
            out_specs=P(),
        )
    )


def test_targets_outside_the_vocabulary_read_as_the_serial_twin_reads_them():
    """`-1` (and anything in [-V, 0)) counts from the end and an id outside [-V, V) is nan,
    value and gradient as the serial twin (`take_along_axis` indexing, optax's loss)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    logits = jax.random.normal(jax.random.key(0), (8, VOCAB))
    targets = jnp.array([0, -1, -VOCAB, VOCAB - 1, VOCAB, 1000, -VOCAB - 1, -100])
    loss = vocab_loss(mesh)
    got = loss(logits, targets)
    expected = serial_cross_entropy(logits, targets)
    assert np.isnan(expected[4:]).all() and np.isfinite(expected[:4]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert_tree_close(got[:4], expected[:4], rtol=1e-6, what="in-range values")
    # optax's gradient for an id with no logit is the softmax alone (the log-sum-exp's).
    grad = jax.jit(jax.grad(lambda z: jnp.sum(loss(z, targets))))(logits)
    optax_loss = optax.softmax_cross_entropy_with_integer_labels
    expected_grad = jax.grad(lambda z: jnp.sum(optax_loss(z, targets)))(logits)
    assert_tree_close(grad, expected_grad, what="gradient")
    with jax.debug_nans(True), pytest.raises(FloatingPointError):
        jax.jit(loss)(logits[4:5], targets[4:5])


def test_narrow_integer_targets_are_read_as_their_values():
    """Byte-level ids in uint8 with V = 256 (and int16 / uint16 ids): compared in the ids' own
    dtype, V wrapped to 0 and every loss was nan, and -100 matched the id 156."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    logits = jax.random.normal(jax.random.key(0), (5, 256))
    ids = np.array([0, 4, 156, 200, 255])
    expected = serial_cross_entropy(logits, jnp.asarray(ids))
    for dtype in (jnp.uint8, jnp.int16, jnp.uint16):
        targets = jnp.asarray(ids, dtype)
        assert_tree_close(vocab_loss(mesh)(logits, targets), expected, rtol=1e-6, what=str(dtype))
        ignoring = vocab_loss(mesh, ignore_index=-100)(logits, targets)
        assert_tree_close(ignoring, expected, rtol=1e-6, what=f"{dtype}, ignore_index=-100")


def test_ignore_index_leaves_positions_out_of_the_loss_and_gradient():
    """Ignored positions give loss 0 and no gradient (no nan from an id outside the
    vocabulary), and `sum(loss) / count` is the serial masked mean, value and gradient."""
    ignore_index = -100
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    logits = jax.random.normal(jax.random.key(0), (2, TOKENS, VOCAB))
    targets = jax.random.randint(jax.random.key(1), (2, TOKENS), 0, VOCAB)
    targets = targets.at[:, 0].set(5).at[0, -2:].set(ignore_index).at[1, -1].set(ignore_index)
    real = targets != ignore_index
    loss = vocab_loss(mesh, P(None, None, "model"), ignore_index=ignore_index)

    def parallel(logits):
        return jnp.sum(loss(logits, targets)) / jnp.sum(real)

    def serial(logits):  # the serial masked loss, padding given a real id first
        per_token = serial_cross_entropy(logits, jnp.where(real, targets, 0))
        return jnp.sum(jnp.where(real, per_token, 0.0)) / jnp.sum(real)

    per_token = loss(logits, targets)
    assert (per_token[~real] == 0).all()
    value, grad = jax.jit(jax.value_and_grad(parallel))(logits)
    expected, expected_grad = jax.value_and_grad(serial)(logits)
    assert_tree_close(value, expected, rtol=1e-6, what="masked mean")
    assert_tree_close(grad, expected_grad, what="gradient")
    assert (grad[~real] == 0).all()


def test_logits_not_split_over_the_vocabulary_axis_are_refused():
    """Logits whole on every device (`in_specs=P()`) would give the serial loss + log(n):
    refused, naming the argument, the axis and the fix; unchecked under check_vma=False."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("model", "pipe"))
    logits = jax.random.normal(jax.random.key(0), (3, 16))
    targets = jnp.array([0, 7, 15])
    with pytest.raises(ValueError, match=r"`logits` are the same on every device of axis 'model'"):
        vocab_loss(mesh, P())(logits, targets)
    refused = r"axis 'pipe'.*log\(2\).*P\(\.\.\., \('model', 'pipe'\)\)"
    with pytest.raises(ValueError, match=refused):
        vocab_loss(mesh, P(None, "model"), axis=("model", "pipe"))(logits, targets)
    split = vocab_loss(mesh, P(None, ("model", "pipe")), axis=("model", "pipe"))
    assert_tree_close(split(logits, targets), serial_cross_entropy(logits, targets), rtol=1e-6)
    unchecked = jax.shard_map(
        lambda z, t: vocab_parallel_cross_entropy(z, t, axis_name="model"),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P(),
        check_vma=False,
    )
    assert unchecked(logits, targets).shape == (3,)
