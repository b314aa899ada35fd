"""Every sampling value SamplingParams accepts is one the batched sampler can run:
integers fit int64, no row's logits or probabilities turn NaN or Inf, tiny floats
are normalised (greedy below a floor, raised to a safe minimum above it), and
every bound is stated in the error. Sampler only: no model."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicas.config import SamplingParams
from replicas.request import Request
from replicas.sampling.sampler import (adjusted_logits, build_sampling_batch, probe_rows,
                                       sample_no_sync, sampling_probs)

V = 512
CPU = torch.device("cpu")


@pytest.mark.parametrize("field, value, bound", [
    ("top_k", 2**63, "[1, 2**63 - 1]"),
    ("top_k", 0, "-1 (all)"),
    ("seed", 2**63, "[0, 2**63 - 1]"),
    ("max_tokens", 2**63, "[1, 2**63 - 1]"),
    ("min_tokens", 2**63, "[0, 2**63 - 1]"),
    ("temperature", 10**400, "[0, 100]"),
    ("temperature", 100.5, "[0, 100]"),
    ("top_p", 0.0, "(0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("presence_penalty", -2.5, "[-2, 2]"),
    ("frequency_penalty", 2.5, "[-2, 2]"),
    ("repetition_penalty", 0.0, "(0, 2]"),
    ("logprobs", 21, "[0, 20]"),
    ("stop_token_ids", [2**63], "at most 1024 integers"),
    ("stop_token_ids", list(range(1025)), "at most 1024 integers"),
])
def test_out_of_range_values_are_refused_with_the_bound_stated(field, value, bound):
    extra = {"max_tokens": None} if field == "min_tokens" else {}
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value, **extra})
    message = str(info.value)
    assert message.startswith(field + " ") and bound in message, message


@pytest.mark.parametrize("kwargs, field, expected", [
    ({"temperature": 1e-300}, "temperature", 0.0),  # float32 would make it 0: NaN
    ({"temperature": 5e-324}, "temperature", 0.0),
    ({"temperature": 9.9e-6}, "temperature", 0.0),
    ({"temperature": 1e-5}, "temperature", 0.01),
    ({"temperature": 0.005}, "temperature", 0.01),
    ({"temperature": 0.01}, "temperature", 0.01),
    ({"temperature": -0.0}, "temperature", 0.0),
    ({"top_p": 1e-300}, "top_p", 1e-6),
    ({"top_p": 0.5}, "top_p", 0.5),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", 0.01),
    ({"repetition_penalty": 1.2}, "repetition_penalty", 1.2),
    ({"top_k": 2**63 - 1}, "top_k", 2**63 - 1),  # accepted; the sampler clamps it
])
def test_tiny_values_are_normalised(kwargs, field, expected):
    assert getattr(SamplingParams(**kwargs), field) == expected


def _request(i: int, params: SamplingParams, outputs: list[int] = (),
             stop_ids: frozenset = frozenset({1})) -> Request:
    req = Request(f"r{i}", [3, 4, 5, 6], params, None, stop_ids, 10**6)
    req.output_token_ids = list(outputs)
    return req


def _logits(rows: int, top: int, seed: int = 0, scale: float = 8.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * scale
    logits[:, top] = logits.max() + 5.0  # a clear top token, away from id 0
    return logits


@pytest.mark.parametrize("kwargs, expected", [
    ({"temperature": 1e-300}, 77), ({"temperature": 0.004}, 77),
    ({"temperature": 1.0, "top_p": 1e-300}, 77),
    ({"temperature": 1.0, "top_k": 2**63 - 1, "top_p": 1e-300}, 77),
    ({"temperature": 1.0, "min_p": 1.0}, 77),
    # a tiny repetition penalty boosts the seen tokens (the prompt's 3..6) 100-fold
    ({"temperature": 1e-3, "repetition_penalty": 1e-300}, 6),
])
def test_extreme_rows_sample_the_top_token_not_garbage(kwargs, expected):
    # NaN probabilities would pick id 0 (the first NaN), not the clear top token.
    rows = [_request(i, SamplingParams(seed=i, **kwargs)) for i in range(4)]
    sb = build_sampling_batch(rows, V, CPU)
    logits = _logits(4, top=77)
    logits[:, 6] = logits[:, 77] - 1.0  # the best seen token: second overall
    sampled, packed = sample_no_sync(logits, sb)
    assert sampled.tolist() == [expected] * 4


_FLOATS_0_1 = st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-6, 1.0]),
                        st.floats(0.0, 1.0, allow_nan=False))


@st.composite
def accepted_params(draw) -> SamplingParams:
    """Any SamplingParams the API accepts, edges first."""
    temperature = draw(st.one_of(
        st.sampled_from([0.0, 5e-324, 1e-300, 1e-5, 0.009, 0.01, 100.0]),
        st.floats(0.0, 100.0, allow_nan=False)))
    top_p = draw(st.one_of(st.sampled_from([5e-324, 1e-300, 1e-6, 1.0]),
                           st.floats(1e-300, 1.0, allow_nan=False)))
    top_k = draw(st.one_of(st.just(-1), st.sampled_from([1, V - 1, V, V + 1, 2**63 - 1]),
                           st.integers(1, 2**63 - 1)))
    penalty = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2.0, 2.0, allow_nan=False))
    repetition = st.one_of(st.sampled_from([5e-324, 1e-300, 0.01, 1.0, 2.0]),
                           st.floats(5e-324, 2.0, allow_nan=False))
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=draw(_FLOATS_0_1),
        seed=draw(st.one_of(st.none(), st.sampled_from([0, 2**63 - 1]),
                            st.integers(0, 2**63 - 1))),
        max_tokens=None, min_tokens=draw(st.sampled_from([0, 1, 5, 2**63 - 1])),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, V - 1), max_size=8))),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        presence_penalty=draw(penalty), frequency_penalty=draw(penalty),
        repetition_penalty=draw(repetition))


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(accepted_params(), min_size=1, max_size=6), st.integers(0, 2**16),
       st.sampled_from([1.0, 8.0, 60.0]))
def test_no_accepted_value_makes_nan_inf_or_an_overflow(params, seed, scale):
    rows = [_request(i, p, outputs=[(7 * i + j) % V for j in range(i * 3)],
                     stop_ids=frozenset(p.stop_token_ids) | {1})
            for i, p in enumerate(params)]
    sb = build_sampling_batch(rows, V, CPU)
    logits = _logits(len(rows), top=77, seed=seed, scale=scale)
    adjusted = adjusted_logits(logits, sb)
    assert not adjusted.isnan().any() and not (adjusted == math.inf).any()
    if not sb.all_greedy:
        probs = sampling_probs(adjusted, sb)
        assert probs.isfinite().all() and (probs.sum(dim=-1) > 0).all()
    sampled, packed = sample_no_sync(logits, sb)
    ids = sampled.tolist()
    assert all(0 <= t < V for t in ids)
    assert packed.isfinite().all()
    assert probe_rows(rows, V, CPU) == []  # each row also samples alone


def test_probe_leaves_a_seeded_generator_as_it_was():
    row = _request(0, SamplingParams(temperature=1.0, seed=42))
    sb = build_sampling_batch([row], V, CPU)
    state = row.generator.get_state()
    assert probe_rows([row], V, CPU) == []
    assert torch.equal(row.generator.get_state(), state)
    fresh = _request(1, SamplingParams(temperature=1.0, seed=42))
    assert probe_rows([fresh], V, CPU) == [] and fresh.generator is None
