"""Draw the pictures of the tutorials into `docs/images/`: the pipeline schedules of
`docs/tutorials/pipeline.md` and `docs/tutorials/zero_bubble.md`, and the parameter layout
of `docs/tutorials/distributions.md`.

Run from anywhere: `python docs/make_images.py`. Needs matplotlib (the `plot` extra).
"""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402 - after the device count is set

import eqpar  # noqa: E402
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


def main() -> list[Path]:
    IMAGES.mkdir(exist_ok=True)
    written = schedules() + layouts()
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
