import jax
import jaxtyping
import pytest


def test_eight_simulated_devices():
    assert jax.device_count() == 8
    assert {d.platform for d in jax.devices()} == {"cpu"}


def test_public_functions_are_runtime_type_checked():
    from eqpar._paths import leaf_paths

    with pytest.raises(jaxtyping.TypeCheckError):
        leaf_paths([1.0], arrays_only="yes")  # type: ignore[arg-type]
