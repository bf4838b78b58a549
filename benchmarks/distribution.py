"""Distributions on 8 simulated CPU devices: memory, communication and overhead per train step.

For an MLP and a transformer block, one Adam train step (loss, gradients, update) under:

- `single`: one device, no distribution;
- `DataParallel(8)`: parameters replicated, batch split 8 ways;
- `FSDP(8)`: parameters, optimizer state and batch split 8 ways;
- `ModelParallel(2x4)`: Megatron column/row layout over `model` (4), batch over `data` (2).

The eqpar step is the way a user writes it: `eqx.filter_jit` on the model, inputs placed with
`distribute_input`, results pinned with `constrain`. The baseline is the same step as plain
`jax.jit` over the array leaves with `NamedSharding` in/out shardings built by hand from the same
specs, measured in the same run, alternating with the eqpar step.

Reported per device: parameter and optimizer-state bytes (from the arrays' shards), collective
ops and bytes per step (from the compiled HLO, see `_hlo.py`), the compiler's memory figure
(argument + output + temp - alias), compile time, step time, and the step time as a ratio to the
baseline. CPU devices share the host's cores, so wall times show no overlap of communication
and computation; only the ratio is meaningful. Run: `python benchmarks/distribution.py`.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from _hlo import (
    collective_summary,
    compile_timed,
    format_bytes,
    memory_figures,
    paired_median_seconds,
    per_device_bytes,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqpar.distributions import FSDP, DataParallel, ModelParallel
from eqpar.layout import LayoutMap
from eqpar.mesh import DeviceMesh

FEATURES, WIDTH = 256, 1024
DIM, HEADS, HIDDEN, SEQ = 256, 8, 1024, 16
BATCH = 16
REPEATS = 7
OPTIMIZER = optax.adam(1e-3)


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.up = eqx.nn.Linear(DIM, HIDDEN, key=k2)
        self.down = eqx.nn.Linear(HIDDEN, DIM, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


def make_mlp(key):
    return eqx.nn.MLP(FEATURES, FEATURES, WIDTH, 2, activation=jax.nn.gelu, key=key)


MODELS = {
    "MLP 256-1024-1024-256": (make_mlp, (BATCH, FEATURES)),
    "transformer block d=256": (Block, (BATCH, SEQ, DIM)),
}


def megatron_layout_map(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["layers/[02]/weight"] = ("model", None)
    layout_map["layers/[02]/bias"] = ("model",)
    layout_map["layers/1/weight"] = (None, "model")
    layout_map["attn/(query|key|value)_proj/weight"] = ("model", None)
    layout_map["attn/output_proj/weight"] = (None, "model")
    layout_map["up/weight"] = ("model", None)
    layout_map["up/bias"] = ("model",)
    layout_map["down/weight"] = (None, "model")
    return layout_map


def distributions():
    mesh_2x4 = DeviceMesh((2, 4), ("data", "model"))
    return {
        "single": None,
        "DataParallel(8)": DataParallel(),
        "FSDP(8)": FSDP(),
        "ModelParallel(2x4)": ModelParallel(
            layout_map=megatron_layout_map(mesh_2x4), batch_dim_name="data"
        ),
    }


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def eqpar_step(d):
    """The train step as a user writes it with eqpar."""

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        if d is not None:
            model, opt_state = d.constrain(model), d.constrain(opt_state, model)
        return model, opt_state, loss

    return step


def baseline_step(static, d, params, opt_state, x, y):
    """The same step as plain `jax.jit` on array pytrees with hand-built `NamedSharding`s."""

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), x, y))(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if d is None:
        return jax.jit(step)
    mesh = d.device_mesh.jax_mesh
    to_sharding = lambda spec: NamedSharding(mesh, spec)
    is_spec = lambda s: isinstance(s, P)
    param_shardings = jax.tree.map(to_sharding, d.partition_specs(params), is_leaf=is_spec)
    opt_shardings = jax.tree.map(to_sharding, d.opt_state_specs(opt_state, params), is_leaf=is_spec)
    x_sharding, y_sharding = x.sharding, y.sharding
    return jax.jit(
        step,
        in_shardings=(param_shardings, opt_shardings, x_sharding, y_sharding),
        out_shardings=(param_shardings, opt_shardings, to_sharding(P())),
    )


def measure(model_name, distribution_name, d):
    constructor, shape = MODELS[model_name]
    size = int(np.prod(shape))
    x = np.sin(np.arange(size, dtype=np.float32) * 0.37).reshape(shape)
    y = np.cos(np.arange(size, dtype=np.float32) * 0.11).reshape(shape)
    key = jax.random.key(0)
    if d is None:
        model = constructor(key)
        x, y = jnp.asarray(x), jnp.asarray(y)
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    else:
        model = d.build_model(constructor, key)
        x, y = d.distribute_input(x), d.distribute_input(y)
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
        opt_state = d.distribute_opt_state(opt_state, model)

    step = eqpar_step(d)
    compiled, compile_seconds = compile_timed(step, model, opt_state, x, y)
    collectives = collective_summary(compiled)
    memory = memory_figures(compiled)

    params, static = eqx.partition(model, eqx.is_array)
    baseline = baseline_step(static, d, params, opt_state, x, y)
    baseline_compiled, _ = compile_timed(baseline, params, opt_state, x, y)
    step_seconds, baseline_seconds = paired_median_seconds(
        (step, (model, opt_state, x, y)), (baseline, (params, opt_state, x, y)), repeats=REPEATS
    )
    baseline_bytes = collective_summary(baseline_compiled).total_bytes

    return {
        "model": model_name,
        "distribution": distribution_name,
        "params/dev": format_bytes(per_device_bytes(model)),
        "opt/dev": format_bytes(per_device_bytes(opt_state)),
        "collectives": str(collectives.total_count),
        "coll. bytes/dev": format_bytes(collectives.total_bytes),
        "jit coll. bytes": format_bytes(baseline_bytes),
        "mem/dev (XLA)": format_bytes(memory["total"]),
        "compile s": f"{compile_seconds:.2f}",
        "step ms": f"{1e3 * step_seconds:.1f}",
        "vs jit": f"{step_seconds / baseline_seconds:.2f}x",
        "_kinds": collectives.counts,
    }


def print_table(rows):
    columns = [c for c in rows[0] if not c.startswith("_")]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    line = lambda cells: "  ".join(
        cells[c].ljust(widths[c]) if i < 2 else cells[c].rjust(widths[c])
        for i, c in enumerate(columns)
    )
    print(line({c: c for c in columns}))
    print("-" * len(line({c: c for c in columns})))
    for row in rows:
        print(line(row))
    print()
    print("collective ops per step by kind:")
    for row in rows:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(row["_kinds"].items())) or "none"
        print(f"  {row['model']:<24} {row['distribution']:<20} {kinds}")


def main():
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, "
          f"Adam, batch {BATCH}, median of {REPEATS} steps\n")  # fmt: skip
    rows = []
    for model_name in MODELS:
        for distribution_name, d in distributions().items():
            rows.append(measure(model_name, distribution_name, d))
    print_table(rows)


if __name__ == "__main__":
    main()
