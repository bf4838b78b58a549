"""Every test sees 8 simulated CPU devices; eqpar runs under jaxtyping + beartype.

Runtime type checking comes from jaxtyping's pytest hook configured in pyproject.toml
(`--jaxtyping-packages=eqpar,beartype.beartype`), which instruments `eqpar` on import. This file
must therefore not import `eqpar` at module level.
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The measuring tools (`_hlo`: collective bytes and memory read off compiled programs) are a
# support module of benchmarks/, not part of the package; the tests import them from there.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    Every program XLA:CPU compiles keeps its machine code in memory maps of its own for as
    long as JAX caches it. A test worker runs hundreds of modules and thousands of programs,
    and a process may hold at most `vm.max_map_count` maps (65530 by default): past that,
    the next compile fails inside LLVM with a segmentation fault, late in the run and never
    when the crashed test runs alone. Programs are rarely shared across modules, so little is
    compiled twice."""
    yield
    jax.clear_caches()
    gc.collect()
