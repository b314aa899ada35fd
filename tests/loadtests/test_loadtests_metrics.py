"""Metric definitions on scripted timelines, and the result block's exact layout."""
import numpy as np
import pytest

from loadtests.serving.client import RequestRecord
from loadtests.serving.datasets import SampleRequest
from loadtests.serving.metrics import (BenchmarkSummary, Distribution, RequestTimeline, format_result_block,
                               itls_s, latency_s, summarize, tpot_s, ttft_s)

SEED_BLOCK = """\
============ Serving Benchmark Result ============
Successful requests:                     1000
Benchmark duration (s):                  23.56
Total input tokens:                      215196
Total generated tokens:                  197521
Request throughput (req/s):              42.44
Output token throughput (tok/s):         8382.12
Total Token throughput (tok/s):          17514.31
---------------Time to First Token----------------
Mean TTFT (ms):                          7615.81
Median TTFT (ms):                        7257.60
P99 TTFT (ms):                           16401.42
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):                          26.01
Median TPOT (ms):                        22.20
P99 TPOT (ms):                           126.35
---------------Inter-token Latency----------------
Mean ITL (ms):                           166.52
Median ITL (ms):                         169.27
P99 ITL (ms):                            505.28
=================================================="""


def _dist(mean, median, p99):
    return Distribution(mean_ms=mean, median_ms=median, std_ms=0.0, percentiles_ms={99.0: p99}, count=1)


def test_result_block_matches_the_seed_layout_exactly():
    summary = BenchmarkSummary(
        num_completed=1000, num_failed=0, duration_s=197521 / 8382.12,
        total_input_tokens=215196, total_output_tokens=197521, total_chunks=197521,
        ttft=_dist(7615.81, 7257.60, 16401.42), tpot=_dist(26.01, 22.20, 126.35),
        itl=_dist(166.52, 169.27, 505.28), e2el=_dist(0, 0, 0))
    assert format_result_block(summary) == SEED_BLOCK


def test_result_block_rules_are_50_wide_and_values_start_at_column_42():
    block = format_result_block(summarize([RequestTimeline(0.0, [0.1, 0.2], 2, prompt_len=3)], 1.0))
    for line in block.splitlines():
        if line.endswith(("=", "-")):
            assert len(line) == 50
        else:
            assert line[40] == " " and line[41] != " ", line


def test_failed_requests_get_their_own_line_only_when_there_are_some():
    ok = RequestTimeline(0.0, [0.1], 1, prompt_len=1)
    bad = RequestTimeline(0.0, [], 0, success=False, error="HTTP 500")
    assert "Failed requests:" not in format_result_block(summarize([ok], 1.0))
    assert "Failed requests:                         1" in format_result_block(summarize([ok, bad], 1.0))


def test_scripted_timeline_gives_known_ttft_tpot_itl():
    # send at 10.0; chunks at 10.5 (2 tokens), 10.7 (3 tokens), 11.3 (5 tokens): 10 tokens
    t = RequestTimeline(send_time=10.0, chunk_times=[10.5, 10.7, 11.3], num_output_tokens=10)
    assert ttft_s(t) == pytest.approx(0.5)
    assert latency_s(t) == pytest.approx(1.3)
    assert tpot_s(t) == pytest.approx(0.8 / 9)  # (latency - TTFT) / (tokens - 1), per token
    assert itls_s(t) == pytest.approx([0.2, 0.6])  # per chunk, not per token


def test_tpot_skips_requests_with_fewer_than_two_tokens():
    one = RequestTimeline(send_time=0.0, chunk_times=[0.25], num_output_tokens=1)
    two = RequestTimeline(send_time=0.0, chunk_times=[0.25, 0.75], num_output_tokens=2)
    assert tpot_s(one) is None
    s = summarize([one, two], duration_s=1.0)
    assert s.tpot.count == 1 and s.tpot.mean_ms == pytest.approx(500.0)
    assert s.ttft.mean_ms == pytest.approx(250.0)


def test_summary_pools_itls_and_uses_numpy_percentiles():
    timelines = [
        RequestTimeline(0.0, [0.1, 0.2, 0.4], 3, prompt_len=5),
        RequestTimeline(1.0, [1.3, 1.4, 1.5, 2.5], 8, prompt_len=7),
        RequestTimeline(2.0, [], 0, prompt_len=9, success=False, error="cut"),
    ]
    s = summarize(timelines, duration_s=4.0, percentiles=(50.0, 99.0))
    itls = [0.1, 0.2, 0.1, 0.1, 1.0]
    assert s.itl.count == 5
    assert s.itl.mean_ms == pytest.approx(np.mean(itls) * 1000)
    assert s.itl.percentiles_ms[99.0] == pytest.approx(np.percentile(itls, 99) * 1000)
    assert s.itl.median_ms == pytest.approx(100.0)
    assert (s.num_completed, s.num_failed) == (2, 1)
    assert (s.total_input_tokens, s.total_output_tokens, s.total_chunks) == (12, 11, 7)
    assert s.output_throughput == pytest.approx(11 / 4.0)
    assert s.total_token_throughput == pytest.approx(23 / 4.0)
    assert s.mean_tokens_per_chunk == pytest.approx(11 / 7)
    tpots = [(0.4 - 0.1) / 2, (1.5 - 0.3) / 7]
    assert s.tpot.mean_ms == pytest.approx(np.mean(tpots) * 1000)
    d = s.to_dict()
    assert d["p99_itl_ms"] == pytest.approx(s.itl.percentiles_ms[99.0])
    assert d["p50_tpot_ms"] == pytest.approx(np.percentile(tpots, 50) * 1000)


def test_empty_run_reports_zeros_not_nan():
    s = summarize([], duration_s=1.0)
    assert s.ttft.mean_ms == 0.0 and s.itl.percentiles_ms[99.0] == 0.0
    assert "nan" not in format_result_block(s)


class _WordTokenizer:
    def encode(self, text):
        return [len(w) for w in text.split()]

    def decode(self, ids):
        return " ".join("x" * i for i in ids)


def test_output_tokens_prefer_usage_then_tokenizer_then_chunks():
    def record(usage):
        rec = RequestRecord(0, SampleRequest("p", 1, 4), RequestTimeline(0.0, [0.1, 0.2], 0))
        rec.text, rec.usage_completion_tokens = "a bb ccc", usage
        return rec
    rec = record(7)
    rec.resolve_output_tokens(_WordTokenizer())
    assert (rec.timeline.num_output_tokens, rec.output_tokens_source) == (7, "usage")
    rec = record(None)
    rec.resolve_output_tokens(_WordTokenizer())
    assert (rec.timeline.num_output_tokens, rec.output_tokens_source) == (3, "tokenizer")
    rec = record(None)
    rec.resolve_output_tokens(None)
    assert (rec.timeline.num_output_tokens, rec.output_tokens_source) == (2, "chunks")
