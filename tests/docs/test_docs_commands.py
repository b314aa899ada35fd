"""Docs as tests: every way the docs give to run the app and every example they give,
run as written on a local Ray, and checked against what the text says.

The command blocks come from the docs (`<!-- docs-test: NAME -->`, see
tests/docs_support.py). Each shell starts fresh: a temporary HOME (no Ray token
yet), the venv activated by the docs' own `source .venv/bin/activate`. The tests
substitute only what they must, and nothing else:

- a free port for Serve's 8000 (in `curl`/`openai`/`locust` URLs, in a copy of
  `configs/serve.yaml`, and as `make serve SERVE_FLAGS="--port P"`), and free
  ports for `ray start --head`'s GCS, dashboard, client server and agent, with
  `RAY_DASHBOARD_ADDRESS` pointing the `serve` CLI at that dashboard;
- `make --old-file=<venv>/.installed serve VENV=<venv>`: never reinstall the venv
  from a test (a `make -n` first proves only the launcher would run);
- locust's `--run-time 2m` becomes 20 s, its `--csv` goes to a temp dir;
- a Ray temp dir per shell, and, where Linux allows, a private PID namespace, so
  `ray stop` stops only what the test started.

One `ray start` serves the whole second way: deploy, status, the `curl` and
`openai` examples, the locust command, shutdown. `make serve` and `serve run`
start their own Ray, as the docs say.
"""
from __future__ import annotations

import contextlib
import csv
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.launcher.console import EXIT_TRY_AGAIN
from cluster.serve_local import RAY_START_TIMED_OUT
from cluster_support import free_port
from docs_support import (
    MAKE_VARS, READY_TIMEOUT_S, REPO, Foreground, Shell, Snippet, all_snippets, assert_streams,
    distinct, free_ports, head_on_free_ports, leftovers, one_snippet, preamble, read_snippets,
    shell_commands, substitute, venv_dir, wait_closed, wait_healthy, with_venv,
)

# HAProxy binds fixed ports: one module of these at a time (tests/run_lanes.py).
pytestmark = pytest.mark.front_door

SNIPPETS = all_snippets()
# The ways to run the app: where two docs give one, they must give the same commands.
LIFECYCLE = ("venv", "make-serve", "serve-run", "deploy-up", "deploy-down", "cluster")
EXPECTED_TAGS = {
    "README.md": {"venv", "make-serve", "serve-run", "deploy-up", "deploy-down", "cluster",
                  "curl", "openai", "locust", "bench"},
    # The commands are README.md's alone; cluster/README.md links to them.
    "cluster/README.md": {"openai"},
    "loadtests/README.md": set(),
    # tests/docs/test_multinode_commands.py runs them
    "docs/multinode.md": {"multinode-up", "multinode-config", "multinode-curl", "multinode-down"},
}


def _local_port(snip: Snippet, text: str, port: int) -> str:
    return substitute(snip, text, r"\b(?:127\.0\.0\.1|localhost):8000\b", f"127.0.0.1:{port}")


def _serve_config(snip: Snippet, text: str, dest: Path, port: int) -> str:
    """`configs/serve.yaml` -> a copy that differs only in http_options.port."""
    config = yaml.safe_load((REPO / "configs/serve.yaml").read_text())
    config["http_options"]["port"] = port
    dest.write_text(yaml.safe_dump(config, sort_keys=False))
    return substitute(snip, text, r"(?<![\w/.-])configs/serve\.yaml\b", str(dest))


def _run_bash(sandbox, text: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", preamble() + text], cwd=REPO,
                          env=sandbox.env("oneshot"), capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    from docs_support import Sandbox

    box = Sandbox(tmp_path_factory.mktemp("docs"))
    yield box
    box.cleanup()


# --- the docs themselves (no Ray) ---------------------------------------------

def test_docs_mark_the_blocks_the_tests_run():
    for doc, tags in EXPECTED_TAGS.items():
        assert {s.tag for s in read_snippets(doc)} == tags, doc


@pytest.mark.parametrize("tag", LIFECYCLE)
def test_each_way_to_run_it_reads_the_same_in_every_doc(tag):
    one_snippet(tag)


def test_deploy_path_sends_ray_token_and_keeps_auth_on():
    up = shell_commands(one_snippet("deploy-up").text)
    first = {name: next(i for i, c in enumerate(up) if c.startswith(name))
             for name in ("export RAY_AUTH_MODE=token", "ray get-auth-token --generate",
                          "ray start --head", "serve deploy", "serve status")}
    assert first["export RAY_AUTH_MODE=token"] < first["ray start --head"] < first["serve deploy"]
    assert first["ray get-auth-token --generate"] < first["ray start --head"]
    down = shell_commands(one_snippet("deploy-down").text)
    assert any(c.startswith("serve shutdown") for c in down)
    for snip in (s for snips in SNIPPETS.values() for s in snips):
        assert "RAY_AUTH_MODE=disabled" not in snip.text, snip.where
    for path in (REPO / "configs").glob("*.yaml"):
        assert "RAY_AUTH_MODE=disabled" not in path.read_text(), path


# --- way 2, in the background: ray start + serve deploy, one Ray for all -------

class Deployment:
    def __init__(self, sandbox):
        self.port, self.gcs, self.dashboard, self.client, self.agent = free_ports(5)
        self.base = f"http://127.0.0.1:{self.port}"
        self.shell = Shell(sandbox, "deploy",
                           RAY_DASHBOARD_ADDRESS=f"http://127.0.0.1:{self.dashboard}")
        self.sandbox = sandbox
        self.up = None
        self.ready_error = None
        self.down_result = None
        self.shell_log = None

    def start(self) -> None:
        venv = self.shell.run("venv", preamble())
        assert venv.ok, venv.output
        snip = one_snippet("deploy-up")
        text = _serve_config(snip, with_venv(snip.text), self.sandbox.root / "serve-deploy.yaml",
                             self.port)
        text = head_on_free_ports(snip, text, self.gcs, self.dashboard, self.client, self.agent)
        self.up = self.shell.run("deploy-up", text, timeout_s=240)
        if self.up.ok:
            try:
                wait_healthy(self.base)
            except (TimeoutError, AssertionError) as exc:
                self.ready_error = f"{exc}\n{self.sandbox.ray_logs('deploy')}"

    def require_up(self) -> None:
        assert self.up is not None and self.up.ok, (
            f"deploy-up failed: {self.up and self.up.failed}\n{self.up and self.up.output[-6000:]}")
        assert self.ready_error is None, self.ready_error

    def down(self):
        if self.down_result is None:
            snip = one_snippet("deploy-down")
            try:
                self.down_result = self.shell.run("deploy-down", with_venv(snip.text), timeout_s=120)
            finally:
                self.shell_log = self.shell.close()
        return self.down_result


@pytest.fixture(scope="module")
def deployment(sandbox):
    dep = Deployment(sandbox)
    try:
        dep.start()
        yield dep
    finally:
        with contextlib.suppress(Exception):
            dep.down()
        dep.shell.kill()


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_deploy_up_runs_as_written_with_ray_token_auth_on(deployment, sandbox):
    deployment.require_up()
    assert "AuthenticationError" not in deployment.up.output
    token = (sandbox.home / ".ray" / "auth_token").read_text().strip()
    assert token  # made by `ray get-auth-token --generate` on this fresh HOME
    url = f"http://127.0.0.1:{deployment.dashboard}/api/serve/applications/"
    assert httpx.get(url, timeout=10).status_code == 401  # Ray's auth is on ...
    ok = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert ok.status_code == 200 and "stepstream" in ok.text  # ... and the token opens it


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_serve_status_says_running(deployment):
    deployment.require_up()
    up = shell_commands(one_snippet("deploy-up").text)
    (status,) = [c for c in up if c.startswith("serve status")]
    deadline = time.monotonic() + 120
    while True:
        res = deployment.shell.run("serve-status", status + "\n", timeout_s=60)
        assert res.ok, res.output
        apps = yaml.safe_load(res.output[res.output.index("proxies:"):])["applications"]
        if apps["stepstream"]["status"] == "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert apps["stepstream"]["status"] == "RUNNING", res.output


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("snip", distinct(SNIPPETS["curl"]), ids=lambda s: s.where)
def test_curl_example_streams_to_done(deployment, snip):
    deployment.require_up()
    res = deployment.shell.run("curl", _local_port(snip, snip.text, deployment.port), timeout_s=120)
    assert res.ok, res.output
    assert_streams(res.output)


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("snip", distinct(SNIPPETS["openai"]), ids=lambda s: s.where)
def test_openai_client_example_prints_a_streamed_answer(deployment, snip):
    deployment.require_up()
    res = deployment.shell.run("openai", _local_port(snip, snip.text, deployment.port),
                               lang="python", timeout_s=120)
    assert res.ok, res.output
    assert res.output.strip(), "the example printed nothing"
    if "include_usage" in snip.text:
        assert re.search(r"completion_tokens=\d+", res.output), res.output


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_locust_headless_command_writes_ttft_itl_tpot_rows(deployment, sandbox):
    deployment.require_up()
    snip = one_snippet("locust")
    out = sandbox.root / "locust-results"
    text = _local_port(snip, snip.text, deployment.port)
    # NOTE: the command's shape, not its load: two users of short requests (the
    # trained model makes ~200 tok/s here, 32 users' 128 tokens each would end no
    # request within a short run, and 8 users' once none beside the suite's other
    # lanes). locust rewrites the CSV once a second and not at exit: the run outlasts
    # the first requests (under a second each alone) many times over.
    text = substitute(snip, text, r"--run-time \S+", "--run-time 12s")
    text = substitute(snip, text, r"--output-len \d+", "--output-len 16")
    text = substitute(snip, text, r"-u \d+ -r \d+", "-u 2 -r 2")
    text = substitute(snip, text, r"--input-len \d+", "--input-len 32")
    text = substitute(snip, text, r"--csv results/", f"--csv {out}/")
    res = deployment.shell.run("locust", text, timeout_s=120)
    assert res.ok, res.output[-4000:]
    prefix = re.search(r"--csv (\S+)", text).group(1)
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    post = rows[("POST", "/v1/completions")]
    assert int(post["Request Count"]) > 0 and int(post["Failure Count"]) == 0, post
    for kind in ("TTFT", "ITL", "TPOT"):
        assert int(rows[(kind, "/v1/completions")]["Request Count"]) > 0, kind
    assert all(int(r["Failure Count"]) == 0 for r in rows.values()), rows


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_bench_command_prints_its_result_block(deployment):
    deployment.require_up()
    snip = one_snippet("bench")
    text = substitute(snip, snip.text, r"--port 8000\b", f"--port {deployment.port}")
    # the shape, not the load
    text = substitute(snip, text, r"--num-prompts \d+", "--num-prompts 8")
    # NOTE: 128 prompt and 16 output tokens each, not the random dataset's 1,024 and
    # 128: the trained model's pace here
    text = substitute(snip, text, r"--ignore-eos\b",
                      "--ignore-eos --random-input-len 128 --random-output-len 16")
    res = deployment.shell.run("bench", text, timeout_s=240)
    assert res.ok, res.output[-4000:]
    assert re.search(r"^Successful requests:\s+8$", res.output, re.M), res.output[-4000:]
    assert "Failed requests" not in res.output, res.output[-4000:]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_deploy_down_stops_serve_and_ray(deployment):
    deployment.require_up()
    res = deployment.down()
    assert res.ok, res.output
    assert wait_closed(deployment.port), "Serve still answers after serve shutdown + ray stop"
    left = leftovers(deployment.shell_log)
    assert not left, f"Ray processes left after `ray stop`: {left}"


# --- way 2, in the foreground: serve run -----------------------------------------

@pytest.mark.ray
@pytest.mark.timeout(600)
def test_serve_run_serves_until_ctrl_c(sandbox):
    snip = one_snippet("serve-run")
    port = free_port()
    text = _serve_config(snip, with_venv(snip.text), sandbox.root / "serve-run.yaml", port)
    fg = Foreground(sandbox, "serve-run", preamble(), text)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", alive=lambda: fg.proc.poll() is None)
        except AssertionError as ended:
            # NOTE: Ray's own CLI: its node's fixed 30 s to register can run out beside
            # the suite's other lanes (the launcher says "start it again" then, see
            # test_make_serve_...); a user runs it again, once
            if RAY_START_TIMED_OUT not in fg.output():
                raise AssertionError(f"{ended}:\n{fg.output()[-4000:]}") from None
            fg.kill()
            fg = Foreground(sandbox, "serve-run-again", preamble(), text)
            wait_healthy(f"http://127.0.0.1:{port}", alive=lambda: fg.proc.poll() is None)
        curl = _one_curl()
        res = _run_bash(sandbox, _local_port(curl, curl.text, port))
        assert res.returncode == 0, res.stderr
        assert_streams(res.stdout)
        rc = fg.interrupt()
    finally:
        fg.kill()
    assert rc == 0, fg.output()[-4000:]
    assert wait_closed(port)
    left = leftovers(fg.output())
    assert not left, f"Ray processes left after Ctrl-C: {left}"


def _one_curl() -> Snippet:
    return distinct(SNIPPETS["curl"])[0]



# --- way 1: make serve -----------------------------------------------------------

@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("make_vars, model_flag", [
    ([], "--model 'smollm2-135m'"),
    (["MODEL=tiny"], "--model 'tiny'"),
    (["SERVE_FLAGS=--config configs/serve.yaml"], ""),  # the config's args.model serves
    (["MODEL=tiny", "SERVE_FLAGS=--config configs/serve.yaml"], "--model 'tiny'"),
])
def test_make_serve_passes_a_model_unless_a_config_names_it(make_vars, model_flag):
    venv = venv_dir()
    fresh_env = {k: v for k, v in os.environ.items() if k not in MAKE_VARS}
    dry = subprocess.run(["make", "-n", f"--old-file={venv}/.installed", "serve", f"VENV={venv}",
                          *make_vars], cwd=REPO, capture_output=True, text=True, timeout=30,
                         env=fresh_env)
    flags = next((v.split("=", 1)[1] for v in make_vars if v.startswith("SERVE_FLAGS=")), "")
    assert dry.stdout.split() == (f"exec {venv}/bin/python -m cluster.serve_local {model_flag} "
                                  f"{flags}").split(), dry.stdout + dry.stderr


@pytest.mark.ray
@pytest.mark.timeout(900)  # a second start after a temporary failure included
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_prints_url_and_a_curl_line_that_streams(sandbox):
    snip = one_snippet("make-serve")
    port = free_port()
    venv = venv_dir()
    # NOTE: -o names the stamp exactly as the Makefile does ($(VENV)/.installed): make
    # matches target names as text. The dry run first proves nothing but the launcher
    # runs (never an install into the venv from a test).
    args = [f"--old-file={venv}/.installed", "serve", f"VENV={venv}", f"SERVE_FLAGS=--port {port}"]
    fresh_env = {k: v for k, v in os.environ.items() if k not in MAKE_VARS}
    dry = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=30, env=fresh_env)
    assert dry.stdout.splitlines() == [
        f"exec {venv}/bin/python -m cluster.serve_local --model 'smollm2-135m' --port {port}"], (
        dry.stdout + dry.stderr)
    text = substitute(snip, snip.text, r"^make serve\b", shlex.join(["make", *args]))
    fg = Foreground(sandbox, "make-serve", preamble(), text)
    try:
        try:
            url = fg.wait_for(r"^Serving at (\S+)$", READY_TIMEOUT_S).group(1)
        except RuntimeError:
            # NOTE: what the launcher tells a user whose busy machine made Ray's own
            # start give up (exit status 75: "start it again"), once; beside the
            # suite's other lanes Ray's node once missed its fixed 30 s to register
            if f"exit status {EXIT_TRY_AGAIN}" not in fg.output():
                raise
            fg.kill()
            left = leftovers(fg.output())
            assert not left, f"Ray processes left after the temporary failure: {left}"
            fg = Foreground(sandbox, "make-serve-again", preamble(), text)
            url = fg.wait_for(r"^Serving at (\S+)$", READY_TIMEOUT_S).group(1)
        assert url == f"http://127.0.0.1:{port}/v1"
        curl_line = fg.wait_for(r"^curl .*$", 10).group(0)
        res = _run_bash(sandbox, curl_line)
        assert res.returncode == 0, res.stderr
        assert_streams(res.stdout)
        fg.interrupt()  # make's own status after Ctrl-C is 2 or 130: not the launcher's
    finally:
        fg.kill()
    assert wait_closed(port), "Serve still answers after Ctrl-C"
    left = leftovers(fg.output())
    assert not left, f"Ray processes left after Ctrl-C: {left}"
