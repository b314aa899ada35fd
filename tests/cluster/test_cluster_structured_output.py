"""Structured outputs through the whole path on a local Ray: OpenAI client ->
ingress -> engine replica (`tiny`, decode windows of 4) and back, streamed and
not; bad schemas and grammars are 400s naming the problem."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from cluster_support import serve_app
from structured_output_schemas import SCHEMAS

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

API_KEY = "test-key-so"
APP_ARGS = {"model": "tiny", "num_engine_replicas": 1, "engine_num_cpus": 1,
            "ingress_num_cpus": 0.5, "num_threads": 1, "api_key": API_KEY,
            "max_num_seqs": 32, "num_kv_blocks": 512, "num_scheduler_steps": 4,
            "max_model_len": 1024}
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]


@pytest.fixture(scope="module")
def server():
    with serve_app(APP_ARGS, num_cpus=3) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _schema_format(name):
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_json_schema_streamed_and_not_validate(client, name):
    for seed in (1, 2):
        kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=160, seed=seed,
                      response_format=_schema_format(name))
        whole = client.chat.completions.create(**kwargs)
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMAS[name])
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content  # same seed, same output
        # per-step streaming: the text arrives in pieces, not in one event at the end
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2


def test_completions_json_schema_and_json_object(client):
    out = client.completions.create(model="tiny", prompt="{", max_tokens=160, seed=3,
                                    extra_body={"response_format": _schema_format("pattern")})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["pattern"])
    out = client.completions.create(model="tiny", prompt="{", max_tokens=160, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    # NOTE: a random-weight model may not close an open string within max_tokens
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:
        assert out.choices[0].finish_reason == "length" and out.choices[0].text.startswith("{")


def test_structured_outputs_regex_and_choice_stream(client):
    chunks = client.completions.create(
        model="tiny", prompt="id:", max_tokens=40, seed=4, stream=True,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{2,4}"}})
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{2,4}", text)
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, seed=5,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert out.choices[0].message.content in ("left", "right")


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "object", "required": "a"}}}},
     "response_format", "invalid JSON schema at required"),
    ({"structured_outputs": {"regex": "[a-z"}}, None, "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, None, "missing_rule"),
])
def test_bad_schemas_and_grammars_are_400s_naming_the_problem(server, extra, param, words):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, **extra}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
