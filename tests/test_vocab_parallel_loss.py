"""`vocab_parallel_cross_entropy` against the serial cross entropy: values and gradients, a
head converted by `ColumnParallel(gather_output=False)`, a vocabulary split over two axes,
and the bytes it moves (a few numbers per token, not the logits)."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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

    value, grad = jax.value_and_grad(parallel)(logits)
    expected, expected_grad = jax.value_and_grad(serial)(logits)
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
