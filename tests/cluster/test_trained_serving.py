"""The trained preset through the app `make serve` runs, on a local Ray: it answers a
factual question, holds a JSON schema with sensible values, and streams the same
text it returns whole. Greedy, so every answer here is the model's own best."""
from __future__ import annotations

import json

import jsonschema
import pytest

from cluster_support import serve_app

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(600)]

MODEL = "smollm2-135m"
APP_ARGS = {"model": MODEL, "num_engine_replicas": 1, "engine_num_cpus": 1,
            "ingress_num_cpus": 0.5, "num_threads": 1, "max_num_seqs": 16,
            "num_kv_blocks": 256, "max_model_len": 2048}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
COUNTRY_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client():
    from openai import OpenAI

    with serve_app(APP_ARGS) as base:
        with OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c


def test_it_is_served_under_the_preset_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_its_card_says_the_gguf_file_s_own_types_run_in_their_bytes(client):
    """quantization auto: the file's Q4_1/Q8_0 matrices run as stored, about the
    file's 98 MB (not the 538 MB of float32 they would dequantize to)."""
    card = client.models.retrieve(MODEL).model_dump()
    assert card["quantization"] == "gguf"
    assert card["weights"] == "Q4_1/Q8_0 (native)"
    assert 90e6 < card["weight_bytes"] < 110e6


def test_a_factual_question_gets_its_answer(client):
    reply = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0,
                                           max_tokens=32)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"  # the model ends its answer itself


def test_the_stream_carries_the_same_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0,
                                           max_tokens=32).choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0,
                                            max_tokens=32, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole


def test_a_completion_continues_the_text(client):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      temperature=0, max_tokens=8)
    assert "Paris" in reply.choices[0].text, reply.choices[0].text


def test_json_schema_gives_valid_json_with_sensible_values(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON "
                                            "with the keys country and capital."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "capital", "schema": COUNTRY_SCHEMA}})
    answer = json.loads(reply.choices[0].message.content)
    jsonschema.validate(answer, COUNTRY_SCHEMA)
    assert answer["country"].lower() == "france" and "Paris" in answer["capital"], answer


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _streamed_message(chunks):
    """content and tool calls joined from a stream's deltas, and the finish reason."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for entry in delta.tool_calls or []:
            if entry.index not in calls:
                assert entry.id and entry.type == "function" and entry.function.name
                calls[entry.index] = {"id": entry.id, "name": entry.function.name,
                                      "arguments": ""}
            else:
                assert entry.id is None and entry.function.name is None
            calls[entry.index]["arguments"] += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice, finish", [
    ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop")])
def test_a_required_or_named_tool_choice_gives_a_valid_call_streamed_as_whole(
        client, tool_choice, finish):
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
                  tool_choice=tool_choice, parallel_tool_calls=False, temperature=0,
                  max_tokens=96)
    message = client.chat.completions.create(**kwargs).choices[0]
    assert message.finish_reason == finish
    [call] = message.message.tool_calls  # one: parallel_tool_calls is false
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    assert "paris" in arguments["city"].lower(), arguments
    content, calls, stream_finish = _streamed_message(
        client.chat.completions.create(**kwargs, stream=True))
    assert stream_finish == finish
    assert content == message.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.message.tool_calls]


def test_a_tool_result_in_the_history_is_answered_in_text(client):
    """NOTE: tool_choice "none" for the answer: with "auto" this 135M model calls
    the tool again (its judgment, not the form under test)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*WEATHER_QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1",
                 "content": '{"city": "Paris", "weather": "sunny", "celsius": 24}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="none", temperature=0,
                                           max_tokens=64).choices[0]
    assert not reply.message.tool_calls and reply.finish_reason == "stop"
    assert "sunny" in reply.message.content.lower() or "24" in reply.message.content, \
        reply.message.content


def test_tool_choice_none_never_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION,
                                           tools=[WEATHER_TOOL], tool_choice="none",
                                           temperature=0, max_tokens=48).choices[0]
    assert not reply.message.tool_calls and reply.message.content
    assert reply.finish_reason in ("stop", "length")


def test_n_choices_each_make_their_own_calls(client):
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
                  tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=7,
                  n=3, max_tokens=96)
    whole = client.chat.completions.create(**kwargs).choices
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for choice in whole:
        content, calls, finish = _streamed_message(
            [c for c in chunks if c.choices and c.choices[0].index == choice.index])
        assert finish == choice.finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("extra, param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "required": "city"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "min_tokens": 4}, "tools"),
    ({"functions": [WEATHER_TOOL["function"]]}, "functions"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, max_tokens=8,
                                       extra_body=extra)
    assert raised.value.body["param"] == param, raised.value.body
