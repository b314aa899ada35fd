"""The engine loop body: schedule -> run N steps -> hand each step to output
processing. Driven by the offline `Engine` and the threaded `AsyncEngine`.

Request validation lives here, so both front ends reject bad input the same way
and a bad request never reaches the scheduler.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import torch

from deltas.types import FinishReason
from replicas.block_manager import BlockManager
from replicas.config import EngineConfig, SamplingParams
from replicas.dtype_choice import resolve_dtype
from replicas.model_runner import ModelRunner
from replicas.output_processor import OutputProcessor
from replicas.presets import ensure_model_dir
from deltas.sink import DeltaSink
from replicas.request import Request, RequestStatus
from replicas.sampler import probe_rows
from replicas.scheduler import Scheduler, SchedulerOutput
from replicas.step_output import StepOutput
from replicas.step_isolation import (bisect, control_request, is_engine_fault,
                                     unfinished_seqs)

logger = logging.getLogger("stepstream")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.bind_thread()
        torch.manual_seed(config.seed)
        self.model_dir = ensure_model_dir(config.model)
        dtype, _ = resolve_dtype(config.dtype, config.device, self.model_dir)
        self.config = config = dataclasses.replace(config, dtype=dtype)
        from replicas.models.model_config import ModelConfig
        mc = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.runner = ModelRunner(config, self.model_dir, self.max_model_len)
        self.model_config = self.runner.model_config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(mc.eos_token_ids)
        num_blocks = self.runner.num_blocks
        max_seq_blocks = -(-(self.max_model_len + config.num_scheduler_steps) // config.block_size)
        if num_blocks < max_seq_blocks:
            raise ValueError(f"KV budget of {num_blocks} blocks cannot hold one sequence of "
                             f"max_model_len {self.max_model_len} (needs {max_seq_blocks}): "
                             f"raise num_kv_blocks/kv_cache_gib or lower max_model_len")
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          num_watermark_blocks=min(num_blocks // 100, max_seq_blocks),
                                          enable_caching=config.enable_prefix_caching)
        self.output = OutputProcessor(self.max_model_len, config.async_output, config.release_per_step)
        self.scheduler = Scheduler(config, self.block_manager, flush_outputs=self.output.wait)
        self.requests: dict[str, Request] = {}
        self._last_num_steps = 0
        self.num_steps = 0  # model steps run, for stats and health
        self.last_step_time = time.monotonic()

    def bind_thread(self) -> None:
        """Apply the torch thread count in the calling thread.

        NOTE: OpenMP's thread count is per calling thread, so the engine loop's
        own thread must set it again.
        """
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)

    # -- requests -------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     sink: DeltaSink) -> Request:
        """Validate and build a request; raises ValueError naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise ValueError("prompt must be a non-empty list of token ids")
        V = self.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
                raise ValueError(f"prompt token ids must be integers in [0, {V}), got {t!r}")
        if any(t >= V for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {V})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; this model's context is {self.max_model_len} "
                             f"tokens, so prompts may have at most {self.max_model_len - 1}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        room = self.max_model_len - n
        max_out = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(request_id, list(prompt_token_ids), params, sink, frozenset(stop_ids), max_out)

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                      error: str | None = None) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        self.output.wait()  # flush: every output of the request is processed first
        self.output.finish_now(req, reason, error)
        self._free_finished()

    def fail_all(self, error: str) -> None:
        """The engine broke: end every request with an error delta."""
        try:
            self.output.wait()
        except Exception:  # the output thread itself may be what broke
            logger.exception("output processing failed")
        for request_id in list(self.requests):
            self.output.finish_now(self.requests[request_id], FinishReason.ERROR, error)
        self._free_finished()

    # -- the loop body --------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> bool:
        """One scheduling decision and its steps; False when there was nothing to run."""
        # NOTE: after a single step, one step of outputs may stay in flight (a
        # finished request then runs at most one extra step); after a window, all
        # must land, or a request that stopped in it would run a whole extra window.
        self.output.wait(1 if self._last_num_steps == 1 else 0)
        self._free_finished()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._last_num_steps = 0
            self.output.wait()
            self._free_finished()
            return False
        self._run(sched)
        return True

    def _run(self, sched: SchedulerOutput) -> None:
        try:
            self._execute(sched)
        except Exception as error:  # noqa: BLE001 - engine faults are re-raised
            self._isolate_failure(sched, error)

    def _execute(self, sched: SchedulerOutput) -> None:
        num_steps = sched.num_steps
        output = self.output
        done = [0]  # steps whose tokens were taken

        def on_step(step: int, rows: list[Request], sampled: StepOutput) -> None:
            counts = []
            for req, token in zip(rows, sampled.token_ids):
                req.output_token_ids.append(token)
                counts.append(len(req.output_token_ids))
            done[0] += 1
            self.num_steps += 1
            self.last_step_time = time.monotonic()
            output.submit(rows, sampled, counts, step == num_steps - 1)

        try:
            self.runner.execute(sched, on_step)
        finally:
            # NOTE: when a later step of a window raised, the earlier ones still count.
            if done[0]:
                for s in sched.prefill_seqs:
                    s.request.num_computed_tokens += s.num_new_tokens
                for s in sched.decode_seqs:
                    s.request.num_computed_tokens += done[0]
        self.scheduler.cache_computed_blocks(sched)
        self._last_num_steps = num_steps

    def _isolate_failure(self, sched: SchedulerOutput, error: Exception) -> None:
        """A step raised: fail only the requests it is tied to (replicas/step_isolation.py)
        and go on. Re-raises, so the engine fails, when the cause is the engine's or
        cannot be told."""
        if is_engine_fault(error):
            raise error
        self._last_num_steps = 0
        self.output.wait()
        self._free_finished()
        seqs = unfinished_seqs(sched)
        rows = [s.request for s in seqs if s.do_sample]
        device, V = self.runner.device, self.vocab_size
        culprits = probe_rows(rows, V, device)
        if culprits and probe_rows([control_request()], V, device):
            raise error  # the sampler fails for anyone: not a request's doing
        if not culprits:
            culprits, any_ran = bisect(seqs, self._execute)
            if not any_ran:
                raise error
        self.output.wait()
        for req, e in culprits:
            logger.warning("request %s failed inside an engine step; only it ends",
                           req.request_id, exc_info=e)
            self.output.finish_now(req, FinishReason.ERROR,
                                   f"the request failed in the engine: {type(e).__name__}: {e}")
        self._free_finished()

    def _free_finished(self) -> None:
        finished = self.output.finished
        if not finished:
            return
        done = []
        while finished:
            req = finished.popleft()
            if req.status == RequestStatus.FINISHED:
                continue
            req.status = RequestStatus.FINISHED
            del req.output_token_ids[req.num_final_output_tokens:]  # drop tokens past the stop
            self.block_manager.free(req.block_ids)
            self.requests.pop(req.request_id, None)
            done.append(req)
        self.scheduler.remove_finished(done)

    # -- introspection --------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_prompt_tokens": self.scheduler.num_waiting_prompt_tokens,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "kv_cache_usage": bm.usage,
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_rate": self.scheduler.prefix_cache_hit_rate,
            "num_prefix_cache_hit_tokens": self.scheduler.num_prefix_cache_hit_tokens,
            "num_prefix_cache_query_tokens": self.scheduler.num_prefix_cache_query_tokens,
            "num_cached_blocks": bm.num_cached_blocks,
        }

    def shutdown(self) -> None:
        self.output.shutdown()
