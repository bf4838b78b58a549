"""Draw the pictures of the docs into `docs/images/`: the quick start's layout on the home
page, the pipeline schedules of `docs/tutorials/pipeline.md` and
`docs/tutorials/zero_bubble.md`, the parameter layout of `docs/tutorials/distributions.md`,
the routing of `docs/tutorials/experts.md`, the charts of `docs/performance.md` and the
planner's calibration chart of `docs/planning.md`.

Run from anywhere: `python docs/make_images.py`. Needs matplotlib (the `plot` extra).

The performance page's charts are drawn from data: the scale table of
`benchmarks/results.md` (memory and collective bytes per device per layout), eqpar's own
schedule tables (bubble against microbatches), and the loss curves of
`examples/train_lm.py --check` that `benchmarks/check_curves.py` wrote into
`benchmarks/results.md`, and the planner's predicted against compiled peaks that
`benchmarks/planner.py` wrote there. Each chart carries the SHA-256 of its data in
its PNG metadata (`Source`), and `python docs/make_images.py --check` (run by
`tests/test_docs.py`) recomputes the data and fails when a chart was drawn from other data:
after a new `benchmarks/results.md`, run the script again.
"""

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402 - after the device count is set
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eqpar  # noqa: E402
from eqpar.nn import MixtureOfExperts  # noqa: E402
from eqpar.nn.experts import expert_buffer_rows  # noqa: E402
from eqpar.schedule import (  # noqa: E402
    CircularSchedule,
    DualPipeVSchedule,
    GPipeSchedule,
    OneFOneBSchedule,
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
)

IMAGES = Path(__file__).resolve().parent / "images"
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results.md"
STAGES, MICROBATCHES, REPEATS = 4, 8, 2
DPI = 110


def schedules() -> list[Path]:
    gpipe = GPipeSchedule(STAGES, MICROBATCHES, include_backward=True)
    circular = CircularSchedule(STAGES, MICROBATCHES, REPEATS, include_backward=True)
    one_f_one_b = OneFOneBSchedule(STAGES, MICROBATCHES)
    zero_bubble = ZeroBubbleH1Schedule(STAGES, MICROBATCHES)
    zero_bubble_v = ZeroBubbleVSchedule(STAGES, MICROBATCHES)
    dualpipe_v = DualPipeVSchedule(STAGES, MICROBATCHES)
    return [
        gpipe.plot(
            IMAGES / "pipeline_gpipe.png",
            title=f"{gpipe.default_title()}\nup to {gpipe.max_stored_inputs()} microbatch "
            "inputs held per device",
        ),
        circular.plot(
            IMAGES / "pipeline_circular.png",
            title=f"{circular.default_title()}\neach stage is 1/{REPEATS} of a GPipe stage, so "
            f"a step takes 1/{REPEATS} of the time; up to {circular.max_stored_inputs()} "
            "stage inputs held per device",
        ),
        one_f_one_b.plot(
            IMAGES / "pipeline_1f1b.png",
            title=f"{one_f_one_b.default_title()}\nup to {one_f_one_b.max_stored_inputs()} "
            "microbatch inputs held per device",
        ),
        zero_bubble.plot(
            IMAGES / "pipeline_zb_h1.png",
            title=f"{zero_bubble.default_title()}\neach backward split into B (input gradient) "
            "and W (weight gradient, green); up to "
            f"{zero_bubble.max_stored_inputs()} microbatches held per device",
        ),
        zero_bubble_v.plot(
            IMAGES / "pipeline_zb_v.png",
            title=f"{zero_bubble_v.default_title()}\nstage d and stage 2S-1-d on device d, the "
            f"loss on device 0; up to {zero_bubble_v.max_stored_inputs()} inputs of half-size "
            "stages held per device (1F1B's memory)",
        ),
        dualpipe_v.plot(
            IMAGES / "pipeline_dualpipe_v.png",
            title=f"{dualpipe_v.default_title()}\nthe published order, each action as soon as "
            "its inputs are there; an overlapped F&B pair is two cells here; up to "
            f"{dualpipe_v.max_stored_inputs()} stage inputs held per device",
        ),
    ]


def quickstart() -> list[Path]:
    # The MLP and plan of the home page's quick start (docs/index.md).
    model = eqx.nn.MLP(64, 64, width_size=256, depth=1, key=jax.random.key(0))
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    plan = {"layers/0": eqpar.ColumnParallel(), "layers/1": eqpar.RowParallel()}
    parallel = eqpar.parallelize(model, plan, mesh=mesh)
    figure = eqpar.inspect.plot_layout(
        parallel,
        eqpar.partition_specs(parallel),
        mesh=mesh,
        title="The quick start's MLP on a data=2 x model=4 mesh: "
        "layers/0 split by rows (ColumnParallel), layers/1 by columns (RowParallel)",
    )
    path = IMAGES / "quickstart_layout.png"
    figure.savefig(path, format="png", dpi=DPI)
    return [path]


def layouts() -> list[Path]:
    # The Megatron-LM layout of "Model parallel with a layout map" in distributions.md.
    model = eqx.nn.MLP(32, 32, 256, 2, activation=jax.nn.tanh, key=jax.random.key(0))
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    layout_map = eqpar.LayoutMap(mesh)
    layout_map["layers/[02]/weight"] = ("model", None)  # column-parallel
    layout_map["layers/[02]/bias"] = ("model",)
    layout_map["layers/1/weight"] = (None, "model")  # row-parallel
    mp = eqpar.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    path = IMAGES / "layout_model_parallel.png"
    figure = eqpar.inspect.plot_layout(
        model,
        mp,
        title="Megatron-LM layout of a 3-layer MLP on a data=2 x model=4 mesh",
    )
    figure.savefig(path, format="png", dpi=DPI)
    return [path]


def tokens_per_expert(moe: MixtureOfExperts, x: jax.Array, devices: int) -> np.ndarray:
    """[devices, experts]: how many of each device's (token, choice) pairs go to each expert,
    the batch split over the devices as `P(("data", "expert"))` splits it."""
    per_device = x.reshape(devices, -1, x.shape[-1])
    logits = jax.vmap(jax.vmap(moe.router))(per_device)
    chosen = jax.lax.top_k(logits, moe.top_k)[1]
    counts = jax.vmap(lambda c: jnp.bincount(c.reshape(-1), length=moe.num_experts))(chosen)
    return np.asarray(counts)


def routing() -> list[Path]:
    # The layer and tokens of "Where the tokens go" in experts.md, on its data=2 x expert=4
    # mesh: even routing, and the same tokens shifted towards expert 0.
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    data, expert, dim = 2, 4, 32
    devices = data * expert
    moe = MixtureOfExperts(dim, 2 * dim, num_experts=8, top_k=2, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (32, 16, dim))
    hot = moe.router.weight[0] / jnp.linalg.norm(moe.router.weight[0])
    tokens = x.shape[0] * x.shape[1] // devices
    rows = expert_buffer_rows(tokens, moe.top_k, expert, 1.25)
    per_device = moe.num_experts // expert
    cases = {"even routing": x, "expert 0 popular": x + hot}
    counts = {name: tokens_per_expert(moe, inputs, devices) for name, inputs in cases.items()}
    top = max(int(c.max()) for c in counts.values())

    figure = Figure(figsize=(10.5, 4.6), layout="constrained")
    axes = figure.subplots(1, len(cases), sharey=True)
    for ax, (name, count) in zip(axes, counts.items()):
        image = ax.imshow(count, cmap="Blues", vmin=0, vmax=top, aspect="auto")
        for (device, e), value in np.ndenumerate(count):
            colour = "white" if value > 0.6 * top else "black"
            ax.text(e, device, str(value), ha="center", va="center", fontsize=8, color=colour)
        for boundary in range(1, expert):  # the experts each device of the expert axis holds
            ax.axvline(boundary * per_device - 0.5, color="black", linewidth=1.5)
        pairs = count.reshape(devices, expert, per_device).sum(-1)
        rounds = -(-int(pairs.max()) // rows)
        ax.set_title(
            f"{name}: busiest device pair {int(pairs.max())} rows\n"
            f"({rows} per round at buffer_factor=1.25: {rounds} round{'s' * (rounds > 1)})",
            fontsize=10,
        )
        device, group = np.unravel_index(int(pairs.argmax()), pairs.shape)
        ax.add_patch(
            Rectangle(
                (group * per_device - 0.5, device - 0.5),
                per_device,
                1,
                fill=False,
                edgecolor="red",
                linewidth=2,
            )
        )
        ax.set_xticks(range(moe.num_experts), [f"e{e}" for e in range(moe.num_experts)])
        ax.set_xlabel("expert (red: the busiest pair of devices)")
        holder = ax.secondary_xaxis("top")
        holder.set_xticks(
            [g * per_device + (per_device - 1) / 2 for g in range(expert)],
            [f"on expert {g}" for g in range(expert)],
            fontsize=8,
        )
        holder.tick_params(length=0)
        ax.set_yticks(
            range(devices), [f"data {d // expert}, expert {d % expert}" for d in range(devices)]
        )
    axes[0].set_ylabel(f"device (its {tokens} tokens x {moe.top_k} choices)")
    figure.colorbar(image, ax=axes, label="assignments sent", shrink=0.9)
    figure.suptitle(
        f"Tokens per expert per device: top-{moe.top_k} of {moe.num_experts} experts, "
        f"{tokens} tokens per device, data={data} x expert={expert} mesh",
        fontsize=11,
    )
    path = IMAGES / "moe_routing.png"
    figure.savefig(path, format="png", dpi=DPI)
    return [path]


# ---------------------------------------------------------------------------------------------
# The performance page's charts, drawn from data and stamped with its digest.

SCALE_CHART = IMAGES / "scale_per_device.png"
BUBBLE_CHART = IMAGES / "bubble_microbatches.png"
CHECK_CHART = IMAGES / "check_curves.png"
PLANNER_CHART = IMAGES / "planner_calibration.png"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = re.compile(r"([0-9.]+) (B|KiB|MiB|GiB|TiB)")
# Columns of the scale table that the chart draws: memory held, and bytes moved, per device.
SCALE_MEMORY = {"params": "params/dev", "optimizer": "optimizer/dev", "temporaries": "temp/dev"}
SCALE_BYTES = {"data": "data bytes", "pipe": "pipe bytes", "model": "model bytes"}


def _size(cell: str) -> int:
    """`"622.07 MiB (1.00x)"` -> bytes; `"—"` (the layout has no such axis) -> 0."""
    found = _SIZE.match(cell.strip())
    return 0 if found is None else round(float(found[1]) * _UNITS[found[2]])


def _section(results: Path, heading: str) -> str:
    """The section of `results` whose heading starts with `heading`, up to the next `## `."""
    text = results.read_text()
    if heading not in text:
        raise ValueError(f"no section {heading!r} in {results}: run benchmarks/run_all.py")
    section = text[text.index(heading) :]
    return section[: section.find("\n## ", 1) if "\n## " in section[1:] else None]


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def scale_data(results: Path = RESULTS) -> dict[str, dict[str, dict[str, int]]]:
    """`{config: {layout: {quantity: bytes per device}}}` from the scale tables of
    `benchmarks/results.md` (the section `## Scale table`, one table after each `**config**`
    line)."""
    section = _section(results, "## Scale table")
    data: dict[str, dict[str, dict[str, int]]] = {}
    config = None
    header: list[str] = []
    for line in section.splitlines():
        bold = re.match(r"\*\*([^*]+)\*\*:", line)
        if bold:
            config, header = bold[1], []
            continue
        if config is not None and header and not line.startswith("|"):
            config = None  # the config's table has ended: later tables are other figures
        if config is None or not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = _cells(line)
        if not header:
            header = [re.sub(r" \(x ideal\)$", "", c) for c in cells]
            continue
        row = dict(zip(header, cells, strict=True))
        columns = {**SCALE_MEMORY, **SCALE_BYTES}
        data.setdefault(config, {})[row["layout"]] = {
            name: _size(row[column]) for name, column in columns.items()
        }
    if not data:
        raise ValueError(f"no scale table found in {results}")
    return data


BUBBLE_STAGES = 4
BUBBLE_MICROBATCHES = (1, 2, 4, 8, 12, 16, 24, 32)


def bubble_data() -> dict[str, dict[str, list[float]]]:
    """`{schedule: {"bubble": [...], "held": [...]}}` over `BUBBLE_MICROBATCHES` on
    `BUBBLE_STAGES` devices, from eqpar's training schedule tables: the idle share of the
    table's (step, device) cells, and the most microbatch inputs a device holds."""
    makers = {
        "GPipe": lambda m: GPipeSchedule(BUBBLE_STAGES, m, include_backward=True),
        "circular (2 stages per device)": lambda m: CircularSchedule(
            BUBBLE_STAGES, m, 2, include_backward=True
        ),
        "1F1B": lambda m: OneFOneBSchedule(BUBBLE_STAGES, m),
        "ZB-H1": lambda m: ZeroBubbleH1Schedule(BUBBLE_STAGES, m),
    }
    data = {}
    for name, make in makers.items():
        tables = [make(m) for m in BUBBLE_MICROBATCHES]
        data[name] = {
            "bubble": [round(t.bubble_fraction, 6) for t in tables],
            "held": [t.max_stored_inputs() for t in tables],
        }
    return data


CHECK_HEADING = "## Loss curves of train_lm.py --check"
CHECK_COLUMNS = {
    "parallel": "parallel loss",
    "one device": "one-device loss",
    "difference": "relative difference",
}


def check_curve_data(results: Path = RESULTS) -> dict[str, object]:
    """The loss curves of `examples/train_lm.py --check` from `benchmarks/results.md` (the
    section written by `benchmarks/check_curves.py`): `{"steps": [...], "parallel": [...],
    "one device": [...], "difference": [...], "mesh": ..., "tolerance": ...}`."""
    section = _section(results, CHECK_HEADING)
    rows = [_cells(line) for line in section.splitlines() if line.startswith("|")]
    rows = [row for row in rows if not set("".join(row)) <= set("-: ")]
    if len(rows) < 2:
        raise ValueError(f"no table under {CHECK_HEADING!r} in {results}")
    header, *rows = rows
    columns = {name: header.index(column) for name, column in CHECK_COLUMNS.items()}
    mesh = re.search(r"mesh (\S+),", section)
    tolerance = re.search(r"tolerance ([0-9.e+-]+)", section)
    if mesh is None or tolerance is None:
        raise ValueError(f"the mesh or the tolerance is missing under {CHECK_HEADING!r}")
    return {
        "steps": [int(row[header.index("step")]) for row in rows],
        **{name: [float(row[i]) for row in rows] for name, i in columns.items()},
        "mesh": mesh[1],
        "tolerance": float(tolerance[1]),
    }


def digest(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _save_stamped(figure, path: Path, data: object) -> Path:
    figure.savefig(path, format="png", dpi=DPI, metadata={"Source": f"sha256:{digest(data)}"})
    return path


def stamp(path: Path) -> str | None:
    """The `Source` digest a chart was drawn from (None: no chart, or no stamp)."""
    if not path.is_file():
        return None
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:
        return image.text.get("Source")  # type: ignore[attr-defined]


def _gib(n: int) -> float:
    return n / 2**30


def scale_chart() -> list[Path]:
    from matplotlib.figure import Figure

    data = scale_data()
    colours = {
        "params": "#4c72b0",
        "optimizer": "#8fa9d6",
        "temporaries": "#dd8452",
        "data": "#55a868",
        "pipe": "#c44e52",
        "model": "#8172b3",
    }
    figure = Figure(figsize=(11, 3.2 * len(data) + 0.6), layout="constrained")
    axes = figure.subplots(len(data), 2, squeeze=False)
    for row, (config, layouts) in zip(axes, data.items()):
        names = list(layouts)
        for ax, parts, what in (
            (row[0], SCALE_MEMORY, "memory per device"),
            (row[1], SCALE_BYTES, "collective bytes per device per step"),
        ):
            left = [0.0] * len(names)
            for part in parts:
                widths = [_gib(layouts[n][part]) for n in names]
                ax.barh(names, widths, left=left, color=colours[part], label=part)
                left = [a + b for a, b in zip(left, widths)]
            for y, total in enumerate(left):
                ax.text(total, y, f" {total:.2f}", va="center", fontsize=8)
            ax.set_xlim(0, max(left) * 1.15)
            ax.invert_yaxis()
            ax.set_title(f"{config}: {what}", fontsize=10)
            ax.set_xlabel("GiB")
            ax.legend(fontsize=8, loc="lower right")
        row[1].set_yticklabels([])
    figure.suptitle(
        "The scale table of benchmarks/results.md: one Adam step of the example LM on 8 "
        "devices, per device (compiler figures)",
        fontsize=11,
    )
    return [_save_stamped(figure, SCALE_CHART, data)]


def bubble_chart() -> list[Path]:
    from matplotlib.figure import Figure

    data = bubble_data()
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    bubble_ax, held_ax = figure.subplots(1, 2)
    for (name, series), marker in zip(data.items(), "osD^"):
        style = {"marker": marker, "label": name}
        if name == "GPipe":  # the same bubble as 1F1B: dashed, so that both lines show
            style.update(linestyle="--", label="GPipe (bubble: as 1F1B)", zorder=3)
        bubble_ax.plot(BUBBLE_MICROBATCHES, series["bubble"], **style)
        held_ax.plot(BUBBLE_MICROBATCHES, series["held"], **style)
    bubble_ax.set_title("bubble: idle share of the schedule's steps x devices", fontsize=10)
    bubble_ax.set_ylabel("bubble fraction")
    bubble_ax.set_ylim(0, None)
    held_ax.set_title("most microbatch inputs held by one device", fontsize=10)
    held_ax.set_ylabel("stage inputs held")
    for ax in (bubble_ax, held_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(BUBBLE_MICROBATCHES, [str(m) for m in BUBBLE_MICROBATCHES])
        ax.set_xlabel("microbatches M")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(
        f"Training schedules on {BUBBLE_STAGES} pipeline devices, from eqpar's schedule tables "
        "(every action one step)",
        fontsize=11,
    )
    return [_save_stamped(figure, BUBBLE_CHART, data)]


def check_chart() -> list[Path]:
    from matplotlib.figure import Figure

    data = check_curve_data()
    steps = data["steps"]
    assert isinstance(steps, list)
    figure = Figure(figsize=(11, 4.0), layout="constrained")
    loss_ax, difference_ax = figure.subplots(1, 2)
    loss_ax.plot(steps, data["parallel"], linewidth=2.5, label=f"parallel ({data['mesh']})")
    loss_ax.plot(steps, data["one device"], "--", color="black", label="one device")
    loss_ax.set_title("loss at each step: the two curves lie on each other", fontsize=10)
    loss_ax.set_ylabel("loss")
    # Steps whose losses are equal (difference 0) sit on the bottom edge of the log scale.
    differences = list(data["difference"])  # type: ignore[call-overload]
    tolerance = data["tolerance"]
    assert isinstance(tolerance, float)
    floor = min([d for d in differences if d > 0] + [tolerance]) / 10
    differ = [(step, d) for step, d in zip(steps, differences) if d > 0]
    equal = [step for step, d in zip(steps, differences) if d == 0]
    difference_ax.plot(
        *zip(*differ), "o", markersize=4, label="|parallel - one device| / one device"
    )
    difference_ax.plot(equal, [floor] * len(equal), "o", markersize=4, fillstyle="none",
                       color="grey", label="equal losses (difference 0)")  # fmt: skip
    difference_ax.axhline(tolerance, color="#c44e52", linestyle=":", label="--check tolerance")
    difference_ax.set_yscale("log")
    difference_ax.set_ylim(floor / 2, tolerance * 5)
    difference_ax.set_title("relative difference of the losses at each step", fontsize=10)
    for ax in (loss_ax, difference_ax):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(
        "examples/train_lm.py --check: the parallel run and the same steps on one device "
        "(plain SGD, float32), from benchmarks/results.md",
        fontsize=11,
    )
    return [_save_stamped(figure, CHECK_CHART, data)]


def planner_data(results: Path = RESULTS) -> dict[str, dict[str, float]]:
    """`{configuration: {"predicted": MiB, "compiled": MiB}}`: the peaks per device of the
    planner's calibration table in `benchmarks/results.md` (`## Planner calibration`)."""
    section = _section(results, "## Planner calibration")
    data: dict[str, dict[str, float]] = {}
    header: list[str] = []
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = _cells(line)
        if cells[0] == "configuration":
            header = cells
            continue
        if cells[0] == "rank":
            header = []  # the search's table follows the calibration table
        if not header or "peak MiB (pred / comp)" not in header or len(cells) != len(header):
            continue
        predicted, compiled = cells[header.index("peak MiB (pred / comp)")].split(" / ")
        data[cells[0]] = {"predicted": float(predicted), "compiled": float(compiled)}
    if not data:
        raise ValueError(f"no planner calibration rows in {results}: run benchmarks/planner.py")
    return data


def planner_chart() -> list[Path]:
    from matplotlib.figure import Figure

    data = planner_data()
    figure = Figure(figsize=(7, 5.5), layout="constrained")
    ax = figure.subplots()
    sizes = {"small": "#4c72b0", "gpt2-small": "#dd8452", "1.3b": "#55a868"}
    for size, colour in sizes.items():
        rows = [v for name, v in data.items() if name.split()[0] == size]
        ax.scatter(
            [r["compiled"] for r in rows],
            [r["predicted"] for r in rows],
            color=colour,
            label=size,
            s=18,
        )
    low = min(min(v.values()) for v in data.values()) * 0.8
    high = max(max(v.values()) for v in data.values()) * 1.25
    line = np.geomspace(low, high, 50)
    ax.plot(line, line, color="black", linewidth=0.8, label="predicted = compiled")
    ax.fill_between(line, line * 0.9, line * 1.1, color="grey", alpha=0.2, label="within 10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compiled peak per device, MiB (memory_analysis)")
    ax.set_ylabel("predicted peak per device, MiB (eqpar.estimate)")
    ax.set_title(
        f"eqpar.estimate against the compiler: {len(data)} training steps of the example LM "
        "(benchmarks/planner.py)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    return [_save_stamped(figure, PLANNER_CHART, data)]


def stale_charts() -> list[str]:
    """A message for every chart of the performance page not drawn from the current data."""
    problems = []
    charts = (
        (SCALE_CHART, scale_data(), "benchmarks/results.md"),
        (BUBBLE_CHART, bubble_data(), "the schedule tables"),
        (CHECK_CHART, check_curve_data(), "benchmarks/results.md"),
        (PLANNER_CHART, planner_data(), "benchmarks/results.md"),
    )
    for path, data, source in charts:
        wanted, found = f"sha256:{digest(data)}", stamp(path)
        if found != wanted:
            problems.append(
                f"{path.relative_to(IMAGES.parents[1])} was not drawn from the data now in "
                f"{source} (stamp {found}, data {wanted}): run `python docs/make_images.py`"
            )
    return problems


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="draw nothing; exit 1 if a chart of the performance page is stale",
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_charts()
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            raise SystemExit(1)
        return []
    IMAGES.mkdir(exist_ok=True)
    written = quickstart() + schedules() + layouts() + routing() + scale_chart() + bubble_chart()
    written += check_chart() + planner_chart()
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
