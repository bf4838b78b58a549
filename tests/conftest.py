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
