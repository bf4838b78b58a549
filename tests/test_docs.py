"""The documentation works: its code runs, its outputs are current, and the site builds.

- Every page's ```python blocks run as a reader would paste them into a fresh Python session:
  one new interpreter per page (`python -c`, in the repository's root directory), the page's
  blocks in page order in its `__main__` namespace, and nothing else. The test adds no device
  count, no `XLA_FLAGS`, no imports and no type-checking hook: it removes every `JAX_*`,
  `XLA_*` and `EQPAR_*` variable from the environment and sets only `JAX_PLATFORMS=cpu`, so
  that a machine with an accelerator runs the pages as a laptop does. A page whose code needs
  several devices therefore sets them itself, visibly, in its first block
  (`jax.config.update("jax_num_cpu_devices", 8)` right after the imports); one that relies on
  setup it does not show fails. The blocks are joined into one script in which every block
  keeps its line numbers in the page, so a traceback points into the Markdown file; the only
  lines the test adds are on the blocks' opening-fence lines, each printing a marker to
  stdout, which splits the output into what each block printed. The interpreter runs in its
  own process group; the test fails if anything it started is still alive when it ends.
- Outputs on the page cannot go stale: a ```text block that directly follows a ```python block
  (nothing but blank lines between them) shows what that block prints to stdout, and the test
  compares it with what the block printed. Trailing whitespace and leading or trailing blank
  lines are ignored, and `...` in the shown output stands for any text (none, or several
  lines), for long messages and values that change from run to run (temporary paths). Nothing
  else is normalised: a block that prints a float rounds it itself to digits that every
  machine agrees on (`f"{loss:.3f}"`), and only deterministic output is shown. To show a
  block's output on any page, put the ```text block right under it; when it differs, the
  failure message gives what the block printed. A ```text block with prose before it is not
  an output and is not checked.
- A block that prints shows it: every ```python block that printed anything (other than blank
  lines) when the page ran has its ```text output block under it, so that a reader sees what
  the code does without running it. The failure names the page, the block's line and what it
  printed; the fix is to paste that under the block, or to stop the block printing. A block
  whose output cannot be the same on every run prints something deterministic instead.
- ```bash blocks are shown, not run; ```py blocks (code of *other* libraries, shown for
  comparison) are allowed only on the pages listed in `SHOWN_ONLY_PAGES`.
- Every ```python example in the docstring of a public module or name (see
  `tests/test_docstrings.py` for how they are found) and of its classes' public methods (and
  `__call__`) runs, each block on its own, in
  this process (8 CPU devices, runtime type checks on), with the global mesh and eqpar's
  current distribution restored afterwards.
- `mkdocs build --strict` succeeds into a temporary directory, with the remote inventories of
  `docs/_hooks/inventories.py` switched off, as on a machine without network (built once, with
  `mkdocs_build`, by `tests/test_site.py`, which then looks at the pages in Chromium); every
  public module has a page in `docs/api/`.
"""

import contextlib
import dataclasses
import importlib.util
import inspect
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
    end: int = 0  # 1-based line number of the closing fence (0: not known)


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
        blocks.append(CodeBlock(language, i + 2, "\n".join(body) + "\n", j + 1))
        i = j + 1
    return blocks


# ---------------------------------------------------------------------------------------------
# The blocks of each page, pasted into a fresh interpreter.

OUTPUT_LANGUAGE = "text"  # a block of this language right under a ```python block: its output
_MARKER = "\x1e"  # printed (with the block's index) on each opening-fence line of the script
_MARKED = re.compile(_MARKER + r"(\d+)\n")


@dataclasses.dataclass(frozen=True)
class Example:
    code: CodeBlock  # a ```python block of the page
    output: CodeBlock | None  # the ```text block right under it: what it prints, if shown


def page_examples(text: str) -> list[Example]:
    """The ```python blocks of a page in order, each with the output block shown under it."""
    lines = text.splitlines()
    blocks = code_blocks(text)
    examples = []
    for i, block in enumerate(blocks):
        if block.language != "python":
            continue
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        shown = (
            following is not None
            and following.language == OUTPUT_LANGUAGE
            and not any(line.strip() for line in lines[block.end : following.line - 2])
        )
        examples.append(Example(block, following if shown else None))
    return examples


def page_script(examples: list[Example]) -> str:
    """The page's ```python blocks as one script, each block at its own lines of the page.

    Each block's opening-fence line prints a marker, so that the output can be split per block
    (`_MARKED`); every other line outside the blocks is empty.
    """
    lines: list[str] = []
    for index, example in enumerate(examples):
        fence = example.code.line - 1  # the opening fence's line, 1-based
        lines += [""] * (fence - 1 - len(lines))
        lines.append(f'print("\\x1e{index}")')
        lines += example.code.source.splitlines()
    return "\n".join(lines) + "\n"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group exists but is not ours to signal
        return True
    return True


def laptop_environment() -> dict[str, str]:
    """This process's environment without anything that configures JAX, XLA or eqpar."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "EQPAR_"))}
    env["JAX_PLATFORMS"] = "cpu"  # the CPU even where an accelerator is installed, as on a laptop
    return env


@dataclasses.dataclass(frozen=True)
class PageRun:
    returncode: int
    stdout: str  # without the markers
    stderr: str  # tracebacks and warnings
    printed: list[str]  # what each ```python block printed, in page order, up to where it stopped


def run_page(page: Path, workdir: Path) -> PageRun:
    """Paste the ```python blocks of `page` into a fresh interpreter; kill its group when done.

    The interpreter runs `exec(compile(<the page's script>, <the page's path>, "exec"))` in its
    own `__main__`, so a traceback names the page and its line. Its output goes to files, not
    pipes, so that a process the page leaves behind (which would inherit a pipe) cannot keep
    this call waiting.
    """
    examples = page_examples(page.read_text())
    script = workdir / "page_script.py"
    script.write_text(page_script(examples))
    program = f"exec(compile(open({str(script)!r}).read(), {str(page)!r}, 'exec'))"
    stdout_path, stderr_path = workdir / "stdout.txt", workdir / "stderr.txt"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", program],
            cwd=ROOT,  # pages that use the repository's examples/ expect to run from a checkout
            env=laptop_environment(),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group: everything it starts can be found
        )
        try:
            returncode = process.wait(timeout=PAGE_TIMEOUT_SECONDS)
            timed_out = False
        except subprocess.TimeoutExpired:
            returncode, timed_out = -1, True
        leftover = _group_alive(process.pid)
        if leftover or timed_out:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    marked, errors = stdout_path.read_text(), stderr_path.read_text()
    pieces = _MARKED.split(marked)  # [before the first block, index, printed, index, ...]
    printed = pieces[2::2]
    output = "".join(pieces[::2])
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    log = f"{errors}\n--- stdout:\n{output}"
    assert not timed_out, f"{name} ran longer than {PAGE_TIMEOUT_SECONDS} s:\n{log}"
    assert not leftover, f"{name} left processes running (killed now):\n{log}"
    return PageRun(returncode, output, errors, printed)


def _normalised(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def output_matches(shown: str, printed: str) -> bool:
    """Whether `printed` is the output `shown` on the page (`...` there stands for any text)."""
    pattern = ".*?".join(re.escape(part) for part in _normalised(shown).split("..."))
    return re.fullmatch(pattern, _normalised(printed), re.DOTALL) is not None


def stale_outputs(page: Path, run: PageRun) -> list[str]:
    """A message for every output shown on `page` that its block did not print."""
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    problems = []
    for example, printed in zip(page_examples(page.read_text()), run.printed, strict=False):
        shown = example.output
        if shown is not None and not output_matches(shown.source, printed):
            problems.append(
                f"{name}:{shown.line}: the output shown under the block of line "
                f"{example.code.line} is not what it prints.\n--- shown:\n{shown.source}"
                f"--- printed:\n{printed}"
            )
    return problems


def unshown_outputs(page: Path, run: PageRun) -> list[str]:
    """A message for every block of `page` that printed something but shows no output."""
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    problems = []
    for example, printed in zip(page_examples(page.read_text()), run.printed, strict=False):
        if example.output is None and _normalised(printed):
            problems.append(
                f"{name}:{example.code.line}: the block of line {example.code.line} prints, "
                f"but the page does not show what. Put a ```{OUTPUT_LANGUAGE} block right under "
                "it (nothing but blank lines between) with its output (`...` for text that "
                "changes from run to run, floats rounded in the block itself), or make it "
                f"print nothing.\n--- printed:\n{printed}"
            )
    return problems


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
    run = run_page(page, tmp_path)
    assert run.returncode == 0, (
        f"a ```python block of docs/{page.relative_to(DOCS)} failed when pasted into a fresh "
        f"interpreter (the traceback's line numbers are the page's):\n{run.stderr}"
        f"\n--- stdout:\n{run.stdout}"
    )
    problems = stale_outputs(page, run) + unshown_outputs(page, run)
    assert not problems, "\n\n".join(problems)


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
    assert f'File "{page}", line 8' in result.stderr and "x is one" in result.stderr
    assert "assert x == 2, 'x is one'" in result.stderr  # the page's own line, as source

    sleeper = tmp_path / "sleeper.md"
    sleeper.write_text(
        "```python\nimport subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n```\n"
    )
    with pytest.raises(AssertionError, match="left processes running"):
        run_page(sleeper, tmp_path)


def test_run_page_gives_a_page_nothing_it_does_not_show(tmp_path, monkeypatch):
    # As pasted into a fresh session: no JAX imported, no names defined, nothing configured.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport os, sys\n\n"
        "print(sorted(name for name in globals() if not name.startswith('__')))\n"
        "print('jax' in sys.modules, 'eqpar' in sys.modules)\n"
        "print(sorted(k for k in os.environ if k.startswith(('JAX_', 'XLA_', 'EQPAR_'))))\n"
        "```\n"
    )
    result = run_page(page, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.printed == ["['os', 'sys']\nFalse False\n['JAX_PLATFORMS']\n"]


def test_outputs_shown_on_a_page_are_checked(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 6 * 7\nprint(x)\n```\n\n```text\n42\n```\n\n"  # shown: checked
        "Prose.\n\n```text\nnot an output: prose comes between\n```\n\n"
        "```python\nprint('a long line', x)\nprint('b')\n```\n"
        "```text\na long ...\nb\n```\n\n"  # `...` stands for any text
        "```python\nprint('quiet' if x else 'loud')\n```\n\n```text\nloud\n```\n"  # stale
        "```python\nprint('not shown')\n```\n"
    )
    examples = page_examples(page.read_text())
    assert [(e.code.line, e.output and e.output.line) for e in examples] == [
        (2, 7),
        (17, 21),
        (26, 30),
        (33, None),
    ]
    result = run_page(page, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.printed == ["42\n", "a long line 42\nb\n", "quiet\n", "not shown\n"]
    assert result.stdout == "".join(result.printed)
    (problem,) = stale_outputs(page, result)
    assert ":30: the output shown under the block of line 26" in problem
    assert "--- shown:\nloud\n--- printed:\nquiet\n" in problem
    (unshown,) = unshown_outputs(page, result)  # the last block prints and shows nothing
    assert f"{page}:33: the block of line 33 prints, but the page does not show what" in unshown
    assert "Put a ```text block right under it" in unshown
    assert unshown.endswith("--- printed:\nnot shown\n")
    quiet = tmp_path / "quiet.md"  # blocks that print nothing, or blank lines, need no output
    quiet.write_text("```python\nx = 1\n```\n\n```python\nprint()\nprint('  ')\n```\n")
    assert unshown_outputs(quiet, run_page(quiet, tmp_path)) == []

    assert output_matches("a\nb  \n\n", "a\nb\n")  # trailing whitespace is ignored
    assert output_matches("x = ...", "x = 1\n2\n3") and output_matches("...", "")
    assert not output_matches("a\nb", "a\n\nb") and not output_matches("a...b", "ab c")


def test_the_charts_of_the_performance_page_are_drawn_from_the_current_data():
    # docs/make_images.py stamps each chart with the digest of the data it drew (the scale
    # table and the --check loss curves of benchmarks/results.md, eqpar's schedule tables);
    # --check recomputes the data.
    result = subprocess.run(
        [sys.executable, str(DOCS / "make_images.py"), "--check"],
        cwd=ROOT,
        env=laptop_environment(),
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr


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
