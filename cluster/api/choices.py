"""The choices of one request: `n` for each of its prompts (completions take a
batch of prompts), each an engine request, admitted together and read as one.

Each choice is an engine request of its own (`<id>-<k>`, k = prompt index x n +
choice index, OpenAI's and vLLM's order; the seed + the choice's index within its
prompt when a seed is given, so seeded choices differ and a prompt's choices are
the same in a batch as alone), so the engine's queue bounds, routing and aborts
count and treat every one. Each prompt's first choice is admitted first (a batch's
first choices together) and the rest once those have their first tokens: each
prompt's full KV blocks are then in the prefix cache, and its other choices
prefill only what is past them (cluster/transport/prefix_affinity.py sends them to
the same replica). A refusal of any choice is the request's answer at once and
aborts the others; a client gone while they open aborts every one admitted.

`merged_text_deltas` interleaves the choices' text deltas as they come, each with
its index; each choice's deltas still merge in its collector while the reader is
behind. Closing it (a client gone, an error) closes every choice's relay, so all
are aborted on their replicas.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from cluster.transport.channels import ChannelHub
from cluster.transport.relay import Relay, aclosing
from cluster.transport.wire import EngineRequest
from deltas.types import TextDelta
from replicas.config import INT64_MAX, SamplingParams  # plain data: no torch


def choice_requests(request_id: str, prompts: list[list[int]], params: SamplingParams,
                    owner: str, n: int) -> list[EngineRequest]:
    """`n` engine requests for each prompt, prompt by prompt."""
    if len(prompts) == 1 and n == 1:
        return [EngineRequest(request_id, prompts[0], params, owner)]
    choice_params = [params if params.seed is None or i == 0 else
                     params.with_seed((params.seed + i) % (INT64_MAX + 1)) for i in range(n)]
    return [EngineRequest(f"{request_id}-{p * n + i}", prompt_ids, choice_params[i], owner)
            for p, prompt_ids in enumerate(prompts) for i in range(n)]


async def open_relays(engine_stream, hub: ChannelHub, requests: list[EngineRequest],
                      new_text_stream: Callable[[], object], timeout_s: float | None = None,
                      queue_timeout_s: float | None = None, n: int | None = None,
                      **relay_options) -> list[Relay]:
    """One open relay per request, in order (`relay_options`: `Relay.open`'s);
    `requests` are `n` choices per prompt (None: one prompt's). On the first
    refusal (ApiError), or when cancelled (the client left), the opens still
    waiting stop and every request already admitted is aborted; then the refusal
    (or the cancel) is raised."""
    async def open_one(index: int, request: EngineRequest) -> Relay:
        if index:
            _own_serve_request_id(index)
        return await Relay.open(engine_stream, hub, request, new_text_stream(),
                                timeout_s=timeout_s, queue_timeout_s=queue_timeout_s,
                                **relay_options)

    n = n or len(requests)
    firsts = [(i, r) for i, r in enumerate(requests) if i % n == 0]
    if len(firsts) == 1:
        relays = {0: await open_one(0, requests[0])}
    else:
        relays = await _open_together(open_one, firsts)
    rest = [(i, r) for i, r in enumerate(requests) if i % n]
    if rest:
        try:
            relays.update(await _open_together(open_one, rest))
        except BaseException:
            for relay in relays.values():
                relay.abort()
            raise
    return [relays[i] for i in range(len(requests))]


async def _open_together(open_one, indexed: list[tuple[int, EngineRequest]]) -> dict[int, Relay]:
    """Open every (index, request) at once; on a refusal or a cancel, stop the opens
    still waiting, abort the ones admitted, and raise it."""
    # NOTE: each task runs with a copy of this context (its own internal request id)
    tasks = {i: asyncio.ensure_future(open_one(i, r)) for i, r in indexed}
    try:
        await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        refusal = next((t.exception() for t in tasks.values()
                        if t.done() and not t.cancelled() and t.exception()), None)
        if refusal is None:
            return {i: t.result() for i, t in tasks.items()}
        raise refusal
    except BaseException:
        for task in tasks.values():
            task.cancel()  # an open cancelled midway closes its own relay
            # NOTE: a callback, not a loop after the gather: a second cancel may cut
            # the gather short, and every relay admitted must still be let go
            task.add_done_callback(_abort_if_opened)
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        raise


def _abort_if_opened(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().abort()


def _own_serve_request_id(index: int) -> None:
    """Give this task's handle calls an internal request id of their own.

    NOTE: Serve's router tells the calls waiting to be routed apart by the request
    context's internal id, which every choice of one HTTP request shares: two of
    them waiting at once would share one replica's answer, and the other would
    wait forever. Only this task's context changes; the public request id (logs)
    stays."""
    from cluster.transport.ray_internals import suffix_internal_request_id

    suffix_internal_request_id(str(index))


def merged_text_deltas(relays: list[Relay]) -> AsyncIterator[tuple[int, TextDelta]]:
    """(choice index, text delta) until every choice has its finish (the ERROR
    finish included). Close it (`contextlib.aclosing`) when done early.

    NOTE: one choice (the common case) reads its relay's own generator: no task
    per delta, and no generator layer between the relay and the SSE writer."""
    if len(relays) == 1:
        return relays[0].text_deltas(index=0)
    return _interleaved_text_deltas(relays)


async def _interleaved_text_deltas(relays: list[Relay]) -> AsyncIterator[tuple[int, TextDelta]]:
    streams = [relay.text_deltas() for relay in relays]
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                i = pending.pop(future)
                td = future.result()
                if td.finish_reason is None:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, td
    finally:
        for future in pending:
            future.cancel()
        # NOTE: a generator may be closed only once its cancelled step has ended.
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()
