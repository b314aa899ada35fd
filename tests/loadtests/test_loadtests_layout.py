"""The package's shape: six entry points, imports among its modules without a cycle,
and none of another module's private names."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "loadtests"
MODULES = {p.stem: ast.parse(p.read_text()) for p in PACKAGE.glob("*.py")}


def _imports(tree: ast.Module) -> list[tuple[str, str]]:
    """(module, name) of each `from loadtests[.module] import name`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loadtests"):
            for alias in node.names:
                if node.module == "loadtests":
                    out.append((alias.name, ""))
                else:
                    out.append((node.module.split(".")[1], alias.name))
    return out


def test_six_entry_points():
    mains = {name for name, tree in MODULES.items()
             if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)}
    # with the locust file, run by `locust -f`
    assert mains | {"locustfile"} == {"bench", "bench_engine", "soak", "fake_server", "gpu_check",
                                      "locustfile"}


def test_no_import_cycle_and_no_private_import():
    graph = {name: {mod for mod, _ in _imports(tree)} for name, tree in MODULES.items()}
    private = [(name, mod, n) for name, tree in MODULES.items() for mod, n in _imports(tree)
               if n.startswith("_")]
    assert not private

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d}))
                   for d in graph.get(start, ()))
    assert [m for m in graph if reaches(m, m, set())] == []
