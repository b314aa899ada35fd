"""Tool-call deltas: a choice's streamed deltas join into its non-streamed message,
however its text is cut into steps (one character at a time, all at once, random
1-4-token chunks as N-step windows make), for both parsed formats; the `n` choices
of a request never share parser state."""
from __future__ import annotations

import json
import random

import pytest

from cluster.api.tools.formats import HERMES, LLAMA3_JSON
from cluster.api.tools.stream import ToolCallStream, finish_reason, tool_message

HERMES_TEXTS = {
    "one call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "text before": 'Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "two parallel": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "n": [1, {"a": "}"}]}}\n</tool_call>'),
    "empty arguments": '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "escapes": '<tool_call>\n{"name": "say", "arguments": {"text": "a \\"quoted\\" } and \\\\ <tool_call>"}}\n</tool_call>',
    "name last": '<tool_call>\n{"arguments": {"x": 1.5e3}, "name": "f"}\n</tool_call>',
    "no call": "Just text, with a < sign and <tool_ and <b>tags</b>.  ",
    "cut mid-call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    "opener then junk": "see <tool_call> here",
}
LLAMA_TEXTS = {
    "one call": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "python tag": '<|python_tag|>{"name": "now", "parameters": {}}',
    "two calls": '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [true, null]}}',
    "text": "  The weather is fine.",
}


def _tokens(text: str) -> list[str]:
    """Token-like pieces: words, single punctuation, whitespace runs."""
    import re
    return re.findall(r"\s+|\w+|[^\w\s]", text)


def _chunkings(text: str, seed: int = 0):
    yield "one character at a time", list(text)
    yield "all at once", [text]
    rng = random.Random(seed)
    tokens, chunks, i = _tokens(text), [], 0
    while i < len(tokens):
        k = rng.randint(1, 4)
        chunks.append("".join(tokens[i:i + k]))
        i += k
    yield "1-4 tokens", chunks


def _stream(chunks: list[str], fmt):
    stream, deltas = ToolCallStream(fmt), []
    for i, chunk in enumerate(chunks):
        deltas.append(stream.feed(chunk, final=i == len(chunks) - 1))
    return stream, deltas


def _joined(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    content, calls = None, {}
    for delta in deltas:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for entry in delta.get("tool_calls", []):
            k = entry["index"]
            if k not in calls:
                assert set(entry) == {"index", "id", "type", "function"}, entry
                assert entry["type"] == "function" and entry["function"]["name"]
                calls[k] = {"id": entry["id"], "type": "function",
                            "function": {"name": entry["function"]["name"], "arguments": ""}}
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            calls[k]["function"]["arguments"] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[k] for k in sorted(calls)]


def _without_ids(calls):
    return [{**c, "id": None} for c in calls]


@pytest.mark.parametrize("fmt, name, text",
                         [(HERMES, k, v) for k, v in HERMES_TEXTS.items()]
                         + [(LLAMA3_JSON, k, v) for k, v in LLAMA_TEXTS.items()])
def test_streamed_deltas_join_into_the_non_streamed_message(fmt, name, text):
    content, calls = tool_message(text, fmt)
    for how, chunks in _chunkings(text, seed=len(text)):
        stream, deltas = _stream(chunks, fmt)
        got_content, got_calls = _joined(deltas)
        assert (got_content or None) == (content or None), (how, got_content, content)
        assert _without_ids(got_calls) == _without_ids(calls), how
        assert stream.made_calls == bool(calls)


def test_what_each_text_parses_to():
    content, calls = tool_message(HERMES_TEXTS["two parallel"], HERMES)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "CET", "n": [1, {"a": "}"}]}
    assert len({c["id"] for c in calls}) == 2
    assert tool_message(HERMES_TEXTS["empty arguments"], HERMES)[1][0]["function"]["arguments"] == "{}"
    assert tool_message(HERMES_TEXTS["text before"], HERMES)[0] == "Let me look that up."
    assert json.loads(tool_message(HERMES_TEXTS["one call"], HERMES)[1][0]["function"]["arguments"]) \
        == {"city": "Paris", "days": 3}  # an integer stays an integer
    assert tool_message(HERMES_TEXTS["name last"], HERMES)[1][0]["function"] == \
        {"name": "f", "arguments": '{"x": 1.5e3}'}
    assert tool_message(HERMES_TEXTS["no call"], HERMES) == (HERMES_TEXTS["no call"], [])
    assert tool_message(HERMES_TEXTS["opener then junk"], HERMES) == ("see <tool_call> here", [])
    cut = tool_message(HERMES_TEXTS["cut mid-call"], HERMES)[1]
    assert cut[0]["function"]["arguments"] == '{"city": "Par'  # as streamed: a cut is a cut
    assert [c["function"]["name"] for c in tool_message(LLAMA_TEXTS["two calls"], LLAMA3_JSON)[1]] == ["a", "b"]
    assert tool_message(LLAMA_TEXTS["text"], LLAMA3_JSON) == (LLAMA_TEXTS["text"], [])


def test_nothing_that_may_begin_a_call_is_sent_as_content():
    stream = ToolCallStream(HERMES)
    assert stream.feed("Sure. <tool", final=False) == {"content": "Sure."}
    assert stream.feed("_call>\n{\"name\": \"f\"", final=False) == {
        "tool_calls": [{"index": 0, "id": stream._calls_sent[0][0], "type": "function",
                        "function": {"name": "f", "arguments": ""}}]}
    assert stream.feed(', "arguments": {"a"', final=False)["tool_calls"] == [
        {"index": 0, "function": {"arguments": '{"a"'}}]


def test_the_n_choices_of_a_request_keep_their_own_state():
    texts = [HERMES_TEXTS["one call"], HERMES_TEXTS["no call"], HERMES_TEXTS["two parallel"]]
    streams = [ToolCallStream(HERMES) for _ in texts]
    deltas = [[] for _ in texts]
    chunked = [list(_chunkings(t, seed=i))[2][1] for i, t in enumerate(texts)]
    # interleaved, as the merged stream of n choices delivers them
    for step in range(max(map(len, chunked))):
        for i, chunks in enumerate(chunked):
            if step < len(chunks):
                deltas[i].append(streams[i].feed(chunks[step], final=step == len(chunks) - 1))
    for i, text in enumerate(texts):
        content, calls = tool_message(text, HERMES)
        got_content, got_calls = _joined(deltas[i])
        assert (got_content or None) == (content or None)
        assert _without_ids(got_calls) == _without_ids(calls)


def test_finish_reasons():
    assert finish_reason("stop", made_calls=True, named=False) == "tool_calls"
    assert finish_reason("stop", made_calls=True, named=True) == "stop"
    assert finish_reason("stop", made_calls=False, named=False) == "stop"
    assert finish_reason("length", made_calls=True, named=False) == "length"
    assert finish_reason(None, made_calls=True, named=False) is None
