import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eqpar import runtime as runtime_module
from eqpar.mesh import DeviceMesh, as_jax_mesh, initialize, list_devices, resolve_distributed_config

# --- list_devices ------------------------------------------------------------------------------


def test_list_devices_all_and_by_platform():
    assert list_devices() == jax.devices()
    assert list_devices("CPU") == jax.devices("cpu")


def test_list_devices_unknown_platform_names_it():
    with pytest.raises(ValueError, match="device_type='tpu'"):
        list_devices("tpu")


# --- DeviceMesh --------------------------------------------------------------------------------


def test_device_mesh_gives_auto_jax_mesh_usable_by_shard_map():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    assert mesh.shape == (2, 4) and mesh.axis_names == ("data", "model") and mesh.size == 8
    jm = mesh.jax_mesh
    assert isinstance(jm, Mesh)
    assert dict(jm.shape) == {"data": 2, "model": 4}
    assert tuple(jm.axis_types) == (AxisType.Auto, AxisType.Auto)
    assert [d.id for d in mesh.devices.reshape(-1)] == [d.id for d in jax.devices()]

    # An unsharded (committed to one device) input is accepted on this mesh.
    x = jnp.arange(16.0).reshape(8, 2)
    f = jax.shard_map(
        lambda block: block * 2,
        mesh=jm,
        in_specs=P(("data", "model")),
        out_specs=P(("data", "model")),
    )
    np.testing.assert_allclose(f(x), x * 2)


def test_device_mesh_helpers():
    mesh = DeviceMesh((2, 4), ("data", "model"))
    assert mesh.axis_size("model") == 4
    assert mesh.axis_size(("data", "model")) == 8
    sharding = mesh.sharding(P("data"))
    assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh.jax_mesh
    assert mesh == DeviceMesh((2, 4), ("data", "model"))
    assert hash(mesh) == hash(DeviceMesh((2, 4), ("data", "model")))
    assert mesh != DeviceMesh((4, 2), ("data", "model"))
    assert as_jax_mesh(mesh) is mesh.jax_mesh
    assert as_jax_mesh(mesh.jax_mesh) is mesh.jax_mesh
    assert "data=2" in repr(mesh)
    with pytest.raises(ValueError, match="unknown axis 'pipe'"):
        mesh.axis_size("pipe")


def test_device_mesh_explicit_devices_in_order_and_by_name():
    devices = jax.devices()[4:]
    mesh = DeviceMesh((2, 2), ("a", "b"), devices[::-1])
    assert [d.id for d in mesh.devices.reshape(-1)] == [d.id for d in devices[::-1]]
    by_name = DeviceMesh((2,), ("a",), ["cpu:3", "CPU:5"])
    assert [d.id for d in by_name.devices] == [3, 5]
    grid = DeviceMesh((2, 4), ("a", "b"), np.array(jax.devices()).reshape(4, 2))
    assert grid.devices.shape == (2, 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (((), ()), "shape is empty"),
        (((2, 4), ("data",)), r"shape \(2, 4\) has 2 axes but axis_names \('data',\) has 1"),
        (((2, 4), ("x", "x")), r"repeats \['x'\]"),
        (
            ((4,), ("data",)),
            r"needs 4 devices but jax.devices\(\) has 8; pass devices=jax.devices\(\)\[:4\]",
        ),
        (((0, 8), ("a", "b")), r"must be >= 1; got \(0, 8\)"),
    ],
)
def test_device_mesh_validation(args, message):
    with pytest.raises(ValueError, match=message):
        DeviceMesh(*args)


def test_device_mesh_device_count_mismatch_with_explicit_devices():
    with pytest.raises(ValueError, match="needs 8 devices but devices has 4"):
        DeviceMesh((2, 4), ("a", "b"), jax.devices()[:4])


def test_device_mesh_bad_devices():
    with pytest.raises(ValueError, match="'gpu:0', which is not a device"):
        DeviceMesh((1,), ("a",), ["gpu:0"])
    with pytest.raises(ValueError, match="lists a device twice"):
        DeviceMesh((2,), ("a",), [jax.devices()[0], jax.devices()[0]])
    with pytest.raises(TypeError, match="got int"):
        DeviceMesh((2,), ("a",), np.array([0, 1]))


def test_device_mesh_axis_names_string_is_refused():
    with pytest.raises(TypeError, match=r"Write \('data',\)"):
        DeviceMesh((8,), "data")  # type: ignore[arg-type]


def test_as_jax_mesh_refuses_other_types():
    # Under the test suite's runtime type checking, the annotation refuses it first; both name
    # the argument.
    with pytest.raises(TypeError, match="mesh"):
        as_jax_mesh("data")  # type: ignore[arg-type]


# --- initialize: resolution --------------------------------------------------------------------


def test_resolution_reads_every_environment_variable():
    env = {
        "EQPAR_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "EQPAR_NUM_PROCESSES": "4",
        "EQPAR_PROCESS_ID": " 3 ",
        "EQPAR_LOCAL_DEVICE_IDS": "0,1",
    }
    config = resolve_distributed_config(environ=env)
    assert config.coordinator_address == "10.0.0.1:1234"
    assert config.num_processes == 4 and config.process_id == 3
    assert config.local_device_ids == (0, 1)
    # The coordinator listens on its own address only, never on every interface.
    assert config.coordinator_bind_address == "10.0.0.1:1234"


def test_resolution_arguments_win_over_environment():
    env = {"EQPAR_COORDINATOR_ADDRESS": "10.0.0.1:1234", "EQPAR_NUM_PROCESSES": "4"}
    config = resolve_distributed_config(
        "127.0.0.1:999", 2, 0, coordinator_bind_address="0.0.0.0:999", environ=env
    )
    assert config == ("127.0.0.1:999", 2, 0, "0.0.0.0:999", None)
    from_env = resolve_distributed_config(
        environ={**env, "EQPAR_COORDINATOR_BIND_ADDRESS": "10.0.0.1:4321"}
    )
    assert from_env.coordinator_bind_address == "10.0.0.1:4321"


def test_resolution_job_address_list_uses_first_and_ipv6():
    config = resolve_distributed_config("10.0.0.1:1234,10.0.0.2:1234", environ={})
    assert config.coordinator_address == "10.0.0.1:1234"
    assert config.num_processes == 2  # one address per process, as Keras' job_addresses
    assert resolve_distributed_config("10.0.0.1:1234,10.0.0.2:1234", 2, environ={}) == config
    assert resolve_distributed_config("[::1]:80", environ={}).coordinator_bind_address == "[::1]:80"


def test_resolution_nothing_given_leaves_detection_to_jax():
    assert resolve_distributed_config(environ={}) == (None, None, None, None, None)


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        (
            {},
            {"EQPAR_NUM_PROCESSES": "two"},
            r"num_processes must be an integer; \$EQPAR_NUM_PROCESSES holds 'two'",
        ),
        ({}, {"EQPAR_PROCESS_ID": "x"}, r"process_id must be an integer; \$EQPAR_PROCESS_ID"),
        ({"num_processes": 2, "process_id": 2}, {}, "process_id=2 .* smaller than num_processes=2"),
        ({"process_id": -1}, {}, "process_id .* must be >= 0; got -1"),
        ({"num_processes": 0}, {}, "num_processes .* must be >= 1; got 0"),
        ({"coordinator_address": "10.0.0.1"}, {}, "coordinator_address .* 'host:port'.*'10.0.0.1'"),
        ({}, {"EQPAR_COORDINATOR_ADDRESS": "host:"}, r"from \$EQPAR_COORDINATOR_ADDRESS"),
        ({"coordinator_bind_address": "nope"}, {}, "coordinator_bind_address .* got 'nope'"),
        (
            {"coordinator_address": "10.0.0.1:1,10.0.0.2:1,10.0.0.3:1", "num_processes": 2},
            {},
            r"lists 3 addresses, one per process .* but num_processes=2 \(from argument\)",
        ),
        (
            {"coordinator_address": "10.0.0.1:1,10.0.0.2:1"},
            {"EQPAR_NUM_PROCESSES": "4"},
            r"lists 2 addresses.*num_processes=4 \(from \$EQPAR_NUM_PROCESSES\)",
        ),
        ({}, {"EQPAR_LOCAL_DEVICE_IDS": "0,a"}, "local_device_ids must be an integer"),
    ],
)
def test_resolution_errors_name_the_culprit(kwargs, env, message):
    with pytest.raises(ValueError, match=message):
        resolve_distributed_config(**kwargs, environ=env)


# --- initialize: calling the runtime -----------------------------------------------------------


@pytest.fixture
def fake_runtime(monkeypatch):
    """Stands in for `jax.distributed` so initialize can be called without starting it."""
    calls = []

    def fake_initialize(**kwargs):
        calls.append(kwargs)

    monkeypatch.setattr(jax.distributed, "initialize", fake_initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(runtime_module, "_initialized_by_eqpar", None)
    for var in (
        "EQPAR_COORDINATOR_ADDRESS",
        "EQPAR_NUM_PROCESSES",
        "EQPAR_PROCESS_ID",
        "EQPAR_COORDINATOR_BIND_ADDRESS",
        "EQPAR_LOCAL_DEVICE_IDS",
    ):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_initialize_passes_resolved_values_and_bind_address(fake_runtime, monkeypatch):
    monkeypatch.setenv("EQPAR_NUM_PROCESSES", "1")
    monkeypatch.setenv("EQPAR_PROCESS_ID", "0")
    config = initialize("127.0.0.1:7777", initialization_timeout=5)
    assert len(fake_runtime) == 1
    call = fake_runtime[0]
    assert call["coordinator_address"] == "127.0.0.1:7777"
    assert call["num_processes"] == 1 and call["process_id"] == 0
    assert call["coordinator_bind_address"] == "127.0.0.1:7777"
    assert call["initialization_timeout"] == 5
    assert config.coordinator_bind_address == "127.0.0.1:7777"


def test_initialize_twice_is_harmless(fake_runtime):
    first = initialize("127.0.0.1:7777", 1, 0)
    second = initialize("127.0.0.1:7777", 1, 0)
    again_without_arguments = initialize()
    assert len(fake_runtime) == 1
    assert first == second == again_without_arguments


def test_initialize_twice_with_other_process_count_raises(fake_runtime):
    initialize("127.0.0.1:7777", 1, 0)
    with pytest.raises(ValueError, match=r"already runs with num_processes=1; .* num_processes=2"):
        initialize("127.0.0.1:7777", 2, 1)
    assert len(fake_runtime) == 1


def test_initialize_without_is_initialized_uses_module_state(fake_runtime, monkeypatch):
    monkeypatch.delattr(jax.distributed, "is_initialized")
    initialize("127.0.0.1:7777", 1, 0)
    initialize("127.0.0.1:7777", 1, 0)
    assert len(fake_runtime) == 1
