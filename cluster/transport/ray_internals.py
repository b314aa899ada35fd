"""Every private Ray or Serve name stepstream uses, in one module.

Each is something Ray offers no public API for (yet). tests/cluster/test_ray_internals.py
pins each one: when a Ray upgrade renames or reshapes it, that test fails with the
Ray version and the name, so an upgrade breaks in the suite, not in production.

Supported Ray: the version pyproject.toml pins (RAY_VERSION); another one runs only
after this module's tests pass on it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

RAY_VERSION = "2.60.0"


def serve_namespace() -> str:
    """The Ray namespace Serve's actors live in."""
    from ray.serve._private.constants import SERVE_NAMESPACE
    return SERVE_NAMESPACE


def serve_controller_name() -> str:
    """The actor name of Serve's controller (in serve_namespace())."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME
    return SERVE_CONTROLLER_NAME


def replica_actor_name(unique_id: str, deployment: str, app_name: str) -> str:
    """The actor name Serve gives a replica of `deployment` in `app_name`."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID  # public; its DeploymentID is not

    return ReplicaID(unique_id, DeploymentID(deployment, app_name)).to_full_id_str()


def suffix_internal_request_id(suffix: str) -> None:
    """Give this task's Serve request context an internal request id of its own
    (the current one + `-suffix`); the public request id stays.

    NOTE: Serve's router tells calls waiting to be routed apart by this internal id,
    which every call made while handling one HTTP request shares."""
    from ray.serve import context

    current = context._get_serve_request_context()
    if current._internal_request_id:  # empty: Serve makes one per call anyway
        context._serve_request_context.set(dataclasses.replace(
            current, _internal_request_id=f"{current._internal_request_id}-{suffix}"))


def fulfill_with_chosen_replica(router: Any, replica: Any, request_metadata: Any = None) -> None:
    """Hand `replica` to the very request it was chosen for, not to the oldest
    pending one (Serve's FIFO policy), by calling RequestRouter's own
    `_fulfill_next_pending_request` past the FIFO mixin's override."""
    from ray.serve.request_router import RequestRouter

    RequestRouter._fulfill_next_pending_request(router, replica, request_metadata)


def gcs_answers(timeout_s: float) -> bool:
    """Whether this driver's Ray GCS answers a small call (the node list) within
    `timeout_s`. True where that call is not as pinned (the caller goes on as if it
    answered). Never starts a Ray, as public calls made after `ray.shutdown` do."""
    from ray._private import worker

    try:
        worker.global_worker.gcs_client.get_all_node_info(timeout=timeout_s)
    except (AttributeError, TypeError):
        return True
    except Exception:  # RpcError: "Timed out while waiting for GCS to become available"
        return False
    return True


async def replica_states(app_name: str, deployment: str) -> dict[str, str]:
    """The state Serve's controller gives each replica of `deployment` ("RUNNING",
    "STARTING", "STOPPING", ...), by replica unique id (the id `pin_replica_id` takes).

    NOTE: `ServeController.get_deployment_details` says it is for tests; its
    `ReplicaDetails` are the public schema the REST API's `serve status` shows."""
    import asyncio

    import ray

    # NOTE: off the event loop: get_actor asks the GCS, and blocks while it does.
    controller = await asyncio.to_thread(ray.get_actor, serve_controller_name(),
                                         namespace=serve_namespace())
    details = await controller.get_deployment_details.remote(app_name, deployment)
    return {r.replica_id: getattr(r.state, "value", r.state) for r in details.replicas}


# Serve's HAProxy paths; it writes each under a folder of the node's id.
_HAPROXY_PATHS = ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                  "RAY_SERVE_HAPROXY_SERVER_STATE_FILE", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH")


def haproxy_node_dirs(node_id: str) -> set[str]:
    """The folders Serve's HAProxy manager writes for the node `node_id` (its config,
    sockets, server state), which Serve leaves behind when it stops."""
    from ray.serve._private import constants

    dirs = {os.path.join(os.path.dirname(getattr(constants, name)), node_id)
            for name in _HAPROXY_PATHS}
    dirs.add(os.path.join(constants.RAY_SERVE_HAPROXY_SERVER_STATE_BASE, node_id))
    return dirs


# For the pin tests: (where, what) of every name above.
PINNED = (
    ("ray.serve._private.constants", "SERVE_NAMESPACE"),
    ("ray.serve._private.constants", "SERVE_CONTROLLER_NAME"),
    ("ray.serve._private.common", "DeploymentID"),
    ("ray.serve.context", "_get_serve_request_context"),
    ("ray.serve.context", "_serve_request_context"),
    ("ray.serve.request_router", "RequestRouter._fulfill_next_pending_request"),
    ("ray._private.worker", "global_worker"),
    ("ray.serve._private.controller", "ServeController.get_deployment_details"),
    *(("ray.serve._private.constants", name) for name in _HAPROXY_PATHS),
    ("ray.serve._private.constants", "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"),
)
