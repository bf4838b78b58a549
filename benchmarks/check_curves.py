"""The loss curves of `examples/train_lm.py --check`: the parallel run and the one-device run.

Runs the example's own `main` with `--check` (plain SGD, the same steps trained again on one
device with the same parameters and batches) and tabulates both runs' loss at every step with
their relative difference. `docs/make_images.py` draws the two curves from this table onto the
performance page (`docs/images/check_curves.png`).

Run: `python benchmarks/check_curves.py` (`--steps`, `--mesh`, `--size`; `--help`).
"""

import argparse
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import train_lm  # pyright: ignore[reportMissingImports]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument(
        "--mesh", default=None, help="the example's --mesh (default: its own, 3D on 8 devices)"
    )
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        command = ["--size", args.size, "--steps", str(args.steps), "--check", "--no-progress",
                   "--no-tensorboard", "--out", out]  # fmt: skip
        if args.mesh is not None:
            command += ["--mesh", args.mesh]
        summary = train_lm.main(command)
    config, check = summary["config"], summary["check"]
    parallel, serial = summary["losses"], check["serial_losses"]
    differences = [abs(a - b) / abs(b) for a, b in zip(parallel, serial, strict=True)]
    lines = [
        f"`python examples/train_lm.py --size {args.size} --steps {args.steps} --check` on "
        f"{jax.device_count()} {jax.devices()[0].platform} devices: mesh {config['mesh']}, "
        f"schedule {config['schedule']}, {config['microbatches']} microbatches, optimizer "
        f"{config['optimizer']}, precision {config['precision']}, batch {config['batch_size']}, "
        f"sequence {config['seq_len']}. The one-device run trains the same steps from the same "
        f"parameters on the same batches. Relative difference: |parallel - one device| / "
        f"one device.",
        "",
        "| step | parallel loss | one-device loss | relative difference |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for step, (a, b, d) in enumerate(zip(parallel, serial, differences), start=1):
        lines.append(f"| {step} | {a:.7f} | {b:.7f} | {d:.1e} |")
    worst = max(range(len(differences)), key=differences.__getitem__)
    lines += [
        "",
        f"Largest relative loss difference {check['loss_difference']:.1e} (step {worst + 1}), "
        f"largest parameter difference {check['parameter_difference']:.1e}, after "
        f"{args.steps} steps; tolerance {check['tolerance']:.0e}: "
        f"{'PASS' if check['passed'] else 'FAIL'}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main())
