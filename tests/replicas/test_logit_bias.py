"""logit_bias: checked once in SamplingParams (and the vocabulary in RequestLimits),
crosses the wire, and the batched sampler adds each row's bias at every step of a
window: -100 bans a token, +100 forces it, greedy rows included, other rows
untouched."""
from __future__ import annotations

import math

import pytest
import torch

from cluster.transport.wire import EngineRequest, decode_request, encode_request
from replicas import Engine, EngineConfig, SamplingParams
from replicas.config import MAX_LOGIT_BIAS_ENTRIES, InvalidValue
from replicas.request import Request
from replicas.request_validation import RequestLimits
from replicas.sampling.sampler import build_sampling_batch, sample_no_sync

CPU = torch.device("cpu")


def test_a_dict_becomes_sorted_pairs_and_crosses_the_wire():
    params = SamplingParams(logit_bias={9: 1, 3: -100.0, 5: 100})
    assert params.logit_bias == ((3, -100.0), (5, 100.0), (9, 1.0))
    assert SamplingParams(logit_bias=[(5, 100), (3, -100)]).logit_bias == params.logit_bias[:2]
    assert SamplingParams().logit_bias == () and SamplingParams(logit_bias=None).logit_bias == ()
    request = EngineRequest("r", [1, 2], params, "owner")
    assert decode_request(encode_request(request)) == request
    hash(params)  # NOTE: still hashable plain data


@pytest.mark.parametrize("bias", [
    {1: 100.5}, {1: -101}, {1: math.nan}, {1: math.inf}, {1: "1"}, {-1: 1}, {True: 1},
    {"1": 1}, {2**63: 1}, {i: 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, "ab", 5,
])
def test_out_of_range_values_are_refused_naming_the_field(bias):
    with pytest.raises(InvalidValue) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"
    assert len(str(e.value)) < 300  # the first bad entry or the count, not the whole map


def test_the_bounds_themselves_are_accepted():
    bias = {i: (-100 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS_ENTRIES)}
    assert len(SamplingParams(logit_bias=bias).logit_bias) == MAX_LOGIT_BIAS_ENTRIES


def test_keys_past_the_vocabulary_are_refused():
    limits = RequestLimits(vocab_size=100, max_model_len=64, eos_token_ids=(1,))
    limits.check([5, 6], SamplingParams(logit_bias={99: 5}))
    with pytest.raises(InvalidValue) as e:
        limits.check([5, 6], SamplingParams(logit_bias={3: 5, 100: 5}))
    assert e.value.param == "logit_bias"


def _row(i: int, params: SamplingParams) -> Request:
    return Request(f"r{i}", [3, 4, 5, 6], params, None, frozenset({1}), 10**6)


def test_the_batch_bans_and_forces_per_row_at_every_step():
    V = 64
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 5
    top = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias={top[0]: -100}),  # banned: the runner-up
        SamplingParams(temperature=0.0, logit_bias={7: 100}),  # forced under greedy
        SamplingParams(temperature=1.0, seed=3, logit_bias={11: 100, top[2]: -100}),  # forced
        SamplingParams(temperature=0.0),  # untouched
        SamplingParams(temperature=0.0, logit_bias={top[4]: -3.0, 0: 0.5}),  # small biases add
    ]
    rows = [_row(i, p) for i, p in enumerate(params)]
    batch = build_sampling_batch(rows, V, CPU)
    expected_logits = logits.clone()
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            expected_logits[i, t] += b
    expected = expected_logits.argmax(dim=-1).tolist()
    expected[2] = 11
    assert expected[0] != top[0] and expected[1] == 7 and expected[3] == top[3]
    for _ in range(8):  # NOTE: a window reuses one batch: the bias holds at every step
        sampled, _ = sample_no_sync(logits.clone(), batch)
        assert sampled.tolist() == expected


def test_logprobs_stay_those_of_the_raw_logits():
    V = 32
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 100})
    sampled, packed = sample_no_sync(logits.clone(), build_sampling_batch([_row(0, params)], V, CPU))
    assert sampled.tolist() == [5]
    assert packed[0, 1].item() == pytest.approx(logits.log_softmax(-1)[0, 5].item(), abs=1e-5)


def _greedy(max_tokens=24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


PROMPTS = [[17, 402, 3001, 77, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=8)) as e:
        yield e


def test_the_engine_honours_bias_in_windows_of_eight_steps(engine):
    plain = [o.token_ids for o in engine.generate(PROMPTS, _greedy())]
    banned = {t: -100 for t in set(plain[0])}
    params = [
        _greedy(logit_bias=banned),
        _greedy(),  # a neighbour without bias keeps its output
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True,
                       logit_bias={4242: 100}),
    ]
    outs = [o.token_ids for o in engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[1]], params)]
    assert not set(outs[0]) & set(banned) and len(outs[0]) == 24
    assert outs[1] == plain[1]
    assert outs[2] == [4242] * 24
    # windows of one step give the same tokens
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=1, async_output=False)) as single:
        assert [o.token_ids for o in single.generate([PROMPTS[0]], params[:1])] == outs[:1]


def test_the_engine_refuses_keys_past_its_vocabulary(engine):
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([5, 6], _greedy(logit_bias={10**6: 1}))
