import io

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from eqpar.distributions import FSDP, DataParallel, ModelParallel
from eqpar.inspect import LayoutRow, layout_table, print_layout_table
from eqpar.layout import LayoutMap, partition_specs
from eqpar.mesh import DeviceMesh


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(16, 8, 64, 1, key=jax.random.key(0))


def model_parallel():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    layout_map = LayoutMap(mesh)
    layout_map["layers/0/weight"] = ("model", None)
    layout_map["layers/0/bias"] = ("model",)
    layout_map["layers/1/weight"] = (None, "model")
    return ModelParallel(layout_map=layout_map)


def test_rows_and_totals_for_a_distribution(mlp):
    table = layout_table(mlp, model_parallel())
    assert [row.path for row in table.rows] == [
        "layers/0/weight",
        "layers/0/bias",
        "layers/1/weight",
        "layers/1/bias",
    ]
    first = table.rows[0]
    assert first == LayoutRow(
        path="layers/0/weight",
        shape=(64, 16),
        dtype="float32",
        spec=P("model", None),
        bytes_total=64 * 16 * 4,
        bytes_per_device=64 * 16 * 4 // 4,
    )
    assert table.rows[3].spec == P() and table.rows[3].bytes_per_device == 8 * 4
    assert table.bytes_total == (64 * 16 + 64 + 8 * 64 + 8) * 4
    assert table.bytes_per_device == (64 * 16 + 64 + 8 * 64) * 4 // 4 + 8 * 4
    assert table.mesh_shape == {"data": 2, "model": 4}


def test_fsdp_table_splits_eight_ways(mlp):
    table = layout_table(mlp, FSDP(min_size_bytes=0))
    assert table.bytes_per_device * 8 == table.bytes_total


def test_specs_with_a_mesh_and_abstract_models():
    abstract = eqx.filter_eval_shape(lambda k: eqx.nn.Linear(16, 12, key=k), jax.random.key(0))
    specs = eqx.tree_at(lambda s: s.weight, partition_specs(abstract), P("data", None))
    table = layout_table(abstract, specs, mesh=DeviceMesh((8,), ("data",)))
    # 12 rows over 8 devices: the largest shard has 2 rows (JAX pads uneven shards).
    assert table.rows[0].bytes_per_device == 2 * 16 * 4
    # A single spec covers every leaf.
    everywhere = layout_table(abstract, P(), mesh=DeviceMesh((8,), ("data",)))
    assert everywhere.bytes_per_device == everywhere.bytes_total


def test_reads_the_shardings_of_placed_arrays(mlp):
    d = model_parallel()
    table = layout_table(d.distribute_model(mlp))
    assert table.rows[2].spec == P(None, "model")
    assert table.bytes_per_device == layout_table(mlp, d).bytes_per_device


def test_errors_name_the_problem(mlp):
    with pytest.raises(ValueError, match="a specs pytree needs mesh="):
        layout_table(mlp, partition_specs(mlp))
    with pytest.raises(ValueError, match="leaf 'layers/0/weight' has no NamedSharding"):
        layout_table(mlp)
    specs = eqx.tree_at(lambda s: s.layers[1].bias, partition_specs(mlp), None)
    with pytest.raises(ValueError, match=r"layout_table: model\.layers\[1\]\.bias is an array"):
        layout_table(mlp, specs, mesh=DeviceMesh((8,), ("data",)))
    with pytest.raises(ValueError, match="layout_table: the specs for model do not fit"):
        layout_table(mlp, {"w": P()}, mesh=DeviceMesh((8,), ("data",)))
    with pytest.raises(ValueError, match="no array leaves"):
        layout_table({"name": "nothing"})
    mesh_a = DeviceMesh((8,), ("data",))
    mesh_b = DeviceMesh((2, 4), ("data", "model"))
    mixed = {
        "a": jax.device_put(jnp.ones(8), mesh_a.sharding(P())),
        "b": jax.device_put(jnp.ones(8), mesh_b.sharding(P())),
    }
    with pytest.raises(ValueError, match="different meshes"):
        layout_table(mixed)


def test_plain_text_rendering(mlp):
    table = layout_table(mlp, model_parallel())
    text = str(table)
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "spec", "bytes/device"]
    assert "layers/0/weight" in lines[2] and "P('model', None)" in lines[2]
    assert "1.00 KiB" in lines[2]  # 4 KiB over 4 devices
    assert lines[-1].startswith("total (4 leaves") and "mesh data=2 x model=4" in lines[-1]
    assert lines[-1].endswith("1.59 KiB")  # (1024 + 64 + 512) * 4 / 4 + 8 * 4 = 1632 bytes


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_print_layout_table_plain_when_piped_rich_in_a_terminal(mlp):
    piped = io.StringIO()
    table = print_layout_table(mlp, DataParallel(), file=piped)
    assert piped.getvalue() == table.to_text() + "\n"
    terminal = FakeTerminal()
    print_layout_table(mlp, DataParallel(), file=terminal)
    rendered = terminal.getvalue()
    assert "parameter layout" in rendered and "layers/1/bias" in rendered
    assert "│" in rendered or "┃" in rendered  # box drawing: a rich table
    assert table.to_rich().row_count == 4


def test_rich_layout_table_shows_every_whole_path_at_80_columns():
    # Paths as long as the example LM's: a terminal of 80 columns shows each one whole,
    # wrapped after a `/`, instead of cutting them all to "body/stages/la…".
    from rich.console import Console

    leaf = jnp.zeros((2, 2, 32, 32))
    attention = {name: {"weight": leaf} for name in ("query_proj", "key_proj", "output_proj")}
    model = {"body": {"stages": {"layers": {"attention": attention}}}, "embed": {"weight": leaf}}
    mesh = DeviceMesh((2, 4), ("pipe", "model"))
    specs = jax.tree.map(lambda _: P("pipe", None, "model", None), model)
    table = layout_table(model, specs, mesh=mesh)
    paths = [row.path for row in table.rows]
    assert max(len(p) for p in paths) == len("body/stages/layers/attention/output_proj/weight")

    def rendered(width):
        out = io.StringIO()
        Console(file=out, width=width, color_system=None).print(table)
        return out.getvalue().splitlines()

    narrow = rendered(80)
    assert max(len(line) for line in narrow) <= 80
    assert "…" not in "".join(narrow)  # nothing cut
    assert "parameter layout (every leaf float32)" in narrow[0]  # one dtype: in the title
    path_column = "".join(line.split("│")[1].strip() for line in narrow if line.startswith("│"))
    for path in paths:  # every path whole, in order, its lines joined
        assert path in path_column
    assert any(line.startswith("│ body/stages/layers/") for line in narrow)
    wide = rendered(200)  # room enough: one line per leaf, every column
    assert any("│ body/stages/layers/attention/output_proj/weight " in line for line in wide)
    assert "dtype" in wide[2] and max(len(line) for line in wide) < 200


# --- eqpar/_hlo.py: reading compiled programs ---------------------------------------------


def load_hlo_helpers():
    import _hlo

    return _hlo


def test_hlo_counts_collectives_inside_loops_per_iteration():
    hlo = load_hlo_helpers()
    mesh = DeviceMesh((8,), ("d",)).jax_mesh
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def local(x):
        def body(carry, _):
            carry = jax.lax.ppermute(carry, "d", ring)
            return carry + jax.lax.psum(carry, "d"), None

        carry, _ = jax.lax.scan(body, x, None, length=5)
        return jax.lax.all_gather(carry, "d", tiled=True), jax.lax.psum_scatter(
            carry, "d", tiled=True
        )

    f = jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=(P(), P("d")), check_vma=False)
    compiled = jax.jit(f).lower(jnp.ones((64, 4))).compile()
    block = 8 * 4 * 4  # the local [8, 4] float32 block
    summary = hlo.collective_summary(compiled)
    assert summary.counts == {
        "collective-permute": 5,
        "all-reduce": 5,
        "all-gather": 1,
        "reduce-scatter": 1,
    }
    assert summary.bytes["collective-permute"] == 5 * block
    assert summary.bytes["all-reduce"] == 5 * 2 * block * 7 / 8
    assert summary.bytes["all-gather"] == 8 * block * 7 / 8
    assert summary.bytes["reduce-scatter"] == block * 7 / 8

    # a shift without the wrap-around pair: 7 of the 8 devices receive a block
    chain = [(i, i + 1) for i in range(7)]
    shift = jax.shard_map(
        lambda x: jax.lax.ppermute(x, "d", chain), mesh=mesh, in_specs=P("d"), out_specs=P("d")
    )
    shifted = hlo.collective_summary(jax.jit(shift).lower(jnp.ones((64, 4))).compile())
    assert shifted.bytes["collective-permute"] == block * 7 / 8
    assert summary.loops_without_trip_count == 0
    assert hlo.collective_bytes(compiled.as_text()) == summary.total_bytes


def test_hlo_reads_compiler_partitioned_programs():
    hlo = load_hlo_helpers()
    mesh = DeviceMesh((2, 4), ("data", "model"))

    def loss(w, x):
        return jnp.tanh(x @ w.T).sum()

    f = jax.jit(
        jax.value_and_grad(loss),
        in_shardings=(mesh.sharding(P("model", None)), mesh.sharding(P("data", None))),
    )
    compiled = f.lower(jnp.ones((16, 8)), jnp.ones((4, 8))).compile()
    ops = hlo.collective_ops(compiled)
    # The loss is summed over "model" (4 devices), then the loss and the weight gradient
    # [4, 8] are summed over "data" (2 devices) in one combined all-reduce.
    assert [(op.kind, op.group_size, op.array_bytes) for op in ops] == [
        ("all-reduce", 4, 4),
        ("all-reduce", 2, 4 + 4 * 8 * 4),
    ]
    figures = hlo.memory_figures(compiled)
    assert figures["argument"] == (4 * 8 + 2 * 8) * 4
    assert figures["total"] == (
        figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
    )
    wrapped = eqx.filter_jit(loss).lower(jnp.ones((16, 8)), jnp.ones((4, 8))).compile()
    assert hlo.collective_ops(wrapped) == []
    assert hlo.memory_figures(wrapped)["argument"] == (16 * 8 + 4 * 8) * 4
    assert hlo.format_bytes(1536) == "1.50 KiB" and hlo.format_bytes(12) == "12 B"
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo.collective_ops("HloModule empty")


def test_layout_table_names_an_unknown_axis():
    import equinox as eqx
    import jax
    import pytest
    from jax.sharding import PartitionSpec as P

    from eqpar import DeviceMesh
    from eqpar.inspect import layout_table

    linear = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    specs = eqx.tree_at(lambda m: (m.weight, m.bias), linear, (P("nope"), P()))
    with pytest.raises(ValueError, match=r"'weight' names the axis 'nope'.*its axes: \('data',\)"):
        layout_table(linear, specs, mesh=DeviceMesh((8,), ("data",)))


def test_layout_table_names_a_spec_longer_than_the_leaf_rank():
    linear = eqx.nn.Linear(16, 8, key=jax.random.key(0))
    specs = eqx.tree_at(lambda m: (m.weight, m.bias), linear, (P(), P(None, "data")))
    with pytest.raises(
        ValueError,
        match=r"layout_table: the layout gives P\(None, 'data'\) for leaf 'bias' of shape "
        r"\(8,\): 2 entries but only 1 dimensions\. Drop the extra entries",
    ):
        layout_table(linear, specs, mesh=DeviceMesh((8,), ("data",)))


# --- plot_layout: the layout as a picture ----------------------------------------------------


def boxes_per_leaf(fig):
    """`{leaf path: number of boxes}` of a `plot_layout` figure (each box's gid is its path)."""
    counts = {}
    for patch in fig.axes[0].patches:
        counts[patch.get_gid()] = counts.get(patch.get_gid(), 0) + 1
    return counts


def test_plot_layout_draws_one_box_per_shard(mlp):
    from eqpar.inspect import plot_layout

    d = model_parallel()  # [64, 16] P("model", None); [64] P("model"); [8, 64] P(None, "model")
    fig = plot_layout(mlp, d)
    (ax,) = fig.axes
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert [label.splitlines()[0] for label in labels] == [
        row.path for row in layout_table(mlp, d).rows
    ]
    assert "[64, 16] P('model', None)" in labels[0] and "1.00 KiB/device" in labels[0]
    assert boxes_per_leaf(fig) == {
        "layers/0/weight": 4,
        "layers/0/bias": 4,
        "layers/1/weight": 4,
        "layers/1/bias": 1,
    }
    texts = [t.get_text() for t in ax.texts]
    # Block 1 of the row-split weight: rows 16:32, model coordinate 1, on devices 1 and 5.
    assert "[16:32, :]\nmodel 1\ndev 1, 5" in texts
    assert "[:, 48:64]\nmodel 3\ndev 3, 7" in texts
    assert "replicated\nall 8 devices" in texts
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["split over 'model'", "replicated"]
    assert "data=2 x model=4" in fig.get_suptitle()


def test_plot_layout_two_axes_selection_and_row_limit(mlp):
    from eqpar.inspect import plot_layout

    mesh = DeviceMesh((2, 4), ("data", "model"))
    specs = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight, m.layers[1].bias),
        partition_specs(mlp),
        (P("model", "data"), P(("data", "model")), P(None, "model"), P()),
    )
    fig = plot_layout(mlp, specs, mesh=mesh, leaves=".*weight")
    assert len(fig.axes[0].get_yticks()) == 2
    assert boxes_per_leaf(fig) == {"layers/0/weight": 8, "layers/1/weight": 4}
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any(t.endswith("data 1 · model 0\ndev 4") for t in texts)  # rows 0:16, cols 8:16
    full = plot_layout(mlp, specs, mesh=mesh, leaves="layers/0/.*")
    assert boxes_per_leaf(full)["layers/0/bias"] == 8  # one dimension over both axes
    limited = plot_layout(mlp, specs, mesh=mesh, max_rows=3)
    assert len(limited.axes[0].get_yticks()) == 3
    assert "showing the first 3 of 4 leaves" in limited.axes[0].get_title()


def test_plot_layout_errors_name_the_problem(mlp):
    from eqpar.inspect import plot_layout

    with pytest.raises(
        ValueError, match=r"plot_layout: `leaves` matches no leaf path: 'layers/9/.\*'"
    ):
        plot_layout(mlp, DataParallel(), leaves="layers/9/.*")
    with pytest.raises(ValueError, match="`max_rows` must be at least 1, got 0"):
        plot_layout(mlp, DataParallel(), max_rows=0)
    with pytest.raises(ValueError, match="plot_layout: a specs pytree needs mesh="):
        plot_layout(mlp, partition_specs(mlp))
    with pytest.raises(
        ValueError, match="plot_layout: leaf 'layers/0/weight' has no NamedSharding"
    ):
        plot_layout(mlp)
