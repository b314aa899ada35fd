"""The application builder configs name as `import_path: cluster.app:build_app`.

`args` (the `args:` of a Serve config, or a dict from `serve_local`) are validated
by `AppArgs` (unknown keys are errors, so a typo in a config fails at deploy
time), mapped onto `replicas.config.EngineConfig` (which checks its own ranges;
`AppArgs` takes its engine fields from it through `cluster/engine_args.py`, so
every engine field is a config key of the same name) and onto the deployment
options of the two deployments. Torch-free.
"""
from __future__ import annotations

import logging
import math
from typing import Literal, Any, Callable

from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.api.access import API_KEY_ENV
from cluster.engine_args import EngineArgs, engine_config_dict
from cluster.api.ingress import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, Ingress
from cluster.transport.replica import EngineReplica
from cluster.transport.routing import ROUTER_PATH
from replicas.checkpoints.presets import served_name

# Unary calls (stats, model_info, health) and one channel per ingress replica
# count against a replica's max_ongoing_requests too. Admitted requests may hold
# the rest, never these: an admitted request holds its slot until a channel took
# its last delta, so a channel queued behind admissions would stall them all.
_UNARY_HEADROOM = 16


class AppArgs(EngineArgs):
    """The `args:` of a Serve config. The engine fields come from `EngineArgs`
    (derived from `EngineConfig`: same names, defaults and range checks; `device`
    defaults to "cuda" when engine_num_gpus > 0, else "cpu"); the rest is ours."""

    model_config = ConfigDict(extra="forbid")

    # Each description is the field's line in cluster/README.md's table
    # (cluster/args_table.py writes it).
    served_model_name: str | None = Field(
        None, description="the `model` clients must send (404 otherwise); null: `model`")
    # The per-step channel between engine and ingress replicas.
    channel_idle_close_s: float = Field(
        5.0, gt=0.0, description="a per-step channel with no requests closes after this long "
        "(so it never holds a draining replica) and reopens on demand")
    ingress_detach_timeout_s: float = Field(
        30.0, gt=0.0, description="requests whose ingress left them with no channel this long "
        "are aborted (a dead ingress is also noticed by pinging it every few seconds)")
    prefix_routing_tokens: int = Field(
        256, ge=0, description="with several engine replicas, prompts whose first whole KV "
        "blocks (up to this many tokens) agree go to the replica the first of them went to, "
        "unless it runs more than prefix_routing_imbalance requests above the least loaded; "
        "other prompts go to the least loaded replica; 0: by load only")
    prefix_routing_imbalance: int = Field(
        8, ge=0, description="see prefix_routing_tokens")
    # Deployments.
    num_engine_replicas: int = Field(1, ge=1, description="engine replicas (or autoscaling)")
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK", description="with tensor_parallel_size > 1: how an engine replica's ranks "
        "(one bundle each) are placed; STRICT_PACK keeps them on one node")
    engine_num_cpus: float = Field(1.0, ge=0.0, description="CPUs per engine replica (per rank "
                                   "with tensor_parallel_size > 1)")
    engine_num_gpus: float = Field(
        0.0, ge=0.0, description="GPUs per engine replica; > 0 makes the default device cuda")
    autoscaling: dict[str, Any] | None = Field(
        None, description="a Serve `autoscaling_config` for the engine deployment, instead of "
        "num_engine_replicas")
    engine_resources: dict[str, float] | None = Field(
        None, description="custom Ray resources each engine replica needs (`ray start "
        "--resources`): only nodes that have them run it, e.g. `{engine_node: 1}`; GPUs "
        "choose their nodes without it")
    ingress_resources: dict[str, float] | None = Field(
        None, description="the same for ingress replicas, e.g. `{ingress_node: 1}` given to "
        "the head node only")
    num_ingress_replicas: int = Field(1, ge=1, description="ingress (HTTP) replicas")
    ingress_num_cpus: float = Field(0.5, ge=0.0, description="CPUs per ingress replica")
    ingress_max_ongoing_requests: int = Field(
        1000, ge=1, description="requests one ingress replica serves at once")
    ingress_max_pending_requests: int | None = Field(
        None, ge=-1, description="requests one ingress replica holds that have no first token "
        "yet (being validated, queued, prefilled); past it new ones get 429 + Retry-After "
        "before their body is read, so a burst never starves the streams already running; "
        "null: what the engine replicas admit at once (max_num_seqs + max_waiting_requests, "
        "or 2 x max_num_seqs, or engine_max_ongoing_requests less the kept slots; times "
        "num_engine_replicas or autoscaling's max_replicas) over num_ingress_replicas; -1: "
        "unbounded")
    engine_max_ongoing_requests: int | None = Field(
        None, ge=1, description=f"requests Serve lets through to one engine replica; null: "
        f"max_num_seqs + max_waiting_requests (or 2 x max_num_seqs) + the slots kept from "
        f"admissions ({_UNARY_HEADROOM} for unary calls, one per ingress replica for its "
        f"channel), so the engine, not Serve's router, decides about overload; past "
        f"admissions' share a replica answers 429 + Retry-After")
    # Bounds on what Serve queues in front of a busy deployment: memory stays
    # bounded under any burst.
    ingress_max_queued_requests: int = Field(
        1000, ge=-1, description="what Serve queues in front of the busy ingress deployment; "
        "past it Serve answers 503 (-1: unbounded)")
    engine_max_queued_requests: int = Field(
        1000, ge=-1, description="the same in front of the engine deployment")
    health_check_period_s: float = Field(
        10.0, gt=0.0, description="Serve's health checks of engine replicas (one that keeps "
        "failing them is replaced)")
    health_check_timeout_s: float = Field(30.0, gt=0.0, description="see health_check_period_s")
    stall_timeout_s: float = Field(
        60.0, gt=0.0, description="the engine is unhealthy after this long without progress "
        "while work is queued; its streams end with an error event and Serve replaces it")
    # Streams are long: replicas being replaced drain before being killed.
    graceful_shutdown_timeout_s: float = Field(
        600.0, ge=0.0, description="how long replicas being replaced or scaled down let "
        "streams finish (>= request_timeout_s, checked)")
    graceful_shutdown_wait_loop_s: float = Field(
        2.0, gt=0.0, description="how often a replica being stopped looks for requests "
        "still running (Serve waits this long at least before it stops an idle one)")
    request_timeout_s: float | None = Field(
        None, gt=0.0, description="a request still generating this long after its first token "
        "ends with 504 (an SSE error event once streaming) and is aborted; null: no limit")
    queue_timeout_s: float | None = Field(
        300.0, gt=0.0, description="a request with no first token this long after it was "
        "validated and tokenized (queued in Serve or the engine, then its prefill) gets 503 + "
        "Retry-After and is aborted; null: no limit")
    enable_fault_injection: bool = Field(
        False, description="test-only: lets `EngineReplica.inject_fault` break the engine "
        "(cluster/transport/faults.py)")
    # HTTP. NOTE: repr=False: the key never reaches a log.
    api_key: str | None = Field(
        None, repr=False, description=f"when set (or the env var {API_KEY_ENV}), every route "
        "but /health needs `Authorization: Bearer <key>`")
    api_key_sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$", description="the key's SHA-256 (hex) instead of "
        "the key: no secret in the config")
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413")
    body_timeout_s: float = Field(
        DEFAULT_BODY_TIMEOUT_S, gt=0.0, description="a request body not all in within this "
        "long gets 408; it is read before the request takes a pending slot, so a client "
        "that trickles its body costs only itself")
    # Checked against the running Serve's HTTP host (cluster/api/access.py).
    allow_unauthenticated: bool = Field(
        False, description="without a key the app serves on a loopback host only, unless "
        "this is true")

    # The key's SHA-256, resolved once, when these args are validated (where the app
    # is built): from the config, else from this process's environment.
    _key_sha256: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_access(self) -> "AppArgs":
        from cluster.api.access import check_access, key_sha256_hex, serve_http_host

        self._key_sha256 = key_sha256_hex(self.api_key, self.api_key_sha256)
        warning = check_access(serve_http_host(), self._key_sha256 is not None,
                               self.allow_unauthenticated)
        if warning:
            logging.getLogger("ray.serve").warning(warning)
        return self

    @model_validator(mode="after")
    def _check(self) -> "AppArgs":
        self.engine_config()  # raises ValueError naming the bad field
        if self.autoscaling is not None and self.num_engine_replicas != 1:
            raise ValueError("set either autoscaling or num_engine_replicas, not both")
        reserved = self.engine_reserved_slots
        if (self.engine_max_ongoing_requests is not None
                and self.engine_max_ongoing_requests <= reserved):
            raise ValueError(
                f"engine_max_ongoing_requests must be > {reserved} ({_UNARY_HEADROOM} slots "
                f"for unary calls and one channel per ingress replica are kept from "
                f"admissions), got {self.engine_max_ongoing_requests}")
        if self.ingress_max_pending_requests == 0:
            raise ValueError("ingress_max_pending_requests must be >= 1, or -1 (unbounded), "
                             "or null (derived from the engine's bounds); 0 would refuse "
                             "every request")
        if self.api_key and self.api_key_sha256:
            raise ValueError("set either api_key or api_key_sha256, not both")
        if (self.request_timeout_s is not None
                and self.graceful_shutdown_timeout_s < self.request_timeout_s):
            raise ValueError("graceful_shutdown_timeout_s must be >= request_timeout_s, or a "
                             "redeploy cuts streams that are still allowed to run")
        return self

    @property
    def name_served(self) -> str:
        return self.served_model_name or served_name(self.model)

    def api_key_digest(self) -> str | None:
        """The key's SHA-256 (hex), resolved when these args were validated, where
        the app is built: every ingress replica gets it, whatever its own node's
        environment holds."""
        return self._key_sha256

    def engine_config_dict(self) -> dict:
        values = engine_config_dict(self, self.engine_num_gpus)
        if values["num_threads"] is None and values["device"] == "cpu":
            # NOTE: torch's threads follow the replica's CPU allotment (at least one),
            # whatever OMP_NUM_THREADS the node's environment holds.
            values["num_threads"] = max(1, int(self.engine_num_cpus))
        return values

    def engine_config(self):
        from replicas.config import EngineConfig

        return EngineConfig(**self.engine_config_dict())

    @property
    def engine_reserved_slots(self) -> int:
        """Slots of an engine replica kept from admissions: unary calls, one channel
        per ingress replica."""
        return _UNARY_HEADROOM + self.num_ingress_replicas

    @property
    def engine_max_ongoing(self) -> int:
        # The engine queues what it cannot run yet (and refuses past its bounds with
        # 429), so Serve must let that many requests through to the replica.
        return self.engine_max_ongoing_requests or (
            self.max_num_seqs + (self.max_waiting_requests or self.max_num_seqs)
            + self.engine_reserved_slots)

    @property
    def engine_max_admitted(self) -> int:
        """Admitted requests an engine replica holds at most: its slots less the
        reserved ones (past it: 429 + Retry-After)."""
        return self.engine_max_ongoing - self.engine_reserved_slots

    @property
    def max_engine_replicas(self) -> int:
        if self.autoscaling is not None:
            return int(self.autoscaling.get("max_replicas", 1))
        return self.num_engine_replicas

    @property
    def max_engine_requests_at_once(self) -> int:
        """Engine requests all engine replicas admit at once, at their most: a
        request needing more (prompts x n) cannot hold them all admitted together,
        so the ingress answers it 400 (cluster/api/ingress.py)."""
        return self.engine_max_admitted * self.max_engine_replicas

    @property
    def ingress_max_pending(self) -> int | None:
        """Requests without a first token one ingress replica holds at most (None:
        unbounded); see cluster/api/pending_gate.py."""
        if self.ingress_max_pending_requests == -1:
            return None
        if self.ingress_max_pending_requests is not None:
            return self.ingress_max_pending_requests
        return max(1, math.ceil(self.max_engine_requests_at_once / self.num_ingress_replicas))

    def engine_options(self) -> dict:
        max_ongoing = self.engine_max_ongoing
        actor = {"num_cpus": self.engine_num_cpus}
        if self.engine_num_gpus:
            actor["num_gpus"] = self.engine_num_gpus
        if self.engine_resources:
            actor["resources"] = dict(self.engine_resources)
        options = {"ray_actor_options": actor, "max_ongoing_requests": max_ongoing,
                   **self.rank_placement(actor),
                   "request_router_config": RequestRouterConfig(
                       request_router_class=ROUTER_PATH,
                       request_router_kwargs=self.router_kwargs()),
                   "max_queued_requests": self.engine_max_queued_requests,
                   "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
                   "graceful_shutdown_wait_loop_s": self.graceful_shutdown_wait_loop_s,
                   "health_check_period_s": self.health_check_period_s,
                   "health_check_timeout_s": self.health_check_timeout_s}
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling
        else:
            options["num_replicas"] = self.num_engine_replicas
        return options

    def rank_placement(self, actor: dict) -> dict:
        """With tensor_parallel_size N > 1, each engine replica asks Serve for a
        placement group of N bundles, one per rank (the replica itself, rank 0, in the
        first), each with the replica's CPUs and GPUs: PACK, so a replica's ranks share
        a node where they fit and spill to others where not. A replica whose group
        cannot be placed stays pending in Serve (its status says so)."""
        if self.tensor_parallel_size <= 1:
            return {}
        bundle = {"CPU": actor["num_cpus"]}
        if actor.get("num_gpus"):
            bundle["GPU"] = actor["num_gpus"]
        bundle.update(actor.get("resources") or {})
        return {"placement_group_bundles": [dict(bundle) for _ in range(self.tensor_parallel_size)],
                "placement_group_strategy": self.placement_group_strategy}

    def router_kwargs(self) -> dict:
        """`cluster.transport.routing.PinnedRouter.initialize_state`'s arguments."""
        tokens = self.prefix_routing_tokens if self.enable_prefix_caching else 0
        return {"prefix_tokens": tokens, "block_size": self.block_size,
                "imbalance_threshold": self.prefix_routing_imbalance}

    def ingress_options(self) -> dict:
        actor = {"num_cpus": self.ingress_num_cpus}
        if self.ingress_resources:
            actor["resources"] = dict(self.ingress_resources)
        return {"num_replicas": self.num_ingress_replicas, "ray_actor_options": actor,
                "max_ongoing_requests": self.ingress_max_ongoing_requests,
                "max_queued_requests": self.ingress_max_queued_requests,
                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
                "graceful_shutdown_wait_loop_s": self.graceful_shutdown_wait_loop_s}


def build_app(args: dict | None = None) -> Application:
    """The Serve builder: `serve run cluster.app:build_app model=tiny` or a config's
    `import_path`."""
    return make_app(AppArgs.model_validate(args or {}))


def make_app(args: AppArgs, engine_factory: Callable | None = None) -> Application:
    """The app for validated args; `engine_factory` swaps the engine (tests)."""
    engine = EngineReplica.options(**args.engine_options()).bind(
        args.engine_config_dict(), channel_idle_close_s=args.channel_idle_close_s,
        ingress_detach_timeout_s=args.ingress_detach_timeout_s,
        stall_timeout_s=args.stall_timeout_s, max_admitted_requests=args.engine_max_admitted,
        enable_fault_injection=args.enable_fault_injection, engine_factory=engine_factory)
    return Ingress.options(**args.ingress_options()).bind(
        engine, served_model_name=args.name_served, model=args.model,
        api_key_sha256=args.api_key_digest(),
        allow_unauthenticated=args.allow_unauthenticated,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
        request_timeout_s=args.request_timeout_s,
        queue_timeout_s=args.queue_timeout_s, max_pending_requests=args.ingress_max_pending,
        max_engine_requests=args.max_engine_requests_at_once)
