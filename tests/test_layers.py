"""kvsim's packages are layers that import one way, and no module imports itself back.

Every `import` of a kvsim module counts, at the top of a module or inside a function
(which runs later, but still ties the two); imports under `if TYPE_CHECKING:` run
nothing and are left out. A package may import its own layer and those below it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvsim"

# bottom first; a package imports only packages of its own or a lower layer
LAYERS = [
    {"kvsim"},  # the version
    {"kvsim.model"},  # specs and memory arithmetic
    {"kvsim.config"},  # schema, loading, errors, engine defaults
    {"kvsim.kvcache", "kvsim.workload", "kvsim.cost"},
    {"kvsim.engines"},
    {"kvsim.sim"},
    {"kvsim.analysis"},
    {"kvsim.plots"},
    {"kvsim.reproduce", "kvsim.sweep", "kvsim.calibrate"},
    {"kvsim.cli"},
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> dict[str, set[str]]:
    """module -> the kvsim modules it imports (a `from pkg import module` names the module)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvsim":
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}")}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "kvsim"}
        graph[module_name(path)] = found - {module_name(path)}
    return graph


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_package_has_a_layer():
    assert {package(m) for m in imports()} <= set(LAYER)


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {d}" for m, deps in graph.items() for d in deps if LAYER[package(d)] > LAYER[package(m)]
    )


def cycles(graph: dict[str, set[str]]) -> list[str]:
    done: set[str] = set()
    found = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            found.append(" -> ".join(path[path.index(module) :] + [module]))
            return
        if module in done or module not in graph:
            return
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def test_packages_import_only_their_own_layer_or_below():
    assert upward(imports()) == []


def test_no_import_cycle_between_modules():
    assert cycles(imports()) == []


def test_the_check_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above find what they look for (on a made-up package)."""
    pkg = tmp_path / "kvsim"
    (pkg / "model").mkdir(parents=True)
    (pkg / "cli").mkdir()
    for path, text in {
        "__init__.py": "",
        "model/__init__.py": "",
        "cli/__init__.py": "",
        "model/a.py": "from kvsim.model import b\nimport kvsim.cli.c\n",
        "model/b.py": "def f():\n    from kvsim.model import a\n",
        "cli/c.py": "",
    }.items():
        (pkg / path).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph = imports()
    assert graph["kvsim.model.a"] == {"kvsim.model", "kvsim.model.b", "kvsim.cli.c"}
    assert graph["kvsim.model.b"] == {"kvsim.model", "kvsim.model.a"}
    assert upward(graph) == ["kvsim.model.a imports kvsim.cli.c"]
    assert cycles(graph) == ["kvsim.model.a -> kvsim.model.b -> kvsim.model.a"]
