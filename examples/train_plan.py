"""Will the run fit, and which plan: `examples/train_lm.py --dry-run` and `--plan auto`.

The run's training step is built from shapes and shardings only (`abstract_step`: the model
and the optimizer state `eval_shape`d, nothing allocated) and `eqpar.estimate` reads per
device what it needs from the traced step, without compiling. `--dry-run` prints that and
exits; `--plan auto` hands `eqpar.search` the layouts the device count allows (mesh
factorizations, FSDP, remat) and trains with the fastest that fits `--memory-per-device`.
`benchmarks/scale.py` and `benchmarks/planner.py` build their abstract steps here too.
"""

import dataclasses
import json
import pathlib
import sys
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqpar
from eqpar.distributions import match_param_specs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lm
from train_options import ConfigError, RunConfig, TrainConfig, format_mesh
from train_steps import (
    build_model,
    build_step,
    check_sizes,
    make_mesh,
    make_optimizer,
    storage_specs,
)

DEVICE = "h100-sxm"  # the step-time model's device figures (eqpar.planning.DEVICES)


class AbstractStep(NamedTuple):
    """A run's training step from shapes and shardings (`abstract_step`)."""

    lowered: Any  # the step function, (tokens, arrays, opt_state) -> ...; lowered by callers
    model: Any  # the abstract model, each leaf a ShapeDtypeStruct with its sharding
    arrays: Any  # the model's array part
    opt_state: Any  # the abstract optimizer state, likewise
    specs: Any  # the model's storage specs
    arguments: tuple[Any, Any, Any]  # the step's abstract (tokens, arrays, opt_state)


def _is_abstract(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def with_shardings(tree: Any, shardings: Any) -> Any:
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


def abstract_step(config: lm.LMConfig, run: RunConfig, devices: Any) -> AbstractStep:
    """`run`'s training step for `config` as `train_lm.py` builds it (`build_model`,
    `storage_specs`, `build_step`), from shapes and shardings only: the model and the
    optimizer state are `eval_shape`d, nothing is allocated. `lowered` is the step as a
    function of `arguments` (the model's static part closed over), ready for `jax.jit(...,
    donate_argnums=(1, 2))` or `eqpar.estimate`."""
    check_sizes(config, run)
    mesh = make_mesh(run.mesh, devices)
    optimizer = make_optimizer(run)
    model = eqx.filter_eval_shape(build_model, config, run, mesh)
    specs = storage_specs(model, mesh, run.fsdp)
    model = with_shardings(model, eqpar.named_shardings(specs, mesh))

    def inexact(leaf: Any) -> bool:
        return _is_abstract(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)

    opt_state = jax.eval_shape(optimizer.init, eqx.filter(model, inexact))
    opt_specs = match_param_specs(opt_state, model, specs)
    opt_state = with_shardings(opt_state, eqpar.named_shardings(opt_specs, mesh))
    step = build_step(model, mesh, run, optimizer)
    # The step is an `eqx.filter_jit`, which takes only arrays as traced arguments: a function
    # of the abstract leaves, with the model's static part closed over.
    arrays, static = eqx.partition(model, _is_abstract)

    def step_of_arrays(tokens: jax.Array, arrays: Any, opt_state: Any) -> Any:
        model, opt_state, loss = step(tokens, eqx.combine(arrays, static), opt_state)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    tokens = jax.ShapeDtypeStruct(
        (run.batch_size, config.seq_len + 1),
        jnp.int32,
        sharding=NamedSharding(mesh.jax_mesh, P(lm.DATA)),
    )
    arguments = (tokens, arrays, opt_state)
    return AbstractStep(step_of_arrays, model, arrays, opt_state, specs, arguments)


def estimate_run(config: lm.LMConfig, run: RunConfig, devices: Any) -> eqpar.Estimate:
    """`eqpar.estimate` of `run`'s training step (nothing compiled, nothing allocated)."""
    step = abstract_step(config, run, devices)
    return eqpar.estimate(step.lowered, *step.arguments, donate_argnums=(1, 2))


def describe_estimate(estimate: eqpar.Estimate, memory: int | None) -> str:
    """The estimate as lines for the console: memory per device (and whether it fits) and
    the collective bytes per step by kind and axes."""
    mib = 2**20
    tokens, params, optimizer = estimate.arguments
    verdict = ""
    if memory is not None:
        fits = "fits" if estimate.peak <= memory else "DOES NOT FIT"
        verdict = f" of {memory / mib:.0f} MiB: {fits}"
    lines = [
        f"per device: parameters {params / mib:.1f} MiB, optimizer state {optimizer / mib:.1f} "
        f"MiB, batch {tokens / mib:.2f} MiB, temporaries (activations, gradients) "
        f"{estimate.temp / mib:.1f} MiB; peak {estimate.peak / mib:.1f} MiB{verdict}"
    ]
    for (kind, axes), amount in sorted(estimate.collectives.items()):
        lines.append(f"  {kind} over {','.join(axes)}: {amount / mib:.2f} MiB per step")
    lines.append(f"(traced and read in {estimate.trace_seconds:.2f} s; nothing compiled)")
    return "\n".join(lines)


def _factorizations(count: int) -> list[dict[str, int]]:
    """Meshes of `count` devices over data, model and pipe, at least 2-way data parallel
    where the count allows (the example's pipelines and TP want a data axis beside them)."""
    meshes = []
    for model in (1, 2, 4, 8):
        for pipe in (1, 2, 4, 8):
            if count % (model * pipe) or model * pipe > max(1, count // 2):
                continue
            meshes.append({lm.DATA: count // (model * pipe), lm.MODEL: model, lm.PIPE: pipe})
    return meshes or [{lm.DATA: count, lm.MODEL: 1, lm.PIPE: 1}]


def candidates(options: TrainConfig, count: int) -> list[TrainConfig]:
    """The plans `--plan auto` weighs: every mesh of `_factorizations`, with and without
    FSDP (where data > 1), remat none and full; pipelines by 1F1B. Those the run's other
    options refuse, or whose sizes the mesh cannot split (`check_sizes`), are left out."""
    config = options.model_config()
    out = []
    for sizes in _factorizations(count):
        for fsdp in (False, True) if sizes[lm.DATA] > 1 else (False,):
            for remat in ("none", "full"):
                option = dataclasses.replace(
                    options,
                    mesh=format_mesh(sizes),
                    fsdp=fsdp,
                    remat=remat,
                    schedule="1f1b" if sizes[lm.PIPE] > 1 else None,
                    plan=None,
                )
                try:  # with the run's other options (e.g. --accumulate refuses a pipe axis)
                    option.validate(count)
                    check_sizes(config, option.run_config(count))
                except ConfigError:
                    continue
                out.append(option)
    return out


def label(option: TrainConfig) -> str:
    """The flags that name `option`'s layout, as a user would pass them."""
    extras = [f"--schedule {option.schedule}"] if option.schedule else []
    extras += ["--fsdp"] if option.fsdp else []
    return " ".join([f"--mesh {option.mesh}", *extras, f"--remat {option.remat}"])


def choose(options: TrainConfig, count: int, memory: int) -> tuple[TrainConfig, str]:
    """`--plan auto`: the fastest candidate that fits `memory` bytes per device by
    `eqpar.search`, and the table that explains the choice."""
    config = options.model_config()
    devices = jax.devices()[:count]
    by_label = {label(o): o for o in candidates(options, count)}

    def build(label: str) -> tuple[Any, tuple[Any, ...]]:
        step = abstract_step(config, by_label[label].run_config(count), devices)
        return step.lowered, step.arguments

    result = eqpar.search(
        build, list(by_label), memory_per_device=memory, device=DEVICE, donate_argnums=(1, 2)
    )
    try:
        best = result.best
    except ValueError as error:
        raise ConfigError(f"--plan auto: {error}") from None
    return by_label[best.candidate], result.table()


def dry_run(options: TrainConfig, run: RunConfig, config: lm.LMConfig, count: int) -> dict:
    """`--dry-run`: print the estimate of `run`'s step and return it as the run's summary."""
    estimate = estimate_run(config, run, jax.devices()[:count])
    memory = options.memory_bytes()
    print(f"--dry-run, {label(options)}:")
    print(describe_estimate(estimate, memory))
    summary: dict[str, Any] = {
        "dry_run": {
            "arguments": list(estimate.arguments),
            "temp": estimate.temp,
            "peak": estimate.peak,
            "collectives": {
                f"{kind} over {','.join(axes)}": amount
                for (kind, axes), amount in sorted(estimate.collectives.items())
            },
            "trace_seconds": estimate.trace_seconds,
        }
    }
    if memory is not None:
        summary["dry_run"]["fits"] = estimate.peak <= memory
    if options.json is not None:
        options.json.write_text(json.dumps(summary, indent=2))
    return summary
