"""The module graph of ``pid_plugins`` (with the fairseq compat hook) and of the experiments beside it (``research/``),
read from the source (ast) without importing anything: no import circle, counting imports inside functions and
``importlib`` calls (a module name computed from the package's own name is refused: it would hide an edge), no edge
from the package into the experiments, core free of the adapters and of the methods (siblings)."""
import ast
from pathlib import Path
from typing import Dict, List, Set

import pid_plugins

ROOT = Path(pid_plugins.__file__).resolve().parent.parent


def _modules() -> Dict[str, Path]:
    found = {}
    for path in [*(ROOT / "pid_plugins").rglob("*.py"), *(ROOT / "research").rglob("*.py"),
                 ROOT / "pid_plugins_fairseq_compat.py"]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _absolute(module: str, is_package: bool, level: int, name: str) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _names_ours(argument: ast.AST) -> bool:
    """Whether a computed module name is built from this package's own name (``f"{__package__}.x"``, ``"." + x``,
    ``"pid_plugins." + x``); a user's module named at run time (the CLI's ``--import``) is not."""
    for node in ast.walk(argument):
        if isinstance(node, ast.Name) and node.id in ("__package__", "__name__", "__spec__"):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith((".", "pid_plugins")):
            return True
    return False


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: List[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node.level, node.module) if node.level else node.module or ""
                for alias in node.names:
                    child = f"{source}.{alias.name}"
                    targets.append(child if child in modules else source)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "import_module", "__import__"):
                argument = node.args[0] if node.args else None
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    name = argument.value
                    if name.startswith("."):
                        level = len(name) - len(name.lstrip("."))
                        name = _absolute(module, is_package, level, name.lstrip(".") or "")
                    targets.append(name)
                elif argument is not None and _names_ours(argument):  # a computed name of one of our modules:
                    raise AssertionError(  # which one cannot be read, so it is refused outright
                        f"{path.relative_to(ROOT)}:{node.lineno}: import_module with a computed name; import "
                        "pid_plugins modules by name (an import statement) so the module graph can be checked"
                    )
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_analysis_finds_a_circle_and_a_hidden_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    # a package whose __init__ imports a submodule that imports the package back: a circle
    assert circles({"p": {"p.a"}, "p.a": {"p"}}) == [["p", "p.a"]]
    hidden = ast.parse("import importlib\nx = importlib.import_module(f'{__package__}.discovery')")
    assert _names_ours(next(n for n in ast.walk(hidden) if isinstance(n, ast.Call)).args[0])


def test_pid_plugins_has_no_import_circle():
    graph = import_graph()
    assert "pid_plugins.core.methods" in graph["pid_plugins.core"]  # the graph is read
    assert circles(graph) == []


def test_the_package_never_imports_the_experiments():
    """``pid_plugins`` (the wheel) and the compat hook import nothing of ``research/`` (demo, reproduce, study),
    which uses the package, nor name it in a string (``importlib.import_module("research...")``, runpy)."""
    graph = import_graph()
    assert "pid_plugins.analysis.models" in graph["research.experiments"]  # the experiments' edges are read
    assert "pid_plugins.cli" in graph["research.cli"] and "research.cli" in graph["research.__main__"]
    assert "pid_plugins.catalogue" in graph["pid_plugins.hf.catalogue"]  # from .. import catalogue
    into = {module: sorted(t for t in targets if t.split(".")[0] == "research")
            for module, targets in graph.items() if module.split(".")[0].startswith("pid_plugins")}
    assert not {module: targets for module, targets in into.items() if targets}
    for module, path in _modules().items():
        strings = [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(getattr(n, "value", 0), str)]
        if module.startswith("pid_plugins"):
            assert not [v for v in strings if v == "research" or v.startswith("research.")], module


def test_core_imports_no_adapter_and_adapters_never_import_each_other():
    graph = import_graph()
    adapters = ("timm", "hf", "mmseg", "fairseq")
    for module, targets in graph.items():
        zoo = module.split(".")[1] if module.count(".") else None
        for target in targets:
            other = target.split(".")[1] if target.count(".") else None
            if module.startswith("pid_plugins.core"):
                assert other not in adapters, f"{module} imports {target}"
            if module.startswith("pid_plugins.core") and ".siblings" not in module:  # the methods import core
                assert ".siblings" not in target, f"{module} imports {target}"
            if zoo in adapters and other in adapters:
                assert other == zoo, f"{module} imports {target}"
