"""The engine loop body: schedule -> run N steps -> hand each step to output
processing. Driven by the offline `Engine` and the threaded `AsyncEngine`.

Start-up facts come from elsewhere: the model from replicas/checkpoints/model_resolution.py,
the block manager from replicas/kv_cache/kv_budget.py, request checks from
replicas/request_validation.py. What other threads may read (stats, admission
bounds) is published as one `EngineStats` snapshot (replicas/engine_stats.py).
"""
from __future__ import annotations

import logging
import time

import torch

from deltas.sink import DeltaSink
from deltas.types import FinishReason
from replicas.config import EngineConfig, SamplingParams
from replicas.engine_stats import EngineStats
from replicas.idle_cores import StepThreads
from replicas.kv_cache.kv_budget import make_block_manager
from replicas.checkpoints.model_resolution import resolve_model
from replicas.model_runner import ModelRunner
from replicas.output_processor import OutputProcessor
from replicas.request import Request, RequestStatus
from replicas.request_validation import RequestLimits
from replicas.sampling.structured_output import GrammarCompiler, GrammarMatcher
from replicas.sampling.sampler import probe_rows
from replicas.scheduler import Scheduler, SchedulerOutput
from replicas.sampling.sampled_step import StepOutput
from replicas.step_isolation import (bisect, control_request, is_engine_fault,
                                     unfinished_seqs)

logger = logging.getLogger("stepstream")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.bind_thread()
        torch.manual_seed(config.seed)
        model = resolve_model(config)
        self.config = config = model.config
        self.model_dir = model.model_dir
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.eos_token_ids = model.eos_token_ids
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, tuple(self.eos_token_ids))
        self.runner = ModelRunner(config, self.model_dir, self.max_model_len)
        self.step_threads = StepThreads.for_engine(config.num_threads, config.use_idle_cores,
                                                   config.device)
        self.grammars = GrammarCompiler(self.model_dir, self.vocab_size, self.eos_token_ids)
        self.model_config = self.runner.model_config
        self.block_manager = make_block_manager(self.runner.num_blocks, config, self.max_model_len)
        self.output = OutputProcessor(self.max_model_len, config.async_output, config.release_per_step)
        self.scheduler = Scheduler(config, self.block_manager, flush_outputs=self.output.wait)
        self.requests: dict[str, Request] = {}
        self._last_num_steps = 0
        # The window being executed: its length, and how many of its steps' tokens
        # were taken (a window that raised part-way still counts the earlier ones).
        self._window_num_steps = 0
        self._window_num_steps_taken = 0
        self.num_steps = 0  # model steps run, for stats and health
        self.last_step_time = time.monotonic()
        self._publish_stats()

    def bind_thread(self) -> None:
        """Apply the torch thread count in the calling thread.

        NOTE: OpenMP's thread count is per calling thread, so the engine loop's
        own thread must set it again.
        """
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
            step_threads = getattr(self, "step_threads", None)
            if step_threads is not None:
                step_threads.current = self.config.num_threads

    # -- requests -------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     sink: DeltaSink, grammar: GrammarMatcher | None = None) -> Request:
        """Validate and build a request; raises ValueError naming what is wrong.
        `grammar`: its structured output, compiled already (else compiled here)."""
        req = self.limits.make_request(request_id, prompt_token_ids, params, sink, self.requests)
        if params.structured_output is not None:
            req.grammar = grammar or self.grammars.compile(params.structured_output)
        return req

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)
        self._publish_stats()

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                      error: str | None = None) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        self.output.wait()  # flush: every output of the request is processed first
        self.output.finish_now(req, reason, error)
        self._free_finished()
        self._publish_stats()

    def fail_all(self, error: str) -> None:
        """The engine broke: end every request with an error delta."""
        try:
            self.output.wait()
        except Exception:  # the output thread itself may be what broke
            logger.exception("output processing failed")
        for request_id in list(self.requests):
            self.output.finish_now(self.requests[request_id], FinishReason.ERROR, error)
        self._free_finished()
        self._publish_stats()

    # -- the loop body --------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> bool:
        """One scheduling decision and its steps; False when there was nothing to run."""
        # NOTE: with N=1, one step of outputs may stay in flight (a finished request
        # then runs at most one extra step). With N>1 all must land first: the next
        # decision may be a window (after a window, or after a mixed step when no
        # waiting prompt can be admitted), and a request that stopped in flight would
        # run all of it, holding its seat while prompts wait.
        in_flight = 1 if self.config.num_scheduler_steps == 1 and self._last_num_steps == 1 else 0
        self.output.wait(in_flight)
        self._free_finished()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._last_num_steps = 0
            self.output.wait()
            self._free_finished()
            self._publish_stats()
            if self.step_threads is not None:
                self.step_threads.idle()
            return False
        if self.step_threads is not None:
            self.step_threads.before_step(self.scheduler.num_unfinished)
        self._run(sched)
        self._publish_stats()
        if self.step_threads is not None and not self.has_work:
            self.step_threads.idle()
        return True

    def _run(self, sched: SchedulerOutput) -> None:
        try:
            self._execute(sched)
        except Exception as error:  # noqa: BLE001 - engine faults are re-raised
            self._isolate_failure(sched, error)

    def _execute(self, sched: SchedulerOutput) -> None:
        self._window_num_steps = sched.num_steps
        self._window_num_steps_taken = 0
        try:
            self.runner.execute(sched, self._on_step)
        finally:
            # NOTE: when a later step of a window raised, the earlier ones still count.
            num_taken = self._window_num_steps_taken
            if num_taken:
                for s in sched.prefill_seqs:
                    s.request.num_computed_tokens += s.num_new_tokens
                for s in sched.decode_seqs:
                    s.request.num_computed_tokens += num_taken
        self.scheduler.cache_computed_blocks(sched)
        self._last_num_steps = sched.num_steps

    def _on_step(self, step: int, rows: list[Request], sampled: StepOutput) -> None:
        """Take one step's sampled tokens, right after its host sync, and hand the
        step to output processing (which may run on its own thread)."""
        counts, failed = [], None
        for req, token in zip(rows, sampled.token_ids):
            req.output_token_ids.append(token)
            n = len(req.output_token_ids)
            if req.grammar is not None:
                error = req.grammar.accept(token, n)
                if error is not None:
                    failed = failed or {}
                    failed[req] = error
            counts.append(n)
        self._window_num_steps_taken += 1
        self.num_steps += 1
        self.last_step_time = time.monotonic()
        self.output.submit(rows, sampled, counts, step == self._window_num_steps - 1, failed)

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
    def _publish_stats(self) -> None:
        """Engine thread only: swap in a fresh snapshot for readers on other threads."""
        self.published_stats = EngineStats.from_engine(self.scheduler, self.block_manager,
                                                       self.num_steps)

    def stats(self) -> EngineStats:
        """Safe from any thread: the last published snapshot, at most one step old."""
        return self.published_stats

    def shutdown(self) -> None:
        self.output.shutdown()
        if self.step_threads is not None:
            self.step_threads.close()
        self.runner.shutdown()
