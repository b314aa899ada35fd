"""docs/multinode.md's layout on one machine, by hand, run as written: a head node and
two engine nodes from three `ray start` calls, the doc's Serve config deployed on
them with Ray's token auth on and the app's API key set (the doc exports it before the
head's `ray start`), a stream through the head's front door, and `serve shutdown -y`
and `ray stop` ending every node.

One shell, as the doc says: README.md's venv activation and the lines of its second
way before `ray start --head` (token auth, the HAProxy front door), then the doc's
blocks (`<!-- docs-test: multinode-* -->`), in a scratch folder that holds the config
block as the file the doc names. Substituted, and nothing else: free ports for the
head's GCS (6379, in every `--address` too), dashboard, client server and agents
(each node's own), and for Serve's 8000 (the config's `port`, the `curl` URL), with
`RAY_DASHBOARD_ADDRESS` pointing the `serve` CLI at that dashboard.
"""
from __future__ import annotations

import contextlib
import re
import time

import httpx
import pytest
import yaml

from docs_support import (
    REPO, Sandbox, Shell, assert_streams, free_ports, head_on_free_ports, isolation_prefix,
    leftovers, one_snippet, preamble, shell_commands, substitute, wait_closed, wait_healthy,
    with_venv,
)
from multinode_support import ENGINE_RESOURCE, INGRESS_RESOURCE

# HAProxy binds fixed ports: one module of these at a time (tests/run_lanes.py).
pytestmark = pytest.mark.front_door

DOC = "docs/multinode.md"
NUM_ENGINE_NODES = 2


def _readme_lines_before_head() -> str:
    """README.md's second way up to its `ray start --head`, as the doc says to run first."""
    lines = one_snippet("deploy-up").text.splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.startswith("ray start --head"))
    return with_venv("".join(lines[:end]))


class Layout:
    """The doc's head and engine nodes, started in one sandboxed shell."""

    def __init__(self, sandbox: Sandbox):
        self.port, self.gcs, self.dashboard, self.client, self.agent, *self.node_agents = (
            free_ports(5 + NUM_ENGINE_NODES))
        self.base = f"http://127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard}"
        self.sandbox = sandbox
        self.workdir = sandbox.root / "multinode-work"
        self.workdir.mkdir()
        self.shell = Shell(sandbox, "multinode", RAY_DASHBOARD_ADDRESS=self.dashboard_url)
        self.up = None
        self.ready_error = None
        self.down_result = None
        self.shell_log = None

    def _config(self) -> str:
        """The config block, saved in the shell's folder under the name it gives itself."""
        snip = one_snippet("multinode-config")
        name = re.match(r"#\s*(\S+\.yaml)\s*$", snip.text.splitlines()[0]).group(1)
        (self.workdir / name).write_text(
            substitute(snip, snip.text, r"(?<=\bport: )8000\b", str(self.port)))
        return name

    def _up_text(self, config_name: str) -> str:
        snip = one_snippet("multinode-up")
        assert f"serve deploy {config_name}" in snip.text, snip.where
        text = substitute(snip, snip.text, r"--address=127\.0\.0\.1:6379\b",
                          f"--address=127.0.0.1:{self.gcs}")
        agents = iter(self.node_agents)
        text, n = re.subn(r"--dashboard-agent-listen-port=\d+",
                          lambda _m: f"--dashboard-agent-listen-port={next(agents)}", text)
        assert n == NUM_ENGINE_NODES, f"{snip.where}: an agent port per engine node"
        return head_on_free_ports(snip, text, self.gcs, self.dashboard, self.client, self.agent)

    def start(self) -> None:
        for name, text in (("venv", preamble()), ("readme-preamble", _readme_lines_before_head()),
                           ("cd", f"cd {self.workdir}\n")):
            res = self.shell.run(name, text)
            assert res.ok, f"{name}: {res.failed}\n{res.output}"
        self.up = self.shell.run("multinode-up", self._up_text(self._config()), timeout_s=240)
        if self.up.ok:
            try:
                wait_healthy(self.base)
            except (TimeoutError, AssertionError) as exc:
                self.ready_error = f"{exc}\n{self.sandbox.ray_logs('multinode')}"

    def require_up(self) -> None:
        assert self.up is not None and self.up.ok, (
            f"multinode-up failed: {self.up and self.up.failed}\n"
            f"{self.up and self.up.output[-6000:]}")
        assert self.ready_error is None, self.ready_error

    def token(self) -> str:
        return (self.sandbox.home / ".ray" / "auth_token").read_text().strip()

    def dashboard_get(self, path: str) -> dict:
        res = httpx.get(self.dashboard_url + path, timeout=30,
                        headers={"Authorization": f"Bearer {self.token()}"})
        res.raise_for_status()
        return res.json()

    def down(self):
        if self.down_result is None:
            snip = one_snippet("multinode-down")
            try:
                self.down_result = self.shell.run("multinode-down", snip.text, timeout_s=120)
            finally:
                self.shell_log = self.shell.close()
        return self.down_result


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    box = Sandbox(tmp_path_factory.mktemp("multinode-docs"))
    yield box
    box.cleanup()


@pytest.fixture(scope="module")
def layout(sandbox):
    if not isolation_prefix():
        pytest.skip("needs a private PID namespace (unshare): the doc's `ray stop` would "
                    "stop every Ray on this machine")
    lay = Layout(sandbox)
    try:
        lay.start()
        yield lay
    finally:
        with contextlib.suppress(Exception):
            lay.down()
        lay.shell.kill()


def test_the_doc_says_to_run_the_readme_lines_before_ray_start_head_first():
    text = " ".join((REPO / DOC).read_text().split())
    assert "lines of README.md's second way that come before its `ray start --head`" in text


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_the_layout_starts_as_written_with_ray_token_auth_on(layout):
    layout.require_up()
    assert "AuthenticationError" not in layout.up.output
    assert layout.token()  # made by the README's `ray get-auth-token --generate`
    url = f"{layout.dashboard_url}/api/serve/applications/"
    assert httpx.get(url, timeout=10).status_code == 401  # Ray's auth is on ...
    assert "stepstream" in layout.dashboard_get("/api/serve/applications/")["applications"]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_serve_status_says_two_engine_replicas_and_one_ingress_running(layout):
    layout.require_up()
    (status,) = [c for c in shell_commands(one_snippet("multinode-up").text)
                 if c.startswith("serve status")]
    wanted = {"EngineReplica": {"RUNNING": NUM_ENGINE_NODES}, "Ingress": {"RUNNING": 1}}
    deadline = time.monotonic() + 120
    while True:
        res = layout.shell.run("serve-status", status + "\n", timeout_s=60)
        assert res.ok, res.output
        apps = yaml.safe_load(res.output[res.output.index("proxies:"):])["applications"]
        app = apps["stepstream"]
        states = {name: d["replica_states"] for name, d in app["deployments"].items()}
        if (app["status"] == "RUNNING" and states == wanted) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert app["status"] == "RUNNING" and states == wanted, res.output


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_engine_replicas_run_on_the_engine_nodes_and_the_ingress_on_the_head(layout):
    layout.require_up()
    nodes = layout.dashboard_get("/api/v0/nodes?detail=1&limit=100")["data"]["result"]["result"]
    alive = [n for n in nodes if n["state"] == "ALIVE"]
    (head,) = [n["node_id"] for n in alive if n["is_head_node"]]
    engine_nodes = {n["node_id"] for n in alive if n["resources_total"].get(ENGINE_RESOURCE)}
    assert len(alive) == 1 + NUM_ENGINE_NODES and len(engine_nodes) == NUM_ENGINE_NODES, nodes
    app = layout.dashboard_get("/api/serve/applications/")["applications"]["stepstream"]
    where = {name: sorted(r["node_id"] for r in d["replicas"] if r["state"] == "RUNNING")
             for name, d in app["deployments"].items()}
    assert where["Ingress"] == [head], where
    assert set(where["EngineReplica"]) == engine_nodes, (where, engine_nodes)  # one on each
    (head_node,) = [n for n in alive if n["is_head_node"]]
    assert head_node["resources_total"].get(INGRESS_RESOURCE), head_node


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_stream_needs_the_api_key_and_streams_to_done(layout):
    layout.require_up()
    snip = one_snippet("multinode-curl")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "stream": True}
    url = f"{layout.base}/v1/completions"
    assert httpx.post(url, json=body, timeout=30).status_code == 401  # no key
    assert httpx.post(url, json=body, timeout=30,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{layout.base}/health", timeout=30).status_code == 200  # open to all
    res = layout.shell.run("curl", substitute(snip, snip.text, r"\b127\.0\.0\.1:8000\b",
                                              f"127.0.0.1:{layout.port}"), timeout_s=120)
    assert res.ok, res.output
    assert_streams(res.output)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_serve_shutdown_and_ray_stop_end_every_node(layout):
    layout.require_up()
    res = layout.down()
    assert res.ok, res.output
    assert wait_closed(layout.port), "Serve still answers after serve shutdown + ray stop"
    left = leftovers(layout.shell_log)
    assert left == [], f"Ray processes left after `ray stop`: {left}"
