"""What a folder's README says it holds, and what it holds: the layout tests of
cluster/ and replicas/ compare the two.

Not a test module.
"""
from __future__ import annotations

import re
from pathlib import Path


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
