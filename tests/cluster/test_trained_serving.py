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
