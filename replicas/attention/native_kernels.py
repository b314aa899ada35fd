"""Builds and loads the C kernels in `csrc/` for the CPU attention backend.

Compiled on first use with the machine's C compiler (`$CC`, else `cc`) for this
CPU (`-march=native`), cached under `$STEPSTREAM_CACHE/kernels/` by a key of the
source, flags, compiler and CPU, and loaded with ctypes (which releases the GIL
during each call, so the output thread runs meanwhile). Without a working
compiler `load_paged_decode_attention()` returns None with the reason, and the
backend selector stays on plain torch.

Only a private build is loaded (replicas/attention/private_files.py): the cache
directory and the file must be this user's alone, or anyone who can write to a
shared STEPSTREAM_CACHE could run code in the engine. We create the directory
with mode 0o700 and the file with 0o755. A cached file that is not private is
built again over; in a cache directory that is not private the kernel is built
in a private temporary directory instead (the reason logged).

NOTE: `-ffast-math` is a compile flag only. Linking a shared library with it
(gcc < 13) adds crtfastmath, which flushes denormals to zero for the whole
process on load and would change torch's numerics. It is needed at compile time
so that glibc declares its vectorised `expf`.
NOTE: OpenMP comes from the `libgomp.so.1` torch already loaded (same soname), so
the kernel shares torch's thread pool instead of starting a second one. Where the
kernel would bring a second OpenMP runtime (another compiler's, or a torch whose
libgomp has another name), two thread pools would fight for the same cores: the
kernel is then not used, and the reason logged.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from replicas.attention.private_files import (UntrustedPath, check_private_dir, make_private_dir,
                                              open_private_file, why_file_not_private)

logger = logging.getLogger("stepstream")

CSRC_DIR = Path(__file__).resolve().with_name("csrc")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBS = ("-lm",)
COMPILE_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, tuple[object | None, str | None]] = {}


def kernel_cache_dir() -> Path:
    from replicas.checkpoints.cache_dirs import default_cache_dir
    return default_cache_dir() / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> list[str] | None:
    """The compiler command ($CC may carry arguments, e.g. "ccache gcc"), or None."""
    cmd = shlex.split(os.environ.get("CC") or "cc")
    if not cmd or shutil.which(cmd[0]) is None:
        return None
    return cmd


def _compiler_version(cc: list[str]) -> str:
    try:
        return subprocess.run([*cc, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def build(name: str, cache_dir: Path | None = None, source: Path | None = None) -> Path:
    """Compile `csrc/<name>.c`, or `source` (another revision of it, for benchmarks),
    cached in `cache_dir` (default `kernel_cache_dir()`), and return the shared
    library's path.

    Raises RuntimeError with the compiler's message when it cannot be built, and
    UntrustedPath (a RuntimeError) when `cache_dir` is not private. A cached file
    that is not private is built again over.
    """
    source = source or CSRC_DIR / f"{name}.c"
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    key = hashlib.sha256("\0".join([
        source.read_text(), " ".join(COMPILE_FLAGS + LINK_FLAGS + LINK_LIBS),
        _compiler_version(cc), _cpu_signature(), platform.machine(),
    ]).encode()).hexdigest()[:16]
    cache_dir = cache_dir or kernel_cache_dir()
    make_private_dir(cache_dir)
    check_private_dir(cache_dir)
    out = cache_dir / f"{name}-{key}.so"
    if os.path.lexists(out):
        why = why_file_not_private(out)
        if why is None:
            return out
        logger.warning("cached %s kernel not used (%s): building it again", name, why)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        obj, lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
        for cmd in ([*cc, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                    [*cc, *LINK_FLAGS, str(obj), "-o", str(lib), *LINK_LIBS]):
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as error:
                raise RuntimeError(f"{' '.join(cmd)} failed: {error}") from error
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()[-2000:]}")
        # NOTE: whatever the umask, never writable by others (it would not be loaded)
        os.chmod(lib, 0o755)
        # NOTE: atomic, so replicas building at once never load a half-written file
        os.replace(lib, out)
    logger.info("built native kernel %s", out)
    return out


def load_paged_decode_attention(kv_dtype: str = "float32"):
    """(ctypes function, None) for caches of `kv_dtype` ("float32", "bfloat16", or
    "bfloat16_io": a bfloat16 cache with bfloat16 q and output), or (None, why it is
    unavailable). The library is loaded once per process."""
    name = "paged_decode_attention"
    lib, problem = load_library(name)
    if lib is None:
        return None, problem
    symbol = {"float32": name, "bfloat16": f"{name}_bf16", "bfloat16_io": f"{name}_bf16_io"}
    return decode_attention_function(lib, symbol[kv_dtype]), None


def load_decode_input_check():
    """(ctypes function, None): check_decode_inputs(tables, lens, B, bs, width,
    num_blocks) -> 0, 1 (a length outside its table) or 2 (a block outside the
    cache); or (None, why it is unavailable)."""
    lib, problem = load_library("paged_decode_attention")
    if lib is None:
        return None, problem
    fn = lib.check_decode_inputs
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4
    return fn, None


def load_library(name: str, source: Path | None = None):
    """(ctypes library, None) for `csrc/<name>.c`, or `source`, or (None, why it is
    unavailable). Each library is loaded once per process."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name, source)
        return _loaded[name]


def decode_attention_function(lib: ctypes.CDLL, symbol: str):
    """`symbol` of a loaded decode-attention library, with its C signature."""
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
    return fn


_OPENMP_LIBS = ("libgomp", "libomp", "libiomp")


def openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; else empty)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return set()
    return {p for p in paths if os.path.basename(p).startswith(_OPENMP_LIBS)}


def _load(name: str, source: Path | None = None):
    import torch  # noqa: F401 - loads torch's libgomp first, so the kernel shares it
    before = openmp_runtimes()
    try:
        lib = _load_private_build(name, source)
    except (RuntimeError, OSError) as error:
        return None, f"the {name} kernel could not be built or loaded: {error}"
    added = openmp_runtimes() - before
    if before and added:
        return None, (f"the {name} kernel brought a second OpenMP runtime ({', '.join(sorted(added))}) "
                      f"beside torch's ({', '.join(sorted(before))}); set CC to the compiler "
                      f"whose OpenMP torch uses (gcc for libgomp)")
    return lib, None


def _load_private_build(name: str, source: Path | None = None) -> ctypes.CDLL:
    """The kernel from the cache where it is private, else built and loaded in a
    private temporary directory (the reason logged). Raises RuntimeError or OSError."""
    try:
        return _load_private(build(name, source=source))
    except UntrustedPath as error:
        logger.warning("kernel cache not used: %s; building the %s kernel in a private "
                       "temporary directory (make the cache directory yours and mode 700, "
                       "or set STEPSTREAM_CACHE)", error, name)
    with tempfile.TemporaryDirectory(prefix="stepstream-kernels-") as tmp:
        return _load_private(build(name, Path(tmp), source))


def _load_private(path: Path) -> ctypes.CDLL:
    """Load `path` once it and its directory are private: through the descriptor that
    was checked, so a file swapped in after the check is never the one loaded."""
    fd = open_private_file(path)
    if not os.path.isdir("/proc/self/fd"):  # no /proc: by the path just checked
        os.close(fd)
        return ctypes.CDLL(str(path))
    # NOTE: the descriptor stays open for the process's life: the dynamic loader
    # matches later loads by name, and a reused fd number would hand back this
    # library for another file.
    try:
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError:
        os.close(fd)
        raise
