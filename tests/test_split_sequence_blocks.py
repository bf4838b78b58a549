"""`SplitSequence` on hand-written blocks: blocks that return `(x, cache)`, raw weight arrays
laid out by `Sharded` (the compiled route), and linears called per token.

- A block returning `(x, cache)` runs on this device's tokens; the activation is gathered
  where the list ends and every block's per-token cache on exit, so the loop collects the
  serial caches.
- The Llama of `llama_style.py` (raw arrays, hand-written attention) with `Sharded` keys
  and `SplitSequence`: under `jax.jit` with the mesh in context the split is a layout the
  compiler honours, and the step is the serial one; without the mesh, one message names it.
- A sequence-parallel column linear called per token gives `[n, out / n]` per token; a
  block whose own code reshapes that into heads is refused with the route that works.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import llama_style as llama
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from numerics import assert_arrays_close, assert_tree_close
from test_any_model import LLAMA_TENSOR_PARALLEL, mesh_of, serial_step, sgd

import eqpar

DIM, HIDDEN, SEQ = 8, 16, 8


class CachingBlock(eqx.Module):
    """Per-token linears (`jax.vmap(self.linear)(x)`, Equinox's way), an MLP around a
    residual, and a per-token cache (the normed input's keys) returned beside the output."""

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    key: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm = eqx.nn.LayerNorm(DIM)
        self.up = eqx.nn.Linear(DIM, HIDDEN, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, DIM, key=k2)
        self.key = eqx.nn.Linear(DIM, DIM, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.norm)(x)
        y = jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))
        return x + y, jax.vmap(self.key)(h)


class CachingModel(eqx.Module):
    blocks: list

    def __call__(self, x):  # one sequence [seq, dim]
        caches = []
        for block in self.blocks:
            x, cache = block(x)
            caches.append(cache)
        return x, caches


def caching_loss(model, x):
    out, caches = jax.vmap(model)(x)
    return jnp.mean(out**2) + 0.1 * sum(jnp.mean(c**2) for c in caches), caches


SEQUENCE_PARALLEL = {
    "blocks": eqpar.SplitSequence("model"),
    r"blocks/\d+/up": eqpar.ColumnParallel(sequence_parallel=True),
    r"blocks/\d+/down": eqpar.RowParallel(sequence_parallel=True),
}


def test_blocks_returning_a_per_token_cache_under_a_sequence_split():
    """TP + SP by plan on blocks that return `(x, cache)`: the loss, the SGD step and the
    caches the loop collects are the serial ones."""
    keys = jax.random.split(jax.random.key(0), 2)
    model = CachingModel([CachingBlock(k) for k in keys])
    x = jax.random.normal(jax.random.key(1), (4, SEQ, DIM))
    step = eqx.filter_value_and_grad(caching_loss, has_aux=True)
    (serial_loss, serial_caches), grads = eqx.filter_jit(step)(model, x)
    mesh = mesh_of((2, 4), ("data", "model"))
    parallel = eqpar.parallelize(model, SEQUENCE_PARALLEL, mesh=mesh)

    def local(m, x):
        loss, caches = caching_loss(m, x)
        return lax.pmean(loss, "data"), caches

    run = eqpar.shard_map(
        local,
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data")),
        out_specs=(P(), P("data")),
    )
    (loss, caches), parallel_grads = eqx.filter_jit(eqx.filter_value_and_grad(run, has_aux=True))(
        parallel, x
    )
    assert_tree_close(loss, serial_loss, what="loss")
    assert_tree_close(caches, serial_caches, what="caches")
    updated = eqpar.unparallelize(sgd(parallel, parallel_grads))
    assert_arrays_close(updated, sgd(model, grads))


class PerTokenHeads(eqx.Module):
    """Hand-written attention whose projections are called per token."""

    W_q: eqx.nn.Linear
    W_o: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)
    gated: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        seq = x.shape[0]
        projected = jax.vmap(self.W_q)(x)
        if self.gated:  # the input gated by its own projection, token by token
            x = x * jax.nn.sigmoid(projected)
        q = projected.reshape(seq, self.n_heads, DIM // self.n_heads)
        attended = jax.nn.dot_product_attention(q, q, q)
        return x + jax.vmap(self.W_o)(attended.reshape(seq, DIM)), q


def test_a_sequence_parallel_linear_called_per_token_into_hand_written_heads_is_refused():
    """The per-token `[n, out / n]` reshaped into heads and back: the row-parallel partner
    gets one token's whole features, or (with no partner) the block returns with the split
    still open, which would be silently wrong; where the author's own code fails on it (a
    gate), the error gets a note. Each says why and names the route (tensor parallelism
    without the sequence split)."""
    keys = jax.random.split(jax.random.key(2), 4)
    row = {r"blocks/\d+/W_o": eqpar.RowParallel(sequence_parallel=True)}
    for name, gated, partner, error, match in [
        ("row partner", False, row, ValueError, r"one token's whole \[in_features\] = \[8\]"),
        ("no partner", False, {}, ValueError, r"no RowParallel\(sequence_parallel=True\) partner"),
        ("the author's code fails", True, row, ValueError, r"Incompatible shapes"),
    ]:
        linears = [(eqx.nn.Linear(DIM, DIM, key=a), eqx.nn.Linear(DIM, DIM, key=b))
                   for a, b in (keys[:2], keys[2:])]  # fmt: skip
        model = CachingModel([PerTokenHeads(q, o, 2, gated) for q, o in linears])
        plan = {
            "blocks": eqpar.SplitSequence("model"),
            r"blocks/\d+/W_q": eqpar.ColumnParallel(sequence_parallel=True),
            **partner,
        }
        parallel = eqpar.parallelize(model, plan)
        run = eqpar.shard_map(
            lambda m, x: jnp.mean(jax.vmap(m)(x)[0]),
            mesh=mesh_of((4,), ("model",)),
            in_specs=(eqpar.partition_specs(parallel), P()),
            out_specs=P(),
        )
        fix = r"gives \[n, out / n\] per token.*without sequence_parallel=True and no SplitSeq"
        with pytest.raises(error, match=match) as caught:
            jax.eval_shape(run, parallel, jnp.ones((2, SEQ, DIM)))
        told = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
        assert re.search(fix, told, re.DOTALL), (name, told)


def test_raw_arrays_with_a_sequence_split_on_the_compiled_route():
    """`Sharded` keys and `SplitSequence` on the Llama (its own attention, reshapes and
    rotary code): under `jax.jit`, on the mesh in context or the one the model is placed on,
    the split is a layout, and the step is the serial one. With neither, one message names
    both; an Explicit axis (where the block's own matmuls would have to type their
    shardings) is refused."""
    model = llama.Llama(key=jax.random.key(0))
    tokens = llama.batch(4)
    serial_loss, serial_model = serial_step(llama.loss, model, tokens)
    mesh = mesh_of((2, 4), ("data", "model"))
    plan = {**LLAMA_TENSOR_PARALLEL, "layers": eqpar.SplitSequence("model")}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    placed = eqx.filter_shard(
        parallel, eqpar.named_shardings(eqpar.partition_specs(parallel), mesh)
    )
    batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh.jax_mesh, P("data")))
    unplaced = eqpar.parallelize(model, plan)
    with pytest.raises(ValueError, match=r"needs the mesh: place the model on it"):
        jax.eval_shape(llama.loss, unplaced, tokens)
    with jax.set_mesh(mesh.jax_mesh):
        loss, updated = serial_step(llama.loss, placed, batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)
    # Placed, the model says its mesh: the step needs no mesh in context.
    loss, updated = serial_step(llama.loss, placed, batch)
    assert_tree_close(loss, serial_loss, what="loss")
    assert_arrays_close(eqpar.unparallelize(updated), serial_model)
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit), pytest.raises(ValueError, match=r"'model' is an Explicit"):
        jax.eval_shape(llama.loss, unplaced, tokens)
