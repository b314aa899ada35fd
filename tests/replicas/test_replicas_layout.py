"""replicas/'s rooms (kv_cache/, sampling/, checkpoints/): each folder's README lists
exactly its files, and imports run down the packages: replicas never imports cluster,
deltas imports neither."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REPLICAS = REPO / "replicas"
ROOMS = ("kv_cache", "sampling", "checkpoints")


def readme_names(folder: Path) -> set[str]:
    """The files and folders the `| file | what |` and `| folder | what |` tables of
    `folder`/README.md name in their first column."""
    names, in_table = set(), False
    for line in (folder / "README.md").read_text().splitlines():
        if re.fullmatch(r"\|\s*(file|folder)\s*\|\s*what\s*\|", line.strip()):
            in_table = True
        elif in_table and line.startswith("|"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
        else:
            in_table = False
    return names


def folder_entries(folder: Path) -> set[str]:
    files = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    dirs = {f"{p.name}/" for p in folder.iterdir()
            if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}
    return files | dirs


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
