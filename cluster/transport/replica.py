"""EngineReplica: a Ray Serve deployment that owns one AsyncEngine.

Token ids in, token deltas out, over two kinds of calls:

- `generate(request)`, one per request, routed by Serve (power of two choices,
  `max_ongoing_requests`, queue bounds, autoscaling and drain all count real
  requests): it validates and admits the request (refusals raise before anything
  is streamed), streams one item, this replica's id, and stays open until the
  request has ended. Cancelling it (client gone, stop string, timeout) aborts
  the request in the engine and frees its KV blocks.
- `channel(owner)`, one per (ingress replica, engine replica) pair, pinned to
  this replica by `cluster.transport.routing.PinnedRouter`: a greeting, then one message
  per engine step carrying every delta of that ingress's requests
  (`cluster/transport/outbox.py`; the messages are declared in `cluster/transport/wire.py`). It ends after `channel_idle_close_s`
  without requests, so an idle channel never holds a draining replica; the
  ingress reopens it on demand.

An ingress that dies leaves requests nobody reads: the replica pings the owner
of each channel and aborts the requests of an owner that is dead, or that left
them without a channel for `ingress_detach_timeout_s`.

The engine (and torch) is imported inside the constructor, so this module loads
on CPU-only nodes.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from ray import serve

from cluster.errors import ReplicaOverloaded, ReplicaRejected, ReplicaUnavailable
from cluster.transport.faults import FaultInjector, fault_injection_enabled
from cluster.transport.outbox import OutboxRegistry, OutboxSink, StepOutbox
from cluster.transport.owner_liveness import find_dead_owners, is_live_ingress_replica
from cluster.transport.replica_stats import ReplicaCounts, ReplicaStats
from cluster.transport.wire import GREETING, EngineRequest, decode_request, encode_step
from replicas.sampling.compile_lanes import LanesBusy  # torch-free

logger = logging.getLogger("ray.serve")


# NOTE: deployment options only in `AppArgs.engine_options` (cluster/app.py), which sets them.
@serve.deployment(name="EngineReplica")
class EngineReplica:
    def __init__(self, engine_config: dict, channel_idle_close_s: float = 5.0,
                 ingress_detach_timeout_s: float = 30.0, owner_check_interval_s: float = 2.0,
                 stats_interval_s: float = 1.0, stall_timeout_s: float | None = None,
                 max_admitted_requests: int | None = None,
                 enable_fault_injection: bool = False,
                 engine_factory: Callable[[Any], Any] | None = None) -> None:
        from replicas.config import EngineConfig

        config = EngineConfig(**engine_config)
        if config.tensor_parallel_size > 1:
            # NOTE: the other ranks as Ray actors in this replica's placement group
            from cluster.transport.rank_actors import RayRanks
            from replicas.tensor_parallel.rank_processes import set_rank_starter
            set_rank_starter(RayRanks)
        if engine_factory is None:
            from replicas.async_engine import AsyncEngine as engine_factory
        self._engine = engine_factory(config)
        if stall_timeout_s is not None and hasattr(self._engine, "stall_timeout_s"):
            self._engine.stall_timeout_s = stall_timeout_s
        self._faults = (FaultInjector(self._engine)
                        if fault_injection_enabled(enable_fault_injection) else None)
        self._channel_idle_close_s = channel_idle_close_s
        # NOTE: past this many open admissions, refuse (429) rather than take the slots
        # Serve keeps for channels and unary calls (cluster/app.py, _UNARY_HEADROOM).
        self._max_admitted = max_admitted_requests
        self._num_admitted = 0
        self._owner_check_interval_s = owner_check_interval_s
        self._outboxes = OutboxRegistry(ingress_detach_timeout_s)
        self._sweeper: asyncio.Task | None = None
        self._model = config.model
        self._counts = ReplicaCounts()
        self._replica_id = _replica_id()
        self._app_name = _app_name()
        # NOTE: an owner id is unique to one ingress replica's life, so one check each.
        self._verified_owners: dict[str, Any] = {}  # owner id -> its ingress's actor id
        self._metrics = None
        self._stop_stats = threading.Event()
        try:
            from cluster.metrics import ReplicaMetrics
            self._metrics = ReplicaMetrics(self._model)
        except Exception:  # metrics are best effort (e.g. no Ray metrics agent)
            logger.warning("replica metrics disabled", exc_info=True)
        self._stats_thread = threading.Thread(
            target=self._stats_loop, args=(stats_interval_s,), name="replica-stats",
            daemon=True)
        self._stats_thread.start()

    # ---- per request: admission -------------------------------------------------

    async def generate(self, request: bytes, pin_replica_id: str | None = None):
        """Admit an encoded `EngineRequest` and stream this replica's id; stay
        open until the request ended. Bad input raises ReplicaRejected, a full
        engine queue (or too many admissions) ReplicaOverloaded and a dead engine
        ReplicaUnavailable, before anything is streamed. Deltas travel on the
        owner's channel. `pin_replica_id` is read by the router (tests)."""
        try:
            req = decode_request(request)
        except ValueError as e:  # NOTE: decoding runs SamplingParams' own checks
            self._counts.num_requests_refused += 1
            raise ReplicaRejected(str(e)) from None
        self._refuse_past_the_admission_bound()  # NOTE: before a compile it would waste
        try:
            grammar = await self._engine.compile_grammar(req.sampling_params)
        except ValueError as e:  # a schema or grammar that does not compile in time
            self._counts.num_requests_refused += 1
            raise ReplicaRejected(str(e)) from None
        except LanesBusy as e:  # every compile worker is taken: busy, not wrong
            self._counts.num_requests_refused += 1
            raise ReplicaOverloaded(f"structured outputs are busy: {e}", 1.0) from None
        self._refuse_past_the_admission_bound()  # again: others came while it compiled
        self._start_sweeper()
        outbox = self._outboxes.get(req.owner)
        done = self._admit(req, outbox, grammar)
        self._counts.num_requests_admitted += 1
        self._num_admitted += 1
        finished = None  # True: its finished delta went out; False: orphaned
        try:
            yield self._replica_id
            finished = await done
        finally:
            self._num_admitted -= 1
            self._engine.release(req.request_id)
            if finished is None:  # the call was cancelled (its caller left) or failed
                self._engine.abort(req.request_id)
                outbox.discard(req.request_id)
                self._counts.num_requests_cancelled += 1
            elif finished:
                self._counts.num_requests_finished += 1
            # NOTE: False: `_orphan` aborted it and counted it orphaned, not finished

    def _refuse_past_the_admission_bound(self) -> None:
        if self._max_admitted is not None and self._num_admitted >= self._max_admitted:
            self._counts.num_requests_refused += 1
            raise ReplicaOverloaded(f"{self._num_admitted} requests are admitted on this "
                                    f"replica, its bound", 1.0)

    def _admit(self, req: EngineRequest, outbox: StepOutbox, grammar) -> asyncio.Future:
        from replicas.async_engine import EngineDeadError, EngineOverloaded

        done = outbox.add(req.request_id)
        try:
            self._engine.submit(req.request_id, req.prompt_token_ids, req.sampling_params,
                                OutboxSink(outbox, req.request_id), grammar)
        except BaseException as e:
            outbox.discard(req.request_id)
            self._counts.num_requests_refused += 1
            if isinstance(e, EngineOverloaded):
                raise ReplicaOverloaded(str(e), float(e.retry_after_s)) from None
            if isinstance(e, EngineDeadError):  # the ingress must not import torch
                raise ReplicaUnavailable(str(e), self._replica_id) from None
            if isinstance(e, (ValueError, TypeError)):
                raise ReplicaRejected(str(e)) from None
            raise
        return done

    # ---- per ingress: the per-step channel ---------------------------------------

    async def channel(self, owner: str, owner_handle: Any = None,
                      pin_replica_id: str | None = None):
        """Stream step messages for ingress `owner` (cluster/transport/wire.py): the
        greeting, then one message per engine step with news for it.
        `owner_handle` (the ingress's Ray actor) lets this replica notice its death;
        `pin_replica_id` is read by the router, not here. Under Serve, an owner that
        is not a live ingress replica of this app is refused (PermissionError)."""
        await self._check_owner(owner, owner_handle)
        self._start_sweeper()
        outbox = self._outboxes.get(owner)
        if owner_handle is not None:
            self._outboxes.owner_handles[owner] = owner_handle
        outbox.channel_epoch += 1
        epoch = outbox.channel_epoch
        outbox.interrupt()  # an older channel of this ingress ends
        outbox.detached_since = None
        self._counts.num_channels_opened += 1
        counts = self._counts
        try:
            yield GREETING
            while not outbox.is_closed and outbox.channel_epoch == epoch:
                if outbox.num_live_requests == 0:
                    try:
                        await asyncio.wait_for(outbox.wait(), self._channel_idle_close_s)
                    except asyncio.TimeoutError:
                        if outbox.num_live_requests == 0:
                            return
                else:
                    await outbox.wait()
                if outbox.is_closed or outbox.channel_epoch != epoch:
                    return
                deltas = outbox.take_deltas()
                if deltas:
                    counts.num_step_messages_sent += 1
                    counts.num_deltas_sent += len(deltas)
                    yield encode_step(deltas)
        finally:
            if outbox.channel_epoch == epoch:
                outbox.detached_since = time.monotonic()

    async def _check_owner(self, owner: str, owner_handle: Any) -> None:
        if self._app_name is None:  # not under Serve (unit tests): no other ingress
            return
        actor_id = getattr(owner_handle, "_actor_id", None)
        if actor_id is None or self._verified_owners.get(owner) != actor_id:
            ok = await asyncio.to_thread(is_live_ingress_replica, owner, owner_handle,
                                         self._app_name)
            if not ok:
                logger.warning("refused a channel for %r: not a live ingress replica of app "
                               "%r", owner, self._app_name)
                raise PermissionError(f"channel refused: {owner!r} is not a live ingress "
                                      f"replica of app {self._app_name!r}")
            self._verified_owners[owner] = actor_id

    # ---- orphaned requests -------------------------------------------------------

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            # NOTE: a fresh context: a task started inside a request's context would
            # be cancelled with that request.
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_loop(), context=contextvars.Context())

    async def _sweep_loop(self) -> None:
        while len(self._outboxes):
            await asyncio.sleep(self._owner_check_interval_s)
            try:
                await self._sweep()
            except Exception:  # never let the sweeper die of one bad round
                logger.warning("outbox sweep failed", exc_info=True)

    async def _sweep(self) -> None:
        now = time.monotonic()
        for outbox in self._outboxes.stale(now):
            self._orphan(outbox, f"no channel for {self._outboxes.detach_timeout_s:g} s")
        dead = await find_dead_owners(self._outboxes.owner_handles,
                                      timeout_s=self._owner_check_interval_s * 5)
        for owner in dead:
            for outbox in self._outboxes:
                if outbox.owner == owner:
                    self._orphan(outbox, "its ingress replica died")

    def _orphan(self, outbox: StepOutbox, why: str) -> None:
        request_ids = self._outboxes.close(outbox)
        for request_id in request_ids:
            self._engine.abort(request_id)
        if request_ids:
            self._counts.num_requests_orphaned += len(request_ids)
            logger.warning("aborted %d requests of ingress replica %s: %s", len(request_ids),
                           outbox.owner.rpartition("-")[0], why)

    # ---- unary methods ----------------------------------------------------------

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    def model_info(self) -> dict:
        # NOTE: what the engine resolved (dtype auto, quantization auto, attention backend
        # auto), for the launcher's console and the model card; a test's fake engine has
        # no core.
        core = getattr(self._engine, "core", None)
        resolved = {} if core is None else {
            "dtype": core.config.dtype, "device": core.config.device,
            "attention_backend": core.runner.backend.name,
            "quantization": core.config.quantization, "weights": core.runner.weight_kinds,
            "weight_bytes": core.runner.weight_bytes}
        return {"model": self._model, "model_dir": self._engine.model_dir,
                "max_model_len": self._engine.max_model_len,
                "vocab_size": self._engine.vocab_size,
                "eos_token_ids": list(self._engine.eos_token_ids), **resolved}

    def stats(self, pin_replica_id: str | None = None) -> dict:
        """`ReplicaStats.as_dict()`, for callers through a handle. `pin_replica_id`:
        ask this very replica (read by the router)."""
        return self._snapshot().as_dict()

    def check_health(self) -> None:
        """Serve's health check: raises when the engine thread died or stalled.

        A stalled engine cannot end its own streams, and Serve stops an unhealthy
        replica gracefully (it waits for in-flight requests): so the streams are
        failed here, and end with an error event instead of hanging."""
        try:
            self._engine.check_health()
        except Exception:
            fail_stalled = getattr(self._engine, "fail_stalled", None)
            if fail_stalled is not None:
                fail_stalled()
            raise

    def health(self, pin_replica_id: str | None = None) -> bool:
        """The same check, callable through a handle (the ingress's /health asks each
        replica: `pin_replica_id`, read by the router)."""
        self.check_health()
        return True

    def inject_fault(self, kind: str, step_delay_s: float = 0.05,
                     pin_replica_id: str | None = None) -> str:
        """Test-only (cluster/transport/faults.py): 'raise', 'hang', 'slow' or 'clear'; returns
        this replica's id. Refused unless fault injection was enabled for this app.
        `pin_replica_id`: the replica to break (read by the router)."""
        if self._faults is None:
            raise PermissionError("fault injection is disabled on this replica")
        self._faults.inject(kind, step_delay_s)
        return self._replica_id

    def __del__(self) -> None:
        self._stop_stats.set()
        faults = getattr(self, "_faults", None)
        if faults is not None:
            faults.release()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()

    # ---- internals --------------------------------------------------------------

    def _snapshot(self) -> ReplicaStats:
        return ReplicaStats(self._engine.stats(), dataclasses.replace(self._counts),
                            self._replica_id, len(self._outboxes))

    def _stats_loop(self, interval_s: float) -> None:
        while not self._stop_stats.wait(interval_s):
            if self._metrics is None:
                return
            try:
                self._metrics.record_stats(self._snapshot())
            except Exception:  # never let a metrics hiccup kill the thread
                logger.debug("replica stats failed", exc_info=True)


def _app_name() -> str | None:
    try:
        return serve.get_replica_context().app_name
    except Exception:  # not inside a Serve replica
        return None


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "local"
