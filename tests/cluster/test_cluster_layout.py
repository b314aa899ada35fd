"""cluster/'s rooms (api/, transport/, launcher/): each folder's README lists exactly
its files, imports between the rooms run one way, and no module of cluster/ loads
torch when imported (the ingress, the builder and the launcher run on CPU-only
nodes). No Ray is started."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from layout_support import folder_entries, readme_names

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
ROOMS = ("api", "transport", "launcher")
# What each part of cluster/ (a room, or a module at the top) may import of cluster/.
# app.py, engine_args.py, args_table.py and serve_local.py, at the top, may import any.
MAY_IMPORT = {
    "launcher": {"launcher", "http_scheduling"},
    "transport": {"transport", "errors", "metrics"},
    "api": {"api", "transport", "errors", "metrics", "http_scheduling"},
    "errors": set(),
    "metrics": set(),
    "http_scheduling": set(),
}


@pytest.mark.parametrize("folder", ["", *ROOMS])
def test_each_readme_lists_exactly_its_folders_files(folder):
    path = CLUSTER / folder
    assert (path / "README.md").is_file()
    assert readme_names(path) == folder_entries(path), f"{path}/README.md's tables"


def _cluster_imports(path: Path) -> set[str]:
    """The modules of cluster/ that `path` imports, anywhere but under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("cluster."))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module == "cluster":
                    found.update(f"cluster.{a.name}" for a in child.names)
                elif child.module.startswith("cluster."):
                    found.add(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _part(path: Path) -> str:
    """cluster/api/ingress.py -> api; cluster/errors.py -> errors."""
    rel = path.relative_to(CLUSTER)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_imports_between_the_rooms_run_one_way():
    wrong = []
    for path in sorted(CLUSTER.rglob("*.py")):
        allowed = MAY_IMPORT.get(_part(path))
        if allowed is None:
            continue
        wrong += [(str(path.relative_to(REPO)), m) for m in sorted(_cluster_imports(path))
                  if m.split(".")[1] not in allowed]
    assert not wrong, wrong


def test_no_module_of_cluster_loads_torch():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
               for p in sorted(CLUSTER.rglob("*.py"))]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
