"""EngineReplica: a Ray Serve deployment that owns one AsyncEngine.

Token ids in, token deltas out. The engine (and torch) is imported inside the
constructor, so this module loads on CPU-only nodes.

Chunking. Ray Serve pays a fixed cost per streamed chunk (in this replica, the
ingress and the proxy), and a replica's yields never block: Serve queues every
chunk and sends them one by one. So a stream sends, after its first token (at
once), one chunk per `get` from the engine's per-request collector, which merges
everything the engine produced since the last one; and a chunk budget per
replica, `max_chunks_per_s`, shared by its active streams, spaces each stream's
chunks: at 1 stream every token is its own chunk, at 200 streams chunks grow
instead of the CPU the hops take from the engine. `min_chunk_interval_ms` is a
floor per stream. Chunks are plain lists (cluster/wire.py), which Ray packs
with msgpack alone. `stream_merge=False` sends one chunk per token (the baseline
the benchmark compares against).

Cancellation. When the ingress cancels the stream (client gone, stop string),
Serve cancels this method's task: CancelledError arrives at an `await` or at the
`yield`, and the `finally` aborts the request in the engine, which frees its KV
blocks at the next step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from ray import serve

from cluster.errors import ReplicaOverloaded, ReplicaRejected, ReplicaUnavailable
from cluster.faults import FaultInjector, fault_injection_enabled
from cluster.wire import encode_delta
from deltas.types import TokenDelta

logger = logging.getLogger("ray.serve")


def split_per_token(delta: TokenDelta) -> list[TokenDelta]:
    """One delta per token (the no-merge baseline); finish info on the last one."""
    n = len(delta.token_ids)
    if n <= 1:
        return [delta]
    base = delta.num_output_tokens - n
    out = []
    for i, tid in enumerate(delta.token_ids):
        last = i == n - 1
        out.append(TokenDelta(
            delta.request_id, [tid],
            logprobs=None if delta.logprobs is None else delta.logprobs[i:i + 1],
            top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[i:i + 1],
            finish_reason=delta.finish_reason if last else None,
            stop_reason=delta.stop_reason if last else None,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_output_tokens=base + i + 1,
            error=delta.error if last else None))
    return out


@serve.deployment(name="EngineReplica", max_ongoing_requests=512,
                  health_check_period_s=10, health_check_timeout_s=30)
class EngineReplica:
    def __init__(self, engine_config: dict, stream_merge: bool = True,
                 min_chunk_interval_ms: float = 0.0, max_chunks_per_s: float = 0.0,
                 stats_interval_s: float = 1.0, stall_timeout_s: float | None = None,
                 enable_fault_injection: bool = False,
                 engine_factory: Callable[[Any], Any] | None = None) -> None:
        from replicas.config import EngineConfig

        config = EngineConfig(**engine_config)
        if engine_factory is None:
            from replicas.async_engine import AsyncEngine as engine_factory
        self._engine = engine_factory(config)
        if stall_timeout_s is not None and hasattr(self._engine, "stall_timeout_s"):
            self._engine.stall_timeout_s = stall_timeout_s
        self._faults = (FaultInjector(self._engine)
                        if fault_injection_enabled(enable_fault_injection) else None)
        self._stream_merge = stream_merge
        self._min_chunk_interval_s = max(0.0, min_chunk_interval_ms) / 1000.0
        self._max_chunks_per_s = max(0.0, max_chunks_per_s)
        self._num_active_streams = 0
        self._model = config.model
        self._counts = {"num_streams_refused": 0, "num_streams_started": 0,
                        "num_streams_finished": 0,
                        "num_streams_cancelled": 0, "num_chunks_sent": 0,
                        "num_tokens_sent": 0}
        self._replica_id = _replica_id()
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

    # ---- Serve streaming method -------------------------------------------------

    async def generate(self, request: dict):
        """Stream TokenDeltas (as `cluster.wire` lists) for {request_id,
        prompt_token_ids, sampling_params, [min_chunk_interval_ms]}. Bad input raises
        ReplicaRejected and a full engine queue ReplicaOverloaded, both before the
        first chunk."""
        request_id, stream = self._open_stream(request)
        interval_ms = request.get("min_chunk_interval_ms")
        min_interval_s = self._min_chunk_interval_s if interval_ms is None else interval_ms / 1000.0
        try:
            delta = await self._first_delta(stream)
        except (ReplicaRejected, ReplicaOverloaded, ReplicaUnavailable):
            self._counts["num_streams_refused"] += 1
            await _close_quietly(stream)
            raise
        except BaseException:  # cancelled before the first token: closing aborts it
            await _close_quietly(stream)
            self._engine.abort(request_id)
            raise
        self._counts["num_streams_started"] += 1
        self._num_active_streams += 1
        finished = False
        num_chunks = num_tokens = 0
        try:
            while True:
                finished = delta.finish_reason is not None
                if self._stream_merge:
                    sent_at = time.monotonic()
                    num_chunks += 1
                    num_tokens += len(delta.token_ids)
                    yield encode_delta(delta)
                    if finished:
                        break
                    # Meanwhile the engine's collector merges what the engine makes.
                    wait_s = sent_at + self._chunk_interval_s(min_interval_s) - time.monotonic()
                    if wait_s > 0:
                        await asyncio.sleep(wait_s)
                else:
                    for one in split_per_token(delta):
                        num_chunks += 1
                        num_tokens += 1 if one.token_ids else 0
                        yield encode_delta(one)
                    if finished:
                        break
                try:
                    delta = await stream.__anext__()
                except StopAsyncIteration:  # the engine ended the stream without a finish
                    finished = True
                    break
        finally:
            self._num_active_streams -= 1
            self._count_stream(finished, num_chunks, num_tokens)
            if not finished:
                self._engine.abort(request_id)
            await _close_quietly(stream)

    def _chunk_interval_s(self, min_interval_s: float) -> float:
        """The least time between two chunks of one stream: the request's floor, and
        this replica's chunk budget shared by its active streams (so at high load
        chunks grow instead of the CPU time spent per chunk)."""
        if self._max_chunks_per_s <= 0:
            return min_interval_s
        return max(min_interval_s, self._num_active_streams / self._max_chunks_per_s)

    # ---- unary methods ----------------------------------------------------------

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    def model_info(self) -> dict:
        return {"model": self._model, "model_dir": self._engine.model_dir,
                "max_model_len": self._engine.max_model_len,
                "vocab_size": self._engine.vocab_size,
                "eos_token_ids": list(self._engine.eos_token_ids)}

    def stats(self) -> dict:
        return {**self._engine.stats(), **self._counts, "replica_id": self._replica_id}

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

    def health(self) -> bool:
        """The same check, callable through a handle (the ingress's /health)."""
        self.check_health()
        return True

    def inject_fault(self, kind: str, step_delay_s: float = 0.05) -> str:
        """Test-only (cluster/faults.py): 'raise', 'hang', 'slow' or 'clear'; returns
        this replica's id. Refused unless fault injection was enabled for this app."""
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

    def _open_stream(self, request: dict):
        from replicas.config import SamplingParams

        request_id = request["request_id"]
        params = request.get("sampling_params") or {}
        try:
            if isinstance(params, dict):
                params = SamplingParams(**params)
            stream = self._engine.generate(request_id, list(request["prompt_token_ids"]),
                                           params)
        except (ValueError, TypeError) as e:
            raise ReplicaRejected(str(e)) from None
        return request_id, stream

    async def _first_delta(self, stream) -> TokenDelta:
        from replicas.async_engine import EngineDeadError, EngineOverloaded

        try:
            return await stream.__anext__()
        except EngineOverloaded as e:
            raise ReplicaOverloaded(str(e), float(getattr(e, "retry_after_s", 1.0))) from None
        except EngineDeadError as e:  # a cluster exception: the ingress must not import torch
            raise ReplicaUnavailable(str(e)) from None
        except ValueError as e:
            raise ReplicaRejected(str(e)) from None

    def _count_stream(self, finished: bool, num_chunks: int, num_tokens: int) -> None:
        counts = self._counts
        counts["num_streams_finished" if finished else "num_streams_cancelled"] += 1
        counts["num_chunks_sent"] += num_chunks
        counts["num_tokens_sent"] += num_tokens
        # NOTE: once per stream, not per chunk: a Ray metric record costs more than
        # everything else this replica does for a chunk.
        if self._metrics is not None and num_chunks:
            self._metrics.chunks.inc(num_chunks)
            self._metrics.tokens_per_chunk.observe(num_tokens / num_chunks)

    def _stats_loop(self, interval_s: float) -> None:
        while not self._stop_stats.wait(interval_s):
            if self._metrics is None:
                return
            try:
                self._metrics.record_stats(self._engine.stats())
            except Exception:  # never let a metrics hiccup kill the thread
                logger.debug("replica stats failed", exc_info=True)


async def _close_quietly(stream) -> None:
    try:
        await stream.aclose()
    except Exception:
        pass


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "local"
