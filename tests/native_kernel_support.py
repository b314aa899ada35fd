"""Whether a C kernel of replicas/ builds on this machine, for the tests that skip
only where it cannot (no compiler, or one that cannot build it here)."""
from __future__ import annotations

from pathlib import Path

from replicas.attention.native_kernels import build
from replicas.attention.private_files import UntrustedPath


def why_not_built(name: str, source: Path | None = None) -> str | None:
    """None where `name` (or `source`) builds, else the compiler's reason."""
    try:
        build(name, source=source)
    except UntrustedPath:
        return None  # the loader builds it in a private temporary directory instead
    except RuntimeError as error:
        return str(error)
    return None
