"""Start the local app (`python -m cluster.serve_local ...`) as a subprocess and always stop it.

The server runs in its own process group (its own session), so stopping it reaches
Ray's helpers too: SIGINT first (a clean Serve shutdown), then SIGTERM, then SIGKILL.
Every started server is also stopped at interpreter exit (atexit), whatever happens.
A launcher that gives up because Ray's own start-up did not finish in time (its exit
status "try again") is started once more.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.launcher.console import EXIT_TRY_AGAIN

LIVE: set["LocalServer"] = set()  # started and not yet stopped
# NOTE: the launcher's "try again" (Ray gave up on its own start-up, on a machine busy
# with other work: cluster/serve_local.py) gets one more start
START_ATTEMPTS = 2


class _TryAgain(RuntimeError):
    """The launcher exited with EXIT_TRY_AGAIN before it was ready."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout_s: float, check_alive=lambda: None) -> None:
    """Polls GET /health until it answers 200; `check_alive()` raises when the server died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive()
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or not ready (non-200 raises HTTPError)
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s:g}s")


def session_autogroup(pid: int | str = "self") -> str | None:
    """The autogroup of `pid`'s session ("/autogroup-N nice K"), or None where it has
    none. NOTE: the kernel shows an empty file, not an error, for a session still in
    the boot-time group (one never started by setsid, as a container's first
    process's may be). A file that names a group does not prove the group is in
    effect: for a process in a CPU cgroup of its own the cgroup shares the CPU."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            line = f.read().strip()
    except OSError:
        return None
    return line or None


def set_session_nice(pid: int, nice: int, timeout_s: float = 2.0) -> bool:
    """Sets the autogroup niceness of `pid`'s session (Linux with autogroup
    scheduling; raising it needs no privilege). False where there is none.
    NOTE: the process has exec'd when Popen returns, so its session exists, and
    everything it starts later inherits the session's group. Without CAP_SYS_ADMIN
    the kernel takes one such change per 100 ms machine-wide and answers EAGAIN
    meanwhile: try again until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
            return True
        except BlockingIOError:  # EAGAIN: another change within the last 100 ms
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        except OSError:
            return False


def _stop_all_at_exit() -> None:
    for server in list(LIVE):
        server.stop()


atexit.register(_stop_all_at_exit)


class LocalServer:
    """`with LocalServer(["--num-scheduler-steps", "8"], log_path=...) as srv: srv.base_url`."""

    def __init__(self, server_args: list[str], *, module: str = "cluster.serve_local",
                 model: str = "tiny", host: str = "127.0.0.1", port: int | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 600.0,
                 stop_timeout_s: float = 30.0, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, session_nice: int = 0):
        """`session_nice` > 0: the server's session, as one autogroup, yields the CPU
        to this process's session when both want it, so a benchmark client on the same
        cores reads each event when it arrives, as a client on another machine would
        (loadtests/serving/client_wait.py says why). The server still gets every cycle the
        client does not use."""
        self.host, self.port = host, port or free_port(host)
        self.command = [sys.executable, "-m", module, "--model", model, "--host", host,
                        "--port", str(self.port), *server_args]
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = {**os.environ, **env} if env else None  # None: this process's
        self.cwd = cwd  # None: this process's
        self.session_nice = session_nice
        self.process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __hash__(self) -> int:
        return id(self)

    def start(self) -> "LocalServer":
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")
        out = self._log_file or subprocess.DEVNULL
        LIVE.add(self)
        attempts_left = START_ATTEMPTS
        while True:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            start_new_session=True,
                                            env=self.env, cwd=self.cwd)
            if self.session_nice and not set_session_nice(self.process.pid, self.session_nice):
                print(f"note: could not set the server session's autogroup nice to "
                      f"{self.session_nice} (no autogroup scheduling here?)", file=sys.stderr)
            attempts_left -= 1
            try:
                wait_healthy(self.base_url, self.startup_timeout_s, self._check_alive)
                return self
            except _TryAgain:
                if attempts_left:
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise

    def _check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            failed = _TryAgain if code == EXIT_TRY_AGAIN else RuntimeError
            raise failed(f"server exited with code {code} before ready "
                         f"({' '.join(self.command)}; log: {self.log_path})")

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # pgid == pid: a session of its own
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        proc = self.process
        if proc is not None:
            for sig, wait_s in ((signal.SIGINT, self.stop_timeout_s), (signal.SIGTERM, 10.0),
                                (signal.SIGKILL, 10.0)):
                if proc.poll() is not None:
                    break
                self._signal_group(sig)
                try:
                    proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    continue
            # NOTE: the leader may exit before its helpers; sweep the group once more.
            self._signal_group(signal.SIGKILL)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        LIVE.discard(self)

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
