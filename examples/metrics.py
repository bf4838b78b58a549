"""What a training run reports, and where: the console, a JSONL file and TensorBoard.

`train_lm.py` reports through two channels, both from this module:

- **messages** (what it is doing: compiling, memory figures, checkpoints saved and restored)
  go through Python's `logging`, to the logger `LOGGER` (`"train_lm"`); `console_logging()`
  sends them to stdout through a `rich` console, one whole line each;
- **numbers** (one record per step: loss, learning rate, gradient norm, tokens/s, model FLOPs
  utilisation, and one start-up record of memory per device) go to a `Recorder`, which hands
  each record to its writers: `ConsoleWriter` (a `rich` progress bar on a terminal, else a log
  line every `log_every` steps), `JsonlWriter` (one JSON object per line) and
  `TensorBoardWriter` (tensorboardX, where installed).

Nothing here knows the model: `memory_figures` reads a compiled program and the arrays it
takes, `peak_flops` a device. The figures are per device: what one device holds.
"""

import contextlib
import json
import logging
import math
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import rich.console
import rich.progress

LOGGER = "train_lm"
log = logging.getLogger(LOGGER)

# One console for log lines and the progress bar, so that lines print above the bar. With no
# `file` it writes to whatever `sys.stdout` is when it writes (a test's capture included); no
# markup, highlighting or wrapping: a message is printed as one line, as written.
CONSOLE = rich.console.Console(soft_wrap=True, markup=False, highlight=False, emoji=False)


class _ConsoleHandler(logging.Handler):
    """A `logging` handler that prints each message through `CONSOLE`."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            CONSOLE.print(self.format(record))
        except Exception:  # logging's own rule: a failed report never stops the program
            self.handleError(record)


@contextlib.contextmanager
def console_logging(level: int = logging.INFO) -> Iterator[logging.Logger]:
    """Print `LOGGER`'s messages on stdout (through `CONSOLE`) while the block runs.

    **Arguments:**

    - `level`: the least severe level printed.

    **Returns:** a context manager giving the logger; on leaving it the handler goes again,
    so calling a program's `main` twice (as tests do) prints each message once.
    """
    handler = _ConsoleHandler(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(LOGGER)
    before = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]


# --- memory and FLOP/s -------------------------------------------------------------------------


def per_device_bytes(tree: Any) -> int:
    """The bytes of `tree`'s arrays that one device holds: each array's block under its
    sharding (the whole array where it is replicated). Abstract arrays with a sharding
    (`jax.ShapeDtypeStruct`) count the same."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "sharding") or not hasattr(leaf, "dtype"):
            continue
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def memory_figures(
    compiled: Any, *, parameters: Any, optimizer_state: Any, batch: Any
) -> dict[str, int]:
    """Memory per device of a compiled training step, in bytes.

    **Arguments:**

    - `compiled`: the step, compiled (`jax.jit(...).lower(...).compile()`, or the same of an
      `eqx.filter_jit` function).
    - `parameters`, `optimizer_state`, `batch`: what it takes (pytrees of arrays; other
      leaves are skipped).

    **Returns:** `parameters`, `optimizer_state` and `batch`: the bytes one device holds of
    each (their sum is the step's `argument`); `argument`, `output`, `temp` (the step's own
    buffers: activations, gradients, collectives' buffers) and `alias` (outputs written into
    donated arguments) exactly as `compiled.memory_analysis()` states them; and `peak`:
    argument + output + temp - alias.

    ```python
    import jax, jax.numpy as jnp
    from metrics import memory_figures
    x = jnp.ones((4, 4))
    compiled = jax.jit(lambda p, s, b: (p * s * b).sum()).lower(x, x, x).compile()
    figures = memory_figures(compiled, parameters=x, optimizer_state=x, batch=x)
    assert figures["argument"] == 3 * 64 == figures["parameters"] * 3
    ```
    """
    inner = getattr(compiled, "compiled", compiled)  # `eqx.filter_jit`'s wraps JAX's
    stats = inner.memory_analysis()
    figures = {
        "parameters": per_device_bytes(parameters),
        "optimizer_state": per_device_bytes(optimizer_state),
        "batch": per_device_bytes(batch),
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
    }
    figures["peak"] = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
    return figures


def format_bytes(count: float) -> str:
    """`1536` -> `1.50 KiB`: bytes in binary units, three figures or more."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            if unit == "B":
                return f"{count:.0f} B"
            digits = 2 if abs(count) < 10 else 1 if abs(count) < 100 else 0
            return f"{count:.{digits}f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def format_memory(figures: Mapping[str, int]) -> str:
    """The start-up line of `memory_figures`, e.g. `memory per device: parameters 1.2 MiB,
    optimizer state 2.4 MiB, compiled temp 3.1 MiB (peak 7.0 MiB)`."""
    return (
        f"memory per device: parameters {format_bytes(figures['parameters'])}, optimizer state "
        f"{format_bytes(figures['optimizer_state'])}, compiled temp "
        f"{format_bytes(figures['temp'])} (peak {format_bytes(figures['peak'])}, "
        f"memory_analysis of the compiled step)"
    )


# Dense peak FLOP/s of one device by `jax.Device.device_kind` (the first name contained in the
# kind wins, so longer names come first), for the compute dtypes of `--precision`: bfloat16
# matmuls, and float32 ones as XLA runs them by default (TF32 tensor cores on NVIDIA GPUs;
# bfloat16 passes on TPUs). From the vendors' data sheets, without sparsity.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756e12, "float32": 378e12},
    "H100 NVL": {"bfloat16": 835e12, "float32": 418e12},
    "H100": {"bfloat16": 989e12, "float32": 495e12},  # SXM
    "H200": {"bfloat16": 989e12, "float32": 495e12},
    "GH200": {"bfloat16": 989e12, "float32": 495e12},
    "B200": {"bfloat16": 2250e12, "float32": 1100e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "L4": {"bfloat16": 121e12, "float32": 60e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},  # v5e
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v5": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v6 lite": {"bfloat16": 918e12, "float32": 918e12},  # v6e (Trillium)
}


def peak_flops(device: Any, precision: str) -> float | None:
    """The peak FLOP/s of `device` for `precision` (`"float32"` or `"bfloat16"`) from
    `PEAK_FLOPS`, or `None` where it is not known: CPU devices (simulated ones share the
    host's cores, so a utilisation would mean nothing) and kinds not in the table."""
    if device.platform == "cpu":
        return None
    kind = str(device.device_kind)
    for name, peaks in PEAK_FLOPS.items():
        if name in kind:
            return peaks.get(precision)
    return None


def utilisation_note(device: Any, precision: str) -> str:
    """Why there is no model FLOPs utilisation for `device` (`""` where there is one)."""
    if device.platform == "cpu":
        return "not meaningful on simulated CPU devices"
    if peak_flops(device, precision) is None:
        return f"the peak FLOP/s of {device.device_kind!r} is not in metrics.PEAK_FLOPS"
    return ""


# --- writers -----------------------------------------------------------------------------------


def format_step(record: Mapping[str, Any], total: int) -> str:
    """A step's record as one log line, e.g. `step 20/120  loss 2.3456  tokens/s 1234  lr
    3.00e-03  grad norm 0.412  MFU 31.2%`, then any further fields' `extra` text."""
    rate = record.get("tokens_per_second")
    line = (
        f"step {record['step']}/{total}  loss {record['loss']:.4f}  tokens/s "
        f"{'-' if rate is None else f'{rate:.0f}'}  lr {record['learning_rate']:.2e}  "
        f"grad norm {record['grad_norm']:.3g}"
    )
    if record.get("mfu") is not None:
        line += f"  MFU {100 * record['mfu']:.1f}%"
    if record.get("extra"):
        line += f"  {record['extra']}"
    return line


class ConsoleWriter:
    """Steps on the console: a `rich` progress bar when stdout is a terminal, otherwise a log
    line (through `logging`) every `every` steps and at the last (a bar redraws itself in
    place, which fills a log file with partial lines)."""

    def __init__(self, total: int, *, every: int = 10, start: int = 0):
        self.total, self.every, self.start = total, every, start
        self.bar: rich.progress.Progress | None = None
        self.task: Any = None

    def startup(self, record: Mapping[str, Any]) -> None:
        if CONSOLE.is_terminal:
            self.bar = rich.progress.Progress(
                rich.progress.TextColumn("training"),
                rich.progress.BarColumn(),
                rich.progress.MofNCompleteColumn(),
                rich.progress.TimeRemainingColumn(),
                rich.progress.TextColumn("{task.fields[status]}"),
                console=CONSOLE,
            )
            self.task = self.bar.add_task(
                "training", total=self.total, completed=self.start, status=""
            )
            self.bar.start()

    def step(self, record: Mapping[str, Any]) -> None:
        step = record["step"]
        if self.bar is not None:
            status = format_step(record, self.total).partition("  ")[2]
            self.bar.update(self.task, completed=step, status=status)
        elif step % self.every == 0 or step == self.total:
            log.info(format_step(record, self.total))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it (NumPy and JAX scalars as Python numbers)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and np.ndim(value) == 0:
        return value.item()
    return value


def strict(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` as strict JSON can hold it (RFC 8259 has no NaN or infinity): NumPy and JAX
    scalars as Python numbers, and each non-finite number as `null`, its key (`/`-joined
    where nested, e.g. `memory/temp`) listed under `"nonfinite"` (after the names `record`
    already lists there).

    ```python
    from metrics import strict
    assert strict({"step": 3, "loss": float("nan"), "grad_norm": float("inf")}) == {
        "step": 3, "loss": None, "grad_norm": None, "nonfinite": ["loss", "grad_norm"]
    }
    ```
    """
    names: list[str] = list(record.get("nonfinite", []))

    def clean(value: Any, name: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            names.append(name)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{name}/{k}" if name else k) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, name) for v in value]
        return value

    cleaned = clean(_plain(record), "")
    if names:
        cleaned["nonfinite"] = list(dict.fromkeys(names))
    return cleaned


def strict_json(record: Mapping[str, Any]) -> str:
    """`record` as one line of strict JSON (`strict`: non-finite numbers as `null`, their
    keys under `"nonfinite"`), which any JSON reader accepts."""
    return json.dumps(strict(record), allow_nan=False)


class JsonlWriter:
    """Records as JSON objects, one a line, flushed as written, so that a run killed midway
    leaves every finished step's line. The lines are strict JSON (`strict_json`): a NaN or
    infinite value is written as `null` and its name listed under `"nonfinite"`. With
    `keep_until`, the file is first cut to the lines of steps up to that one (a resumed run
    continues the file of the run it resumes)."""

    def __init__(self, path: pathlib.Path, *, keep_until: int | None = None):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [] if keep_until is None else read_records(self.path, upto=keep_until)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(strict_json(r) + "\n" for r in kept))
        os.replace(partial, self.path)  # a kill midway leaves the earlier file whole
        self.file = self.path.open("a")

    def startup(self, record: Mapping[str, Any]) -> None:
        self._write({"event": "start", **record})

    def step(self, record: Mapping[str, Any]) -> None:
        self._write({key: value for key, value in record.items() if key != "extra"})

    def _write(self, record: Mapping[str, Any]) -> None:
        self.file.write(strict_json(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_records(path: pathlib.Path, *, upto: int | None = None) -> list[dict[str, Any]]:
    """The records of a `JsonlWriter` file (`[]` if there is none): with `upto`, only those of
    steps up to `upto`. A last line cut short by a kill is skipped."""
    try:
        lines = pathlib.Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if upto is None or record.get("step", 0) <= upto:
            records.append(record)
    return records


def step_losses(records: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """`{step: loss}` of the step records among `records` (the last one of a step wins; a
    loss written as `null`, not finite, reads as NaN)."""
    return {
        int(r["step"]): math.nan if r["loss"] is None else float(r["loss"])
        for r in records
        if "loss" in r
    }


class TensorBoardWriter:
    """Scalars for TensorBoard (tensorboardX's `SummaryWriter`): each step's numbers under
    `train/`, the start-up memory figures under `memory/` at the start step."""

    def __init__(self, logdir: pathlib.Path):
        from tensorboardX import SummaryWriter

        self.logdir = pathlib.Path(logdir)
        self.writer = SummaryWriter(str(self.logdir))

    def startup(self, record: Mapping[str, Any]) -> None:
        for name, value in record.get("memory", {}).items():
            self.writer.add_scalar(f"memory/{name}_bytes", value, record.get("step", 0))

    def step(self, record: Mapping[str, Any]) -> None:
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{name}", value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_available() -> bool:
    """Whether tensorboardX is installed (`pip install -e ".[tensorboard]"`)."""
    import importlib.util

    return importlib.util.find_spec("tensorboardX") is not None


class Recorder:
    """Hands each record to every writer: `startup(record)` once, `step(record)` per step.

    **Arguments:**

    - `writers`: objects with `startup`, `step` and `close` methods (`ConsoleWriter`,
      `JsonlWriter`, `TensorBoardWriter`, or your own: a W&B one is three lines).
    """

    def __init__(self, writers: Sequence[Any] = ()):
        self.writers = list(writers)

    def startup(self, record: Mapping[str, Any]) -> None:
        for writer in self.writers:
            writer.startup(record)

    def step(self, record: Mapping[str, Any]) -> None:
        for writer in self.writers:
            writer.step(record)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
