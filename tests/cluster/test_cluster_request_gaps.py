"""Small protocol gaps, without Ray: `stream_options` without `stream: true` is a
400, and errors name the field the client sent (chat's `top_logprobs` and
`max_completion_tokens`, not the engine's `logprobs` and `max_tokens`); a value
out of the engine's range gets a 400 that states the bound."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cluster.api.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                         validation_error_message)

MESSAGES = [{"role": "user", "content": "hi"}]


def _error(cls, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate_json(json.dumps(body))
    return validation_error_message(info.value)


@pytest.mark.parametrize("cls, base", [(CompletionRequest, {"prompt": "x"}),
                                       (ChatCompletionRequest, {"messages": MESSAGES})])
def test_stream_options_need_stream_true(cls, base):
    for stream in ({}, {"stream": False}):
        message, param = _error(cls, {"model": "m", **base, **stream,
                                      "stream_options": {"include_usage": True}})
        assert param == "stream_options" and "stream is true" in message, message
    ok = cls.model_validate_json(json.dumps({"model": "m", **base, "stream": True,
                                             "stream_options": {"include_usage": True}}))
    assert ok.include_usage


@pytest.mark.parametrize("body, param, bound", [
    ({"top_logprobs": 3}, "top_logprobs", "requires logprobs"),
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs", "requires logprobs"),
])
def test_chat_errors_name_the_field_the_client_sent(body, param, bound):
    message, got = _error(ChatCompletionRequest, {"model": "m", "messages": MESSAGES, **body})
    assert got == param and bound in message, message


@pytest.mark.parametrize("body, param, bound", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "[0, 20]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "[1, 2**63 - 1]"),
    ({"max_completion_tokens": 2**63}, "max_completion_tokens", "[1, 2**63 - 1]"),
    ({"max_tokens": 0}, "max_tokens", "[1, 2**63 - 1]"),
])
def test_chat_range_errors_name_the_field_the_client_sent(body, param, bound):
    """The ranges are SamplingParams' (one rule each); the 400 names the chat field."""
    from cluster.errors import ApiError
    from cluster.api.ingress import _sampling_params

    req = ChatCompletionRequest.model_validate_json(json.dumps(
        {"model": "m", "messages": MESSAGES, **body}))
    with pytest.raises(ApiError) as info:
        _sampling_params(req)
    error = info.value
    assert error.status == 400 and error.param == param, error.message
    assert bound in error.message and f"'{param}': {param} must be" in error.message, error.message


def test_chat_top_logprobs_in_range_reaches_the_engine():
    r = ChatCompletionRequest.model_validate_json(json.dumps(
        {"model": "m", "messages": MESSAGES, "logprobs": True, "top_logprobs": 20}))
    assert r.num_logprobs == 20


@pytest.mark.parametrize("field, value, bound", [
    ("top_k", 2**63, "[1, 2**63 - 1]"), ("seed", 2**63, "[0, 2**63 - 1]"),
    ("temperature", 100.5, "[0, 100]"), ("logprobs", 21, "[0, 20]"),
    ("repetition_penalty", 0, "(0, 2]"),
])
def test_engine_range_errors_state_the_bound(field, value, bound):
    """What the ingress answers (cluster.api.ingress._sampling_params): a 400 whose
    message starts with the field and states the range."""
    from cluster.errors import ApiError
    from cluster.api.ingress import _sampling_params

    req = CompletionRequest.model_validate_json(json.dumps(
        {"model": "m", "prompt": "x", field: value}))
    with pytest.raises(ApiError) as info:
        _sampling_params(req)
    error = info.value
    assert error.status == 400 and error.param == field and bound in error.message, error.message
