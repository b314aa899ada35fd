"""Files only this user can have written: what native code may be loaded from.

A file is *private* when it is a regular file (not a link), owned by this
process's effective user (or root, who could change our code anyway), and not
writable by its group or others; a directory is private on the same terms, so
nobody else can add, replace or rename an entry in it. The checks run on open
descriptors (`O_NOFOLLOW`), and `open_private_file` hands back the descriptor it
checked, so a loader can load exactly that file (`/proc/self/fd/N`): a path
swapped after the check is never the one loaded.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

TRUSTED_OTHER_UIDS = (0,)  # root


class UntrustedPath(RuntimeError):
    """A file or directory someone else could have written; the message says why."""


def why_not_private(st: os.stat_result, what: str) -> str | None:
    """None when only this user (or root) can change it, else why not."""
    uid = os.geteuid()
    if st.st_uid != uid and st.st_uid not in TRUSTED_OTHER_UIDS:
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by its group or others (mode {stat.filemode(st.st_mode)})"
    return None


def make_private_dir(path: Path) -> None:
    """Create `path` (and its parents) if missing; the directory itself with mode 0o700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _open_private_dir(path: Path) -> int:
    """A descriptor of `path` once it is a private directory (not a link), else
    raises UntrustedPath. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise UntrustedPath(f"directory {path} cannot be opened as a directory "
                            f"(a link?): {error}") from error
    why = why_not_private(os.fstat(fd), f"directory {path}")
    if why is not None:
        os.close(fd)
        raise UntrustedPath(why)
    return fd


def check_private_dir(path: Path) -> None:
    """Raises UntrustedPath unless `path` is a private directory (not a link)."""
    os.close(_open_private_dir(path))


def open_private_file(path: Path) -> int:
    """A read-only descriptor of `path` once it and its directory are private, else
    raises UntrustedPath. The caller closes it."""
    dir_fd = _open_private_dir(path.parent)
    try:
        # NOTE: looked up in the directory just checked, not by its path again
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as error:
        raise UntrustedPath(f"file {path} cannot be opened without following links: "
                            f"{error}") from error
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    why = (why_not_private(st, f"file {path}") if stat.S_ISREG(st.st_mode)
           else f"file {path} is not a regular file")
    if why is not None:
        os.close(fd)
        raise UntrustedPath(why)
    return fd


def why_file_not_private(path: Path) -> str | None:
    """None when `path` and its directory are private, else why not."""
    try:
        os.close(open_private_file(path))
    except UntrustedPath as error:
        return str(error)
    return None
