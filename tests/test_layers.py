"""The packages' imports run one way: down the peer library's layers, from the command line to
everything, from the coordinator only to the formats both sides share; no module imports
itself back through others. Read from the source (``ast``), plus what importing actually
loads, in fresh interpreters."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peer", "server", "swarmgrad", "swarmlab")
PRODUCT = ("peer", "server", "swarmgrad")  # what the wheel ships; swarmlab is the tests' own

# Folders of one layer that never import each other.
SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("peer.averaging.allreduce", "peer.averaging.sharing"),
    (
        "peer.optim.collaborative",
        "peer.optim.decentralized",
        "peer.optim.diloco",
        "peer.optim.hierarchy",
    ),
)
# The peer library, lowest first: a module may import its own layer and those below.
PEER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("peer.exceptions",),
    # what the coordinator and the volunteer share
    ("peer.formats", "peer.wire", "peer.compression"),
    ("peer.transport",),
    ("peer.node",),
    # averaging: the round's vocabulary and wire below matchmaking, the all-reduce and state
    # sharing above it, the averager (and its step) on top
    ("peer.averaging.exceptions", "peer.averaging.seam", "peer.averaging.control"),
    ("peer.averaging.matchmaking.messages",),
    ("peer.averaging.protocol",),
    ("peer.averaging.matchmaking",),
    SIBLINGS[0],
    ("peer.averaging",),
    # optim: what every optimizer passes down, what they share, then one folder each
    ("peer.optim.seam", "peer.optim.scheduler", "peer.optim.averager_options"),
    ("peer.optim.buffers", "peer.optim.no_group", "peer.optim.utilisation"),
    ("peer.optim.shared",),
    SIBLINGS[1],
    ("peer.optim",),
    ("peer.coordinator",),
    ("peer.tasks",),
    ("peer.volunteer", "peer.trainer", "peer.data_dir"),
    ("peer.integrations",),
    ("peer",),  # the package's lazy names (its __init__) reach every layer
)
# What the coordinator may use of the peer library: the shared formats, nothing of the node.
SERVER_MAY_IMPORT = ("peer.exceptions", "peer.formats")
SERVER_STACK = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "jinja2")
SERVER_STACK += ("pydantic_settings", "prometheus_client")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    top_level: bool  # at import time of the importer (not inside a function)
    type_only: bool = False  # under `if TYPE_CHECKING:`: for the type checker only


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
    }


def _imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST, top_level: bool, type_only: bool = False) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                # for the type checker only: never imported at run time
                yield from visit(child, top_level, type_only=True)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(name, alias.name, child.lineno, top_level, type_only)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    prefix = package[: len(package) - child.level + 1]
                    base = ".".join([*prefix, *([child.module] if child.module else [])])
                # `from package import submodule` imports the submodule (the package is only
                # its parent, as for any `import package.submodule`); other names come from
                # the module itself
                submodules = [f"{base}.{a.name}" for a in child.names]
                for imported in submodules:
                    if imported in known:
                        yield Import(name, imported, child.lineno, top_level, type_only)
                if not all(imported in known for imported in submodules):
                    yield Import(name, base, child.lineno, top_level, type_only)
            inner = top_level and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            yield from visit(child, inner, type_only)

    yield from visit(ast.parse(path.read_text(), str(path)), True)


def all_imports(*, type_only: bool = False) -> list[Import]:
    """Every import of the packages; with ``type_only``, those under ``TYPE_CHECKING`` too."""
    known = modules()
    return [
        found
        for name, path in known.items()
        for found in _imports(name, path, known)
        if type_only or not found.type_only
    ]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def peer_layer(module: str) -> int:
    """The index in PEER_LAYERS of the most specific entry that holds ``module``."""
    best, length = -1, -1
    for index, layer in enumerate(PEER_LAYERS):
        for prefix in layer:
            if _within(module, prefix) and len(prefix) > length:
                best, length = index, len(prefix)
    assert best >= 0, f"{module} is in no layer of PEER_LAYERS: place it there"
    return best


def test_every_peer_module_has_a_layer() -> None:
    for name in modules():
        if name.split(".")[0] == "peer":
            peer_layer(name)


def test_the_peer_library_imports_only_down_its_layers() -> None:
    upward = [
        f"{i.importer} (line {i.line}) imports {i.imported}"
        for i in all_imports()
        if _within(i.importer, "peer")
        and i.importer != "peer"
        and _within(i.imported, "peer")
        and peer_layer(i.imported) > peer_layer(i.importer)
    ]
    assert upward == []


def test_sibling_folders_never_import_each_other() -> None:
    for group in SIBLINGS:

        def folder(module: str, group: tuple[str, ...] = group) -> str | None:
            return next((f for f in group if _within(module, f)), None)

        crossing = [
            i
            for i in all_imports(type_only=True)
            if (a := folder(i.importer)) and (b := folder(i.imported)) and a != b
        ]
        assert not crossing, crossing


def test_the_product_never_imports_the_test_and_bench_support() -> None:
    found = [
        f"{i.importer} (line {i.line}) imports {i.imported}"
        for i in all_imports()
        if i.importer.split(".")[0] in PRODUCT and _within(i.imported, "swarmlab")
    ]
    assert found == []


def test_the_peer_library_never_imports_the_command_line_nor_the_server() -> None:
    found = [
        f"{i.importer} (line {i.line}) imports {i.imported}"
        for i in all_imports()
        if _within(i.importer, "peer")
        and i.imported.split(".")[0] in ("server", "swarmgrad", *SERVER_STACK)
    ]
    assert found == []


def test_the_server_uses_only_the_shared_formats_of_the_peer_library() -> None:
    found = [
        f"{i.importer} (line {i.line}) imports {i.imported}"
        for i in all_imports()
        if _within(i.importer, "server")
        and (
            i.imported.split(".")[0] == "swarmgrad"
            or (
                _within(i.imported, "peer")
                and i.imported != "peer"
                and not any(_within(i.imported, allowed) for allowed in SERVER_MAY_IMPORT)
            )
        )
    ]
    assert found == []


def test_the_command_line_loads_the_server_only_in_the_coordinator_command() -> None:
    found = [
        f"{i.importer} (line {i.line}) imports {i.imported}"
        for i in all_imports()
        if _within(i.importer, "swarmgrad")
        and i.top_level
        and i.imported.split(".")[0] in ("server", *SERVER_STACK)
    ]
    assert found == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back_at_import_time() -> None:
    known = modules()
    edges: dict[str, set[str]] = {}
    for i in all_imports():
        if i.top_level and i.imported in known and i.imported != i.importer:
            edges.setdefault(i.importer, set()).add(i.imported)
    assert _cycles(edges) == []


def test_the_node_modules_import_one_way_even_for_the_type_checker() -> None:
    """Within peer.node no module imports itself back, counting the imports under
    ``TYPE_CHECKING`` (the node's parts are handed what they need, not typed as the node)."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for i in all_imports(type_only=True):
        if (
            _within(i.importer, "peer.node")
            and _within(i.imported, "peer.node")
            and i.imported in known
            and i.imported != i.importer
            and i.importer != "peer.node"  # the package's __init__ gathers its modules
        ):
            edges.setdefault(i.importer, set()).add(i.imported)
    assert "peer.node.exchange" in edges and "peer.node.core" in edges  # the graph was read
    assert _cycles(edges) == []


def test_the_transport_layer_never_touches_the_node() -> None:
    """Transports and bulk lanes import nothing of peer.node, not even for the type checker,
    and take nothing typed ``Any`` that could be the node: what they need of it is a
    Protocol of their own (peer.transport.lane_links), which the node satisfies."""
    imports = [
        f"{i.importer} (line {i.line}) imports {i.imported}"
        for i in all_imports(type_only=True)
        if _within(i.importer, "peer.transport") and _within(i.imported, "peer.node")
    ]
    assert imports == []
    untyped = []
    for name, path in modules().items():
        if not _within(name, "peer.transport"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.arg)
                and node.arg in ("core", "node", "owner", "links")
                and node.annotation is not None
                and "Any" in ast.unparse(node.annotation)
            ):
                untyped.append(f"{name} (line {node.lineno}): {node.arg}")
    assert untyped == []
    lanes = (REPO_ROOT / "peer/transport/bulk.py").read_text()
    assert "links: LaneLinks" in lanes  # the test reads the seam it guards


def _loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``statement``."""
    done = subprocess.run(
        [sys.executable, "-c", f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


@pytest.mark.parametrize("statement", ["import server", "import server.app, server.cli"])
def test_the_server_does_not_load_the_node(statement: str) -> None:
    loaded = _loaded_by(statement)
    assert not {m for m in loaded if _within(m, "peer.node") or _within(m, "peer.transport")}
    assert "torch" not in loaded
    assert {m for m in loaded if _within(m, "peer")} <= {
        "peer", "peer.exceptions", "peer.formats", "peer.formats.identity",
        "peer.formats.revocation", "peer.formats.durations", "peer.formats.payloads",
        "peer.formats.requests",
        "peer.formats.run_config", "peer.formats.rates", "peer.formats.task_files",
        "peer.formats.open_types",
    }  # fmt: skip


@pytest.mark.parametrize(
    "statement", ["import peer", "import peer.formats", "import peer.coordinator, swarmgrad.cli"]
)
def test_the_peer_library_does_not_load_the_server_stack(statement: str) -> None:
    loaded = _loaded_by(statement)
    assert not {m for m in loaded if m.split(".")[0] in ("server", *SERVER_STACK)}


def test_import_peer_loads_no_node_and_no_torch() -> None:
    loaded = _loaded_by("import peer, peer.formats")
    assert not {m for m in loaded if _within(m, "peer.node")}
    assert "torch" not in loaded


def test_the_shared_formats_import_only_the_standard_library_and_their_three_packages() -> None:
    allowed = {*sys.stdlib_module_names, "msgpack", "cryptography", "pydantic"}
    found = [
        f"{i.importer} (line {i.line}) imports {i.imported}"
        for i in all_imports()
        if _within(i.importer, "peer.formats")
        and not _within(i.imported, "peer.formats")
        and not _within(i.imported, "peer.exceptions")
        and i.imported.split(".")[0] not in allowed
    ]
    assert found == []


def test_no_node_is_typed_any_in_the_peer_library() -> None:
    """Nodes are typed through the seams (peer.averaging.seam, peer.optim.seam) or as the
    node itself: mypy checks every use."""
    found = []
    for name, path in modules().items():
        if not _within(name, "peer"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.arg) and node.annotation is not None:
                target, annotation = node.arg, node.annotation
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                target, annotation = node.target.id, node.annotation
            else:
                continue
            if target in ("node", "_node") and "Any" in ast.unparse(annotation):
                found.append(f"{name} (line {node.lineno})")
    assert found == []


# The module names that may repeat in peer/: one idea at several layers (docs/architecture.md,
# Layout, says which).
SAME_IDEA_AT_LAYERS = {"__init__.py", "base.py", "exceptions.py", "seam.py"}


def test_no_two_modules_of_the_peer_library_are_named_alike() -> None:
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO_ROOT / "peer").rglob("*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO_ROOT)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert set(repeated) <= SAME_IDEA_AT_LAYERS, {
        name: paths for name, paths in repeated.items() if name not in SAME_IDEA_AT_LAYERS
    }
