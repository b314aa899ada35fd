"""Names the calling thread for the operating system, so `top -H`, `ps -L` and
/proc/<pid>/task/<tid>/comm tell the engine's threads apart from Ray's (Python's
own thread names stay inside Python). The benchmark's CPU table reads them.

Linux only (prctl PR_SET_NAME, 15 bytes at most); elsewhere, or if the call fails,
nothing happens: a name is a convenience, never a reason to fail.
"""
from __future__ import annotations

import ctypes
import sys

# The engine loop's thread: the one that runs the steps.
ENGINE_STEP_THREAD = "ss-engine-step"
# The asynchronous output processor's thread.
ENGINE_OUTPUT_THREAD = "ss-engine-out"

_PR_SET_NAME = 15
_MAX_BYTES = 15


def name_this_thread(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        # NOTE: CDLL(None) is this process's own symbols, libc's prctl among them.
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_MAX_BYTES]), 0, 0, 0)
    except Exception:  # noqa: BLE001 (a thread pool's initializer must not raise)
        pass
