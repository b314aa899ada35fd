"""When a batched step raises: which requests is it tied to?

One request must never take the engine down, so `EngineCore` fails only the
requests a failed step can be pinned on, and goes on:

1. Engine faults (device errors, out of memory outside sampling) are nobody's
   request: re-raised. A batch that cannot get memory to sample
   (`sampler.SamplingOutOfMemory`) is its rows' fault: it goes on below.
2. Each sampled row is sampled alone on zero logits (`sampler.probe_rows`). Rows
   that fail while a plain control row succeeds are at fault (a sampling
   parameter, a per-request hook, a row that cannot get memory even alone).
3. Otherwise the cause is elsewhere in the step, and the step's unfinished work
   is run again as single steps, halving every failing set (`bisect`): a request
   that fails alone while some other run succeeded is at fault. When no run
   succeeds the cause cannot be told, and the error is the engine's.

Retried work never leaves what the scheduler reserved for the failed step: a
prefill chunk is retried only if none of it ran, a decode only inside its window.
"""
from __future__ import annotations

from typing import Callable

import torch

from replicas.config import SamplingParams
from replicas.request import Request, RequestStatus
from replicas.sampling.sampler import SamplingOutOfMemory
from replicas.scheduler import ScheduledSeq, SchedulerOutput

# What a device or driver failure says; after one the device cannot be trusted.
_DEVICE_ERROR_MARKERS = ("CUDA error", "CUDA out of memory", "device-side assert",
                         "illegal memory access", "CUBLAS_STATUS", "cuDNN error", "NCCL",
                         "HIP error")

Culprits = list[tuple[Request, Exception]]


def is_engine_fault(error: BaseException) -> bool:
    if isinstance(error, SamplingOutOfMemory):
        return False  # smaller batches may sample: retried in halves
    if not isinstance(error, Exception) or isinstance(error, MemoryError):
        return True
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return any(marker in text for marker in _DEVICE_ERROR_MARKERS)


def control_request() -> Request:
    """A plain sampled row with nothing of any client in it."""
    return Request("step-isolation-control", [0], SamplingParams(temperature=1.0, max_tokens=1),
                   None, frozenset(), 1)


def _is_live(req: Request) -> bool:
    return req.status == RequestStatus.RUNNING and not req.is_finished


def unfinished_seqs(sched: SchedulerOutput) -> list[ScheduledSeq]:
    """The work of a failed decision still to do, as single-step seqs."""
    seqs = [s for s in sched.prefill_seqs
            if _is_live(s.request) and s.request.num_computed_tokens == s.num_computed_tokens]
    for s in sched.decode_seqs:
        req = s.request
        # NOTE: slots are reserved up to the end of the window, not past it.
        if (_is_live(req) and req.is_decoding
                and req.num_computed_tokens < s.num_computed_tokens + sched.num_steps):
            seqs.append(ScheduledSeq(req, req.num_computed_tokens, 1, True))
    return seqs


def one_step(seqs: list[ScheduledSeq]) -> SchedulerOutput:
    out = SchedulerOutput(num_steps=1)
    for s in seqs:
        # NOTE: a 1-token chunk that ends a recomputed request is the same work on
        # either path.
        is_decode = s.num_new_tokens == 1 and s.request.is_decoding
        (out.decode_seqs if is_decode else out.prefill_seqs).append(s)
    return out


def bisect(seqs: list[ScheduledSeq], run: Callable[[SchedulerOutput], None]) -> tuple[Culprits, bool]:
    """Run `seqs` as one step, halving on failure; (the seqs that failed alone, with
    their errors; whether any run succeeded). Engine faults are re-raised."""
    # NOTE: a run that raised after its tokens were taken did that work: not again.
    seqs = [s for s in seqs if _is_live(s.request)
            and s.request.num_computed_tokens == s.num_computed_tokens]
    if not seqs:
        return [], False
    try:
        run(one_step(seqs))
        return [], True
    except Exception as e:  # noqa: BLE001 - sorted below
        if is_engine_fault(e):
            raise
        if len(seqs) == 1:
            return [(seqs[0].request, e)], False
    mid = len(seqs) // 2
    first, first_ran = bisect(seqs[:mid], run)
    second, second_ran = bisect(seqs[mid:], run)
    return first + second, first_ran or second_ran
