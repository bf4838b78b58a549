"""`eqpar.check` and hand-written attention: a GPT-2 port whose head count is an `int` field.

Under the documented Column/Row plan each device holds `n_head / n` heads of the query, key
and value projections, but the author's `x.reshape(seq, self.n_head, -1)` splits them into
`n_head` groups: silently wrong before. Now the block is refused at trace time naming the
field, `HeadParallel(fields=("n_head",))` makes it right, and `eqpar.check` names the first
module whose output differs in the cases no trace-time rule sees.
"""

import equinox as eqx
import gpt2_port as gpt
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import eqpar

TP = {
    r"blocks/\d+/attn/(q|k|v)_proj": eqpar.ColumnParallel(),
    r"blocks/\d+/attn/c_proj": eqpar.RowParallel(),
    r"blocks/\d+/mlp/c_fc": eqpar.ColumnParallel(),
    r"blocks/\d+/mlp/c_proj": eqpar.RowParallel(),
}
HEADS = {r"blocks/\d+/attn": eqpar.HeadParallel(fields=("n_head",))}


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> eqpar.DeviceMesh:
    return eqpar.DeviceMesh(shape, names, devices=jax.devices()[: int(jnp.prod(jnp.array(shape)))])


@pytest.fixture(scope="module")
def gpt2():
    return gpt.GPT(key=jax.random.key(0)), gpt.batch(4)


def test_a_reshape_by_a_global_head_count_is_refused_naming_the_field(gpt2):
    model, (tokens, keys) = gpt2
    mesh = mesh_of((2, 4), ("data", "model"))
    parallel = eqpar.parallelize(model, TP, mesh=mesh)
    step = eqpar.shard_map(
        lambda m, t, k: lax.pmean(gpt.loss(m, t, k), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P("data"), P("data")),
        out_specs=P(),
    )
    with pytest.raises(
        ValueError, match=r"int field `n_head` \(4\).*HeadParallel\(fields=\('n_head',\)"
    ):
        step(parallel, tokens, keys)


@pytest.mark.parametrize(
    ("shape", "fsdp"), [((2, 4), False), ((4, 2), True)], ids=["dp2xtp4", "fsdp4xtp2"]
)
def test_head_parallel_fields_equal_one_device(gpt2, shape, fsdp):
    """Loss and every gradient leaf against one device at 1e-5 of its scale, by `eqpar.check`
    (the parameters are the same, so an SGD update `w - lr * g` agrees as its gradient
    does); dropout on the attention weights included: each device draws its heads' block of
    the serial mask."""
    model, batch = gpt2
    mesh = mesh_of(shape, ("data", "model"))
    parallel = eqpar.parallelize(model, {**TP, **HEADS}, mesh=mesh)
    assert eqpar.unparallelize(parallel).blocks[0].attn.n_head == gpt.HEADS
    if fsdp:
        storage = eqpar.FSDP(mesh, axis="data", min_size_bytes=0).partition_specs(parallel)
        parallel = eqx.filter_shard(parallel, eqpar.named_shardings(storage, mesh))
    report = eqpar.check(gpt.loss, parallel, *batch, mesh=mesh, batch_specs=P("data"))
    assert report.ok and len(report.leaves) > 30


def test_head_parallel_fields_refuse_what_they_cannot_split(gpt2):
    model, _ = gpt2
    with pytest.raises(TypeError, match="no int field 'n_heads'"):
        eqpar.parallelize(model, {r"blocks/\d+/attn": eqpar.HeadParallel(fields=("n_heads",))})
    with pytest.raises(ValueError, match="n_head=4, which does not divide by the size of axis"):
        eqpar.parallelize(model, {**TP, **HEADS}, mesh=mesh_of((8,), ("model",)))
    with pytest.raises(TypeError, match="fields"):
        eqpar.HeadParallel(fields="n_head")  # type: ignore[arg-type]


class ConstantHeads(eqx.Module):
    """Attention whose head count is a module-level constant: no field for a rule to read."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, x):
        seq = x.shape[0]
        q, k, v = (y.reshape(seq, 4, -1) for y in jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1))
        return jax.vmap(self.out)(jax.nn.dot_product_attention(q, k, v).reshape(seq, -1))


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    attention: ConstantHeads
    head: eqx.nn.Linear

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        return jax.vmap(self.head)(x + self.attention(x))


def constant_heads_model() -> Model:
    k = jax.random.split(jax.random.key(3), 4)
    attention = ConstantHeads(eqx.nn.Linear(16, 48, key=k[0]), eqx.nn.Linear(16, 16, key=k[1]))
    return Model(eqx.nn.Embedding(32, 16, key=k[2]), attention, eqx.nn.Linear(16, 32, key=k[3]))


def lm_loss(model, tokens):
    logits = jax.vmap(model)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_check_names_the_first_differing_module_where_no_rule_sees_the_cause():
    """The three columns of one fused projection split per device (each device's block holds
    pieces of q, k and v alike): silently wrong, and only the numbers show it."""
    model = constant_heads_model()
    tokens = jax.random.randint(jax.random.key(4), (4, 9), 0, 32)
    mesh = mesh_of((2, 2), ("data", "model"))
    plan = {"attention/qkv": eqpar.ColumnParallel(), "attention/out": eqpar.RowParallel()}
    report = eqpar.check(lm_loss, model, tokens, mesh=mesh, plan=plan, raise_on_mismatch=False)
    assert not report.ok
    assert report.first_difference == "attention/out" and report.first_kind == "RowParallelLinear"
    assert any("mixes devices' features" in cause for cause in report.causes)
    with pytest.raises(
        eqpar.ParityError, match="first module whose output differs: 'attention/out'"
    ):
        eqpar.check(lm_loss, model, tokens, mesh=mesh, plan=plan)


def test_check_catches_a_dropout_kept_plain_on_split_heads(gpt2):
    """The earlier rounds' silently wrong dropout: one mask on every device's block."""
    model, batch = gpt2
    mesh = mesh_of((2, 4), ("data", "model"))
    plan = {**TP, **HEADS, r"blocks/\d+/attn/attn_dropout": eqpar.Replicated()}
    report = eqpar.check(gpt.loss, model, *batch, mesh=mesh, plan=plan, raise_on_mismatch=False)
    assert not report.ok
    # Its output, this device's heads, is compared with the serial output's blocks of heads.
    assert report.first_difference == "blocks/0/attn/attn_dropout"
    assert report.first_kind == "Dropout"
    assert any("repeats one mask on every device's block" in c for c in report.causes)
    assert "FAIL" in str(report)


def test_check_refuses_bad_arguments():
    model = constant_heads_model()
    mesh = mesh_of((2,), ("data",))
    with pytest.raises(ValueError, match="pass a small batch"):
        eqpar.check(lm_loss, model, mesh=mesh)
    with pytest.raises(ValueError, match="one per batch argument"):
        eqpar.check(lm_loss, model, jnp.zeros((2, 9), int), mesh=mesh, batch_specs=(P(), P()))


CP = {
    "blocks": eqpar.SplitSequence("context"),
    r"blocks/\d+/attn": eqpar.ContextParallel(axis_name="context"),
}


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_context_parallel_on_a_hand_written_block_that_calls_dot_product_attention(
    strategy, monkeypatch
):
    """The block's own `jax.nn.dot_product_attention(..., is_causal=True)` runs as ring (or
    Ulysses) attention on its block of the sequence; the learned positions, sliced by
    `[:seq]` before the blocks, stay global; the residual dropouts draw their rows of the
    serial mask."""
    model = gpt.GPT(key=jax.random.key(0), fused=True)
    mesh = mesh_of((2, 4), ("data", "context"))
    plan = {**CP, r"blocks/\d+/attn": eqpar.ContextParallel(strategy=strategy)}
    from eqpar.nn import _attention_calls

    called = []
    attend = getattr(_attention_calls, f"{strategy}_attention")
    monkeypatch.setattr(
        _attention_calls,
        f"{strategy}_attention",
        lambda *args, **kwargs: called.append(1) or attend(*args, **kwargs),
    )
    report = eqpar.check(
        gpt.loss, model, *gpt.batch(4), mesh=mesh, plan=plan, batch_specs=P("data")
    )
    assert report.ok and called
    assert (
        type(eqpar.unparallelize(eqpar.parallelize(model, CP)).blocks[0].attn) is gpt.FusedAttention
    )


def test_context_parallel_on_einsum_attention_is_refused_naming_the_route(gpt2):
    model, batch = gpt2
    mesh = mesh_of((2, 4), ("data", "context"))
    with pytest.raises(ValueError, match=r"without calling jax.nn.dot_product_attention.*Call jax"):
        eqpar.check(gpt.loss, model, *batch, mesh=mesh, plan=CP, batch_specs=P("data"))
    with pytest.raises(ValueError, match="strategy='ring' or 'ulysses'"):
        eqpar.parallelize(model, {r"blocks/\d+/attn": eqpar.ContextParallel(strategy="all_gather")})


def test_bfloat16_compute_is_checked_at_bfloat16_tolerance(gpt2):
    """float32 parameters, bfloat16 matrix products: `check` reads the compute dtype off the
    step and compares at bfloat16's tolerance."""
    model, batch = gpt2
    policy = eqpar.Precision.bfloat16()

    def loss(m, tokens, keys):
        return policy.cast_to_output(gpt.loss(policy.cast_to_compute(m), tokens, keys))

    mesh = mesh_of((2, 4), ("data", "model"))
    report = eqpar.check(loss, model, *batch, mesh=mesh, plan={**TP, **HEADS})
    assert report.ok and report.leaves[0].tolerance == pytest.approx(4e-2)


def test_a_checkpoint_restores_onto_another_tensor_parallel_size(gpt2, tmp_path):
    """Head counts stay global outside the parallel region, so a checkpoint written with 4
    heads split over model=4 restores bit for bit into the abstract model split over
    model=2, which then trains as one device does."""
    model, batch = gpt2
    plan = {**TP, **HEADS}
    mesh4 = mesh_of((2, 4), ("data", "model"))
    parallel = eqpar.parallelize(model, plan, mesh=mesh4)
    parallel = eqx.filter_shard(
        parallel, eqpar.named_shardings(eqpar.partition_specs(parallel), mesh4)
    )
    mesh2 = mesh_of((4, 2), ("data", "model"))
    abstract = eqpar.parallelize(eqx.filter_eval_shape(gpt.GPT, key=jax.random.key(0)), plan)
    shardings = eqpar.named_shardings(eqpar.partition_specs(abstract), mesh2)
    arrays, rest = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    target = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        arrays,
        shardings,
    )
    target = eqx.combine(target, rest)
    with eqpar.checkpoint.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, parallel)
        restored = checkpointer.restore(target=target)
    assert restored.blocks[0].attn.q_proj.weight.sharding.spec == P("model", None)
    assert restored.blocks[0].attn.q_proj.weight.sharding.mesh.shape["model"] == 2
    assert eqx.tree_equal(eqpar.unparallelize(restored), model)
    assert eqpar.check(gpt.loss, restored, *batch, mesh=mesh2, batch_specs=P("data")).ok
