"""The local Ray that consecutive test modules share starts once
(tests/cluster_support.py): asking for it again with the same system config keeps
the running one, with its Serve."""
from __future__ import annotations

import pytest

import cluster_support

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(120)]


def test_asking_again_with_the_same_config_keeps_the_running_ray():
    import ray

    cluster_support.shared_ray()
    starts = cluster_support.shared_ray_starts
    node_id = ray.get_runtime_context().get_node_id()
    cluster_support.shared_ray()
    cluster_support.shared_ray(dict(cluster_support.SHARED_RAY_SYSTEM_CONFIG))
    assert cluster_support.shared_ray_starts == starts
    assert ray.get_runtime_context().get_node_id() == node_id
