"""Mixture of experts: tokens routed to the top-k of E expert MLPs, on one device or with the
experts split over a mesh axis (expert parallelism).

`MixtureOfExperts` is an ordinary Equinox layer: a router (`eqx.nn.Linear`, features ->
experts), the experts' weights stacked `[E, ...]`, top-k gating, and the usual auxiliary
losses. On one device the experts run as grouped matmuls, so no token is padded to a fixed
capacity and the program does not grow with E: on GPU and TPU `lax.ragged_dot` over the
tokens sorted by expert; on CPU, where JAX lowers `ragged_dot` by copying the rows once per
expert, a scan over the experts that holds one expert's product at a time
(`_apply_experts`).

With `expert_axis_name` set (the `eqpar.ExpertParallel` plan style sets it), each device of
that axis holds `E / n` experts and its own tokens; the layer sends each (token, expert)
assignment to the device holding the expert and the result back (`lax.all_to_all` after an
exchange of counts). eqpar owns this exchange because `lax.ragged_all_to_all` has no CPU
lowering and needs a receive buffer whose size is fixed at trace time: here the buffer holds
`buffer_factor` times the balanced share, and a step whose routing overflows it runs more
rounds of the same exchange instead of dropping tokens (the result stays exact). On GPU and
TPU a device's experts share its slot of each pair's buffer and run as the ragged dot; on
CPU each local expert has a slot of its own (`_slots_per_destination`), so the experts run
as one batched matmul over fixed blocks, holding what a capacity-based exchange holds.
"""

import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.core import Tracer
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, Shaped

from .._axes import axis_size
from .._axis_types import explicit_axes
from .._tracing import pipeline_axes, under_vmap
from .._vma import cast_varying, varies_over, varying_axes
from ._own_region import batch_axes, call_in_own_region, needs_own_region, region_mesh
from ._twins import instance_with

__all__ = ["MixtureOfExperts", "RouterLosses", "expert_buffer_rows"]


class RouterLosses(NamedTuple):
    """What a `MixtureOfExperts` call reports besides its output, over all the tokens of the
    call (every device's tokens, under `shard_map`).

    - `load_balancing`: `E * sum_e f_e * p_e`, with `f_e` the share of the (token, choice)
      assignments routed to expert `e` and `p_e` its mean router probability (1 when
      perfectly balanced). Add it to the loss with a small weight (e.g. 0.01).
    - `z_loss`: the mean squared log-sum-exp of the router logits (keeps them small; e.g.
      0.001).
    - `dropped`: how many assignments a capacity factor dropped (0 when dropless).

    ```python
    import jax, jax.numpy as jnp
    from eqpar.nn import MixtureOfExperts

    moe = MixtureOfExperts(8, 16, num_experts=4, key=jax.random.key(0))
    y, losses = moe(jnp.ones((6, 8)))
    loss = jnp.mean(y**2) + 0.01 * losses.load_balancing + 0.001 * losses.z_loss
    assert losses.dropped == 0 and loss.shape == ()
    ```
    """

    load_balancing: Float[Array, ""]
    z_loss: Float[Array, ""]
    dropped: Int[Array, ""]


def expert_buffer_rows(tokens: int, top_k: int, axis_size: int, buffer_factor: float) -> int:
    """Rows per source device in one round of the expert-parallel exchange: the balanced share
    `tokens * top_k / axis_size`, times `buffer_factor`, rounded up. A device receives
    `axis_size` times this many rows per round.

    On CPU, with several experts per device, each expert has a slot of its own in a pair's
    rows: `expert_buffer_rows(tokens, top_k, num_experts, buffer_factor)` rows per (source,
    expert) per round (the same total where the division is exact), and a step runs as
    many rounds as its busiest (source, expert) slot needs. On GPU and TPU the experts of a
    device share the pair's rows.

    ```python
    from eqpar.nn.experts import expert_buffer_rows
    assert expert_buffer_rows(64, 2, 4, 1.25) == 40  # balanced 32 per pair, x1.25
    assert expert_buffer_rows(64, 2, 8, 1.25) == 20  # per expert, 8 experts (2 per device)
    assert expert_buffer_rows(50, 4, 4, 1.1) == 55
    ```
    """
    # Rounded before the ceiling: 1.1 * 50 * 4 / 4 is 55.00000000000001 in binary floating
    # point, which is 55 rows, not 56.
    return max(1, math.ceil(round(buffer_factor * tokens * top_k / axis_size, 6)))


def _positive_finite(value: object) -> bool:
    """Whether `value` is a real number, not a bool, finite and > 0 (a factor's range)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    number = float(value)
    return math.isfinite(number) and number > 0


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype) -> Array:
    # The same scale `eqx.nn.Linear` uses, so a stacked expert starts as a Linear would.
    limit = 1 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -limit, limit)


class MixtureOfExperts(eqx.Module):
    """A top-k mixture-of-experts MLP over tokens: `y = sum_c w_c * expert_{e_c}(x)`.

    Each token's router logits (`router`, an `eqx.nn.Linear` from features to experts) give
    softmax probabilities; the token goes to its `top_k` most probable experts, weighted by
    those probabilities (renormalized to sum to 1 when `normalize_weights`). An expert is an
    MLP `down(activation(up(x)))`, or with `gated=True` `down(activation(gate(x)) * up(x))`
    (SwiGLU with `jax.nn.silu`). The weights are stacked over experts in global view:
    `up`/`gate` are `[E, features, hidden]`, `down` is `[E, hidden, features]`, whatever the
    parallel layout.

    The layer takes a whole batch of tokens, `[..., features]` (call it on the batch, not
    under a per-example `jax.vmap`: the grouped matmul batches tokens itself). It returns the
    output, in the input's dtype, and the `RouterLosses`; it takes real floating-point tokens
    and refuses an integer or boolean batch (a `TypeError`: its output would be truncated to
    that dtype; cast the batch first). Inside a pipeline stage the batch of a call is a
    microbatch, so the router losses are those of its tokens (the load-balancing loss is not
    linear in the tokens: a mean over microbatches differs from the whole batch's). Under
    expert parallelism the layer has a reverse-mode derivative (`jax.grad`) only, not a
    forward-mode or second one.

    **Capacity.** By default no assignment is dropped. With `capacity_factor=c`, each expert
    takes at most `ceil(c * T * top_k / E)` of the `T` tokens of a call on one device (first
    choices before second choices, then in token order); the rest contribute nothing and
    `RouterLosses.dropped` counts them.

    **Parallel.** `expert_axis_name` splits the experts over that mesh axis (each device holds
    `E / n` and routes its own tokens to all of them; see the module docstring for the
    buffers: `buffer_factor`), and `model_axis_name` splits each expert's hidden features
    (column-parallel `up`/`gate`, row-parallel `down`). Use `eqpar.ExpertParallel` in a plan
    rather than setting them by hand. Called outside `shard_map` on placed parameters, the
    layer opens one region over their mesh (tokens split over every axis but the model
    axis). Tokens split over the model axis as well (sequence
    parallelism between blocks) are gathered over it on entry and split again on exit. The
    auxiliary losses are taken over every device's tokens (the axes `shard_map` types them
    as varying over, with its default `check_vma=True`), so they equal the serial layer's
    on the whole batch.

    **Arguments:**

    - `features`, `hidden`, `num_experts`: sizes; `top_k`: experts per token.
    - `gated`, `activation`, `use_bias` (the experts' biases), `use_router_bias`,
      `normalize_weights`, `capacity_factor`: as above (`capacity_factor` a finite number
      > 0, or `None`: dropless).
    - `expert_axis_name`, `model_axis_name`, `buffer_factor`: the parallel options above
      (`buffer_factor` a finite number > 0); set by `eqpar.ExpertParallel` in a plan.
    - `key`: the initialization key; `dtype`: the parameters' dtype.

    ```python
    import jax, jax.numpy as jnp
    from eqpar.nn import MixtureOfExperts

    moe = MixtureOfExperts(8, 16, num_experts=4, top_k=2, key=jax.random.key(0))
    y, losses = moe(jnp.ones((2, 5, 8)))
    assert y.shape == (2, 5, 8) and int(losses.dropped) == 0
    ```
    """

    router: eqx.nn.Linear
    up: Float[Array, "experts features hidden"]
    down: Float[Array, "experts hidden features"]
    gate: Float[Array, "experts features hidden"] | None
    up_bias: Float[Array, "experts hidden"] | None
    down_bias: Float[Array, "experts features"] | None
    activation: Callable = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    normalize_weights: bool = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    expert_axis_name: Hashable | None = eqx.field(static=True)
    model_axis_name: Hashable | None = eqx.field(static=True)
    buffer_factor: float = eqx.field(static=True)
    origin: eqx.Module | None = eqx.field(static=True)
    # What `eqpar.ExpertParallel` replaced (`(name, value)` pairs), for `unparallelize`.
    options_before: tuple = eqx.field(static=True)

    def __init__(
        self,
        features: int,
        hidden: int,
        num_experts: int,
        *,
        top_k: int = 2,
        gated: bool = False,
        activation: Callable = jax.nn.gelu,
        use_bias: bool = False,
        use_router_bias: bool = False,
        normalize_weights: bool = True,
        capacity_factor: float | None = None,
        expert_axis_name: Hashable | None = None,
        model_axis_name: Hashable | None = None,
        buffer_factor: float = 1.25,
        key: PRNGKeyArray,
        dtype=None,
    ):
        for name, value in (("features", features), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"MixtureOfExperts: `{name}` must be a positive int, got {value!r}."
                )
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(
                f"MixtureOfExperts: `num_experts` must be a positive int, got {num_experts!r}."
            )
        dtype = jnp.float32 if dtype is None else dtype
        keys = jax.random.split(key, 6)
        self.router = eqx.nn.Linear(
            features, num_experts, use_bias=use_router_bias, key=keys[0], dtype=dtype
        )
        self.up = _uniform(keys[1], (num_experts, features, hidden), features, dtype)
        self.down = _uniform(keys[2], (num_experts, hidden, features), hidden, dtype)
        self.gate = (
            _uniform(keys[3], (num_experts, features, hidden), features, dtype) if gated else None
        )
        self.up_bias = (
            _uniform(keys[4], (num_experts, hidden), features, dtype) if use_bias else None
        )
        self.down_bias = (
            _uniform(keys[5], (num_experts, features), hidden, dtype) if use_bias else None
        )
        self.activation = activation
        self.top_k = top_k
        self.normalize_weights = normalize_weights
        self.capacity_factor = capacity_factor
        self.expert_axis_name = expert_axis_name
        self.model_axis_name = model_axis_name
        self.buffer_factor = buffer_factor
        self.origin = None
        self.options_before = ()
        self.__check_init__()

    def __check_init__(self) -> None:
        # Built in global view; `[..., E, features, hidden]`: a stack of layers (say the
        # `[L, ...]` of a scanned stack that a plan converts) has the same E.
        num_experts = self.up.shape[-3]
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise TypeError(f"MixtureOfExperts: `top_k` must be an int, got {self.top_k!r}.")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(
                f"MixtureOfExperts: `top_k` must be between 1 and num_experts={num_experts}, "
                f"got {self.top_k}."
            )
        if self.capacity_factor is not None and not _positive_finite(self.capacity_factor):
            raise ValueError(
                f"MixtureOfExperts: `capacity_factor` must be None (dropless) or a finite "
                f"number > 0, got {self.capacity_factor!r}. For no capacity limit pass None."
            )
        check_single_axes(
            "MixtureOfExperts",
            expert_axis_name=self.expert_axis_name,
            model_axis_name=self.model_axis_name,
        )
        if not _positive_finite(self.buffer_factor):
            raise ValueError(
                f"MixtureOfExperts: `buffer_factor` must be a finite number > 0 (1.25 is the "
                f"default; a step whose routing overflows the buffer runs more rounds, so a "
                f"larger factor is never needed for exactness), got {self.buffer_factor!r}."
            )
        if self.router.out_features != num_experts:
            raise ValueError(
                f"MixtureOfExperts: the router gives {self.router.out_features} logits for "
                f"{num_experts} experts (`up` is {tuple(self.up.shape)}); they must agree."
            )

    @property
    def num_experts(self) -> int:
        # The router's static size: inside shard_map `up` holds only this device's experts.
        return int(self.router.out_features)

    def replace(self, **fields) -> "MixtureOfExperts":
        """A copy with the named fields replaced (parameters or options such as
        `expert_axis_name`), checked as the constructor checks them.

        ```python
        import jax
        from eqpar.nn import MixtureOfExperts

        moe = MixtureOfExperts(8, 16, num_experts=4, key=jax.random.key(0))
        assert moe.replace(top_k=1).top_k == 1
        ```
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise TypeError(
                f"MixtureOfExperts.replace: no field(s) {unknown}; the fields are {sorted(names)}."
            )
        values = {name: getattr(self, name) for name in names} | fields
        new = instance_with(type(self), values)
        new.__check_init__()
        return new

    @classmethod
    def from_experts(
        cls,
        router: eqx.nn.Linear,
        experts: Sequence[eqx.nn.MLP],
        *,
        top_k: int,
        normalize_weights: bool = True,
        capacity_factor: float | None = None,
    ) -> "MixtureOfExperts":
        """The layer from the common hand-written form: a router `eqx.nn.Linear` (features ->
        experts) and a list of expert `eqx.nn.MLP`s of depth 1 (two `Linear`s, the same
        activation, no final activation). The weights are the experts' own, stacked.

        **Arguments:** `router`, `experts` as above; `top_k` and the rest as in the class.

        **Returns:** a `MixtureOfExperts` computing what the hand-written layer computes with
        softmax top-k routing.

        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        from eqpar.nn import MixtureOfExperts

        keys = jax.random.split(jax.random.key(0), 5)
        router = eqx.nn.Linear(8, 4, use_bias=False, key=keys[0])
        experts = [eqx.nn.MLP(8, 8, 16, 1, key=k) for k in keys[1:]]
        moe = MixtureOfExperts.from_experts(router, experts, top_k=1)
        x = jnp.ones((3, 8))
        best = jnp.argmax(jax.vmap(router)(x), axis=-1)
        expected = jnp.stack([experts[int(e)](t) for e, t in zip(best, x)])
        assert jnp.allclose(moe(x)[0], expected, atol=1e-5)
        ```
        """
        if not isinstance(router, eqx.nn.Linear):
            raise TypeError(
                f"MixtureOfExperts.from_experts: `router` must be an eqx.nn.Linear, got "
                f"{type(router).__name__}."
            )
        experts = list(experts)
        if len(experts) != router.out_features:
            raise ValueError(
                f"MixtureOfExperts.from_experts: the router gives {router.out_features} logits "
                f"but {len(experts)} experts were given."
            )
        for index, expert in enumerate(experts):
            if (
                not isinstance(expert, eqx.nn.MLP)
                or len(expert.layers) != 2
                or expert.layers[0].in_features != router.in_features
                or expert.layers[1].out_features != router.in_features
            ):
                raise TypeError(
                    f"MixtureOfExperts.from_experts: experts/{index} must be an eqx.nn.MLP of "
                    f"depth 1 from {router.in_features} to {router.in_features} features; got "
                    f"{_describe(expert)}. Write other experts as a MixtureOfExperts."
                )
            if not _is_identity(expert.final_activation):
                raise TypeError(
                    f"MixtureOfExperts.from_experts: experts/{index} has a final activation "
                    f"({expert.final_activation!r}); MixtureOfExperts experts have none."
                )
            if not _same_function(expert.activation, experts[0].activation):
                raise TypeError(
                    f"MixtureOfExperts.from_experts: experts/{index}'s activation "
                    f"({expert.activation!r}) computes otherwise than experts/0's "
                    f"({experts[0].activation!r}); MixtureOfExperts experts share one."
                )
        stacked_biases = []
        for position in (0, 1):  # each Linear's bias: every expert's, or none
            biases = [e.layers[position].bias for e in experts]
            present = [b is not None for b in biases]
            if any(present) and not all(present):
                raise TypeError(
                    f"MixtureOfExperts.from_experts: the experts' layers[{position}] have a "
                    f"bias in some experts and none in others (experts/"
                    f"{present.index(not present[0])}); give every expert the same form."
                )
            stacked_biases.append(_stack(biases) if all(present) else None)
        fields = {
            "router": router,
            "up": _stack([_transposed(e.layers[0].weight) for e in experts]),
            "down": _stack([_transposed(e.layers[1].weight) for e in experts]),
            "gate": None,
            "up_bias": stacked_biases[0],
            "down_bias": stacked_biases[1],
            "activation": experts[0].activation,
            "top_k": top_k,
            "normalize_weights": normalize_weights,
            "capacity_factor": capacity_factor,
            "expert_axis_name": None,
            "model_axis_name": None,
            "buffer_factor": 1.25,
            "origin": None,
            "options_before": (),
        }
        moe = instance_with(cls, fields)
        moe.__check_init__()
        return moe

    def __partition_specs__(self) -> dict[str, P]:
        expert, model = self.expert_axis_name, self.model_axis_name
        specs = {"up": P(expert, None, model), "down": P(expert, model, None)}
        if self.gate is not None:
            specs["gate"] = P(expert, None, model)
        if self.up_bias is not None:
            specs["up_bias"] = P(expert, model)
        if self.down_bias is not None:
            specs["down_bias"] = P(expert, None)
        return specs

    def __call__(
        self, x: Shaped[Array, "*tokens features"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "*tokens features"], RouterLosses] | Float[Array, "*tokens features"]:
        features = self.router.in_features
        if x.ndim == 0 or x.shape[-1] != features:
            raise ValueError(
                f"MixtureOfExperts: input must be [..., {features}] (tokens, features); got "
                f"shape {x.shape}."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            # The output is returned in the input's dtype (a bfloat16 batch stays bfloat16):
            # an integer dtype would truncate the mixed values.
            raise TypeError(
                f"MixtureOfExperts: `x` has dtype {x.dtype}; the layer takes real "
                f"floating-point tokens and returns its output in their dtype, which an "
                f"integer or boolean dtype would truncate. Cast the batch first, e.g. "
                f"`x.astype({jnp.dtype(self.up.dtype).name})` (the experts' dtype), or embed "
                f"token ids before the layer."
            )
        if under_vmap(x):
            raise TypeError(_UNDER_VMAP)
        if self.expert_axis_name is not None and needs_own_region(self.expert_axis_name):
            return self._in_own_region(x)
        tokens = x.reshape(-1, features)
        model = self.model_axis_name
        manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
        if manual and varies_over(x, manual[0]) is None:
            raise ValueError(
                f"MixtureOfExperts: called inside shard_map with check_vma=False (over "
                f"{manual}), so the layer cannot tell which axes split the tokens (the router "
                f"losses sum over them; sequence-split tokens are gathered). Run it under "
                f"shard_map's default check_vma=True (eqpar.shard_map's default too)."
            )
        split_over_model = model is not None and bool(varies_over(tokens, model))
        if split_over_model:
            # Sequence parallelism: this device holds its own tokens, but its experts hold
            # only a block of the hidden features, which every token needs. Gather the
            # axis's tokens (the experts act token by token, so their order is free), and
            # keep this device's rows of the result (the gather's transpose sums the
            # gradients back, a reduce-scatter).
            tokens = lax.all_gather(tokens, model, axis=0, tiled=True)
        num_tokens, k, num_experts = tokens.shape[0], self.top_k, self.num_experts
        logits = jax.vmap(self.router)(tokens).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        top_probs, chosen = lax.top_k(probs, k)
        weights = top_probs
        if self.normalize_weights:
            weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
        # Assignments in choice-major order (a = c * T + t): first choices come first in
        # each expert's group, which is the order a capacity keeps them in.
        assigned = chosen.T.reshape(-1).astype(jnp.int32)
        kept = jnp.ones_like(assigned, dtype=bool)
        if self.capacity_factor is not None:
            capacity = self._capacity(num_tokens)
            kept = _within_capacity(assigned, num_experts, capacity)
        routed = jnp.where(kept, assigned, num_experts)  # dropped ones sort past every group
        order = jnp.argsort(routed, stable=True)
        rows = tokens[order % num_tokens]
        sorted_experts = routed[order]
        params = _ExpertParams(self.up, self.gate, self.down, self.up_bias, self.down_bias)
        if self.expert_axis_name is None:
            out_sorted = _apply_experts(
                params, rows, sorted_experts, self._static(1, 0), grouped=True
            )
        else:
            out_sorted = self._exchange(params, rows, sorted_experts, num_tokens)
        out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
        out = out.reshape(k, num_tokens, features)
        mixed = jnp.einsum("ktf,tk->tf", out, weights.astype(out.dtype))
        if split_over_model:
            # Keep this device's rows, and count only them in the router losses (summed
            # over every axis the tokens are split over, the model axis included).
            own = num_tokens // lax.axis_size(model)
            start = lax.axis_index(model) * own

            def mine(rows: Array, axis: int = 0) -> Array:
                return lax.dynamic_slice_in_dim(rows, start, own, axis=axis)

            mixed, logits, probs = mine(mixed), mine(logits), mine(probs)
            assigned = mine(assigned.reshape(k, num_tokens), 1).reshape(-1)
            kept = mine(kept.reshape(k, num_tokens), 1).reshape(-1)
        mixed = mixed.reshape(x.shape).astype(x.dtype)
        if self.origin is not None:
            return mixed  # the author's layer returned its output alone
        losses = _router_losses(logits, probs, assigned, kept, num_experts, self._token_axes(x))
        return mixed, losses

    def _in_own_region(
        self, x: Array
    ) -> tuple[Float[Array, "*tokens features"], RouterLosses] | Float[Array, "*tokens features"]:
        """The layer called outside `shard_map` on a placed model (the one-device step): one
        region manual over every axis of the mesh, the tokens split over all of them but the
        layer's model axis (in mesh order: the data axes and the expert axis, and any other
        axis the mesh has, such as another layer's tensor axis). No axis can stay with the
        compiler: routing sorts the tokens, and a sort along a dimension the compiler splits
        gathers it whole on every device. A capacity (`capacity_factor`) then counts the
        tokens of one device of that split."""
        owner = type(self).__name__
        mesh = region_mesh(owner, self, self.expert_axis_name)
        axes = tuple(mesh.axis_names)
        token_axes = batch_axes(mesh, frozenset(axes), self, frozenset())
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        devices = math.prod(sizes[name] for name in token_axes)
        count = math.prod(x.shape[:-1])
        if count % devices:
            raise ValueError(
                f"{owner}: `x` has shape {tuple(x.shape)}, {count} tokens, which the layer "
                f"splits over the mesh axes {token_axes} ({devices} devices) when called "
                f"outside `shard_map`; {devices} does not divide {count}. Give it a number of "
                f"tokens (the product of the leading dimensions) that {devices} divides."
            )
        tokens = x.reshape(-1, x.shape[-1])
        split = P(token_axes)
        out_specs = split if self.origin is not None else (split, P())
        out = call_in_own_region(
            owner,
            axes,
            self,
            lambda layer, rows: layer(rows),
            (tokens,),
            arg_specs=(split,),
            out_specs=out_specs,
            arg_names=("x",),
        )
        mixed, losses = (out, None) if self.origin is not None else out
        if explicit_axes(mesh):
            # Over Explicit axes the output's type says the region's split; give it the
            # tokens' own (the residual add after the layer takes both).
            mixed = jax.sharding.reshard(mixed, jax.typeof(tokens).sharding)
        mixed = mixed.reshape(x.shape)
        return mixed if losses is None else (mixed, losses)

    def _capacity(self, num_tokens: int) -> int:
        """Assignments each expert takes of a device's `num_tokens` (`capacity_factor`)."""
        assert self.capacity_factor is not None
        # An expert takes each token at most once: a larger capacity drops nothing.
        wanted = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        return min(wanted, num_tokens)

    def _token_axes(self, x: Array) -> tuple:
        # The mesh axes the tokens are split over: where shard_map types them (check_vma),
        # every axis they vary over but a pipeline's (its stages hold other microbatches,
        # at other steps); the expert axis always splits them.
        axes = set(varying_axes(x)) - pipeline_axes()
        if self.expert_axis_name is not None:
            axes.add(self.expert_axis_name)
        return tuple(sorted(axes, key=str))

    def _static(self, axis: int, rows_per_slot: int, slots: int = 1) -> "_Static":
        return _Static(
            axis_name=self.expert_axis_name,
            axis_size=axis,
            rows_per_slot=rows_per_slot,
            local_experts=self.num_experts // axis,
            activation=self.activation,
            model_axis_name=self.model_axis_name,
            slots=slots,
        )

    def _exchange(
        self, params: "_ExpertParams", rows: Array, sorted_experts: Array, num_tokens: int
    ) -> Array:
        axis = self.expert_axis_name
        n = axis_size(axis, "MixtureOfExperts", argument="expert_axis_name")
        if self.num_experts % n:
            raise ValueError(
                f"MixtureOfExperts: {self.num_experts} experts do not divide over the "
                f"{n} devices of expert axis {axis!r}. Choose a multiple of {n}."
            )
        local = self.num_experts // n
        if params.up.shape[0] != local:
            raise ValueError(
                f"MixtureOfExperts: the local expert block has {params.up.shape[0]} experts; "
                f"{self.num_experts} over the {n} devices of {axis!r} expects {local}. Pass "
                f"the layer into shard_map with the specs of `eqpar.partition_specs(model)`."
            )
        if varies_over(rows, axis) is False:
            raise ValueError(
                f"MixtureOfExperts: the tokens are the same on every device of expert axis "
                f"{axis!r}; each device must bring its own. Split the batch over it as over a "
                f"data axis: in_specs P(('data', {axis!r})) for the batch (or P({axis!r}))."
            )
        # Typed as varying wherever the tokens are, the weights' gradients are summed over
        # the data axes here, outside the rounds below: a sum inside them would wait on
        # devices of another data group, which may run another number of rounds.
        params = jax.tree.map(lambda leaf: cast_varying(leaf, varying_axes(rows)), params)
        slots = _slots_per_destination(local)
        if self.capacity_factor is not None:
            # Each source sends at most `capacity` per expert: one round always fits.
            per_slot = self._capacity(num_tokens) * (local // slots)
        else:
            # The balanced share of a slot: a pair's over its slots (per expert when each
            # expert has its own), times the buffer factor.
            per_slot = expert_buffer_rows(num_tokens, self.top_k, n * slots, self.buffer_factor)
        static = dataclasses.replace(
            self._static(n, min(per_slot, rows.shape[0]), slots),
            operand_axes=tuple(varying_axes(leaf) for leaf in jax.tree.leaves((rows, params))),
        )
        meta = _routing_meta(sorted_experts, static, self.num_experts)
        if self.capacity_factor is not None:
            return _one_round(static, jnp.int32(0), meta, rows, params)
        return _rounds(static, meta, rows, params)  # pyright: ignore[reportReturnType]


# Models may be abstract (`eqx.filter_eval_shape`): their leaves are ShapeDtypeStructs, which
# the conversion to and from the hand-written form reshapes as it would the arrays.
def _stack(leaves: list) -> Array | jax.ShapeDtypeStruct:
    if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype)
    return jnp.stack(leaves)


def _transposed(leaf: Array | jax.ShapeDtypeStruct) -> Array | jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[::-1], leaf.dtype)
    return leaf.T


def _row(leaf: Array | jax.ShapeDtypeStruct, index: int) -> Array | jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return leaf[index]


# Beyond [-1, 1] too, where clipping activations (hard_tanh) part from the identity.
_PROBE = (-7.5, -2.0, -1.0, -0.25, 0.0, 0.5, 1.0, 3.0, 11.0)


def _describe(expert: object) -> str:
    if isinstance(expert, eqx.nn.MLP):
        return f"an eqx.nn.MLP of depth {len(expert.layers) - 1}"
    return type(expert).__name__


def _same_function(fn: object, other: object) -> bool:
    """Whether two activations agree (the same object, or the same values on a probe)."""
    if fn is other:
        return True
    try:
        probe = jnp.array(_PROBE)
        return bool(jnp.array_equal(fn(probe), other(probe)))  # type: ignore[operator]
    except Exception:
        return False


def _is_identity(fn: object) -> bool:
    return isinstance(fn, eqx.nn.Identity) or _same_function(fn, lambda values: values)


_UNDER_VMAP = (
    "MixtureOfExperts: called under `jax.vmap` (e.g. a model run one example at a time). "
    "The layer groups the tokens of a whole batch itself (by expert, and over the devices "
    "of an expert axis): call it on the batch, [..., features], outside the vmap. It routes "
    "every token on its own, so the result is the same."
)


class _ExpertParams(NamedTuple):
    up: Array
    gate: Array | None
    down: Array
    up_bias: Array | None
    down_bias: Array | None


@dataclasses.dataclass(frozen=True)
class _Static:
    axis_name: Hashable | None
    axis_size: int
    # One round's buffer: `slots` slots per (source, destination) pair of devices, each of
    # `rows_per_slot` rows. A slot per local expert (`slots == local_experts`) or one that
    # the destination's experts share (`slots == 1`, see `_slots_per_destination`).
    rows_per_slot: int
    local_experts: int
    activation: Callable
    model_axis_name: Hashable | None
    slots: int = 1
    # The replication types of the loop's operands (rows, then each parameter leaf), for
    # its backward, whose residuals may come back typed otherwise (read from a pipeline
    # schedule's buffer, say).
    operand_axes: tuple = ()


class _RoutingMeta(NamedTuple):
    send_counts: Array  # [n, slots] assignments this device sends to each slot of each device
    send_start: Array  # [n, slots] where each slot's run starts in the sorted assignments
    recv_bounds: Array  # [n, local experts] cumulative counts each source sends per expert
    recv_counts: Array  # [n, slots] assignments each source sends to each slot here
    rounds: Array  # rounds of the exchange every device of the axis runs


def _slots_per_destination(local_experts: int) -> int:
    """A slot per local expert on CPU, one slot per device pair elsewhere.

    With a slot per expert the rows a device receives come grouped by expert in fixed-size
    blocks, and the experts run as one batched matmul over them: the layer holds what a
    capacity-based exchange holds, nothing more. The price is more rounds under skew: a
    round's limit is then per (source, expert) instead of per (source, device), and one
    expert's share of a pair fluctuates more than the pair's total. Where XLA has a ragged
    dot (GPU and TPU) a shared slot costs no memory (the ragged dot runs on the rows as they
    come), so there the experts of a device share its slot and skew costs fewer rounds. On
    CPU JAX's rule for the ragged dot copies the rows once per expert, and the scan that
    replaces it (`_experts_on_cpu`) still holds an extra product per matmul and slices of
    the weights. With one local expert both layouts are the same.
    """
    return local_experts if jax.default_backend() == "cpu" else 1


def _within_capacity(assigned: Array, num_experts: int, capacity: int) -> Array:
    """Whether each assignment is among the first `capacity` of its expert (in order)."""
    order = jnp.argsort(assigned, stable=True)
    sorted_experts = assigned[order]
    counts = jnp.zeros(num_experts, jnp.int32).at[assigned].add(1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(assigned.shape[0]) - starts[sorted_experts]
    return jnp.zeros_like(assigned, dtype=bool).at[order].set(rank < capacity)


def _apply_experts(
    params: _ExpertParams, rows: Array, expert_of_row: Array, static: _Static, *, grouped: bool
) -> Array:
    """The experts on rows: row `i` through local expert `expert_of_row[i]` (an id past the
    last expert gives zeros). `grouped`: the rows already come sorted by expert.

    The serial layer's route, and the exchange's where a device's experts share a slot (GPU
    and TPU). On GPU and TPU the rows are sorted by expert (unless `grouped`) and run as
    XLA's ragged dot. On CPU JAX lowers `lax.ragged_dot` by a generic rule that copies the
    rows once per expert (a `[experts, rows, features]` masked copy, in the forward and
    again in each transpose), so a layer's temp grew with its number of local experts;
    there each matmul is instead a loop over the local experts that holds one `[rows, out]`
    product at a time and selects each expert's rows from it, in the rows' own order (no
    sort, no gathered copy), where that holds less (`_experts_on_cpu`). The loop does the
    same multiply-adds as that rule (every row meets every local expert's weights; XLA's
    ragged dot does one expert's work per row), and both give the same values: each output
    row is its own expert's product, selected, not summed. The choice is made by the
    default backend (`jax.default_backend()`) when the program is traced.
    """
    # Chosen by the default backend while tracing, not by `lax.platform_dependent`: that is
    # a conditional, and under autodiff a conditional's forward keeps the residuals of
    # every branch (zeros for those not taken), which cost the example's step 11% more
    # temp with the CPU branch unused.
    if jax.default_backend() == "cpu":
        return _experts_on_cpu(params, rows, expert_of_row, static, grouped)
    return _experts_by_ragged_dot(params, rows, expert_of_row, static, grouped)


def _experts_on_cpu(
    params: _ExpertParams, rows: Array, expert_of_row: Array, static: _Static, grouped: bool
) -> Array:
    """The scan over experts where it holds less than JAX's CPU rule for `ragged_dot`: the
    scan holds a `[rows, hidden]` product besides each result, the rule a
    `[experts, rows, features]` masked copy of each input. Measured on the exchange's rows
    when they shared a slot on CPU too (`benchmarks/moe.py`, `tests/test_memory_guard.py`):
    with one local expert the scan always wins; with G local experts it wins when
    `hidden <= G x features` (hidden 128 = 2 x 64: 1016 against 1467 KiB) and loses beyond
    (hidden 256 = 4 x 64 with 2 experts: 12% more temp in the example's step), where the
    rule runs instead. On CPU the exchange now gives each expert its own slot and runs no
    such loop; the serial layer (every expert local, rows grouped) still does."""
    features, hidden = params.up.shape[-2], params.up.shape[-1]
    local = static.local_experts
    if local == 1 or hidden <= local * features:
        return _experts_by_loop(params, rows, expert_of_row, static)
    return _experts_by_ragged_dot(params, rows, expert_of_row, static, grouped)


def _times_own_expert_by_loop(x: Array, weights: Array, expert_of_row: Array) -> Array:
    def expert(out: Array, weights_and_id: tuple[Array, Array]) -> tuple[Array, None]:
        own_weights, e = weights_and_id
        return jnp.where((expert_of_row == e)[:, None], x @ own_weights, out), None

    # Expert 0 outside the loop: its product gives the carry the type (dtype, and the mesh
    # axes it varies over) that every later expert's has. The loop scans over the weights
    # rather than indexing them with its counter: the transpose then stacks each expert's
    # gradient instead of writing it at a saved index, and such an index read back from a
    # pipeline schedule's buffers is typed as varying over the pipe axis, which JAX's
    # dynamic_update_slice refuses against expert-split weights.
    first = jnp.where((expert_of_row == 0)[:, None], x @ weights[0], 0)
    ids = jnp.arange(1, weights.shape[0], dtype=expert_of_row.dtype)
    return lax.scan(expert, first, (weights[1:], ids))[0]


def _experts_by_loop(
    params: _ExpertParams, rows: Array, expert_of_row: Array, static: _Static
) -> Array:
    """Every matmul as the scan over experts (rows in any order)."""

    def times_own_expert(x: Array, weights: Array) -> Array:
        return _times_own_expert_by_loop(x, weights, expert_of_row)

    return _expert_mlp_by_row(params, rows, expert_of_row, times_own_expert, static)


def _experts_by_ragged_dot(
    params: _ExpertParams, rows: Array, expert_of_row: Array, static: _Static, grouped: bool
) -> Array:
    order = None if grouped else jnp.argsort(expert_of_row, stable=True)
    if order is not None:
        rows, expert_of_row = rows[order], expert_of_row[order]
    group_sizes = jnp.zeros(static.local_experts, jnp.int32).at[expert_of_row].add(1, mode="drop")

    def times_own_expert(x: Array, weights: Array) -> Array:
        return lax.ragged_dot(x, weights, group_sizes)

    out = _expert_mlp_by_row(params, rows, expert_of_row, times_own_expert, static)
    return out if order is None else jnp.zeros_like(out).at[order].set(out)


def _expert_mlp(
    params: _ExpertParams,
    rows: Array,
    times_own_expert: Callable[[Array, Array], Array],
    own_bias: Callable[[Array], Array],
    static: _Static,
) -> Array:
    """Each row through its expert's MLP, `times_own_expert(x, weights)` being each row of
    `x` times its own expert's block of `weights` (`[experts, in, out]`) and
    `own_bias(bias)` each row's expert's row of `bias` (`[experts, out]`), broadcastable
    against the rows."""
    hidden = times_own_expert(rows, params.up)
    if params.up_bias is not None:
        hidden = hidden + own_bias(params.up_bias)
    if params.gate is not None:
        hidden = static.activation(times_own_expert(rows, params.gate)) * hidden
    else:
        hidden = static.activation(hidden)
    out = times_own_expert(hidden, params.down)
    if static.model_axis_name is not None:
        out = lax.psum(out, static.model_axis_name)
    if params.down_bias is not None:
        out = out + own_bias(params.down_bias)
    return out


def _expert_mlp_by_row(
    params: _ExpertParams,
    rows: Array,
    expert_of_row: Array,
    times_own_expert: Callable[[Array, Array], Array],
    static: _Static,
) -> Array:
    """`_expert_mlp` on rows of any experts, row `i` of expert `expert_of_row[i]` (zeros for
    an id past the last expert)."""
    local = static.local_experts
    row_expert = jnp.minimum(expert_of_row, local - 1)
    out = _expert_mlp(params, rows, times_own_expert, lambda bias: bias[row_expert], static)
    return jnp.where((expert_of_row < local)[:, None], out, 0)


def _experts_by_slot(
    params: _ExpertParams, received: Array, valid: Array, static: _Static
) -> Array:
    """The experts on a round's received rows laid out a slot per local expert,
    `[sources, experts, rows, features]` (`valid`: `[sources, experts, rows]`, zeros where
    not): each expert's rows from every source as one block, all experts as one batched
    matmul, the same work and buffers as a capacity-based exchange."""
    sources, local, rows_per_slot, features = received.shape
    by_expert = received.transpose(1, 0, 2, 3).reshape(local, sources * rows_per_slot, features)

    def times_own_expert(x: Array, weights: Array) -> Array:
        return jnp.einsum("erf,efh->erh", x, weights)

    out = _expert_mlp(params, by_expert, times_own_expert, lambda bias: bias[:, None], static)
    out = out.reshape(local, sources, rows_per_slot, -1).transpose(1, 0, 2, 3)
    return jnp.where(valid[..., None], out, 0)


def _routing_meta(sorted_experts: Array, static: _Static, num_experts: int) -> _RoutingMeta:
    n, local, slots = static.axis_size, static.local_experts, static.slots
    per_expert = jnp.zeros(num_experts, jnp.int32).at[sorted_experts].add(1, mode="drop")
    send_by_expert = per_expert.reshape(n, local)
    recv_by_expert = lax.all_to_all(send_by_expert, static.axis_name, 0, 0, tiled=True)
    # A slot's experts are consecutive, so each slot's assignments are one sorted run.
    send_counts = jnp.sum(send_by_expert.reshape(n, slots, -1), axis=2)
    flat = send_counts.reshape(-1)
    most = lax.pmax(jnp.max(send_counts), static.axis_name)
    return _RoutingMeta(
        send_counts=send_counts,
        send_start=(jnp.cumsum(flat) - flat).reshape(n, slots),
        recv_bounds=jnp.cumsum(recv_by_expert, axis=1),
        recv_counts=jnp.sum(recv_by_expert.reshape(n, slots, -1), axis=2),
        rounds=(most + static.rows_per_slot - 1) // static.rows_per_slot,
    )


def _one_round(
    static: _Static, round_index: Array, meta: _RoutingMeta, rows: Array, params: _ExpertParams
) -> Array:
    """Round `round_index` of the exchange: rows `[r C, (r + 1) C)` of each (source,
    destination, slot) run go to their experts and back (`C` rows per slot); the result
    rows of other rounds are 0."""
    assignments, features = rows.shape
    position = round_index * static.rows_per_slot + jnp.arange(static.rows_per_slot)
    send_valid = position < meta.send_counts[..., None]  # [n, slots, C]
    send_index = jnp.where(send_valid, meta.send_start[..., None] + position, assignments)
    send = jnp.where(send_valid[..., None], rows[jnp.minimum(send_index, assignments - 1)], 0)
    received = lax.all_to_all(send, static.axis_name, 0, 0, tiled=True)  # [sources, slots, C, f]
    received_valid = position < meta.recv_counts[..., None]
    if static.slots == static.local_experts:
        out = _experts_by_slot(params, received, received_valid, static)
    else:
        # One shared slot: the local expert of each received row, from the counts its
        # source announced.
        expert = jax.vmap(lambda bounds: jnp.searchsorted(bounds, position, side="right"))(
            meta.recv_bounds
        )
        expert = jnp.where(received_valid[:, 0], expert, static.local_experts).reshape(-1)
        flat = received.reshape(-1, features)
        out = _apply_experts(params, flat, expert, static, grouped=False)
    back = lax.all_to_all(out.reshape(received.shape), static.axis_name, 0, 0, tiled=True)
    # In the experts' result type (float32 parameters on bfloat16 tokens mix in float32,
    # as the serial layer does).
    back, send_index = back.reshape(-1, features), send_index.reshape(-1)
    return jnp.zeros(rows.shape, back.dtype).at[send_index].add(back, mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounds(static: _Static, meta: _RoutingMeta, rows: Array, params: _ExpertParams) -> Array:
    """Every round of the exchange: round 0, then as many more as the routing needs (a step
    whose busiest device pair overflows one round's buffers). A loop with a trip count
    known only at run time has no reverse-mode rule, so the backward pass is this
    function's own: round 0's pullback from what its forward kept, then a loop over the
    further rounds that recomputes each one's forward (as remat would)."""
    return _rounds_forward(static, meta, rows, params)[0]


def _further_rounds(static: _Static, meta: _RoutingMeta, rows: Array, params: _ExpertParams):
    dtype = jnp.result_type(rows, params.up)
    return lax.fori_loop(
        1,
        meta.rounds,
        lambda r, total: total + _one_round(static, r, meta, rows, params),
        cast_varying(jnp.zeros(rows.shape, dtype), varying_axes(rows)),
    )


def _rounds_forward(static, meta, rows, params):
    first, pullback = jax.vjp(
        lambda rows, params: _one_round(static, jnp.int32(0), meta, rows, params), rows, params
    )
    out = first + _further_rounds(static, meta, rows, params)
    return out, (meta, rows, params, pullback)


def _rounds_backward(static, residuals, cotangent):
    meta, rows, params, first_pullback = residuals

    def typed(tree: tuple) -> tuple:
        # Residuals and cotangents typed as the operands were (see `_Static.operand_axes`).
        leaves, treedef = jax.tree.flatten(tree)
        typed_leaves = [cast_varying(a, axes) for a, axes in zip(leaves, static.operand_axes)]
        return jax.tree.unflatten(treedef, typed_leaves)

    rows, params = typed((rows, params))

    # Summed over the rounds in float32 at least, and rounded to the operands' dtypes once.
    def wide(tree: tuple) -> tuple:
        return jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), tree)

    def accumulate(round_index, grads):
        _, pullback = jax.vjp(
            lambda rows, params: _one_round(static, round_index, meta, rows, params), rows, params
        )
        return typed(jax.tree.map(jnp.add, grads, wide(pullback(cotangent))))

    first = typed(wide(first_pullback(cotangent)))
    total = lax.fori_loop(1, meta.rounds, accumulate, first)
    grad_rows, grad_params = jax.tree.map(lambda g, p: g.astype(p.dtype), total, (rows, params))
    return None, grad_rows, grad_params


_rounds.defvjp(_rounds_forward, _rounds_backward)


def _router_losses(
    logits: Array, probs: Array, assigned: Array, kept: Array, num_experts: int, axes: tuple
) -> RouterLosses:
    """The auxiliary losses over the tokens of every device in `axes` (global means)."""

    def total(value: Array) -> Array:
        return lax.psum(value, axes) if axes else value

    num_tokens = logits.shape[0]
    count = total(jnp.float32(num_tokens))
    per_expert = jnp.zeros(num_experts, jnp.float32).at[assigned].add(1.0)
    share = total(per_expert) / total(jnp.float32(assigned.shape[0]))
    mean_prob = total(jnp.sum(probs, axis=0)) / count
    z = jax.nn.logsumexp(logits, axis=-1)
    return RouterLosses(
        load_balancing=num_experts * jnp.sum(share * mean_prob),
        z_loss=total(jnp.sum(z**2)) / count,
        dropped=total(jnp.sum(~kept).astype(jnp.int32)),
    )


def check_single_axes(owner: str, **axes: Hashable | None) -> None:
    """Refuse a tuple of mesh axes where the experts (or their hidden features) take one
    axis; shared by the layer and the `eqpar.ExpertParallel` style."""
    for name, axis in axes.items():
        if isinstance(axis, tuple | list):
            raise TypeError(
                f"{owner}: `{name}` must name one mesh axis, got {axis!r}; to use more "
                f"devices, make one mesh axis of their product (e.g. 'expert' of size 8)."
            )


def experts_layer(
    layer: object, *, top_k: int | None, normalize_weights: bool = True, check: bool = False
) -> MixtureOfExperts:
    """`layer` as a `MixtureOfExperts`: itself, or built from the hand-written form (a
    module with `router` and a list `experts` of depth-1 MLPs; see `from_experts`) with the
    author's module (weights removed) kept as `origin`. With `check`, the author's layer and
    the converted one are run on a few tokens, and a difference is refused."""
    if isinstance(layer, MixtureOfExperts):
        return layer
    router = getattr(layer, "router", None)
    experts = getattr(layer, "experts", None)
    if not isinstance(layer, eqx.Module) or router is None or type(experts) not in (list, tuple):
        raise TypeError(
            f"expected an eqpar.nn.MixtureOfExperts, or a module with a `router` "
            f"(eqx.nn.Linear) and a list of `experts` (eqx.nn.MLP of depth 1); got "
            f"{type(layer).__name__}."
        )
    own = getattr(layer, "top_k", None)
    own = own if isinstance(own, int) and not isinstance(own, bool) else None
    if top_k is None and own is None:
        raise TypeError(
            f"{type(layer).__name__} has no int `top_k` field: pass the number of experts per "
            f"token, ExpertParallel(top_k=...)."
        )
    if top_k is not None and own is not None and top_k != own:
        raise ValueError(
            f"ExpertParallel(top_k={top_k}) disagrees with {type(layer).__name__}.top_k="
            f"{own}; leave top_k out to use the layer's own."
        )
    chosen = own if top_k is None else top_k
    assert chosen is not None  # one of them was checked above
    moe = MixtureOfExperts.from_experts(
        router,
        experts,  # pyright: ignore[reportArgumentType]  # a list or tuple, checked above
        top_k=chosen,
        normalize_weights=normalize_weights,
    )
    # The author's module without its weights; `experts` holds the list or tuple type.
    skeleton = eqx.tree_at(lambda m: (m.router, m.experts), layer, (None, type(experts)))
    left = [leaf for leaf in jax.tree.leaves(skeleton) if eqx.is_array(leaf)]
    if left:
        raise TypeError(
            f"{type(layer).__name__} holds arrays besides `router` and `experts`; "
            f"MixtureOfExperts would not use them. Write the layer as a MixtureOfExperts."
        )
    moe = moe.replace(origin=skeleton)
    if check:
        _check_conversion(layer, moe)
    return moe


@eqx.filter_jit  # one function, so layers of the same structure share its compilation
def _run_both(layer: object, moe: MixtureOfExperts, tokens: Array) -> tuple:
    return layer(tokens), moe(tokens)  # type: ignore[operator]


def _check_conversion(layer: object, moe: MixtureOfExperts) -> None:
    """Refuse a conversion of a hand-written layer that computes something else (another
    weighting of the chosen experts, say): both run on a few tokens, compiled."""
    leaves = jax.tree.leaves(layer)
    if any(isinstance(leaf, Tracer | jax.ShapeDtypeStruct) for leaf in leaves):
        return  # converted inside a trace, or an abstract model: nothing concrete to run
    features = int(moe.router.in_features)
    probe = jax.random.normal(jax.random.key(0), (8, features), moe.up.dtype)
    try:
        expected, got = _run_both(layer, moe, probe)
    except Exception as error:  # the author's layer may want other arguments
        warnings.warn(
            f"ExpertParallel: could not run {type(layer).__name__} on 8 tokens to check the "
            f"conversion ({type(error).__name__}: {error}); it computes softmax top-"
            f"{moe.top_k} routing with normalize_weights={moe.normalize_weights}.",
            stacklevel=4,
        )
        return
    if not isinstance(expected, jax.Array) or expected.shape != got.shape:
        raise TypeError(
            f"{type(layer).__name__}(tokens [8, {features}]) returned "
            f"{type(expected).__name__} {getattr(expected, 'shape', '')}; the conversion "
            f"keeps a layer that returns its output alone, shaped as its input."
        )
    error = float(jnp.max(jnp.abs(expected - got)))
    scale = float(jnp.max(jnp.abs(expected))) + 1e-6
    if error > 1e-4 * scale:
        raise ValueError(
            f"{type(layer).__name__} and its conversion (softmax top-{moe.top_k} routing, "
            f"normalize_weights={moe.normalize_weights}) differ on 8 tokens by {error:.3g} "
            f"(outputs of size {scale:.3g}). If the author scales each chosen expert by its "
            f"probability without renormalizing, pass ExpertParallel(normalize_weights="
            f"{not moe.normalize_weights}); other routing rules: write the layer as a "
            f"MixtureOfExperts."
        )


def serial_experts(moe: MixtureOfExperts) -> eqx.Module:
    """The serial form of `moe`: no mesh axes, and the author's module where `moe` was
    converted from one."""
    serial = moe.replace(
        expert_axis_name=None, model_axis_name=None, options_before=(), **dict(moe.options_before)
    )
    if moe.origin is None:
        return serial
    features, hidden = moe.up.shape[1:]
    experts = []
    for index in range(moe.num_experts):
        mlp = eqx.nn.MLP(
            features,
            features,
            hidden,
            1,
            activation=moe.activation,
            use_bias=moe.up_bias is not None,
            use_final_bias=moe.down_bias is not None,
            key=jax.random.key(0),
            dtype=moe.up.dtype,
        )
        weights = [_transposed(_row(moe.up, index)), _transposed(_row(moe.down, index))]
        mlp = eqx.tree_at(lambda m: (m.layers[0].weight, m.layers[1].weight), mlp, tuple(weights))
        if moe.up_bias is not None:
            mlp = eqx.tree_at(lambda m: m.layers[0].bias, mlp, _row(moe.up_bias, index))
        if moe.down_bias is not None:
            mlp = eqx.tree_at(lambda m: m.layers[1].bias, mlp, _row(moe.down_bias, index))
        experts.append(mlp)
    original = moe.origin
    container = original.experts  # type: ignore[attr-defined]  # the list or tuple type
    return eqx.tree_at(
        lambda m: (m.router, m.experts),
        original,
        (moe.router, container(experts)),
        is_leaf=lambda node: node is None,
    )
