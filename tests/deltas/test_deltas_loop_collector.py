"""LoopCollector: DeltaCollector's semantics for puts on the reader's own loop
(the ingress's channel hub): merges while the reader is away, drops after the
finish, wakes a waiting reader once."""
from __future__ import annotations

import asyncio

import pytest

from deltas.collector import LoopCollector
from deltas.types import FinishReason, TokenDelta
from tests.deltas.test_deltas_collector import delta, run_async


@run_async
async def test_puts_while_the_reader_is_away_merge_into_one_get():
    collector = LoopCollector("r")
    for i in range(100):
        collector.put(delta([i], i + 1))
    merged = await collector.get()
    assert merged.token_ids == list(range(100)) and merged.num_output_tokens == 100
    assert merged.logprobs == [-float(i) for i in range(100)]
    assert not collector.finished


@run_async
async def test_a_waiting_reader_gets_each_put_in_order_until_the_finish():
    collector = LoopCollector("r")
    got = []

    async def read():
        async for d in collector:
            got.append((d.token_ids, d.finish_reason))

    reader = asyncio.ensure_future(read())
    for i in range(5):
        await asyncio.sleep(0)
        collector.put(delta([i], i + 1, FinishReason.LENGTH if i == 4 else None))
        await asyncio.sleep(0)
    await asyncio.wait_for(reader, 5)
    assert got == [([i], None) for i in range(4)] + [([4], FinishReason.LENGTH)]
    assert collector.finished
    with pytest.raises(RuntimeError, match="already finished"):
        await collector.get()


@run_async
async def test_puts_after_the_finish_are_dropped_and_an_error_keeps_the_token_count():
    collector = LoopCollector("r")
    collector.put(delta([1, 2], 2))
    collector.put_error("the replica died")
    collector.put(delta([3], 3))  # after the finished (error) delta: dropped
    merged = await collector.get()
    assert merged.token_ids == [1, 2] and merged.finish_reason == FinishReason.ERROR
    assert merged.error == "the replica died" and merged.num_output_tokens == 2


@run_async
async def test_a_put_without_notify_waits_for_notify():
    collector = LoopCollector("r")
    reader = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    collector.put(delta([7], 1), notify=False)
    await asyncio.sleep(0.01)
    assert not reader.done()
    collector.notify()
    assert (await asyncio.wait_for(reader, 5)).token_ids == [7]


@run_async
async def test_a_cancelled_reader_leaves_the_collector_usable():
    collector = LoopCollector("r")
    reader = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    collector.put(delta([9], 1, FinishReason.STOP))
    assert (await collector.get()).token_ids == [9]


@run_async
async def test_notify_with_nothing_pending_leaves_the_reader_waiting():
    collector = LoopCollector("r")
    reader = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    collector.notify()
    await asyncio.sleep(0.01)
    assert not reader.done()
    collector.put(delta([3], 1))
    assert (await asyncio.wait_for(reader, 5)).token_ids == [3]
