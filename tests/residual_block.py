"""A residual MLP block over one sequence, written as Equinox code writes one (pre-norm,
per-token `jax.vmap`); the stack tests share it."""

import equinox as eqx
import jax


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key, dim=16, hidden=64):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, dim, key=k2)

    def __call__(self, x):
        return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(self.norm(t)))))(x)
