"""DeltaCollector: thread producer, asyncio consumer; merges, never drops or reorders."""
from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from deltas.collector import DeltaCollector
from deltas.types import FinishReason, TokenDelta
from tests.delta_sinks import ListSink


def delta(ids: list[int], num_output_tokens: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta("r", list(ids), logprobs=[-float(i) for i in ids], finish_reason=finish,
                      num_output_tokens=num_output_tokens)


class CountingLoop:
    """Wraps the loop to count cross-thread wakes."""

    def __init__(self, loop):
        self._loop = loop
        self.num_wakes = 0

    def call_soon_threadsafe(self, *args):
        self.num_wakes += 1
        return self._loop.call_soon_threadsafe(*args)

    def create_future(self):
        return self._loop.create_future()


def run_async(test):
    """No pytest-asyncio here: each test runs its own event loop."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(test(*args, **kwargs), 30))

    return wrapper


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn)
    thread.start()
    return thread


@run_async
async def test_ten_thousand_puts_from_a_thread_nothing_lost_or_reordered():
    collector = DeltaCollector("r")
    num_puts = 10_000

    def produce():
        for i in range(num_puts):
            collector.put(delta([i], i + 1, FinishReason.LENGTH if i == num_puts - 1 else None))

    thread = in_thread(produce)
    ids, logprobs, num_gets = [], [], 0
    async for merged in collector:
        num_gets += 1
        ids.extend(merged.token_ids)
        logprobs.extend(merged.logprobs)
        if num_gets % 10 == 0:
            await asyncio.sleep(0.001)  # a slow consumer
    thread.join()
    assert ids == list(range(num_puts))
    assert logprobs == [-float(i) for i in range(num_puts)]
    assert merged.finish_reason == FinishReason.LENGTH and merged.num_output_tokens == num_puts
    assert num_gets < num_puts  # a consumer behind the producer gets merged deltas


@run_async
async def test_puts_while_the_consumer_is_away_merge_into_one_get():
    collector = DeltaCollector("r")
    in_thread(lambda: [collector.put(delta([i], i + 1)) for i in range(100)]).join()
    merged = await collector.get()
    assert merged.token_ids == list(range(100)) and merged.num_output_tokens == 100


@run_async
async def test_wakes_only_a_waiting_consumer_once_per_wait():
    collector = DeltaCollector("r")
    counting = collector._mailbox._loop = CountingLoop(collector._mailbox._loop)
    in_thread(lambda: [collector.put(delta([i], i + 1)) for i in range(50)]).join()
    assert counting.num_wakes == 0  # nobody was waiting
    await collector.get()
    getter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0.01)  # the consumer now waits
    in_thread(lambda: [collector.put(delta([i], i + 1)) for i in range(50)]).join()
    merged = await asyncio.wait_for(getter, 5)
    assert counting.num_wakes == 1
    assert merged.token_ids  # woken by the first put; the rest came before or after


@run_async
async def test_notify_false_waits_for_notify():
    collector = DeltaCollector("r")
    getter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0.01)
    in_thread(lambda: [collector.put(delta([i], i + 1), notify=False) for i in range(3)]).join()
    done, _ = await asyncio.wait({getter}, timeout=0.2)
    assert not done  # not woken by notify=False puts
    in_thread(collector.notify).join()
    merged = await asyncio.wait_for(getter, 5)
    assert merged.token_ids == [0, 1, 2]


@run_async
async def test_get_takes_pending_notify_false_deltas_without_waiting():
    collector = DeltaCollector("r")
    collector.put(delta([1], 1), notify=False)
    assert (await asyncio.wait_for(collector.get(), 1)).token_ids == [1]


@run_async
async def test_put_error_ends_the_stream_after_pending_tokens():
    collector = DeltaCollector("r")
    collector.put(delta([1, 2], 2))
    in_thread(lambda: collector.put_error("engine died")).join()
    collector.put(delta([3], 3))  # after the finish: dropped
    received = [d async for d in collector]
    assert len(received) == 1
    assert received[0].token_ids == [1, 2]
    assert received[0].finish_reason == FinishReason.ERROR and received[0].error == "engine died"
    assert received[0].num_output_tokens == 2
    with pytest.raises(RuntimeError):
        await collector.get()


@run_async
async def test_cancelled_get_does_not_break_later_puts():
    collector = DeltaCollector("r")
    getter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0.01)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    in_thread(lambda: collector.put(delta([5], 1))).join()
    assert (await asyncio.wait_for(collector.get(), 1)).token_ids == [5]


@run_async
async def test_put_from_the_loop_thread_wakes_without_call_soon_threadsafe():
    collector = DeltaCollector("r")
    counting = collector._mailbox._loop = CountingLoop(collector._mailbox._loop)
    getter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    collector.put(delta([7], 1))
    assert (await asyncio.wait_for(getter, 1)).token_ids == [7]
    assert counting.num_wakes == 0


def test_list_sink_merges_without_a_loop():
    sink = ListSink("r")
    sink.put(delta([1], 1), notify=False)
    sink.notify()
    sink.put(delta([2, 3], 3, FinishReason.STOP))
    sink.put(delta([4], 4))  # after the finish: dropped
    assert sink.delta.token_ids == [1, 2, 3] and sink.delta.logprobs == [-1.0, -2.0, -3.0]
    assert sink.finished and sink.delta.num_output_tokens == 3
    error_sink = ListSink("e")
    error_sink.put(delta([1], 1))
    error_sink.put_error("boom")
    assert error_sink.delta.finish_reason == FinishReason.ERROR and error_sink.delta.num_output_tokens == 1


def test_wake_batch_wakes_every_waiting_consumer_with_one_loop_call():
    import asyncio as _asyncio
    import threading as _threading

    from deltas.collector import DeltaCollector, WakeBatch
    from deltas.types import TokenDelta

    async def main():
        loop = _asyncio.get_running_loop()
        collectors = [DeltaCollector(f"r{i}") for i in range(10)]
        getters = [_asyncio.ensure_future(c.get()) for c in collectors]
        await _asyncio.sleep(0.01)  # every consumer is now waiting
        calls = []
        real = loop.call_soon_threadsafe

        def counting(*args):
            calls.append(args)
            return real(*args)
        loop.call_soon_threadsafe = counting

        def produce():
            batch = WakeBatch()
            for i, c in enumerate(collectors):
                c.put(TokenDelta(f"r{i}", [i]), True, batch)
            assert not calls  # nothing woken before the flush
            batch.flush()
        t = _threading.Thread(target=produce)
        t.start()
        t.join()
        got = await _asyncio.wait_for(_asyncio.gather(*getters), 2)
        return calls, got
    calls, got = asyncio.run(main())
    assert len(calls) == 1
    assert [d.token_ids for d in got] == [[i] for i in range(10)]


@run_async
async def test_one_mailbox_keeps_each_request_apart_and_wakes_its_reader_once():
    """The StepOutbox's mechanism: many requests, one reader."""
    from deltas.collector import DeltaMailbox, MailboxSink

    mailbox = DeltaMailbox()
    counting = mailbox._loop = CountingLoop(mailbox._loop)
    a, b = MailboxSink(mailbox, "a"), MailboxSink(mailbox, "b")
    waiter = asyncio.ensure_future(mailbox.wait())
    await asyncio.sleep(0.01)

    def produce():
        for i in range(3):
            a.put(TokenDelta("a", [i], num_output_tokens=i + 1))
            b.put(TokenDelta("b", [10 + i], num_output_tokens=i + 1))
        b.put_error("boom")
        b.put(TokenDelta("b", [99], num_output_tokens=4))  # after the finish: dropped

    in_thread(produce).join()
    await asyncio.wait_for(waiter, 1)
    assert counting.num_wakes == 1
    pending = mailbox.take_all()
    assert pending["a"].token_ids == [0, 1, 2] and pending["a"].finish_reason is None
    assert pending["b"].token_ids == [10, 11, 12] and pending["b"].error == "boom"
    assert pending["b"].num_output_tokens == 3 and mailbox.take_all() == {}
