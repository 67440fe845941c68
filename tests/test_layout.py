"""The package's import graph has no cycle (function-level imports included): data flows one
way, from the command line and the demo down to the allocator front and the ctypes seam."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torch_budget"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                # the deepest module of the package this import names (a package, or a module in it)
                while t and t not in modules:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != name and t != "torch_budget":  # the facade imports lazily
                    edges.add(t)
        graph[name] = edges
    return graph


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert "torch_budget.allocator" in graph and "torch_budget.graphs.runner" in graph
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_reads_another_modules_private_names():
    """Modules talk through public names: no `from .x import _y`, no `x._y` on a module of the
    package, no lookup of package modules in sys.modules."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        text = path.read_text()
        if "sys.modules" in text:
            found.append(f"{name}: sys.modules")
        tree = ast.parse(text)
        bound = {}  # local name -> module of the package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in modules and base != name and _private(a.name):
                        found.append(f"{name}: from {base} import {a.name}")
            elif isinstance(node, ast.Import):
                bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and _private(node.attr)):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    assert not found, found
