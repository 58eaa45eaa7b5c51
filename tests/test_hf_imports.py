"""The modules of ``pid_plugins.hf`` import each other without a cycle, and without hiding one: every import among
them (module level or inside a function) is an edge of the graph, and ``importlib`` is not used to reach one."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pid_plugins" / "hf"


def _graph() -> dict:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {}
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module is None:  # from . import x
                    edges |= {a.name for a in node.names if a.name in modules}
                elif node.level == 1:  # from .x import y
                    edges.add(node.module.split(".")[0])
                elif node.level == 0 and node.module and node.module.startswith("pid_plugins.hf"):
                    rest = node.module[len("pid_plugins.hf"):].lstrip(".")
                    edges.add(rest.split(".")[0] if rest else "__init__")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name != "importlib", f"{path.name} imports importlib"
                    if a.name.startswith("pid_plugins.hf"):
                        rest = a.name[len("pid_plugins.hf"):].lstrip(".")
                        edges.add(rest.split(".")[0] if rest else "__init__")
            elif isinstance(node, ast.Name) and node.id in ("__import__", "import_module"):
                raise AssertionError(f"{path.name} imports by name ({node.id})")
        graph[path.stem] = edges - {path.stem}
    return graph


def test_the_hf_modules_import_each_other_without_a_cycle():
    graph = _graph()
    assert {"attention", "discovery", "conversion", "install", "config"} <= set(graph)
    done, path = set(), []

    def visit(node):
        if node in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(node):] + [node])}")
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt != "__init__" or node != "__init__":
                visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_no_submodule_imports_the_package():
    """A submodule importing ``pid_plugins.hf`` itself would be a cycle through ``__init__`` (which imports them all)."""
    graph = _graph()
    assert [m for m, edges in graph.items() if "__init__" in edges and m != "__init__"] == []
