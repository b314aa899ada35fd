"""The local launcher's split of a CPU machine into engine and ingress replicas
(cluster/launcher/cpu_layout.py) and when it applies."""
from __future__ import annotations

import pytest

from cluster.launcher import cpu_layout
from cluster.launcher.cpu_layout import CpuLayout, layout_for


@pytest.mark.parametrize("cores, replicas, cpus, ingresses", [
    (1, 1, 1, 1), (2, 2, 1, 1), (4, 4, 1, 1),  # one one-thread engine per core
    (5, 2, 2, 1), (8, 2, 3, 1), (16, 3, 5, 1), (32, 7, 4, 2), (64, 15, 4, 4)])
def test_the_layout_of_each_machine_size(cores, replicas, cpus, ingresses):
    layout = cpu_layout.cpu_layout(cores)
    assert layout == CpuLayout(cores, replicas, cpus, ingresses)
    # never more engine threads than the cores left beside one per ingress replica
    assert replicas * cpus <= max(1, cores - (ingresses if cores > 4 else 0))


def test_it_applies_only_where_nothing_chooses_the_replicas():
    assert layout_for({}, cores=2).app_args() == {
        "num_engine_replicas": 2, "engine_num_cpus": 1.0, "num_ingress_replicas": 1}
    assert layout_for({"model": "tiny", "device": "cpu"}, cores=2) is not None
    for chosen in ({"num_engine_replicas": 1}, {"engine_num_cpus": 2}, {"num_threads": 2},
                   {"num_ingress_replicas": 2}, {"engine_num_gpus": 1},
                   {"autoscaling": {"min_replicas": 1, "max_replicas": 2}},
                   {"device": "cuda"}):
        assert layout_for(chosen, cores=2) is None, chosen


@pytest.mark.parametrize("ray_cpus, replicas", [(1, 1), (2, 1), (2.5, 2), (3, 2), (8, 2)])
def test_replicas_fit_in_the_ray_cpus_the_user_fixed(ray_cpus, replicas):
    assert layout_for({}, cores=2, ray_cpus=ray_cpus).num_engine_replicas == replicas


@pytest.mark.parametrize("cores, ranks, ray_cpus, replicas", [
    (2, 2, None, 1), (4, 2, None, 2), (4, 3, None, 1), (8, 2, None, 1), (4, 2, 2.5, 1)])
def test_a_tensor_parallel_replica_takes_a_core_per_rank(cores, ranks, ray_cpus, replicas):
    """Each rank a bundle of engine_num_cpus: a replica no Ray could place would wait forever."""
    layout = layout_for({"tensor_parallel_size": ranks}, cores=cores, ray_cpus=ray_cpus)
    assert layout.num_engine_replicas == replicas
    assert replicas * ranks * layout.engine_num_cpus <= cores


def test_the_ingress_cpus_assumed_are_the_apps_default():
    from cluster.app import AppArgs

    assert AppArgs().ingress_num_cpus == cpu_layout.INGRESS_NUM_CPUS


def test_the_launcher_applies_it_unless_flags_or_the_config_choose(monkeypatch, tmp_path):
    from cluster.serve_local import app_args, parse_args

    monkeypatch.setattr(cpu_layout, "usable_cores", lambda: 2)
    args = app_args(parse_args([]))[0]
    assert (args["num_engine_replicas"], args["engine_num_cpus"]) == (2, 1.0)
    assert app_args(parse_args(["--num-cpus", "2"]))[0]["num_engine_replicas"] == 1
    assert app_args(parse_args(["--engine-num-cpus", "2"]))[0] == {"engine_num_cpus": 2.0}
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n- args:\n    num_engine_replicas: 3\n")
    assert app_args(parse_args(["--config", str(config)]))[0] == {"num_engine_replicas": 3}
