"""response_format and structured_outputs without Ray: what reaches the engine's
SamplingParams, the 400s naming the field sent, and the wire round trip."""
from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from cluster.api.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                         validation_error_message)
from cluster.transport.wire import EngineRequest, decode_request, encode_request
from replicas.config import InvalidValue, SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, "x", None]}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def _request(cls, **fields):
    base = {"model": "tiny", "prompt": "hi"} if cls is CompletionRequest else \
        {"model": "tiny", "messages": MESSAGES}
    return cls.model_validate_json(json.dumps({**base, **fields}))


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("fields, spec", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}}}, {"json": SCHEMA}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json": SCHEMA}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, {"grammar": 'start: "x"'}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
])
def test_both_forms_reach_the_engine_on_both_endpoints(cls, fields, spec):
    assert _request(cls, **fields).sampling_params().structured_output == spec


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("fields, param, words", [
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "other than text"),
])
def test_bad_specs_are_400s_naming_the_field_sent(cls, fields, param, words):
    with pytest.raises(InvalidValue) as info:
        _request(cls, **fields).sampling_params()
    assert info.value.param == param and words in str(info.value)
    assert str(info.value).startswith(param)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_object", "json_schema": {"name": "t", "schema": {}}}, "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "t"}}, "response_format.json_schema.schema"),
])
def test_malformed_response_format_is_refused_by_the_model(fmt, param):
    with pytest.raises(ValidationError) as info:
        _request(ChatCompletionRequest, response_format=fmt)
    assert validation_error_message(info.value)[1] == param


def test_the_spec_crosses_the_wire_intact():
    params = _request(CompletionRequest, structured_outputs={"json": SCHEMA}).sampling_params()
    back = decode_request(encode_request(EngineRequest("r", [1, 2], params, "owner")))
    assert back.sampling_params.structured_output == {"json": SCHEMA}


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "object", "required": "a"}},
     "invalid JSON schema: Expected array for 'required'"),
    ({"json": {"properties": {"a": {"type": "strin"}}}}, "invalid JSON schema: Invalid type: strin"),
    ({"json": {"type": 5}}, "invalid JSON schema: type must be a string"),
    ({"regex": "[a-z"}, "unclosed character class"),
    ({"grammar": "start: missing_rule"}, 'unknown name: "missing_rule"'),
])
def test_the_ingress_checks_a_grammar_once_off_its_loop(spec, words):
    """SamplingParams check a spec's shape; its grammar is checked by llguidance in a
    worker (replicas/sampling/grammar_text.py), and what engines get is its text."""
    from replicas.sampling.grammar_text import GrammarChecks

    params = SamplingParams(structured_output=spec)  # the shape is fine
    with pytest.raises(InvalidValue) as info:
        asyncio.run(GrammarChecks().checked(params.structured_output, 100))
    assert info.value.param == "structured_output" and words in str(info.value)
    checked = asyncio.run(GrammarChecks().checked({"json": SCHEMA}, 100))
    assert list(checked) == ["llguidance"] and '"required":["a"]' in checked["llguidance"]


def test_a_grammar_past_the_size_bound_is_refused_before_its_check():
    from replicas.sampling.grammar_text import MAX_GRAMMAR_CHARS, GrammarChecks

    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 90}
                                               for i in range(MAX_GRAMMAR_CHARS // 100)}}
    with pytest.raises(InvalidValue, match="is too large: its grammar has"):
        asyncio.run(GrammarChecks().checked({"json": schema}, MAX_GRAMMAR_CHARS))
