"""Write the file tree in ``docs/architecture.md`` from the package tree.

Each package and module of ``peer``, ``server``, ``swarmgrad`` and ``swarmlab`` gets one entry:
its name and the first sentence of its docstring (a package's from its ``__init__.py``). The
tree sits between two marker lines in the doc; ``tests/test_layout_doc.py`` checks that the
committed doc matches this script's output. After moving, adding or re-describing a module::

    .venv/bin/python tools/layout.py

``--check`` only compares, exiting 1 on a difference.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peer", "server", "swarmgrad", "swarmlab")
DOC = Path("docs") / "architecture.md"
BEGIN = "<!-- The tree below is written by tools/layout.py: edit the docstrings, then run it. -->"
END = "<!-- End of the tree written by tools/layout.py. -->"
NAME_WIDTH = 24  # the descriptions' column
WIDTH = 100
# A sentence ends at a full stop followed by a space or the end, not at these abbreviations'.
SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\bvs)(?<!\bal)\.(?=\s|$)")


def summary(path: Path) -> str:
    """The first sentence of a module's docstring (empty without one)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    if not docstring:
        return ""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    end = SENTENCE_END.search(paragraph)
    return paragraph if end is None else paragraph[: end.start() + 1]


def entry(name: str, depth: int, text: str) -> list[str]:
    label = "  " * depth + name
    indent = " " * NAME_WIDTH
    if not text:
        return [label]
    if len(label) >= NAME_WIDTH - 1:
        lines = [label]
        first = indent
    else:
        lines = []
        first = label.ljust(NAME_WIDTH)
    wrapped = textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return lines + wrapped


def package_tree(directory: Path, depth: int) -> list[str]:
    lines = entry(directory.name + "/", depth, summary(directory / "__init__.py"))
    children = sorted(directory.iterdir(), key=lambda p: p.name)
    for module in children:
        if module.suffix == ".py" and module.name != "__init__.py":
            lines += entry(module.name, depth + 1, summary(module))
    for sub in children:
        if sub.is_dir() and (sub / "__init__.py").exists():
            lines += package_tree(sub, depth + 1)
    return lines


def tree(root: Path = ROOT) -> str:
    """The generated block, markers included."""
    lines = [BEGIN, "```"]
    for package in PACKAGES:
        lines += package_tree(root / package, 0)
    lines += ["```", END]
    return "\n".join(lines) + "\n"


def rewritten(document: str, block: str) -> str:
    """``document`` with its generated block replaced by ``block``."""
    start = document.find(BEGIN)
    stop = document.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"{DOC} lacks the marker lines around its tree")
    return document[:start] + block + document[stop + len(END) + 1 :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository (default: this one)"
    )
    args = parser.parse_args(argv)
    path = args.root / DOC
    document = path.read_text()
    new = rewritten(document, tree(args.root))
    if args.check:
        if new != document:
            print(f"{DOC}'s tree differs from the package tree: run tools/layout.py")
            return 1
        return 0
    path.write_text(new)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
