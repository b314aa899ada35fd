"""Test-only fault injection into an engine replica's loop.

The reliability tests need an engine that fails the way real ones do: a step
that raises (a CUDA error, a bug), a step that never returns (a hung kernel, a
deadlock), steps that crawl (to keep streams in flight during a redeploy). The
engine runs `AsyncEngine.fault_hook` before every step; `FaultInjector` installs
one there.

Never on by default: `EngineReplica.inject_fault` refuses unless the app was built
with `enable_fault_injection: true` or the replica's process has
`STEPSTREAM_ENABLE_FAULT_INJECTION=1`. The method is reachable only through a
Serve handle (inside the cluster), never over HTTP.
"""
from __future__ import annotations

import os
import threading
import time

FAULT_INJECTION_ENV = "STEPSTREAM_ENABLE_FAULT_INJECTION"
FAULT_KINDS = ("raise", "hang", "slow", "clear")


class InjectedFault(RuntimeError):
    """The exception an injected `raise` fault throws inside an engine step."""


def fault_injection_enabled(flag: bool) -> bool:
    return flag or os.environ.get(FAULT_INJECTION_ENV, "") == "1"


class FaultInjector:
    """Installs one fault at a time as the engine's `fault_hook`.

    raise: the next step raises InjectedFault (the engine loop dies).
    hang:  the next step blocks until `release()` (the loop stalls; health fails).
    slow:  every step first sleeps `step_delay_s` (until `clear`).
    clear: no fault.
    """

    def __init__(self, engine) -> None:
        self._engine = engine
        self._released = threading.Event()

    def inject(self, kind: str, step_delay_s: float = 0.05) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULT_KINDS}")
        hooks = {"raise": self._raise_once, "hang": self._hang_once,
                 "slow": lambda: time.sleep(step_delay_s), "clear": None}
        self._engine.fault_hook = hooks[kind]

    def release(self) -> None:
        """Let a hung step return (replica shutdown), so the thread can exit."""
        self._released.set()

    def _raise_once(self) -> None:
        self._engine.fault_hook = None
        raise InjectedFault("injected fault: an engine step raised")

    def _hang_once(self) -> None:
        self._engine.fault_hook = None
        self._released.wait()
