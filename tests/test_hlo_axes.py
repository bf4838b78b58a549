"""Collectives of a compiled program attributed to the mesh axes their device groups span."""

import jax
import jax.numpy as jnp
import numpy as np
from _hlo import collective_bytes_by_axes, collective_ops, device_groups, group_axes
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

SIZES = {"data": 2, "pipe": 2, "model": 2}


def test_device_groups_reads_every_form():
    assert device_groups("x = f32[4] all-reduce(y), replica_groups={{0,2},{1,3}}, ", 4) == (
        (0, 2),
        (1, 3),
    )
    assert device_groups("replica_groups=[2,4]<=[8]", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert device_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == (
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
    )
    line = "replica_groups=mesh['a'=4,'b'=1,'c'=2], device_ids=([2,4]T(1,0)) {'a'}, x"
    assert device_groups(line, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert device_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}", 8) == (
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
    )
    permute = "x = f32[2] collective-permute(y), source_target_pairs={{0,1},{1,0}}, "
    assert device_groups(permute, 2) == ((0, 1), (1, 0))
    assert device_groups("replica_groups={}", 4) == ((0, 1, 2, 3),)
    assert group_axes(((0, 4), (1, 5)), SIZES) == ("data",)
    assert group_axes(((0, 1, 2, 3),), SIZES) == ("pipe", "model")
    assert group_axes(((0,), (1,)), SIZES) == ()


def test_bytes_by_axes_of_a_compiled_program():
    mesh = jax.make_mesh(tuple(SIZES.values()), tuple(SIZES), axis_types=(AxisType.Auto,) * 3)

    def body(x):
        a = lax.psum(x, "model")  # all-reduce over model
        b = lax.psum(a, ("data", "pipe"))  # all-reduce over data and pipe
        c = lax.ppermute(b, "pipe", [(0, 1), (1, 0)])  # swap over pipe
        return c

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(("data", "pipe", "model")), out_specs=P("pipe")),
        in_shardings=NamedSharding(mesh, P(("data", "pipe", "model"))),
    )
    compiled = f.lower(jnp.zeros((8 * 256,), jnp.float32)).compile()
    block = 256 * 4
    found = collective_bytes_by_axes(compiled, SIZES)
    expected = {
        ("model",): 2 * block * 1 / 2,
        ("data", "pipe"): 2 * block * 3 / 4,
        ("pipe",): block,
    }
    assert {axes: found[axes] for axes in expected} == expected
    assert not any(value for axes, value in found.items() if axes not in expected)
    np.testing.assert_equal(sum(found.values()), sum(expected.values()))


def test_group_size_of_mesh_groups_with_device_ids():
    from _hlo import _group_size

    line = (
        "x = f32[] all-reduce(y), replica_groups=mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}"
    )
    assert _group_size(line, 8) == 4
    assert _group_size("x = f32[] all-reduce(y), replica_groups=mesh['a'=2,'b'=4] {'a'}", 8) == 2


def test_collectives_inside_conditionals_are_marked():
    mesh = jax.make_mesh(tuple(SIZES.values()), tuple(SIZES), axis_types=(AxisType.Auto,) * 3)

    def body(x, index):
        x = lax.psum(x, "model")  # runs every time: exact

        def shift(pairs):
            return lambda x: lax.ppermute(x, "pipe", pairs)

        # which branch runs depends on the data: the text cannot say
        return lax.switch(index[0], [shift([(0, 1)]), shift([(0, 1), (1, 0)]), lambda x: x], x)

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(("data", "pipe", "model")), P()),
            out_specs=P(("data", "pipe")),
        )
    )
    x = jnp.zeros((8 * 256,), jnp.float32)
    ops = collective_ops(f.lower(x, jnp.zeros((1,), jnp.int32)).compile())
    kinds = {(op.kind, op.in_conditional) for op in ops}
    assert kinds == {("all-reduce", False), ("collective-permute", True)}
    # counted at the busiest branch: the swap, both pairs of it on every pipe group
    (permute,) = [op for op in ops if op.kind == "collective-permute"]
    assert len(permute.groups) == 2 * 4


def test_predicated_conditional_is_one_conditional():
    # `true_computation` / `false_computation`: one of the two runs, the busier one counts
    text = """HloModule m, num_partitions=2

%yes (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %r = f32[4] all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

%no (q: f32[4]) -> f32[4] {
  %q = f32[4] parameter(0)
  ROOT %s = f32[4] all-gather(%q), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[4], c: pred[]) -> f32[4] {
  %a = f32[4] parameter(0)
  %c = pred[] parameter(1)
  %g = f32[4] all-reduce(%a), replica_groups={{0,1}}, to_apply=%add
  ROOT %k = f32[4] conditional(%c, %g, %g), true_computation=%yes, false_computation=%no
}
"""
    ops = collective_ops(text)
    assert [(op.name, op.in_conditional) for op in ops] == [("g", False), ("r", True)]
