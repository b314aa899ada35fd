"""Turns each step's sampled ids into per-request deltas: one loop over the batch,
O(1) work per new token (no output is ever rebuilt or re-decoded).

With async output the loop for step k runs on its own thread while step k+1
computes (torch releases the GIL inside its kernels). The processor alone decides
where a request stops (EOS, stop token, max_tokens, model context); requests that
finished are handed back to the engine thread through `finished`. A row that
fails here (its sink, its logprobs) ends that request alone with an error.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from deltas.collector import WakeBatch
from deltas.types import FinishReason, TokenDelta
from replicas.os_thread_name import ENGINE_OUTPUT_THREAD, name_this_thread
from replicas.request import Request
from replicas.sampling.sampled_step import StepOutput

logger = logging.getLogger("stepstream")


class OutputProcessor:
    def __init__(self, max_model_len: int, async_output: bool, release_per_step: bool):
        self.max_model_len = max_model_len
        self.release_per_step = release_per_step
        self._executor = ThreadPoolExecutor(
            1, "stepstream-output", initializer=name_this_thread,
            initargs=(ENGINE_OUTPUT_THREAD,)) if async_output else None
        self._pending: deque[Future] = deque()
        self.finished: deque[Request] = deque()  # appended here, drained by the engine
        self._held_sinks: list = []  # per-window release: sinks to wake at window end
        self.num_output_tokens = 0
        self.cpu_time_s = 0.0  # thread CPU time spent in process_step (benchmarks)

    # -- engine-thread side ---------------------------------------------------
    def submit(self, rows: list[Request], sampled: StepOutput, counts: list[int],
               is_window_end: bool, failed: dict[Request, str] | None = None) -> None:
        """`failed`: requests whose token of this step must not go out (their grammar
        failed on it), with why; None almost always."""
        if self._executor is None:
            self.process_step(rows, sampled, counts, is_window_end, failed)
            return
        self._pending.append(self._executor.submit(self.process_step, rows, sampled, counts,
                                                   is_window_end, failed))

    def wait(self, max_pending_steps: int = 0) -> None:
        """Block until at most `max_pending_steps` submitted steps are unprocessed."""
        while len(self._pending) > max_pending_steps:
            self._pending.popleft().result()  # re-raises an output-thread error here

    def finish_now(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request outside the step loop (abort, error): after wait()."""
        if req.is_finished:
            return
        n = len(req.output_token_ids) if req.num_final_output_tokens is None else req.num_final_output_tokens
        req.finish_reason, req.num_final_output_tokens = reason, min(n, len(req.output_token_ids))
        req.sink.put(TokenDelta(req.request_id, [], finish_reason=reason, error=error,
                                num_prompt_tokens=req.num_prompt_tokens,
                                num_output_tokens=req.num_final_output_tokens))
        self.finished.append(req)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    # -- the per-step loop (output thread when async) ---------------------------
    def process_step(self, rows: list[Request], sampled: StepOutput, counts: list[int],
                     is_window_end: bool, failed: dict[Request, str] | None = None) -> None:
        start = time.thread_time()
        self._process_step(rows, sampled, counts, is_window_end, failed)
        self.cpu_time_s += time.thread_time() - start

    def _process_step(self, rows: list[Request], sampled: StepOutput, counts: list[int],
                      is_window_end: bool, failed: dict[Request, str] | None) -> None:
        notify = self.release_per_step or is_window_end
        with_logprobs = sampled.has_logprobs
        token_ids = sampled.token_ids
        max_model_len = self.max_model_len
        held = self._held_sinks
        wakes = WakeBatch()
        for i, req in enumerate(rows):
            if req.finish_reason is not None:
                continue  # stopped earlier in this window: its extra tokens drop
            n = counts[i]
            try:
                if failed is not None and req in failed:
                    self._fail_row(req, n - 1, failed[req])
                    continue
                token = token_ids[i]
                reason = None
                if token in req.stop_token_ids and n > req.params.min_tokens:
                    # NOTE: the OpenAI API's (and vLLM's) stop_reason: the id of one
                    # of the request's own stop_token_ids, None for the model's EOS
                    reason = FinishReason.STOP
                    stop_reason = token if token in req.params.stop_token_ids else None
                elif n >= req.max_output_tokens or req.num_prompt_tokens + n >= max_model_len:
                    reason, stop_reason = FinishReason.LENGTH, None
                delta = TokenDelta(req.request_id, [token], num_prompt_tokens=req.num_prompt_tokens,
                                   num_output_tokens=n)
                if with_logprobs and req.params.logprobs is not None:
                    self._attach_logprobs(delta, sampled, i, req.params.logprobs)
                if reason is not None:
                    delta.finish_reason, delta.stop_reason = reason, stop_reason
                    req.finish_reason, req.num_final_output_tokens = reason, n
                    self.finished.append(req)
                    if not notify:
                        # skipped by the window's last step: woken at the window end
                        held.append(req.sink)
                req.sink.put(delta, notify, wakes)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                self._fail_row(req, n - 1, e)
        wakes.flush()  # one cross-thread wake-up for every consumer of this step
        self.num_output_tokens += len(rows)
        if is_window_end and held:
            for sink in held:
                sink.notify()
            held.clear()

    def _fail_row(self, req: Request, num_delivered: int, error: Exception | str) -> None:
        """End one request with an error delta: an exception output processing raised,
        or a reason (its grammar failed)."""
        if isinstance(error, str):
            logger.warning("request %s ends: %s", req.request_id, error)
            message = error
        else:
            logger.warning("request %s failed in output processing; only it ends",
                           req.request_id, exc_info=error)
            message = f"the request failed in the engine: {type(error).__name__}: {error}"
        if req.finish_reason is None:
            self.finished.append(req)
        req.finish_reason, req.num_final_output_tokens = FinishReason.ERROR, num_delivered
        try:
            req.sink.put(TokenDelta(req.request_id, [], finish_reason=FinishReason.ERROR,
                                    error=message,
                                    num_prompt_tokens=req.num_prompt_tokens,
                                    num_output_tokens=num_delivered))
        except Exception:  # noqa: BLE001 - its sink is what broke: nothing more to tell it
            logger.exception("could not end request %s", req.request_id)

    @staticmethod
    def _attach_logprobs(delta: TokenDelta, sampled: StepOutput, row: int, k: int) -> None:
        delta.logprobs = [sampled.logprobs[row]]
        if k > 0:
            ids, lps = sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]
            delta.top_logprobs = [list(zip(ids, lps))]
