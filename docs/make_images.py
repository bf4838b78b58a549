"""Draw the pipeline schedule pictures of `docs/tutorials/pipeline.md` into `docs/images/`.

Run from anywhere: `python docs/make_images.py`. Needs matplotlib (the `plot` extra).
"""

from pathlib import Path

from eqpar.schedule import CircularSchedule, GPipeSchedule, OneFOneBSchedule

IMAGES = Path(__file__).resolve().parent / "images"
STAGES, MICROBATCHES = 4, 8


def main() -> list[Path]:
    IMAGES.mkdir(exist_ok=True)
    gpipe = GPipeSchedule(STAGES, MICROBATCHES, include_backward=True)
    circular = CircularSchedule(STAGES, MICROBATCHES, num_repeats=2)
    one_f_one_b = OneFOneBSchedule(STAGES, MICROBATCHES)
    written = [
        gpipe.plot(
            IMAGES / "pipeline_gpipe.png",
            title=f"GPipe training step, {STAGES} stages, {MICROBATCHES} microbatches\n"
            f"bubble {gpipe.bubble_fraction:.1%}, up to {gpipe.max_stored_inputs()} "
            f"microbatches held",
        ),
        circular.plot(
            IMAGES / "pipeline_circular.png",
            title=f"Circular forward, {STAGES} devices x 2 stages, {MICROBATCHES} microbatches\n"
            f"label m.r = microbatch m on trip r; bubble {circular.bubble_fraction:.1%}",
        ),
        one_f_one_b.plot(
            IMAGES / "pipeline_1f1b.png",
            title=f"1F1B training step, {STAGES} stages, {MICROBATCHES} microbatches\n"
            f"bubble {one_f_one_b.bubble_fraction:.1%}, up to "
            f"{one_f_one_b.max_stored_inputs()} microbatches held",
        ),
    ]
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
