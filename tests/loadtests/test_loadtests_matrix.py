"""The HTTP matrix (`python -m loadtests.bench compare|http`) end to end with the fake
server as launcher, and the server launcher's cleanup."""
import json
import os
import textwrap

import pytest

from loadtests import bench
from loadtests.serving import serving_matrix
from loadtests.serving.local_server import LIVE, LocalServer
from loadtests.serving.metrics import ratio

pytestmark = pytest.mark.slow  # serving-matrix runs: not in `make test-fast`


def test_compare_runs_each_config_and_prints_one_table(tmp_path, capsys):
    out = bench.main(["compare", "--launcher", "loadtests.fake_server", "--model", "fake",
                      "--configs", "N1,N8-window,non-stream", "--baseline", "N8-window",
                      "--num-prompts", "8", "--input-len", "10", "--output-len", "16",
                      "--max-concurrency", "4", "--result-dir", str(tmp_path),
                      "--startup-timeout", "60", "--disable-tqdm"])
    printed = capsys.readouterr().out
    table = out["table"].splitlines()
    assert table[0].startswith("| config") and "TPOT x vs N8-window" in table[0]
    assert [line.split("|")[1].strip() for line in table[2:]] == ["N1", "N8-window", "non-stream"]
    assert out["table"] in printed
    rows = out["rows"]
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in rows.values())
    # the fake server's chunking follows the flags each row passed to it
    assert rows["N1"]["mean_tokens_per_chunk"] == pytest.approx(1.0)
    assert rows["N8-window"]["mean_tokens_per_chunk"] == pytest.approx(8.0)
    assert rows["non-stream"]["mean_tokens_per_chunk"] == pytest.approx(16.0)
    assert rows["non-stream"]["stream"] is False
    assert all(v == pytest.approx(1.0) for v in rows["N8-window"]["ratios"].values())
    n1 = rows["N1"]
    assert n1["ratios"]["median_itl_ms"] == pytest.approx(
        n1["median_itl_ms"] / rows["N8-window"]["median_itl_ms"])
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["baseline"] == "N8-window" and set(saved["rows"]) == {"N1", "N8-window", "non-stream"}
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads((tmp_path / "bench-N1.json").read_text())["requests"]) == 8
    assert "Serving at http://127.0.0.1:" in (tmp_path / "server-N1.log").read_text()
    assert not LIVE  # every server was stopped


def test_format_table_marks_failed_rows_and_streamless_metrics():
    rows = {
        "base": {"stream": True, "completed": 2, "failed": 0, "output_throughput": 10.0,
                 "median_tpot_ms": 2.0, "median_itl_ms": 4.0},
        "ns": {"stream": False, "completed": 2, "failed": 0, "output_throughput": 5.0,
               "median_tpot_ms": 0.0, "median_itl_ms": 0.0},
        "broken": {"error": "server exited"},
    }
    assert ratio(rows["ns"]["output_throughput"], rows["base"]["output_throughput"]) == 0.5
    lines = serving_matrix.compare_table(rows, "base").splitlines()
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    header, ns, broken = cells(lines[0]), cells(lines[3]), cells(lines[4])
    assert ns[header.index("tok/s x vs base")] == "0.500"
    assert ns[header.index("ITL med ms")] == "-" and ns[header.index("TPOT x vs base")] == "-"
    assert broken[1] == "failed"


def test_http_preset_rows_offline_and_served_with_cpu_per_role(tmp_path, capsys):
    out = bench.main(["http", "--launcher", "loadtests.fake_server", "--num-prompts", "4",
                      "--input-len", "8", "--output-len", "4", "--temperatures", "0", "1",
                      "--variant", "one=--num-scheduler-steps 1",
                      "--variant", "window=FAKE_ENV=1 --num-scheduler-steps 4 --release-per-window",
                      "--result-dir", str(tmp_path), "--startup-timeout", "60"])
    rows = out["rows"]
    assert list(rows) == ["offline, t=0", "offline, t=1", "http one, t=0", "http one, t=1",
                          "http one, c=1", "http window, t=0", "http window, t=1", "offline, c=1"]
    assert all(r["completed"] == (10 if "c=1" in n else 4) and r["failed"] == 0 for n, r in rows.items())
    assert rows["http one, t=1"]["temperature"] is None  # 1.0 is sent as none, as clients do
    assert rows["http window, t=0"]["mean_tokens_per_chunk"] == pytest.approx(4.0)
    assert rows["http one, t=0"]["mean_tokens_per_chunk"] == pytest.approx(1.0)
    assert rows["http one, t=0"]["cpu_us server"] >= 0  # read from /proc for the fake's tree
    assert "cpu_us server" not in rows["offline, t=0"]
    printed = capsys.readouterr().out
    assert "CPU us per output token" in printed and "median TTFT at concurrency 1" in printed
    assert json.loads((tmp_path / "bench_http.json").read_text())["variants"] == ["one", "window"]
    assert not LIVE


def _write_module(path, name, body):
    (path / f"{name}.py").write_text(textwrap.dedent(body))


def test_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path, monkeypatch):
    _write_module(tmp_path, "never_ready", """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stubborn server: needs SIGTERM or worse
        time.sleep(120)
    """)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    server = LocalServer([], module="never_ready", startup_timeout_s=1.5, stop_timeout_s=1.0)
    with pytest.raises(TimeoutError):
        server.start()
    assert server.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # the whole group is gone
    assert server not in LIVE


def test_server_that_exits_early_is_reported(tmp_path, monkeypatch):
    _write_module(tmp_path, "exits_at_once", "raise SystemExit(3)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        LocalServer([], module="exits_at_once", startup_timeout_s=20).start()


def test_a_launcher_that_says_try_again_starts_once_more(tmp_path, monkeypatch):
    """Exit status 75 (Ray gave up on its own start-up on a busy machine): one more
    start; a second 75 is reported as any early exit."""
    from cluster.launcher.console import EXIT_TRY_AGAIN

    _write_module(tmp_path, "busy_then_fake", f"""
        import os, runpy, sys
        tries = os.path.join({str(tmp_path)!r}, "tries")
        with open(tries, "a") as f:
            f.write("x")
        if len(open(tries).read()) <= int(os.environ["BUSY_TRIES"]):
            sys.exit({EXIT_TRY_AGAIN})
        runpy.run_module("loadtests.fake_server", run_name="__main__")
    """)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("BUSY_TRIES", "1")
    with LocalServer(["--step-ms", "1"], module="busy_then_fake", model="fake",
                     log_path=tmp_path / "s.log", startup_timeout_s=30):
        pass
    assert (tmp_path / "tries").read_text() == "xx"
    (tmp_path / "tries").unlink()
    monkeypatch.setenv("BUSY_TRIES", "2")
    with pytest.raises(RuntimeError, match=f"exited with code {EXIT_TRY_AGAIN}"):
        LocalServer([], module="busy_then_fake", startup_timeout_s=20).start()
    assert (tmp_path / "tries").read_text() == "xx"


def test_local_server_stops_its_process_group(tmp_path):
    server = LocalServer(["--step-ms", "1"], module="loadtests.fake_server", model="fake",
                         log_path=tmp_path / "s.log", startup_timeout_s=30)
    with server:
        assert server in LIVE
        pid = server.process.pid
        assert os.getpgid(pid) == pid  # its own group, so Ray's helpers go with it
    assert server.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def test_variant_names_a_checkout_an_environment_and_flags():
    server = serving_matrix.parse_variant("before=@/tmp/old OMP_WAIT_POLICY=passive --engine-num-cpus 2")
    assert (server.name, server.tree) == ("before", "/tmp/old")
    assert server.env == (("OMP_WAIT_POLICY", "passive"),)
    assert server.flags == ("--engine-num-cpus", "2")
    assert serving_matrix.parse_variant("now=--port 1").tree is None


def test_local_server_launches_from_the_checkout_it_is_given(tmp_path):
    # A module that exists only in the other checkout: found because the server runs there.
    _write_module(tmp_path, "only_in_that_checkout", "import os, sys; sys.exit(7 if os.getcwd() else 0)\n")
    with pytest.raises(RuntimeError, match="exited with code 7"):
        LocalServer([], module="only_in_that_checkout", startup_timeout_s=20, cwd=tmp_path).start()
