"""Test-only fault injection into an engine replica's loop.

The reliability tests need an engine that fails the way real ones do: a step
that raises (a CUDA error, a bug), a step that never returns (a hung kernel, a
deadlock), steps that crawl (to keep streams in flight during a redeploy), and
one request whose sampling raises inside the batched step (a bad parameter: only
that request may fail). The engine runs `AsyncEngine.fault_hook` before every
step and `replicas.sampling.sampler.row_fault_hook` on every sampled row; `FaultInjector`
installs them.

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
FAULT_KINDS = ("raise", "hang", "slow", "clear", "fail_request")


class InjectedFault(RuntimeError):
    """The exception an injected `raise` fault throws inside an engine step."""


def fault_injection_enabled(flag: bool) -> bool:
    return flag or os.environ.get(FAULT_INJECTION_ENV, "") == "1"


class FaultInjector:
    """Installs one fault at a time as the engine's `fault_hook`.

    raise: the next step raises InjectedFault (the engine loop dies).
    hang:  the next step blocks until `release()` (the loop stalls; health fails).
    slow:  every step first sleeps `step_delay_s` (until `clear`).
    fail_request:<request id>: that request's sampling raises InjectedFault inside
           the batched step, from now on (until `clear`); other faults stay.
    clear: no fault.
    """

    def __init__(self, engine) -> None:
        self._engine = engine
        self._released = threading.Event()

    def inject(self, kind: str, step_delay_s: float = 0.05) -> None:
        kind, _, request_id = kind.partition(":")
        if kind not in FAULT_KINDS or (kind == "fail_request") != bool(request_id):
            raise ValueError(f"unknown fault {kind!r}; one of {FAULT_KINDS} "
                             "(fail_request:<request id>)")
        from replicas.sampling import sampler  # NOTE: here, not at import: it loads torch

        if kind == "fail_request":
            sampler.row_fault_hook = _fail_request_hook(request_id)
            return
        if kind == "clear":
            sampler.row_fault_hook = None
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


def _fail_request_hook(request_id: str):
    def hook(request) -> None:
        if request.request_id == request_id:
            raise InjectedFault(f"injected fault: sampling of {request_id} raised")
    return hook
