"""Tensor-parallel MLP and attention blocks against plain-JAX serial twins."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close
from test_tensor_parallel import mesh_of, sharded_apply

from eqpar.nn import TPAttentionBlock, TPLayerNorm, TPMLPBlock

D, HIDDEN, HEADS, SEQ = 16, 32, 8, 6
X_SPEC = P(None, None, "model")  # [batch, seq, features]


def serial_mlp(block, x):
    up, down = block.up.to_linear(), block.down.to_linear()
    h = jax.nn.gelu(jnp.einsum("...i,oi->...o", x, up.weight) + up.bias)
    return jnp.einsum("...i,oi->...o", h, down.weight) + down.bias


def serial_attention(block, x):
    qkv = block.qkv.to_linear()
    out = block.out.to_linear()
    projected = jnp.einsum("...i,oi->...o", x, qkv.weight) + qkv.bias
    heads = projected.reshape(*x.shape[:-1], HEADS, 3, D // HEADS)  # head-major rows
    q, k, v = heads[..., 0, :], heads[..., 1, :], heads[..., 2, :]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
    mask = np.tril(np.ones((SEQ, SEQ), bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(x.shape)
    return jnp.einsum("...i,oi->...o", mixed, out.weight) + out.bias


BLOCKS = {
    "mlp": (lambda ring: TPMLPBlock(D, HIDDEN, use_ring=ring, key=jax.random.key(0)), serial_mlp),
    "attention": (
        lambda ring: TPAttentionBlock(D, num_heads=HEADS, use_ring=ring, key=jax.random.key(0)),
        serial_attention,
    ),
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("ring", [False, True])
def test_block_matches_serial_twin(name, n, ring):
    make, serial = BLOCKS[name]
    block = make(ring)
    mesh = mesh_of(n)
    x = jax.random.normal(jax.random.key(1), (2, SEQ, D))

    def parallel_loss(block, x):
        return jnp.sum(jnp.sin(sharded_apply(block, x, mesh, X_SPEC, X_SPEC)))

    def serial_loss(block, x):
        return jnp.sum(jnp.sin(serial(block, x)))

    got = jax.jit(lambda b, x: sharded_apply(b, x, mesh, X_SPEC, X_SPEC))(block, x)
    assert_tree_close(got, jax.jit(serial)(block, x), what="output")
    grads = jax.jit(jax.grad(parallel_loss, argnums=(0, 1)))(block, x)
    expected = jax.jit(jax.grad(serial_loss, argnums=(0, 1)))(block, x)
    assert_tree_close(grads, expected, what="gradients")


def test_attention_validation():
    with pytest.raises(ValueError, match="d_model=10 must be a positive multiple of num_heads=4"):
        TPAttentionBlock(10, num_heads=4, key=jax.random.key(0))
    block = TPAttentionBlock(12, num_heads=3, key=jax.random.key(0))
    x = jnp.ones((1, 2, 12))
    with pytest.raises(
        ValueError, match="num_heads=3 does not divide by the size of axis 'model' \\(2\\)"
    ):
        sharded_apply(block, x, mesh_of(2), X_SPEC, X_SPEC)


def test_blocks_are_equinox_modules():
    assert isinstance(BLOCKS["mlp"][0](False), eqx.Module)


@pytest.mark.parametrize("n", [1, 4])
def test_layer_norm_matches_equinox(n):
    norm = TPLayerNorm(D)
    norm = eqx.tree_at(
        lambda m: (m.weight, m.bias), norm, (jnp.linspace(0.5, 2, D), jnp.linspace(-1, 1, D))
    )
    serial = eqx.nn.LayerNorm(D)
    serial = eqx.tree_at(lambda m: (m.weight, m.bias), serial, (norm.weight, norm.bias))
    x = jax.random.normal(jax.random.key(0), (2, SEQ, D)) * 3 + 1
    mesh = mesh_of(n)

    def parallel_loss(m, x):
        return jnp.sum(jnp.cos(sharded_apply(m, x, mesh, X_SPEC, X_SPEC)))

    def serial_loss(m, x):
        return jnp.sum(jnp.cos(jax.vmap(jax.vmap(m))(x)))

    assert_tree_close(
        jax.jit(lambda m, x: sharded_apply(m, x, mesh, X_SPEC, X_SPEC))(norm, x),
        jax.vmap(jax.vmap(serial))(x),
        what="output",
    )
    got = jax.jit(jax.grad(parallel_loss, argnums=(0, 1)))(norm, x)
    want = jax.grad(serial_loss, argnums=(0, 1))(serial, x)
    assert_tree_close(
        (got[0].weight, got[0].bias, got[1]),
        (want[0].weight, want[0].bias, want[1]),
        what="(weight, bias, input) gradients",
    )


def test_layer_norm_refuses_parameters_that_are_not_split():
    """`weight` / `bias` passed whole (in_specs P()) against a feature block: the parameter,
    its local shape against the expected one, and the fix, not a broadcasting error."""
    norm = TPLayerNorm(D)
    x = jnp.ones((2, SEQ, D))
    with pytest.raises(
        ValueError, match=r"TPLayerNorm: the local block of weight has shape \(16,\) but \(8,\)"
    ):
        jax.shard_map(lambda m, x: m(x), mesh=mesh_of(2), in_specs=(P(), X_SPEC), out_specs=X_SPEC)(
            norm, x
        )


def test_attention_block_refuses_a_zero_length_sequence():
    block = TPAttentionBlock(D, num_heads=HEADS, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"TPAttentionBlock: zero-length sequence \(`x` has shape"):
        sharded_apply(block, jnp.ones((2, 0, D)), mesh_of(2), X_SPEC, X_SPEC)
