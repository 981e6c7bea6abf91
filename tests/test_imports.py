"""No import cycles in pallaskit/ and lowering/: the module-level import graph
(every import statement, also those inside functions, since a lazy import is
still a dependency; ``if TYPE_CHECKING:`` blocks left out, since they never
run) has no cycle other than those in ALLOWED."""
from __future__ import annotations

import ast
import os

import networkx as nx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallaskit", "lowering")

# Cycles that exist today, each a set of modules forming one strongly connected
# component. Nothing else may join one, and none may grow.
ALLOWED: list = []  # none: the program module (codegen/program.py) imports the kernel renderers, not they it


def _modules(root: str) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: str = REPO) -> nx.DiGraph:
    """Edges module -> module it imports (``from pkg import mod`` counts as an
    import of ``pkg.mod`` when that is a module, else of ``pkg``; a submodule's
    implicit import of its parent package is not an edge)."""
    modules = _modules(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    parts = name.split(".")[:None if is_package else -1]
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a module a.b, or an attribute
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def test_the_graph_sees_the_packages():
    graph = import_graph()
    assert {"pallaskit", "pallaskit.api", "lowering", "lowering.scheduler", "lowering.codegen.pallas"} <= set(graph)
    assert graph.has_edge("pallaskit.api", "pallaskit.autodiff")
    assert graph.has_edge("lowering.codegen.triton", "lowering.codegen.emitter")
    assert graph.has_edge("lowering.codegen.pallas", "lowering.codegen.emitter")


def test_no_import_cycles_but_the_allowed():
    graph = import_graph()
    found = [set(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    unexpected = [c for c in found if c not in ALLOWED]
    details = []
    for c in unexpected:
        cycle = nx.find_cycle(graph.subgraph(c))
        details.append(" -> ".join(f"{u} (line {graph.edges[u, v]['line']})" for u, v in cycle) + f" -> {cycle[0][0]}")
    assert not unexpected, "import cycles:\n" + "\n".join(details)


def test_a_new_cycle_is_found(tmp_path):
    """The check itself: two modules importing each other, one lazily, form a cycle;
    a TYPE_CHECKING import does not."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "pallaskit" / "a.py").write_text("from pallaskit import b\n")
    (tmp_path / "pallaskit" / "b.py").write_text("def f():\n    from pallaskit.a import x\n")
    (tmp_path / "pallaskit" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pallaskit import a\nfrom . import d\n")
    (tmp_path / "pallaskit" / "d.py").write_text("import pallaskit.c\n")
    graph = import_graph(str(tmp_path))
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    assert cycles == [["pallaskit.a", "pallaskit.b"], ["pallaskit.c", "pallaskit.d"]]
    assert not graph.has_edge("pallaskit.c", "pallaskit.a")
