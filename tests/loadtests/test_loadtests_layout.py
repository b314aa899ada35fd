"""The package's shape: six entry points at the top and no other module there, every
other module in a room (serving/, engine/, gpu/) whose README lists exactly its files,
imports among all the modules without a cycle, and none of another module's private
names."""
import ast
from pathlib import Path

import pytest

from layout_support import readme_names

PACKAGE = Path(__file__).resolve().parents[2] / "loadtests"
ROOMS = ("serving", "engine", "gpu")
ENTRY_POINTS = {"bench", "bench_engine", "soak", "fake_server", "gpu_check", "locustfile"}
# "bench", "serving.client", ...: every module of the package but the __init__ files
MODULES = {".".join(p.relative_to(PACKAGE).with_suffix("").parts): ast.parse(p.read_text())
           for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"}


def _imports(tree: ast.Module) -> list[tuple[str, str]]:
    """(module, name) of each import of the package: `from loadtests[.room][.module]
    import name` or `import loadtests.room.module`; name "" where a module is imported."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".", 1)[1], "") for a in node.names if a.name.startswith("loadtests.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "loadtests":
            within = node.module.partition(".")[2]  # "", a room, or a module
            for alias in node.names:
                inner = f"{within}.{alias.name}" if within else alias.name
                out.append((inner, "") if inner in MODULES else (within, alias.name))
    return out


def test_six_entry_points():
    mains = {name for name, tree in MODULES.items()
             if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)}
    # with the locust file, run by `locust -f`; nothing in a room runs as a program
    assert mains | {"locustfile"} == ENTRY_POINTS
    assert {name for name in MODULES if "." not in name} == ENTRY_POINTS


def test_every_other_module_is_in_a_room():
    assert {name.split(".")[0] for name in MODULES if "." in name} == set(ROOMS)
    assert all(name.count(".") == 1 for name in MODULES if "." in name)
    assert all((PACKAGE / room / "__init__.py").is_file() for room in ROOMS)


@pytest.mark.parametrize("room", ROOMS, ids=[f"{room}/" for room in ROOMS])  # not "gpu": a marker
def test_each_rooms_readme_lists_exactly_its_files(room):
    folder = PACKAGE / room
    files = {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh")} - {"__init__.py"}
    assert readme_names(folder) == files, f"{folder}/README.md's table"


def test_the_readme_lists_exactly_the_folders():
    folders = {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert readme_names(PACKAGE) == folders == {f"{room}/" for room in ROOMS} | {"data/"}


def test_no_import_cycle_and_no_private_import():
    imports = {name: _imports(tree) for name, tree in MODULES.items()}
    assert all(mod in MODULES or mod in ROOMS for found in imports.values() for mod, _ in found)
    private = [(name, mod, n) for name, found in imports.items() for mod, n in found
               if n.startswith("_") or mod.rpartition(".")[2].startswith("_")]
    assert not private
    graph = {name: {mod for mod, _ in found if mod in MODULES} for name, found in imports.items()}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d}))
                   for d in graph.get(start, ()))
    assert [m for m in graph if reaches(m, m, set())] == []
