"""Ahead-of-time scale table: the example LM at GPT-2-small and ~1.3B sizes, every layout.

The decoder-only language model of `examples/lm.py` at two real sizes, one Adam training step
per layout exactly as `examples/train_lm.py` builds it (`build_model`, `storage_specs`,
`build_step`), compiled ahead of time without one parameter in memory: the model comes from
`eqx.filter_eval_shape`, the step is lowered with `jax.ShapeDtypeStruct`s that carry the
layout's `NamedSharding`s, and `.compile()` gives the figures. Nothing runs; every figure is
a statement of the compiler or of the shardings, so they are exact on any machine.

Sizes: `gpt2-small` (vocab 50304, seq 1024, d_model 768, 12 heads, MLP 3072, 12 layers) and
`1.3b` (d_model 2048, 16 heads, MLP 8192, 24 layers), global batch 16, float32, Adam. Layouts
on 8 devices: `DP` (`data=8`), `FSDP` (`data=8 --fsdp`: the block stack gathered layer by
layer), `DPxTP` (`data=2,model=4`), `DPxPP` with the GPipe, 1F1B and circular schedules
(`data=2,pipe=4`, 8 microbatches; circular with 2 stages per device where the depth allows,
else 3) and `DPxTPxPP` (`data=2,pipe=2,model=2`, GPipe). Each layer uses the per-layer remat
policy `--remat` (default `full`: a layer keeps only its input for the backward pass).

Per device:

- **params, optimizer**: bytes of one shard of every leaf (`sharding.shard_shape`), against
  the ideal `total / ways`, where `ways` is the number of devices each parameter could be split
  over in the layout: the product of the `pipe` and `model` sizes, times `data` under FSDP
  (DP 1, FSDP 8, DPxTP 4, DPxPP 4, DPxTPxPP 4).
- **temp** (`memory_analysis().temp_size_in_bytes`) and **peak** = argument + output + temp -
  alias (on CPU the reported peak ignores temp).
- **collective bytes per mesh axis**: what one device receives per step (ring model of
  `eqpar/_hlo.py`, loops counted per iteration), each collective assigned to the mesh axes its
  device groups span (`collective_bytes_by_axes`). A collective over several axes is split
  among them as a hierarchical ring would move it (innermost axis first: a full ring over it,
  then the next axis on `1/g` of the data), which preserves its total.
- **compile s**: `lower` + `compile`; a depth sweep (12 to 96 layers at GPT-2-small width)
  gives temp and compile time against depth.

Ideal collective bytes per device per step, with `g` the axis size, `P` all parameter bytes,
`w` the layout's `ways`, `A = (batch / data) x seq x d_model x 4` one device's activation
of one layer, `L` layers, `S` pipe size, `V` stages per device, `t` model size:

- `data`, replicated parameters: one all-reduce of the gradient, `2 (g-1)/g x P / w`;
  FSDP: all-gather in the forward, re-gather in the backward, reduce-scatter of the
  gradient, `3 (g-1)/g x P`.
- `pipe`: each microbatch's activation forward and its cotangent backward once per stage
  boundary, averaged over devices: `2 (V S - 1) / S x A`.
- `model` (Megatron): per layer two activation all-reduces forward and two backward, plus
  one with `full` remat (the recomputed forward repeats the attention's all-reduce, whose
  output the MLP's backward needs; the MLP's own is not needed again), one for the
  vocabulary-parallel embedding, one for the head's input cotangent, and three of
  `A / d_model` for a vocabulary-parallel cross entropy (no logits gathered); with a pipe
  axis each device holds `L / S` layers and the embedding and head fall on one stage each:
  `2 (t-1)/t x ((k L + 2) A + 3 A / d_model) / S`, `k` = 4, or 5 with `full` remat.

Run: `python benchmarks/scale.py` (`--quick`: GPT-2-small only, depths 12 and 24; `--help`
for the rest). On CPU 8 devices are simulated unless `JAX_PLATFORMS` is set; on accelerators
the device kind is recorded above the tables.
"""

import argparse
import dataclasses
import math
import os
import pathlib
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import lm  # pyright: ignore[reportMissingImports]
import train_lm  # pyright: ignore[reportMissingImports]

import eqpar
from eqpar._hlo import collective_bytes_by_axes, format_bytes, memory_figures
from eqpar.distributions import match_param_specs

NUM_DEVICES = 8
AXES = (lm.DATA, lm.PIPE, lm.MODEL)
CONFIGS = {
    "gpt2-small": lm.LMConfig(
        vocab_size=50304, seq_len=1024, d_model=768, num_heads=12, d_hidden=3072, num_layers=12
    ),
    "1.3b": lm.LMConfig(
        vocab_size=50304, seq_len=1024, d_model=2048, num_heads=16, d_hidden=8192, num_layers=24
    ),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: dict[str, int]
    fsdp: bool = False
    schedule: str = "gpipe"


LAYOUTS = {
    "DP": Layout({lm.DATA: 8}),
    "FSDP": Layout({lm.DATA: 8}, fsdp=True),
    "DPxTP": Layout({lm.DATA: 2, lm.MODEL: 4}),
    "DPxPP GPipe": Layout({lm.DATA: 2, lm.PIPE: 4}),
    "DPxPP 1F1B": Layout({lm.DATA: 2, lm.PIPE: 4}, schedule="1f1b"),
    "DPxPP circular": Layout({lm.DATA: 2, lm.PIPE: 4}, schedule="circular"),
    "DPxTPxPP": Layout({lm.DATA: 2, lm.PIPE: 2, lm.MODEL: 2}),
}


@dataclasses.dataclass
class Figures:
    """What the compiler and the shardings say about one layout's training step."""

    layout: str
    run: Any  # train_lm.RunConfig
    num_params: int
    param_bytes: int  # all parameters, one copy
    opt_bytes: int  # all optimizer state, one copy
    params: int  # per device
    opt_state: int  # per device
    memory: dict[str, int]
    axis_bytes: dict[tuple[str, ...], float]  # per set of mesh axes, as measured
    compile_s: float

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: self.run.mesh[axis] for axis in AXES}

    @property
    def ways(self) -> int:
        """Devices each parameter could be split over in this layout."""
        return (
            self.sizes[lm.PIPE]
            * self.sizes[lm.MODEL]
            * (self.sizes[lm.DATA] if self.run.fsdp else 1)
        )

    @property
    def per_axis(self) -> dict[str, float]:
        """Measured bytes per mesh axis, collectives over several axes split among them."""
        return split_by_axis(self.axis_bytes, self.sizes)


# --- compiling without parameters -----------------------------------------------------------


def _is_abstract(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def _with_shardings(tree: Any, shardings: Any) -> Any:
    """`tree`'s ShapeDtypeStructs, each carrying its sharding."""
    return jax.tree.map(
        lambda leaf, sharding: (
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            if _is_abstract(leaf)
            else leaf
        ),
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


def _nbytes(leaf: jax.ShapeDtypeStruct, shape: tuple[int, ...] | None = None) -> int:
    return math.prod(leaf.shape if shape is None else shape) * jnp.dtype(leaf.dtype).itemsize


def _shard_bytes(tree: Any) -> int:
    """Bytes of one shard of every leaf: what each device holds (the layouts split evenly)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if _is_abstract(leaf)]
    return sum(_nbytes(leaf, leaf.sharding.shard_shape(leaf.shape)) for leaf in leaves)


def _whole_bytes(tree: Any) -> int:
    return sum(_nbytes(leaf) for leaf in jax.tree.leaves(tree) if _is_abstract(leaf))


def compile_layout(
    name: str, config: lm.LMConfig, run: Any, devices: list[Any]
) -> tuple[Figures, Any]:
    """Lower and compile `run`'s training step for `config` from shapes and shardings only."""
    train_lm.check_sizes(config, run)
    mesh = train_lm.make_mesh(run.mesh, devices)
    optimizer = train_lm.make_optimizer(run)
    model = eqx.filter_eval_shape(train_lm.build_model, config, run, mesh)
    specs = train_lm.storage_specs(model, mesh, run.fsdp)
    model = _with_shardings(model, eqpar.named_shardings(specs, mesh))

    def inexact(leaf: Any) -> bool:
        return _is_abstract(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)

    opt_state = jax.eval_shape(optimizer.init, eqx.filter(model, inexact))
    opt_specs = match_param_specs(opt_state, model, specs)
    opt_state = _with_shardings(opt_state, eqpar.named_shardings(opt_specs, mesh))
    step = train_lm.build_step(model, mesh, run, optimizer)
    # The step is an `eqx.filter_jit`, which takes only arrays as traced arguments: wrap it in
    # `jax.jit` over the abstract leaves, with the model's static part closed over.
    arrays, static = eqx.partition(model, _is_abstract)

    def abstract_step(tokens: jax.Array, arrays: Any, opt_state: Any) -> Any:
        model, opt_state, loss = step(tokens, eqx.combine(arrays, static), opt_state)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    tokens = jax.ShapeDtypeStruct(
        (run.batch_size, config.seq_len + 1),
        jnp.int32,
        sharding=NamedSharding(mesh.jax_mesh, P(lm.DATA)),
    )
    started = time.perf_counter()
    lowered = jax.jit(abstract_step, donate_argnums=(1, 2)).lower(tokens, arrays, opt_state)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    sizes = {axis: run.mesh[axis] for axis in AXES}
    figures = Figures(
        layout=name,
        run=run,
        num_params=sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(arrays)),
        param_bytes=_whole_bytes(arrays),
        opt_bytes=_whole_bytes(opt_state),
        params=_shard_bytes(arrays),
        opt_state=_shard_bytes(opt_state),
        memory=memory_figures(compiled),
        axis_bytes=collective_bytes_by_axes(compiled, sizes),
        compile_s=compile_s,
    )
    return figures, compiled


def split_by_axis(
    axis_bytes: dict[tuple[str, ...], float], sizes: dict[str, int]
) -> dict[str, float]:
    """Bytes per single mesh axis. A collective over axes `a_1 .. a_k` (mesh order) moves
    `c (g-1)/g x N` for its whole group of `g = g_1 ... g_k`; a hierarchical ring moves
    `c (g_k - 1)/g_k x N` over the innermost axis `a_k`, then `c (g_j - 1)/g_j x N / (g_{j+1}
    ... g_k)` over each outer one: the same total, split in those proportions."""
    per_axis = dict.fromkeys(AXES, 0.0)
    for axes, received in axis_bytes.items():
        if not axes:
            continue
        shares, inner = {}, 1
        for axis in reversed(axes):
            g = sizes[axis]
            shares[axis] = (g - 1) / g / inner
            inner *= g
        total = sum(shares.values())
        for axis, share in shares.items():
            per_axis[axis] += received * share / total
    return per_axis


# --- ideals ---------------------------------------------------------------------------------


def ideal_collectives(f: Figures, config: lm.LMConfig) -> dict[str, float]:
    """The ideal bytes per device per step on each mesh axis (module docstring)."""
    sizes = f.sizes
    data, pipe, model = sizes[lm.DATA], sizes[lm.PIPE], sizes[lm.MODEL]
    local_batch = f.run.batch_size // data
    activation = local_batch * config.seq_len * config.d_model * 4
    ideal = dict.fromkeys(AXES, 0.0)
    if data > 1:
        share = (data - 1) / data
        if f.run.fsdp:
            ideal[lm.DATA] = 3 * share * f.param_bytes
        else:
            ideal[lm.DATA] = 2 * share * f.param_bytes / f.ways
    if pipe > 1:
        repeats = train_lm.pipeline_repeats(f.run)
        ideal[lm.PIPE] = 2 * (repeats * pipe - 1) / pipe * activation
    if model > 1:
        per_layer = 5 if f.run.remat == "full" else 4
        reductions = (per_layer * config.num_layers + 2) * activation
        reductions += 3 * activation / config.d_model
        ideal[lm.MODEL] = 2 * (model - 1) / model * reductions / pipe
    return ideal


# --- report ---------------------------------------------------------------------------------


def _ratio(value: float, ideal: float) -> str:
    if ideal == 0:
        return "—" if value == 0 else "n/a"
    return f"{value / ideal:.2f}x"


def _mesh_label(run: Any) -> str:
    label = ",".join(f"{axis}={size}" for axis, size in run.mesh.items() if size > 1)
    if run.fsdp:
        label += " --fsdp"
    if run.mesh[lm.PIPE] > 1:
        label += f" {run.schedule} M={run.microbatches}"
        if run.schedule == "circular":
            label += f" V={run.repeats}"
    return label


def describe_config(name: str, config: lm.LMConfig, figures: Figures, batch: int) -> str:
    return (
        f"**{name}**: vocab {config.vocab_size}, seq {config.seq_len}, d_model "
        f"{config.d_model}, {config.num_heads} heads, MLP {config.d_hidden}, "
        f"{config.num_layers} layers: {figures.num_params:,} float32 parameters "
        f"({format_bytes(figures.param_bytes)}; Adam state {format_bytes(figures.opt_bytes)}); "
        f"global batch {batch}."
    )


def layout_table(rows: list[Figures], config: lm.LMConfig) -> list[str]:
    lines = [
        "| layout | mesh | params/dev (x ideal) | optimizer/dev (x ideal) | params+opt "
        "(x ideal) | temp/dev | peak/dev | data bytes (x ideal) | pipe bytes (x ideal) | "
        "model bytes (x ideal) | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in rows:
        ideal_params = f.param_bytes / f.ways
        ideal_opt = f.opt_bytes / f.ways
        state = f.params + f.opt_state
        ideal = ideal_collectives(f, config)
        measured = f.per_axis
        cells = [
            f.layout,
            _mesh_label(f.run),
            f"{format_bytes(f.params)} ({_ratio(f.params, ideal_params)})",
            f"{format_bytes(f.opt_state)} ({_ratio(f.opt_state, ideal_opt)})",
            f"{format_bytes(state)} ({_ratio(state, ideal_params + ideal_opt)})",
            format_bytes(f.memory["temp"]),
            format_bytes(f.memory["total"]),
        ]
        for axis in AXES:
            if f.sizes[axis] == 1 and measured[axis] == 0:
                cells.append("—")
            else:
                cells.append(
                    f"{format_bytes(measured[axis])} ({_ratio(measured[axis], ideal[axis])})"
                )
        cells.append(f"{f.compile_s:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def collective_detail(rows: list[Figures], config: lm.LMConfig) -> list[str]:
    lines = [
        "",
        "Collective bytes per device per step by the mesh axes each collective's groups span "
        "(as measured, before splitting those over several axes), and the ideal per axis:",
        "",
    ]
    for f in rows:
        measured = ", ".join(
            f"{'+'.join(axes)}: {format_bytes(value)}"
            for axes, value in sorted(f.axis_bytes.items())
            if axes
        )
        ideal = ", ".join(
            f"{axis}: {format_bytes(value)}"
            for axis, value in ideal_collectives(f, config).items()
            if value
        )
        lines.append(f"- {f.layout}: measured {measured or 'none'}; ideal {ideal or 'none'}")
    return lines


def depth_table(sweep: dict[tuple[str, int], Figures], depths: list[int]) -> list[str]:
    series = sorted({name for name, _ in sweep}, key=lambda n: list(SWEEP).index(n))
    lines = [
        "| layers | "
        + " | ".join(f"{name} temp (x {depths[0]} layers)" for name in series)
        + " | "
        + " | ".join(f"{name} compile s (x {depths[0]})" for name in series)
        + " |",
        "|---:|" + "---:|" * (2 * len(series)),
    ]
    for depth in depths:
        cells = []
        for name in series:
            temp, first = sweep[name, depth].memory["temp"], sweep[name, depths[0]].memory["temp"]
            cells.append(f"{format_bytes(temp)} ({_ratio(temp, first)})")
        for name in series:
            seconds, first = sweep[name, depth].compile_s, sweep[name, depths[0]].compile_s
            cells.append(f"{seconds:.1f} ({_ratio(seconds, first)})")
        lines.append(f"| {depth} | " + " | ".join(cells) + " |")
    state = "; ".join(
        f"{name}: " + ", ".join(format_bytes(sweep[name, depth].params) for depth in depths)
        for name in series
    )
    lines += [
        "",
        "Temp includes the gradients and the optimizer's update, which grow with the "
        f"parameters. Params per device at {', '.join(map(str, depths))} layers: {state}.",
    ]
    return lines


def targets(
    tables: dict[str, list[Figures]],
    sweep: dict[tuple[str, int], Figures],
    depths: list[int],
    configs: dict[str, lm.LMConfig],
) -> list[str]:
    """The issue's targets, each with the measured figure and whether it is met."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines = ["", "Targets (issue 12):", ""]
    for name, rows in tables.items():
        config = configs[name]
        axis_ratios: list[tuple[float, str]] = []
        for f in rows:
            ideal, measured = ideal_collectives(f, config), f.per_axis
            for axis in AXES:
                if ideal[axis] or measured[axis]:
                    ratio = measured[axis] / ideal[axis] if ideal[axis] else math.inf
                    axis_ratios.append((ratio, f"{f.layout} {axis} {ratio:.2f}x"))
        over = [text for ratio, text in sorted(axis_ratios, reverse=True) if ratio > 1.1]
        lines.append(
            f"- {name}: collective bytes on each axis <= 1.1x ideal: "
            f"{verdict(not over)}" + (f" (over: {', '.join(over)})" if over else "")
        )
        by_name = {f.layout: f for f in rows}
        if "DP" in by_name and "FSDP" in by_name:
            dp, fsdp = by_name["DP"].memory["total"], by_name["FSDP"].memory["total"]
            lines.append(
                f"- {name}: FSDP peak < DP peak: {format_bytes(fsdp)} vs {format_bytes(dp)} "
                f"({fsdp / dp:.2f}x): {verdict(fsdp < dp)}"
            )
        state = []
        for f in rows:
            ratio = (f.params + f.opt_state) / ((f.param_bytes + f.opt_bytes) / f.ways)
            state.append((ratio, f"{f.layout} {ratio:.2f}x"))
        over = [text for ratio, text in sorted(state, reverse=True) if ratio > 1.05]
        lines.append(
            f"- {name}: params + optimizer per device <= 1.05x ideal: {verdict(not over)}"
            + (f" (over: {', '.join(over)})" if over else "")
        )
        if "DPxPP GPipe" in by_name and "DPxPP circular" in by_name:
            gpipe = by_name["DPxPP GPipe"].memory["temp"]
            circular = by_name["DPxPP circular"].memory["temp"]
            lines.append(
                f"- {name}: circular temp <= 1.1x GPipe temp: {format_bytes(circular)} vs "
                f"{format_bytes(gpipe)} ({circular / gpipe:.2f}x): "
                f"{verdict(circular <= 1.1 * gpipe)}"
            )
    for series in SWEEP:
        if not SWEEP[series][1] == "full" or (series, depths[-1]) not in sweep:
            continue
        first, last = (
            sweep[series, depths[0]].memory["temp"],
            sweep[series, depths[-1]].memory["temp"],
        )
        lines.append(
            f"- {series}: temp at {depths[-1]} layers <= 1.5x temp at {depths[0]}: "
            f"{last / first:.2f}x: {verdict(last <= 1.5 * first)}"
        )
    return lines


# (layout, remat) of each series of the depth sweep
SWEEP = {
    "DP remat none": ("DP", "none"),
    "DP remat full": ("DP", "full"),
    "DPxPP GPipe remat full": ("DPxPP GPipe", "full"),
}


def make_run(config: lm.LMConfig, layout: Layout, args: argparse.Namespace, remat: str) -> Any:
    mesh = {axis: layout.mesh.get(axis, 1) for axis in AXES}
    repeats = 2
    if layout.schedule == "circular" and config.num_layers % (2 * mesh[lm.PIPE]):
        repeats = 3
    return train_lm.RunConfig(
        mesh=mesh,
        fsdp=layout.fsdp,
        schedule=layout.schedule,
        microbatches=args.microbatches,
        repeats=repeats,
        remat=remat,
        batch_size=args.batch_size,
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description="Ahead-of-time figures of the example LM at GPT-2-small and ~1.3B sizes, "
        "every layout, without materialising parameters."
    )
    parser.add_argument(
        "--quick", action="store_true", help="GPT-2-small only; depth sweep 12 and 24"
    )
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--depths", nargs="+", type=int, default=None, help="depth sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the depth sweep")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument(
        "--microbatches", type=int, default=8, help="microbatches of the pipe layouts"
    )
    parser.add_argument(
        "--remat", choices=("none", "full"), default="full", help="per-layer remat policy"
    )
    args = parser.parse_args(argv)
    if jax.device_count() < NUM_DEVICES:
        raise SystemExit(f"needs {NUM_DEVICES} devices; got {jax.device_count()}")
    devices = jax.devices()[:NUM_DEVICES]
    config_names = args.configs or (["gpt2-small"] if args.quick else list(CONFIGS))
    depths = args.depths or ([12, 24] if args.quick else [12, 24, 48, 96])
    configs = {name: CONFIGS[name] for name in config_names}

    def progress(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    def figures_of(layout: str, config: lm.LMConfig, remat: str) -> Figures:
        # The sweep compiles its own programs even where a table has the same one, so that
        # its compile times are taken one after the other, under the same load.
        run = make_run(config, LAYOUTS[layout], args, remat)
        return compile_layout(layout, config, run, devices)[0]

    tables: dict[str, list[Figures]] = {}
    for name, config in configs.items():
        rows = []
        for layout in args.layouts:
            figures = figures_of(layout, config, args.remat)
            progress(f"{name} {layout}: compiled in {figures.compile_s:.1f} s")
            rows.append(figures)
        tables[name] = rows

    sweep: dict[tuple[str, int], Figures] = {}
    if not args.no_sweep:
        width = CONFIGS["gpt2-small"]
        for series, (layout, remat) in SWEEP.items():
            for depth in depths:
                config = dataclasses.replace(width, num_layers=depth)
                sweep[series, depth] = figures_of(layout, config, remat)
                progress(f"sweep {series} {depth} layers: {sweep[series, depth].compile_s:.1f} s")

    device = devices[0]
    lines = [
        f"Devices: {NUM_DEVICES} x {device.device_kind} ({device.platform}); "
        f"jax {jax.__version__}. Every figure is per device, from the compiled program and the "
        "shardings (nothing is allocated). Remat policy of the layout tables: "
        f"`{args.remat}`; pipe layouts: {args.microbatches} microbatches.",
    ]
    for name, rows in tables.items():
        config = configs[name]
        lines += ["", describe_config(name, config, rows[0], args.batch_size), ""]
        lines += layout_table(rows, config)
        lines += collective_detail(rows, config)
    lines += [
        "",
        "Ideals: params/optimizer = one copy / ways (DP 1, FSDP 8, DPxTP 4, DPxPP 4, "
        "DPxTPxPP 4); `data` = 2(g-1)/g x P/ways (FSDP: 3(g-1)/g x P); `pipe` = 2(VS-1)/S x A, "
        "A = (batch/data) x seq x d_model x 4; `model` = 2(t-1)/t x ((kL+2) A + 3A/d_model)/S, "
        "k = 4 (5 with remat full). Collectives over several axes are split among them as a "
        "hierarchical ring would move them (module docstring).",
    ]
    if sweep:
        width = CONFIGS["gpt2-small"]
        lines += [
            "",
            f"Depth sweep at GPT-2-small width (d_model {width.d_model}, seq {width.seq_len}, "
            f"global batch {args.batch_size}); in brackets the ratio to {depths[0]} layers:",
            "",
        ]
        lines += depth_table(sweep, depths)
    lines += targets(tables, sweep, depths, configs)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main())
