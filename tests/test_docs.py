"""The documentation works: its code runs and the site builds without a warning.

- Every ```python block of `docs/**/*.md` runs. The blocks of one page run in order in one
  namespace (a page may build on its earlier blocks), in a fresh Python process with 8 CPU
  devices and eqpar under the jaxtyping + beartype import hook, as in the rest of the suite. The
  process runs in its own process group; the test fails if anything it started is still alive
  when it ends. ```bash blocks are shown, not run; ```py blocks (code of *other* libraries,
  shown for comparison) are allowed only on the pages listed in `SHOWN_ONLY_PAGES`.
- Every ```python example in the docstring of a public module or name (see
  `tests/test_docstrings.py` for how they are found) and of its classes' public methods (and
  `__call__`) runs, each block on its own, in
  this process (8 CPU devices, runtime type checks on), with the global mesh and eqpar's
  current distribution restored afterwards.
- `mkdocs build --strict` succeeds into a temporary directory, with the remote inventories of
  `docs/_hooks/inventories.py` switched off, as on a machine without network; every public
  module has a page in `docs/api/`.
"""

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import linecache
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from test_docstrings import MODULES, PROBLEMS, PUBLIC, own_doc

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
PAGE_TIMEOUT_SECONDS = 600
BUILD_TIMEOUT_SECONDS = 300
SHOWN_ONLY_PAGES = {"porting.md"}  # pages allowed ```py blocks: other libraries' code

FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")


@dataclasses.dataclass(frozen=True)
class CodeBlock:
    language: str  # the first word of the fence's info string ("" when none)
    line: int  # 1-based line number of the block's first code line in its file
    source: str  # dedented by the fence's own indentation


def code_blocks(text: str) -> list[CodeBlock]:
    """Every fenced code block of a Markdown text, including fences nested in lists/admonitions."""
    blocks: list[CodeBlock] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE_OPEN.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        info = opening["info"].strip().lstrip("{").strip()
        language = re.split(r"[\s{}.]", info, maxsplit=1)[0] if info else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        else:
            raise ValueError(f"line {i + 1}: code fence {fence!r} is never closed")
        blocks.append(CodeBlock(language, i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


# ---------------------------------------------------------------------------------------------
# The blocks of each page, in a fresh process.

# Runs in the child: configure JAX and the type-checking hook exactly like tests/conftest.py and
# the pytest options do, then run the page's blocks in one namespace. Each block is compiled
# with the page's path and its own line numbers, so a traceback points into the Markdown file.
_PAGE_RUNNER = """
import json, os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 8)
from jaxtyping import install_import_hook
install_import_hook(["eqpar"], "beartype.beartype")
with open(sys.argv[1]) as f:
    page, blocks = json.load(f)
namespace = {"__name__": "__main__"}
for block in blocks:
    padded = "\\n" * (block["line"] - 1) + block["source"]
    exec(compile(padded, page, "exec"), namespace)
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group exists but is not ours to signal
        return True
    return True


def run_page(page: Path, workdir: Path) -> subprocess.CompletedProcess:
    """Run the ```python blocks of `page` in a new process group; kill the group when done.

    The output goes to a file, not a pipe, so that a process the page leaves behind (which
    would inherit the pipe) cannot keep this call waiting.
    """
    blocks = [b for b in code_blocks(page.read_text()) if b.language == "python"]
    payload = workdir / "blocks.json"
    payload.write_text(json.dumps([str(page), [dataclasses.asdict(b) for b in blocks]]))
    log_path = workdir / "output.txt"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _PAGE_RUNNER, str(payload)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: everything it starts can be found
        )
        try:
            returncode = process.wait(timeout=PAGE_TIMEOUT_SECONDS)
            timed_out = False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
        leftover = _group_alive(process.pid)
        if leftover or timed_out:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = log_path.read_text()
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    assert not timed_out, f"{name} ran longer than {PAGE_TIMEOUT_SECONDS} s:\n{output}"
    assert not leftover, f"{name} left processes running (killed now):\n{output}"
    return subprocess.CompletedProcess(process.args, returncode, output)


def _has_python(page: Path) -> bool:
    try:
        return any(b.language == "python" for b in code_blocks(page.read_text()))
    except ValueError:  # an unclosed fence: let the page's test run and report it
        return True


PAGES_WITH_CODE = [p for p in PAGES if _has_python(p)]


@pytest.mark.parametrize(
    "page", PAGES_WITH_CODE, ids=[str(p.relative_to(DOCS)) for p in PAGES_WITH_CODE]
)
def test_page_code_runs(page, tmp_path):
    result = run_page(page, tmp_path)
    assert result.returncode == 0, (
        f"a ```python block of docs/{page.relative_to(DOCS)} failed (the traceback's line "
        f"numbers are the page's):\n{result.stdout}"
    )


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_fences_are_runnable_or_marked_as_shown(page):
    # Python code is fenced ```python (and then runs); other libraries' code, which cannot
    # run here, is fenced ```py, and only on the pages listed in SHOWN_ONLY_PAGES.
    relative = str(page.relative_to(DOCS))
    for block in code_blocks(page.read_text()):
        assert block.language not in {"python3", "py3", "pycon", "ipython"}, (
            f"docs/{relative}:{block.line}: fence the block ```python so that it runs"
        )
        if block.language == "py":
            assert relative in SHOWN_ONLY_PAGES, (
                f"docs/{relative}:{block.line}: ```py blocks are not run; fence eqpar code "
                "```python (only other libraries' code, on the porting page, may be ```py)"
            )


def test_code_blocks_finds_nested_fences_and_their_lines():
    text = "\n".join(
        [
            "# Title",  # 1
            "```python",  # 2
            "x = 1",  # 3
            "```",  # 4
            "- a list item:",  # 5
            "",  # 6
            "    ```python",  # 7
            "    y = x + 1",  # 8
            "    ```",  # 9
            '```bash title="run"',  # 10
            "echo hi",  # 11
            "```",  # 12
            "````md",  # 13
            "```python",  # 14
            "not code",  # 15
            "```",  # 16
            "````",  # 17
        ]
    )
    blocks = code_blocks(text)
    assert [(b.language, b.line) for b in blocks] == [
        ("python", 3),
        ("python", 8),
        ("bash", 11),
        ("md", 14),
    ]
    assert blocks[1].source == "y = x + 1\n"
    with pytest.raises(ValueError, match="never closed"):
        code_blocks("```python\nx = 1\n")


def test_run_page_reports_the_failing_line_and_kills_leftovers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is one'\n```\n"
    )
    result = run_page(page, tmp_path)
    assert result.returncode != 0
    assert f'File "{page}", line 8' in result.stdout and "x is one" in result.stdout

    sleeper = tmp_path / "sleeper.md"
    sleeper.write_text(
        "```python\nimport subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n```\n"
    )
    with pytest.raises(AssertionError, match="left processes running"):
        run_page(sleeper, tmp_path)


# ---------------------------------------------------------------------------------------------
# Docstring examples, in this process.


def _public_members(cls: type) -> list[tuple[str, object]]:
    """The class's own public methods and properties (plus `__call__`), in definition order."""
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(value, classmethod | staticmethod):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if callable(value):
            members.append((name, value))
    return members


def docstring_examples(name: str, obj: object) -> list[tuple[str, CodeBlock]]:
    """`(where, block)` for every ```python block of `obj`'s docstring and its methods'."""
    documented = [(name, obj)]
    if inspect.isclass(obj):
        documented += [(f"{name}.{member}", value) for member, value in _public_members(obj)]
    found = []
    for where, item in documented:
        doc = own_doc(item)
        found += [(where, b) for b in code_blocks(doc) if b.language == "python"]
    return found


@contextlib.contextmanager
def restored_global_state():
    """Put back the process-wide mesh and eqpar's current distribution after an example."""
    import eqpar

    get_distribution = getattr(eqpar, "distribution", None)
    set_distribution = getattr(eqpar, "set_distribution", None)
    tracks_distribution = callable(get_distribution) and callable(set_distribution)
    before = get_distribution() if tracks_distribution else None  # type: ignore[misc]
    mesh_scope = jax.set_mesh(None) if hasattr(jax, "set_mesh") else contextlib.nullcontext()
    try:
        with mesh_scope:
            yield
    finally:
        if tracks_distribution and get_distribution() is not before:  # type: ignore[misc]
            set_distribution(before)  # type: ignore[misc]


EXAMPLES = {name: docstring_examples(name, obj) for name, obj in PUBLIC.items()}
# Module docstrings open every API page, so their examples run too.
for _module in MODULES:
    if PROBLEMS.get(_module, "").startswith("import failed"):  # reported by test_docstrings
        continue
    _module_examples = [
        (_module, block)
        for block in code_blocks(inspect.getdoc(importlib.import_module(_module)) or "")
        if block.language == "python"
    ]
    if _module_examples:
        EXAMPLES[f"module {_module}"] = _module_examples


@pytest.mark.parametrize("name", sorted(n for n, examples in EXAMPLES.items() if examples))
def test_docstring_examples_run(name):
    for where, block in EXAMPLES[name]:
        filename = f"<docstring of {where}>"
        # Register the source so that a traceback shows the failing line of the example.
        linecache.cache[filename] = (
            len(block.source),
            None,
            block.source.splitlines(True),
            filename,
        )
        with restored_global_state():
            exec(compile(block.source, filename, "exec"), {"__name__": "__main__"})


def test_docstring_examples_cover_methods():
    # TPDense documents from_linear and to_linear with examples of their own.
    wheres = {where for where, _ in EXAMPLES["eqpar.nn.TPDense"]}
    assert {
        "eqpar.nn.TPDense",
        "eqpar.nn.TPDense.from_linear",
        "eqpar.nn.TPDense.to_linear",
    } <= wheres


# ---------------------------------------------------------------------------------------------
# The site.


def mkdocs_build(site_dir: Path, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EQPAR_DOCS_INVENTORIES"}
    env.update(NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT), **env_overrides)
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    return subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_SECONDS,
        check=False,
    )


def test_site_builds_strictly(tmp_path):
    result = mkdocs_build(tmp_path / "site")
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log and "ERROR" not in log, log
    assert (tmp_path / "site" / "index.html").is_file()


@pytest.mark.parametrize("module_name", [m for m in MODULES if m not in ("eqpar", "eqpar.nn")])
def test_every_public_module_has_an_api_page(module_name):
    # Each module gets its own reference page; the packages only re-export (see api/index.md).
    directives = {
        line.strip()
        for page in sorted((DOCS / "api").glob("*.md"))
        for line in page.read_text().splitlines()
    }
    assert f"::: {module_name}" in directives, (
        f"no page of docs/api/ renders {module_name}: add docs/api/<name>.md with "
        f"'::: {module_name}' and list it in mkdocs.yml's nav"
    )


def _load_inventory_hook():
    spec = importlib.util.spec_from_file_location(
        "inventories_hook", DOCS / "_hooks" / "inventories.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python_handler_inventories(config) -> list:
    return list(
        config.plugins["mkdocstrings"].config.handlers.get("python", {}).get("inventories", [])
    )


@pytest.mark.parametrize(
    ("switch", "expected"),
    [
        (None, []),
        ("0", []),
        ("1", "defaults"),
        (
            "file:///mirror/jax.inv file:///mirror/equinox.inv",
            ["file:///mirror/jax.inv", "file:///mirror/equinox.inv"],
        ),
    ],
)
def test_inventories_are_opt_in(monkeypatch, switch, expected):
    # Remote inventories are fetched only when EQPAR_DOCS_INVENTORIES asks for them: an
    # unreachable inventory is an error, which fails a strict build on a machine offline.
    from mkdocs.config import load_config

    hook = _load_inventory_hook()
    if switch is None:
        monkeypatch.delenv("EQPAR_DOCS_INVENTORIES", raising=False)
    else:
        monkeypatch.setenv("EQPAR_DOCS_INVENTORIES", switch)
    config = load_config(str(ROOT / "mkdocs.yml"))
    assert _python_handler_inventories(config) == []  # none in mkdocs.yml itself
    hook.on_config(config)
    wanted = list(hook.DEFAULT_INVENTORIES) if expected == "defaults" else expected
    assert _python_handler_inventories(config) == wanted
