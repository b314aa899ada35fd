"""Continuous batching, FCFS, chunked prefill, preemption by recompute.

Never touches a device: it hands the runner a plain `SchedulerOutput`.

A decision is either a *mixed step* (some prompt tokens to compute: chunks of
prefills plus one token for every decoding request; one step) or a *decode
window* (every running request decodes; `num_scheduler_steps` steps back to
back). New prompts are admitted only at these boundaries; while the waiting ones
cannot be (every seat taken, or no blocks), running decodes still run as windows.
A window reserves the slots of its N-1 lookahead tokens up front, so block tables
never change inside it, and preemption happens before a window, never inside one.

Prefix caching: a request being admitted takes the longest chain of cached full
blocks of its tokens (prompt, plus output after a preemption) and computes only
the rest, always at least its last token (the model needs its logits). Blocks
enter the cache once full and computed (`cache_computed_blocks`, after a
decision ran), so nothing can hit a block that is still being written.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from replicas.kv_cache.block_hash import extend_block_hashes, kv_namespace, root_block_hash
from replicas.kv_cache.block_manager import BlockManager
from replicas.config import EngineConfig
from replicas.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_computed_tokens: int  # context already in the cache (start of the query)
    num_new_tokens: int  # query tokens this step: a prompt chunk, or 1 to decode
    do_sample: bool  # False for a prompt chunk that does not reach the end


@dataclass(slots=True)
class SchedulerOutput:
    prefill_seqs: list[ScheduledSeq] = field(default_factory=list)
    decode_seqs: list[ScheduledSeq] = field(default_factory=list)
    num_steps: int = 1
    preempted_requests: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill_seqs and not self.decode_seqs

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefill_seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 flush_outputs: Callable[[], None] = lambda: None):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: preempt from the back
        # NOTE: called before a preemption so that every output of the victim has
        # been processed (async output) before its state is reset.
        self.flush_outputs = flush_outputs
        self.num_waiting_prompt_tokens = 0
        self.num_preemptions = 0
        # ids of requests that finished while being preempted in this schedule() (a
        # victim's outputs are flushed first): out of `running`, never reserved again
        self._dropped: set[int] = set()
        self.root_block_hash = root_block_hash(kv_namespace(config.model, config.dtype))
        # Tokens of admitted requests, and those of them found in the prefix cache.
        self.num_prefix_cache_query_tokens = 0
        self.num_prefix_cache_hit_tokens = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.num_waiting_prompt_tokens += request.num_tokens

    def remove_finished(self, requests: list[Request]) -> None:
        """Forget finished requests (their blocks are freed by the engine)."""
        done = set(map(id, requests))
        if self.running:
            self.running = [r for r in self.running if id(r) not in done]
        if any(id(r) in done for r in self.waiting):
            kept = deque()
            for r in self.waiting:
                if id(r) in done:
                    self.num_waiting_prompt_tokens -= r.num_tokens
                else:
                    kept.append(r)
            self.waiting = kept

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._dropped.clear()
        has_prompt_work = bool(self.waiting) or any(not r.is_decoding for r in self.running)
        if has_prompt_work:
            self._schedule_mixed_step(out)
            while out.is_empty and self.running and not all(r.is_decoding for r in self.running):
                # only half-computed prompts hold the blocks: the latest yields them
                self._preempt(self.running[-1], out)
                self._schedule_mixed_step(out)
            if out.prefill_seqs or not all(r.is_decoding for r in self.running):
                return out
            # NOTE: no prompt token fits (every seat taken, or no blocks for the head of
            # the queue): a step of decodes alone would give a backlogged engine single
            # steps for as long as the queue waits; the same decodes run as a window,
            # and the queue is looked at again at its end.
            out = SchedulerOutput(preempted_requests=out.preempted_requests)
        if self.running:
            self._schedule_decode_window(out)
        return out

    # -- decode window -------------------------------------------------------
    def _schedule_decode_window(self, out: SchedulerOutput) -> None:
        num_steps = self.config.num_scheduler_steps
        # NOTE: iterate over a copy: reserving may preempt requests from the back.
        for req in list(self.running):
            if self._still_running(req):
                # positions [num_computed, num_computed + N) get K/V in this window
                self._reserve(req, req.num_computed_tokens + num_steps, out)
        out.num_steps = num_steps
        out.decode_seqs = [ScheduledSeq(r, r.num_computed_tokens, 1, True) for r in self.running]

    # -- mixed step ----------------------------------------------------------
    def _schedule_mixed_step(self, out: SchedulerOutput) -> None:
        bm = self.block_manager
        token_budget = self.config.max_num_batched_tokens
        # 1. every decoding request gets its one token (slot) first
        for req in [r for r in self.running if r.is_decoding]:
            if self._still_running(req):
                self._reserve(req, req.num_computed_tokens + 1, out)
        decoding = [r for r in self.running if r.is_decoding]
        token_budget -= len(decoding)
        out.decode_seqs = [ScheduledSeq(r, r.num_computed_tokens, 1, True) for r in decoding]
        # 2. running requests mid-prefill continue with their next chunk
        for req in list(self.running):
            if req.is_decoding or token_budget <= 0:
                continue
            chunk = min(req.num_uncomputed_tokens, token_budget)
            end = req.num_computed_tokens + chunk
            # NOTE: no preemption here: a victim could already be in decode_seqs.
            if not self._still_running(req) or not bm.can_append(req.block_ids, end):
                continue
            bm.append_slots(req.block_ids, end)
            out.prefill_seqs.append(ScheduledSeq(req, req.num_computed_tokens, chunk,
                                                 end == req.num_tokens))
            token_budget -= chunk
        # 3. admit waiting requests, FCFS, while budget, sequences and blocks allow
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached_block_ids = self._find_cached_prefix(req)
            start = len(cached_block_ids) * bm.block_size
            chunk = min(req.num_tokens - start, token_budget)
            end = start + chunk
            # NOTE: the watermark keeps room for running decodes to grow; with none
            # running it would only hold back a prompt that fits (make_block_manager
            # sizes the cache for one longest sequence), and the engine would spin.
            if not bm.can_allocate(end, cached_block_ids, keep_watermark=bool(self.running)):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.num_waiting_prompt_tokens -= req.num_tokens
            bm.take_cached_blocks(req.block_ids, cached_block_ids)
            bm.allocate(req.block_ids, end)
            req.num_computed_tokens = start
            req.num_cached_blocks = len(cached_block_ids)
            self.num_prefix_cache_query_tokens += req.num_tokens
            self.num_prefix_cache_hit_tokens += start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.prefill_seqs.append(ScheduledSeq(req, start, chunk, end == req.num_tokens))
            token_budget -= chunk
        out.num_steps = 1

    # -- prefix cache --------------------------------------------------------
    def _find_cached_prefix(self, req: Request) -> list[int]:
        """Cached block ids for req's leading full blocks, never its last token."""
        bm = self.block_manager
        if not bm.enable_caching:
            return []
        max_blocks = (req.num_tokens - 1) // bm.block_size
        extend_block_hashes(req.block_hashes, self.root_block_hash, bm.block_size,
                            max_blocks * bm.block_size, req.token_ids_slice)
        return bm.find_cached_blocks(req.block_hashes, max_blocks)

    def cache_computed_blocks(self, out: SchedulerOutput) -> None:
        """Enter the blocks a decision filled into the prefix cache, once it ran.

        NOTE: O(1) per request unless a block became full; each block is hashed
        once, when its last token's K/V is computed (tokens sampled in a window
        are already in output_token_ids by then).
        """
        bm = self.block_manager
        if not bm.enable_caching:
            return
        bs = bm.block_size
        for seqs in (out.prefill_seqs, out.decode_seqs):
            for s in seqs:
                req = s.request
                num_full_blocks = req.num_computed_tokens // bs
                if num_full_blocks <= req.num_cached_blocks:
                    continue
                extend_block_hashes(req.block_hashes, self.root_block_hash, bs,
                                    num_full_blocks * bs, req.token_ids_slice)
                bm.cache_blocks(req.block_ids, req.block_hashes, req.num_cached_blocks,
                                num_full_blocks)
                req.num_cached_blocks = num_full_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Admitted tokens found in the cache, over all admitted tokens."""
        return self.num_prefix_cache_hit_tokens / max(self.num_prefix_cache_query_tokens, 1)

    def _reserve(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Slots for `num_tokens` in req's table, preempting from the back as needed.

        Returns False when req itself had to be preempted.
        """
        bm = self.block_manager
        while not bm.can_append(req.block_ids, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        bm.append_slots(req.block_ids, num_tokens)
        return True

    def _still_running(self, req: Request) -> bool:
        """Not preempted since the caller's copy of `running` was taken: a live victim
        is WAITING again, a finished one was dropped."""
        return req.status == RequestStatus.RUNNING and id(req) not in self._dropped

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks; it recomputes from scratch later."""
        self.flush_outputs()
        self.running.remove(req)
        if req.is_finished:
            # finished while its outputs were in flight: the engine frees it
            self.block_manager.free(req.block_ids)
            req.num_computed_tokens = req.num_cached_blocks = 0
            self._dropped.add(id(req))
            return
        # NOTE: its block hashes stay: the tokens are the same when it comes back,
        # and its own blocks may still be cached then.
        self.block_manager.free(req.block_ids)
        req.num_computed_tokens = req.num_cached_blocks = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.num_waiting_prompt_tokens += req.num_tokens
        out.preempted_requests.append(req)
