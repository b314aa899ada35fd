"""cluster/ without Ray: request models, SSE formatting, errors, app args, the
replica's chunk type and the serve_local CLI mapping."""
from __future__ import annotations

import dataclasses
import json
import pickle
import sys

import pytest
from pydantic import ValidationError

from cluster.errors import ApiError, ReplicaOverloaded, replica_cause, sse_error_event
from cluster.api.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                         validation_error_message)
from cluster.api.openai_events import (DONE_EVENT, ChatFormatter, CompletionFormatter, TokenLabels,
                                       chat_logprobs, completion_logprobs)
from deltas.types import FinishReason, TokenDelta


def _parse(cls, body: dict | bytes):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return cls.model_validate_json(raw)


def _error(cls, body) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        _parse(cls, body)
    return validation_error_message(info.value)


def test_cluster_package_never_imports_torch():
    import subprocess

    code = ("import sys, cluster.app, cluster.api.ingress, cluster.transport.replica, cluster.serve_local;"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_completion_request_accepts_openai_shapes():
    r = _parse(CompletionRequest, {"model": "tiny", "prompt": "hi"})
    assert (r.max_tokens, r.n, r.stream, r.stop_strings, r.include_usage) == (16, 1, False, [], False)
    assert _parse(CompletionRequest, {"model": "m", "prompt": ["one"]}).prompt == "one"
    assert _parse(CompletionRequest, {"model": "m", "prompt": [[5, 6]]}).prompt == [5, 6]
    assert _parse(CompletionRequest, {"model": "m", "prompt": [5, 6]}).prompt == [5, 6]
    r = _parse(CompletionRequest, {"model": "m", "prompt": "x", "stop": "END", "temperature": 0,
                                   "stream": True, "stream_options": {"include_usage": True}})
    assert r.stop_strings == ["END"] and r.include_usage and r.temperature == 0.0
    params = r.sampling_params()
    assert params.max_tokens == 16 and params.stop_token_ids == () and params.temperature == 0.0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": ["a", ""]}, "prompt"),
    ({"model": "m", "prompt": [[1], []]}, "prompt"),
    ({"model": "m", "prompt": ["a"] * 129}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"], "n": 65}, "prompt"),
    ({"model": "m", "prompt": ["a", [1]]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "n": 129}, "n"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "m", "prompt": "x", "stream_options": {"bogus": 1}}, "stream_options.bogus"),
])
def test_completion_request_rejects_with_param(body, param):
    message, got = _error(CompletionRequest, body)
    assert got == param, message
    assert message


def test_invalid_json_nan_and_non_objects_are_rejected():
    assert _error(CompletionRequest, b'{"model": ')[0].startswith("Invalid JSON")
    assert _error(CompletionRequest, b'{"model":"m","prompt":"x","temperature":NaN}')[1] == \
        "temperature"
    assert _error(CompletionRequest, b'[1, 2]')[0] == "The request body must be a JSON object"
    assert _error(CompletionRequest, b"[" * 1000 + b"]" * 1000)[0].startswith("Invalid JSON")


@pytest.mark.parametrize("escape", [rb"\ud800", rb"\ud800b", rb"\udc00", rb"\udc00\ud800",
                                    rb"\ud800\u0041"])
def test_an_unpaired_surrogate_escape_is_refused_with_the_rule(escape):
    """Text cannot hold half of a UTF-16 pair (the tokenizer has no bytes for it); the
    parser's own words for it ("unexpected end of hex escape") name no rule."""
    message, param = _error(CompletionRequest, b'{"model":"m","prompt":"a' + escape + b'"}')
    assert message.startswith("Invalid JSON body") and param is None
    assert "escapes come in pairs, a \\uD800-\\uDBFF then a \\uDC00-\\uDFFF" in message
    assert _error(CompletionRequest, rb'{"model":"m","prompt":"a\u12"}')[0] == \
        "Invalid JSON body: Invalid JSON: invalid escape at line 1 column 29"


def test_chat_request_fields():
    r = _parse(ChatCompletionRequest, {
        "model": "m", "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]})
    assert r.requested_max_tokens == 7 and r.num_logprobs == 3
    assert r.template_messages() == [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "ab"}]
    assert _parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "x"}]}).requested_max_tokens is None
    assert _error(ChatCompletionRequest, {"model": "m", "messages": []})[1] == "messages"
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "wizard", "content": "x"}]})[1] == "messages.0.role"


def test_only_an_assistant_message_may_come_without_content():
    for role in ("system", "developer", "user"):
        for message in ({"role": role, "content": None}, {"role": role}):
            msg, param = _error(ChatCompletionRequest, {"model": "m", "messages": [
                {"role": "user", "content": "hi"}, message]})
            assert param == "messages.1" and f"a {role} message needs content" in msg, msg
    req = _parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": ""}, {"role": "assistant", "content": None}]})
    assert req.template_messages() == [{"role": "user", "content": ""},
                                       {"role": "assistant", "content": ""}]


def test_completion_chunks_are_openai_shaped():
    fmt = CompletionFormatter("cmpl-1", "tiny", 123, include_usage=True)
    event = fmt.chunk_event('he said "hi"\n')
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    obj = json.loads(event[6:])
    assert obj == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "tiny",
                   "choices": [{"index": 0, "text": 'he said "hi"\n', "logprobs": None,
                                "finish_reason": None}], "usage": None}
    last = json.loads(fmt.chunk_event("", "stop", None, "END")[6:])
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["stop_reason"] == "END"
    usage = json.loads(fmt.usage_event(3, 5)[6:])
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert DONE_EVENT == b"data: [DONE]\n\n"
    no_usage = json.loads(CompletionFormatter("c", "m", 1).chunk_event("x")[6:])
    assert "usage" not in no_usage
    so_far = json.loads(fmt.chunk_event("x", "length", None, None, 2, (7, 4))[6:])
    assert so_far["choices"][0]["index"] == 2 and so_far["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_continuous_usage_needs_include_usage_as_vllms_does():
    def continuous(options):
        return _parse(CompletionRequest, {"model": "m", "prompt": "x", "stream": True,
                                          "stream_options": options}).continuous_usage

    assert continuous({"include_usage": True, "continuous_usage_stats": True})
    assert not continuous({"continuous_usage_stats": True})
    assert not continuous({"include_usage": True})


def test_chat_chunks_carry_role_first_then_content_then_empty_delta():
    fmt = ChatFormatter("chatcmpl-1", "tiny", 5)
    first = json.loads(fmt.chunk_event("Hel")[6:])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert json.loads(fmt.chunk_event("lo")[6:])["choices"][0]["delta"] == {"content": "lo"}
    last = json.loads(fmt.chunk_event("", "length")[6:])["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    body = fmt.response_of([fmt.choice(0, "Hello", "stop", None, None)], 4, 2)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["usage"]["total_tokens"] == 6 and body["object"] == "chat.completion"


def test_completion_logprobs_offsets():
    lp = completion_logprobs([1, 2], [-0.1, -0.2], [[(1, -0.1)], [(2, -0.2)]],
                             {1: "ab", 2: "c"}.__getitem__, text_offset=10)
    assert lp == {"tokens": ["ab", "c"], "token_logprobs": [-0.1, -0.2],
                  "top_logprobs": [{"ab": -0.1}, {"c": -0.2}], "text_offset": [10, 12]}


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny"])
def test_chat_logprob_bytes_are_each_tokens_own_and_join_into_the_text(model):
    """An emoji spans several byte-level tokens, each of whose text alone is U+FFFD:
    `bytes` carries the token's own bytes, so a client can join the character."""
    from deltas.tokenization.tokenizer import Tokenizer
    from replicas.checkpoints.presets import resolve_tokenizer_dir

    tok = Tokenizer.from_dir(resolve_tokenizer_dir(model))
    text = "ok \U0001F600 n\u00e9e \u4e2d\u6587"
    ids = tok.encode(text, add_special_tokens=False)
    labels = TokenLabels.of_tokenizer(tok)
    lp = chat_logprobs(ids, [-0.5] * len(ids), [[(i, -0.5)] for i in ids], labels)
    entries = lp["content"]
    assert any(e["token"] == "\ufffd" for e in entries)  # some token holds part of a character
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    assert [e["top_logprobs"][0]["bytes"] for e in entries] == [e["bytes"] for e in entries]


def test_a_sentencepiece_tokens_text_keeps_the_space_its_bytes_carry():
    """A Metaspace piece ("▁wor") decoded alone drops its leading space; its label
    keeps it, as its bytes do, so "▁the" and "the" stay two keys of completions'
    top_logprobs. A piece of a character is U+FFFD, as before."""
    from deltas_tokenizers import sentencepiece_tokenizer

    tok = sentencepiece_tokenizer("llama2")
    ids = tok.encode("hello world \U0001F600", add_special_tokens=False)
    labels = TokenLabels.of_tokenizer(tok)
    entries = chat_logprobs(ids, [-0.5] * len(ids), None, labels)["content"]
    assert "".join(e["token"] for e in entries).startswith(" hello world ")
    assert " wor" in [e["token"] for e in entries]  # "wor" when decoded alone
    for e in entries:
        assert e["token"] in (bytes(e["bytes"]).decode("utf-8", "replace"), "\ufffd")
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == " hello world \U0001F600"
    wor, bare = tok.backend.token_to_id("▁wor"), tok.backend.token_to_id("wor")
    tops = completion_logprobs([wor], [-0.1], [[(wor, -0.1), (bare, -2.0)]], labels.text,
                               0)["top_logprobs"]
    assert tops == [{" wor": -0.1, "wor": -2.0}]


def test_chat_logprob_bytes_fall_back_to_the_texts_encoding():
    """Where the decoder cannot be mapped to bytes (token_bytes gives None)."""
    labels = TokenLabels({7: "h\u00e9"}.__getitem__, lambda i: None)
    entry = chat_logprobs([7], [-0.1], None, labels)["content"][0]
    assert entry == {"token": "h\u00e9", "logprob": -0.1, "bytes": [104, 195, 169],
                     "top_logprobs": []}


def test_errors_have_openai_shape_and_retry_after():
    err = ApiError(429, "busy", code="rate_limit_exceeded", retry_after_s=0.2)
    resp = err.response()
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    body = json.loads(resp.body)
    assert body == {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                              "code": "rate_limit_exceeded"}}
    assert ApiError(400, "x", param="p").headers() is None
    event = sse_error_event(ApiError(500, "boom"))
    assert json.loads(event[6:])["error"]["type"] == "server_error"
    assert b"[DONE]" not in event


def test_replica_errors_pickle_and_unwrap():
    err = pickle.loads(pickle.dumps(ReplicaOverloaded("full", 2.5)))
    assert (err.message, err.retry_after_s) == ("full", 2.5)

    class Wrapped(Exception):
        cause = err

    assert replica_cause(Wrapped()) is err
    plain = ValueError("x")
    assert replica_cause(plain) is plain


def test_relay_maps_replica_errors_to_http():
    from cluster.errors import ReplicaRejected
    from cluster.transport.relay import replica_error

    e = replica_error(ReplicaOverloaded("queue full", 3.0))
    assert e.status == 429 and e.headers() == {"Retry-After": "3"}
    assert replica_error(ReplicaRejected("token id 9 out of range")).status == 400
    lost = replica_error(RuntimeError("actor died"))
    assert lost.status == 503 and lost.headers() == {"Retry-After": "1"}


def test_wire_format_round_trips_and_crosses_as_one_bytes_object():
    from ray import cloudpickle
    from ray._private.serialization import SerializationContext
    from ray._private.worker import global_worker

    from cluster.transport.wire import (EngineRequest, decode_request, decode_step, encode_request,
                                        encode_step)
    from replicas.config import SamplingParams

    delta = TokenDelta("r", [1, 2], logprobs=[-0.1, -0.2], top_logprobs=[[(1, -0.1)], [(2, -0.2)]],
                       finish_reason=FinishReason.STOP, stop_reason=3, num_prompt_tokens=4,
                       num_output_tokens=2)
    plain = TokenDelta("r", [7], num_output_tokens=1)
    message = encode_step([delta, plain])
    assert decode_step(message) == [delta, plain]
    assert decode_step(encode_step([])) == []
    request = EngineRequest("r", [1, 2], SamplingParams(max_tokens=3, stop_token_ids=(5,)), "ing-1")
    wire = encode_request(request)
    assert decode_request(wire) == request
    assert decode_request(wire).sampling_params.stop_token_ids == (5,)
    # Both cross as one bytes object: Serve's by-value path pickles it as a plain
    # copy, and Ray's object store keeps it as raw bytes ("RAW"), not the
    # cloudpickle fallback ("PYTHON").
    for data in (message, wire):
        assert type(data) is bytes and cloudpickle.loads(cloudpickle.dumps(data)) == data
        assert SerializationContext(global_worker).serialize(data).metadata == b"RAW"


def test_app_args_map_onto_engine_config_and_deployment_options():
    from cluster.app import AppArgs

    args = AppArgs.model_validate({"model": "tiny", "max_num_seqs": 32,
                                   "max_waiting_requests": 100, "engine_num_gpus": 1,
                                   "num_scheduler_steps": 4, "release_per_step": False})
    cfg = args.engine_config()
    assert (cfg.max_num_seqs, cfg.num_scheduler_steps, cfg.release_per_step, cfg.device) == \
        (32, 4, False, "cuda")
    engine = args.engine_options()
    assert engine["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    assert engine["max_ongoing_requests"] >= 32 + 100
    assert engine["num_replicas"] == 1
    assert args.ingress_options()["max_ongoing_requests"] >= 1000
    scaled = AppArgs.model_validate({"autoscaling": {"min_replicas": 1, "max_replicas": 8}})
    assert "num_replicas" not in scaled.engine_options()
    assert scaled.engine_options()["autoscaling_config"]["max_replicas"] == 8
    for bad in ({"block_size": 3}, {"num_scheduler_steps": 0}, {"typo_field": 1},
                {"autoscaling": {"max_replicas": 2}, "num_engine_replicas": 2}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_build_app_returns_a_serve_application():
    from ray.serve import Application

    from cluster.app import build_app

    assert isinstance(build_app({"model": "tiny", "num_engine_replicas": 2}), Application)


def test_context_check_says_the_limits():
    from cluster.api.ingress import _check_limits
    from replicas.config import SamplingParams
    from replicas.request_validation import RequestLimits

    limits = RequestLimits(vocab_size=8192, max_model_len=100, eos_token_ids=(2,))
    assert _check_limits(limits, [[1] * 10], SamplingParams(max_tokens=None)) == [90]
    assert _check_limits(limits, [[1] * 10], SamplingParams(max_tokens=90)) == [90]
    assert _check_limits(limits, [[1] * 10, [1] * 30], SamplingParams(max_tokens=None)) == [90, 70]
    with pytest.raises(ApiError) as info:
        _check_limits(limits, [[1] * 10], SamplingParams(max_tokens=91))
    assert info.value.status == 400 and "100" in info.value.message and "101" in info.value.message
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    assert not info.value.message.startswith("Prompt")
    with pytest.raises(ApiError) as info:
        _check_limits(limits, [[1] * 100], SamplingParams(max_tokens=1))
    assert info.value.param == "prompt"
    for prompt, params, param in (([1, 8192], SamplingParams(), "prompt"),
                                  ([1], SamplingParams(stop_token_ids=[8192]), "stop_token_ids")):
        with pytest.raises(ApiError) as info:
            _check_limits(limits, [prompt], params)
        assert info.value.param == param and "8192" in info.value.message
    # a batch's refusal names the prompt
    with pytest.raises(ApiError) as info:
        _check_limits(limits, [[1], [1] * 100, [1, 8192]], SamplingParams(max_tokens=1))
    assert info.value.param == "prompt" and info.value.message.startswith("Prompt 1 of the batch: ")
    # ... but not a refusal of the request's own fields
    with pytest.raises(ApiError) as info:
        _check_limits(limits, [[1], [2]], SamplingParams(stop_token_ids=[8192]))
    assert info.value.param == "stop_token_ids" and not info.value.message.startswith("Prompt")


def test_a_developer_message_takes_the_system_prompts_place():
    from types import SimpleNamespace

    from cluster.api.ingress import developer_role
    from deltas.tokenization.tokenizer import Tokenizer
    from tests import trained_model

    chat = [{"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]
    req = _parse(ChatCompletionRequest, {"model": "m", "messages": chat})
    assert req.template_messages()[0] == {"role": "system", "content": "Answer briefly."}
    assert req.template_messages("developer")[0]["role"] == "developer"
    # SmolLM2's template knows no developer role: the message renders as the system
    # prompt, in place of the template's default one (not after it)
    tokenizer = Tokenizer.from_dir(trained_model.model_dir())
    role = developer_role(tokenizer)
    as_system = [{"role": "system", "content": "Answer briefly."}, chat[1]]
    assert role == "system"
    assert (tokenizer.apply_chat_template(req.template_messages(role))
            == tokenizer.apply_chat_template(as_system))
    knows_it = SimpleNamespace(chat_templates={"default": "{% if m.role == 'developer' %}"})
    assert developer_role(knows_it) == "developer"


def test_chat_length_bound_counts_every_message_before_the_template():
    from types import SimpleNamespace

    from cluster.api.ingress import DEFAULT_MAX_BODY_BYTES, Ingress, _max_token_chars, _prompt_chars
    from deltas.tokenization.tokenizer import Tokenizer
    from replicas.checkpoints.presets import PRESETS, resolve_tokenizer_dir

    tokenizer = Tokenizer.from_dir(resolve_tokenizer_dir("tiny"))
    # A bound: never more characters than the chat template makes.
    req = _parse(ChatCompletionRequest, {"model": "tiny", "messages": [
        {"role": "system", "content": ""}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]})
    rendered = tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=False)
    assert 3 < _prompt_chars(req, True)[0] <= len(rendered)
    # A body at the size limit of nothing but empty messages (an assistant's may
    # leave its content out): 400 before the template and the tokenizer (seconds of
    # CPU for 1.3M tokens) run.
    message = b'{"role":"assistant"},'
    num_messages = (DEFAULT_MAX_BODY_BYTES - 64) // len(message)
    body = b'{"model":"tiny","messages":[' + (message * num_messages)[:-1] + b']}'
    assert len(body) <= DEFAULT_MAX_BODY_BYTES
    req = ChatCompletionRequest.model_validate_json(body)
    ingress = SimpleNamespace(_max_token_chars=_max_token_chars(tokenizer))
    max_model_len = PRESETS["tiny"]["max_position_embeddings"]
    with pytest.raises(ApiError) as info:
        Ingress.func_or_class._check_prompt_chars(ingress, req, True, max_model_len)
    assert info.value.status == 400 and info.value.param == "messages"
    assert info.value.code == "context_length_exceeded"
    assert f"{num_messages} messages" in info.value.message
    # a completions batch: each prompt is bounded, the refusal names the one past it
    max_chars = max_model_len * ingress._max_token_chars * 4
    batch = _parse(CompletionRequest, {"model": "tiny", "prompt": ["hi", "x" * (max_chars + 1)]})
    with pytest.raises(ApiError) as info:
        Ingress.func_or_class._check_prompt_chars(ingress, batch, False, max_model_len)
    assert info.value.param == "prompt"
    assert info.value.message.startswith(f"Prompt 1 of the batch has {max_chars + 1} characters")
    fits = _parse(CompletionRequest, {"model": "tiny", "prompt": ["hi", "x" * max_chars]})
    assert Ingress.func_or_class._check_prompt_chars(ingress, fits, False, max_model_len) == \
        2 + max_chars


def test_each_request_counts_one_status_a_client_gone_before_its_answer_499():
    import asyncio
    from types import SimpleNamespace

    from cluster.api.ingress import CLIENT_CLOSED_REQUEST, Ingress

    def ingress_whose_answer(outcome):
        async def generate(request, chat):
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        counted = []
        return SimpleNamespace(_generate=generate,
                               _count=lambda route, status: counted.append((route, status))
                               ), counted

    handle = Ingress.func_or_class._handle
    for outcome, status in ((asyncio.CancelledError(), CLIENT_CLOSED_REQUEST),
                            (ApiError(429, "busy"), 429),
                            (SimpleNamespace(status_code=200), 200)):
        ingress, counted = ingress_whose_answer(outcome)
        try:
            asyncio.run(handle(ingress, None, chat=True))
        except BaseException as e:  # noqa: BLE001 - the outcome raised again
            assert e is outcome
        assert counted == [("chat", status)]


def test_a_model_card_answers_while_no_engine_replica_does(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from cluster.api import ingress as ingress_module

    async def never():
        await asyncio.sleep(3600)

    async def lost():
        raise ApiError(503, "no engine replica", code="engine_unavailable")

    async def known():
        return {"max_model_len": 2048}

    monkeypatch.setattr(ingress_module, "MODEL_CARD_INFO_WAIT_S", 0.05)
    card_of = ingress_module.Ingress.func_or_class._model_card
    for info, max_model_len in ((never, None), (lost, None), (known, 2048)):
        fake = SimpleNamespace(_served_model_name="m", _created=1, _model="tiny", _info=info)
        card = asyncio.run(card_of(fake))
        assert card["id"] == "m" and card.get("max_model_len") == max_model_len


def test_serve_local_flags_override_config(tmp_path):
    from cluster.serve_local import app_args, curl_line, parse_args

    args, host, port = app_args(parse_args([
        "--model", "tiny", "--port", "9001", "--num-scheduler-steps", "4",
        "--release-per-window", "--no-async-output",
        "--max-num-seqs", "8", "--num-engine-replicas", "2", "--num-ingress-replicas", "2",
        "--num-cpus", "4"]))
    assert (host, port) == ("127.0.0.1", 9001)
    assert args == {"model": "tiny", "num_scheduler_steps": 4, "max_num_seqs": 8,
                    "num_engine_replicas": 2, "num_ingress_replicas": 2,
                    "release_per_step": False, "async_output": False}
    args, host, port = app_args(parse_args(["--config", "configs/serve.yaml",
                                            "--max-num-seqs", "3"]))
    assert args["max_num_seqs"] == 3 and port == 8000
    assert "request_timeout_s" in args  # read from the config
    line = curl_line("http://127.0.0.1:8000", "tiny", has_key=False)
    assert line.startswith("curl -sN http://127.0.0.1:8000/v1/completions") and '"stream": true' in line


@pytest.mark.parametrize("request_class, body", [
    (CompletionRequest, {"model": "tiny", "prompt": "hi"}),
    (ChatCompletionRequest, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_sampling_fields_left_out_take_the_engines_defaults(request_class, body):
    from replicas.config import SamplingParams

    req = request_class.model_validate(body)
    # max_tokens is the API's own default (16 for completions, the context for chat)
    params = dataclasses.replace(req.sampling_params(), max_tokens=16)
    assert params == SamplingParams(max_tokens=16)
