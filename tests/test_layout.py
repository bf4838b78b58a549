from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

from eqpar._paths import leaf_paths
from eqpar.layout import LayoutMap, TensorLayout, named_shardings, partition_specs
from eqpar.mesh import DeviceMesh
from eqpar.spmd import shard_map


@pytest.fixture(scope="module")
def mesh():
    return DeviceMesh((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))


# --- TensorLayout ------------------------------------------------------------------------------


def test_tensor_layout_spec_and_sharding(mesh):
    layout = TensorLayout(("model", None), mesh)
    assert layout.axes == ("model", None)
    assert layout.spec == P("model", None)
    assert layout.sharding == NamedSharding(mesh.jax_mesh, P("model", None))
    both = TensorLayout((("data", "model"), None))
    assert both.spec == P(("data", "model"), None)
    assert both.with_mesh(mesh).sharding.spec == P(("data", "model"), None)
    assert TensorLayout(P("model")) == TensorLayout(["model"])


def test_tensor_layout_errors(mesh):
    with pytest.raises(ValueError, match=r"name \['pipe'\], which the mesh does not have"):
        TensorLayout(("pipe", None), mesh)
    with pytest.raises(ValueError, match="has no device_mesh"):
        TensorLayout(("model",)).sharding  # noqa: B018
    with pytest.raises(ValueError, match="'model' is used by two dimensions"):
        TensorLayout(("model", ("data", "model")))
    # The runtime type check may catch this first (it samples one entry); both name `axes`.
    with pytest.raises(TypeError, match=r"axes"):
        TensorLayout(("model", 3))  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"Write \('model',\)"):
        TensorLayout("model")


def test_leaf_paths_of_a_model(mlp):
    assert leaf_paths(mlp) == [
        f"layers/{i}/{name}" for i in range(3) for name in ("weight", "bias")
    ]


# --- LayoutMap: a real mapping with regex lookup -----------------------------------------------


def test_layout_map_lookup_rules(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["layers/.*/weight"] = (None, "model")
    layout_map["layers/0/weight"] = ("model", None)  # exact key wins over the regex
    layout_map["bias"] = ("model",)  # fullmatch: does not match "layers/0/bias"
    assert layout_map["layers/0/weight"].axes == ("model", None)
    assert layout_map["layers/2/weight"].axes == (None, "model")
    assert layout_map.get("layers/0/bias") is None
    assert layout_map.get("layers/0/bias", "fallback") == "fallback"
    assert "layers/7/weight" in layout_map and "layers/0/bias" not in layout_map
    with pytest.raises(KeyError, match="no key matches 'layers/0/bias'"):
        layout_map["layers/0/bias"]
    assert layout_map.lookup("layers/0/bias") is None
    assert layout_map.matching_keys("layers/1/weight") == ["layers/.*/weight"]
    assert isinstance(layout_map, Mapping)
    assert list(layout_map) == ["layers/.*/weight", "layers/0/weight", "bias"]
    assert len(layout_map) == 3
    assert dict(layout_map.items())["bias"].spec == P("model")
    del layout_map["bias"]
    assert list(layout_map.keys()) == ["layers/.*/weight", "layers/0/weight"]


def test_layout_map_accepts_every_layout_form(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["a"] = TensorLayout(("model",))
    layout_map["b"] = P(None, "model")
    layout_map["c"] = ["data", None]
    layout_map["d"] = None
    assert [layout_map[k].spec for k in "abcd"] == [
        P("model"),
        P(None, "model"),
        P("data", None),
        P(),
    ]
    assert all(layout_map[k].device_mesh is mesh for k in "abcd")


def test_layout_map_two_matching_keys_raise_naming_path_and_keys(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["layers/.*"] = (None,)
    layout_map[".*/bias"] = ("model",)
    with pytest.raises(
        ValueError, match=r"'layers/0/bias' matches several keys \['layers/\.\*', '\.\*/bias'\]"
    ):
        layout_map.get("layers/0/bias")


def test_layout_map_invalid_regex_names_key(mesh):
    layout_map = LayoutMap(mesh)
    with pytest.raises(ValueError, match=r"key 'layers/\(0' is not a valid regular expression"):
        layout_map["layers/(0"] = ("model",)
    assert len(layout_map) == 0


def test_layout_map_value_errors_name_key(mesh):
    layout_map = LayoutMap(mesh)
    with pytest.raises(ValueError, match=r"LayoutMap\['w'\]: .*\['pipe'\]"):
        layout_map["w"] = ("pipe",)
    # Wrong types: the runtime type check (on in the test suite) or eqpar's own check refuses
    # them; both name the parameter.
    with pytest.raises(TypeError, match=r"value|LayoutMap\['w'\]: a layout must be"):
        layout_map["w"] = 3  # type: ignore[assignment]
    other = DeviceMesh((8,), ("model",))
    with pytest.raises(
        ValueError, match=r"LayoutMap\['w'\]: the TensorLayout is bound to another mesh"
    ):
        layout_map["w"] = TensorLayout(("model",), other)
    with pytest.raises(TypeError, match="key"):
        layout_map[3] = ("model",)  # type: ignore[index]


def test_layout_map_unused_keys_and_unmatched_paths(mesh, mlp):
    layout_map = LayoutMap(mesh)
    layout_map["layers/[01]/weight"] = ("model", None)
    layout_map["head/.*"] = None
    assert layout_map.unused_keys(mlp) == ["head/.*"]
    assert layout_map.unmatched_paths(mlp) == [
        "layers/0/bias",
        "layers/1/bias",
        "layers/2/weight",
        "layers/2/bias",
    ]


def test_strict_layout_map_raises_for_unmatched_paths_and_unused_keys(mesh, mlp):
    layout_map = LayoutMap(mesh, strict=True)
    layout_map["layers/.*/weight"] = None
    layout_map["head/.*"] = None
    with pytest.raises(ValueError, match="no key matches leaf path 'layers/0/bias'"):
        layout_map.lookup("layers/0/bias")
    with pytest.raises(
        ValueError,
        match=r"leaf paths no key matches: \['layers/0/bias', 'layers/1/bias', 'layers/2/bias'\]; "
        r"keys that match no leaf: 'head/\.\*'",
    ):
        partition_specs(mlp, layout_map)
    del layout_map["head/.*"]
    layout_map["layers/.*/bias"] = None
    specs = partition_specs(mlp, layout_map)
    assert specs.layers[0].bias == P()


# --- partition_specs ---------------------------------------------------------------------------


def megatron_map(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["layers/0/weight"] = ("model", None)
    layout_map["layers/0/bias"] = ("model",)
    layout_map["layers/1/weight"] = (None, "model")
    return layout_map


def test_partition_specs_is_a_filtered_pytree_of_the_model(mesh, mlp):
    specs = partition_specs(mlp, megatron_map(mesh))
    assert jax.tree.structure(specs) == jax.tree.structure(eqx.filter(mlp, eqx.is_array))
    assert specs.activation is None and specs.final_activation is None
    assert specs.layers[0].weight == P("model", None)
    assert specs.layers[0].bias == P("model")
    assert specs.layers[1].weight == P(None, "model")
    assert specs.layers[1].bias == P() and specs.layers[2].weight == P()


def test_partition_specs_of_an_abstract_model(mesh):
    abstract = eqx.filter_eval_shape(lambda k: eqx.nn.MLP(8, 4, 16, 2, key=k), jax.random.key(0))
    specs = partition_specs(abstract, megatron_map(mesh))
    assert specs.layers[1].weight == P(None, "model")


def test_partition_specs_work_as_jit_shardings(mesh, mlp):
    specs = partition_specs(mlp, megatron_map(mesh))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh.jax_mesh, s), specs)
    params, static = eqx.partition(mlp, eqx.is_array)
    placed = jax.device_put(params, shardings)
    assert placed.layers[0].weight.sharding.spec == P("model", None)

    def forward(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    x = jnp.linspace(-1, 1, 16 * 8).reshape(16, 8)
    out = jax.jit(forward, in_shardings=(shardings, None), out_shardings=None)(placed, x)
    assert_tree_close(out, jax.vmap(mlp)(x))
    assert named_shardings(specs, mesh).layers[1].weight == shardings.layers[1].weight


def test_partition_specs_work_as_shard_map_in_specs(mesh, mlp):
    layout_map = LayoutMap(mesh)
    layout_map["layers/.*/(weight|bias)"] = None
    specs = partition_specs(mlp, layout_map)

    @shard_map(mesh=mesh, in_specs=(specs, P("data")), out_specs=(P("data"), specs))
    def apply(model, x):
        return jax.vmap(model)(x), model

    x = jnp.linspace(-1, 1, 16 * 8).reshape(16, 8)
    out, model_out = apply(mlp, x)
    assert_tree_close(out, jax.vmap(mlp)(x))
    assert model_out.activation is mlp.activation


def test_rank_mismatch_names_path(mesh, mlp):
    layout_map = LayoutMap(mesh)
    layout_map["layers/0/bias"] = ("model", None)
    with pytest.raises(
        ValueError,
        match=r"LayoutMap\['layers/0/bias'\] gives .* for leaf 'layers/0/bias' of shape \(16,\)",
    ):
        partition_specs(mlp, layout_map)


def test_indivisible_dimension_names_path(mesh, mlp):
    layout_map = LayoutMap(mesh)
    layout_map["layers/2/weight"] = ("model", None)  # 4 rows over 4 devices: fine
    layout_map["layers/2/bias"] = ("data",)  # 4 over 2: fine
    partition_specs(mlp, layout_map)
    layout_map["layers/0/weight"] = (None, ("data", "model"))  # 8 columns over 8: fine
    partition_specs(mlp, layout_map)
    layout_map["layers/1/weight"] = (None, None)
    layout_map["layers/0/bias"] = (("data", "model"),)  # 16 over 8: fine
    layout_map["layers/2/weight"] = (None, ("data", "model"))
    partition_specs(mlp, layout_map)
    layout_map["layers/2/bias"] = (("data", "model"),)  # 4 over 8: not
    with pytest.raises(
        ValueError,
        match=r"leaf 'layers/2/bias' of shape \(4,\): dimension 0 \(size 4\) does not divide by 8",
    ):
        partition_specs(mlp, layout_map)


def test_without_layout_map_everything_undeclared_is_replicated(mlp):
    specs = partition_specs(mlp, mesh=DeviceMesh((8,), ("data",)))
    assert all(spec == P() for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)))


# --- declared layouts --------------------------------------------------------------------------


class ColumnLinear(eqx.Module):
    """A toy module that requires its weight split by rows over `model`."""

    weight: jax.Array
    bias: jax.Array
    spec: P = eqx.field(static=True, default=P("model", None))

    def __partition_specs__(self):
        return {"weight": self.spec}


class Net(eqx.Module):
    blocks: list
    head: eqx.nn.Linear


COLUMN = P("model", None)


def make_net(spec=COLUMN):
    keys = jax.random.split(jax.random.key(1), 3)
    blocks = [ColumnLinear(jax.random.normal(k, (8, 4)), jnp.zeros(8), spec) for k in keys[:2]]
    return Net(blocks, eqx.nn.Linear(8, 4, key=keys[2]))


def test_declared_specs_come_first_and_the_map_fills_in(mesh):
    net = make_net()
    layout_map = LayoutMap(mesh)
    layout_map["head/weight"] = (None, "model")
    specs = partition_specs(net, layout_map)
    assert specs.blocks[0].weight == P("model", None) and specs.blocks[1].weight == P("model", None)
    assert specs.blocks[0].bias == P()
    assert specs.head.weight == P(None, "model")
    assert partition_specs(net).blocks[1].weight == P("model", None)


def test_declared_and_map_agreeing_is_fine(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["blocks/.*/weight"] = (("model",), None)
    specs = partition_specs(make_net(P("model")), layout_map)
    assert specs.blocks[0].weight == P("model")


def test_declared_and_map_disagreeing_names_path(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["blocks/.*/weight"] = (None, "model")
    with pytest.raises(
        ValueError,
        match=r"leaf 'blocks/0/weight' is declared .*'model', None.* but "
        r"LayoutMap\['blocks/\.\*/weight'\] gives",
    ):
        partition_specs(make_net(), layout_map)


def test_declared_specs_are_checked_against_the_mesh():
    with pytest.raises(
        ValueError, match=r"__partition_specs__.*leaf 'blocks/0/weight'.*mesh axes \['model'\]"
    ):
        partition_specs(make_net(), mesh=DeviceMesh((8,), ("data",)))
    with pytest.raises(
        ValueError,
        match=r"leaf 'blocks/0/weight' of shape \(8, 4\): dimension 1 \(size 4\) does not "
        r"divide by 8",
    ):
        partition_specs(make_net(P(None, "model")), mesh=DeviceMesh((8,), ("model",)))


class BadDeclaration(eqx.Module):
    weight: jax.Array

    def __partition_specs__(self):
        return {"kernel": P("model")}


def test_declared_path_that_is_not_a_leaf_raises():
    with pytest.raises(ValueError, match=r"declare specs for \['inner/kernel'\]"):
        partition_specs({"inner": BadDeclaration(jnp.zeros(8))})


def test_the_map_extends_a_declared_spec_on_the_dimensions_it_leaves_open(mesh):
    """As FSDP adds `data`, a layout map adds an axis where a module's declaration says
    nothing (the one route for a pipeline stack with tensor-parallel raw arrays)."""
    layout_map = LayoutMap(mesh)
    layout_map["blocks/.*/weight"] = ("data", None)
    specs = partition_specs(make_net(P(None, "model")), layout_map)
    assert specs.blocks[0].weight == P("data", "model")
    layout_map = LayoutMap(mesh)
    layout_map["blocks/.*/weight"] = (None, "model")  # the same as declared: unchanged
    assert partition_specs(make_net(P(None, "model")), layout_map).blocks[0].weight == P(
        None, "model"
    )
