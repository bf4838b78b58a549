"""Mixture of experts under expert parallelism: exchange bytes, buffers, memory, compiling.

`eqpar.nn.MixtureOfExperts` split by `eqpar.ExpertParallel` on 8 devices, with the experts
over an `expert` axis of n devices (mesh `data=2,expert=4`, n = 4, and `expert=8`, n = 8)
and the tokens split over every axis (`P(("data", "expert"))`, `T` tokens per device), in
one training step: `value_and_grad` of a loss through the layer inside `eqpar.shard_map`
(in_specs from `eqpar.partition_specs`), with respect to the layer and its input (in a
model the layer's input has a gradient). Four tables:

1. **All-to-all bytes** per device, read from the compiled HLO (`_hlo.collective_ops`),
   against the ideal: each (token, choice) assignment's hidden state sent to its expert's
   device and back, forward and backward, counting the (n-1)/n of the assignments that
   leave the device under balanced routing. The exchange of counts (integers) is reported
   on its own, and so is one further round, which a step overflowing the buffers runs.
2. **Receive buffers** per device (`n * expert_buffer_rows(...)`) against the balanced size
   `T * top_k`, and the rounds the exchange runs at measured routing skews (forward passes
   on more tokens): routers with a bias that balances the experts exactly, plus a bias on
   expert 0 that gives it 1x to 3x its balanced share. The rounds and the per-pair counts
   are the layer's own (its `_routing_meta` recorded by a `jax.debug.callback` while the
   layer runs), and each skewed output is compared with the serial layer's.
3. **Temp memory** per device (`memory_analysis`) of the training step against a dense MLP
   of the same active parameters (hidden `top_k * H`) on the same tokens; also the serial
   layer on one device, and the expert-parallel layer with a capacity factor giving the
   same buffer (one round, no loop over further rounds), and a textbook sort-and-gather
   exchange with the same weights and receive buffer (the baseline the layer is held to).
4. **Compile time** against the number of experts (8 to 64): flat, since no Python loop
   runs over experts (grouped matmuls: `lax.ragged_dot` on GPU and TPU, a `lax.scan` over
   the local experts on CPU).

Run: `python benchmarks/moe.py` (1 to 2 minutes on 2 idle cores; `--quick`: one timed
compilation per size instead of three).
"""

import argparse
import contextlib
import math
import os
import re
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from _hlo import CollectiveOp, collective_ops, compile_timed, memory_figures
from jax import lax
from jax.sharding import PartitionSpec as P

import eqpar
from eqpar.nn import MixtureOfExperts
from eqpar.nn import experts as experts_module
from eqpar.nn.experts import expert_buffer_rows

FEATURES, HIDDEN, TOKENS, TOP_K, EXPERTS = 64, 128, 80, 2, 8  # TOKENS: per device
SKEW_TOKENS = 1024  # per device, for the rounds at routing skews (forward only)
ITEMSIZE = 4  # float32
MESHES = (("data=2,expert=4", (2, 4), ("data", "expert")), ("expert=8", (8,), ("expert",)))
BUFFER_FACTORS = (1.0, 1.1, 1.25)
SKEWS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0)
COMPILE_EXPERTS = (8, 16, 32, 64)


def _slots(n: int) -> int:
    """Slots per device pair in the layer's exchange on this backend (on CPU one per local
    expert; on GPU and TPU one the device's experts share)."""
    return experts_module._slots_per_destination(EXPERTS // n)


def _rows_per_pair(tokens: int, n: int, buffer_factor: float, slots: int) -> int:
    """One round's rows per (source, destination) pair: `slots` slots of the slot's
    balanced share times the factor."""
    return slots * expert_buffer_rows(tokens, TOP_K, n * slots, buffer_factor)


@contextlib.contextmanager
def _one_slot_per_pair():
    """The exchange as it runs on GPU and TPU (a device's experts share a slot per pair,
    their rows in any mix, through `_apply_experts`), here on this backend."""
    original = experts_module._slots_per_destination
    experts_module._slots_per_destination = lambda local: 1
    try:
        yield
    finally:
        experts_module._slots_per_destination = original


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> eqpar.DeviceMesh:
    return eqpar.DeviceMesh(shape, names, devices=jax.devices()[: math.prod(shape)])


def _layer(
    num_experts: int,
    buffer_factor: float,
    *,
    router_bias: bool = False,
    capacity_factor: float | None = None,
):
    moe = MixtureOfExperts(
        FEATURES,
        HIDDEN,
        num_experts,
        top_k=TOP_K,
        use_router_bias=router_bias,
        key=jax.random.key(0),
    )
    style = eqpar.ExpertParallel(
        axis_name="expert", buffer_factor=buffer_factor, capacity_factor=capacity_factor
    )
    return eqpar.parallelize(moe, {"": style})


def _forward(layer, mesh, names):
    tokens = P(names)
    return eqpar.shard_map(
        lambda m, x: m(x),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(layer), tokens),
        out_specs=(tokens, P()),
    )


def _moe_loss(layer, mesh, names):
    forward = _forward(layer, mesh, names)

    def loss(layer, x):
        y, losses = forward(layer, x)
        return jnp.mean(y**2) + 0.01 * losses.load_balancing + 0.001 * losses.z_loss

    return loss


def _dense_loss(mlp, mesh, names):
    forward = eqpar.shard_map(
        lambda m, x: jax.vmap(m)(x), mesh=mesh, in_specs=(P(), P(names)), out_specs=P(names)
    )
    return lambda mlp, x: jnp.mean(forward(mlp, x) ** 2)


def _sort_and_gather_loss(layer, mesh, names, buffer_factor: float):
    """A textbook sort-and-gather exchange with the layer's own weights, the baseline of
    table 3: the assignments sorted by expert, each (source, expert) pair given
    `ceil(buffer_factor * T k / E)` slots (overflow dropped), one all-to-all there and one
    back, the experts as one batched matmul over their slots. Its receive buffer holds as
    many rows as the layer's at the same buffer factor."""

    def forward(moe, tokens):
        n, local = lax.axis_size("expert"), moe.up.shape[0]
        num_experts, (num_tokens, features) = n * local, tokens.shape
        slots = math.ceil(buffer_factor * num_tokens * TOP_K / num_experts)
        probs = jax.nn.softmax(jax.vmap(moe.router)(tokens), axis=-1)
        top, chosen = lax.top_k(probs, TOP_K)
        weights = top / jnp.sum(top, axis=-1, keepdims=True)
        assigned = chosen.T.reshape(-1)
        order = jnp.argsort(assigned, stable=True)
        sorted_experts = assigned[order]
        counts = jnp.zeros(num_experts, jnp.int32).at[assigned].add(1)
        rank = jnp.arange(assigned.shape[0]) - (jnp.cumsum(counts) - counts)[sorted_experts]
        kept = rank < slots
        slot = jnp.where(kept, sorted_experts * slots + rank, num_experts * slots)
        buffer = jnp.zeros((num_experts * slots, features), tokens.dtype)
        buffer = buffer.at[slot].set(tokens[order % num_tokens], mode="drop")
        received = lax.all_to_all(buffer.reshape(n, -1, features), "expert", 0, 0, tiled=True)
        x = received.reshape(n, local, slots, features).transpose(1, 0, 2, 3)
        x = x.reshape(local, n * slots, features)
        hidden = moe.activation(jnp.einsum("gcf,gfh->gch", x, moe.up))
        y = jnp.einsum("gch,ghf->gcf", hidden, moe.down).reshape(local, n, slots, features)
        y = y.transpose(1, 0, 2, 3).reshape(n, -1, features)
        back = lax.all_to_all(y, "expert", 0, 0, tiled=True).reshape(-1, features)
        out_sorted = jnp.where(kept[:, None], back[jnp.minimum(slot, back.shape[0] - 1)], 0)
        out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
        return jnp.einsum("ktf,tk->tf", out.reshape(TOP_K, num_tokens, features), weights)

    tokens = P(names)
    sharded = eqpar.shard_map(
        forward, mesh=mesh, in_specs=(eqpar.partition_specs(layer), tokens), out_specs=tokens
    )
    return lambda layer, x: jnp.mean(sharded(layer, x) ** 2)


def _compiled_step(loss, model, mesh, x):
    """The training step (gradients for the model and its input), compiled, and seconds."""
    specs = eqpar.partition_specs(model)
    placed = eqx.filter_shard(model, eqpar.named_shardings(specs, mesh))
    step = eqx.filter_jit(eqx.filter_value_and_grad(lambda both: loss(*both)))
    return compile_timed(step, (placed, x))


def _text(compiled) -> str:
    return compiled.compiled.as_text()  # eqx.filter_jit's wrapper around JAX's Compiled


def _tokens(mesh, names, *, per_device: int = TOKENS, seed: int = 1) -> jax.Array:
    x = jax.random.normal(jax.random.key(seed), (mesh.size * per_device, FEATURES))
    return jax.device_put(x, eqpar.named_shardings(P(names), mesh))


# -- table 1: the bytes of the exchange -------------------------------------------------------


def _dtype(text: str, name: str) -> str:
    match = re.search(rf"%{re.escape(name)} = \(?(\w+)\[", text)
    return match.group(1) if match else "?"


def _moved(ops: list[CollectiveOp]) -> float:
    return sum(op.executions * op.share * op.bytes_per_device for op in ops)


def exchange_bytes(compiled, rows_per_pair: int) -> dict:
    """The exchange's collectives in the compiled step: the hidden states' all-to-alls of
    round 0 (bytes, count), one round of the loop over further rounds (its body, whose trip
    count is the run's: counted once), the counts exchange (the integer collectives) and the
    rest (gradient and loss reductions)."""
    text = _text(compiled)
    integer = lambda op: _dtype(text, op.name)[0] in "spu"  # s32, u32, pred
    hidden = lambda op: op.kind == "all-to-all" and not integer(op)
    ops = collective_ops(text)
    once = [op for op in ops if not op.in_unknown_loop]
    further = [op for op in ops if hidden(op) and op.in_unknown_loop]
    hidden_ops = [op for op in once if hidden(op)]
    assert all(op.array_bytes % (rows_per_pair * FEATURES * ITEMSIZE) == 0 for op in hidden_ops)
    return {
        "hidden": _moved(hidden_ops),
        "hidden_ops": round(sum(op.executions * op.share for op in hidden_ops)),
        "fallback_round": _moved(further),
        "fallback_ops": len(further),
        "counts": _moved([op for op in once if integer(op)]),
        "other": _moved([op for op in once if not hidden(op) and not integer(op)]),
    }


def ideal_bytes(n: int) -> float:
    """Dispatch and combine, forward and backward: 4 (n-1)/n T k F itemsize."""
    return 4 * (n - 1) / n * TOKENS * TOP_K * FEATURES * ITEMSIZE


def measure_exchange() -> list[dict]:
    rows = []
    for mesh_name, shape, names in MESHES:
        mesh = _mesh(shape, names)
        n = mesh.axis_size("expert")
        x = _tokens(mesh, names)
        for buffer_factor in BUFFER_FACTORS:
            layer = _layer(EXPERTS, buffer_factor)
            compiled, _ = _compiled_step(_moe_loss(layer, mesh, names), layer, mesh, x)
            per_pair = _rows_per_pair(TOKENS, n, buffer_factor, _slots(n))
            rows.append(
                {
                    "mesh": mesh_name,
                    "n": n,
                    "slots": _slots(n),
                    "buffer_factor": buffer_factor,
                    "rows_per_pair": per_pair,
                    "ideal": ideal_bytes(n),
                    "temp": memory_figures(compiled)["temp"],
                    **exchange_bytes(compiled, per_pair),
                }
            )
    return rows


def exchange_table(rows: list[dict]) -> str:
    lines = [
        "| mesh | n | buffer_factor | rows/pair C (slots) | ideal KiB | all-to-all KiB | ratio "
        "| all-to-alls | counts exchange B | further round KiB (ratio) | other collectives KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mesh']} | {r['n']} | {r['buffer_factor']} | {r['rows_per_pair']} "
            f"({r['slots']}) | "
            f"{r['ideal'] / 1024:.1f} | {r['hidden'] / 1024:.1f} | "
            f"{r['hidden'] / r['ideal']:.3f} | {r['hidden_ops']} | {r['counts']:.0f} | "
            f"{r['fallback_round'] / 1024:.1f} ({r['fallback_round'] / r['ideal']:.3f}) | "
            f"{r['other'] / 1024:.1f} |"
        )
    ops = {r["fallback_ops"] for r in rows}
    return (
        f"Per device, float32, T = {TOKENS} tokens per device, k = {TOP_K} choices, F = "
        f"{FEATURES} features, E = {EXPERTS} experts (hidden {HIDDEN}). Ideal = 4 x (n-1)/n x "
        "T x k x F x 4 bytes: each (token, choice) assignment's hidden state goes to its "
        "expert's device and back (forward), and both transposes run backward; only the "
        "(n-1)/n share of the assignments that leaves the device under balanced routing "
        "counts. Measured: the all-to-alls of hidden states of round 0 (outside the loop "
        "over further rounds), each receiving (n-1)/n of its "
        "[n, C, F] buffer, C = ceil(buffer_factor x T k / n) rows per (source, destination) "
        "pair (on CPU one slot of ceil(buffer_factor x T k / E) rows per local expert, the "
        "same C here); so the ratio is n C / (T k) = buffer_factor. Counts exchange: the integer "
        "collectives (all-to-all of per-expert counts, pmax of the rounds). Further round: "
        f"one trip of the loop a step runs when its routing overflows C ({'/'.join(map(str, ops))} "
        "all-to-alls per round: dispatch and combine forward, and in the backward the "
        "dispatch recomputed plus both transposes; round 0's backward uses what its forward "
        "kept). Other collectives: the gradient and "
        "router-loss reductions (not part of the exchange).\n\n" + "\n".join(lines) + "\n"
    )


# -- table 2: receive buffers and rounds at measured skews ------------------------------------


@contextlib.contextmanager
def _recording_routing(record: list):
    """The layer's own `_routing_meta`, recording per device the experts of its sorted
    assignments, its send counts per destination device and the rounds."""
    original = experts_module._routing_meta

    def recorded(sorted_experts, static, num_experts):
        meta = original(sorted_experts, static, num_experts)
        jax.debug.callback(
            lambda e, s, r: record.append((np.asarray(e), np.asarray(s), int(r))),
            sorted_experts,
            meta.send_counts,
            meta.rounds,
        )
        return meta

    experts_module._routing_meta = recorded
    try:
        yield
    finally:
        experts_module._routing_meta = original


def skewed_biases(router: eqx.nn.Linear, x: jax.Array) -> dict[float, jax.Array]:
    """Router biases that give expert 0 `skew` x its balanced share of the assignments of
    `x`: first a bias balancing every expert exactly, then a bias on expert 0 found by
    bisection (its share grows with it)."""
    weight = router.weight

    @jax.jit
    def loads(bias):
        _, chosen = lax.top_k(x @ weight.T + bias, TOP_K)  # softmax keeps the order
        return jnp.zeros(EXPERTS).at[chosen.reshape(-1)].add(1.0)

    balanced = x.shape[0] * TOP_K / EXPERTS
    bias = jnp.zeros(EXPERTS)
    for _ in range(400):
        bias = bias - 0.05 * (loads(bias) / balanced - 1)
    biases = {}
    for skew in SKEWS:
        low, high = 0.0, 20.0
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (
                (middle, high)
                if loads(bias.at[0].add(middle))[0] < skew * balanced
                else (low, middle)
            )
        biases[skew] = bias.at[0].add(high if skew > 1 else 0.0)
    return biases


def measure_skew() -> list[dict]:
    rows = []
    for mesh_name, shape, names in MESHES:
        mesh = _mesh(shape, names)
        n = mesh.axis_size("expert")
        x = _tokens(mesh, names, per_device=SKEW_TOKENS, seed=2)
        base = _layer(EXPERTS, 1.25, router_bias=True)
        biases = skewed_biases(base.router, x)
        serial = jax.jit(lambda layer, x: eqpar.unparallelize(layer)(x)[0])
        found = {skew: {"mesh": mesh_name, "n": n, "target": skew, "rounds": {}, "error": 0.0}
                 for skew in SKEWS}  # fmt: skip
        for buffer_factor in BUFFER_FACTORS:
            layer = base.replace(buffer_factor=buffer_factor)
            record: list = []  # filled by the compiled program's callbacks
            with _recording_routing(record):
                forward = jax.jit(_forward(layer, mesh, names)).lower(layer, x).compile()
            for skew, bias in biases.items():
                skewed = eqx.tree_at(lambda m: m.router.bias, layer, bias)
                record.clear()
                y, losses = jax.block_until_ready(forward(skewed, x))
                jax.effects_barrier()
                assert len(record) == mesh.size and int(losses.dropped) == 0
                experts, sends, rounds = zip(*record)
                row = found[skew]
                row["rounds"][buffer_factor] = max(rounds)  # per group of the expert axis
                error = jnp.max(jnp.abs(y - serial(skewed, x))) / jnp.max(jnp.abs(y))
                row["error"] = max(row["error"], float(error))
                loads = np.bincount(np.concatenate(experts), minlength=EXPERTS + 1)[:EXPERTS]
                row["expert_skew"] = loads.max() / (x.shape[0] * TOP_K / EXPERTS)
                # The layer's slots (per expert on CPU), and what one slot per device pair
                # (GPU and TPU) would carry of the same assignments.
                slots = _slots(n)
                row["max_slot"] = int(np.max(sends))
                row["slot_skew"] = row["max_slot"] / (SKEW_TOKENS * TOP_K / (n * slots))
                per_slot = expert_buffer_rows(SKEW_TOKENS, TOP_K, n * slots, buffer_factor)
                assert max(rounds) == -(-row["max_slot"] // per_slot)
                local = EXPERTS // n
                pairs = [np.bincount(e[e < EXPERTS] // local, minlength=n) for e in experts]
                per_pair = expert_buffer_rows(SKEW_TOKENS, TOP_K, n, buffer_factor)
                row["max_pair"] = int(np.max(pairs))
                row["pair_skew"] = row["max_pair"] / (SKEW_TOKENS * TOP_K / n)
                row.setdefault("pair_rounds", {})[buffer_factor] = -(-row["max_pair"] // per_pair)
        rows.extend(found.values())
    return rows


def buffer_table(exchange_rows: list[dict], skew_rows: list[dict]) -> str:
    lines = [
        "| mesh | n | buffer_factor | receive rows/device (n C) | balanced (T k) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in exchange_rows:
        received = r["n"] * r["rows_per_pair"]  # the same total with a slot per expert
        lines.append(
            f"| {r['mesh']} | {r['n']} | {r['buffer_factor']} | {received} | "
            f"{TOKENS * TOP_K} | {received / (TOKENS * TOP_K):.3f} |"
        )
    factors = " | ".join(f"rounds at {f}" for f in BUFFER_FACTORS)
    skews = [
        "| mesh | target skew | expert 0 load / balanced | max slot rows | max slot / balanced "
        f"slot | {factors} | max rel. error vs serial |",
        "|---|---|---|---|---|" + "---|" * len(BUFFER_FACTORS) + "---|",
    ]
    shared = [
        f"| mesh | target skew | max pair rows | max pair / balanced pair | {factors} |",
        "|---|---|---|---|" + "---|" * len(BUFFER_FACTORS),
    ]
    for r in skew_rows:
        rounds = " | ".join(str(r["rounds"][f]) for f in BUFFER_FACTORS)
        skews.append(
            f"| {r['mesh']} | {r['target']} | {r['expert_skew']:.3f} | {r['max_slot']} | "
            f"{r['slot_skew']:.3f} | {rounds} | {r['error']:.1e} |"
        )
        rounds = " | ".join(str(r["pair_rounds"][f]) for f in BUFFER_FACTORS)
        shared.append(
            f"| {r['mesh']} | {r['target']} | {r['max_pair']} | {r['pair_skew']:.3f} | {rounds} |"
        )
    one_round = []
    for mesh_name, *_ in MESHES:
        fits = [
            r["expert_skew"] for r in skew_rows if r["mesh"] == mesh_name and r["rounds"][1.25] == 1
        ]
        over = [
            r["expert_skew"] for r in skew_rows if r["mesh"] == mesh_name and r["rounds"][1.25] > 1
        ]
        one_round.append(
            f"{mesh_name}: one round up to a measured expert skew of {max(fits):.2f}"
            + (f", two or more from {min(over):.2f}" if over else "")
        )
    return (
        "Receive buffer per device and round: n x C rows of F features (C as in the table "
        "above), against the T k assignments a device receives under balanced routing.\n\n"
        + "\n".join(lines)
        + f"\n\nRounds at measured routing skews: the layer's forward on T = {SKEW_TOKENS} "
        "tokens per device (with T = 80 the sampling noise of 20 to 40 rows per device pair "
        "alone overflows 1.25 x). The router's bias first balances the E experts exactly on "
        "these tokens, then raises expert 0's share of all the assignments to the target "
        "multiple of its balanced share. The slot counts and rounds are the layer's own "
        "(every device's `_routing_meta`, recorded while the layer runs): on CPU a round "
        "carries at most ceil(buffer_factor x T k / E) rows per (source, expert) slot, whose "
        "balanced load is T k / E, so the rounds are ceil(max slot / that); with one expert "
        "per device a slot is a device pair. The error is the largest difference from the "
        "serial layer over the largest output, over the three buffer factors (nothing "
        "dropped).\n\n"
        + "\n".join(skews)
        + "\n\nWith buffer_factor 1.25 one round holds any routing whose busiest slot "
        "carries at most 1.25 x its balanced load: " + "; ".join(one_round) + ".\n\n"
        "On GPU and TPU a device's experts share one slot per device pair (C = "
        "ceil(buffer_factor x T k / n) rows, the same buffer; the ragged dot takes the rows in "
        "any mix of experts without extra memory), so a round is full only when a whole pair "
        "is: the rounds those devices run on the same assignments (computed from the recorded "
        "sorted experts):\n\n" + "\n".join(shared) + "\n"
    )


# -- table 3: temp memory against a dense MLP ----------------------------------------------


def measure_memory(exchange_rows: list[dict]) -> list[dict]:
    """Temp per device: the dense MLP first (the baseline), the serial MoE, then the MoE
    under expert parallelism (dropless at each buffer factor, and with a capacity factor)."""
    mlp = eqx.nn.MLP(
        FEATURES, FEATURES, TOP_K * HIDDEN, 1, activation=jax.nn.gelu, use_bias=False,
        key=jax.random.key(0),
    )  # fmt: skip
    rows = []
    for index, (mesh_name, shape, names) in enumerate(MESHES):
        mesh = _mesh(shape, names)
        x = _tokens(mesh, names)
        if index == 0:  # replicated weights and T tokens per device: the same on any mesh
            dense, _ = _compiled_step(_dense_loss(mlp, mesh, names), mlp, mesh, x)
            name = f"dense MLP {FEATURES}-{TOP_K * HIDDEN}-{FEATURES}, T tokens per device"
            rows.append({"name": name, "temp": memory_figures(dense)["temp"]})
            serial = eqpar.unparallelize(_layer(EXPERTS, 1.25))
            step = eqx.filter_jit(
                eqx.filter_value_and_grad(lambda mx: jnp.mean(mx[0](mx[1])[0] ** 2))
            )
            compiled, _ = compile_timed(step, (serial, jnp.zeros((TOKENS, FEATURES))))
            name = f"MoE serial, one device ({EXPERTS} experts), T tokens"
            rows.append({"name": name, "temp": memory_figures(compiled)["temp"]})
        for r in exchange_rows:
            if r["mesh"] == mesh_name:
                name = f"MoE EP {mesh_name}, dropless, buffer_factor {r['buffer_factor']}"
                row = {"name": name, "temp": r["temp"], "mesh": mesh_name}
                rows.append(row | {"buffer_factor": r["buffer_factor"]})
        if _slots(mesh.axis_size("expert")) > 1:
            dropless = _layer(EXPERTS, 1.25)
            with _one_slot_per_pair():
                compiled, _ = _compiled_step(_moe_loss(dropless, mesh, names), dropless, mesh, x)
            name = (
                f"MoE EP {mesh_name}, dropless, buffer_factor 1.25, one slot per device pair "
                "(the GPU/TPU layout, its experts as a scan on CPU)"
            )
            rows.append({"name": name, "temp": memory_figures(compiled)["temp"], "mesh": mesh_name})
        capped = _layer(EXPERTS, 1.25, capacity_factor=1.25)
        compiled, _ = _compiled_step(_moe_loss(capped, mesh, names), capped, mesh, x)
        name = f"MoE EP {mesh_name}, capacity_factor 1.25 (same C, one round, may drop)"
        row = {"name": name, "temp": memory_figures(compiled)["temp"], "mesh": mesh_name}
        rows.append(row | {"capacity_factor": 1.25})
        for factor in BUFFER_FACTORS:
            loss = _sort_and_gather_loss(capped, mesh, names, factor)
            compiled, _ = _compiled_step(loss, capped, mesh, x)
            name = f"sort-and-gather exchange {mesh_name}, buffer_factor {factor} (may drop)"
            row = {"name": name, "temp": memory_figures(compiled)["temp"], "mesh": mesh_name}
            rows.append(row | {"baseline_factor": factor})
    return rows


def memory_table(rows: list[dict]) -> str:
    base = rows[0]["temp"]
    baseline = {
        (r["mesh"], r["baseline_factor"]): r["temp"] for r in rows if "baseline_factor" in r
    }

    def to_baseline(r: dict) -> str:
        factor = r.get("buffer_factor", r.get("capacity_factor"))
        if "baseline_factor" in r or factor is None:
            return ""
        return f"{r['temp'] / baseline[(r['mesh'], factor)]:.2f}"

    lines = [
        "| program | temp KiB/device | ratio to dense | ratio to sort-and-gather, same buffer |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['temp'] / 1024:.1f} | {r['temp'] / base:.2f} | {to_baseline(r)} |"
        )
    dropless = {r["mesh"]: r["temp"] for r in rows if r.get("buffer_factor") == 1.25}
    capped = {r["mesh"]: r["temp"] for r in rows if r.get("capacity_factor") == 1.25}
    fallback = ", ".join(f"{mesh} {dropless[mesh] / capped[mesh]:.2f}x" for mesh in capped)
    return (
        f"Temp per device (`memory_analysis`) of the training step on T = {TOKENS} tokens "
        f"per device, as ratios to a dense MLP with the active parameters of one token's "
        f"{TOP_K} experts (hidden {TOP_K} x {HIDDEN}) on the same tokens, and to a textbook "
        "sort-and-gather exchange with the same weights and receive buffer "
        "(`_sort_and_gather_loss`: per (source, expert) slots, overflow dropped, one batched "
        "matmul over the slots).\n\n"
        + "\n".join(lines)
        + "\n\nWhere the layer stands. On CPU each local expert has its own slot of "
        "ceil(buffer_factor x T k / E) rows in a pair's buffer, so the rows a device receives "
        "come in one fixed block per expert and the experts run as one batched matmul, as in "
        "the baseline: with a capacity factor (one round) the layer holds what the baseline "
        "holds (its router losses aside), and nothing is dropped without one. Dropless, the "
        "layer also holds the backward loop over further rounds (each recomputes its round "
        "and adds the weights' and rows' gradients into running sums, which a one-round step "
        "writes once): dropless over capacity factor at the same buffer: " + fallback + ". "
        "With one slot per device pair, the layout of GPU and TPU, the rows come in any mix of "
        "experts; there XLA's ragged dot takes them as they come, but on CPU JAX's rule for "
        "`lax.ragged_dot` copies the rows once per expert, and the scan that replaces it "
        "(every row times every local expert's weights, keeping its own) holds a product and "
        "a weight slice per expert: the row above with one slot per pair is that layout run "
        "on CPU.\n"
    )


# -- table 4: compile time against the number of experts -------------------------------------


def measure_compile(compiles: int) -> list[dict]:
    _, shape, names = MESHES[0]
    mesh = _mesh(shape, names)
    x = _tokens(mesh, names)
    layers = {e: _layer(e, 1.25) for e in COMPILE_EXPERTS}
    seconds: dict[int, list[float]] = {e: [] for e in COMPILE_EXPERTS}
    compiled = {}
    # Taken in turns, so that load falls on every size alike (the tables before this one
    # have compiled the same program at E = 8: JAX is warm).
    for _ in range(compiles):
        for e, layer in layers.items():
            compiled[e], spent = _compiled_step(_moe_loss(layer, mesh, names), layer, mesh, x)
            seconds[e].append(spent)
    return [
        {
            "experts": e,
            "local": e // mesh.axis_size("expert"),
            "seconds": statistics.median(seconds[e]),
            "chars": len(_text(compiled[e])),
            "temp": memory_figures(compiled[e])["temp"],
        }
        for e in COMPILE_EXPERTS
    ]


def compile_table(rows: list[dict], compiles: int) -> str:
    base = rows[0]
    lines = [
        "| experts E | per device | compile s | ratio to E=8 | compiled chars | ratio | temp KiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['experts']} | {r['local']} | {r['seconds']:.2f} | "
            f"{r['seconds'] / base['seconds']:.2f} | {r['chars']} | "
            f"{r['chars'] / base['chars']:.2f} | {r['temp'] / 1024:.1f} |"
        )
    return (
        f"The training step on {MESHES[0][0]} (buffer_factor 1.25) against the number of "
        f"experts: `lower` + `compile`, median of {compiles} compilations taken in turns, and the "
        "length of the compiled program's text.\n\n" + "\n".join(lines) + "\n"
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timed compilation per size")
    args = parser.parse_args(argv)
    compiles = 1 if args.quick else 3
    exchange = measure_exchange()
    skew = measure_skew()
    memory = measure_memory(exchange)
    compile_rows = measure_compile(compiles)
    return "\n".join(
        [
            "### All-to-all bytes against the ideal\n",
            exchange_table(exchange),
            "### Receive buffers and rounds at routing skews\n",
            buffer_table(exchange, skew),
            "### Temp memory against a dense MLP\n",
            memory_table(memory),
            "### Compile time against the number of experts\n",
            compile_table(compile_rows, compiles),
        ]
    )


if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1:]))
