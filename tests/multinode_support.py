"""Helpers for the multi-node tests: a real multi-node Ray on this machine
(`ray.cluster_utils.Cluster`: a raylet, object store and worker processes per node),
laid out as a serving cluster is, and where Serve put each replica.

Not a test module. The layout (docs/multinode.md starts the same one by hand with
`ray start`):
- a head node: Serve's controller and HTTP proxy (`proxy_location: HeadOnly`), and
  the ingress replicas, which the app places there with `ingress_resources`;
- engine nodes, each with one `engine_node` resource: the app places one engine
  replica per node with `engine_resources`, as `num_gpus` picks GPU nodes on a real
  cluster.
One cluster per test module, always shut down.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from cluster_support import _start_serve_on_a_free_port, free_port, wait_healthy

ENGINE_RESOURCE = "engine_node"
INGRESS_RESOURCE = "ingress_node"
# Placement as an app config says it (AppArgs): one engine replica per engine node,
# ingress replicas on the head only.
PLACEMENT_ARGS = {"engine_resources": {ENGINE_RESOURCE: 1},
                  "ingress_resources": {INGRESS_RESOURCE: 1}}


@dataclass
class LocalCluster:
    nodes: object  # ray.cluster_utils.Cluster
    head_node_id: str
    engine_nodes: list = field(default_factory=list)  # ray._private.node.Node, alive
    base: str = ""  # Serve's HTTP address

    def engine_node_ids(self) -> list[str]:
        return [n.node_id for n in self.engine_nodes]

    def remove(self, node_id: str) -> None:
        """Kill an engine node at once, as a lost machine: its raylet, object store
        and every worker process on it (SIGKILL, no graceful shutdown)."""
        (node,) = [n for n in self.engine_nodes if n.node_id == node_id]
        self.nodes.remove_node(node, allow_graceful=False)
        self.engine_nodes.remove(node)


@contextlib.contextmanager
def local_cluster(num_engine_nodes: int = 3, head_cpus: int = 2, engine_node_cpus: int = 2):
    """Start the head and `num_engine_nodes` engine nodes, connect, start Serve on
    the head; yield a `LocalCluster`. Always shuts Serve, the driver and every node
    down."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # NOTE: the head may take many ingress replicas; each engine node one engine.
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "resources": {INGRESS_RESOURCE: 100},
        "include_dashboard": False})
    try:
        engine_nodes = [nodes.add_node(num_cpus=engine_node_cpus,
                                       resources={ENGINE_RESOURCE: 1})
                        for _ in range(num_engine_nodes)]
        ray.init(address=nodes.address, log_to_driver=False, configure_logging=False)
        try:
            port = _start_serve_on_a_free_port(free_port(), proxy_location="HeadOnly")
            yield LocalCluster(nodes, nodes.head_node.node_id, engine_nodes,
                               f"http://127.0.0.1:{port}")
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
    finally:
        nodes.shutdown()


def deploy(app_args: dict, base: str, timeout_s: float = 240.0) -> None:
    from ray import serve

    from cluster.app import AppArgs, make_app

    serve.run(make_app(AppArgs.model_validate(app_args)), name="stepstream",
              route_prefix="/", blocking=False)
    wait_healthy(base, timeout_s)


def replica_nodes(deployment: str, app: str = "stepstream") -> dict[str, str]:
    """{replica id: node id} of the deployment's live replicas."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {a["Name"][len(prefix):]: a["Address"]["NodeID"]
            for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and a.get("Name", "").startswith(prefix)}
