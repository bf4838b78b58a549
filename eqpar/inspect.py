"""Looking at layouts: one row per parameter with its spec and its bytes on each device."""

__all__ = ["LayoutRow", "LayoutTable", "layout_table", "print_layout_table"]

import dataclasses
import math
import sys
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._paths import path_to_str
from ._typing import PyTree, Specs
from .layout import expand_specs, is_array_like
from .mesh import DeviceMesh, as_jax_mesh


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

    `print(table)` / `str(table)` give plain text; `rich.print(table)` gives a rich table;
    `table.rows` and the totals are there for code.

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

    def to_rich(self) -> Any:
        """The table as a `rich.table.Table`."""
        from rich.table import Table

        header, body, footer = self._cells()
        table = Table(title="parameter layout", show_footer=True)
        for i, (name, foot) in enumerate(zip(header, footer)):
            table.add_column(name, footer=foot, justify="right" if i == len(header) - 1 else "left")
        for cells in body:
            table.add_row(*cells)
        return table

    def __rich__(self) -> Any:
        return self.to_rich()

    def __str__(self) -> str:
        return self.to_text()


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
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        split = math.prod(sizes[name] for name in names)
        out[dim] = -(-shape[dim] // split)
    return tuple(out)


def layout_table(
    model: PyTree,
    distribution_or_specs: Any = None,
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
    flat, _ = jax.tree_util.tree_flatten_with_path(model)
    arrays = [(path_to_str(path), leaf) for path, leaf in flat if is_array_like(leaf)]
    if distribution_or_specs is None:
        specs_list, jax_mesh = _specs_from_arrays(arrays)
    else:
        if hasattr(distribution_or_specs, "partition_specs") and hasattr(
            distribution_or_specs, "device_mesh"
        ):
            specs: Specs = distribution_or_specs.partition_specs(model)
            jax_mesh = as_jax_mesh(distribution_or_specs.device_mesh)
        elif mesh is None:
            raise ValueError(
                "layout_table: a specs pytree needs mesh=...; or pass a distribution, or None "
                "to read the arrays' own shardings."
            )
        else:
            specs = distribution_or_specs
            jax_mesh = as_jax_mesh(mesh)
        specs_list = _specs_for(model, specs)
    sizes = dict(jax_mesh.shape)
    rows = []
    for (path, leaf), spec in zip(arrays, specs_list):
        shape = tuple(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        for entry in tuple(spec):
            for name in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
                if name not in sizes:
                    raise ValueError(
                        f"layout_table: the spec {spec} of {path!r} names the axis {name!r}, "
                        f"which the mesh does not have (its axes: {tuple(sizes)}). Pass the "
                        "mesh the specs were made for."
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
    return LayoutTable(rows=tuple(rows), mesh_shape={str(k): int(v) for k, v in sizes.items()})


def _specs_for(model: PyTree, specs: Specs) -> list[PartitionSpec]:
    """The spec of every array leaf of `model`, in flattening order; `specs` may be a prefix."""
    full = expand_specs(specs, model, where="model", caller="layout_table")
    return jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _specs_from_arrays(arrays: list[tuple[str, Any]]) -> tuple[list[PartitionSpec], Mesh]:
    specs, meshes = [], []
    for path, leaf in arrays:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"layout_table: leaf {path!r} has no NamedSharding "
                f"({type(sharding).__name__}); place the model first (distribute_model) or "
                f"pass a distribution."
            )
        specs.append(sharding.spec)
        meshes.append(sharding.mesh)
    if not meshes:
        raise ValueError("layout_table: the model has no array leaves.")
    if any(m != meshes[0] for m in meshes[1:]):
        raise ValueError("layout_table: the arrays live on different meshes.")
    return specs, meshes[0]


def print_layout_table(
    model: PyTree,
    distribution_or_specs: Any = None,
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
    stream: Any = sys.stdout if file is None else file
    if stream.isatty():
        from rich.console import Console

        Console(file=stream).print(table.to_rich())
    else:
        stream.write(table.to_text() + "\n")
    return table
