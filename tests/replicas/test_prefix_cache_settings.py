"""enable_prefix_caching from a Serve config to the engine, and the replica gauges."""
import pytest

from replicas import EngineConfig


def test_engine_config_checks_the_flag():
    assert EngineConfig().enable_prefix_caching is True
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="no")


def test_app_args_pass_the_flag_to_the_engine():
    from cluster.app import AppArgs

    assert AppArgs.model_validate({}).engine_config().enable_prefix_caching is True
    args = AppArgs.model_validate({"enable_prefix_caching": False})
    assert args.engine_config().enable_prefix_caching is False


def test_replica_metrics_record_the_prefix_cache_stats():
    from cluster.metrics import ReplicaMetrics

    recorded = {}
    metrics = ReplicaMetrics("tiny")
    for name in ("prefix_cache_hit_rate", "num_cached_blocks"):
        gauge = getattr(metrics, name)
        gauge.set = lambda value, tags=None, name=name: recorded.__setitem__(name, value)
    metrics.record_stats(_replica_stats(prefix_cache_hit_rate=0.75, num_cached_blocks=12))
    assert recorded == {"prefix_cache_hit_rate": 0.75, "num_cached_blocks": 12}


def _replica_stats(**engine_fields):
    import dataclasses

    from cluster.transport.replica_stats import ReplicaCounts, ReplicaStats
    from replicas.engine_stats import EngineStats

    fields = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return ReplicaStats(EngineStats(**{**fields, **engine_fields}), ReplicaCounts(), "r", 0)
