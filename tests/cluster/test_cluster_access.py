"""Access without Ray: the no-key rule (loopback only, or an explicit
`allow_unauthenticated`), the local launcher's key from the environment (passed on
as its SHA-256 only), and /health's cache (at most one engine call per second,
whatever the hit rate)."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import subprocess
import sys

import pytest
from pydantic import ValidationError

from cluster.api import access
from cluster.api.access import check_access, is_loopback
from cluster.app import AppArgs  # NOTE: first: importing Serve sets up its loggers


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.8.7", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)
    assert "No API key" in check_access(host, has_key=False, allow_unauthenticated=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "example.com"])
def test_no_key_on_a_non_loopback_address_needs_an_explicit_allow(host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="allow_unauthenticated: true"):
        check_access(host, has_key=False, allow_unauthenticated=False)
    assert "open to anyone" in check_access(host, has_key=False, allow_unauthenticated=True)
    assert check_access(host, has_key=True, allow_unauthenticated=False) is None


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def serve_warnings():
    """Warnings of the "ray.serve" logger (Ray stops it from propagating)."""
    records, logger = _Records(), logging.getLogger("ray.serve")
    logger.addHandler(records)
    yield records.messages
    logger.removeHandler(records)


def test_app_args_check_the_running_serves_host(monkeypatch, serve_warnings):
    monkeypatch.delenv(access.API_KEY_ENV, raising=False)
    monkeypatch.setattr(access, "serve_http_host", lambda: "0.0.0.0")
    with pytest.raises(ValidationError, match="allow_unauthenticated"):
        AppArgs()
    AppArgs(allow_unauthenticated=True)
    assert len(serve_warnings) == 1 and "open to anyone" in serve_warnings.pop()
    AppArgs(api_key_sha256="ab" * 32)
    monkeypatch.setenv(access.API_KEY_ENV, "from-env")
    AppArgs()
    assert serve_warnings == []
    monkeypatch.delenv(access.API_KEY_ENV)
    monkeypatch.setattr(access, "serve_http_host", lambda: "127.0.0.1")
    AppArgs()
    assert len(serve_warnings) == 1 and "No API key" in serve_warnings.pop()
    monkeypatch.setattr(access, "serve_http_host", lambda: None)  # no Serve: nothing to check
    AppArgs()
    assert serve_warnings == []


@pytest.mark.parametrize("name, needs_key", [("serve.yaml", False), ("serve-gpu.yaml", True)])
def test_configs_follow_the_no_key_rule(monkeypatch, name, needs_key):
    import pathlib

    import yaml

    config = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "configs" /
                             name).read_text())
    args = config["applications"][0]["args"]
    monkeypatch.delenv(access.API_KEY_ENV, raising=False)
    monkeypatch.setattr(access, "serve_http_host", lambda: config["http_options"]["host"])
    if needs_key:  # it binds 0.0.0.0: without a key it refuses to start
        with pytest.raises(ValidationError, match="refusing to serve on 0.0.0.0"):
            AppArgs.model_validate(args)
        monkeypatch.setenv(access.API_KEY_ENV, "set-on-every-node")
    AppArgs.model_validate(args)


def test_launcher_takes_the_key_from_the_env_and_passes_its_digest(monkeypatch, tmp_path):
    from cluster.serve_local import app_args, parse_args

    digest = hashlib.sha256(b"s3cret").hexdigest()
    monkeypatch.setenv(access.API_KEY_ENV, "s3cret")
    args, _, _ = app_args(parse_args([]))
    assert args["api_key_sha256"] == digest and "api_key" not in args
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n  - args:\n      api_key: from-config\n")
    args, _, _ = app_args(parse_args(["--config", str(config)]))
    assert args["api_key_sha256"] == digest and "api_key" not in args
    monkeypatch.delenv(access.API_KEY_ENV)
    args, _, _ = app_args(parse_args(["--api-key", "flag-key"]))
    assert args["api_key_sha256"] == hashlib.sha256(b"flag-key").hexdigest()
    assert "api_key_sha256" not in app_args(parse_args([]))[0]


def test_launcher_refuses_a_public_address_without_a_key_before_starting_ray():
    env = {k: v for k, v in __import__("os").environ.items() if k != access.API_KEY_ENV}
    done = subprocess.run([sys.executable, "-m", "cluster.serve_local", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to serve on 0.0.0.0" in done.stderr
    assert "Started a local Ray" not in done.stderr + done.stdout


class _Check:
    """Counts engine health checks; each takes a little while, like a real round trip."""

    def __init__(self, fail: bool = False):
        self.calls = 0
        self.fail = fail

    async def __call__(self):
        from cluster.api.engine_health import EngineHealth

        self.calls += 1
        await asyncio.sleep(0.02)
        if self.fail:
            return EngineHealth((), {"replica-a": "RuntimeError"})
        return EngineHealth(("replica-a",))


def test_health_is_cached_and_shared_by_concurrent_hits():
    from cluster.api.ingress import _HealthCache

    def ok(health) -> bool:
        return health.is_healthy

    async def main():
        check = _Check()
        cache = _HealthCache(ttl_s=0.3, check=check)
        first = await asyncio.gather(*(cache.health() for _ in range(200)))
        again = [await cache.health() for _ in range(200)]
        assert all(map(ok, first + again)) and check.calls == 1
        # a client that hangs up does not cancel the check the others wait on
        await asyncio.sleep(0.35)
        hung_up = asyncio.ensure_future(cache.health())
        waiting = asyncio.ensure_future(cache.health())
        await asyncio.sleep(0)
        hung_up.cancel()
        assert ok(await waiting) and check.calls == 2
        # a check cancelled from outside (Serve cancels what a cancelled request
        # started) is not reused: the next hit starts a new one
        await asyncio.sleep(0.35)
        first_hit = asyncio.ensure_future(cache.health())
        await asyncio.sleep(0)
        cache._check_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first_hit
        calls = check.calls
        assert ok(await cache.health()) and check.calls == calls + 1
        dead = _Check(fail=True)
        dead_cache = _HealthCache(ttl_s=10.0, check=dead)
        answers = await asyncio.gather(*(dead_cache.health() for _ in range(50)))
        assert {a.response().status_code for a in answers} == {503} and dead.calls == 1
    asyncio.run(main())


@pytest.mark.parametrize("host, ok", [
    ("localhost", True), ("localhost:8000", True), ("LOCALHOST:8000", True),
    ("127.0.0.1", True), ("127.0.0.1:8000", True), ("127.3.2.1:80", True),
    ("[::1]", True), ("[::1]:8000", True), ("::1", True), ("app.localhost:8000", True),
    ("evil.example", False), ("evil.example:8000", False), ("10.0.0.5:8000", False),
    ("0.0.0.0:8000", False), ("localhost.evil.example", False), ("", False), (None, False),
    ("[::1", False), ("127.0.0.1.evil.example:8000", False),
])
def test_host_headers_of_loopback_only(host, ok):
    assert access.is_loopback_host_header(host) is ok


@pytest.mark.parametrize("value, ok", [
    ("application/json", True), ("application/json; charset=utf-8", True),
    ("Application/JSON", True), ("text/plain", False), ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False), ("", False), (None, False),
    ("application/jsonx", False),
])
def test_only_json_bodies(value, ok):
    assert access.is_json_content_type(value) is ok


def test_the_key_is_resolved_where_the_app_is_built(monkeypatch):
    """The ingress gets the digest as an argument: its own node's environment never
    decides whether it is open."""
    from cluster.app import make_app

    monkeypatch.setattr(access, "serve_http_host", lambda: None)
    monkeypatch.setenv(access.API_KEY_ENV, "from-the-build-node")
    digest = hashlib.sha256(b"from-the-build-node").hexdigest()
    args = AppArgs()
    assert args.api_key_digest() == digest
    ingress_kwargs = make_app(args)._bound_deployment.init_kwargs
    assert ingress_kwargs["api_key_sha256"] == digest and "api_key" not in ingress_kwargs
    assert AppArgs(api_key="in-config").api_key_digest() == hashlib.sha256(b"in-config").hexdigest()
    monkeypatch.delenv(access.API_KEY_ENV)
    # resolved once, at validation: later changes to this environment do not matter
    assert args.api_key_digest() == digest
    assert make_app(args)._bound_deployment.init_kwargs["api_key_sha256"] == digest
    assert AppArgs().api_key_digest() is None


def test_an_ingress_never_reads_the_key_from_its_own_environment(monkeypatch):
    from cluster.api import ingress

    monkeypatch.setattr(ingress, "serve_http_host", lambda: "127.0.0.1")
    monkeypatch.setenv(access.API_KEY_ENV, "only-on-this-node")
    assert ingress._access_mode(None, allow_unauthenticated=False) == (None, True)


def test_an_ingress_without_a_key_applies_the_no_key_rule_itself(monkeypatch):
    """`serve run cluster.app:build_app` builds before Serve runs: the ingress checks
    again, against the host the running Serve binds."""
    from cluster.api import ingress

    monkeypatch.setattr(ingress, "serve_http_host", lambda: "0.0.0.0")
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0"):
        ingress._access_mode(None, allow_unauthenticated=False)
    assert ingress._access_mode(None, allow_unauthenticated=True) == (None, False)
    assert ingress._access_mode("ab" * 32, allow_unauthenticated=False) == (bytes.fromhex("ab" * 32), False)
    monkeypatch.setattr(ingress, "serve_http_host", lambda: "127.0.0.1")
    assert ingress._access_mode(None, allow_unauthenticated=False) == (None, True)
    monkeypatch.setattr(ingress, "serve_http_host", lambda: None)  # unknown: refuse
    with pytest.raises(ValueError, match="could not be learned"):
        ingress._access_mode(None, allow_unauthenticated=False)
    assert ingress._access_mode(None, allow_unauthenticated=True) == (None, False)
