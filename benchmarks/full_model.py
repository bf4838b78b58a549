"""The language model of `examples/train_lm.py`: one Adam training step per parallel layout.

For the decoder-only transformer of `examples/lm.py`, one training step (loss, gradients, Adam
update) exactly as `examples/train_lm.py` runs it (`build_step`, `place`) under

- `DP`: `data=8`, parameters replicated;
- `FSDP`: `data=8 --fsdp`, parameters and optimizer state also split over `data`;
- `DPxTP`: `data=2,model=4` (`lm.PLAN`: heads, MLP and vocabulary split over `model`);
- `DPxPP`: `data=2,pipe=4` (GPipe, 4 microbatches);
- `DPxTPxPP`: `data=2,pipe=2,model=2`.

Each is set against plain `jax.jit` of the same model and update without any parallelism
(`lm.model_order` of the model: plain `eqx.nn` layers, the block stack scanned, the same
parameters) on an 8-device `data` mesh: the batch is split over `data`, parameters are
replicated (for the FSDP row: placed with FSDP storage specs) and GSPMD partitions the rest.
Both start from the same parameters and batch; their first losses are compared as a check that
they compute the same thing.

Per device: parameter and optimizer-state bytes (the most any device holds of the arrays'
shards after a step), temporaries (`memory_analysis().temp`: activations and other scratch),
bytes received by collectives per step (compiled HLO, loops counted per iteration, see
`benchmarks/_hlo.py`), compile time, and the median step time measured alternately with its
baseline. Each figure also as a ratio to its baseline. The simulated CPU devices share the
host's cores, so wall times show no overlap of communication and computation.

Run: `python benchmarks/full_model.py` (`--quick` for a smaller model, `--help` for options).
"""

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import lm  # pyright: ignore[reportMissingImports]
import train_lm  # pyright: ignore[reportMissingImports]
from _hlo import (
    collective_summary,
    compile_timed,
    format_bytes,
    memory_figures,
    paired_median_seconds,
    per_device_bytes,
)

NUM_DEVICES = 8
LAYOUTS: dict[str, tuple[dict[str, int], bool]] = {
    "DP": ({lm.DATA: 8}, False),
    "FSDP": ({lm.DATA: 8}, True),
    "DPxTP": ({lm.DATA: 2, lm.MODEL: 4}, False),
    "DPxPP": ({lm.DATA: 2, lm.PIPE: 4}, False),
    "DPxTPxPP": ({lm.DATA: 2, lm.PIPE: 2, lm.MODEL: 2}, False),
}


# --- measuring -----------------------------------------------------------------------------


class Chained:
    """Calls a compiled step on its own previous outputs, so donated buffers are never reused."""

    def __init__(self, compiled: Callable, tokens: jax.Array, params: Any, opt_state: Any):
        self.compiled, self.tokens, self.params, self.opt_state = (
            compiled,
            tokens,
            params,
            opt_state,
        )

    def __call__(self) -> jax.Array:
        self.params, self.opt_state, loss = self.compiled(self.tokens, self.params, self.opt_state)
        return loss


@dataclasses.dataclass
class Measured:
    name: str
    mesh: str
    params: int
    opt_state: int
    temp: int
    collectives: Any  # CollectiveSummary
    compile_s: float
    first_loss: float
    chained: Chained
    step_s: float = float("nan")
    # For a layout: its baseline's step time measured alongside it; for a baseline: all of
    # those (its row shows their median).
    paired_baseline_s: list[float] = dataclasses.field(default_factory=list)


def _measure(name: str, mesh: str, step: Any, tokens: jax.Array, params: Any, opt: Any) -> Measured:
    compiled, compile_s = compile_timed(step, tokens, params, opt)
    chained = Chained(compiled, tokens, params, opt)
    first_loss = float(chained())
    return Measured(
        name=name,
        mesh=mesh,
        params=per_device_bytes(chained.params),
        opt_state=per_device_bytes(chained.opt_state),
        temp=memory_figures(compiled)["temp"],
        collectives=collective_summary(compiled),
        compile_s=compile_s,
        first_loss=first_loss,
        chained=chained,
    )


def baseline(
    config: lm.LMConfig, run: train_lm.RunConfig, tokens: np.ndarray, *, fsdp: bool
) -> Measured:
    """`jax.jit` of the serial loss and Adam update; batch over `data`, GSPMD for the rest."""
    optimizer = train_lm.make_optimizer(run)
    model = lm.model_order(lm.LM(config, key=jax.random.key(run.seed)))  # plain eqx.nn layers
    params, static = eqx.partition(model, eqx.is_inexact_array)
    mesh = train_lm.make_mesh({lm.DATA: NUM_DEVICES, lm.PIPE: 1, lm.MODEL: 1})
    replicated = NamedSharding(mesh.jax_mesh, P())
    if fsdp:
        specs = train_lm.storage_specs(model, mesh, True)
        param_shardings = jax.tree.map(lambda _, s: NamedSharding(mesh.jax_mesh, s), params, specs)
    else:
        param_shardings = jax.tree.map(lambda _: replicated, params)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, params),
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    batch_sharding = NamedSharding(mesh.jax_mesh, P(lm.DATA))

    def step(tokens: jax.Array, params: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: eqx.combine(p, static).loss(tokens))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(
        step,
        in_shardings=(batch_sharding, param_shardings, opt_shardings),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(1, 2),
    )
    params = jax.device_put(params, param_shardings)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    name = "jit, params " + ("FSDP specs" if fsdp else "replicated")
    return _measure(
        name, "data=8", jitted, jax.device_put(tokens, batch_sharding), params, opt_state
    )


def eqpar_layout(
    name: str, config: lm.LMConfig, run: train_lm.RunConfig, tokens: np.ndarray
) -> Measured:
    """The step of `examples/train_lm.py` under `run.mesh` / `run.fsdp`."""
    train_lm.check_sizes(config, run)
    optimizer = train_lm.make_optimizer(run)
    mesh = train_lm.make_mesh(run.mesh)
    model = train_lm.build_model(config, run, mesh)
    model, opt_state = train_lm.place(model, optimizer, mesh, run.fsdp)
    step = train_lm.build_step(model, mesh, run, optimizer)
    batch = jax.device_put(tokens, NamedSharding(mesh.jax_mesh, P(lm.DATA)))
    label = ",".join(f"{axis}={size}" for axis, size in run.mesh.items() if size > 1)
    return _measure(name, label + (" --fsdp" if run.fsdp else ""), step, batch, model, opt_state)


# --- report --------------------------------------------------------------------------------


def _ratio(value: float, base: float) -> str:
    if base == 0:
        return "n/a" if value else "1.00x"
    return f"{value / base:.2f}x"


def _cell(value: float, base: float | None, text: str) -> str:
    return text if base is None else f"{text} ({_ratio(value, base)})"


def as_markdown(
    rows: list[tuple[Measured, Measured | None]], config: lm.LMConfig, args: argparse.Namespace
) -> str:
    baseline_params = jax.tree.leaves(eqx.filter(rows[0][0].chained.params, eqx.is_array))
    num_params = sum(int(leaf.size) for leaf in baseline_params)
    lines = [
        f"LM of `examples/lm.py`: vocab {config.vocab_size}, seq {config.seq_len}, "
        f"d_model {config.d_model}, {config.num_heads} heads, d_hidden {config.d_hidden}, "
        f"{config.num_layers} layers ({num_params:,} float32 parameters, "
        f"{format_bytes(4 * num_params)}); batch {args.batch_size}; Adam. One training step "
        "per row as `examples/train_lm.py` builds it (`place`, `build_step`); rows with a pipe "
        f"axis use GPipe with {args.microbatches} microbatches, the others 1. Figures are per "
        "device; in brackets the ratio to the row's baseline: `jax.jit` of the same model's "
        "serial form (`lm.model_order`) and Adam update with the batch split over `data=8` "
        "and GSPMD choosing the rest (parameters replicated, or for FSDP placed with FSDP "
        "storage specs), measured in the same run. Step time: median of "
        f"{args.repeats} steps, alternating with the baseline.",
        "",
        "| layout | mesh | params/dev | optimizer/dev | temp/dev | collective bytes/dev/step "
        "| compile s | step ms | baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row, base in rows:
        b = base
        lines.append(
            "| "
            + " | ".join(
                [
                    row.name,
                    row.mesh,
                    _cell(row.params, b and b.params, format_bytes(row.params)),
                    _cell(row.opt_state, b and b.opt_state, format_bytes(row.opt_state)),
                    _cell(row.temp, b and b.temp, format_bytes(row.temp)),
                    _cell(
                        row.collectives.total_bytes,
                        b and b.collectives.total_bytes,
                        format_bytes(row.collectives.total_bytes),
                    ),
                    _cell(row.compile_s, b and b.compile_s, f"{row.compile_s:.2f}"),
                    _cell(
                        row.step_s,
                        b and row.paired_baseline_s[0],
                        f"{1e3 * row.step_s:.1f}",
                    ),
                    "—" if b is None else b.name,
                ]
            )
            + " |"
        )
    lines += ["", "Collective ops per step (executions, loops counted per iteration):", ""]
    for row, _ in rows:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(row.collectives.counts.items())) or "none"
        unknown = row.collectives.loops_without_trip_count
        note = f" ({unknown} loops without a stated trip count, counted once)" if unknown else ""
        lines.append(f"- {row.name}: {kinds}{note}")
    differences = [abs(row.first_loss - base.first_loss) for row, base in rows if base is not None]
    lines += [
        "",
        f"Same model check: first-step loss {rows[0][0].first_loss:.6f} (baseline); largest "
        f"difference of any layout's first-step loss from its baseline's: {max(differences):.1e}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description="One training step of the example LM per parallel layout, against jax.jit."
    )
    parser.add_argument("--quick", action="store_true", help="4 layers, d_model 32, 3 repeats")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--microbatches", type=int, default=4, help="GPipe microbatches of the pipe rows"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed steps (median)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args(argv)
    if jax.device_count() < NUM_DEVICES:
        raise SystemExit(f"needs {NUM_DEVICES} devices; got {jax.device_count()}")
    config = lm.LMConfig()
    if args.quick:
        config = dataclasses.replace(config, d_model=32, d_hidden=128, num_layers=4)
        args.repeats = min(args.repeats, 3)
    base_run = train_lm.RunConfig(
        mesh={lm.DATA: NUM_DEVICES, lm.PIPE: 1, lm.MODEL: 1},
        batch_size=args.batch_size,
    )
    corpus = lm.encode(lm.make_corpus(20_000, seed=base_run.seed), config.vocab_size)
    tokens = lm.Batches(
        corpus, batch_size=args.batch_size, seq_len=config.seq_len, seed=base_run.seed
    ).batch(0)

    baselines: dict[bool, Measured] = {}
    rows: list[tuple[Measured, Measured | None]] = []
    for fsdp in sorted({LAYOUTS[name][1] for name in args.layouts}):
        baselines[fsdp] = baseline(config, base_run, tokens, fsdp=fsdp)
        rows.append((baselines[fsdp], None))
        print(f"  compiled {baselines[fsdp].name}", file=sys.stderr, flush=True)
    for name in args.layouts:
        sizes, fsdp = LAYOUTS[name]
        mesh = {lm.DATA: 1, lm.PIPE: 1, lm.MODEL: 1, **sizes}
        # Without a pipe axis a microbatch loop only repeats the gradient all-reduce.
        microbatches = args.microbatches if mesh[lm.PIPE] > 1 else 1
        run = dataclasses.replace(base_run, mesh=mesh, fsdp=fsdp, microbatches=microbatches)
        measured = eqpar_layout(name, config, run, tokens)
        measured.step_s, baseline_s = paired_median_seconds(
            (measured.chained, ()), (baselines[fsdp].chained, ()), repeats=args.repeats
        )
        measured.paired_baseline_s.append(baseline_s)
        baselines[fsdp].paired_baseline_s.append(baseline_s)
        rows.append((measured, baselines[fsdp]))
        print(f"  measured {name}", file=sys.stderr, flush=True)
    for base in baselines.values():
        base.step_s = statistics.median(base.paired_baseline_s)
    return as_markdown(rows, config, args)


if __name__ == "__main__":
    sys.stdout.write(main())
