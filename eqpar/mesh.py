"""Devices and meshes: `list_devices` and `DeviceMesh`.

The multi-process start-up (`initialize` and its configuration) lives in `eqpar.runtime`; its
names are re-exported here, where earlier releases defined them.
"""

__all__ = ["DeviceMesh", "as_jax_mesh", "list_devices"]

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .runtime import COORDINATOR_ADDRESS_ENV as COORDINATOR_ADDRESS_ENV
from .runtime import COORDINATOR_BIND_ADDRESS_ENV as COORDINATOR_BIND_ADDRESS_ENV
from .runtime import LOCAL_DEVICE_IDS_ENV as LOCAL_DEVICE_IDS_ENV
from .runtime import NUM_PROCESSES_ENV as NUM_PROCESSES_ENV
from .runtime import PROCESS_ID_ENV as PROCESS_ID_ENV
from .runtime import DistributedConfig as DistributedConfig
from .runtime import initialize as initialize
from .runtime import resolve_distributed_config as resolve_distributed_config


def list_devices(device_type: str | None = None) -> list[jax.Device]:  # pyright: ignore[reportInvalidTypeForm]
    """All global devices, or those of one platform.

    **Arguments:**

    - `device_type`: `None` for the default backend's devices, or a platform name such as
      `"cpu"`, `"gpu"` or `"tpu"` (case-insensitive).

    **Returns:** a list of `jax.Device`, over every process (global devices).

    ```python
    import eqpar
    devices = eqpar.list_devices("cpu")
    assert len(devices) == 8 and devices[0].platform == "cpu"
    ```
    """
    if device_type is None:
        return list(jax.devices())
    platform = device_type.lower()
    try:
        return list(jax.devices(platform))
    except RuntimeError as error:
        raise ValueError(
            f"list_devices: device_type={device_type!r} names no available platform "
            f"(the default backend is {jax.default_backend()!r}); pass one of the platforms "
            f"JAX was started with, or None. JAX said: {error}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Meshes


def _resolve_devices(devices: object, count: int) -> list:
    if devices is None:
        found = list(jax.devices())
        source = "jax.devices()"
    else:
        flat = np.asarray(devices, dtype=object).reshape(-1).tolist()
        by_name = {f"{d.platform}:{d.id}": d for d in jax.devices()}
        found = []
        for item in flat:
            if isinstance(item, str):
                if item.lower() not in by_name:
                    raise ValueError(
                        f"DeviceMesh: devices names {item!r}, which is not a device; known "
                        f"names look like {next(iter(by_name))!r}."
                    )
                found.append(by_name[item.lower()])
            elif isinstance(item, jax.Device):
                found.append(item)
            else:
                raise TypeError(
                    f"DeviceMesh: devices must hold jax.Device objects or names like 'cpu:0'; "
                    f"got {type(item).__name__}."
                )
        source = "devices"
        ids = [d.id for d in found]
        if len(set(ids)) != len(ids):
            raise ValueError(f"DeviceMesh: devices lists a device twice (ids {ids}).")
    if len(found) != count:
        hint = (
            f"pass devices=jax.devices()[:{count}]"
            if devices is None and len(found) > count
            else "make the product of shape equal the number of devices"
        )
        raise ValueError(
            f"DeviceMesh: shape needs {count} devices but {source} has {len(found)}; {hint}."
        )
    return found


class DeviceMesh:
    """A named grid of devices, usable wherever eqpar or JAX wants a mesh.

    Axes are `AxisType.Auto` by default (the compiler propagates shardings), unlike
    `jax.make_mesh`, whose default is `AxisType.Explicit` (the sharding is part of each
    array's type). eqpar's placement, `eqpar.shard_map`, plans (pipelines included),
    checkpoints and `eqpar.check` take meshes of either kind and meshes that mix them: they
    reshard arrays over Explicit axes and constrain them over Auto ones. `SplitSequence`
    needs its axis Auto (it refuses an Explicit one, saying so).

    **Arguments:**

    - `shape`: the size of each mesh axis, e.g. `(2, 4)`.
    - `axis_names`: one unique name per axis, e.g. `("data", "model")`.
    - `devices`: the devices, in row-major order over `shape` (a list, an array, or names
      such as `"cpu:3"`); default: all of `jax.devices()`, whose count must match `shape`.
    - `axis_types`: one `jax.sharding.AxisType` for all axes or one per axis (default
      `AxisType.Auto`), as `jax.make_mesh` takes them.

    **Attributes:** `shape`, `axis_names`, `devices` (an array of devices shaped `shape`),
    `jax_mesh` (the `jax.sharding.Mesh`), `size`.

    ```python
    import eqpar
    from jax.sharding import PartitionSpec as P
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    assert mesh.axis_size("model") == 4 and mesh.jax_mesh.shape["data"] == 2
    sharding = mesh.sharding(P("data", "model"))

    from jax.sharding import AxisType
    typed = eqpar.DeviceMesh((2, 4), ("data", "model"), axis_types=AxisType.Explicit)
    assert typed.jax_mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    ```
    """

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        devices: Sequence[jax.Device] | Sequence[str] | np.ndarray | None = None,  # pyright: ignore[reportInvalidTypeForm]
        *,
        axis_types: AxisType | Sequence[AxisType] = AxisType.Auto,
    ):
        if isinstance(axis_names, str):
            raise TypeError(
                f"DeviceMesh: axis_names must be a sequence of names; got the string "
                f"{axis_names!r}. Write ({axis_names!r},) for a one-axis mesh."
            )
        if isinstance(shape, int | np.integer | str):
            raise TypeError(
                f"DeviceMesh: shape must be a tuple of axis sizes, one per axis name; got "
                f"{shape!r}. Write ({shape!r},) for a one-axis mesh."
            )
        shape = tuple(shape)
        axis_names = tuple(axis_names)
        if len(shape) == 0:
            raise ValueError("DeviceMesh: shape is empty; give at least one axis, e.g. (8,).")
        if any(not isinstance(s, int | np.integer) or s < 1 for s in shape):
            raise ValueError(f"DeviceMesh: every axis size in shape must be >= 1; got {shape}.")
        if len(shape) != len(axis_names):
            raise ValueError(
                f"DeviceMesh: shape {shape} has {len(shape)} axes but axis_names "
                f"{axis_names} has {len(axis_names)}; give one name per axis."
            )
        duplicates = sorted({n for n in axis_names if axis_names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"DeviceMesh: axis_names {axis_names} repeats {duplicates}; names must be unique."
            )
        types = (axis_types,) * len(shape) if isinstance(axis_types, AxisType) else axis_types
        if (
            isinstance(types, str)
            or not isinstance(types, Sequence)
            or not all(isinstance(t, AxisType) and t != AxisType.Manual for t in types)
        ):
            raise TypeError(
                f"DeviceMesh: axis_types must be AxisType.Auto or AxisType.Explicit (of "
                f"jax.sharding), or one of them per axis; got {axis_types!r}. Write e.g. "
                f"AxisType.Explicit, or (AxisType.Explicit, AxisType.Auto) for two axes. "
                f"(Manual axes are what shard_map makes inside its region.)"
            )
        types = tuple(types)
        if len(types) != len(shape):
            raise ValueError(
                f"DeviceMesh: shape {shape} has {len(shape)} axes but axis_types has "
                f"{len(types)}; give one type per axis, or one for all."
            )
        found = _resolve_devices(devices, math.prod(shape))
        self._shape = tuple(int(s) for s in shape)
        self._axis_names = axis_names
        grid = np.empty(len(found), dtype=object)
        grid[:] = found
        self._devices = grid.reshape(self._shape)
        self._jax_mesh = Mesh(self._devices, self._axis_names, axis_types=types)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._axis_names

    @property
    def devices(self) -> np.ndarray:
        return self._devices

    @property
    def jax_mesh(self) -> Mesh:
        return self._jax_mesh

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    def axis_size(self, axis: str | Sequence[str]) -> int:
        """The number of devices along one axis name or a tuple of axis names."""
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        for name in names:
            if name not in self._axis_names:
                raise ValueError(
                    f"DeviceMesh.axis_size: unknown axis {name!r}; the mesh has axes "
                    f"{self._axis_names}."
                )
        return math.prod(self._shape[self._axis_names.index(n)] for n in names)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """A `NamedSharding` of this mesh for `spec`."""
        return NamedSharding(self._jax_mesh, spec)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self._jax_mesh == other._jax_mesh

    def __hash__(self) -> int:
        return hash(self._jax_mesh)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self._axis_names, self._shape))
        return f"DeviceMesh({axes}, platform={self._devices.flat[0].platform!r})"


def as_jax_mesh(mesh: DeviceMesh | Mesh) -> Mesh:
    """The `jax.sharding.Mesh` behind a `DeviceMesh` (a `Mesh` is returned as it is).

    **Arguments:**

    - `mesh`: a `DeviceMesh` or a `jax.sharding.Mesh`.

    **Returns:** a `jax.sharding.Mesh`.

    ```python
    import eqpar, jax
    mesh = eqpar.DeviceMesh((8,), ("data",))
    assert isinstance(eqpar.mesh.as_jax_mesh(mesh), jax.sharding.Mesh)
    ```
    """
    if isinstance(mesh, DeviceMesh):
        return mesh.jax_mesh
    if isinstance(mesh, Mesh):
        return mesh
    raise TypeError(
        f"mesh must be an eqpar.DeviceMesh or a jax.sharding.Mesh; got {type(mesh).__name__}."
    )
