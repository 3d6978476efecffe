"""Count the product's functions with ``Any`` in their signature.

The product is the three shipped packages, ``peer``, ``server`` and ``swarmgrad``. A function
(or method, or nested function) counts when ``Any`` (``Any`` or ``typing.Any``, also inside a
quoted annotation) appears in a parameter's or the return annotation. Prints the count;
``--list`` prints each such function first, as ``path:line name``::

    .venv/bin/python tools/count_any.py [--list]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("peer", "server", "swarmgrad")

Function = ast.FunctionDef | ast.AsyncFunctionDef


def mentions_any(annotation: ast.expr | None) -> bool:
    """Whether an annotation names ``Any``."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                quoted = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                continue
            if mentions_any(quoted):
                return True
    return False


def signature_has_any(function: Function) -> bool:
    arguments = function.args
    parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    parameters += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
    annotations = [p.annotation for p in parameters] + [function.returns]
    return any(mentions_any(a) for a in annotations)


def functions(path: Path) -> Iterator[Function]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in PRODUCT for p in (root / package).rglob("*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print each function first")
    args = parser.parse_args(argv)
    total = with_any = 0
    for path in product_files():
        for function in functions(path):
            total += 1
            if signature_has_any(function):
                with_any += 1
                if args.list:
                    print(f"{path.relative_to(ROOT)}:{function.lineno} {function.name}")
    print(f"{with_any} of {total} product functions have Any in their signature")
    return 0


if __name__ == "__main__":
    sys.exit(main())
