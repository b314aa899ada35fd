"""loadtests/soak.py without a server: the KV gauge parser, loopback only, the
per-minute sampling and the report."""
import pytest

from loadtests import soak


def test_kv_gauge_lines_with_and_without_the_ray_prefix():
    text = ("# HELP ray_stepstream_kv_cache_usage KV\n"
            'ray_stepstream_kv_cache_usage{Component="core_worker",model="tiny"} 0.25\n'
            "stepstream_kv_cache_usage 0.5\n"
            "ray_stepstream_kv_cache_usage_total 9\n")
    assert [float(v) for v in soak.KV_LINE.findall(text)] == [0.25, 0.5]


@pytest.mark.parametrize("host", ["http://10.0.0.5:8000", "http://example.com"])
def test_only_loopback_hosts(host):
    with pytest.raises(SystemExit):
        soak.check_loopback(host)
    soak.check_loopback("http://127.0.0.1:8000")


def test_minutes_and_report():
    sampler = soak.Sampler(None, None, 5.0)
    rss = {role: 100.0 for role in soak.ROLES}
    sampler.samples = [(5.0, rss, [0.1, 0.3]), (65.0, {**rss, "engine": 110.0}, [0.2]),
                       (125.0, rss, [])]
    first, last = sampler.minute(0), sampler.minute(1)
    assert first["kv_usage_mean"] == pytest.approx(0.2) and first["kv_usage_max"] == 0.3
    assert last["rss_mib"]["engine"] == 110.0
    recorded = {"requests": 10, "failures": 1, "ttft": {"p99_ms": 12.0}, "itl": {"p99_ms": 3.0},
                "per_minute": [{"minute": 0, "ttft": {"p99_ms": 11.0}, "itl": {"p99_ms": 2.0}},
                               {"minute": 1, "ttft": {"p99_ms": 13.0}, "itl": {"p99_ms": 4.0}}]}
    text = soak.report({"minutes": 2, "users": 4, "recorded": recorded, "first_minute": first,
                        "last_minute": last})
    assert "Error rate:                         10.000%" in text
    assert "12.0 / 11.0 / 13.0" in text and "100.0 / 110.0 (+10.0 MiB, +10.0%)" in text
    assert "20.0% / 20.0%" in text  # KV mean, first and last minute
