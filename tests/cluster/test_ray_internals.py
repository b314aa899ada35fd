"""The private Ray and Serve names of cluster/transport/ray_internals.py, pinned: each test
fails naming the Ray version and the name when an upgrade changes it."""
from __future__ import annotations

import asyncio
import contextvars
import importlib
import inspect

import pytest
import ray

from cluster.transport import ray_internals


def _where(module: str, name: str) -> str:
    return (f"Ray {ray.__version__}: {module}.{name} changed; stepstream was built on Ray "
            f"{ray_internals.RAY_VERSION}: update cluster/transport/ray_internals.py for this Ray")


def _resolve(module: str, name: str):
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("module, name", ray_internals.PINNED,
                         ids=[f"{m}.{n}" for m, n in ray_internals.PINNED])
def test_every_pinned_name_still_exists(module, name):
    try:
        _resolve(module, name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{_where(module, name)} ({error})")


def test_the_pinned_ray_is_the_one_installed():
    import tomllib
    from pathlib import Path

    pins = tomllib.loads(Path(__file__).parents[2].joinpath("pyproject.toml").read_text())
    assert f"ray[serve]=={ray_internals.RAY_VERSION}" in pins["project"]["dependencies"], (
        "pyproject.toml pins another Ray than cluster/transport/ray_internals.py was checked on")
    assert ray.__version__ == ray_internals.RAY_VERSION, _where("ray", "__version__")


def test_serve_names_have_the_values_serve_uses():
    where = _where("ray.serve._private.constants", "SERVE_NAMESPACE / SERVE_CONTROLLER_NAME")
    assert ray_internals.serve_namespace() == "serve", where
    assert ray_internals.serve_controller_name() == "SERVE_CONTROLLER_ACTOR", where


def test_replica_actor_names_have_serves_format():
    name = ray_internals.replica_actor_name("abc123", "Ingress", "stepstream")
    assert name == "SERVE_REPLICA::stepstream#Ingress#abc123", _where(
        "ray.serve._private.common", "DeploymentID / ReplicaID.to_full_id_str")


def test_the_internal_request_id_gets_its_suffix_in_this_task_only():
    from ray.serve import context

    where = _where("ray.serve.context", "_serve_request_context / _internal_request_id")

    async def main():
        context._serve_request_context.set(context._RequestContext(
            request_id="public-1", _internal_request_id="internal-1"))

        async def choice(i: int) -> tuple[str, str]:
            ray_internals.suffix_internal_request_id(str(i))
            current = context._get_serve_request_context()
            return current.request_id, current._internal_request_id

        results = await asyncio.gather(choice(0), choice(1))
        assert results == [("public-1", "internal-1-0"), ("public-1", "internal-1-1")], where
        assert context._get_serve_request_context()._internal_request_id == "internal-1", where

    contextvars.copy_context().run(asyncio.run, main())


def test_the_router_keeps_its_fulfil_hook():
    from ray.serve.request_router import FIFOMixin, RequestRouter

    where = _where("ray.serve.request_router", "RequestRouter._fulfill_next_pending_request")
    params = list(inspect.signature(RequestRouter._fulfill_next_pending_request).parameters)
    assert params == ["self", "replica", "request_metadata"], where
    # NOTE: the FIFO mixin overrides it: the very override routing.py must bypass
    assert FIFOMixin._fulfill_next_pending_request is not RequestRouter._fulfill_next_pending_request, where


def test_the_controller_lists_each_replica_with_its_id_and_state():
    """What `replica_states` reads of `get_deployment_details` (the ingress's /health)."""
    from ray.serve._private.common import ReplicaState
    from ray.serve._private.controller import ServeController
    from ray.serve.schema import DeploymentDetails, ReplicaDetails

    where = _where("ray.serve._private.controller",
                   "ServeController.get_deployment_details / ReplicaDetails")
    params = list(inspect.signature(ServeController.get_deployment_details).parameters)
    assert params == ["self", "app_name", "deployment_name"], where
    fields = getattr(ReplicaDetails, "model_fields", None) or ReplicaDetails.__fields__
    assert {"replica_id", "state"} <= set(fields), where
    assert "replicas" in (getattr(DeploymentDetails, "model_fields", None)
                          or DeploymentDetails.__fields__), where
    assert {"RUNNING", "STARTING", "STOPPING", "STOPPED"} <= {s.value for s in ReplicaState}, where
