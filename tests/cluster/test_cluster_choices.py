"""n > 1 without Ray: one engine request per choice (ids, seeds), admission that
aborts every choice when one is refused, the choices' deltas merged with their
indices, and bodies and streams that the `openai` client's own types parse, with
usage counting the prompt once."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

import cluster.api.choices as choices
from cluster.errors import ApiError
from cluster.api.openai_events import ChatFormatter, CompletionFormatter
from cluster.api.response_writer import StreamEnd, json_body, sse_events
from deltas.types import FinishReason, TextDelta
from replicas.config import INT64_MAX, InvalidValue, SamplingParams


def test_one_engine_request_per_choice_with_its_own_seed():
    params = SamplingParams(seed=7, temperature=1.0, logit_bias={3: 1})
    requests = choices.choice_requests("cmpl-x", [[1, 2]], params, "owner", 3)
    assert [r.request_id for r in requests] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.prompt_token_ids == [1, 2] and r.sampling_params.logit_bias == ((3, 1.0),)
               for r in requests)
    one, = choices.choice_requests("cmpl-x", [[1, 2]], params, "owner", 1)
    assert one.request_id == "cmpl-x" and one.sampling_params == params
    wrapped = choices.choice_requests("c", [[1]], SamplingParams(seed=INT64_MAX), "o", 2)
    assert [r.sampling_params.seed for r in wrapped] == [INT64_MAX, 0]
    unseeded = choices.choice_requests("c", [[1]], SamplingParams(), "o", 2)
    assert all(r.sampling_params.seed is None for r in unseeded)
    # a choice's params are the request's, checked again only in their seed
    assert params.with_seed(12) == dataclasses.replace(params, seed=12)
    with pytest.raises(InvalidValue, match="seed"):
        params.with_seed(-1)


def test_a_batch_has_n_choices_per_prompt_in_openai_order_seeded_as_alone():
    params = SamplingParams(seed=7)
    requests = choices.choice_requests("cmpl-x", [[1], [2, 3]], params, "owner", 2)
    assert [(r.request_id, r.prompt_token_ids, r.sampling_params.seed) for r in requests] == [
        ("cmpl-x-0", [1], 7), ("cmpl-x-1", [1], 8), ("cmpl-x-2", [2, 3], 7),
        ("cmpl-x-3", [2, 3], 8)]
    one_each = choices.choice_requests("c", [[1], [2], [3]], SamplingParams(), "o", 1)
    assert [(r.request_id, r.prompt_token_ids) for r in one_each] == [
        ("c-0", [1]), ("c-1", [2]), ("c-2", [3])]


def test_a_batch_opens_each_prompts_first_choice_together_then_the_rest(monkeypatch):
    """Every prompt's first choice waits for its first token at once (none waits
    behind another prompt's prefill); the others follow, into that prefix's cache."""
    order: list[tuple[str, str]] = []
    waiting: set[str] = set()

    async def fake_open(engine_stream, hub, request, text_stream, **kwargs):
        rid = request.request_id
        waiting.add(rid)
        order.append(("open", rid))
        await asyncio.sleep(0.01)
        order.append(("first token", rid))
        waiting.discard(rid)
        return FakeRelay(rid, [])

    monkeypatch.setattr(choices.Relay, "open", fake_open)
    requests = choices.choice_requests("c", [[1], [2], [3]], SamplingParams(), "o", 2)
    relays = asyncio.run(choices.open_relays(None, None, requests, lambda: None, n=2))
    assert [r.request_id for r in relays] == [f"c-{k}" for k in range(6)]
    opens = [rid for what, rid in order if what == "open"]
    assert opens[:3] == ["c-0", "c-2", "c-4"] and sorted(opens[3:]) == ["c-1", "c-3", "c-5"]
    assert order.index(("open", "c-4")) < order.index(("first token", "c-0"))
    firsts_done = max(order.index(("first token", f"c-{k}")) for k in (0, 2, 4))
    assert all(order.index(("open", f"c-{k}")) > firsts_done for k in (1, 3, 5))


@pytest.mark.parametrize("hanging, opened_ids", [
    ("c-2", ["c-0"]),  # while the prompts' first choices open
    ("c-3", ["c-0", "c-2", "c-1"]),  # while the others do
])
def test_a_client_gone_while_a_batch_opens_aborts_every_admitted_choice(monkeypatch, hanging,
                                                                         opened_ids):
    opened, cancelled = _hanging_opens(monkeypatch, hangs=lambda rid: rid == hanging)
    requests = choices.choice_requests("c", [[1], [2]], SamplingParams(), "o", 2)

    async def run():
        task = asyncio.ensure_future(choices.open_relays(None, None, requests, lambda: None, n=2))
        while len(opened) < len(opened_ids):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert cancelled == [hanging]
    assert [r.request_id for r in opened] == opened_ids and all(r.aborted for r in opened)


def test_a_second_cancel_while_opens_wind_down_still_aborts_every_admitted_choice(monkeypatch):
    """A client gone twice over (Serve cancels, then shuts the replica down): the
    relays admitted before it are aborted even though the wind-down was cut short."""
    opened, cancelled = _hanging_opens(monkeypatch, hangs=lambda rid: rid == "c-2")
    requests = choices.choice_requests("c", [[1], [2]], SamplingParams(), "o", 2)

    async def run():
        task = asyncio.ensure_future(choices.open_relays(None, None, requests, lambda: None, n=2))
        while not opened:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0)  # it is now winding the opens down
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert [r.request_id for r in opened] == ["c-0"] and opened[0].aborted


@pytest.mark.parametrize("refused", ["-2", "-3"])
def test_a_refused_choice_of_a_batch_aborts_every_admitted_one(monkeypatch, refused):
    opened: list[FakeRelay] = []

    async def fake_open(engine_stream, hub, request, text_stream, **kwargs):
        if request.request_id.endswith(refused):
            raise ApiError(429, "busy", code="overloaded")
        relay = FakeRelay(request.request_id, [])
        opened.append(relay)
        return relay

    monkeypatch.setattr(choices.Relay, "open", fake_open)
    requests = choices.choice_requests("c", [[1], [2]], SamplingParams(), "o", 2)
    with pytest.raises(ApiError):
        asyncio.run(choices.open_relays(None, None, requests, lambda: None, n=2))
    assert opened and all(r.aborted for r in opened)
    assert refused not in [r.request_id[-2:] for r in opened]


class FakeRelay:
    """What the writers read of a Relay: scripted text deltas, with a pause before
    each, and whether the stream was closed before its finish (an abort)."""

    def __init__(self, request_id: str, deltas: list[TextDelta], pause_s: float = 0.0):
        self.request_id = request_id
        self.timed_out = False
        self.replica_lost = False
        self.num_replica_losses = 0
        self._deltas = deltas
        self._pause_s = pause_s
        self.aborted = False

    async def text_deltas(self, index=None):
        done = False
        try:
            for td in self._deltas:
                await asyncio.sleep(self._pause_s)
                done = td.finish_reason is not None
                yield td if index is None else (index, td)
        finally:
            if not done:
                self.aborted = True

    def abort(self) -> None:
        self.aborted = True


def _deltas(words: list[str], finish=FinishReason.LENGTH) -> list[TextDelta]:
    out = [TextDelta(w, token_ids=[i], num_output_tokens=i + 1) for i, w in enumerate(words)]
    out[-1].finish_reason = finish
    return out


def _relays(pauses=(0.0, 0.001, 0.002)) -> list[FakeRelay]:
    return [FakeRelay(f"r-{i}", _deltas([f"c{i}w{k} " for k in range(3 + i)]), pause)
            for i, pause in enumerate(pauses)]


@pytest.mark.parametrize("num_choices", [1, 3])
def test_merged_deltas_carry_their_index_and_end_after_every_finish(num_choices):
    relays = _relays()[:num_choices]

    async def run():
        return [(i, td.text) async for i, td in choices.merged_text_deltas(relays)]

    got = asyncio.run(run())
    for i in range(num_choices):
        assert [t for j, t in got if j == i] == [f"c{i}w{k} " for k in range(3 + i)]
    assert not any(r.aborted for r in relays)


@pytest.mark.parametrize("num_choices", [1, 3])
def test_closing_the_merge_early_aborts_every_unfinished_choice(num_choices):
    """One choice reads its relay's own generator: closing the merge closes it."""
    relays = _relays()[:num_choices]

    async def run():
        async with choices.aclosing(choices.merged_text_deltas(relays)) as deltas:
            async for _ in deltas:
                break
        # NOTE: here, not after asyncio.run, whose own clean-up closes every generator
        return [r.aborted for r in relays]

    assert asyncio.run(run()) == [True] * num_choices


def test_a_refused_choice_aborts_the_admitted_ones(monkeypatch):
    opened: list[FakeRelay] = []

    async def fake_open(engine_stream, hub, request, text_stream, **kwargs):
        if request.request_id.endswith("-2"):
            raise ApiError(429, "busy", code="overloaded")
        relay = FakeRelay(request.request_id, [])
        opened.append(relay)
        return relay

    monkeypatch.setattr(choices.Relay, "open", fake_open)
    requests = choices.choice_requests("c", [[1]], SamplingParams(), "o", 4)
    with pytest.raises(ApiError) as e:
        asyncio.run(choices.open_relays(None, None, requests, lambda: None))
    assert e.value.status == 429
    assert [r.request_id for r in opened] == ["c-0", "c-1", "c-3"]
    assert all(r.aborted for r in opened)


def _hanging_opens(monkeypatch, refuse_suffix: str | None = None,
                   hangs=lambda rid: not rid.endswith(("-0", "-1"))):
    """Relay.open stand-in: `refuse_suffix` is refused at once, the ids `hangs`
    picks (all but `-0` and `-1`) wait for their first token forever, the rest open
    at once. (opened relays, cancelled opens)"""
    opened: list[FakeRelay] = []
    cancelled: list[str] = []

    async def fake_open(engine_stream, hub, request, text_stream, **kwargs):
        rid = request.request_id
        if refuse_suffix and rid.endswith(refuse_suffix):
            raise ApiError(429, "busy", code="overloaded")
        if hangs(rid):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(rid)
                raise
        relay = FakeRelay(rid, [])
        opened.append(relay)
        return relay

    monkeypatch.setattr(choices.Relay, "open", fake_open)
    return opened, cancelled


def test_a_refusal_is_answered_at_once_while_other_choices_wait(monkeypatch):
    opened, cancelled = _hanging_opens(monkeypatch, refuse_suffix="-3")
    requests = choices.choice_requests("c", [[1]], SamplingParams(), "o", 4)

    async def run():
        return await asyncio.wait_for(choices.open_relays(None, None, requests, lambda: None), 5)

    with pytest.raises(ApiError) as e:
        asyncio.run(run())
    assert e.value.status == 429
    assert cancelled == ["c-2"]
    assert [r.request_id for r in opened] == ["c-0", "c-1"] and all(r.aborted for r in opened)


def test_a_client_gone_while_choices_open_aborts_the_ones_admitted(monkeypatch):
    opened, cancelled = _hanging_opens(monkeypatch)
    requests = choices.choice_requests("c", [[1]], SamplingParams(), "o", 3)

    async def run():
        task = asyncio.ensure_future(choices.open_relays(None, None, requests, lambda: None))
        while len(opened) < 2:
            await asyncio.sleep(0.001)
        task.cancel()  # what Serve does to the request when its client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert cancelled == ["c-2"]
    assert [r.request_id for r in opened] == ["c-0", "c-1"] and all(r.aborted for r in opened)


@pytest.mark.parametrize("chat", [False, True])
def test_a_body_of_three_choices_parses_with_the_openai_types(chat):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    formatter = (ChatFormatter if chat else CompletionFormatter)("id-1", "m", 1)
    body = asyncio.run(json_body(_relays(), formatter, chat, None, num_prompt_tokens=5))
    parsed = (ChatCompletion if chat else Completion).model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    texts = [c.message.content if chat else c.text for c in parsed.choices]
    assert texts == ["".join(f"c{i}w{k} " for k in range(3 + i)) for i in range(3)]
    assert all(c.finish_reason == "length" for c in parsed.choices)
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens,
            parsed.usage.total_tokens) == (5, 3 + 4 + 5, 5 + 12)


def _parse_chunk(cls, data: dict):
    """Strictly by the client's type; but as the client itself does (its lenient
    `construct_type`) for a completions chunk without a finish: the type declares
    finish_reason non-null, while OpenAI's own stream chunks carry null."""
    from openai._models import construct_type

    if data["choices"] and data["choices"][0].get("finish_reason", "") is None \
            and "delta" not in data["choices"][0]:
        return construct_type(type_=cls, value=data)
    return cls.model_validate(data)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_of_three_choices_parses_with_the_openai_types(chat):
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    formatter = (ChatFormatter if chat else CompletionFormatter)("id-1", "m", 1,
                                                                  include_usage=True)

    async def run():
        return [e async for e in sse_events(_relays(), formatter, chat, None, None, 0.0, 5)]

    writes = asyncio.run(run())
    # one event per write, but the last: the last finish, usage and [DONE] go together
    assert all(w.count(b"\n\n") == 1 for w in writes[:-1])
    assert type(writes[-1]) is StreamEnd and writes[-1].count(b"\n\n") == 3
    events = [e + b"\n\n" for e in b"".join(writes).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [_parse_chunk(ChatCompletionChunk if chat else Completion,
                           json.loads(e[len(b"data: "):])) for e in events[:-1]]
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    roles = {}
    for chunk in chunks[:-1]:
        choice, = chunk.choices
        texts[choice.index] += (choice.delta.content or "") if chat else choice.text
        if chat and choice.delta.role:
            roles[choice.index] = roles.get(choice.index, 0) + 1
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {i: "".join(f"c{i}w{k} " for k in range(3 + i)) for i in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert not chat or roles == {0: 1, 1: 1, 2: 1}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (5, 12)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_puts_each_choices_usage_so_far_on_its_chunks(chat):
    """vLLM's continuous_usage_stats: each chunk carries its own choice's prompt
    tokens (a batch's prompts differ) and output tokens so far; the last usage
    chunk still sums the request."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    formatter = (ChatFormatter if chat else CompletionFormatter)("id-1", "m", 1,
                                                                  include_usage=True)

    async def run():
        return [e async for e in sse_events(_relays(), formatter, chat, None, None, 0.0, 12,
                                            [5, 5, 7])]

    events = [e for e in b"".join(asyncio.run(run())).split(b"\n\n") if e][:-1]
    chunks = [_parse_chunk(ChatCompletionChunk if chat else Completion,
                           json.loads(e[len(b"data: "):])) for e in events]
    seen: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    for chunk in chunks[:-1]:
        choice, = chunk.choices
        seen[choice.index].append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
        assert chunk.usage.total_tokens == sum(seen[choice.index][-1])
    assert seen == {i: [(5 if i < 2 else 7, k + 1) for k in range(3 + i)] for i in range(3)}
    last = chunks[-1].usage
    assert chunks[-1].choices == [] and (last.prompt_tokens, last.completion_tokens) == (12, 12)


def test_an_error_in_one_choice_ends_the_stream_and_aborts_the_others():
    relays = _relays(pauses=(0.01, 0.0, 0.01))
    relays[1] = FakeRelay("r-1", [TextDelta("x"), TextDelta("", finish_reason=FinishReason.ERROR,
                                                            error="boom")])

    async def run():
        events = [e async for e in sse_events(relays, CompletionFormatter("i", "m", 1), False,
                                              None, None, 0.0, 5)]
        return events, relays[0].aborted and relays[2].aborted  # before asyncio.run's clean-up

    events, others_aborted = asyncio.run(run())
    assert b"boom" in events[-1] and b"[DONE]" not in b"".join(events)
    assert others_aborted


class _Recorded:
    def __init__(self):
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


def test_each_choice_has_its_own_itl_and_tpot_and_the_request_one_ttft():
    from types import SimpleNamespace

    from cluster.metrics import SampledHistogram

    itl_s = _Recorded()
    metrics = SimpleNamespace(ttft_s=_Recorded(), itl_s=itl_s, tpot_s=_Recorded(),
                              itl_sample=SampledHistogram(itl_s, now=time.monotonic()),
                              tokens_per_event=_Recorded(), count_tokens=lambda p, o: None)
    relays = _relays(pauses=(0.01, 0.01, 0.01))  # 3, 4 and 5 events of one token

    async def run():
        return [e async for e in sse_events(relays, CompletionFormatter("i", "m", 1), False,
                                            None, metrics, 0.0, 5)]

    asyncio.run(run())
    assert len(metrics.ttft_s.values) == 1
    assert len(metrics.itl_s.values) == 2 + 3 + 4
    assert len(metrics.tpot_s.values) == 3 and metrics.tokens_per_event.values == [1.0] * 3
    # each choice's tokens came about 10 ms apart (all choices interleaved: ~3 ms)
    assert min(metrics.tpot_s.values) > 0.005 and min(metrics.itl_s.values) > 0.005


def test_each_choice_is_routed_under_an_internal_request_id_of_its_own(monkeypatch):
    from ray.serve import context

    seen: list[str] = []

    async def fake_open(engine_stream, hub, request, text_stream, **kwargs):
        seen.append(context._get_serve_request_context()._internal_request_id)
        return FakeRelay(request.request_id, [])

    monkeypatch.setattr(choices.Relay, "open", fake_open)

    async def run():
        context._set_request_context(request_id="req", _internal_request_id="abc")
        await choices.open_relays(None, None, choices.choice_requests(
            "c", [[1]], SamplingParams(), "o", 3), lambda: None)
        return context._get_serve_request_context()._internal_request_id

    assert asyncio.run(run()) == "abc"  # the request's own context is untouched
    assert sorted(seen) == ["abc", "abc-1", "abc-2"]


def _lost_mid_answer(request_id: str, **flags) -> FakeRelay:
    relay = FakeRelay(request_id, [TextDelta("x"), TextDelta("", finish_reason=FinishReason.ERROR,
                                                             error="replica gone")])
    relay.replica_lost = True
    for name, value in flags.items():
        setattr(relay, name, value)
    return relay


@pytest.mark.parametrize("flags, status", [
    ({"num_replica_losses": 1}, 503),  # its one retry went on a loss before the first token
    ({"timed_out": True}, 504),  # timed out: its timeout, not the loss, is the answer
])
def test_an_answer_lost_mid_way_is_not_run_again_when_it_may_not_be(flags, status):
    from cluster.api.response_writer import json_answer

    runs = []

    async def reopen(run):
        runs.append(run)
        return [FakeRelay("again", _deltas(["y"]))]

    counted = []
    metrics = type("M", (), {"count_tokens": lambda self, p, o: counted.append((p, o))})()
    with pytest.raises(ApiError) as info:
        asyncio.run(json_answer([_lost_mid_answer("r", **flags)], reopen,
                                CompletionFormatter("i", "m", 1), False, None, 5, metrics))
    assert info.value.status == status and runs == [] and counted == [(5, 0)]


def test_a_client_gone_while_the_answer_runs_again_counts_its_prompt_once():
    from cluster.api.response_writer import json_answer

    async def reopen(run):
        raise asyncio.CancelledError  # the client left while it was admitted again

    counted = []
    metrics = type("M", (), {"count_tokens": lambda self, p, o: counted.append((p, o))})()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(json_answer([_lost_mid_answer("r")], reopen,
                                CompletionFormatter("i", "m", 1), False, None, 5, metrics))
    assert counted == [(5, 0)]
