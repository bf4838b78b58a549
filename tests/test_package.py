import ast
import pathlib
import re
import sys
import tomllib

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


# --- packaging -------------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Where an import name and its distribution's name differ.
# array_record (the file format of examples/data.py) comes with grain.
DISTRIBUTION_OF = {
    "orbax": "orbax-checkpoint",
    "etils": "orbax-checkpoint",
    "tensorboardX": "tensorboardx",
    "array_record": "grain",
}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_names(requirements: list[str]) -> set[str]:
    """`["jax>=0.10.0", "eqpar[checkpoint,plot]"]` -> `{"jax", "eqpar"}`."""
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def third_party_imports(files: list[pathlib.Path], local: set[str]) -> set[str]:
    """Distribution names of everything `files` import, at any depth (lazy imports too), less
    the standard library and the names in `local`."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    names -= set(sys.stdlib_module_names) | local
    return {DISTRIBUTION_OF.get(name, name) for name in names}


def test_core_dependencies_are_what_the_package_imports():
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    imported = third_party_imports(sorted((ROOT / "eqpar").rglob("*.py")), {"eqpar"})
    optional = requirement_names(extras["checkpoint"] + extras["plot"])
    assert requirement_names(project["dependencies"]) == imported - optional
    assert optional <= imported  # each optional extra is there for an import


def test_examples_need_only_the_examples_extra():
    project = pyproject()["project"]
    examples = sorted((ROOT / "examples").glob("*.py"))
    imported = third_party_imports(examples, {"eqpar", *(path.stem for path in examples)})
    extras = project["optional-dependencies"]
    # tensorboardX is imported only where it is installed (`metrics.TensorBoardWriter`).
    available = requirement_names(
        project["dependencies"]
        + extras["examples"]
        + extras["checkpoint"]
        + extras["plot"]
        + extras["tensorboard"]
    )
    assert imported <= available


def test_version_is_the_same_everywhere():
    import eqpar

    version = pyproject()["project"]["version"]
    assert eqpar.__version__ == version
    assert re.search(
        rf"^copyright: eqpar {re.escape(version)} ", (ROOT / "mkdocs.yml").read_text(), re.M
    )
    assert f"This site documents eqpar {version}." in (ROOT / "docs" / "index.md").read_text()
    assert f"\n## {version}\n" in (ROOT / "CHANGELOG.md").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert pyproject()["project"]["license"] == {"text": "Apache-2.0"}


def test_one_jax_floor_and_one_python_floor_everywhere():
    # What README.md and the docs say eqpar needs is what pyproject.toml declares, and what
    # the floor run of CI pins (.ci/constraints-floor.txt).
    project = pyproject()["project"]
    (jax_floor,) = re.findall(r"^jax>=(\S+)$", "\n".join(project["dependencies"]), re.M)
    python_floor = re.fullmatch(r">=(\S+)", project["requires-python"]).group(1)
    stated = {"jax": [], "python": []}
    patterns = {
        "jax": [
            r"JAX (?:≥|>=) ?(\d[\d.]*\d)",
            r"floors \(JAX (\d[\d.]*\d)",
            r"JAX (\d[\d.]*\d) or newer",
        ],
        "python": [r"Python (?:≥|>=) ?(\d[\d.]*\d)", r"Python (\d[\d.]*\d) or newer"],
    }
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        for what, regexes in patterns.items():
            for regex in regexes:
                stated[what] += [(page.relative_to(ROOT), v) for v in re.findall(regex, text)]
    assert stated["jax"] and stated["python"]
    assert {v for _, v in stated["jax"]} == {jax_floor}, stated["jax"]
    assert {v for _, v in stated["python"]} == {python_floor}, stated["python"]
    pinned = (ROOT / ".ci" / "constraints-floor.txt").read_text()
    assert re.search(rf"^jax=={re.escape(jax_floor)}$", pinned, re.M)
    assert re.search(rf"^jaxlib=={re.escape(jax_floor)}$", pinned, re.M)


def test_readme_and_docs_give_the_same_install_line():
    def install_lines(path: pathlib.Path) -> list[str]:
        return re.findall(r"^pip install .*$", path.read_text(), re.M)

    readme = install_lines(ROOT / "README.md")
    assert len(readme) == 1
    assert install_lines(ROOT / "docs" / "index.md") == readme


# --- the house's rules (DESIGN.md) ------------------------------------------------------------


def eqpar_imports() -> dict[str, list[tuple[str, str | None]]]:
    """Each module of eqpar (dotted) -> the eqpar modules it imports, at any depth (lazy
    imports inside functions too, but for the old-path lookups of a module `__getattr__`),
    each with the name imported from it (`None` for a module import)."""
    found: dict[str, list[tuple[str, str | None]]] = {}
    for path in sorted((ROOT / "eqpar").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        package = module.split(".") if is_package else module.split(".")[:-1]
        edges: list[tuple[str, str | None]] = []
        module_ast = ast.parse(path.read_text())
        # A module-level `__getattr__` that imports a moved name for its old import path runs
        # only when that name is asked for, after both modules are loaded: not an edge.
        old_paths = {
            id(inner)
            for top in module_ast.body
            if isinstance(top, ast.FunctionDef) and top.name == "__getattr__"
            for inner in ast.walk(top)
        }
        for node in ast.walk(module_ast):
            if id(node) in old_paths:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "eqpar":
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if (ROOT / (submodule.replace(".", "/") + ".py")).exists() or (
                        ROOT / submodule.replace(".", "/") / "__init__.py"
                    ).exists():
                        edges.append((submodule, None))
                    else:
                        edges.append((source, alias.name))
            elif isinstance(node, ast.Import):
                edges += [(a.name, None) for a in node.names if a.name.split(".")[0] == "eqpar"]
        found[module] = edges
    return found


def test_no_private_name_is_imported_from_another_public_file():
    # What two files share lives in a private module both import (`_checks`, `_vma`,
    # `pipeline/_loop`, ...): a private name of a public module is private to its file.
    offenders = [
        f"{module} imports {name} from {source}"
        for module, edges in eqpar_imports().items()
        for source, name in edges
        if name is not None
        and name.startswith("_")
        and not source.rsplit(".", 1)[-1].startswith("_")
    ]
    assert offenders == []


def test_no_import_cycle_between_modules():
    # The top-level `eqpar/__init__.py` only re-exports; every other edge counts, lazy
    # imports inside functions included.
    graph = {
        module: {source for source, _ in edges if source != module and source != "eqpar"}
        for module, edges in eqpar_imports().items()
        if module != "eqpar"
    }
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in visiting:
            cycle = [*visiting[visiting.index(module) :], module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done or module not in graph:
            return
        visiting.append(module)
        for source in sorted(graph[module]):
            visit(source)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_measuring_tools_are_not_in_the_package():
    assert not (ROOT / "eqpar" / "_hlo.py").exists()
    assert (ROOT / "benchmarks" / "_hlo.py").exists()
    jax_internals = re.compile(r"jax\._src|jax\.interpreters|thread_resources")
    assert [
        str(path)
        for path in (ROOT / "eqpar").rglob("*.py")
        if jax_internals.search(path.read_text())
    ] == []
