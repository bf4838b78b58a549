"""Mixed precision: parameters in one floating dtype, compute in another.

A `Precision` policy names three dtypes, as jmp's policies do: `param_dtype`, in which the
parameters (and so the optimizer state) are stored and updated; `compute_dtype`, in which the
forward and backward passes run; and `output_dtype`, in which a loss or other result is handed
back. `Precision.bfloat16()` keeps float32 parameters and computes in bfloat16.

**What JAX and Equinox do and what eqpar adds.** Casting is `Array.astype`, and JAX's autodiff
already does the rest: the gradient of a cast is the cast back, so a loss computed from
`policy.cast_to_compute(model)` has gradients in the parameter dtype. Equinox's normalisation
layers and attention softmax already compute in at least float32 whatever their input. eqpar
adds only what they lack: one object that casts the floating-point array leaves of any pytree
(a model, a batch, a result) and leaves everything else alone (token ids, integer state,
static fields), with checked dtypes.

**Where the cast goes.** Cast the parameters *outside* the `shard_map`ped (or `jit`ted) loss,
before they enter it. Everything inside then runs in `compute_dtype`, including the
collectives of the backward pass: the gradients of parameters replicated over the data axis
are summed over it in bfloat16, half the bytes of float32, and the transpose of the cast turns
the summed gradient back into the parameter dtype for the optimizer.

**float16 is refused.** Its exponent range is far narrower than float32's, so small gradients
underflow to zero unless the loss is scaled up and the gradients back down (loss scaling),
which eqpar does not provide. bfloat16 has float32's exponent range and needs no scaling.

```python
import jax, jax.numpy as jnp
import equinox as eqx
import eqpar

policy = eqpar.Precision.bfloat16()
model = eqx.nn.Linear(4, 2, key=jax.random.key(0))
x = jnp.ones((4,))

def loss(model, x):
    model, x = policy.cast_to_compute((model, x))
    return policy.cast_to_output(jnp.sum(model(x) ** 2))

value, grads = eqx.filter_value_and_grad(loss)(model, x)
assert value.dtype == jnp.float32 and grads.weight.dtype == jnp.float32
assert policy.cast_to_compute(model).weight.dtype == jnp.bfloat16
```
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

__all__ = ["Precision"]

_NAMES = ("float32", "bfloat16")


def _checked_dtype(argument: str, value: Any) -> np.dtype:
    if value is None:  # jnp.dtype(None) is float64: never what None was meant to say
        raise TypeError(
            f"Precision: {argument}=None is not a dtype (NumPy would read it as float64); "
            f"give it one, e.g. jnp.float32 or jnp.bfloat16. Only output_dtype may be None "
            f"(it then follows param_dtype)."
        )
    try:
        dtype = jnp.dtype(value)
    except TypeError as error:
        raise TypeError(
            f"Precision: {argument} must be a floating dtype such as jnp.float32 or "
            f"jnp.bfloat16; got {value!r}."
        ) from error
    if dtype == jnp.float16:
        raise ValueError(
            f"Precision: {argument}=float16 is not supported: float16 gradients underflow "
            "without loss scaling, which eqpar does not provide. Use jnp.bfloat16 (float32's "
            "exponent range, no scaling needed)."
        )
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise ValueError(
            f"Precision: {argument} must be float32, bfloat16 or float64; got {dtype.name}."
        )
    _check_x64(argument, dtype)
    return dtype


def _check_x64(argument: str, dtype: np.dtype) -> None:
    """float64 only where JAX has 64-bit mode on (else it casts to float32 with a warning)."""
    if dtype == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"Precision: {argument}=float64 needs JAX's 64-bit mode, which is off, so JAX "
            f"would cast to float32 instead. Turn it on at the start of the program "
            f'(`jax.config.update("jax_enable_x64", True)` or JAX_ENABLE_X64=1), or use '
            f"jnp.float32."
        )


def _cast_floating(tree: PyTree, dtype: np.dtype, argument: str) -> PyTree:
    _check_x64(argument, dtype)

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array | np.ndarray) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf if leaf.dtype == dtype else leaf.astype(dtype)
        return leaf

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """A mixed-precision policy: the dtypes of parameters, of computation and of outputs.

    **Arguments:**

    - `param_dtype`: the dtype parameters are stored, updated and checkpointed in.
    - `compute_dtype`: the dtype of the forward and backward passes and their collectives.
    - `output_dtype`: the dtype of what a loss function hands back (default: `param_dtype`).

    Each is float32, bfloat16 or float64; float16 is refused (it needs loss scaling), and so
    is `None` for `param_dtype` or `compute_dtype` (only `output_dtype` has a default).
    float64 needs JAX's 64-bit mode (`jax.config.update("jax_enable_x64", True)`) when the
    policy is built and when it casts; without it the policy raises rather than cast to
    float32 behind your back. The casts touch only floating-point array leaves (`jax.Array`
    or NumPy): integer and boolean arrays (token ids, step counters) and non-array leaves
    pass through unchanged. A policy is hashable, so it can be a static argument of
    `jax.jit` / `eqx.filter_jit`.

    ```python
    import jax.numpy as jnp
    import eqpar

    policy = eqpar.Precision(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16)
    assert policy == eqpar.Precision.bfloat16() and policy.output_dtype == jnp.float32
    batch = {"ids": jnp.arange(4), "weights": jnp.ones(4)}
    cast = policy.cast_to_compute(batch)
    assert cast["ids"].dtype == jnp.int32 and cast["weights"].dtype == jnp.bfloat16
    ```
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = None

    def __post_init__(self):
        param = _checked_dtype("param_dtype", self.param_dtype)
        compute = _checked_dtype("compute_dtype", self.compute_dtype)
        output = param if self.output_dtype is None else self.output_dtype
        output = _checked_dtype("output_dtype", output)
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "output_dtype", output)

    @classmethod
    def float32(cls) -> "Precision":
        """Everything in float32 (casting is then a no-op).

        ```python
        import jax.numpy as jnp
        import eqpar

        policy = eqpar.Precision.float32()
        assert policy.compute_dtype == jnp.float32
        ```
        """
        return cls(param_dtype=jnp.float32, compute_dtype=jnp.float32, output_dtype=jnp.float32)

    @classmethod
    def bfloat16(cls) -> "Precision":
        """float32 parameters and outputs, bfloat16 computation and collectives.

        ```python
        import jax.numpy as jnp
        import eqpar

        policy = eqpar.Precision.bfloat16()
        assert (policy.param_dtype, policy.compute_dtype) == (jnp.float32, jnp.bfloat16)
        ```
        """
        return cls(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, output_dtype=jnp.float32)

    @classmethod
    def from_name(cls, name: str) -> "Precision":
        """The preset called `name`: `"float32"` or `"bfloat16"` (as a command line spells it).

        ```python
        import eqpar

        assert eqpar.Precision.from_name("bfloat16") == eqpar.Precision.bfloat16()
        ```
        """
        if name not in _NAMES:
            raise ValueError(f"Precision.from_name: name must be one of {_NAMES}; got {name!r}.")
        return cls.bfloat16() if name == "bfloat16" else cls.float32()

    @property
    def name(self) -> str:
        """`"float32"`, `"bfloat16"` for the presets, else the three dtypes in words.

        ```python
        import eqpar

        assert eqpar.Precision.bfloat16().name == "bfloat16"
        ```
        """
        for name in _NAMES:
            if self == Precision.from_name(name):
                return name
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """`tree` with its floating-point array leaves cast to `compute_dtype`.

        ```python
        import jax.numpy as jnp
        import eqpar

        ids, x = eqpar.Precision.bfloat16().cast_to_compute((jnp.arange(3), jnp.ones(3)))
        assert ids.dtype == jnp.int32 and x.dtype == jnp.bfloat16
        ```
        """
        return _cast_floating(tree, self.compute_dtype, "compute_dtype")

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """`tree` with its floating-point array leaves cast to `param_dtype` (for gradients
        computed without autodiff through the cast, e.g. by a pipeline's own backward pass).

        ```python
        import jax.numpy as jnp
        import eqpar

        grads = {"w": jnp.ones(3, jnp.bfloat16)}
        assert eqpar.Precision.bfloat16().cast_to_param(grads)["w"].dtype == jnp.float32
        ```
        """
        return _cast_floating(tree, self.param_dtype, "param_dtype")

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """`tree` with its floating-point array leaves cast to `output_dtype`.

        ```python
        import jax.numpy as jnp
        import eqpar

        loss = jnp.asarray(2.5, jnp.bfloat16)
        assert eqpar.Precision.bfloat16().cast_to_output(loss).dtype == jnp.float32
        ```
        """
        return _cast_floating(tree, self.output_dtype, "output_dtype")
