"""The main example end to end: every parallel layout trains like the same model on one device."""

import dataclasses
import pathlib
import sys

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import lm
import train_lm

import eqpar

TINY = lm.LMConfig(vocab_size=32, seq_len=16, d_model=32, num_heads=8, d_hidden=64, num_layers=4)
STEPS = 3


def run_config(mesh: str, **options) -> train_lm.RunConfig:
    return train_lm.RunConfig(
        mesh=train_lm.parse_mesh(mesh, 8 if mesh != "data=1" else 1),
        steps=STEPS,
        batch_size=8,
        optimizer="sgd",
        **options,
    )


@pytest.fixture(scope="module")
def serial():
    run = run_config("data=1", microbatches=1)
    return train_lm.train(
        run, config=TINY, devices=jax.devices()[:1], progress=False, show_layout=False
    )


def arrays(model):
    """The parameters in the serial form (the same leaves and shapes for every layout)."""
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(lm.model_order(model), eqx.is_array))]


@pytest.mark.parametrize(
    ("mesh", "options"),
    [
        ("data=2,pipe=2,model=2", {"schedule": "gpipe", "microbatches": 2}),
        ("data=2,pipe=2,model=2", {"schedule": "circular", "microbatches": 2}),
        ("data=2,pipe=4", {"schedule": "1f1b", "microbatches": 2, "remat": "matmuls"}),
        ("data=8", {"fsdp": True, "microbatches": 1}),
        ("data=2,model=4", {"fsdp": True, "microbatches": 2}),
    ],
    ids=["dp-pp-tp-gpipe", "dp-pp-tp-circular", "dp-pp-1f1b-remat", "fsdp8", "fsdp-tp"],
)
def test_parallel_training_equals_one_device(serial, mesh, options):
    serial_losses, serial_model = serial
    losses, model = train_lm.train(
        run_config(mesh, **options), config=TINY, progress=False, show_layout=False
    )
    np.testing.assert_allclose(losses, serial_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for got, want in zip(arrays(model), arrays(serial_model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


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
    assert placed.embed.weight.sharding.spec == P("model", None)  # the vocabulary split
    # the optimizer's momentum mirrors the parameters' layout
    momentum = opt_state[1][0].trace.body.stages.layers.attention.query_proj.weight
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
    with pytest.raises(SystemExit, match="multiply to 4 but there are 8 devices"):
        train_lm.parse_mesh("data=2,model=2", 8)
    with pytest.raises(SystemExit, match="got 'tensor=2'"):
        train_lm.parse_mesh("tensor=2", 2)
    run = dataclasses.replace(run_config("pipe=8"), schedule="circular", repeats=2)
    with pytest.raises(SystemExit, match="num_layers=4 must divide by pipe x repeats = 16"):
        train_lm.check_sizes(TINY, run)
    with pytest.raises(SystemExit, match="batch_size=8 must divide by data x microbatches = 16"):
        train_lm.check_sizes(TINY, run_config("data=8", microbatches=2))


@pytest.mark.parametrize("flag", ["--microbatches", "--batch-size", "--steps"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_counts_below_one_are_refused_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.build_parser().parse_args([flag, value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}: must be a positive integer, got '{value}'" in error
    assert train_lm.build_parser().parse_args([flag, "3"]).__dict__[flag[2:].replace("-", "_")] == 3


def test_main_writes_pictures_and_checks(tmp_path):
    summary = train_lm.main(
        [
            "--steps", "2", "--microbatches", "2", "--no-progress", "--check",
            "--optimizer", "sgd", "--out", str(tmp_path), "--batch-size", "8",
        ]
    )  # fmt: skip
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "schedule_gpipe.png").stat().st_size > 1000
    assert summary["loss_difference"] < 1e-5
    assert summary["parameter_difference"] < 1e-5


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
