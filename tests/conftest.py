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

# A test worker may hold this many memory maps before it drops JAX's compiled programs (see
# `_release_compiled_programs`); one of the example's training runs adds about 1,200.
MAP_BUDGET = 20_000


def _memory_maps() -> int | None:
    """How many memory maps this process holds (Linux), or None where /proc does not say."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs once a worker holds `MAP_BUDGET` memory maps.

    Every program XLA:CPU compiles keeps its machine code in memory maps of its own for as
    long as JAX caches it, and a process may hold at most `vm.max_map_count` of them (65,530
    by default): past that, the next compile fails inside LLVM with a segmentation fault,
    late in a run and never when the crashed test runs alone. A worker that runs thousands of
    tests gets there (this suite did, twice); dropping the caches now and then frees the maps
    at the cost of compiling again what a later test would have reused."""
    yield
    maps = _memory_maps()
    if maps is not None and maps > MAP_BUDGET:
        jax.clear_caches()
        gc.collect()
