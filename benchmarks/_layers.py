"""The transformer layer the memory benchmarks share, written the way the Equinox
documentation writes one: `eqx.nn.MultiheadAttention`, `LayerNorm`, and a per-token MLP of
two `eqx.nn.Linear`s applied with `jax.vmap` (pre-norm residual blocks)."""

import equinox as eqx
import jax


class Layer(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm

    def __init__(self, dim: int, heads: int, hidden: int, *, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, hidden, key=k2)
        self.down = eqx.nn.Linear(hidden, dim, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x` is one sequence, `[seq, dim]`."""
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(h)


def stacked_layers(depth: int, dim: int, heads: int, hidden: int, *, seed: int = 0) -> Layer:
    """`depth` layers stacked on a leading axis (for `eqpar.nn.ScannedLayers`)."""
    keys = jax.random.split(jax.random.key(seed), depth)
    return eqx.filter_vmap(lambda k: Layer(dim, heads, hidden, key=k))(keys)
