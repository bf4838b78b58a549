"""A guard on the memory of the example's training step, layout by layout.

Each layout's step (`examples/train_lm.py`: `build_model`, `storage_specs`, `build_step`,
Adam) is lowered from shapes and shardings and compiled ahead of time at a small size
(`benchmarks/scale.py`'s `lower_step`), and its figures per device are checked:

- **parameters** and **optimizer state**: the bytes of one shard of every leaf, which depend
  only on the shapes and the layout: equal to the recorded figure;
- **temp** (`memory_analysis().temp_size_in_bytes`, exact for a given compiler): at most 5%
  above the figure recorded for this JAX version. A JAX version with no record is held to
  the newest record at 25% (compilers of other versions lay out buffers differently; a
  regression such as FSDP keeping every gathered layer, 1F1B holding all microbatches or
  activations replicated where they were split moves temp by far more);
- the relations that hold whatever the compiler (`BELOW`): FSDP's temp below data
  parallelism's, 1F1B's below GPipe's with more microbatches than stages.

Record a JAX version's figures (after a change that lowers memory on purpose, or for a new
JAX) with `python tests/test_memory_guard.py`, which rewrites `tests/memory_guard.json`.
"""

import dataclasses
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # run as a script: 8 simulated devices too

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]

import lm  # noqa: E402
import scale  # noqa: E402  (sets 8 CPU devices, as conftest does)
import train_lm  # noqa: E402
from _hlo import memory_figures  # noqa: E402

RECORD = pathlib.Path(__file__).with_name("memory_guard.json")
TOLERANCE = 0.05  # temp may grow this much over the record of the same JAX version
OTHER_VERSION_TOLERANCE = 0.25  # ... or over the newest record, under another JAX version

CONFIG = lm.LMConfig(
    vocab_size=512, seq_len=64, d_model=64, num_heads=4, d_hidden=256, num_layers=4
)
MOE = dataclasses.replace(CONFIG, num_experts=8, top_k=2)
MICROBATCHES = 8  # more than the 4 stages of the pipe layouts: 1F1B holds 4, GPipe 8

# Layouts that hold less temp than another whatever the compiler: FSDP than data parallelism
# (it holds a layer's gathered parameters and split gradients where DP holds them all), 1F1B
# than GPipe (S microbatches in flight against M).
BELOW = {"FSDP": "DP", "1F1B": "GPipe"}


def _mesh(**sizes: int) -> dict[str, int]:
    return {lm.DATA: 1, lm.PIPE: 1, lm.MODEL: 1, **sizes}


# name: (config, run options); the example's defaults otherwise (remat none, float32)
LAYOUTS = {
    "DP": (CONFIG, dict(mesh=_mesh(data=8))),
    "FSDP": (CONFIG, dict(mesh=_mesh(data=8), fsdp=True)),
    "TP": (CONFIG, dict(mesh=_mesh(data=2, model=4))),
    "FSDPxTP": (CONFIG, dict(mesh=_mesh(data=2, model=4), fsdp=True)),
    "GPipe": (CONFIG, dict(mesh=_mesh(data=2, pipe=4), schedule="gpipe")),
    "1F1B": (CONFIG, dict(mesh=_mesh(data=2, pipe=4), schedule="1f1b")),
    "ZB-H1": (CONFIG, dict(mesh=_mesh(data=2, pipe=4), schedule="zb-h1")),
    "3D": (CONFIG, dict(mesh=_mesh(data=2, pipe=2, model=2))),
    "EP": (MOE, dict(mesh={lm.DATA: 2, lm.EXPERT: 4, lm.PIPE: 1, lm.MODEL: 1})),
}


def figures(layout: str) -> dict[str, int]:
    """Parameters, optimizer state and temp per device of `layout`'s compiled step."""
    config, options = LAYOUTS[layout]
    run = train_lm.RunConfig(batch_size=16, microbatches=MICROBATCHES, **options)
    step = scale.lower_step(config, run, jax.devices()[:8])
    return {
        "params": scale._shard_bytes(step.arrays),
        "opt_state": scale._shard_bytes(step.opt_state),
        "temp": memory_figures(step.lowered.compile())["temp"],
    }


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text())


def expected_temp(record: dict, layout: str) -> tuple[int, float, str]:
    """The recorded temp to hold `layout` to, its tolerance, and which record it is."""
    by_version = record["temp"]
    if jax.__version__ in by_version:
        return by_version[jax.__version__][layout], TOLERANCE, f"jax {jax.__version__}"
    newest = max(by_version, key=lambda v: tuple(int(p) for p in v.split(".")[:3]))
    return by_version[newest][layout], OTHER_VERSION_TOLERANCE, f"jax {newest} (newest record)"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_memory_per_device_holds(layout, record):
    got = figures(layout)
    for kind in ("params", "opt_state"):
        assert got[kind] == record[kind][layout], (
            f"{layout}: {kind} per device {got[kind]} bytes, recorded {record[kind][layout]}: "
            "the layout's shards changed. If on purpose, rerun `python "
            "tests/test_memory_guard.py` to record the new figures."
        )
    limit, tolerance, which = expected_temp(record, layout)
    assert got["temp"] <= limit * (1 + tolerance), (
        f"{layout}: temp per device {got['temp']} bytes, {got['temp'] / limit:.3f}x the "
        f"{limit} recorded for {which} (allowed {1 + tolerance:.2f}x): a memory regression. "
        "Find the buffer that grew (XLA_FLAGS=--xla_dump_to=DIR writes the buffer "
        "assignment); if the growth is on purpose, rerun `python tests/test_memory_guard.py`."
    )
    if layout in BELOW:
        other, _, which = expected_temp(record, BELOW[layout])
        assert got["temp"] < other, (
            f"{layout}: temp per device {got['temp']} bytes, not below {BELOW[layout]}'s "
            f"{other} recorded for {which}."
        )


def main() -> None:
    """Record this JAX version's figures in `memory_guard.json` (parameters and optimizer
    state are the same under every version)."""
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {"temp": {}}
    measured = {layout: figures(layout) for layout in LAYOUTS}
    for kind in ("params", "opt_state"):
        recorded[kind] = {layout: f[kind] for layout, f in measured.items()}
    recorded["temp"][jax.__version__] = {layout: f["temp"] for layout, f in measured.items()}
    RECORD.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    for layout, f in measured.items():
        print(f"{layout:8s} " + "  ".join(f"{k} {v:>10,d}" for k, v in f.items()))


if __name__ == "__main__":
    main()
