"""Every test sees 8 simulated CPU devices; eqpar runs under jaxtyping + beartype.

Runtime type checking comes from jaxtyping's pytest hook configured in pyproject.toml
(`--jaxtyping-packages=eqpar,beartype.beartype`), which instruments `eqpar` on import. This file
must therefore not import `eqpar` at module level.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)
