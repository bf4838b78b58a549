"""Sharded checkpoints (`eqpar.checkpoint`) across layouts: a save from 2 real processes restored
in one, model-order pipeline stacks restored under another stage count by a reshape, and
restore targets for every plan (`parallelize` on an abstract model). Helpers come from
`test_checkpoint`; the functions starting with `_child` run in processes started by
`multiprocess_util`."""

import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multiprocess_util import run_processes
from test_checkpoint import (
    ENV_DIRECTORY,
    TIMEOUT,
    assert_bitwise_equal,
    fsdp8_layout,
    is_data,
    mesh_of,
    one_device_layout,
    place,
)

import eqpar
from eqpar.checkpoint import Checkpointer, CheckpointMismatchError


def _global_state_values() -> dict:
    """The global values saved by the 2-process job, as NumPy arrays (the same in every
    process and in the test)."""
    rng = np.random.default_rng(11)
    return {
        "w": rng.normal(size=(16, 8)).astype(np.float32),
        "b": rng.normal(size=(16,)).astype(np.float32),
        "key_data": np.asarray(jax.random.key_data(jax.random.key(3))),
    }


def _child_saves_from_two_processes():
    from multiprocess_util import initialize_cpu_distributed

    process_id, _ = initialize_cpu_distributed(num_cpu_devices=4)
    import jax

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("pipe", "model"))  # row p: process p
    values = _global_state_values()

    def global_array(value, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    state = {
        "params": {
            "w": global_array(values["w"], P("pipe", "model")),
            "b": global_array(values["b"], P("pipe")),
        },
        "key": jax.random.wrap_key_data(global_array(values["key_data"], P())),
        "step": 7,
    }
    assert not state["params"]["w"].is_fully_addressable
    with Checkpointer(os.environ[ENV_DIRECTORY]) as checkpointer:
        assert checkpointer.save(7, state)
        # both processes restore onto another layout: columns over all 8 devices
        other = NamedSharding(mesh, P(None, ("pipe", "model")))
        target = {
            "params": {
                "w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=other),
                "b": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(mesh, P())),
            },
            "key": jax.ShapeDtypeStruct(
                (), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P())
            ),
            "step": 0,
        }
        restored = checkpointer.restore(target=target)
    assert restored["step"] == 7
    for shard in restored["params"]["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values["w"][shard.index])
    for shard in restored["params"]["b"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values["b"])
    print(f"process {process_id} saved and restored", flush=True)


@pytest.mark.multiprocess
def test_two_processes_write_their_own_shards_and_one_process_restores(tmp_path):
    results = run_processes(
        _child_saves_from_two_processes,
        num_processes=2,
        timeout=TIMEOUT,
        env={ENV_DIRECTORY: str(tmp_path)},
    )
    assert all(f"process {r.process_id} saved and restored" in r.stdout for r in results)
    # each process wrote its own shards into its own OCDBT directory
    item = tmp_path / "7" / "default"
    for process in (0, 1):
        written = [p for p in (item / f"ocdbt.process_{process}").rglob("*") if p.is_file()]
        assert written, f"process {process} wrote nothing"

    values = _global_state_values()
    expected = {
        "params": {"w": values["w"], "b": values["b"]},
        "key": jax.random.wrap_key_data(jnp.asarray(values["key_data"])),
        "step": 7,
    }
    abstract = {
        "params": {
            "w": jax.ShapeDtypeStruct((16, 8), jnp.float32),
            "b": jax.ShapeDtypeStruct((16,), jnp.float32),
        },
        "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype),
        "step": 0,
    }
    with Checkpointer(tmp_path) as checkpointer:
        # one process with 8 devices, FSDP-like rows over `data`; then one device
        for layout in (fsdp8_layout, one_device_layout):
            shardings = {
                "params": jax.tree.map(layout, abstract["params"]),
                "key": None,
                "step": None,
            }
            restored = checkpointer.restore(target=abstract, shardings=shardings)
            assert restored["step"] == 7
            assert restored["params"]["w"].sharding == layout(abstract["params"]["w"])
            for name in ("w", "b"):
                np.testing.assert_array_equal(
                    np.asarray(restored["params"][name]), expected["params"][name]
                )
            np.testing.assert_array_equal(
                jax.random.key_data(restored["key"]), jax.random.key_data(expected["key"])
            )


# ---------------------------------------------------------------------------------------------
# Pipeline stage counts: model-order stacks restore under another layout by a reshape


class _PipelinedNet(eqx.Module):
    head: eqx.nn.Linear
    body: Any  # a PipelineModule, or _SerialBody


class _SerialBody(eqx.Module):
    """One-device stand-in with the leaf paths of a PipelineModule (`stages/layers/...`) but the
    layers stored as one plain `[L, ...]` scanned stack."""

    stages: Any  # a ScannedLayers


def _pipelined_net(num_stages: int, num_repeats: int, key: int):
    from eqpar.nn.pipeline import PipelineModule

    keys = jax.random.split(jax.random.key(key), 9)
    layers = eqx.filter_vmap(lambda k: eqx.nn.MLP(4, 4, 8, 1, key=k))(keys[:8])
    body = PipelineModule.from_layers(
        layers, num_stages=num_stages, num_repeats=num_repeats, num_microbatches=1
    )
    return _PipelinedNet(eqx.nn.Linear(4, 2, key=keys[8]), body), layers


def _placed_on_pipe_mesh(tree, size: int):
    from eqpar.layout import partition_specs

    mesh = mesh_of((size,), ("pipe",))
    specs = partition_specs(tree)
    return jax.tree.map(
        lambda leaf, spec: (
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
            if is_data(leaf)
            else leaf
        ),
        tree,
        specs,
        is_leaf=lambda x: x is None,
    )


def test_pipeline_checkpoint_restores_under_another_stage_count_by_reshape(tmp_path):
    from eqpar.nn.pipeline import ScannedLayers

    saved, layers = _pipelined_net(8, 1, key=0)
    assert saved.body.stages.layers.layers[0].weight.shape == (8, 1, 8, 4)
    placed = jax.tree.map(
        lambda leaf, target: jax.device_put(leaf, target.sharding) if is_data(target) else leaf,
        saved,
        _placed_on_pipe_mesh(eqx.filter_eval_shape(lambda: saved), 8),
    )
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, placed)

        # PP(S=4, V=2): stored [2, 4, 1, ...], sharded P(None, "pipe", ...) on 4 devices.
        circular = eqx.filter_eval_shape(lambda: _pipelined_net(4, 2, key=1)[0])
        target = _placed_on_pipe_mesh(circular, 4)
        assert target.body.stages.layers.layers[0].weight.shape == (2, 4, 1, 8, 4)
        with pytest.raises(CheckpointMismatchError, match=r"\(shape\): \(8, 1, 8, 4\) in the"):
            checkpointer.restore(target=target)
        restored = checkpointer.restore(target=target, reshape=True)
        weight = restored.body.stages.layers.layers[0].weight
        assert weight.sharding == target.body.stages.layers.layers[0].weight.sharding
        assert_bitwise_equal(restored.body.to_layers(), layers)
        assert_bitwise_equal(restored.head, saved.head)

        # TP(8) without a pipeline (S = 1): the MLP's layers converted by a plan, split over
        # "model"; the converted layers keep their leaves, so the paths are the same.
        plan = {
            "body/stages/layers/layers/0": eqpar.ColumnParallel(),
            "body/stages/layers/layers/1": eqpar.RowParallel(),
        }
        tp = eqpar.parallelize(eqx.filter_eval_shape(lambda: _pipelined_net(1, 1, key=2)[0]), plan)
        tp_mesh = mesh_of((1, 8), ("pipe", "model"))
        tp = jax.tree.map(
            lambda leaf, spec: (
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(tp_mesh, spec))
                if is_data(leaf)
                else leaf
            ),
            tp,
            eqpar.partition_specs(tp),
            is_leaf=lambda x: x is None,
        )
        restored = checkpointer.restore(target=tp, reshape=True)
        weight = restored.body.stages.layers.layers[0].weight
        assert weight.shape == (1, 8, 8, 4)
        assert weight.sharding.spec == P("pipe", None, "model", None)
        assert_bitwise_equal(eqpar.unparallelize(restored.body.to_layers()), layers)
        assert_bitwise_equal(restored.head, saved.head)

        # One device, a plain [8, ...] scanned stack at the same leaf paths.
        serial = eqx.filter_eval_shape(
            lambda: _PipelinedNet(saved.head, _SerialBody(ScannedLayers(layers)))
        )
        serial = place(serial, one_device_layout)
        restored = checkpointer.restore(target=serial, reshape=True)
        assert restored.body.stages.layers.layers[0].weight.shape == (8, 8, 4)
        assert_bitwise_equal(restored.body.stages.layers, layers)
        assert_bitwise_equal(restored.head, saved.head)

        # Another layer of the same size (transposed) stays a mismatch even with reshape=True.
        transposed = eqx.tree_at(
            lambda n: n.head.weight, serial, jax.ShapeDtypeStruct((4, 2), jnp.float32)
        )
        with pytest.raises(CheckpointMismatchError, match=r"`head/weight` \(shape\): \(2, 4\)"):
            checkpointer.restore(target=transposed, reshape=True)

        # Sizes that differ stay a mismatch even with reshape=True.
        wrong = eqx.tree_at(
            lambda n: n.head.weight, serial, jax.ShapeDtypeStruct((3, 4), jnp.float32)
        )
        with pytest.raises(CheckpointMismatchError, match=r"`head/weight` \(shape\): \(2, 4\)"):
            checkpointer.restore(target=wrong, reshape=True)


def test_reshape_refuses_other_layers_of_the_same_size(tmp_path):
    from eqpar.nn.pipeline import ScannedLayers

    def linears(count: int, out: int) -> ScannedLayers:
        keys = jax.random.split(jax.random.key(0), count)
        return ScannedLayers(eqx.filter_vmap(lambda k: eqx.nn.Linear(4, out, key=k))(keys))

    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, {"stack": linears(2, 8), "raw": jnp.zeros((2, 8, 4))})
        # Two Linear(4, 8) hold as many numbers as four Linear(4, 4), but they are other layers.
        target = eqx.filter_eval_shape(
            lambda: {"stack": linears(4, 4), "raw": jnp.zeros((2, 8, 4))}
        )
        with pytest.raises(CheckpointMismatchError) as caught:
            checkpointer.restore(target=target, reshape=True)
        message = str(caught.value)
        assert (
            "first mismatching leaf: `stack/layers/weight` (shape): (2, 8, 4) in the checkpoint, "
            "(4, 4, 4) in the target; one layer is (8, 4) in the checkpoint but (4, 4) in the "
            "target, and `reshape=True` changes only the stacking dimensions" in message
        )
        assert "`stack/layers/bias` (shape): (2, 8) in the checkpoint" in message
        # An array outside a ScannedLayers / PipelineModule has no stacking dimensions.
        target = {
            "stack": eqx.filter_eval_shape(lambda: linears(2, 8)),
            "raw": jnp.zeros((4, 4, 4)),
        }
        with pytest.raises(CheckpointMismatchError, match=r"`raw` \(shape\): .* is not in one"):
            checkpointer.restore(target=target, reshape=True)

        # The checkpoint's own stacking depth counts too: three layers of (2, 4) are not six
        # layers of (4,), though (3, 2, 4) ends in (4,).
        checkpointer.save(1, {"stack": ScannedLayers({"w": jnp.zeros((3, 2, 4))})})
        target = {"stack": ScannedLayers({"w": jax.ShapeDtypeStruct((6, 4), jnp.float32)})}
        with pytest.raises(
            CheckpointMismatchError, match=r"one layer is \(2, 4\) in the checkpoint"
        ):
            checkpointer.restore(1, target=target, reshape=True)


# ---------------------------------------------------------------------------------------------
# Restore targets for every plan: `parallelize` on an abstract model


class _PlannedBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout
    raw: jax.Array

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=k1)
        self.up, self.down = eqx.nn.Linear(8, 16, key=k2), eqx.nn.Linear(16, 8, key=k3)
        self.norm, self.dropout = eqx.nn.LayerNorm(8), eqx.nn.Dropout(0.1)
        self.raw = jax.random.normal(k4, (8, 8))

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x)))) @ self.raw


class _PlannedModel(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(16, 8, key=keys[0])
        self.layers = [_PlannedBlock(k) for k in keys[1:]]

    def __call__(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


_BLOCK = r"layers/\d+"
_TP = {f"{_BLOCK}/up": eqpar.ColumnParallel(), f"{_BLOCK}/down": eqpar.RowParallel()}
_PLANS = {
    "column-row": _TP,
    "head": {f"{_BLOCK}/attention": eqpar.HeadParallel()},
    "context": {f"{_BLOCK}/attention": eqpar.ContextParallel()},
    "vocab": {"embed": eqpar.VocabParallel()},
    "feature": {"embed": eqpar.FeatureParallel()},
    "sequence": {f"{_BLOCK}/dropout": eqpar.SequenceParallel()},
    "replicated": {f"{_BLOCK}/norm": eqpar.Replicated()},
    "remat": {_BLOCK: eqpar.Remat()},
    "split-sequence": {"layers": eqpar.SplitSequence()},
    "sharded": {f"{_BLOCK}/raw": eqpar.Sharded(P(None, "model"))},
    "pipeline": {"layers": eqpar.Pipeline(stages=2, microbatches=2)},
    "circular": {"layers": eqpar.Pipeline(stages=2, microbatches=2, repeats=2)},
    "1f1b": {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")},
    "pipeline-tp": {"layers": eqpar.Pipeline(stages=2, microbatches=2), **_TP},
}


@pytest.mark.parametrize("plan", list(_PLANS.values()), ids=list(_PLANS))
def test_parallelize_builds_the_abstract_parallel_model_with_every_style(plan):
    """`parallelize(eqx.filter_eval_shape(...), plan)` is the parallel model with
    ShapeDtypeStructs for arrays: the structure, shapes, dtypes and layout of the concrete
    one (a restore target), and `unparallelize` gives the abstract plain model back. (The
    ExpertParallel style: tests/test_experts.py.) On the old code a Pipeline entry failed:
    "the layers have no array leaves"."""
    abstract = eqx.filter_eval_shape(_PlannedModel, jax.random.key(0))
    parallel = eqpar.parallelize(abstract, plan)
    concrete = eqpar.parallelize(_PlannedModel(jax.random.key(0)), plan)
    is_array = lambda leaf: isinstance(leaf, jax.Array)
    assert not any(map(is_array, jax.tree.leaves(parallel)))
    assert jax.tree.structure(parallel) == jax.tree.structure(concrete)
    structs = lambda tree: [
        (leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(tree) if is_data(leaf)
    ]
    assert structs(parallel) == structs(concrete)
    assert eqpar.partition_specs(parallel) == eqpar.partition_specs(concrete)
    back = eqpar.unparallelize(parallel)
    assert jax.tree.structure(back) == jax.tree.structure(abstract)
    assert structs(back) == structs(abstract)


def test_a_pipelined_checkpoint_restores_into_the_abstract_parallel_model(tmp_path):
    """Saved from a model pipelined by a plan, restored into `parallelize(filter_eval_shape(
    ...), plan)` placed by its own specs; a plain target gets a mismatch that names the fix."""
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2)}
    mesh = mesh_of((2,), ("pipe",))
    saved = eqpar.parallelize(_PlannedModel(jax.random.key(0)), plan)
    saved = eqx.filter_shard(saved, eqpar.named_shardings(eqpar.partition_specs(saved), mesh))
    abstract = eqx.filter_eval_shape(_PlannedModel, jax.random.key(1))
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, saved)
        target = eqpar.parallelize(abstract, plan)
        shardings = eqpar.named_shardings(eqpar.partition_specs(target), mesh)
        restored = checkpointer.restore(target=target, shardings=shardings)
        assert_bitwise_equal(restored, saved)
        stacked = restored.layers.pipeline.stages.layers.up.weight
        assert stacked.sharding.spec[0] == "pipe" and stacked.shape == (2, 2, 16, 8)
        assert_bitwise_equal(eqpar.unparallelize(restored), eqpar.unparallelize(saved))

        with pytest.raises(CheckpointMismatchError) as caught:
            checkpointer.restore(target=abstract)
        message = str(caught.value)
        assert "`layers/0/up/weight` (missing leaf)" in message
        assert (
            "The checkpoint holds a parallelized model (its pipelined blocks stored stacked) "
            "and `target` a plain one: restore into the parallelized structure, "
            "`eqpar.parallelize(eqx.filter_eval_shape(Model, ...), plan)`" in message
        )
        assert "or save `eqpar.unparallelize(model)` instead" in message

        # The other way round: a plain checkpoint, a parallelized target.
        checkpointer.save(1, eqpar.unparallelize(saved))
        with pytest.raises(CheckpointMismatchError, match="restore into the plain structure"):
            checkpointer.restore(1, target=target, shardings=shardings)
