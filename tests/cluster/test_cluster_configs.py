"""Every file in configs/ validates with Ray's own schemas (and our AppArgs)."""
from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SERVE_CONFIGS = ["serve.yaml", "serve-gpu.yaml"]
CLUSTER_CONFIGS = ["cluster.yaml", "cluster-local.yaml"]
KUBE_CONFIGS = ["rayservice.yaml"]  # tests/cluster/test_multinode_configs.py


def _load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def test_every_config_file_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(
        SERVE_CONFIGS + CLUSTER_CONFIGS + KUBE_CONFIGS)


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_validates_with_serve_schema_and_app_args(name):
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import AppArgs, build_app

    schema = ServeDeploySchema.model_validate(_load(name))
    (app,) = schema.applications
    assert app.import_path == "cluster.app:build_app"
    args = AppArgs.model_validate(app.args)  # unknown keys or bad values would raise
    build_app(app.args)  # builds the deployments without starting anything
    assert args.graceful_shutdown_timeout_s >= 600  # streams are long: drain, don't cut


def test_gpu_config_uses_one_gpu_per_replica_and_autoscales_1_to_8():
    from cluster.app import AppArgs

    args = AppArgs.model_validate(_load("serve-gpu.yaml")["applications"][0]["args"])
    from ray.serve.config import AutoscalingConfig

    engine = args.engine_options()
    assert engine["ray_actor_options"]["num_gpus"] == 1
    autoscaling = AutoscalingConfig(**engine["autoscaling_config"])  # Serve's defaults filled in
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 8)
    assert "target_ongoing_requests" in engine["autoscaling_config"]
    assert args.num_ingress_replicas > 1
    assert args.engine_config().device == "cuda" and args.dtype == "bfloat16"


def test_local_config_is_cpu_trained_preset_with_one_replica_each():
    from cluster.app import AppArgs

    args = AppArgs.model_validate(_load("serve.yaml")["applications"][0]["args"])
    # the model a newcomer meets answers: the trained preset, not random weights
    assert args.model == "smollm2-135m" and args.engine_num_gpus == 0
    assert args.num_engine_replicas == 1 and args.num_ingress_replicas == 1
    assert args.engine_config().device == "cpu"


def test_serve_schema_rejects_a_broken_config():
    from ray.serve.schema import ServeDeploySchema

    from pydantic import ValidationError

    broken = _load("serve.yaml")
    broken["applications"][0].pop("import_path")
    with pytest.raises(ValidationError):
        ServeDeploySchema.model_validate(broken)
    broken = _load("serve.yaml")
    broken["proxy_location"] = "Nowhere"
    with pytest.raises(ValidationError):
        ServeDeploySchema.model_validate(broken)


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_config_validates_with_ray_autoscaler_schema(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = _load(name)
    prepared = prepare_config(copy.deepcopy(raw))  # what `ray up` does before validating
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_cloud_cluster_has_cpu_head_and_gpu_workers():
    raw = _load("cluster.yaml")
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    assert "--num-gpus=0" in " ".join(raw["head_start_ray_commands"])
    assert any("g" in t["node_config"]["InstanceType"].split(".")[0] and name != raw["head_node_type"]
               for name, t in types.items())
    assert "node_config" in head
    assert any("[gpu]" in cmd for cmd in raw["setup_commands"])


def test_autoscaler_schema_rejects_a_broken_cluster_config():
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = _load("cluster.yaml")
    broken["available_node_types"]["gpu_worker"]["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_our_request_timeout_is_the_only_one_on_a_stream(name):
    """Serve's proxy timeout counts from arrival (queue wait included) and cuts a
    stream with no error event; ours counts from the first token and ends it with a
    504 error event. So no config sets the proxy's, and every config sets ours, with
    a drain at least as long."""
    from cluster.app import AppArgs

    raw = _load(name)
    assert (raw.get("http_options") or {}).get("request_timeout_s") is None
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    assert args.request_timeout_s is not None
    assert args.graceful_shutdown_timeout_s >= args.request_timeout_s


def _exported(command: str) -> dict[str, str]:
    """`export A=1 B=2` (the line a cluster YAML appends to ~/.bashrc) -> {A: 1, B: 2}."""
    line = command.split("echo '", 1)[1].split("'", 1)[0]
    assert line.startswith("export "), command
    return dict(word.split("=", 1) for word in shlex.split(line)[1:])


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_configs_run_the_haproxy_front_door_on_every_node(name):
    from cluster.launcher.front_door import HAPROXY_BINARY_ENV, HAPROXY_ENV

    exported = {}
    for command in _load(name)["initialization_commands"]:
        exported.update(_exported(command))
    assert {k: exported.get(k) for k in HAPROXY_ENV} == HAPROXY_ENV
    # started as stepstream-haproxy (splice() off), found where `ray start` runs
    assert exported[HAPROXY_BINARY_ENV] == "$(command -v stepstream-haproxy)"


def test_local_config_drains_like_the_launcher():
    from cluster.launcher.front_door import LOCAL_DRAIN_ENV

    env = _load("serve.yaml")["applications"][0]["runtime_env"]["env_vars"]
    assert env == LOCAL_DRAIN_ENV


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_configs_bind_the_dashboard_to_loopback(name):
    """The dashboard's REST API deploys code: reach it through `ray dashboard` (SSH)."""
    (start,) = [c for c in _load(name)["head_start_ray_commands"] if "ray start --head" in c]
    assert "--dashboard-host=127.0.0.1" in start
    assert "0.0.0.0" not in yaml.safe_dump(_load(name))


def test_both_deployments_take_the_shutdown_wait_loop_and_timeout():
    """Serve's own deployment options, from the app's args: a drain's limit is ours,
    not Serve's 20 s default (tests/cluster/test_reliability_drain.py drains streams)."""
    from cluster.app import AppArgs, build_app

    args = AppArgs.model_validate({"graceful_shutdown_wait_loop_s": 0.5,
                                   "graceful_shutdown_timeout_s": 120.0})
    for options in (args.engine_options(), args.ingress_options()):
        assert options["graceful_shutdown_wait_loop_s"] == 0.5
        assert options["graceful_shutdown_timeout_s"] == 120.0
    build_app({"graceful_shutdown_wait_loop_s": 0.5})  # Serve takes it for both deployments
    assert AppArgs().graceful_shutdown_wait_loop_s == 2.0  # Serve's default
    with pytest.raises(ValueError):
        AppArgs.model_validate({"graceful_shutdown_wait_loop_s": 0})
