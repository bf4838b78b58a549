"""Looking at layouts: one row per parameter with its spec and its bytes on each device, as a
table (`layout_table`) or a picture of which device holds which block (`plot_layout`)."""

__all__ = [
    "LayoutRow",
    "LayoutTable",
    "layout_table",
    "plot_layout",
    "print_layout_table",
    "schedule_figure",
]

import dataclasses
import math
import sys
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._checks import check_int
from ._matching import compile_key, unused_key_hints
from ._paths import path_to_str
from ._specs import check_spec, show_spec
from ._typing import PyTree, Specs
from .layout import expand_specs, is_array_like
from .mesh import DeviceMesh, as_jax_mesh

if TYPE_CHECKING:
    from matplotlib.figure import Figure as _Figure
else:  # matplotlib is optional: imported only when a picture is drawn
    _Figure = Any


@runtime_checkable
class _TextStream(Protocol):
    """Where `print_layout_table` writes: anything with `write` and `isatty`."""

    def write(self, text: str, /) -> int: ...

    def isatty(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class LayoutRow:
    """One array leaf of a `LayoutTable`: its path, global shape, dtype, spec, and bytes
    (globally and on one device).

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    table = eqpar.inspect.layout_table(eqx.nn.Linear(64, 64, key=jax.random.key(0)), eqpar.FSDP())
    row = table.rows[0]
    assert (row.path, row.shape, row.spec) == ("weight", (64, 64), P("data", None))
    assert row.bytes_per_device * 8 == row.bytes_total
    ```
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec
    bytes_total: int
    bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class LayoutTable:
    """The layout of a model, leaf by leaf.

    `print(table)` / `str(table)` give plain text; `rich.print(table)` gives a rich table
    that fits the terminal: where the paths do not fit beside the other columns, each path
    wraps after a `/`, so its end (the leaf's own name) is always shown; `table.rows` and the
    totals are there for code.

    ```python
    import equinox as eqx, jax, eqpar
    mlp = eqx.nn.MLP(64, 64, 64, 1, key=jax.random.key(0))
    table = eqpar.inspect.layout_table(mlp, eqpar.FSDP())  # 16 KiB weights split, biases not
    assert table.bytes_per_device == 2 * 64 * 64 * 4 // 8 + 2 * 64 * 4
    assert str(table).splitlines()[0].split()[0] == "path"
    ```
    """

    rows: tuple[LayoutRow, ...]
    mesh_shape: dict[str, int]

    @property
    def bytes_total(self) -> int:
        """Bytes of all leaves, counted once."""
        return sum(row.bytes_total for row in self.rows)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of all leaves that one device holds (the largest shards when uneven)."""
        return sum(row.bytes_per_device for row in self.rows)

    def _cells(self) -> tuple[list[str], list[list[str]], list[str]]:
        header = ["path", "shape", "dtype", "spec", "bytes/device"]
        body = [
            [
                row.path,
                str(list(row.shape)),
                row.dtype,
                _spec_text(row.spec),
                _format_bytes(row.bytes_per_device),
            ]
            for row in self.rows
        ]
        footer = [
            f"total ({len(self.rows)} leaves, {_format_bytes(self.bytes_total)} global)",
            "",
            "",
            _mesh_text(self.mesh_shape),
            _format_bytes(self.bytes_per_device),
        ]
        return header, body, footer

    def to_text(self) -> str:
        """The table as aligned plain text."""
        header, body, footer = self._cells()
        lines = [header, *body, footer]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

        def fmt(cells: list[str]) -> str:
            parts = [
                cell.rjust(width) if i == len(cells) - 1 else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(cells, widths))
            ]
            return "  ".join(parts).rstrip()

        rule = "-" * len(fmt(header))
        return "\n".join([fmt(header), rule, *(fmt(row) for row in body), rule, fmt(footer)])

    def to_rich(self, width: int | None = None) -> PyTree:
        """The table as a `rich.table.Table`, `width` characters wide at most (`None`: as
        wide as its cells).

        A table too wide for `width` leaves out the dtype column when every leaf has the same
        dtype (the title names it), wraps the shapes and specs at spaces, and wraps each path
        after a `/`, so that its end, the leaf's own name, is always shown.
        """
        from rich.table import Table

        header, body, footer = self._cells()
        title = "parameter layout"
        widths: list[int | None] = [None] * len(header)
        if width is not None and not _fits([header, *body, footer], width):
            dtypes = {row[2] for row in body}
            if len(dtypes) == 1:  # one dtype: say it once, in the title
                title = f"parameter layout (every leaf {dtypes.pop()})"
                header, footer = [*header[:2], *header[3:]], [*footer[:2], *footer[3:]]
                body = [[*row[:2], *row[3:]] for row in body]
            if not _fits([header, *body, footer], width):
                widths = list(_narrow_widths([header, *body, footer], width))
                body = [[_wrap_path(row[0], widths[0] or 1), *row[1:]] for row in body]
        table = Table(title=title, show_footer=True)
        for i, (name, foot) in enumerate(zip(header, footer)):
            justify = "right" if i == len(header) - 1 else "left"
            table.add_column(name, footer=foot, justify=justify, width=widths[i])
        for cells in body:
            table.add_row(*cells)
        return table

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield self.to_rich(width=options.max_width)

    def __str__(self) -> str:
        return self.to_text()


# A rich table's frame: one border left of every column and one at the right, and a space of
# padding on both sides of every cell.
def _table_frame(columns: int) -> int:
    return (columns + 1) + 2 * columns


def _natural(rows: list[list[str]], column: int) -> int:
    return max(len(row[column]) for row in rows)


def _fits(rows: list[list[str]], width: int) -> bool:
    columns = len(rows[0])
    return sum(_natural(rows, i) for i in range(columns)) + _table_frame(columns) <= width


# Shapes and specs wrap at spaces down to this many characters (or their longest word).
_NARROW_COLUMN = 15


def _narrow_widths(rows: list[list[str]], width: int) -> list[int]:
    """Widths of the columns of `rows` (header, body, footer; the path first) in a rich
    table `width` wide: every other column at its natural width or `_NARROW_COLUMN`, whichever
    is less (but not under its longest word), and the rest for the paths."""
    others = [
        min(_natural(rows, i), max(_NARROW_COLUMN, *(len(w) for r in rows for w in r[i].split())))
        for i in range(1, len(rows[0]))
    ]
    free = width - _table_frame(len(rows[0])) - sum(others)
    longest_path = max(len(row[0]) for row in rows[1:-1]) if len(rows) > 2 else len(rows[0][0])
    return [min(longest_path, max(free, 8)), *others]


def _wrap_path(path: str, width: int) -> str:
    """`path` on lines of at most `width` characters, broken after a `/` (a part longer than
    a line is cut into pieces of `width`)."""
    parts = path.split("/")
    pieces = [part + "/" for part in parts[:-1]] + [parts[-1]]
    lines = [""]
    for piece in pieces:
        while len(piece) > width:  # a part longer than a whole line
            if lines[-1]:
                lines.append("")
            lines[-1], piece = piece[:width], piece[width:]
            lines.append("")
        if len(lines[-1]) + len(piece) > width and lines[-1]:
            lines.append("")
        lines[-1] += piece
    return "\n".join(line for line in lines if line)


def _format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _spec_text(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(entry) for entry in tuple(spec)) + ")"


def _mesh_text(shape: dict[str, int]) -> str:
    return "mesh " + " x ".join(f"{name}={size}" for name, size in shape.items())


def _shard_shape(shape: tuple[int, ...], spec: PartitionSpec, sizes: dict) -> tuple[int, ...]:
    out = list(shape)
    for dim, entry in enumerate(tuple(spec)):
        names = _axis_names(entry)
        split = math.prod(sizes[name] for name in names)
        out[dim] = -(-shape[dim] // split)
    return tuple(out)


def layout_table(
    model: PyTree,
    distribution_or_specs: PyTree = None,
    *,
    mesh: DeviceMesh | Mesh | None = None,
) -> LayoutTable:
    """The layout of `model`: one row per array leaf (path, global shape, dtype, spec, bytes per
    device) and the totals.

    **Arguments:**

    - `model`: an Equinox module or pytree (concrete, or abstract from `eqx.filter_eval_shape`).
    - `distribution_or_specs`: a distribution (`DataParallel`, `ModelParallel`, `FSDP`), a
      specs pytree (needs `mesh`), or `None` to read the shardings the arrays already have.
    - `mesh`: the mesh for a specs pytree.

    **Returns:** a `LayoutTable`; print it, or use `print_layout_table` for a rich table in a
    terminal.

    ```python
    import equinox as eqx, jax, eqpar
    mlp = eqx.nn.MLP(64, 64, 64, 1, key=jax.random.key(0))
    table = eqpar.inspect.layout_table(mlp, eqpar.FSDP(min_size_bytes=0))
    assert table.bytes_per_device * 8 == table.bytes_total
    print(table)
    ```
    """
    return _layout(model, distribution_or_specs, mesh, "layout_table")[0]


def _layout(
    model: PyTree, distribution_or_specs: PyTree, mesh: DeviceMesh | Mesh | None, caller: str
) -> tuple[LayoutTable, Mesh]:
    """The `LayoutTable` of `model` and the `jax.sharding.Mesh` its specs refer to; errors
    name `caller`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model)
    arrays = [(path_to_str(path), leaf) for path, leaf in flat if is_array_like(leaf)]
    if distribution_or_specs is None:
        specs_list, jax_mesh = _specs_from_arrays(arrays, caller)
    else:
        if hasattr(distribution_or_specs, "partition_specs") and hasattr(
            distribution_or_specs, "device_mesh"
        ):
            specs: Specs = distribution_or_specs.partition_specs(model)
            jax_mesh = as_jax_mesh(distribution_or_specs.device_mesh)
        elif mesh is None:
            raise ValueError(
                f"{caller}: a specs pytree needs mesh=...; or pass a distribution, or None "
                "to read the arrays' own shardings."
            )
        else:
            specs = distribution_or_specs
            jax_mesh = as_jax_mesh(mesh)
        specs_list = _specs_for(model, specs, caller)
    sizes = dict(jax_mesh.shape)
    rows = []
    for (path, leaf), spec in zip(arrays, specs_list):
        shape = tuple(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        check_spec(path, spec, shape, None, source=f"{caller}: the layout")  # the rank
        for entry in tuple(spec):
            for name in _axis_names(entry):
                if name not in sizes:
                    raise ValueError(
                        f"{caller}: the spec {show_spec(spec)} of {path!r} names the axis "
                        f"{name!r}, which the mesh does not have (its axes: {tuple(sizes)}). "
                        "Pass the mesh the specs were made for."
                    )
        rows.append(
            LayoutRow(
                path=path,
                shape=shape,
                dtype=str(np.dtype(leaf.dtype)),
                spec=spec,
                bytes_total=math.prod(shape) * itemsize,
                bytes_per_device=math.prod(_shard_shape(shape, spec, sizes)) * itemsize,
            )
        )
    table = LayoutTable(rows=tuple(rows), mesh_shape={str(k): int(v) for k, v in sizes.items()})
    return table, jax_mesh


def _axis_names(entry: PyTree) -> tuple[Any, ...]:
    """The mesh axes of one entry of a `PartitionSpec`, major first (`()` when unsplit)."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _specs_for(model: PyTree, specs: Specs, caller: str) -> list[PartitionSpec]:
    """The spec of every array leaf of `model`, in flattening order; `specs` may be a prefix."""
    full = expand_specs(specs, model, where="model", caller=caller)
    return jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _specs_from_arrays(
    arrays: list[tuple[str, Any]], caller: str
) -> tuple[list[PartitionSpec], Mesh]:
    specs, meshes = [], []
    for path, leaf in arrays:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"{caller}: leaf {path!r} has no NamedSharding "
                f"({type(sharding).__name__}); place the model first (distribute_model) or "
                f"pass a distribution."
            )
        specs.append(sharding.spec)
        meshes.append(sharding.mesh)
    if not meshes:
        raise ValueError(f"{caller}: the model has no array leaves.")
    if any(m != meshes[0] for m in meshes[1:]):
        raise ValueError(f"{caller}: the arrays live on different meshes.")
    return specs, meshes[0]


def print_layout_table(
    model: PyTree,
    distribution_or_specs: PyTree = None,
    *,
    mesh: DeviceMesh | Mesh | None = None,
    file: _TextStream | None = None,
) -> LayoutTable:
    """Print `layout_table(...)`: a rich table when `file` (default stdout) is a terminal,
    plain text otherwise.

    **Arguments:** as `layout_table`, plus `file` to print to.

    **Returns:** the `LayoutTable`.

    ```python
    import equinox as eqx, jax, eqpar
    mlp = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    table = eqpar.inspect.print_layout_table(mlp, eqpar.DataParallel())
    assert table.bytes_per_device == table.bytes_total
    ```
    """
    table = layout_table(model, distribution_or_specs, mesh=mesh)
    stream: PyTree = sys.stdout if file is None else file
    if stream.isatty():
        from rich.console import Console

        Console(file=stream).print(table)  # as wide as the terminal
    else:
        stream.write(table.to_text() + "\n")
    return table


# --- the layout as a picture ----------------------------------------------------------------

# (dark, light) per mesh axis, by the axis' position in the mesh; then for leaves split over
# several axes; replicated leaves are grey.
_AXIS_COLOURS = (
    ("#4c72b0", "#a9c4e8"),
    ("#55a868", "#a8d5b2"),
    ("#8172b3", "#c3bade"),
    ("#937860", "#cdb9a5"),
)
_COMBINED_COLOURS = (
    ("#dd8452", "#f4c09c"),
    ("#c44e52", "#e8a6a8"),
    ("#da8bc3", "#f0c8e4"),
    ("#8c8c8c", "#c8c8c8"),
)
_REPLICATED_COLOUR = "#e3e3e3"


@dataclasses.dataclass(frozen=True)
class _Block:
    """One block of a leaf: where it sits in the leaf, its mesh coordinates, its devices."""

    index: tuple[int, ...]
    slices: tuple[tuple[int, int] | None, ...]
    coords: tuple[tuple[str, int], ...]
    devices: tuple[int, ...]


def _blocks(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> list[_Block]:
    """The blocks of a leaf of `shape` laid out by `spec` on `mesh`, in row-major block order:
    one per distinct shard, with the ids of the devices holding it."""
    sizes = {str(k): int(v) for k, v in mesh.shape.items()}
    per_dim = [tuple(str(n) for n in _axis_names(e)) for e in tuple(spec)]
    per_dim += [()] * (len(shape) - len(per_dim))
    splits = [math.prod(sizes[n] for n in names) for names in per_dim]
    holders: dict[tuple[int, ...], list[int]] = {}
    coords: dict[tuple[int, ...], tuple[tuple[str, int], ...]] = {}
    axis_names = [str(n) for n in mesh.axis_names]
    for position in np.ndindex(*mesh.devices.shape):
        coord = dict(zip(axis_names, position))
        index = []
        for names in per_dim:
            b = 0
            for name in names:
                b = b * sizes[name] + coord[name]
            index.append(b)
        key = tuple(index)
        device: PyTree = mesh.devices[position]
        holders.setdefault(key, []).append(int(device.id))
        coords[key] = tuple((n, coord[n]) for n in axis_names if any(n in d for d in per_dim))
    blocks = []
    for key in np.ndindex(*splits):
        slices: list[tuple[int, int] | None] = []
        for dim, (b, split) in enumerate(zip(key, splits)):
            if split == 1:
                slices.append(None)
            else:
                size = -(-shape[dim] // split)
                slices.append((min(b * size, shape[dim]), min((b + 1) * size, shape[dim])))
        blocks.append(_Block(key, tuple(slices), coords[key], tuple(sorted(holders[key]))))
    return blocks


def _device_text(devices: tuple[int, ...], total: int) -> str:
    """`dev 0, 4` / `dev 0–3` / `all 8 devices`: the devices holding a block."""
    if len(devices) == total:
        return f"all {total} devices" if total > 1 else "device 0"
    runs: list[str] = []
    start = prev = devices[0]
    for d in (*devices[1:], None):
        if d is not None and d == prev + 1:
            prev = d
            continue
        runs.append(
            str(start)
            if start == prev
            else f"{start}–{prev}"
            if prev > start + 1
            else f"{start}, {prev}"
        )
        if d is not None:
            start = prev = d
    text = "dev " + ", ".join(runs)
    return text if len(text) <= 14 else f"{len(devices)} devices"


def _slice_text(slices: tuple[tuple[int, int] | None, ...]) -> str:
    if not slices:
        return "scalar"
    return "[" + ", ".join(":" if s is None else f"{s[0]}:{s[1]}" for s in slices) + "]"


def plot_layout(
    model: PyTree,
    distribution_or_specs: PyTree = None,
    *,
    mesh: DeviceMesh | Mesh | None = None,
    leaves: str | None = None,
    max_rows: int | None = 30,
    title: str | None = None,
) -> _Figure:
    """Draw the layout of `model`: which device holds which block of each parameter.

    One row per array leaf (its `/`-joined path, shape, spec and bytes per device on the
    left). The leaf is drawn as a bar cut into its blocks, one box per distinct shard in
    row-major block order, coloured by the mesh axes that split the leaf (grey: replicated);
    each box names its slice of the leaf (`[0:64, :]`), its mesh coordinates (`model 1`)
    and the devices holding it (`dev 1, 5`), as far as the box is wide enough. Each box is a
    `matplotlib.patches.Rectangle` whose `gid` is the leaf's path. Needs matplotlib
    (`pip install eqpar[plot]`).

    **Arguments:**

    - `model`, `distribution_or_specs`, `mesh`: as for `layout_table`.
    - `leaves`: a regular expression; only the leaves whose whole path it matches
      (`re.fullmatch`, as `LayoutMap` keys) are drawn, e.g. `"layers/0/.*"` or `".*weight"`.
    - `max_rows`: draw at most this many leaves (the first ones); the caption says how many
      were left out. `None` draws all.
    - `title`: the figure title; by default the mesh and its size.

    **Returns:** a `matplotlib.figure.Figure` with an Agg canvas (not registered with
    pyplot): `fig.savefig("layout.png")` writes it, a notebook displays it.

    ```python
    import equinox as eqx, jax, eqpar
    mlp = eqx.nn.MLP(16, 8, 64, 1, key=jax.random.key(0))
    fig = eqpar.inspect.plot_layout(mlp, eqpar.FSDP(min_size_bytes=0), leaves=".*weight")
    boxes = [p for p in fig.axes[0].patches if p.get_gid() == "layers/0/weight"]
    assert len(boxes) == 8  # [64, 16] split 8 ways over "data"
    ```
    """
    if leaves is not None and not isinstance(leaves, str):
        raise TypeError(f"plot_layout: `leaves` must be a regex string or None; got {leaves!r}.")
    if max_rows is not None:
        check_int(max_rows, name="max_rows", owner="plot_layout")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as error:  # pragma: no cover - matplotlib is a declared extra
        raise ImportError(
            "plot_layout needs matplotlib: `pip install eqpar[plot]` (from a checkout: "
            "`pip install -e '.[plot]'`)."
        ) from error

    table, jax_mesh = _layout(model, distribution_or_specs, mesh, "plot_layout")
    rows, selected = _selected_rows(table, leaves, max_rows)

    axis_names = [str(n) for n in jax_mesh.axis_names]
    num_devices = int(jax_mesh.devices.size)
    combined: list[tuple[str, ...]] = []

    def colours(axes: tuple[str, ...]) -> tuple[str, str]:
        if not axes:
            return _REPLICATED_COLOUR, _REPLICATED_COLOUR
        if len(axes) == 1:
            return _AXIS_COLOURS[axis_names.index(axes[0]) % len(_AXIS_COLOURS)]
        if axes not in combined:
            combined.append(axes)
        return _COMBINED_COLOURS[combined.index(axes) % len(_COMBINED_COLOURS)]

    fig = Figure(figsize=(12.0, 0.6 * len(rows) + 1.9), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    legend: dict[tuple[str, ...], str] = {}
    labels = []
    texts: list[
        tuple[int, int, tuple[str, str], list[list[str]]]
    ] = []  # row, boxes, colours, lines
    for r, row in enumerate(rows):
        blocks = _blocks(row.shape, row.spec, jax_mesh)
        axes = tuple(n for n in axis_names if any(n == c for c, _ in blocks[0].coords))
        dark, light = colours(axes)
        legend.setdefault(axes, dark)
        box = 1.0 / len(blocks)
        split_dims = [
            k for k, last in enumerate(blocks[-1].index) if last > 0
        ]  # row-major: last is the largest
        for i, block in enumerate(blocks):
            ax.add_patch(
                Rectangle(
                    (i * box, r + 0.08),
                    box,
                    0.84,
                    facecolor=dark if i % 2 == 0 else light,
                    edgecolor="white",
                    linewidth=1.2,
                    gid=row.path,
                )
            )
            # A wider gap where the leading split dimension moves on to its next block.
            if (
                i > 0
                and len(split_dims) > 1
                and block.index[split_dims[0]] != blocks[i - 1].index[split_dims[0]]
            ):
                ax.plot([i * box] * 2, [r + 0.08, r + 0.92], color="white", linewidth=4)
        if axes:
            lines = [
                [_slice_text(b.slices) for b in blocks],
                [" · ".join(f"{n} {c}" for n, c in b.coords) for b in blocks],
                [_device_text(b.devices, num_devices) for b in blocks],
            ]
        else:
            lines = [["replicated"], [_device_text(blocks[0].devices, num_devices)]]
        texts.append((r, len(blocks), (dark, light), lines))
        labels.append(
            f"{row.path}\n{list(row.shape)} {_spec_text(row.spec)} · "
            f"{_format_bytes(row.bytes_per_device)}/device"
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([r + 0.5 for r in range(len(rows))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    caption = "one box per block of a parameter: its slice, mesh coordinates, devices holding it"
    if len(rows) < selected:
        caption += (
            f"\nshowing the first {len(rows)} of {selected} leaves (select with leaves=, "
            "or raise max_rows=)"
        )
    ax.set_title(caption, fontsize=8, color="#444444")
    if title is None:
        title = f"parameter layout, {_mesh_text(table.mesh_shape)} ({num_devices} devices)"
    fig.suptitle(title, fontsize=10)
    handles = [
        Patch(
            facecolor=colour,
            edgecolor="#cccccc",
            label=(
                "replicated" if not axes else "split over " + " and ".join(repr(a) for a in axes)
            ),
        )
        for axes, colour in legend.items()
    ]
    fig.legend(
        handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False
    )

    _write_box_texts(fig, ax, texts)
    return fig


def _selected_rows(
    table: "LayoutTable", leaves: str | None, max_rows: int | None
) -> tuple[list["LayoutRow"], int]:
    """The rows `plot_layout` draws (those whose path `leaves` matches, at most `max_rows`),
    and how many matched."""
    rows = list(table.rows)
    if leaves is not None:
        pattern = compile_key(leaves, "plot_layout `leaves`")
        rows = [row for row in rows if pattern.fullmatch(row.path)]
        if not rows:
            raise ValueError(
                "plot_layout: `leaves` matches no leaf path: "
                f"{unused_key_hints([leaves], [r.path for r in table.rows])}."
            )
    return (rows if max_rows is None else rows[:max_rows]), len(rows)


def _write_box_texts(fig: Any, ax: Any, texts: list) -> None:
    """Write each box's lines (`texts`: row, boxes, colours, lines of each kind)."""
    # The text goes in once the layout has settled the bar's width: in each row the same kinds
    # of line for every box, dropping the slice, then the coordinates, where they do not fit.
    fig.draw_without_rendering()
    bar_inches = ax.get_window_extent().width / fig.dpi
    for r, count, (dark, light), lines in texts:
        box_inches = bar_inches / count
        best: tuple[float, list[list[str]]] = (7.0, [])
        for fontsize in (7.0, 6.0):
            room = (box_inches - 0.08) * 72 / (0.6 * fontsize)  # characters that fit
            kept = [kind for kind in lines if max(len(t) for t in kind) <= room]
            if len(kept) > len(best[1]):
                best = (fontsize, kept)
        fontsize, kept = best
        for i in range(count if kept else 0):
            ax.text(
                (i + 0.5) / count,
                r + 0.5,
                "\n".join(kind[i] for kind in kept),
                ha="center",
                va="center",
                fontsize=fontsize,
                color=_text_colour(dark if i % 2 == 0 else light),
                linespacing=1.15,
            )


def _text_colour(background: str) -> str:
    """Black on light boxes and cells, white on dark ones."""
    r, g, b = (int(background[i : i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 160 else "white"


# ---------------------------------------------------------------------------------------------
# Pipeline schedules as Gantt charts (`PipelineSchedule.figure` and `.plot` draw here).

_IDLE_COLOUR = "#eeeeee"
_FORWARD_COLOURS = ("#4c72b0", "#a9c4e8", "#2a4d7a", "#6f95cf")
_BACKWARD_COLOURS = ("#dd8452", "#f4c09c", "#a8552a", "#e8a070")
_WEIGHT_COLOURS = ("#55a868", "#a6d8b2", "#2f7040", "#7fc28e")
_KIND_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "backward_input": "backward (input gradient)",
    "backward_weight": "weight gradient",
}


def _cell_colour(kind: str, trip: int) -> str:
    palette = {"forward": _FORWARD_COLOURS, "backward_weight": _WEIGHT_COLOURS}.get(
        kind, _BACKWARD_COLOURS
    )
    return palette[trip % len(palette)]


def _num_trips(schedule: PyTree) -> int:
    """How many stages each device runs (trips round the ring)."""
    stages = [a.stage for row in schedule.actions for a in row if a.stage is not None]
    return 1 + max(stages) // schedule.num_stages if stages else 1


def _device_label(schedule: PyTree, device: int) -> str:
    stages = schedule.stages_on(device)
    if len(stages) == 1:
        return f"device {device} (stage {stages[0]})"
    shown = [str(s) for s in stages] if len(stages) <= 4 else [str(stages[0]), "…"]
    if len(stages) > 4:
        shown.append(str(stages[-1]))
    return f"device {device} (stages {', '.join(shown)})"


def schedule_figure(schedule: PyTree, *, title: str | None = None) -> PyTree:
    """A pipeline schedule (`eqpar.schedule.PipelineSchedule`) as a Gantt chart: what
    `schedule.figure()` returns (see there for what the chart shows).

    **Arguments:**

    - `schedule`: a `PipelineSchedule`.
    - `title`: the chart title; by default `schedule.default_title()`.

    **Returns:** a `matplotlib.figure.Figure` with an Agg canvas (not registered with pyplot).

    ```python
    from eqpar.inspect import schedule_figure
    from eqpar.schedule import GPipeSchedule
    fig = schedule_figure(GPipeSchedule(2, 3), title="GPipe")
    assert fig._suptitle.get_text() == "GPipe"
    ```
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:  # pragma: no cover - matplotlib is a declared extra
        raise ImportError(
            "PipelineSchedule.figure and .plot (eqpar.inspect.schedule_figure) need "
            "matplotlib: `pip install eqpar[plot]` (from a checkout: `pip install -e '.[plot]'`)."
        ) from error

    s, trips = schedule.num_stages, _num_trips(schedule)
    present = {a.kind for row in schedule.actions for a in row}
    kinds = [
        k for k in ("forward", *("backward", "backward_input", "backward_weight")) if k in present
    ]
    legend_labels = []
    for kind in kinds:
        for trip in range(trips):
            label = _KIND_LABELS[kind]
            if trips > 1:
                first, last = trip * s, trip * s + s - 1
                label += f", stage {first}" if s == 1 else f", stages {first}–{last}"
            legend_labels.append((kind, trip, label))
    # The legend goes below the axes in as many columns as the width holds (an entry is
    # about 0.6 in of patch and padding plus 0.06 in a character at 8 pt).
    width = max(6.5, 0.3 * schedule.num_steps + 1.8)
    column = 0.6 + 0.06 * max(len(label) for *_, label in legend_labels)
    ncols = max(1, min(len(legend_labels) + 1, int((width - 0.3) // column)))
    legend_rows = -(-(len(legend_labels) + 1) // ncols)
    fig = Figure(
        figsize=(width, 0.45 * schedule.num_devices + 1.7 + 0.22 * legend_rows),
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    def cell(step: int, device: int, colour: str, edge: str = "white") -> None:
        ax.add_patch(Rectangle((step, device), 1, 1, facecolor=colour, edgecolor=edge, linewidth=1))

    for step, row in enumerate(schedule.actions):
        for device, a in enumerate(row):
            if a.kind == "idle":
                cell(step, device, _IDLE_COLOUR, edge="#dddddd")
                continue
            colour = _cell_colour(a.kind, 0 if a.stage is None else a.stage // s)
            cell(step, device, colour)
            ax.text(
                step + 0.5,
                device + 0.5,
                str(a.microbatch),
                ha="center",
                va="center",
                fontsize=8 if schedule.num_microbatches < 100 else 6,
                color=_text_colour(colour),
            )
    ax.set_xlim(0, schedule.num_steps)
    ax.set_ylim(schedule.num_devices, 0)
    ax.set_yticks([d + 0.5 for d in range(schedule.num_devices)])
    ax.set_yticklabels([_device_label(schedule, d) for d in range(schedule.num_devices)])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    caption = "cell number = microbatch index"
    if trips > 1:
        caption += "; shade = which of its stages the device runs"
    ax.set_title(caption, fontsize=8, color="#444444")
    fig.suptitle(schedule.default_title() if title is None else title, fontsize=10)

    handles = [
        Patch(facecolor=_cell_colour(kind, trip), label=label)
        for kind, trip, label in legend_labels
    ]
    handles.append(Patch(facecolor=_IDLE_COLOUR, edgecolor="#cccccc", label="idle (bubble)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8, frameon=False)
    return fig
