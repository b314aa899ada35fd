"""Helpers for the docs-as-tests modules: the command blocks the docs mark as
runnable, and shells that run them the way a user would.

Not a test module. A fenced block right after an HTML comment
`<!-- docs-test: NAME -->` is meant to run as written; NAME says what it is
(`make-serve`, `serve-run`, `deploy-up`, ...). The tests read the blocks from the
docs themselves, so a doc edit that breaks a command fails a test.

Shells run in a sandbox: a temporary HOME (no Ray token yet, as on a fresh
machine), a private Ray temp dir (no other Ray on this machine is found or
touched), and, where Linux allows it, a private PID namespace, so `ray stop` sees
only the processes the sandbox started and nothing outlives the shell.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cluster_support import free_port
from loadtests.serving.openai_stream import StreamParser

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "cluster/README.md", "loadtests/README.md", "docs/multinode.md")

_TAG = re.compile(r"^\s*<!--\s*docs-test:\s*([A-Za-z0-9_-]+)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([A-Za-z0-9_+-]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Snippet:
    doc: str   # path relative to the repository root
    line: int  # 1-based line of the opening fence
    tag: str
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"



# Set by a `make` this test run is under (`make test`): a fresh shell has none, and
# with them a nested make prints "Entering directory" lines.
MAKE_VARS = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKE_TERMOUT", "MAKE_TERMERR")

def read_snippets(doc: str) -> list[Snippet]:
    """Every tagged fenced block of one doc, in order; a tag not followed by a
    fenced block is an error (the block would silently go untested)."""
    lines = (REPO / doc).read_text().splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = _TAG.match(lines[i])
        i += 1
        if not m:
            continue
        while i < len(lines) and not lines[i].strip():
            i += 1
        fence = _FENCE.match(lines[i]) if i < len(lines) else None
        if not fence:
            raise ValueError(f"{doc}:{i}: `docs-test: {m.group(1)}` is not followed by a fenced block")
        indent, marker, lang = fence.group(1), fence.group(2), fence.group(3)
        start, i = i, i + 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != marker:
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{doc}:{start + 1}: unclosed fenced block")
        i += 1
        out.append(Snippet(doc, start + 1, m.group(1), lang or "bash", "\n".join(body) + "\n"))
    return out


def all_snippets() -> dict[str, list[Snippet]]:
    by_tag: dict[str, list[Snippet]] = {}
    for doc in DOCS:
        for snip in read_snippets(doc):
            by_tag.setdefault(snip.tag, []).append(snip)
    return by_tag


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: comments dropped, `\\` continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    cmds = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            cmds.append(line)
    return cmds


def distinct(snippets: list[Snippet]) -> list[Snippet]:
    """One snippet per distinct command text (the same block in two docs runs once)."""
    seen: dict[tuple, Snippet] = {}
    for s in snippets:
        key = (s.lang, tuple(shell_commands(s.text)) if s.lang == "bash" else s.text.strip())
        seen.setdefault(key, s)
    return list(seen.values())


def one_snippet(tag: str) -> Snippet:
    """The block of `tag`; where two docs give it, they must give the same commands."""
    variants = distinct(all_snippets()[tag])
    assert len(variants) == 1, (
        f"`{tag}` differs between {[s.where for s in variants]}: keep the docs in step")
    return variants[0]


def substitute(snip: Snippet, text: str, pattern: str, repl: str) -> str:
    """`text` (from `snip`) with `pattern` replaced; the block must contain it."""
    new, n = re.subn(pattern, lambda _m: repl, text)
    assert n, f"{snip.where}: no {pattern!r} in the `{snip.tag}` block (the test substitutes it)"
    return new


def head_on_free_ports(snip: Snippet, text: str, gcs: int, dashboard: int, client: int,
                       agent: int) -> str:
    """`ray start --head` on free ports instead of Ray's fixed ones (6379, 8265, 10001,
    52365), which another Ray on this machine may hold."""
    return substitute(snip, text, r"\bray start --head\b",
                      f"ray start --head --port={gcs} --dashboard-port={dashboard} "
                      f"--ray-client-server-port={client} --dashboard-agent-listen-port={agent}")


def preamble() -> str:
    """The docs' venv activation, as every shell of theirs starts."""
    return with_venv(one_snippet("venv").text)


# --- the sandbox --------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def isolation_prefix() -> tuple[str, ...]:
    """`unshare` arguments for a private PID namespace, or () where Linux refuses."""
    if not shutil.which("unshare"):
        return ()
    for prefix in (("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"),
                   ("unshare", "--user", "--map-root-user", "--pid", "--fork",
                    "--mount-proc", "--kill-child")):
        try:
            subprocess.run([*prefix, "true"], check=True, capture_output=True, timeout=20)
            return prefix
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


# Run at the end of every sandboxed shell: inside a PID namespace (the shell is
# PID 1) every process is the sandbox's own, so list the Ray processes left.
_LEFTOVERS = r"""
if [ "$$" = 1 ]; then
  for __i in $(seq 100); do pgrep -f 'gcs_server|raylet' > /dev/null || break; sleep 0.2; done
  echo "__LEFTOVERS__"
  pgrep -af 'gcs_server|raylet|default_worker|ray::' | grep -v defunct || true
  echo "__END_LEFTOVERS__"
fi
"""


def leftovers(log: str) -> list[str] | None:
    """Ray processes still alive when the shell ended (None: not measurable here)."""
    m = re.search(r"__LEFTOVERS__\n(.*?)__END_LEFTOVERS__", log, re.S)
    return None if m is None else [line for line in m.group(1).splitlines() if line.strip()]


# --- what a user sees -----------------------------------------------------------

READY_TIMEOUT_S = 300.0  # a cold Ray and the app on a busy 2-core machine


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def assert_streams(output: str) -> None:
    """`output` is one SSE stream that ends with `data: [DONE]`, with an answer and
    no error event."""
    parsed = StreamParser.of(output)
    assert parsed.events and parsed.events[-1] == "[DONE]", (
        f"the stream did not end with data: [DONE]:\n{output[-3000:]}")
    assert not parsed.error, output[-3000:]  # no error event, no bad JSON
    # NOTE: one event may hold the whole answer: the ingress merges a stream's deltas
    # while its writer is behind, which a loaded machine can keep it for a short answer.
    # That each step streams on its own is the cluster tests' to check, where the load
    # is theirs to set.
    assert parsed.events[:-1] and parsed.text, f"expected a streamed answer:\n{output[-3000:]}"


def wait_healthy(base: str, alive=lambda: True, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # NOTE: a patient client, as curl is: while the engine replica starts, /health
        # waits for it (up to the ingress's own 10 s check timeout).
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=30).status_code == 200:
                return
        assert alive(), "the server ended before /health answered"
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not answer 200 within {timeout_s:.0f}s")


def wait_closed(port: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        except httpx.HTTPError:
            return True
        time.sleep(0.5)
    return False


class Sandbox:
    """A temporary HOME and Ray temp dir, and the environment of a fresh shell there."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.home.mkdir(parents=True)
        # NOTE: Ray puts Unix sockets under its temp dir (108-byte path limit): keep it short.
        import tempfile

        self.ray_tmp = Path(tempfile.mkdtemp(prefix="ssdocs-", dir="/tmp"))

    def env(self, session: str, **extra: str) -> dict[str, str]:
        """A fresh shell's environment for one session: no Ray settings inherited,
        the sandbox HOME (shared: the Ray token persists between sessions, as on one
        machine), a Ray temp dir of the session's own (one session never finds
        another's Ray)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("RAY_") and k not in ("VIRTUAL_ENV", "PYTHONHOME")
               and k not in MAKE_VARS}
        real_home = os.environ.get("HOME", str(Path.home()))
        ray_tmp = self.ray_tmp / session
        ray_tmp.mkdir(exist_ok=True)
        env.update({
            "HOME": str(self.home),
            "RAY_TMPDIR": str(ray_tmp),
            "RAY_USAGE_STATS_ENABLED": "0",
            # NOTE: a worker's `ray start` asks the head's GCS for the head node 20 times,
            # 2 s apart, by default; beside the suite's other lanes that once ran out on
            # this machine (the command passed alone). A slow machine's patience only.
            "RAY_NUM_REDIS_GET_RETRIES": "90",
            # the preset's weights, made once per machine: share them, not the Ray token
            "STEPSTREAM_CACHE": os.environ.get("STEPSTREAM_CACHE")
            or str(Path(real_home) / ".cache" / "stepstream"),
        })
        env.update(extra)
        return env

    def ray_logs(self, session: str, tail: int = 20) -> str:
        """The end of each Serve log of a session's Ray, for failure messages."""
        logs = self.ray_tmp / session / "ray" / "session_latest" / "logs"
        parts = []
        for path in sorted(logs.glob("serve/*.log")) + sorted(logs.glob("*.err")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            if lines and (path.suffix == ".log" or any("Error" in x for x in lines)):
                parts.append(f"== {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def cleanup(self) -> None:
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def venv_dir() -> Path:
    return Path(sys.prefix)


def with_venv(text: str) -> str:
    """The docs name `.venv`; tests run from whatever venv runs pytest."""
    venv = venv_dir()
    if venv.resolve() == (REPO / ".venv").resolve():
        return text
    return re.sub(r"(?<![\w/.])\.venv/", f"{venv}/", text)


def _default_sigint() -> None:
    """In the child, before exec: Ctrl-C as a terminal gives it.

    NOTE: a test run started in the background (`make test &`, a CI runner) has
    SIGINT ignored, every child inherits that, and a shell cannot undo a signal
    ignored on entry: `serve run` would then sleep through the tests' Ctrl-C.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


@dataclasses.dataclass
class StepResult:
    rc: int
    failed: list[str]  # "__FAILED__ rc=N :: command" per command that failed
    output: str

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.failed


class Shell:
    """One long-lived bash session, like a user's terminal: each step is sourced
    into it, so an `export` in one step holds for the next ones. A step ends at its
    first failing command, as a user would stop there: the commands after it (a
    worker's `ray start` after the head's failed) would only wait out the step's
    timeout."""

    # NOTE: the ERR trap fires in the step's file (BASH_SOURCE), where `return` ends the
    # sourced step; it fires again for the `source` line itself, where it does nothing.
    _HOLDER = r"""
trap ':' INT
while IFS= read -r __step; do
  [ "$__step" = exit ] && break
  __fails=0
  trap '__status=$?; if [ "${BASH_SOURCE[0]:-}" = "$__step" ]; then echo "__FAILED__ rc=$__status :: $BASH_COMMAND"; __fails=$((__fails + 1)); return 1; fi' ERR
  source "$__step" > "$__step.out" 2>&1 < /dev/null
  __rc=$?
  trap - ERR
  echo "$__rc $__fails" > "$__step.tmp"
  mv "$__step.tmp" "$__step.rc"
done
""" + _LEFTOVERS

    def __init__(self, sandbox: Sandbox, name: str, **extra_env: str):
        self.dir = sandbox.root / name
        self.dir.mkdir()
        self.n = 0
        holder = self.dir / "holder.sh"
        holder.write_text(self._HOLDER)
        self.log_path = self.dir / "holder.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*isolation_prefix(), "bash", str(holder)], stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, env=sandbox.env(name, **extra_env), cwd=REPO,
                start_new_session=True, text=True, preexec_fn=_default_sigint)
        self.closed_log: str | None = None

    def run(self, name: str, text: str, lang: str = "bash", timeout_s: float = 120.0) -> StepResult:
        self.n += 1
        step = self.dir / f"{self.n:02d}-{name}.sh"
        if lang == "python":
            script = step.with_suffix(".py")
            script.write_text(text)
            step.write_text(f'python "{script}"\n')
        else:
            step.write_text(text)
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        rc_file, out_file = Path(f"{step}.rc"), Path(f"{step}.out")
        deadline = time.monotonic() + timeout_s
        while not rc_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the shell ended during {name}:\n{self._read(out_file)}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{name} still running after {timeout_s:.0f}s:\n"
                                   f"{self._read(out_file)[-4000:]}")
            time.sleep(0.1)
        rc, fails = rc_file.read_text().split()
        output = self._read(out_file)
        failed = [line for line in output.splitlines() if line.startswith("__FAILED__")]
        return StepResult(int(rc), failed, output)

    @staticmethod
    def _read(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self, timeout_s: float = 60.0) -> str:
        """End the session; returns its log (with the leftover listing)."""
        if self.closed_log is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self.kill()
            self.closed_log = self._read(self.log_path)
        return self.closed_log

    def kill(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc)


class Foreground:
    """A command that serves until Ctrl-C (`make serve`, `serve run`), in its own
    bash, in its own process group: `interrupt()` is the Ctrl-C of a terminal."""

    def __init__(self, sandbox: Sandbox, name: str, preamble: str, text: str, **extra_env: str):
        self.dir = sandbox.root / name
        self.dir.mkdir()
        script = self.dir / "run.sh"
        script.write_text(f"trap ':' INT\n{preamble}\n{text}\necho \"__EXIT__ $?\"\n{_LEFTOVERS}")
        self.log_path = self.dir / "run.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*isolation_prefix(), "bash", str(script)], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=sandbox.env(name, **extra_env), cwd=REPO,
                start_new_session=True, preexec_fn=_default_sigint)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            m = re.search(pattern, self.output(), re.M)
            if m:
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"ended before {pattern!r}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {pattern!r} after {timeout_s:.0f}s:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def interrupt(self, timeout_s: float = 90.0) -> int | None:
        """Ctrl-C; waits for the shell to end; returns the command's exit status."""
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        m = re.search(r"^__EXIT__ (\d+)$", self.output(), re.M)
        return int(m.group(1)) if m else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc)
