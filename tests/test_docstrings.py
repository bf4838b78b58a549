"""Every public name of eqpar has a docstring with a runnable ```python example.

The public names are discovered, so a new module or export is covered without editing this
file: every module of `eqpar` and `eqpar.nn` whose name does not start with `_`, and in each
the names of its `__all__`, or, without `__all__`, its public classes and functions (those it
defines; a package also counts what it re-exports). Constants and type aliases carry no runtime
docstring and are not checked. The examples themselves are run by `tests/test_docs.py`.
"""

import importlib
import inspect
import pkgutil
import re
import types
from collections.abc import Iterator

import pytest

PACKAGES = ("eqpar", "eqpar.nn")
EXAMPLE_FENCE = re.compile(r"^\s*```python\s*$", re.MULTILINE)


def public_module_names() -> list[str]:
    """`eqpar`, `eqpar.nn` and every public submodule of either, sorted."""
    names: set[str] = set()
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.add(package_name)
        for info in pkgutil.iter_modules(package.__path__, prefix=f"{package_name}."):
            if not info.name.rsplit(".", 1)[-1].startswith("_"):
                names.add(info.name)
    return sorted(names)


def _is_documentable(obj: object) -> bool:
    return inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)


def _module_public_names(module: types.ModuleType) -> Iterator[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        yield from exported
        return
    is_package = hasattr(module, "__path__")
    for name, obj in vars(module).items():
        if name.startswith("_") or not _is_documentable(obj):
            continue
        # A plain module's imports (Mesh, PartitionSpec, helpers) are not its API; a package's
        # re-exports are.
        if is_package or getattr(obj, "__module__", None) == module.__name__:
            yield name


def discover() -> tuple[dict[str, object], dict[str, str]]:
    """Every public class and function once, keyed by its first public dotted name; and the
    problems met on the way (a module that does not import, an `__all__` entry that does not
    exist), keyed by module, so that one broken module fails its own test, not collection.

    Modules are visited in sorted order, so an object defined in a submodule and re-exported
    by its package (`eqpar.nn.TPDense`) is listed under the package's name.
    """
    found: dict[str, object] = {}
    problems: dict[str, str] = {}
    seen: set[int] = set()
    for module_name in public_module_names():
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # reported by test_public_modules_import_and_export
            problems[module_name] = f"import failed: {type(error).__name__}: {error}"
            continue
        missing = []
        for name in _module_public_names(module):
            if not hasattr(module, name):
                missing.append(name)
                continue
            obj = getattr(module, name)
            if not _is_documentable(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            found[f"{module_name}.{name}"] = obj
        if missing:
            problems[module_name] = f"__all__ lists names the module does not define: {missing}"
    return found, problems


def own_doc(obj: object) -> str:
    """The object's own docstring, cleaned; never one inherited from a base class."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def has_example(obj: object) -> bool:
    """Whether the object's own docstring holds a ```python fenced block."""
    return EXAMPLE_FENCE.search(own_doc(obj)) is not None


PUBLIC, PROBLEMS = discover()
MODULES = public_module_names()


@pytest.mark.parametrize("module_name", MODULES)
def test_public_modules_import_and_export(module_name):
    assert module_name not in PROBLEMS, f"{module_name}: {PROBLEMS[module_name]}"


def test_discovery_finds_the_landed_api():
    # Guards the discovery itself: these names exist, so an empty or broken walk fails here.
    expected = {
        "eqpar.collectives.async_gather",
        "eqpar.placement.host_to_global_device_array",
        "eqpar.ragged.split_batch",
        "eqpar.leaf_paths",
        "eqpar.nn.TPDense",
        "eqpar.nn.TPMLPBlock",
    }
    assert expected <= set(PUBLIC), sorted(expected - set(PUBLIC))


def test_has_example_detects_a_missing_example():
    def documented():
        """Do a thing.

        ```python
        assert True
        ```
        """

    def undocumented():
        """Do a thing, with `inline code` but no example."""

    assert has_example(documented)
    assert not has_example(undocumented)
    assert not has_example(lambda: None)

    class Base:
        """Base.

        ```python
        assert True
        ```
        """

    class Child(Base):
        pass

    assert has_example(Base) and not has_example(Child)  # no inherited examples


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_name_has_docstring_with_example(name):
    obj = PUBLIC[name]
    assert own_doc(obj), (
        f"{name} has no docstring; every public name needs one with a ```python example."
    )
    assert has_example(obj), (
        f"{name}'s docstring has no ```python example; add a short, complete, runnable one "
        "(imports included, tiny shapes; it runs on 8 simulated CPU devices in tests/test_docs.py)."
    )
