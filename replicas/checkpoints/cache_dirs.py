"""Directories written once into the shared model cache, whole or not at all.

NOTE: several processes (engine replicas, ingress replicas, the launcher) may
materialise the same directory at once. Each writes a private temp dir beside the
final one and renames it into place: rename is atomic, and it fails when another
process's complete dir already took the name, which is then used as it is.
Torch-free.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def default_cache_dir() -> Path:
    return Path(os.environ.get("STEPSTREAM_CACHE") or Path.home() / ".cache" / "stepstream")


def models_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()).expanduser() / "models"


def write_once(final_dir: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_dir) and move tmp_dir to final_dir; a final_dir that another
    process completed first wins (callers look for it before they pay for a write)."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        write(tmp_dir)
        # mkdtemp makes the dir private; a shared cache must be readable by others.
        os.chmod(tmp_dir, 0o755)
        for file in tmp_dir.iterdir():
            os.chmod(file, 0o644)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not final_dir.is_dir():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
