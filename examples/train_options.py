"""The options of `examples/train_lm.py`: `TrainConfig` (every command-line option, read by
tyro, saved as `config.json` and read back by `--config`), `RunConfig` (what one run
trains), the mesh syntax of `--mesh`, the model sizes and `ConfigError`, the one kind of
refusal `train_lm.py` prints after `train_lm.py: error:`. `train_lm.py` imports them; they
live here so that the training script stays one concern."""

import contextlib
import dataclasses
import io
import itertools
import json
import os
import pathlib
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, Literal

import numpy as np
import tyro

from eqpar.planning import parse_bytes

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import data as input_data
import lm

# The help text of `train_lm.py --help`: its own docstring, set by `train_lm.py` on import.
DESCRIPTION: str | None = None


class ConfigError(ValueError):
    """A refusal of the command line: a bad option, options that do not go together
    (`TrainConfig.validate`), sizes the mesh cannot split (`check_sizes`), a checkpoint
    directory that does not fit the run. The message names the options and the fix; `main`
    prints it after `train_lm.py: error:` and exits with status 2 (tyro reports a
    `ValueError` of an option's parser with the option's name)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    mesh: dict[str, int]
    schedule: str = "gpipe"
    microbatches: int = 4  # per step on a pipe axis; without one a step is not cut up
    accumulate: int = 1  # without a pipe axis: the step's gradients summed over this many slices
    repeats: int = 2
    fsdp: bool = False
    remat: str = "none"  # what each layer keeps for the backward pass: none, full, matmuls
    steps: int = 120
    batch_size: int = 16
    lr: float = 3e-3
    optimizer: str = "adam"
    seed: int = 0
    precision: str = "float32"  # an `eqpar.Precision` preset: float32 or bfloat16


# The mesh axes in device order. `context` sits next to `model`: the ring attention's
# key/value blocks and the tensor-parallel reductions are the traffic of every layer.
# `expert` (the experts of `--experts` split over it) follows `data`: the batch rows are
# split over both, as over one data axis.
AXES = (lm.DATA, lm.EXPERT, lm.PIPE, lm.CONTEXT, lm.MODEL)


OPTIONAL_AXES = (lm.EXPERT, lm.CONTEXT)  # in a mesh only where `--mesh` names them


def parse_mesh(text: str, device_count: int) -> dict[str, int]:
    """`data=2,pipe=2,model=2` -> sizes of the axes in `AXES` order: data, pipe and model
    always (missing ones are 1), expert and context only where `text` names them."""
    given: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in AXES or not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"--mesh: expected entries like data=2,pipe=2,model=2, data=2,context=4 or "
                f"data=2,expert=4 with axes {sorted(AXES)}; got {part!r}."
            )
        given[name] = int(value)
    names = [name for name in AXES if name in given or name not in OPTIONAL_AXES]
    sizes = {name: given.get(name, 1) for name in names}
    product = int(np.prod(list(sizes.values())))
    if product != device_count:
        raise ConfigError(
            f"--mesh {text}: the axis sizes multiply to {product} but there are "
            f"{device_count} devices; choose sizes whose product is {device_count}."
        )
    return sizes


def format_mesh(sizes: dict[str, int]) -> str:
    """`{"data": 2, "pipe": 2, "model": 2}` -> `data=2,pipe=2,model=2` (the `--mesh` syntax)."""
    return ",".join(f"{name}={size}" for name, size in sizes.items())


# How close `--check` requires the parallel run to be to the one-device run, with plain SGD:
# float32 rounding gives about 4e-7 for both after 120 steps of the default model.
CHECK_TOLERANCE = 1e-5


# The same under bfloat16 compute: both runs round to bfloat16 (2**-9 relative) but sum over
# devices in other orders; after 120 steps of the default model (data=2,pipe=2,model=2) the
# losses differ by 2.1e-3 (relative) and the parameters by 6.9e-3.
CHECK_TOLERANCE_BFLOAT16 = 3e-2


SIZES = {
    "small": lm.LMConfig(),
    "tiny": lm.LMConfig(
        vocab_size=32, seq_len=16, d_model=32, num_heads=8, d_hidden=64, num_layers=4
    ),
}


def positive_int(text: str) -> int:
    """A count of at least 1 read from the command line (`ConfigError` saying what came)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A learning rate read from the command line: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or not np.isfinite(value):
        raise ConfigError(f"must be a number above 0, got {text!r}")
    return value


def _read_with(parse: Callable[[str], Any], metavar: str) -> Any:
    """How tyro reads an option of one word with `parse` (whose `ValueError` tyro reports
    with the option's name)."""
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar=metavar,
        instance_from_str=lambda words: parse(words[0]),
        is_instance=lambda value: isinstance(value, int | float),
        str_from_instance=lambda value: [str(value)],
    )


PositiveInt = Annotated[int, _read_with(positive_int, "N")]


PositiveFloat = Annotated[float, _read_with(positive_float, "FLOAT")]


Schedule = Literal["gpipe", "circular", "1f1b", "zb-h1", "zb-v", "dualpipe-v"]


Precision = Literal["float32", "bfloat16"]


assert typing.get_args(Schedule) == lm.SCHEDULES and typing.get_args(Precision) == lm.PRECISIONS


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every option of the command line (`main` parses it with tyro: `--batch-size` is
    `batch_size`). `save_config` writes it to a file and `--config FILE` reads it back, so
    a run is reproducible from the `config.json` it writes beside its outputs."""

    mesh: str | None = None
    """axis sizes whose product is the device count, e.g. data=2,pipe=2,model=2; missing
    axes are 1; a context axis (e.g. data=2,context=4) splits every sequence over its
    devices, by ring attention (--seq-len must divide by 2 x context); unset:
    data=2,pipe=2,model=2 on 8 devices, else data=<count>"""
    plan: Literal["auto"] | None = None
    """auto: pick the mesh, --fsdp and --remat by eqpar.search before compiling (the
    fastest modelled step whose predicted peak fits --memory-per-device) and print why;
    not with --mesh, --fsdp, --remat, --schedule or --resume"""
    memory_per_device: str | None = None
    """device memory for --plan auto and --dry-run, e.g. 16GiB or 80GB"""
    dry_run: bool = False
    """print the step's predicted memory per device and collective bytes (eqpar.estimate:
    traced, not compiled) and exit without training"""
    schedule: Schedule | None = None
    """pipeline schedule on the pipe axis (unset: gpipe); refused without a pipe axis"""
    microbatches: PositiveInt = 4
    """microbatches per step on the pipe axis; without one a step is not cut up"""
    accumulate: PositiveInt = 1
    """without a pipe axis: accumulate the step's gradients over this many slices of each
    device's rows (one slice's activations held at a time, the same update as the whole
    batch); with a pipe axis the pipeline cuts the batch into --microbatches instead"""
    repeats: PositiveInt = 2
    """stages per device (circular schedule; zb-v and dualpipe-v run 2)"""
    fsdp: bool = False
    """also shard parameters over data"""
    remat: Literal["none", "full", "matmuls"] = "none"
    """recompute each layer's activations in the backward pass: 'full' keeps only its input
    and 'matmuls' also its matmul outputs"""
    steps: PositiveInt = 120
    """training steps"""
    batch_size: PositiveInt = 16
    """sequences per step (global)"""
    lr: PositiveFloat = 3e-3
    """Adam's learning rate; plain SGD uses 30 times it"""
    optimizer: Literal["adam", "sgd"] | None = None
    """adam (with warmup and clipping), or plain SGD with momentum (unset: adam, and sgd
    with --check)"""
    experts: PositiveInt | None = None
    """a mixture of E experts in every block instead of its MLP (eqpar.nn.MixtureOfExperts,
    each expert the dense MLP's kind, dropless), with the load-balancing and router z
    auxiliary losses of every block added to the loss; an expert axis in --mesh (e.g.
    data=2,expert=4) splits the experts over its devices (the batch rows split over data and
    expert), a model axis each expert's hidden units; not with a pipe axis (unset: a dense
    MLP)"""
    top_k: PositiveInt | None = None
    """experts per token (with --experts; unset: 2); refused without --experts"""
    seed: int = 0
    """initialization and data order"""
    precision: Precision = "float32"
    """the compute dtype (eqpar.Precision): bfloat16 computes the forward and backward passes
    and their collectives in bfloat16, keeping float32 parameters, optimizer state, layer
    norms, softmax and loss"""
    check: bool = False
    """train the same steps again on one device with plain SGD under the same --precision
    and print PASS or FAIL: losses (relative) and parameters within 1e-05 (bfloat16: 3e-02);
    exit status 1 on FAIL"""
    allow_nonfinite: bool = False
    """train on after a step whose loss, gradient norm or updated parameters are not finite
    (NaN or inf); by default the run stops there with exit status 1, keeping the last finite
    checkpoint. A non-finite state is never saved either way"""
    size: Literal["small", "tiny"] = "small"
    """model size"""
    seq_len: PositiveInt | None = None
    """tokens per sequence (unset: the --size's: 32 for small, 16 for tiny)"""
    out: pathlib.Path = pathlib.Path("outputs")
    """where the loss curve and schedule pictures, config.json, tensorboard/ and (without
    a --ckpt-dir) metrics.jsonl go"""
    progress: bool = True
    """show the steps: a progress bar on a terminal, a log line every --log-every steps in a
    log (--no-progress: neither)"""
    log_every: PositiveInt = 10
    """when stdout is not a terminal (a log file, CI): a line every N steps instead of a
    progress bar"""
    json: pathlib.Path | None = None
    """write a summary (losses, timings, memory) here"""
    metrics: pathlib.Path | None = None
    """the JSONL file of a start-up record and one record per step (unset: metrics.jsonl
    in the --ckpt-dir, where a resumed run goes on with it, else in --out)"""
    tensorboard: bool = True
    """TensorBoard events in --out/tensorboard where tensorboardX is installed"""
    ckpt_dir: pathlib.Path | None = None
    """checkpoint directory (also gets config.json and metrics.jsonl); one that holds
    another run's steps needs --resume"""
    save_every: PositiveInt = 20
    """checkpoint every N steps"""
    keep: PositiveInt = 3
    """checkpoints to keep"""
    resume: bool = False
    """continue from the latest checkpoint in --ckpt-dir (refused where there is none, or
    where its config.json records another --size, --seq-len, --experts, --top-k,
    --optimizer or --data)"""
    config: pathlib.Path | None = None
    """read the options from this file (a config.json written by a run); options given
    beside it override the file's"""
    processes: PositiveInt = 1
    """run as N processes on this machine (127.0.0.1), each with 8/N simulated CPU devices
    (EQPAR_NUM_CPU_DEVICES sets another count), started and watched by examples/launch.py,
    their lines prefixed [p<id>]; inside a job, its process count"""
    distributed: bool = False
    """join a multi-process job started by SLURM, mpirun or by hand: eqpar.initialize()
    reads EQPAR_COORDINATOR_ADDRESS, EQPAR_NUM_PROCESSES and EQPAR_PROCESS_ID, or else
    JAX's cluster detection (implied when those variables are set)"""
    timeout: PositiveFloat = 3600.0
    """with --processes: seconds each process may run before it is killed"""
    verbose: bool = False
    """with --processes: also show JAX's and Gloo's start-up chatter"""
    data: pathlib.Path | None = None
    """train on the tokenized corpus in this directory (ArrayRecord files read with Grain,
    each process reading only its own rows; write the demo corpus with python
    examples/data.py DIR --vocab-size V) instead of generated text"""
    log_examples: pathlib.Path | None = None
    """append each step's loss and example ids to DIR/process<P>.jsonl"""

    def validate(self, device_count: int) -> None:
        """Refuse options that do not go together (`ConfigError` naming them and the fix);
        sizes the mesh cannot split are `check_sizes`'s."""
        if self.resume and self.ckpt_dir is None:
            raise ConfigError("--resume needs --ckpt-dir DIR (the directory to resume from)")
        self.memory_bytes()  # a size that does not parse is refused here
        if self.plan == "auto":
            chosen = [
                flag
                for flag, given in (
                    ("--mesh", self.mesh is not None),
                    ("--fsdp", self.fsdp),
                    ("--remat", self.remat != "none"),
                    ("--schedule", self.schedule is not None),
                    ("--resume", self.resume),
                )
                if given
            ]
            if chosen:
                raise ConfigError(
                    f"--plan auto chooses the layout itself; {', '.join(chosen)} would "
                    "override its choice: leave them out, or drop --plan auto"
                )
            if self.memory_per_device is None:
                raise ConfigError(
                    "--plan auto needs --memory-per-device SIZE (e.g. 16GiB): the memory "
                    "each device has, which the plan must fit"
                )
        if self.top_k is not None and self.experts is None:
            raise ConfigError(
                f"--top-k {self.top_k} chooses among the experts of --experts, and there is no "
                f"--experts: add --experts E (E at least {self.top_k}) for a mixture of "
                "experts, or leave --top-k out"
            )
        if self.check and self.optimizer == "adam":
            # A config.json names the optimizer its run resolved: it cannot be left out there.
            fix = (
                f"pass --optimizer sgd (--config {self.config} says adam)"
                if self.config is not None
                else "leave out --optimizer adam (--check then trains with sgd)"
            )
            raise ConfigError(
                f"--check compares with one device within {CHECK_TOLERANCE:.0e}, which holds "
                "for plain SGD only: Adam turns float32 rounding differences into full-size "
                f"updates. To check, {fix}."
            )
        if self.plan == "auto":
            return  # the mesh is the plan's to choose; each candidate is checked with it
        mesh = parse_mesh(self.mesh or default_mesh(device_count), device_count)
        if self.accumulate > 1 and mesh[lm.PIPE] > 1:
            raise ConfigError(
                f"--accumulate {self.accumulate} cuts a step without a pipe axis; --mesh "
                f"{self.mesh or format_mesh(mesh)} has one, whose pipeline already cuts the "
                f"batch into --microbatches ({self.microbatches}): use --microbatches "
                f"{self.microbatches * self.accumulate} instead, or drop the pipe axis"
            )
        if self.schedule is not None and mesh[lm.PIPE] == 1:
            example = f" (e.g. --mesh data={device_count // 2},pipe=2)" * (device_count % 2 == 0)
            raise ConfigError(
                f"--schedule {self.schedule} needs a pipe axis in --mesh: without one every "
                f"device holds every layer and there is no pipeline to schedule; add a pipe "
                f"axis{example} or leave --schedule out"
            )

    def memory_bytes(self) -> int | None:
        """`--memory-per-device` in bytes (`ConfigError` where it does not parse)."""
        if self.memory_per_device is None:
            return None
        try:
            return parse_bytes(self.memory_per_device)
        except ValueError:
            raise ConfigError(
                f"--memory-per-device {self.memory_per_device}: give a size such as 16GiB, "
                "80GB or a number of bytes"
            ) from None

    def resolved(self, device_count: int) -> "TrainConfig":
        """The options with every unset one that the run fills in filled in as it is (mesh,
        schedule, optimizer, sequence length), so that a saved file says what ran."""
        mesh = parse_mesh(self.mesh or default_mesh(device_count), device_count)
        return dataclasses.replace(
            self,
            mesh=format_mesh(mesh),
            schedule=self.schedule or ("gpipe" if mesh[lm.PIPE] > 1 else None),
            optimizer=self.optimizer or ("sgd" if self.check else "adam"),
            seq_len=self.seq_len or SIZES[self.size].seq_len,
            top_k=self.top_k or (DEFAULT_TOP_K if self.experts is not None else None),
        )

    def run_config(self, device_count: int) -> RunConfig:
        """The `RunConfig` of these options."""
        options = self.resolved(device_count)
        assert options.mesh is not None and options.optimizer is not None
        return RunConfig(
            mesh=parse_mesh(options.mesh, device_count),
            schedule=options.schedule or "gpipe",
            microbatches=options.microbatches,
            accumulate=options.accumulate,
            repeats=options.repeats,
            fsdp=options.fsdp,
            remat=options.remat,
            steps=options.steps,
            batch_size=options.batch_size,
            lr=options.lr,
            optimizer=options.optimizer,
            seed=options.seed,
            precision=options.precision,
        )

    def model_config(self) -> lm.LMConfig:
        """The model's sizes: the `--size`'s, with `--seq-len` and `--experts` applied."""
        config = SIZES[self.size]
        if self.seq_len is not None:
            config = dataclasses.replace(config, seq_len=self.seq_len)
        if self.experts is not None:
            top_k = DEFAULT_TOP_K if self.top_k is None else self.top_k
            config = dataclasses.replace(config, num_experts=self.experts, top_k=top_k)
        return config


DEFAULT_TOP_K = 2  # experts per token of --experts without --top-k


def default_mesh(device_count: int) -> str:
    """The mesh of a run without `--mesh`: 3D on 8 devices, else all data."""
    return "data=2,pipe=2,model=2" if device_count == 8 else f"data={device_count}"


CONFIG_FILE = "config.json"  # what a run writes into --out and --ckpt-dir


# How to read the file, whether to resume and how to join a job: not what runs.
_NOT_SAVED = ("config", "resume", "distributed")


def save_config(options: TrainConfig, path: pathlib.Path) -> pathlib.Path:
    """Write `options` to `path` as JSON (through a rename, so never half written); `--config
    path` reads it back. `resume` and `config` are left out: a file says what to run.

    **Returns:** `path`."""
    values = {
        field.name: getattr(options, field.name)
        for field in dataclasses.fields(options)
        if field.name not in _NOT_SAVED
    }
    text = json.dumps(
        {name: str(v) if isinstance(v, pathlib.Path) else v for name, v in values.items()},
        indent=2,
    )
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text + "\n")
    os.replace(partial, path)
    return path


def config_arguments(path: pathlib.Path) -> list[str]:
    """The options saved in `path` as the command line they stand for (`--steps 20 --fsdp
    ...`), so that tyro reads a file's values as it reads typed ones. Each value is first
    checked against its option's type (`ConfigError` naming the file, the entry and the
    option)."""
    try:
        saved = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--config {path}: cannot read it ({error})") from None
    known = {field.name for field in dataclasses.fields(TrainConfig)} - set(_NOT_SAVED)
    if not isinstance(saved, dict) or set(saved) - known:
        unknown = sorted(set(saved) - known) if isinstance(saved, dict) else saved
        raise ConfigError(
            f"--config {path}: expected a JSON object of the options {sorted(known)} (the "
            f"config.json a run writes); got {unknown!r}"
        )
    if saved.get("experts") is None and saved.get("top_k") == DEFAULT_TOP_K:
        del saved["top_k"]  # written before --top-k was refused without --experts: its default
    hints = typing.get_type_hints(TrainConfig, include_extras=True)
    problems = [
        f'"{name}": {json.dumps(value)} is not {expected} (for {_flag(name)})'
        for name, value in saved.items()
        if (expected := _not_a(value, hints[name])) is not None
    ]
    if problems:
        raise ConfigError(f"--config {path}: " + "; ".join(problems))
    words: list[str] = []
    for name, value in saved.items():
        if isinstance(value, bool):
            words.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        else:
            words += [_flag(name), "None" if value is None else str(value)]
    return words


def _flag(name: str) -> str:
    """The command-line flag of the option `name` (`batch_size` -> `--batch-size`)."""
    return "--" + name.replace("_", "-")


def _not_a(value: Any, hint: Any) -> str | None:
    """What a JSON `value` is not, for an option of type `hint` (e.g. `"a bool (true or
    false)"`), or `None` where it fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (rest,) = [arg for arg in args if arg is not type(None)]
        return _not_a(value, rest)
    if value is None:
        return "a value (null is not allowed here)"
    if origin is Annotated:  # PositiveInt, PositiveFloat
        base = args[0]
        if isinstance(value, bool) or not isinstance(value, int if base is int else int | float):
            return "a positive integer" if base is int else "a number above 0"
        parse = positive_int if base is int else positive_float
        try:
            parse(str(value))
        except ConfigError:
            return "a positive integer" if base is int else "a number above 0"
        return None
    if origin is Literal:
        return None if value in args else "one of " + ", ".join(json.dumps(a) for a in args)
    if hint is bool:
        return None if isinstance(value, bool) else "a bool (true or false)"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint in (str, pathlib.Path):
        return None if isinstance(value, str) else "a string"
    return None


def parse_options(argv: Sequence[str] | None, device_count: int | None = None) -> TrainConfig:
    """The options of the command line `argv` (default `sys.argv[1:]`): with `--config FILE`,
    the file's options first, then `argv`'s over them; with `device_count`, validated
    (`TrainConfig.validate`). A usage error exits with status 2 and the reason on stderr
    after `train_lm.py: error:`, as argparse's do. Without `device_count` it touches no
    device (`main`: a launcher starts its processes, and a process joins its job, before JAX
    picks its devices)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with _usage_errors():
        options = _read_options(argv)
        if options.config is not None:
            words = [*config_arguments(options.config), *argv]
            try:
                options = _read_options(words)
            except ConfigError as error:  # `argv` alone was fine: the file's values are not
                raise ConfigError(f"--config {options.config}: {error}") from None
        if device_count is not None:
            options.validate(device_count)
    return options


_PROG = "train_lm.py"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours, where tyro writes to a terminal


def _read_options(words: list[str]) -> TrainConfig:
    """`TrainConfig` from the command line `words` through tyro; its parse errors as one
    `ConfigError` (tyro draws them in a box on stderr: its text, unboxed, becomes the
    message, with a hint where a flag was given a value)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            options = tyro.cli(TrainConfig, args=words, prog=_PROG, description=DESCRIPTION)
    except SystemExit as exit_:
        if exit_.code in (0, None):  # --help
            raise
        raise ConfigError(_unboxed(captured.getvalue(), words)) from None
    sys.stderr.write(captured.getvalue())  # tyro's warnings, if any
    return options


def _unboxed(text: str, words: list[str]) -> str:
    """tyro's error box `text` as plain lines: its first part (the error) on one line, the
    rest (help on the option) indented below. tyro draws the box with UTF-8 characters where
    stdout's encoding is UTF-8, else with a title line and dashes."""
    lines = [line for line in (_ANSI.sub("", raw).rstrip() for raw in text.splitlines()) if line]
    if lines and not lines[0].lstrip().startswith("╭"):
        lines = lines[1:]  # the title, on a line of its own
    parts: list[list[str]] = [[]]
    for line in lines:
        inner = line.strip()
        if inner[:1] in ("╭", "╰"):  # the top edge (with the title) and the bottom edge
            continue
        if inner.startswith("│") and inner.endswith("│"):
            line = inner[1:-1].rstrip()
        if set(line.strip()) <= {"─", "-"}:  # a rule between parts
            parts.append([])
        else:
            parts[-1].append(line)
    indent = min((len(line) - len(line.lstrip()) for part in parts for line in part), default=0)
    parts = [[line[indent:] for line in part] for part in parts]
    parts = [part for part in parts if part]
    if not parts:
        return f"cannot read the options {' '.join(words)!r}"
    message = " ".join(line.strip() for line in parts[0])
    if message.startswith("Unrecognized options:"):
        flags = {_flag(f.name) for f in dataclasses.fields(TrainConfig) if f.type is bool}
        given = [w for w, after in itertools.pairwise(words) if w in flags and after[:2] != "--"]
        message += "".join(f"; {flag} takes no value: write {flag} or --no-{flag[2:]}"
                           for flag in given)  # fmt: skip
    rest = [f"  {line}" for part in parts[1:] for line in part]
    return "\n".join([message, *rest])


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """A `ConfigError` or `data.DataError` inside exits with status 2 and the reason on
    stderr, after `train_lm.py: error:` (every refusal of the example's options)."""
    try:
        yield
    except (ConfigError, input_data.DataError) as error:
        print(f"{_PROG}: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
