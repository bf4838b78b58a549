"""Draw the pictures of the tutorials into `docs/images/`: the pipeline schedules of
`docs/tutorials/pipeline.md` and `docs/tutorials/zero_bubble.md`, the parameter layout
of `docs/tutorials/distributions.md`, and the routing of `docs/tutorials/experts.md`.

Run from anywhere: `python docs/make_images.py`. Needs matplotlib (the `plot` extra).
"""

import os
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
    GPipeSchedule,
    OneFOneBSchedule,
    ZeroBubbleH1Schedule,
)

IMAGES = Path(__file__).resolve().parent / "images"
STAGES, MICROBATCHES, REPEATS = 4, 8, 2
DPI = 110


def schedules() -> list[Path]:
    gpipe = GPipeSchedule(STAGES, MICROBATCHES, include_backward=True)
    circular = CircularSchedule(STAGES, MICROBATCHES, REPEATS, include_backward=True)
    one_f_one_b = OneFOneBSchedule(STAGES, MICROBATCHES)
    zero_bubble = ZeroBubbleH1Schedule(STAGES, MICROBATCHES)
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


def main() -> list[Path]:
    IMAGES.mkdir(exist_ok=True)
    written = quickstart() + schedules() + layouts() + routing()
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
