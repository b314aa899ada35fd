"""The benchmark client against a fake OpenAI-compatible SSE server on 127.0.0.1."""
import asyncio
import json

import pytest

from loadtests.bench import main
from loadtests.serving.serving_run import BenchConfig, make_parser, run_benchmark
from loadtests.fake_server import FakeServerConfig, FakeServerThread
from loadtests.serving.openai_stream import StreamParser, join_url

SEED_HEADINGS = [
    "============ Serving Benchmark Result ============",
    "---------------Time to First Token----------------",
    "-----Time per Output Token (excl. 1st token)------",
    "---------------Inter-token Latency----------------",
    "==================================================",
]


def _config(base_url, **overrides) -> BenchConfig:
    values = dict(base_url=base_url, model="fake", dataset_name="random", num_prompts=12,
                  random_input_len=20, random_output_len=9, max_concurrency=4,
                  ready_check_timeout_sec=0, timeout=20.0, run_timeout=60.0,
                  disable_tqdm=True, print_result=False)
    values.update(overrides)
    return BenchConfig(**values)


def test_every_request_succeeds_and_totals_match_the_server_usage(tmp_path, capsys):
    with FakeServerThread(FakeServerConfig(num_scheduler_steps=4, release_per_window=True)) as srv:
        argv = ["--base-url", srv.base_url + "/v1", "--model", "fake", "--dataset-name", "sharegpt",
                "--num-prompts", "15", "--sharegpt-output-len", "10", "--max-concurrency", "5",
                "--ready-check-timeout-sec", "0", "--save-result", "--result-dir", str(tmp_path),
                "--result-filename", "run.json", "--disable-tqdm"]
        result = main(argv)
        server = srv.server
    out = capsys.readouterr().out
    for heading in SEED_HEADINGS:
        assert heading in out.splitlines()
    assert "Successful requests:                     15" in out
    saved = json.loads((tmp_path / "run.json").read_text())
    assert len(saved["requests"]) == 15 and sorted(r["index"] for r in saved["requests"]) == list(range(15))
    assert all(r["success"] and r["output_tokens_source"] == "usage" for r in saved["requests"])
    assert saved["completed"] == 15 and saved["failed"] == 0
    assert saved["total_output_tokens"] == server.total_completion_tokens == 150
    assert saved["total_input_tokens"] == server.total_prompt_tokens
    assert sum(r["usage_prompt_tokens"] for r in saved["requests"]) == server.total_prompt_tokens
    # per-window release: 10 tokens as chunks of 4, 4, 2 -> 3 chunks and 2 ITL gaps each
    assert all(r["num_chunks"] == 3 and len(r["itl_ms"]) == 2 for r in saved["requests"])
    assert result["mean_tokens_per_chunk"] == pytest.approx(10 / 3)
    # the client's own wait for a CPU is part of every result (loadtests/serving/client_wait.py)
    assert saved["client_longest_loop_stall_ms"] >= 0.0 and "client_cpu_wait_share" in saved


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_per_step_chunks_on_both_endpoints(endpoint):
    with FakeServerThread(FakeServerConfig(step_ms=1.0)) as srv:
        result = asyncio.run(run_benchmark(_config(srv.base_url, endpoint=endpoint)))
    assert result["completed"] == 12 and result["total_output_tokens"] == 12 * 9
    for r in result["requests"]:
        # the chat role-only chunk is no content chunk: 9 tokens, 9 chunks, 8 gaps
        assert r["num_chunks"] == 9 and len(r["itl_ms"]) == 8
        assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0


@pytest.mark.parametrize("failure", ["http500", "cut", "error_event"])
def test_failures_are_counted_with_their_reason(failure):
    config = FakeServerConfig(fail_every=3, failure=failure)
    with FakeServerThread(config) as srv:
        # the initial test request is the server's request 1; ours are 2..10 -> 3, 6, 9 fail
        result = asyncio.run(run_benchmark(_config(srv.base_url, num_prompts=9, ready_check_timeout_sec=10)))
    assert (result["completed"], result["failed"]) == (6, 3)
    reasons = {r["error"] for r in result["requests"] if not r["success"]}
    expected = {"http500": "HTTP 500", "cut": "stream ended without [DONE]", "error_event": "error event"}
    assert len(reasons) == 1 and next(iter(reasons)).startswith(expected[failure])
    assert result["total_output_tokens"] == 6 * 9  # failed requests add no tokens


def test_initial_test_request_failing_stops_the_run():
    with FakeServerThread(FakeServerConfig(fail_every=1)) as srv:
        with pytest.raises(RuntimeError, match="HTTP 500"):
            asyncio.run(run_benchmark(_config(srv.base_url, ready_check_timeout_sec=0.5)))


def test_non_streamed_requests_have_ttft_equal_to_latency():
    with FakeServerThread() as srv:
        result = asyncio.run(run_benchmark(_config(srv.base_url, disable_stream=True)))
    assert result["completed"] == 12 and not result["stream"]
    for r in result["requests"]:
        assert r["num_chunks"] == 1 and r["itl_ms"] == [] and r["ttft_ms"] == r["latency_ms"]
        assert r["output_tokens"] == 9


def test_per_request_and_whole_run_timeouts_bound_the_run():
    slow = FakeServerConfig(step_ms=300.0)  # 9 tokens take 2.7 s
    with FakeServerThread(slow) as srv:
        result = asyncio.run(run_benchmark(_config(srv.base_url, num_prompts=2, timeout=0.4)))
        assert result["failed"] == 2 and all("timeout after 0.4s" in r["error"] for r in result["requests"])
        result = asyncio.run(run_benchmark(_config(srv.base_url, num_prompts=3, max_concurrency=1,
                                                   run_timeout=0.5)))
    assert result["failed"] == 3 and result["duration"] < 2.0
    assert all("run timeout" in r["error"] for r in result["requests"])


def test_poisson_rate_spreads_the_sends():
    with FakeServerThread() as srv:
        result = asyncio.run(run_benchmark(_config(srv.base_url, num_prompts=6, request_rate=20.0)))
    offsets = sorted(r["send_offset_s"] for r in result["requests"])
    assert result["completed"] == 6 and offsets[-1] - offsets[0] > 0.05


def test_plot_writes_a_png(tmp_path):
    with FakeServerThread() as srv:
        result = asyncio.run(run_benchmark(_config(srv.base_url, plot=True, result_dir=str(tmp_path),
                                                   result_filename="p.json")))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["plot_path"].endswith("p.png")


def test_stream_parser_times_content_chunks_and_reads_usage():
    p = StreamParser()
    lines = [b": keep-alive\n", b"\n",
             b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n',
             b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n', b"\n",
             b'data:{"choices":[{"delta":{"content":"lo"}}]}\n',
             b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n',
             b"data: [DONE]\n"]
    for i, line in enumerate(lines):
        p.feed(line, float(i))
    assert p.chunk_times == [3.0, 5.0] and p.text == "Hello"
    assert (p.completion_tokens, p.prompt_tokens, p.is_done) == (2, 3, True)
    assert p.failure_reason(200) == ""
    cut = StreamParser()
    cut.feed(b'data: {"choices":[{"text":"a"}]}', 0.0)
    assert cut.failure_reason(200) == "stream ended without [DONE]"
    assert cut.failure_reason(503) == "HTTP 503"
    err = StreamParser()
    err.feed(b"event: error", 0.0)
    err.feed(b'data: {"message": "overloaded"}', 0.0)
    err.feed(b"data: [DONE]", 0.0)
    assert err.failure_reason(200).startswith("error event")



def test_stream_parser_of_a_whole_stream_keeps_every_event():
    text = ('data: {"id":"c","choices":[{"text":"Hi"}]}\n\n: ping\n\n'
            'data: {"choices":[{"text":" there","finish_reason":"length"}]}\n\ndata: [DONE]\n\n')
    p = StreamParser.of(text)
    assert [e if isinstance(e, str) else e["choices"][0]["text"] for e in p.events] == ["Hi", " there", "[DONE]"]
    assert p.text == "Hi there" and p.is_done and p.num_events == 3 and not p.error
    assert StreamParser.of(text.encode().splitlines()).events == p.events
    bad = StreamParser.of('data: {"error": {"message": "boom"}}\n\ndata: {nope\n')
    assert bad.events == [{"error": {"message": "boom"}}] and bad.error.startswith("error event")
    assert StreamParser().events == [] and StreamParser().keep_events is False


def test_every_config_field_is_a_flag_with_its_default():
    args = make_parser().parse_args(["--input-len", "7", "--output-len", "3", "--plot"])
    cfg = BenchConfig.from_any(args)
    assert (cfg.random_input_len, cfg.random_output_len, cfg.plot) == (7, 3, True)
    defaults = BenchConfig.from_any(make_parser().parse_args([]))
    assert defaults == BenchConfig()  # each default declared once, on the field
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--dataset-name", "nope"])


def test_join_url_does_not_double_v1():
    assert join_url("http://h:1/v1", "/v1/completions") == "http://h:1/v1/completions"
    assert join_url("http://h:1/", "/v1/chat/completions") == "http://h:1/v1/chat/completions"
