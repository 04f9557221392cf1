"""The shape of the package, as issue 27 measures it: the biggest modules and functions, how many modules and
functions are over the size limits of docs/contributing.md, the top-level modules, and the layers of the import
contract. Static (``ast`` and ``pyproject.toml`` only): nothing is imported.

Run it from the repository root, on any checkout (``git worktree add /tmp/old REV`` for an earlier one)::

    python3 benchmarks/structure.py            # this checkout
    python3 benchmarks/structure.py /tmp/old   # another one
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import tomllib

MODULE_LINES = 600
FUNCTION_LINES = 80


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=".", type=Path, help="a checkout (default: this directory)")
    args = parser.parse_args()
    package = args.root / "zerocopy_pickle"
    modules = sorted(package.rglob("*.py"))
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(package)) for p in modules), reverse=True)
    functions, code = [], []  # code: the same without the docstring
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((length, f"{path.relative_to(package)}:{node.name}"))
                code.append((length - _docstring_lines(node), f"{path.relative_to(package)}:{node.name}"))
    functions.sort(reverse=True)
    code.sort(reverse=True)
    contracts = tomllib.loads((args.root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = {tuple(c["containers"]): len(c["layers"]) for c in contracts if c["type"] == "layers"}
    top = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    packages = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    print(f"modules: {len(modules)}, {sum(n for n, _ in sizes)} lines")
    print("five biggest modules:", ", ".join(f"{name} {n}" for n, name in sizes[:5]))
    print("five biggest functions:", ", ".join(f"{name} {n}" for n, name in functions[:5]))
    print(f"modules over {MODULE_LINES} lines: {sum(1 for n, _ in sizes if n > MODULE_LINES)}")
    print(f"functions over {FUNCTION_LINES} lines: {sum(1 for n, _ in functions if n > FUNCTION_LINES)}")
    print(
        f"functions over {FUNCTION_LINES} lines without their docstrings: "
        + (", ".join(f"{name} {n}" for n, name in code if n > FUNCTION_LINES) or "none")
    )
    print(f"top-level modules: {len(top)} and packages {packages}")
    print("layers:", ", ".join(f"{'.'.join(k)} {v}" for k, v in layers.items()))


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


if __name__ == "__main__":
    main()
