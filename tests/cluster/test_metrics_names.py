"""The metric names a user meets are the ones Ray exports for cluster/metrics.py:
every name the Grafana dashboard (configs/grafana/stepstream.json) queries, and the
table of docs/operations.md, which lists each metric once. The dashboard has the
shape Grafana's file provisioning and import take, on a Prometheus data source
chosen by a variable (Ray's Grafana setup provides one named Prometheus)."""
from __future__ import annotations

import re

from metrics_support import (OPERATIONS, dashboard, dashboard_queries, declared_metrics,
                             exported_names, names_in)


def test_every_name_the_dashboard_queries_is_exported():
    queried = names_in(dashboard_queries(dashboard()))
    assert queried and queried <= exported_names(), sorted(queried - exported_names())


def test_the_dashboard_shows_latency_throughput_and_kv_usage():
    queried = names_in(dashboard_queries(dashboard()))
    for wanted in ("ray_stepstream_time_to_first_token_seconds_bucket",
                   "ray_stepstream_inter_chunk_latency_seconds_bucket",
                   "ray_stepstream_time_per_output_token_seconds_bucket",
                   "ray_stepstream_output_tokens_total", "ray_stepstream_kv_cache_usage"):
        assert wanted in queried, wanted


def test_the_dashboard_loads_on_a_prometheus_datasource_variable():
    board = dashboard()
    assert board["uid"] == "stepstream" and board["title"] and "id" not in board
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert p["datasource"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["datasource"] == "${datasource}" for t in p["targets"])
        assert all('model=~"$model"' in t["expr"] for t in p["targets"]), p["title"]


def test_the_operations_doc_lists_each_metric_once_by_its_exported_name():
    text = OPERATIONS.read_text()
    table = text.split("<!-- metrics-names:", 1)[1].split("<!-- metrics-names: end -->", 1)[0]
    listed = re.findall(r"^\| `(ray_stepstream_[a-z0-9_]+)` \| (\w+) \|", table, re.M)
    kinds = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}
    expected = {(name + ("_total" if kind == "Counter" else ""), kinds[kind])
                for name, kind in declared_metrics().items()}
    assert len(listed) == len(set(listed)) and set(listed) == expected, (
        sorted(set(listed) ^ expected))
