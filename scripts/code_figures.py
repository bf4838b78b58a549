"""Figures of the package's code, as the renovation issue states them.

    python scripts/code_figures.py [PACKAGE_DIR] [-v]   # -v: the longest functions too

Code lines are lines that are neither blank, comments nor docstrings. A function's length is
the code lines in its span (nested functions count in their parent as well). `Any` counts the
name `Any` in code (annotations included) per 1,000 code lines.
"""

import ast
import io
import pathlib
import statistics
import sys
import tokenize


def docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                end = body[0].end_lineno or body[0].lineno
                lines.update(range(body[0].lineno, end + 1))
    return lines


def code_lines(source: str) -> tuple[set[int], int]:
    """The line numbers holding code, and the count of the name `Any`."""
    tree = ast.parse(source)
    skip = docstring_lines(tree)
    lines: set[int] = set()
    any_count = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                          tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if token.start[0] in skip:
            continue
        if token.type == tokenize.NAME and token.string == "Any":
            any_count += 1
        lines.update(range(token.start[0], token.end[0] + 1))
    return lines, any_count


def main() -> None:
    folders = [a for a in sys.argv[1:] if not a.startswith("-")]
    root = pathlib.Path(folders[0] if folders else "eqpar")
    per_file: dict[str, int] = {}
    functions: list[tuple[int, str]] = []
    total_any = 0
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines, any_count = code_lines(source)
        total_any += any_count
        per_file[str(path)] = len(lines)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                functions.append((sum(1 for n in span if n in lines), f"{path}:{node.name}"))
    total = sum(per_file.values())
    lengths = sorted(length for length, _ in functions)
    p95 = lengths[min(len(lengths) - 1, round(0.95 * (len(lengths) - 1)))]
    print(f"files                 {len(per_file)}")
    print(f"code lines            {total}")
    print(f"median file           {statistics.median(per_file.values()):.0f}")
    print(f"largest file          {max(per_file.values())} ({max(per_file, key=per_file.get)})")
    print(f"function length p95   {p95}")
    longest = max(functions)
    print(f"function length max   {longest[0]} ({longest[1]})")
    print(f"Any per 1k code lines {1000 * total_any / total:.1f}")
    if "-v" in sys.argv:
        for length, name in sorted(functions)[-15:]:
            print(f"  {length:4d} {name}")


if __name__ == "__main__":
    main()
