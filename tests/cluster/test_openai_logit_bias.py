"""logit_bias at the ingress, without Ray: both endpoints take OpenAI's string keys,
the engine gets token ids, and each bad value is an InvalidValue naming the field
(the ingress answers it with a 400)."""
from __future__ import annotations

import json

import pytest

from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from replicas.config import InvalidValue

_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
_COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("cls, body", [(CompletionRequest, _COMPLETION),
                                       (ChatCompletionRequest, _CHAT)])
def test_string_keys_become_token_ids(cls, body):
    req = cls.model_validate_json(json.dumps({**body, "logit_bias": {"17": -100, "5": 100.0}}))
    assert req.sampling_params().logit_bias == ((5, 100.0), (17, -100.0))
    assert cls.model_validate_json(json.dumps({**body, "logit_bias": {}})).sampling_params(
    ).logit_bias == ()


@pytest.mark.parametrize("bias", [{"x": 1}, {"-1": 1}, {" 5": 1}, {"1" * 5000: 1}, {"5": 100.5},
                                  {str(2**63): 1}, {str(i): 1 for i in range(301)}])
def test_bad_keys_and_values_name_the_field(bias):
    req = CompletionRequest.model_validate_json(json.dumps({**_COMPLETION, "logit_bias": bias}))
    with pytest.raises(InvalidValue) as e:
        req.sampling_params()
    assert e.value.param == "logit_bias" and len(str(e.value)) < 20_000
