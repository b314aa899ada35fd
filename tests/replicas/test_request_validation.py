"""Request validation and the KV budget check: what the engine refuses, and why,
without loading a model."""
from __future__ import annotations

import pytest

from replicas.config import EngineConfig, SamplingParams
from replicas.kv_cache.kv_budget import blocks_per_sequence, make_block_manager
from replicas.request_validation import RequestLimits
from tests.delta_sinks import ListSink

LIMITS = RequestLimits(vocab_size=100, max_model_len=16, eos_token_ids=(3,))


def make(prompt, params=SamplingParams(), request_id="r", in_use=()):
    return LIMITS.make_request(request_id, prompt, params, ListSink(request_id), set(in_use))


@pytest.mark.parametrize("prompt, message", [
    ([], "non-empty list"),
    ((1, 2), "non-empty list"),
    ([1, 100], r"integers in \[0, 100\)"),
    ([1, -1], r"integers in \[0, 100\)"),
    ([1, True], r"integers in \[0, 100\)"),
    (list(range(16)), "at most 15"),
])
def test_bad_prompts_are_refused_naming_the_rule(prompt, message):
    with pytest.raises(ValueError, match=message):
        make(prompt)


def test_stop_ids_past_the_vocabulary_duplicate_ids_and_non_params_are_refused():
    with pytest.raises(ValueError, match="stop_token_ids"):
        make([1], SamplingParams(stop_token_ids=[100]))
    with pytest.raises(ValueError, match="already in use"):
        make([1], in_use={"r"})
    with pytest.raises(ValueError, match="SamplingParams"):
        make([1], {"max_tokens": 4})


def test_output_room_and_stop_ids_follow_the_context_and_eos():
    req = make([1] * 10, SamplingParams(max_tokens=None, stop_token_ids=[7]))
    assert req.max_output_tokens == 6 and req.stop_token_ids == {3, 7}
    req = make([1] * 10, SamplingParams(max_tokens=2, ignore_eos=True))
    assert req.max_output_tokens == 2 and req.stop_token_ids == frozenset()


def test_a_kv_budget_too_small_for_one_sequence_fails_at_start_up():
    config = EngineConfig(block_size=16, num_scheduler_steps=8)
    needed = blocks_per_sequence(64, 8, 16)
    assert needed == 5  # 64 tokens of context and 8 lookahead slots
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        make_block_manager(needed - 1, config, max_model_len=64)
    assert make_block_manager(needed, config, max_model_len=64).num_blocks == needed


def test_every_refusal_names_its_field_and_the_api_rule_refuses_what_the_engine_cuts():
    from replicas.config import InvalidValue

    cases = [([], SamplingParams(), "prompt"), ([1, 100], SamplingParams(), "prompt"),
             (list(range(16)), SamplingParams(), "prompt"),
             ([1], SamplingParams(stop_token_ids=[100]), "stop_token_ids")]
    for prompt, params, param in cases:
        with pytest.raises(InvalidValue) as info:
            LIMITS.check(prompt, params)
        assert info.value.param == param, info.value
    with pytest.raises(InvalidValue) as info:
        SamplingParams(top_p=0)
    assert info.value.param == "top_p"
    # 10 prompt tokens leave 6 of 16: the engine cuts max_tokens=8 to 6, the API refuses it
    assert LIMITS.check([1] * 10, SamplingParams(max_tokens=8)) == 6
    with pytest.raises(InvalidValue) as info:
        LIMITS.check([1] * 10, SamplingParams(max_tokens=8), must_fit=True)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    assert LIMITS.check([1] * 10, SamplingParams(max_tokens=6), must_fit=True) == 6
