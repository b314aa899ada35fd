"""Access on a real multi-node Ray (`ray.cluster_utils.Cluster`: a raylet and worker
processes per node, on one machine), with Ray's token auth on:

- the API key holds on an ingress replica whose node lacks STEPSTREAM_API_KEY (the
  key was resolved where the app was built and passed on as its digest);
- without a key, an ingress refuses to start behind a non-loopback HTTP host even
  when the app was built before Serve ran (as `serve run cluster.app:build_app`
  does), so no entry point skips the rule;
- a driver without the cluster's token cannot connect, so it cannot get a handle
  to call an engine replica around the ingress;
- an engine replica opens a channel for a live ingress replica of its app only.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from cluster_support import free_port, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.own_ray, pytest.mark.timeout(600)]

MODEL = "tiny"
ENGINE_ARGS = {"max_num_seqs": 8, "num_kv_blocks": 256, "max_model_len": 256,
               "num_scheduler_steps": 4}
APP_ARGS = {"model": MODEL, "engine_num_cpus": 1, "ingress_num_cpus": 0.5, **ENGINE_ARGS}
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "STEPSTREAM_API_KEY")
# NOTE: Serve tries a failing replica's constructor 3 times by default; once shows the
# refusal as well (the nodes' processes inherit this process's environment).
_RETRY_VAR = "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in (*_AUTH_VARS, _RETRY_VAR)}
    token = secrets.token_hex(32)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, _RETRY_VAR: "1"})
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.pop("STEPSTREAM_API_KEY", None)  # no node gets the variable
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray._private.authentication_test_utils import reset_auth_token_state
    reset_auth_token_state()  # NOTE: Ray's C++ config reads the auth mode once per process
    # The head runs Serve's controller and proxy (no CPUs: no replica lands there);
    # the worker node runs the engine and the ingress.
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    worker = nodes.add_node(num_cpus=3)
    try:
        ray.init(address=nodes.address, log_to_driver=False, configure_logging=False)
        port = free_port()
        # NOTE: 0.0.0.0 is what a cluster binds; the tests only send to 127.0.0.1.
        serve.start(proxy_location="HeadOnly", http_options={"host": "0.0.0.0", "port": port})
        yield SimpleNamespace(address=nodes.address, base=f"http://127.0.0.1:{port}",
                              worker_node_id=worker.node_id, token=token)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        nodes.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_auth_token_state()


def _node_of(class_suffix: str) -> str:
    """The node of the live actor whose class name ends with `class_suffix`."""
    import ray

    nodes = {a["Address"]["NodeID"] for a in ray._private.state.actors().values()
             if a["ActorClassName"].endswith(class_suffix) and a["State"] == "ALIVE"}
    (node,) = nodes
    return node


def test_without_a_key_the_ingress_refuses_a_non_loopback_host(cluster, monkeypatch):
    from ray import serve

    from cluster.api import access
    from cluster.app import AppArgs, make_app

    # Built before Serve runs (serve run's order): the builder cannot see the host.
    monkeypatch.setattr(access, "serve_http_host", lambda: None)
    app = make_app(AppArgs.model_validate(APP_ARGS))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="Failed to update the deployments"):
        serve.run(app, name="open", route_prefix="/open", blocking=False)
        serve._private.api.get_global_client()._wait_for_application_running("open", timeout_s=300)
    # what `serve status` shows: the ingress's own refusal
    message = serve.status().applications["open"].deployments["Ingress"].message
    assert "refusing to serve on 0.0.0.0" in message, message[-2000:]
    serve.delete("open")


@pytest.fixture(scope="module")
def keyed_app(cluster):
    from ray import serve

    from cluster.app import AppArgs, make_app

    key = secrets.token_urlsafe(24)
    os.environ["STEPSTREAM_API_KEY"] = key  # this process builds the app; no node has it
    try:
        args = AppArgs.model_validate(APP_ARGS)
    finally:
        os.environ.pop("STEPSTREAM_API_KEY")
    serve.run(make_app(args), name="stepstream", route_prefix="/", blocking=False)
    wait_healthy(cluster.base, timeout_s=240)
    yield key
    serve.delete("stepstream")


def test_the_key_holds_on_an_ingress_whose_node_lacks_the_variable(cluster, keyed_app):
    assert _node_of(":Ingress") == cluster.worker_node_id
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    url = cluster.base + "/v1/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, timeout=60,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.post(url, json=body, timeout=120, headers={"Authorization": f"Bearer {keyed_app}"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


_CONNECT = ("import ray\n"
            "ray.init(address={address!r}, log_to_driver=False)\n"
            "print('connected')\n")


@pytest.mark.parametrize("mode", ["token", None])
def test_a_driver_without_the_clusters_token_cannot_connect(cluster, tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k not in _AUTH_VARS}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token
    if mode:
        env["RAY_AUTH_MODE"] = mode
    # NOTE: a refused driver retries its connection once a second, 20 times by
    # default; two tries show the refusal as well.
    env["RAY_gcs_server_port_wait_time_s"] = "2"
    result = subprocess.run([sys.executable, "-c", _CONNECT.format(address=cluster.address)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "connected" not in result.stdout, result.stdout
    assert "auth" in (result.stderr + result.stdout).lower(), result.stderr[-2000:]


def test_an_engine_replica_opens_channels_for_its_live_ingress_replicas_only(cluster, keyed_app):
    import ray
    from ray import serve

    from cluster.transport.routing import PIN_KWARG

    engine = serve.get_deployment_handle("EngineReplica", app_name="stepstream")
    stats = engine.stats.remote().result(timeout_s=60)
    engine_actor = ray.get_actor(
        f"SERVE_REPLICA::stepstream#EngineReplica#{stats['replica_id']}", namespace="serve")
    stream = engine.options(stream=True)
    for owner, handle in (("forged-owner1", None), ("forged-owner2", engine_actor),
                          (f"{stats['replica_id']}-deadbeef", engine_actor)):
        gen = stream.channel.remote(owner, owner_handle=handle,
                                    **{PIN_KWARG: stats["replica_id"]})
        with pytest.raises(Exception, match="not a live ingress replica"):
            next(iter(gen))
    # the real ingress's channel works: a request streams to its end
    r = httpx.post(cluster.base + "/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {keyed_app}"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
