"""replicas/'s rooms (kv_cache/, sampling/, checkpoints/): each folder's README lists
exactly its files, and imports run down the packages: replicas never imports cluster,
deltas imports neither."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from layout_support import folder_entries, readme_names

REPO = Path(__file__).resolve().parents[2]
REPLICAS = REPO / "replicas"
ROOMS = ("kv_cache", "sampling", "checkpoints")


@pytest.mark.parametrize("folder", ["", *ROOMS])
def test_each_readme_lists_exactly_its_folders_files(folder):
    path = REPLICAS / folder
    assert (path / "README.md").is_file()
    assert readme_names(path) == folder_entries(path), f"{path}/README.md's tables"


def _top_level_imports(path: Path) -> set[str]:
    """The first name of every module `path` imports (absolute imports only)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package, never", [("replicas", {"cluster", "loadtests"}),
                                            ("deltas", {"cluster", "replicas", "loadtests"})])
def test_imports_run_down_the_packages(package, never):
    wrong = [(str(p.relative_to(REPO)), sorted(_top_level_imports(p) & never))
             for p in sorted((REPO / package).rglob("*.py")) if _top_level_imports(p) & never]
    assert not wrong, wrong


def test_the_modules_of_models_import_each_other_one_way():
    """No circle among replicas/models/'s modules, counting imports inside functions
    (the shared layers live in layers.py, which the model and the kernels import)."""
    import ast

    folder = Path(__file__).resolve().parents[2] / "replicas" / "models"
    graph = {}
    for path in folder.glob("*.py"):
        name = f"replicas.models.{path.stem}"
        graph[name] = {node.module for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.ImportFrom) and node.module
                       and node.module.startswith("replicas.models.")}

    def visit(name, trail):
        assert name not in trail, " -> ".join([*trail, name])
        for other in graph.get(name, ()):
            visit(other, [*trail, name])
    for name in graph:
        visit(name, [])
