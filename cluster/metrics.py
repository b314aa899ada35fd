"""Ray metrics of the ingress and the replicas (exported for Prometheus by Ray).

Created inside the deployments' constructors (metrics need a Ray worker). Names
are declared `stepstream_*`; Ray's exporter adds `ray_` and Prometheus' suffixes
(`_total` for counters, `_bucket`/`_sum`/`_count` for histograms), so a scrape
shows `ray_stepstream_output_tokens_total` (docs/operations.md lists them all).

NOTE: a Ray metric record costs more than formatting an SSE event, so the hot
path records a sample of the per-event values (the ITL: `SampledHistogram`) and
everything else once per request (tokens per event is a per-request mean) or once
per second (replica counters, from the stats thread).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from ray.util import metrics

if TYPE_CHECKING:
    from cluster.transport.replica_stats import ReplicaStats

_LATENCY_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
              30.0, 60.0]
_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


# NOTE: 200 records a second give each 15 s scrape interval 3,000 values for its
# quantiles, at under 0.1% of a core (a record costs about 2 us).
ITL_RECORDS_PER_S = 200


class SampledHistogram:
    """A histogram fed by a per-event hot path: every value while fewer than
    `max_per_s` come a second, else every k-th, with k from the rate of the last
    window of at least a second.

    Why: one Ray record costs about as much as formatting and writing the event it
    measures (a few percent of the ingress's CPU at one record per event per stream).
    Every k-th value (not the first `max_per_s` of each second) spreads the sample
    over each second; the first second of a burst is recorded in full (k is learnt
    from it), and each ingress replica has its own k. `_count` is the sample's
    size, not the number of events."""

    __slots__ = ("_histogram", "_max_per_s", "_every", "_since_record", "_window_start",
                 "_window_values")

    def __init__(self, histogram, max_per_s: int = ITL_RECORDS_PER_S,
                 now: float = 0.0) -> None:
        if max_per_s < 1:
            raise ValueError(f"max_per_s must be >= 1, got {max_per_s}")
        self._histogram = histogram
        self._max_per_s = max_per_s
        self._every = 1
        self._since_record = 0
        self._window_start = now
        self._window_values = 0

    @property
    def every(self) -> int:
        """1 + the values skipped between two records, now."""
        return self._every

    def observe(self, value: float, now: float) -> None:
        """`now`: time.monotonic() of the value (the caller has it already)."""
        self._window_values += 1
        elapsed = now - self._window_start
        if elapsed >= 1.0:
            self._every = max(1, math.ceil(self._window_values / (elapsed * self._max_per_s)))
            self._window_start, self._window_values = now, 0
        self._since_record += 1
        if self._since_record >= self._every:
            self._since_record = 0
            self._histogram.observe(value)


class IngressMetrics:
    def __init__(self, model: str) -> None:
        tags = {"model": model}
        self.requests = metrics.Counter(
            "stepstream_requests", "HTTP requests by route and status code",
            tag_keys=("model", "route", "status"))
        self.requests.set_default_tags(tags)
        self.ttft_s = metrics.Histogram(
            "stepstream_time_to_first_token_seconds", "Time to the first streamed token",
            boundaries=_LATENCY_S, tag_keys=("model",))
        self.tpot_s = metrics.Histogram(
            "stepstream_time_per_output_token_seconds",
            "(latency - TTFT) / (output tokens - 1) per streamed choice",
            boundaries=_LATENCY_S, tag_keys=("model",))
        self.itl_s = metrics.Histogram(
            "stepstream_inter_chunk_latency_seconds", "Gap between streamed chunks of one choice",
            boundaries=_LATENCY_S, tag_keys=("model",))
        self.tokens_per_event = metrics.Histogram(
            "stepstream_tokens_per_event", "Mean output tokens per SSE event, per streamed choice",
            boundaries=_TOKENS, tag_keys=("model",))
        self.output_tokens = metrics.Counter(
            "stepstream_output_tokens", "Output tokens sent to clients", tag_keys=("model",))
        self.prompt_tokens = metrics.Counter(
            "stepstream_prompt_tokens", "Prompt tokens received", tag_keys=("model",))
        for m in (self.ttft_s, self.tpot_s, self.itl_s, self.tokens_per_event,
                  self.output_tokens, self.prompt_tokens):
            m.set_default_tags(tags)
        self.itl_sample = SampledHistogram(self.itl_s, now=time.monotonic())

    def count_request(self, route: str, status: int) -> None:
        self.requests.inc(1, {"route": route, "status": str(status)})

    def count_tokens(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Once per request that reached the engine, streamed or not."""
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_output_tokens:
            self.output_tokens.inc(num_output_tokens)


class ReplicaMetrics:
    def __init__(self, model: str) -> None:
        tags = {"model": model}
        self.num_running = metrics.Gauge(
            "stepstream_num_requests_running", "Requests in the engine's running batch",
            tag_keys=("model",))
        self.num_waiting = metrics.Gauge(
            "stepstream_num_requests_waiting", "Requests waiting for the engine",
            tag_keys=("model",))
        self.kv_cache_usage = metrics.Gauge(
            "stepstream_kv_cache_usage", "Fraction of KV cache blocks in use (0..1)",
            tag_keys=("model",))
        self.prefix_cache_hit_rate = metrics.Gauge(
            "stepstream_prefix_cache_hit_rate",
            "Admitted prompt tokens found in the prefix cache, since start (0..1)",
            tag_keys=("model",))
        self.num_cached_blocks = metrics.Gauge(
            "stepstream_prefix_cache_blocks", "KV blocks in the prefix cache (held or evictable)",
            tag_keys=("model",))
        self.prefix_cache_hit_rate.set_default_tags(tags)
        self.num_cached_blocks.set_default_tags(tags)
        self.step_messages = metrics.Counter(
            "stepstream_replica_step_messages",
            "Per-step channel messages sent to ingress replicas", tag_keys=("model",))
        self.deltas_sent = metrics.Counter(
            "stepstream_replica_deltas_sent",
            "Request deltas carried by per-step channel messages", tag_keys=("model",))
        self.num_channels = metrics.Gauge(
            "stepstream_replica_channels", "Ingress replicas with an outbox on this replica",
            tag_keys=("model",))
        for m in (self.num_running, self.num_waiting, self.kv_cache_usage, self.step_messages,
                  self.deltas_sent, self.num_channels):
            m.set_default_tags(tags)
        self._last_step_messages = 0
        self._last_deltas = 0

    def record_stats(self, stats: ReplicaStats) -> None:
        engine, counts = stats.engine, stats.counts
        self.num_running.set(engine.num_running)
        self.num_waiting.set(engine.num_waiting)
        self.kv_cache_usage.set(engine.kv_cache_usage)
        self.prefix_cache_hit_rate.set(engine.prefix_cache_hit_rate)
        self.num_cached_blocks.set(engine.num_cached_blocks)
        self.num_channels.set(stats.num_outboxes)
        # NOTE: counters advance by what was sent since the last record, not per
        # message: a Ray metric record costs more than sending a step message.
        if counts.num_step_messages_sent > self._last_step_messages:
            self.step_messages.inc(counts.num_step_messages_sent - self._last_step_messages)
            self._last_step_messages = counts.num_step_messages_sent
        if counts.num_deltas_sent > self._last_deltas:
            self.deltas_sent.inc(counts.num_deltas_sent - self._last_deltas)
            self._last_deltas = counts.num_deltas_sent
