"""The main example end to end: every parallel layout trains like the same model on one device."""

import dataclasses
import json
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import lm
import train_lm
import train_options
import train_steps

import eqpar
from eqpar.nn import ContextParallelAttention

TINY = lm.LMConfig(vocab_size=32, seq_len=16, d_model=32, num_heads=8, d_hidden=64, num_layers=4)
STEPS = 3


def run_config(mesh: str, **options) -> train_lm.RunConfig:
    return train_lm.RunConfig(
        mesh=train_options.parse_mesh(mesh, 8 if mesh != "data=1" else 1),
        steps=STEPS,
        batch_size=8,
        optimizer="sgd",
        **options,
    )


def one_device(config):
    """The example trained on one device: the reference every layout is checked against."""
    run = run_config("data=1", microbatches=1)
    return train_lm.train(
        run, config=config, devices=jax.devices()[:1], progress=False, show_layout=False
    )


@pytest.fixture(scope="module")
def serial():
    return one_device(TINY)


def arrays(model):
    """The parameters in the serial form (the same leaves and shapes for every layout)."""
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(lm.model_order(model), eqx.is_array))]


@pytest.mark.parametrize(
    ("mesh", "options"),
    [
        ("data=2,pipe=2,model=2", {"schedule": "gpipe", "microbatches": 2}),
        ("data=2,pipe=2,model=2", {"schedule": "circular", "microbatches": 2}),
        ("data=2,pipe=4", {"schedule": "1f1b", "microbatches": 2, "remat": "matmuls"}),
        ("data=2,pipe=2,model=2", {"schedule": "zb-h1", "microbatches": 2}),
        ("data=2,pipe=2,model=2", {"schedule": "zb-v", "microbatches": 2}),
        ("data=2,pipe=2,model=2", {"schedule": "dualpipe-v", "microbatches": 4}),
        ("data=8", {"fsdp": True, "microbatches": 4}),  # no pipe: a step is not cut up
        ("data=2,model=4", {"fsdp": True, "accumulate": 2}),  # gradients over 2 slices
        ("data=4,model=2", {"accumulate": 2}),
        ("data=2,context=4", {}),  # the sequence split over 4: ring attention, balanced
        ("data=2,context=2,model=2", {}),  # and the heads over model
        ("pipe=2,context=2,model=2", {"schedule": "1f1b", "microbatches": 2}),
    ],
    ids=[
        "dp-pp-tp-gpipe",
        "dp-pp-tp-circular",
        "dp-pp-1f1b-remat",
        "dp-pp-tp-zb-h1",
        "dp-pp-tp-zb-v",
        "dp-pp-tp-dualpipe-v",
        "fsdp8",
        "fsdp-tp-accumulate",
        "dp-tp-accumulate",
        "dp-cp",
        "dp-cp-tp",
        "pp-cp-tp-1f1b",
    ],
)
def test_parallel_training_equals_one_device(serial, mesh, options):
    serial_losses, serial_model = serial
    run = run_config(mesh, **options)
    losses, model = train_lm.train(run, config=TINY, progress=False, show_layout=False)
    pipe = run.mesh["pipe"] > 1
    assert model.body.num_microbatches == (options["microbatches"] if pipe else 1)
    attention = model.body.stages.layers.attention
    if "context" in run.mesh:  # causal attention over the balanced split sequence
        assert isinstance(attention, ContextParallelAttention)
        strategy = "all_gather" if pipe else "ring"  # the ring does not run in a stage yet
        assert (attention.causal, attention.layout, attention.strategy) == (
            True, "balanced", strategy,
        )  # fmt: skip
    else:
        assert not isinstance(attention, ContextParallelAttention)
    np.testing.assert_allclose(losses, serial_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for got, want in zip(arrays(model), arrays(serial_model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


# The embedding and the head [128, 32] are 16 KiB: large enough for FSDP to split them.
WIDE_VOCAB = dataclasses.replace(TINY, vocab_size=128)


@pytest.fixture(scope="module")
def wide_serial():
    run = run_config("data=1", microbatches=1)
    return train_lm.train(
        run, config=WIDE_VOCAB, devices=jax.devices()[:1], progress=False, show_layout=False
    )


@pytest.mark.parametrize(
    ("mesh", "options"),
    [
        ("data=8", {"microbatches": 4}),
        ("data=2,pipe=2,model=2", {"schedule": "circular", "microbatches": 2}),
        ("data=2,pipe=4", {"schedule": "1f1b", "microbatches": 2}),
        ("data=2,pipe=2,model=2", {"schedule": "zb-h1", "microbatches": 2}),
    ],
    ids=["fsdp8", "fsdp-pp-tp-circular", "fsdp-pp-1f1b", "fsdp-pp-tp-zb-h1"],
)
def test_fsdp_reduce_scatters_every_split_gradient_the_embedding_and_head_included(
    wide_serial, mesh, options
):
    """`--fsdp` with an embedding and a head large enough for FSDP to split trains as one
    device does, and the compiled step (exact figures) reduces the gradient of every
    parameter FSDP splits, the embedding's and the head's included, by reduce-scatter over
    `data`: the reduce-scatters take every split gradient's block (as the layers see it), and
    the all-reduces over `data` hold no more than the unsplit parameters' gradients and the
    loss. Under autodiff (`eqpar.shard_map(stored_specs=...)`) and under the 1F1B and ZB-H1
    schedules' own backward passes (`eqpar.spmd.gather_stored`) alike."""
    from _hlo import collective_ops, group_axes

    serial_losses, serial_model = wide_serial
    run = run_config(mesh, fsdp=True, **options)
    losses, model = train_lm.train(run, config=WIDE_VOCAB, progress=False, show_layout=False)
    np.testing.assert_allclose(losses, serial_losses, rtol=1e-5)
    for got, want in zip(arrays(model), arrays(serial_model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)

    device_mesh = train_lm.make_mesh(run.mesh)
    model = train_lm.build_model(WIDE_VOCAB, run, device_mesh)
    stored = train_lm.storage_specs(model, device_mesh, fsdp=True)
    assert P(("model", "pipe"), "data") == stored.embed.weight == stored.unembed.weight
    is_spec = lambda x: isinstance(x, P)
    split, unsplit = [], []
    for leaf, kept, inside in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        jax.tree.leaves(stored, is_leaf=is_spec),
        jax.tree.leaves(eqpar.partition_specs(model), is_leaf=is_spec),
        strict=True,
    ):
        shape = NamedSharding(device_mesh.jax_mesh, inside).shard_shape(leaf.shape)
        block = int(np.prod(shape)) * leaf.dtype.itemsize  # what the layers see
        (split if kept != inside else unsplit).append(block)
    optimizer = train_lm.make_optimizer(run)
    placed, opt_state = train_lm.place(model, optimizer, device_mesh, fsdp=True)
    step = train_lm.build_step(placed, device_mesh, run, optimizer)
    rows = NamedSharding(device_mesh.jax_mesh, P("data"))
    tokens = jax.device_put(np.zeros((8, WIDE_VOCAB.seq_len + 1), np.int32), rows)
    sizes = dict(device_mesh.jax_mesh.shape)
    ops = collective_ops(step.lower(tokens, placed, opt_state).compile())
    over_data = [op for op in ops if "data" in group_axes(op.groups, sizes)]
    # A reduce-scatter's input: its result x the group.
    scattered = sum(
        op.array_bytes * op.group_size * op.executions
        for op in over_data
        if op.kind == "reduce-scatter"
    )
    all_reduced = sum(op.array_bytes * op.executions for op in over_data if op.kind == "all-reduce")
    assert scattered == sum(split), (scattered, split)
    assert all_reduced <= sum(unsplit) + 64, (all_reduced, unsplit)  # + the loss


def test_parameters_live_where_their_layout_says():
    run = run_config("data=2,pipe=2,model=2", fsdp=True)
    mesh = train_lm.make_mesh(run.mesh)
    model = train_lm.build_model(TINY, run, mesh)
    placed, opt_state = train_lm.place(model, train_lm.make_optimizer(run), mesh, fsdp=True)
    specs = train_lm.storage_specs(model, mesh, fsdp=True)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for leaf, spec in zip(
        jax.tree.leaves(eqx.filter(placed, eqx.is_array)), flat_specs, strict=True
    ):
        assert leaf.sharding.spec == spec
    # [stage, layer in stage, out, in]: stages over pipe, heads over model, FSDP over data
    query = placed.body.stages.layers.attention.query_proj.weight
    assert query.sharding.spec == P("pipe", None, "model", "data")
    # the vocabulary split over model and pipe
    assert placed.embed.weight.sharding.spec == P(("model", "pipe"), None)
    # the optimizer's momentum mirrors the parameters' layout
    momentum = opt_state[0].trace.body.stages.layers.attention.query_proj.weight
    assert momentum.sharding.spec == query.sharding.spec


def test_serial_form_is_the_same_model():
    run = run_config("data=2,pipe=2,model=2", schedule="circular", microbatches=2)
    mesh = train_lm.make_mesh(run.mesh)
    model = train_lm.build_model(TINY, run, mesh)
    assert model.body.stages.layers.up.weight.shape == (2, 2, 1, 64, 32)  # [V, S, L/(SV), ...]
    serial = lm.model_order(model)
    assert type(serial.body.up) is eqx.nn.Linear and serial.body.up.weight.shape == (4, 64, 32)
    tokens = jax.random.randint(jax.random.key(1), (8, TINY.seq_len + 1), 0, TINY.vocab_size)
    loss = eqx.filter_jit(
        eqpar.shard_map(
            train_lm.global_loss,
            mesh=mesh,
            in_specs=(eqpar.partition_specs(model), P("data")),
            out_specs=P(),
        )
    )(model, tokens)
    np.testing.assert_allclose(loss, serial.loss(tokens), rtol=1e-5)


def test_cli_errors_name_the_problem(capsys):
    ConfigError = train_lm.ConfigError
    with pytest.raises(ConfigError, match="multiply to 4 but there are 8 devices"):
        train_options.parse_mesh("data=2,model=2", 8)
    with pytest.raises(ConfigError, match="got 'tensor=2'"):
        train_options.parse_mesh("tensor=2", 2)
    run = dataclasses.replace(run_config("pipe=8"), schedule="circular", repeats=2)
    with pytest.raises(ConfigError, match="num_layers=4 must divide by pipe x repeats = 16: "
                       "choose a smaller pipe in --mesh or fewer --repeats"):  # fmt: skip
        train_lm.check_sizes(TINY, run)
    with pytest.raises(ConfigError, match=r"batch_size=8 must divide by data x microbatches = 16: "
                       r"use a --batch-size that is a multiple of 16 \(e.g. 16\) or fewer "
                       r"--microbatches"):  # fmt: skip
        train_lm.check_sizes(TINY, run_config("data=4,pipe=2", microbatches=4))
    with pytest.raises(ConfigError, match=r"batch_size=4 must divide by data = 8: use a "
                       r"--batch-size that is a multiple of 8 \(e.g. 8\)\.$"):  # fmt: skip
        train_lm.check_sizes(TINY, dataclasses.replace(run_config("data=8"), batch_size=4))
    with pytest.raises(ConfigError, match=r"seq_len=12 must divide by 2 x context = 8 .*: use a "
                       r"--seq-len that is a multiple of 8 \(e.g. 16\) or context=1, 2, 3 or 6 "
                       r"in --mesh\.$"):  # fmt: skip
        train_lm.check_sizes(dataclasses.replace(TINY, seq_len=12), run_config("data=2,context=4"))
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--check", "--optimizer", "adam"])
    assert exit_info.value.code == 2
    assert "holds for plain SGD only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--lr", "0"])
    assert exit_info.value.code == 2
    assert "Error parsing --lr: must be a number above 0, got '0'" in capsys.readouterr().err
    # A schedule needs a pipeline to schedule: not silently ignored without a pipe axis.
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--schedule", "1f1b", "--mesh", "data=8"])
    assert exit_info.value.code == 2
    assert (
        "--schedule 1f1b needs a pipe axis in --mesh: without one every device holds every "
        "layer and there is no pipeline to schedule; add a pipe axis (e.g. --mesh "
        "data=4,pipe=2) or leave --schedule out"
    ) in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--resume"])
    assert exit_info.value.code == 2
    assert "--resume needs --ckpt-dir DIR" in capsys.readouterr().err
    # Accumulation cuts a step without a pipeline; a pipeline cuts it by --microbatches.
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--accumulate", "2", "--mesh", "data=4,pipe=2"])
    assert exit_info.value.code == 2
    assert (
        "--accumulate 2 cuts a step without a pipe axis; --mesh data=4,pipe=2 has one, whose "
        "pipeline already cuts the batch into --microbatches (4): use --microbatches 8 "
        "instead, or drop the pipe axis"
    ) in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"batch_size=8 must divide by data x accumulate = 16: "
                       r".* or fewer --accumulate\.$"):  # fmt: skip
        train_lm.check_sizes(TINY, run_config("data=8", accumulate=2))
    assert "gradients accumulated over 2 microbatches" in train_lm.describe(
        run_config("data=8", accumulate=2)
    )


def test_microbatches_only_cut_a_pipeline():
    # `--mesh data=8 --fsdp` with the default 4 microbatches: no pipe axis, so a step is not
    # cut into microbatches and 8 rows split over 8 devices are enough (the fsdp8 run above
    # trains that way).
    run = run_config("data=8", microbatches=4, fsdp=True)
    train_lm.check_sizes(TINY, run)
    assert train_steps.pipeline_microbatches(run) == 1
    assert train_steps.pipeline_microbatches(run_config("data=2,pipe=4", microbatches=4)) == 4


@pytest.mark.parametrize("size", [0.01, 10.0])  # global norm below and above the clip's 1
def test_adam_clips_as_optax(size):
    # The example's clipping multiplies by one scalar factor where optax's divides each
    # gradient by the norm (which costs the step a buffer the size of the gradients on CPU):
    # the same clipped gradients to two float32 roundings (the factor's division and the
    # product, 2**-24 relative each; 2**-22 leaves room for a norm summed in another order),
    # and so the same Adam updates over steps whose gradients change (Adam's ratio scales
    # them by about the same, 2**-20 at most).
    optimizer = train_lm.make_optimizer(dataclasses.replace(run_config("data=1"), optimizer="adam"))
    warmup = optax.linear_schedule(0.0, train_lm.RunConfig.lr, transition_steps=10)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(warmup))
    params = {"w": jnp.ones((3, 5)), "b": [jnp.zeros(5), jnp.ones(())]}
    state, reference_state = optimizer.init(params), reference.init(params)
    for key in jax.random.split(jax.random.key(0), 4):
        parts = jax.random.split(key, 3)
        grads = {
            "w": size * jax.random.normal(parts[0], (3, 5)),
            "b": [size * jax.random.normal(parts[1], (5,)), size * jax.random.normal(parts[2])],
        }
        clipped, _ = train_steps.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
        expected, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
        for leaf, expected_leaf in zip(jax.tree.leaves(clipped), jax.tree.leaves(expected)):
            np.testing.assert_allclose(leaf, expected_leaf, rtol=2**-22, atol=0)
        updates, state = optimizer.update(grads, state, params)
        expected, reference_state = reference.update(grads, reference_state, params)
        for leaf, expected_leaf in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
            np.testing.assert_allclose(leaf, expected_leaf, rtol=2**-20, atol=0)
        params = optax.apply_updates(params, updates)


def help_text(capsys) -> str:
    """`train_lm.py --help` as words (the box tyro draws around it left out)."""
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    return " ".join(text.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


def test_help_shows_the_defaults(capsys):
    text = help_text(capsys)
    for default in ("(default: 120)", "(default: 16)", "(default: 10)"):
        assert default in text
    assert "unset: data=2,pipe=2,model=2 on 8 devices" in text
    assert "a context axis (e.g. data=2,context=4) splits every sequence" in text
    assert "--seq-len {None}|N tokens per sequence (unset: the --size's: 32 for small" in text
    assert "--schedule {None,gpipe,circular,1f1b,zb-h1,zb-v,dualpipe-v} pipeline schedule" in text
    assert "--experts {None}|N a mixture of E experts" in text
    assert "--top-k {None}|N experts per token (with --experts; unset: 2)" in text
    assert "--precision {float32,bfloat16}" in text and "(default: float32)" in text


def test_run_described_in_words():
    run = run_config("data=2,pipe=2,model=2", schedule="circular", microbatches=2, fsdp=True)
    assert train_lm.describe(run) == (
        "mesh data=2,pipe=2,model=2 | circular x 2 repeats schedule, 2 microbatches | FSDP"
    )
    assert train_lm.describe(run_config("data=8")) == "mesh data=8,pipe=1,model=1"
    # a context axis where it is asked for, between pipe and model as in the mesh
    run = run_config("model=2,context=2,data=2")
    assert train_lm.describe(run) == "mesh data=2,pipe=1,context=2,model=2"
    assert train_lm.make_mesh(run.mesh).axis_names == ("data", "pipe", "context", "model")


@pytest.mark.parametrize("flag", ["--microbatches", "--accumulate", "--batch-size", "--steps"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_counts_below_one_are_refused_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.parse_options([flag, value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"Error parsing {flag}: must be a positive integer, got '{value}'" in error
    assert getattr(train_lm.parse_options([flag, "3"]), flag[2:].replace("-", "_")) == 3


def test_main_writes_pictures_metrics_config_and_checks(tmp_path, capsys):
    argv = [
        "--steps", "3", "--microbatches", "2", "--check", "--log-every", "2",
        "--out", str(tmp_path), "--batch-size", "8", "--size", "tiny",
    ]  # fmt: skip
    summary = train_lm.main(argv)
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "schedule_gpipe.png").stat().st_size > 1000
    out = capsys.readouterr().out
    # stdout is not a terminal here: whole log lines, no progress bar redrawn with "\r"
    assert "\r" not in out
    lines = out.splitlines()
    assert "optimizer sgd" in lines[0]  # --check trains with plain SGD
    compiling = lines.index("compiling the training step...")
    assert lines[compiling + 1].startswith("compiled in ")
    assert "; memory per device: parameters " in lines[compiling + 1]
    assert "model FLOPs utilisation is not meaningful" in lines[compiling + 2]  # CPU devices
    assert lines[compiling + 3].startswith("step 1 took ")
    logged = [line for line in lines if line.startswith("step ")][1:]
    assert [line.split("  ")[0] for line in logged] == ["step 2/3", "step 3/3"]
    assert all("  lr 9.00e-02  grad norm " in line for line in logged)  # SGD: 30 x 3e-3
    assert summary["first_step_seconds"] > 0 and summary["tokens_per_second"] > 0
    assert summary["compile_seconds"] > 0
    assert summary["curve"] == {"steps": [1, 2, 3], "losses": summary["losses"]}
    check = summary["check"]
    assert check["passed"] and check["tolerance"] == 1e-5
    assert check["loss_difference"] < 1e-5 and check["parameter_difference"] < 1e-5
    assert "(sgd, float32, tolerance 1e-05)" in lines[-1] and lines[-1].endswith(": PASS")
    # The first step's gradients, leaf by leaf, by eqpar.check (the 3D mesh's pipeline stack
    # compared in model order with the one-device stack).
    first = check["first_step"]
    assert first["passed"] and first["leaves"] > 10 and first["largest_difference"] < 1e-5
    assert any(line.startswith("eqpar.check: PASS") for line in lines)

    # metrics.jsonl: a start-up record, then one record per step with the per-step fields.
    start, *steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert start["event"] == "start" and start["memory"] == summary["memory"]
    assert start["platform"] == "cpu" and start["peak_flops_per_device"] is None
    assert [record["step"] for record in steps] == [1, 2, 3]
    assert [record["loss"] for record in steps] == summary["losses"]
    for record in steps:
        assert record["learning_rate"] == pytest.approx(0.09)
        assert record["grad_norm"] > 0 and record["mfu"] is None  # no CPU peak
    assert steps[0]["tokens_per_second"] is None  # the first step is not timed
    assert steps[-1]["tokens_per_second"] == summary["tokens_per_second"]
    # TensorBoard events beside them (tensorboardX is in the test extra).
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    # The memory figures are memory_analysis()'s of the same compiled step.
    run = train_lm.RunConfig(
        mesh={"data": 2, "pipe": 2, "model": 2},
        microbatches=2,
        steps=3,
        batch_size=8,
        optimizer="sgd",
    )
    mesh = train_lm.make_mesh(run.mesh)
    optimizer = train_lm.make_optimizer(run)
    model, opt_state = train_lm.place(
        train_lm.build_model(TINY, run, mesh), optimizer, mesh, run.fsdp
    )
    step = train_lm.build_step(model, mesh, run, optimizer, with_stats=True)
    tokens = jax.device_put(
        np.zeros((8, TINY.seq_len + 1), np.int32), NamedSharding(mesh.jax_mesh, P("data"))
    )
    stats = step.lower(tokens, model, opt_state).compile().compiled.memory_analysis()
    memory = summary["memory"]
    assert memory["temp"] == stats.temp_size_in_bytes > 0
    assert memory["argument"] == stats.argument_size_in_bytes
    assert memory["output"] == stats.output_size_in_bytes
    assert memory["alias"] == stats.alias_size_in_bytes
    # What each device holds of the arguments, by array: together the step's argument size.
    assert memory["parameters"] + memory["optimizer_state"] + memory["batch"] == (
        stats.argument_size_in_bytes
    )
    assert memory["parameters"] == sum(
        int(np.prod(leaf.addressable_shards[0].data.shape)) * 4
        for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    )

    # config.json: the run's options as it ran them; read back, the same run.
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["mesh"] == "data=2,pipe=2,model=2" and saved["optimizer"] == "sgd"
    assert saved["schedule"] == "gpipe" and saved["seq_len"] == 16 and saved["check"] is True
    loaded = train_lm.parse_options(["--config", str(tmp_path / "config.json")])
    expected = train_lm.parse_options(argv).resolved(8)
    assert dataclasses.replace(loaded, config=None) == expected
    assert loaded.run_config(8) == run and loaded.model_config() == TINY
    # Options beside --config override the file's.
    overridden = train_lm.parse_options(["--config", str(tmp_path / "config.json"), "--steps", "5"])
    assert overridden.steps == 5 and overridden.fsdp is False
    assert summary["config"] == json.loads(json.dumps(dataclasses.asdict(expected), default=str))


def test_config_files_are_checked_as_the_command_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    options = train_lm.parse_options(["--fsdp", "--steps", "7", "--mesh", "data=8"])
    train_lm.save_config(options, path)
    assert train_lm.parse_options(["--config", str(path)]) == dataclasses.replace(
        options, config=path
    )
    path.write_text(json.dumps({"steps": 0}))
    with pytest.raises(SystemExit) as exit_info:
        train_lm.parse_options(["--config", str(path)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error == (
        f'train_lm.py: error: --config {path}: "steps": 0 is not a positive integer (for --steps)\n'
    )
    path.write_text(json.dumps({"stepz": 3}))
    with pytest.raises(SystemExit):
        train_lm.parse_options(["--config", str(path)])
    error = capsys.readouterr().err
    assert f"--config {path}: expected a JSON object of the options" in error
    assert "got ['stepz']" in error
    # A file names the optimizer its run resolved (adam): --check beside it says to pass sgd.
    train_lm.save_config(options.resolved(8), path)
    with pytest.raises(train_lm.ConfigError, match=r"To check, pass --optimizer sgd \(--config"):
        train_lm.parse_options(["--config", str(path), "--check"]).validate(8)
    checked = train_lm.parse_options(["--config", str(path), "--check", "--optimizer", "sgd"])
    checked.validate(8)


@pytest.fixture(scope="module")
def serial_bfloat16():
    run = run_config("data=1", microbatches=1, precision="bfloat16")
    return train_lm.train(
        run, config=TINY, devices=jax.devices()[:1], progress=False, show_layout=False
    )


@pytest.mark.parametrize(
    ("mesh", "options"),
    [
        ("data=2,pipe=2,model=2", {"schedule": "gpipe", "microbatches": 2}),
        ("data=2,pipe=4", {"schedule": "1f1b", "microbatches": 2}),
    ],
    ids=["dp-pp-tp-gpipe", "dp-pp-1f1b"],
)
def test_bfloat16_trains_like_one_device_and_like_float32(serial, serial_bfloat16, mesh, options):
    run = run_config(mesh, precision="bfloat16", **options)
    losses, model = train_lm.train(run, config=TINY, progress=False, show_layout=False)
    serial_losses, serial_model = serial_bfloat16
    # Against one device under the same policy: bfloat16 rounding, summed in another order
    # over the devices (measured after 3 steps: losses 1.4e-4 relative, parameters 2.5e-4).
    np.testing.assert_allclose(losses, serial_losses, rtol=2e-3)
    for got, want in zip(arrays(model), arrays(serial_model), strict=True):
        assert got.dtype == np.float32  # parameters stay float32
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)
    # The loss curve of float32 training, within bfloat16's rounding (measured: 2.6e-4).
    np.testing.assert_allclose(serial_losses, serial[0], rtol=2e-3)
    assert losses[-1] < losses[0]


def test_precision_flag():
    assert train_lm.parse_options([]).precision == "float32"
    assert train_lm.parse_options(["--precision", "bfloat16"]).precision == "bfloat16"
    with pytest.raises(SystemExit):
        train_lm.parse_options(["--precision", "float16"])
    run = run_config("data=8", precision="bfloat16")
    assert train_lm.describe(run) == "mesh data=8,pipe=1,model=1 | bfloat16 compute"
    assert train_lm.check_tolerance("bfloat16") == train_options.CHECK_TOLERANCE_BFLOAT16


@pytest.mark.parametrize("target_mesh", ["pipe=4,model=2", "data=2,model=4", "data=1"])
def test_checkpoint_restores_under_other_layouts(target_mesh, saved_run):
    from eqpar.checkpoint import Checkpointer

    directory, saved_model = saved_run
    run = run_config(target_mesh)
    devices = jax.devices()[:1] if target_mesh == "data=1" else None
    mesh = train_lm.make_mesh(run.mesh, devices)
    fresh = train_lm.build_model(TINY, dataclasses.replace(run, seed=123), mesh)
    model, opt_state = train_lm.place(fresh, train_lm.make_optimizer(run), mesh, fsdp=True)
    target = {"model": model, "opt_state": opt_state, "position": 0}
    with Checkpointer(directory) as checkpointer:
        restored = checkpointer.restore(target=target, reshape=True)
    assert restored["position"] == STEPS
    for got, placed in zip(
        jax.tree.leaves(eqx.filter(restored["model"], eqx.is_array)),
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        strict=True,
    ):
        assert got.shape == placed.shape and got.sharding == placed.sharding
    for got, want in zip(arrays(restored["model"]), saved_model, strict=True):
        np.testing.assert_array_equal(got, want)  # bitwise


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm-checkpoint")
    run = run_config("data=2,pipe=2,model=2", schedule="circular", microbatches=2)
    options = train_lm.CheckpointOptions(directory, save_every=2, keep=1)
    _, model = train_lm.train(
        run, config=TINY, progress=False, show_layout=False, checkpoint=options
    )
    return directory, arrays(model)


# --- mixture of experts (`--experts`) --------------------------------------------------------

MOE = dataclasses.replace(TINY, num_experts=8, top_k=2)


def test_experts_check_against_one_device(tmp_path, capsys):
    summary = train_lm.main(
        [
            "--experts", "8", "--top-k", "2", "--mesh", "data=2,expert=4", "--check",
            "--steps", "2", "--batch-size", "8", "--size", "tiny", "--log-every", "1",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    check = summary["check"]
    assert check["passed"] and check["tolerance"] == 1e-5
    lines = capsys.readouterr().out.splitlines()
    assert "mesh data=2,expert=4,pipe=1,model=1; 8 experts, top 2; optimizer sgd" in lines[0]
    logged = [line for line in lines if line.startswith("step ") and "/" in line.split()[1]]
    assert len(logged) == 2
    for line in logged:  # the auxiliary losses and the dropped count, in every log line
        assert "  load balancing " in line and "  z " in line and line.endswith("  dropped 0")
    assert lines[-1].endswith(": PASS")
    stats = summary["router_stats"]
    assert stats["dropped"] == 0  # dropless
    assert 0.5 < stats["load_balancing"] < 2 and stats["z_loss"] > 0
    # The loss is the cross entropy plus each block's weighted auxiliary losses.
    blocks = MOE.num_layers
    expected = (
        stats["cross_entropy"]
        + lm.LOAD_BALANCING_WEIGHT * blocks * stats["load_balancing"]
        + lm.Z_LOSS_WEIGHT * blocks * stats["z_loss"]
    )
    np.testing.assert_allclose(summary["losses"][-1], expected, rtol=1e-6)


@pytest.fixture(scope="module")
def serial_experts():
    return one_device(MOE)


def test_experts_in_3d_with_fsdp_train_like_one_device(serial_experts):
    # The experts over `expert`, each expert's hidden units over `model`, and (FSDP) their
    # weights over `data` too; the batch rows over data and expert.
    run = run_config("data=2,expert=2,model=2", fsdp=True)
    mesh = train_lm.make_mesh(run.mesh)
    model = train_lm.build_model(MOE, run, mesh)
    moe = model.body.stages.layers.moe
    assert (moe.expert_axis_name, moe.model_axis_name) == ("expert", "model")
    specs = train_lm.storage_specs(model, mesh, fsdp=True).body.stages.layers.moe
    assert specs.up == P("pipe", None, "expert", "data", "model")  # [S, L/S, E, d, h]
    assert specs.down == P("pipe", None, "expert", "model", "data")
    losses, model = train_lm.train(run, config=MOE, progress=False, show_layout=False)
    serial_losses, serial_model = serial_experts
    assert lm.model_order(model).body.moe.expert_axis_name is None  # the serial form
    np.testing.assert_allclose(losses, serial_losses, rtol=1e-5)
    for got, want in zip(arrays(model), arrays(serial_model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_experts_bad_combinations_are_refused(capsys):
    def refused(config, mesh, match, **options):
        with pytest.raises(train_lm.ConfigError, match=match):
            train_lm.check_sizes(config, dataclasses.replace(run_config(mesh), **options))

    refused(
        dataclasses.replace(MOE, num_experts=6),
        "data=2,expert=4",
        r"--experts 6 must divide by expert=4 .*: choose --experts 8 or expert=1, 2, 3 or 6 "
        r"in --mesh\.$",
    )
    refused(dataclasses.replace(MOE, top_k=9), "data=2,expert=4", "--top-k 9 must be at most")
    refused(MOE, "data=2,expert=2,pipe=2", r"--experts does not run with a pipe axis \(pipe=2\)")
    refused(MOE, "data=2,expert=4", "--schedule 1f1b runs the pipeline's own", schedule="1f1b")
    refused(TINY, "data=2,expert=4", "expert=4 in --mesh splits the experts .* give --experts")
    refused(MOE, "data=4,expert=2", r"batch_size=4 must divide by data x expert = 8", batch_size=4)
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--experts", "6", "--mesh", "data=2,expert=4", "--size", "tiny"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before any output
    assert err.startswith("train_lm.py: error: --experts 6 must divide by expert=4")


def test_utilisation_needs_a_known_peak():
    import types

    import metrics

    def device(platform, kind):
        return types.SimpleNamespace(platform=platform, device_kind=kind)

    h100, pcie = device("gpu", "NVIDIA H100 80GB HBM3"), device("gpu", "NVIDIA H100 PCIe")
    assert metrics.peak_flops(h100, "bfloat16") == 989e12
    assert metrics.peak_flops(h100, "float32") == 495e12  # TF32, as XLA runs float32 matmuls
    assert metrics.peak_flops(pcie, "bfloat16") == 756e12  # the longer name first
    assert metrics.peak_flops(device("tpu", "TPU v5 lite"), "bfloat16") == 197e12
    assert metrics.utilisation_note(h100, "bfloat16") == ""
    cpu = jax.devices()[0]
    assert metrics.peak_flops(cpu, "float32") is None
    assert metrics.utilisation_note(cpu, "float32") == "not meaningful on simulated CPU devices"
    unknown = device("gpu", "NVIDIA GeForce RTX 3090")
    assert metrics.peak_flops(unknown, "bfloat16") is None
    assert "'NVIDIA GeForce RTX 3090' is not in metrics.PEAK_FLOPS" in metrics.utilisation_note(
        unknown, "bfloat16"
    )
    # The model FLOPs of a token: 3 x the forward pass's matmuls and attention.
    config = train_options.SIZES["tiny"]  # d 32, hidden 64, 4 layers, vocab 32, seq 16
    forward = 2 * (4 * (4 * 32 * 32 + 2 * 32 * 64 + 2 * 16 * 32) + 32 * 32)
    assert train_lm.training_flops_per_token(config) == 3 * forward


# --- a run that goes bad stops before it loses anything, and says what it did --------------

# A learning rate far too large: plain SGD at 30 x 1e4 makes the loss non-finite in a few
# steps (step 1 is always finite: the initial parameters).
NONFINITE = ["--size", "tiny", "--mesh", "data=8", "--batch-size", "8", "--optimizer", "sgd",
             "--lr", "1e4", "--steps", "6", "--no-progress", "--no-tensorboard"]  # fmt: skip


def strict_json(text: str):
    """`json.loads` as strict readers read: NaN and Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def restored_state(directory, run):
    """The latest checkpoint in `directory` of a tiny model trained by `run`."""
    from eqpar.checkpoint import Checkpointer

    mesh = train_lm.make_mesh(run.mesh)
    optimizer = train_lm.make_optimizer(run)
    model, opt_state = train_lm.place(
        train_lm.build_model(TINY, run, mesh), optimizer, mesh, run.fsdp
    )
    with Checkpointer(directory) as checkpointer:
        return checkpointer.restore(target={"model": model, "opt_state": opt_state, "position": 0})


@pytest.fixture(scope="module")
def nonfinite_run(tmp_path_factory):
    """The run above with --save-every 1 --keep 2: its exit status, console and directory."""
    import contextlib
    import io

    directory = tmp_path_factory.mktemp("nonfinite")
    argv = [*NONFINITE, "--save-every", "1", "--keep", "2", "--ckpt-dir", str(directory / "ckpt"),
            "--out", str(directory / "out"), "--json", str(directory / "summary.json")]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = train_lm.exit_status(argv)
    return status, out.getvalue(), directory


def test_a_run_that_goes_non_finite_stops_and_keeps_its_finite_checkpoints(nonfinite_run):
    status, out, directory = nonfinite_run
    ckpt = directory / "ckpt"
    assert status == 1, out
    # Every file a strict JSON reader accepts: non-finite values as null, flagged.
    summary = strict_json((directory / "summary.json").read_text())
    records = [strict_json(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    stop = summary["stopped"]["step"]
    assert [r["step"] for r in records[1:]] == list(range(1, stop + 1))  # none after it
    bad = records[-1]
    assert bad["loss"] is None and "loss" in bad["nonfinite"]
    assert "loss" in summary["stopped"]["nonfinite"] and summary["losses"][-1] is None
    assert all("nonfinite" not in r for r in records[1:-1])
    # The message names the step, what was kept and the option that trains on.
    assert f"stopped at step {stop}: not finite: loss nan" in out
    assert f"the last checkpoint, step {stop - 1} in {ckpt}, is finite" in out
    assert "Pass --allow-nonfinite to train on" in out
    assert summary["config"]["allow_nonfinite"] is False
    # The non-finite step was not saved and rotated nothing out: the last finite steps stay.
    assert stop >= 2 and summary["stopped"]["last_checkpoint"] == stop - 1
    assert train_lm.saved_steps(ckpt) == list(range(max(1, stop - 2), stop))
    run = train_lm.parse_options([*NONFINITE]).run_config(8)
    state = restored_state(ckpt, run)
    assert state["position"] == stop - 1
    leaves = jax.tree.leaves(eqx.filter((state["model"], state["opt_state"]), eqx.is_inexact_array))
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)


def test_a_checkpoint_directory_that_does_not_fit_is_refused_naming_the_fix(
    nonfinite_run, tmp_path, capsys
):
    _, _, directory = nonfinite_run
    ckpt = directory / "ckpt"
    record = (ckpt / "config.json").read_text()
    steps = train_lm.saved_steps(ckpt)

    def refused(*argv, before_any_output=True):
        with pytest.raises(SystemExit) as exit_info:
            train_lm.main([*argv, "--out", str(tmp_path / "out")])
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2 and (out == "" or not before_any_output), out
        assert err.startswith("train_lm.py: error: ") and "Traceback" not in err
        return " ".join(err.split())

    # Resumed without the options it was written with: each named, with both values.
    err = refused("--ckpt-dir", str(ckpt), "--resume", "--mesh", "data=8")
    assert (
        f"--resume: the checkpoint in --ckpt-dir {ckpt} was written with other options "
        f"({ckpt / 'config.json'}): --size tiny there, small here; --seq-len 16 there, 32 "
        "here; --optimizer sgd there, adam here." in err
    )
    assert "resume with the options it was written with (--size tiny, --seq-len 16, " in err
    assert f"or with --config {ckpt / 'config.json'} --resume" in err
    corpus = tmp_path / "corpus"
    err = refused(*NONFINITE, "--ckpt-dir", str(ckpt), "--resume", "--data", str(corpus))
    assert f"--data unset there, {corpus} here" in err and "(no --data)" in err
    # A directory that holds another run's steps, without --resume.
    err = refused(*NONFINITE, "--ckpt-dir", str(ckpt))
    assert f"--ckpt-dir {ckpt} already holds checkpoints (steps {steps[0]}, {steps[1]})" in err
    assert f"Pass --resume to continue from step {steps[-1]}, or another --ckpt-dir" in err
    # --resume that finds nothing: a typo in --ckpt-dir; nothing is created there.
    typo = directory / "ckpt-typo"
    err = refused(*NONFINITE, "--ckpt-dir", str(typo), "--resume")
    assert f"--resume: nothing to resume from: --ckpt-dir {typo} does not exist" in err
    assert "leave out --resume to start from step 0" in err and not typo.exists()
    err = refused(*NONFINITE, "--ckpt-dir", str(ckpt), "--resume", "--steps", "1")
    assert f"is step {steps[-1]}, past --steps 1: pass --steps above {steps[-1]}" in err
    assert (ckpt / "config.json").read_text() == record  # the record is untouched
    assert train_lm.saved_steps(ckpt) == steps

    # Without a record (or past it), the restore's own check, as a usage error naming the
    # first difference; config.json is written only once a restore succeeded.
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("config.json", "*.lock"))
    err = refused(
        *NONFINITE, "--ckpt-dir", str(bare), "--resume", "--experts", "4", before_any_output=False
    )
    assert f"--resume: the checkpoint in --ckpt-dir {bare} does not fit this run's model" in err
    assert "first mismatching leaf: `model/body/stages/layers/" in err
    assert not (bare / "config.json").exists()


def test_allow_nonfinite_trains_on_without_saving_and_a_save_that_did_not_happen_says_so(
    tmp_path, capsys, monkeypatch
):
    from eqpar.checkpoint import Checkpointer

    save = Checkpointer.save

    def save_but_step_1(self, step, state, *, force=False):  # as if orbax declined it
        return False if step == 1 else save(self, step, state, force=force)

    monkeypatch.setattr(Checkpointer, "save", save_but_step_1)
    ckpt = tmp_path / "ckpt"
    argv = [*NONFINITE, "--allow-nonfinite", "--save-every", "1", "--keep", "9",
            "--ckpt-dir", str(ckpt), "--out", str(tmp_path)]  # fmt: skip
    assert train_lm.exit_status(argv) == 0
    out = capsys.readouterr().out
    assert "saved the checkpoint of step 1" not in out
    assert f"the checkpoint of step 1 was NOT saved in {ckpt}: the checkpointer declined" in out
    records = [strict_json(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    bad = [r["step"] for r in records[1:] if "nonfinite" in r]
    assert [r["step"] for r in records[1:]] == [1, 2, 3, 4, 5, 6] and bad == list(range(bad[0], 7))
    assert f"step {bad[0]}: not finite: loss" in out and "training on (--allow-nonfinite)" in out
    assert f"not saving step {bad[0]}: not finite" in out
    assert train_lm.saved_steps(ckpt) == list(range(2, bad[0]))  # finite steps only


def test_every_refusal_has_one_prefix_and_exit_status_2(tmp_path, capsys):
    import data as input_data

    corpus = input_data.write_corpus(tmp_path / "corpus", num_documents=40)
    shard = corpus.directory / corpus.files[1]
    with shard.open("r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    cases = {
        ("--mesh", "data=3"): "--mesh data=3: the axis sizes multiply to 3 but there are 8",
        ("--mesh", "data=2,pipe=4", "--batch-size", "3"): "batch_size=3 must divide by data x",
        ("--top-k", "4"): "--top-k 4 chooses among the experts of --experts, and there is no "
        "--experts: add --experts E (E at least 4) for a mixture of experts, or leave --top-k out",
        ("--lr", "0"): "Error parsing --lr: must be a number above 0, got '0'",
        ("--fsdp", "yes"): "Unrecognized options: yes; --fsdp takes no value",
        ("--size", "tiny", "--data", str(corpus.directory)): f"--data {corpus.directory}: "
        f"cannot open {shard} (RuntimeError); the file is missing, unreadable, truncated",
    }
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            train_lm.main([*argv, "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"train_lm.py: error: {message}"), err
        assert err.count("train_lm.py: error:") == 1


def test_config_file_errors_name_the_file_the_entry_and_the_option(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"fsdp": "yes", "schedule": "2f2b", "steps": 3, "lr": "fast"}))
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main(["--config", str(path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f'train_lm.py: error: --config {path}: "fsdp": "yes" is not a bool (true or false) '
        f'(for --fsdp); "schedule": "2f2b" is not one of "gpipe", "circular", "1f1b", "zb-h1", '
        f'"zb-v", "dualpipe-v" (for --schedule); "lr": "fast" is not a number above 0 (for --lr)\n'
    )
    # A file written before --top-k was refused without --experts still reads.
    path.write_text(json.dumps({"experts": None, "top_k": 2, "steps": 3}))
    assert train_lm.parse_options(["--config", str(path)]).top_k is None
