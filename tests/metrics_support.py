"""Helpers for the metric-name tests: the names Ray exports for our metrics, and the
names the Grafana dashboard and docs/operations.md use.

Not a test module."""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "configs" / "grafana" / "stepstream.json"
OPERATIONS = REPO / "docs" / "operations.md"
_NAME = re.compile(r"\bray_stepstream_[a-z0-9_]+")


def declared_metrics() -> dict[str, str]:
    """`ray_`-prefixed name -> kind (Counter, Gauge, Histogram) of every metric that
    cluster/metrics.py declares."""
    from ray.util import metrics

    from cluster.metrics import IngressMetrics, ReplicaMetrics

    out = {}
    for group in (IngressMetrics("m"), ReplicaMetrics("m")):
        for m in vars(group).values():
            if isinstance(m, metrics.Metric):
                out["ray_" + m.info["name"]] = type(m).__name__
    return out


def exported_names() -> set[str]:
    """Every name a Prometheus scrape shows for them: Ray adds `_total` to counters
    and `_bucket`, `_sum`, `_count` to histograms."""
    suffixes = {"Counter": ("_total",), "Gauge": ("",),
                "Histogram": ("_bucket", "_sum", "_count")}
    return {name + s for name, kind in declared_metrics().items() for s in suffixes[kind]}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(board: dict) -> list[str]:
    """Every PromQL text of the dashboard: panels' targets and templating queries."""
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        query = var.get("query")
        queries.append(query["query"] if isinstance(query, dict) else query or "")
    return queries


def names_in(texts) -> set[str]:
    return {name for text in texts for name in _NAME.findall(text)}


def scrape() -> dict[str, float]:
    """One Prometheus scrape of the local Ray's metrics: each series name with its
    values summed over labels (one series per worker); {} when it cannot be read."""
    import httpx
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals
