"""The multi-node configs, without a cluster:

- configs/rayservice.yaml validates against KubeRay's own RayService CRD of the
  version it names (vendored in configs/schemas/), as strictly as `kubectl apply`
  (unknown fields are errors); its serveConfigV2 is configs/serve-gpu.yaml with the
  ingress placed on the head, and builds the app; Ray's token and the app's API key
  come from one Kubernetes Secret;
- the serve config of docs/multinode.md builds the app with the placement the
  multi-node tests use.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def _rayservice() -> dict:
    return yaml.safe_load((CONFIGS / "rayservice.yaml").read_text())


def _kuberay_version() -> str:
    (version,) = re.findall(r"^# KubeRay: (v\d+\.\d+\.\d+)$",
                            (CONFIGS / "rayservice.yaml").read_text(), re.M)
    return version


def _strict(schema):
    """The CRD's schema with unknown fields refused, as kubectl's strict field
    validation does: every object that lists its properties allows no others
    (unless it says it keeps unknown fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validator(api_version: str) -> jsonschema.Validator:
    crd_path = CONFIGS / "schemas" / f"kuberay-{_kuberay_version()}" / "ray.io_rayservices.yaml"
    # NOTE: the C loader: the CRD is 1 MB of YAML.
    crd = yaml.load(crd_path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == "RayService"
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def validator():
    return _validator(_rayservice()["apiVersion"])


def _serve_config(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def test_the_rayservice_validates_against_kuberays_crd(validator):
    service = _rayservice()
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    errors = sorted(validator.iter_errors(service), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


@pytest.mark.parametrize("path, value", [
    (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParam"), {}),  # a typo
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplicas"), "eight"),
    (("spec", "rayClusterConfig", "authOptions", "mode"), "password"),
    (("spec", "serveConfigV2"), {"applications": []}),  # must be a YAML string
])
def test_the_crd_refuses_a_broken_rayservice(validator, path, value):
    broken = _rayservice()
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert not validator.is_valid(broken)


def test_serve_config_v2_is_the_gpu_config_with_the_ingress_on_the_head():
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import AppArgs, build_app

    service = _rayservice()
    config = _serve_config(service)
    (app,) = ServeDeploySchema.model_validate(config).applications
    args = AppArgs.model_validate(app.args)
    build_app(app.args)  # the deployments build (nothing starts)
    gpu = yaml.safe_load((CONFIGS / "serve-gpu.yaml").read_text())
    placed = copy.deepcopy(config)
    assert placed["applications"][0]["args"].pop("ingress_resources") == {"ingress_node": 1}
    assert placed == gpu, "configs/rayservice.yaml's serveConfigV2 left serve-gpu.yaml"
    # The placement the cluster offers: ingress_node on the head only, enough of it
    # for every ingress replica; GPUs (so engine replicas) on the workers only.
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert float(head["resources"]["ingress_node"]) >= args.num_ingress_replicas
    assert head["rayStartParams"]["num-gpus"] == "0"
    for group in cluster["workerGroupSpecs"]:
        assert "ingress_node" not in group.get("resources", {})
        (container,) = group["template"]["spec"]["containers"]
        assert float(container["resources"]["limits"]["nvidia.com/gpu"]) >= args.engine_num_gpus
        assert group["maxReplicas"] >= args.autoscaling["max_replicas"]
    assert cluster["enableInTreeAutoscaling"] is True


def _containers(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_ray_token_and_api_key_come_from_the_secret_on_every_pod():
    from cluster.api.access import API_KEY_ENV
    from cluster.launcher.front_door import HAPROXY_BINARY_ENV, HAPROXY_ENV

    service = _rayservice()
    auth = service["spec"]["rayClusterConfig"]["authOptions"]
    assert auth["mode"] == "token"
    secret = auth["secretName"]  # KubeRay reads its `auth_token` key
    args = _serve_config(service)["applications"][0]["args"]
    assert "api_key" not in args and "api_key_sha256" not in args
    for container in _containers(service):
        env = {e["name"]: e for e in container["env"]}
        assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": secret,
                                                                  "key": "api_key"}
        assert {k: env[k]["value"] for k in HAPROXY_ENV} == HAPROXY_ENV
        # Serve starts HAProxy as stepstream-haproxy (splice() off): pip's bin of the image
        assert env[HAPROXY_BINARY_ENV]["value"] == "/home/ray/anaconda3/bin/stepstream-haproxy"
        assert container["image"] == _containers(service)[0]["image"]
    assert "rayproject/ray:" + service["spec"]["rayClusterConfig"]["rayVersion"] in (
        (CONFIGS / "rayservice.yaml").read_text())


def test_the_ray_version_is_the_one_the_project_pins():
    pinned = re.search(r'"ray\[serve\]==([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert _rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == pinned.group(1)


def _doc_serve_config() -> dict:
    """The serve config docs/multinode.md deploys on the hand-started cluster."""
    text = (REPO / "docs" / "multinode.md").read_text()
    (block,) = re.findall(r"```yaml\n(# serve-multinode\.yaml\n.*?)```", text, re.S)
    return yaml.safe_load(block)


def test_the_docs_serve_config_places_replicas_as_the_tests_do():
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import AppArgs, build_app
    from multinode_support import ENGINE_RESOURCE, INGRESS_RESOURCE, PLACEMENT_ARGS

    config = _doc_serve_config()
    (app,) = ServeDeploySchema.model_validate(config).applications
    assert config["proxy_location"] == "HeadOnly"
    args = AppArgs.model_validate(app.args)
    build_app(app.args)
    assert {k: app.args[k] for k in PLACEMENT_ARGS} == PLACEMENT_ARGS
    assert args.engine_options()["ray_actor_options"]["resources"] == {ENGINE_RESOURCE: 1}
    assert args.ingress_options()["ray_actor_options"]["resources"] == {INGRESS_RESOURCE: 1}
