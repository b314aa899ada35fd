"""What the local launcher (`python -m cluster.serve_local`, `make serve`) says, and
what its flags reach. A busy port costs a short message that names the flag to
pass and a non-zero exit, before Ray starts; --metrics-port reaches Ray's metrics
export and --engine-num-gpus the engine replica's resources, and a machine whose Ray
sees too few GPUs is told so instead of waiting forever; an app that cannot deploy
says why in a line; Ray's misleading shutdown lines are dropped. Only the deploy
failure starts a Ray: the flag plumbing runs against stand-ins for `ray.init` and
`serve.start`."""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from cluster.launcher import console, preflight
from cluster_support import free_port

pytestmark = [pytest.mark.front_door, pytest.mark.timeout(120)]


def _launcher(*flags: str, timeout_s: float = 90, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "STEPSTREAM_API_KEY"} | extra_env
    return subprocess.run([sys.executable, "-m", "cluster.serve_local", *flags],
                          capture_output=True, text=True, timeout=timeout_s, env=env,
                          stdin=subprocess.DEVNULL)


def _listening(port: int, host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((host, port))
    s.listen()
    return s


@pytest.mark.parametrize("which", ["http", "metrics"])
def test_a_busy_port_says_which_flag_to_pass_and_exits_before_ray(which):
    taken = free_port()
    http_port = taken if which == "http" else free_port()
    flags = ["--port", str(http_port)]
    if which == "metrics":
        flags += ["--metrics-port", str(taken)]
    with _listening(taken, "127.0.0.1" if which == "http" else ""):
        started = time.monotonic()
        result = _launcher(*flags)
        elapsed_s = time.monotonic() - started
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"port {taken} is in use" in result.stderr, out
    flag = "--port" if which == "http" else "--metrics-port"
    assert f"{flag} {taken + 1}" in result.stderr, out
    assert "Traceback" not in out and len(out.splitlines()) <= 4, out
    assert "Starting a local Ray" not in out  # it said so before Ray started
    print(f"\n{which} port busy: exit 1 after {elapsed_s:.1f} s:\n{out}")


def test_the_default_metrics_port_falls_back_when_taken_and_says_where(monkeypatch):
    taken = free_port()
    monkeypatch.setattr(preflight, "DEFAULT_METRICS_PORT", taken)
    with _listening(taken, ""):
        port, warning = preflight.metrics_port(None)
        assert port != taken and preflight.bind_problem("", port) is None
        assert f"metrics on port {port}" in warning and "--metrics-port" in warning
        assert preflight.metrics_port(taken) == (None, f"port {taken} is in use on this machine")
    assert preflight.metrics_port(None) == (taken, None)


def test_a_missing_model_directory_is_one_line_before_ray(tmp_path):
    result = _launcher("--model", str(tmp_path / "nowhere"), "--port", str(free_port()))
    assert result.returncode == 2, result.stderr
    assert "neither a preset" in result.stderr and "Traceback" not in result.stderr
    assert preflight.model_problem(str(tmp_path)).endswith("has no config.json (a Hugging "
                                                           "Face checkpoint has)")
    assert preflight.model_problem("tiny") is None


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_an_app_that_cannot_deploy_says_why_and_exits(tmp_path):
    """A checkpoint without its tokenizer: the replica's own error, in one line, and
    exit 1 (not the 600 s wait for /health)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    result = _launcher("--model", str(tmp_path), "--port", str(free_port()), "--num-cpus", "2",
                       "--metrics-port", str(free_port()), timeout_s=240,
                       # NOTE: Serve tries a failing constructor 3 times by default; once
                       # gives the same line
                       RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"the app did not start: Ingress: FileNotFoundError: no tokenizer.json in {tmp_path}" \
        in result.stderr, result.stderr
    assert "the replicas' logs: " in result.stderr and "Traceback" not in result.stderr
    assert result.stdout.splitlines()[-2:] == ["Shutting down", "Stopped"], result.stdout


@pytest.mark.parametrize("flags, said", [
    (["--port", "99999"], "argument --port: 99999 is not a port number (1-65535)"),
    (["--port", "0"], "argument --port: 0 is not a port number"),
    (["--metrics-port", "-5"], "argument --metrics-port: -5 is not a port number"),
    (["--port", "abc"], "argument --port: 'abc' is not a port number"),
    (["--num-cpus", "0"], "argument --num-cpus: 0 is not at least 1"),
])
def test_a_flag_out_of_range_is_refused_in_a_line(flags, said, capsys):
    from cluster.serve_local import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(flags)
    assert info.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("text, said", [
    (None, "cannot read"),
    ("applications: [\n", "is not valid YAML (line 2)"),
    ("- 1\n- 2\n", "the file must be a mapping, not list"),
    ("applications: 5\n", "applications must be a list of mappings"),
    ("applications:\n  - args: [1, 2]\n", "applications[0].args must be a mapping, not list"),
    ("http_options: 8000\n", "http_options must be a mapping, not int"),
    ("http_options:\n  port: eighty\n", "http_options.port: 'eighty' is not a port number"),
    ("http_options:\n  port: 70000\n", "http_options.port: 70000 is not a port number"),
])
def test_a_config_file_the_launcher_cannot_read_is_one_line_before_ray(tmp_path, text, said,
                                                                      capsys):
    from cluster import serve_local

    config = tmp_path / "serve.yaml"
    if text is not None:
        config.write_text(text)
    assert serve_local.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config: ") and said in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.fixture
def environ_restored():
    """main() sets Ray's and Serve's variables in its own environment before Ray
    starts; run in this process, they must not reach a Ray a later test starts here
    (a GCS with RAY_AUTH_MODE=token refuses a driver that read it as disabled)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_config_settings_the_launcher_does_not_apply_are_named(tmp_path, capsys,
                                                               environ_restored):
    """`serve run` applies the whole file; the launcher serves applications[0].args on
    http_options' host and port, and says what else it leaves."""
    from cluster import serve_local
    from cluster.launcher.config_file import read_config

    for shipped in ("configs/serve.yaml", "configs/serve-gpu.yaml"):
        assert read_config(shipped).unused == [], shipped
    config = tmp_path / "serve.yaml"
    config.write_text(textwrap.dedent("""\
        proxy_location: Disabled
        logging_config: {log_level: DEBUG}
        http_options: {host: 127.0.0.1, port: 8123, request_timeout_s: 30}
        applications:
          - name: stepstream
            route_prefix: /llm
            import_path: cluster.app:build_app
            runtime_env: {env_vars: {RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S: "2"}}
            deployments: [{name: Engine, num_replicas: 3}]
            args: {model: tiny, max_num_seqs: 0}
          - name: second
        """))
    assert read_config(str(config)).unused == [
        "proxy_location", "logging_config", "http_options.request_timeout_s",
        "applications[0].route_prefix", "applications[0].deployments", "applications[1:] (1 more)"]
    # NOTE: max_num_seqs 0 ends it before Ray, after the warning
    assert serve_local.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("warning: --config: the launcher serves applications[0].args"), err
    assert "not applied: proxy_location, logging_config, " in err[0], err
    assert err[1].startswith("error: invalid settings: max_num_seqs"), err


def test_settings_the_app_refuses_are_named_without_pydantic_echoing_them():
    from pydantic import ValidationError

    from cluster.app import AppArgs
    from cluster.serve_local import settings_problems

    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate({"model": "tiny", "max_num_seqs": "lots", "bogus_key": 1})
    said = settings_problems(info.value)
    assert said.startswith("max_num_seqs: Input should be a valid integer"), said
    assert "bogus_key: Extra inputs are not permitted" in said
    assert "input_value" not in said and "pydantic.dev" not in said
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate({"model": "tiny", "max_num_seqs": 0})
    assert settings_problems(info.value) == "max_num_seqs must be an integer in [1, 4096], got 0"


def test_a_second_ctrl_c_ends_the_launcher_in_a_line_not_a_traceback(monkeypatch, capsys):
    from cluster import serve_local

    def interrupted(argv):
        raise KeyboardInterrupt  # what the second signal raises (_stop_on_signals)

    monkeypatch.setattr(serve_local, "main", interrupted)
    assert serve_local.run([]) == 130
    err = capsys.readouterr().err
    assert err.startswith("warning: stopped before a clean shutdown") and len(err.splitlines()) == 1


def test_after_a_sigterm_serve_drains_only_if_the_gcs_answers(monkeypatch):
    """A SIGTERM to the launcher's whole process group (`timeout`, systemd) leaves
    Ray's GCS without answers: no 30 s wait for Serve's controller then."""
    import signal
    import threading

    from cluster import serve_local

    asked = []
    monkeypatch.setattr(serve_local, "gcs_answers", lambda timeout_s: asked.append(timeout_s))
    stop = threading.Event()
    stop.signum = signal.SIGINT  # Ctrl-C: Ray's processes ignore it
    assert serve_local._drain_serve(stop) and not asked
    stop.signum = signal.SIGTERM
    assert not serve_local._drain_serve(stop)
    assert asked == [serve_local.GCS_PROBE_TIMEOUT_S]


def test_flags_reach_the_app_args():
    from cluster.app import AppArgs
    from cluster.serve_local import app_args, parse_args

    assert parse_args([]).metrics_port is None  # the default, resolved at start
    assert parse_args(["--metrics-port", "9100"]).metrics_port == 9100
    args, _, _ = app_args(parse_args(["--engine-num-gpus", "1", "--model", "tiny"]))
    app = AppArgs.model_validate(args)
    assert app.engine_config().device == "cuda"
    assert app.engine_options()["ray_actor_options"]["num_gpus"] == 1
    args, _, _ = app_args(parse_args([]))
    assert "engine_num_gpus" not in args and AppArgs.model_validate(args).engine_config().device == "cpu"


# Runs the launcher's main() in a child process with stand-ins for Ray: prints what
# ray.init got and the exit status.
_STAND_INS = textwrap.dedent("""
    import json, os, sys
    import ray
    from ray import serve
    from cluster.launcher import process_reaper
    from cluster import serve_local

    seen = {}
    process_reaper.start = lambda: None
    def init(**kw):
        if os.environ.get("RAY_INIT_RAISES"):  # Ray's own failure, as it words it
            raise Exception(os.environ["RAY_INIT_RAISES"])
        seen.update(init={k: kw.get(k) for k in ("_metrics_export_port", "logging_level")})
        seen.update(env={k: os.environ.get(k) for k in (
            "RAY_worker_niceness", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")})
    ray.init = init
    ray.cluster_resources = lambda: {"CPU": 2.0, "GPU": float(sys.argv[1])}
    ray.shutdown = lambda: None
    ray.get_runtime_context = lambda: type("Context", (), {"get_node_id": lambda self: "0" * 56})()
    def start(**kw):
        seen["serve_start"] = kw
        if os.environ.get("HEALTHY_AT_START"):  # the app answers /health at once
            import http.server, threading
            class Health(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200 if self.path == "/health" else 404)
                    self.end_headers()
                def log_message(self, *args):
                    pass
            port = kw["http_options"]["port"]
            server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
            threading.Thread(target=server.serve_forever, daemon=True).start()
        if os.environ.get("SIGNAL_AT_START"):  # Ctrl-C or a SIGTERM while Serve starts
            os.kill(os.getpid(), int(os.environ["SIGNAL_AT_START"]))
            return
        raise RuntimeError("Ray's own words\\nFailed to bind to address 127.0.0.1:1")
    serve.start = start
    serve.run = lambda app, **kw: seen.update(serve_run=kw["name"])
    serve.shutdown = lambda: None
    status = serve_local.main(sys.argv[2:])
    print("RESULT " + json.dumps({"status": status, **seen}))
""")


def _with_stand_ins(num_gpus_seen: int, *flags: str, **extra_env: str | None
                    ) -> tuple[dict, str]:
    """`extra_env`: a value None takes the variable out of the environment."""
    env = {k: v for k, v in ({k: v for k, v in os.environ.items() if k != "STEPSTREAM_API_KEY"}
                             | extra_env).items() if v is not None}
    result = subprocess.run([sys.executable, "-c", _STAND_INS, str(num_gpus_seen), *flags],
                            capture_output=True, text=True, timeout=90, env=env)
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, result.stdout + result.stderr
    return json.loads(line[len("RESULT "):]), result.stderr


def test_ray_giving_up_on_its_own_start_is_a_try_again_not_a_traceback():
    """Ray waits a fixed 30 s for its node; on a busy machine that runs out."""
    from cluster.launcher.console import EXIT_TRY_AGAIN

    seen, stderr = _with_stand_ins(0, "--port", str(free_port()), RAY_INIT_RAISES=(
        "The current node timed out during startup. This could happen because some of the "
        "raylet failed to startup or the GCS has become overloaded."))
    assert seen["status"] == EXIT_TRY_AGAIN and "serve_start" not in seen
    assert "did not register within Ray's fixed 30 s" in stderr, stderr
    assert "Traceback" not in stderr, stderr


def test_ray_runs_the_apps_processes_at_the_launchers_priority_and_waits_for_a_busy_proxy():
    """Ray's nice 15 and Serve's 5 s proxy readiness: beside other busy work the
    launcher never served (cluster/serve_local.py, cluster/launcher/front_door.py)."""
    seen, _ = _with_stand_ins(0, "--port", str(free_port()), RAY_worker_niceness=None,
                              RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=None)
    assert seen["env"] == {"RAY_worker_niceness": "0",
                           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
    # a user's own settings stay
    seen, _ = _with_stand_ins(0, "--port", str(free_port()), RAY_worker_niceness="10",
                              RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="9")
    assert seen["env"] == {"RAY_worker_niceness": "10",
                           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "9"}


@pytest.mark.parametrize("signum, status", [(2, 130), (15, 143)])
def test_a_signal_before_serving_is_an_aborted_start_not_a_clean_exit(signum, status):
    """A supervisor (systemd, a script) tells a start cut short (128 + the signal)
    from a stop after serving (0)."""
    seen, stderr = _with_stand_ins(0, "--port", str(free_port()), SIGNAL_AT_START=str(signum))
    assert seen["status"] == status and seen["serve_run"], (seen, stderr)
    name = {2: "SIGINT", 15: "SIGTERM"}[signum]
    assert f"warning: stopped before serving ({name})" in stderr, stderr
    assert "Traceback" not in stderr, stderr


def test_a_signal_once_the_app_answers_is_a_clean_stop_though_serving_at_was_not_said():
    """The app can answer (others saw /health 200) before the launcher's own check
    of it ends: a stop then is a stop after serving."""
    seen, stderr = _with_stand_ins(0, "--port", str(free_port()), SIGNAL_AT_START="2",
                                   HEALTHY_AT_START="1")
    assert seen["status"] == 0, (seen, stderr)
    assert "stopped before serving" not in stderr, stderr


def test_metrics_port_reaches_ray_and_too_few_gpus_is_said_plainly():
    mport = free_port()
    flags = ["--port", str(free_port()), "--metrics-port", str(mport), "--engine-num-gpus", "1"]
    seen, stderr = _with_stand_ins(0, *flags)
    assert seen["status"] == 1 and seen["init"]["_metrics_export_port"] == mport
    assert "serve_start" not in seen  # Serve would wait for the GPU forever
    assert "Ray sees 0 GPUs" in stderr and "nvidia-smi" in stderr, stderr
    seen, stderr = _with_stand_ins(1, *flags)
    assert seen["status"] == 1 and "serve_start" in seen  # the GPU is there: Serve starts
    assert "the app did not start: Failed to bind to address" in stderr, stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 4, stderr


def test_ray_lines_that_mislead_are_dropped_with_their_newline():
    out = io.StringIO()
    stream = console.LineFilter(out)
    for line in ("(raylet) Task ServeController.graceful_shutdown failed. There are infinite "
                 "retries remaining, so the task will be retried. Error: The actor is dead "
                 "because it was killed by `ray.kill`.",
                 "(raylet) Task ServeController.listen_for_change failed. ... killed by "
                 "`ray.kill`.", "Serving at http://127.0.0.1:8000/v1", ""):
        print(line, file=stream)
    assert out.getvalue() == "Serving at http://127.0.0.1:8000/v1\n\n"


def test_the_model_line_says_dtype_backend_and_replicas():
    info = {"model": "tiny", "dtype": "float32", "device": "cpu", "attention_backend": "cpu",
            "num_kv_tokens": 262144}
    assert console.model_line(info, 1, 1, 0) == (
        "Model: tiny (float32 on cpu, attention backend cpu, KV cache 262,144 tokens); "
        "1 engine replica, 1 ingress replica")
    info = {**info, "model": "smollm2-135m", "weights": "Q4_1/Q8_0 (native)",
            "weight_bytes": 96_600_000}
    assert console.model_line(info, 2, 2, 0) == (
        "Model: smollm2-135m (float32 on cpu, weights Q4_1/Q8_0 (native), 97 MB, attention "
        "backend cpu, KV cache 262,144 tokens); 2 engine replicas, 2 ingress replicas")
    assert console.model_line({"model": "/m"}, 2, 4, 1) == (
        "Model: /m; 2 engine replicas, 1 GPU each, 4 ingress replicas")
