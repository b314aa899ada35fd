"""Top-k / top-p rows on a CPU sample from their top candidates
(replicas/sampling/candidates.py): the same distribution as the whole-vocabulary sort
(chi-square against `sampling_probs`) at every width a row can take, from a first
handful of candidates to the whole-vocabulary fallback, and each row's choices its
own, so a seeded row draws the same tokens beside rows of any other width. Sampler
only: no model."""
from __future__ import annotations

import pytest
import torch

from replicas.config import SamplingParams
from replicas.sampling import candidates, sampler
from replicas.sampling.candidates import FIRST_WIDTH, WIDTH_GROWTH, plan_candidates, top_k_width
from replicas.sampling.sampler import build_sampling_batch, sample_no_sync, sampling_probs
from tests.sampling_support import CPU, chi_square, chi_square_limit, sampled_counts, sampler_row

V = 2048  # the widths 64, 256 and 1024 below the whole vocabulary


def _logits(spread: float, seed: int = 11) -> torch.Tensor:
    """One row: a few tokens well ahead and a long tail, `spread` sets how peaked."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * spread + torch.linspace(8.0, 0.0, V)[torch.randperm(V, generator=g)]


def _assert_follows_the_sort(params: SamplingParams, logits: torch.Tensor,
                             num_rounds: int = 60) -> int:
    counts, sb = sampled_counts(params, logits, 1024 * num_rounds, num_rows=1024)
    assert sb.candidates is not None  # the CPU path under test
    probs = sampling_probs(logits.unsqueeze(0), build_sampling_batch(
        [sampler_row(0, params)], V, CPU))[0]
    assert counts[probs == 0].sum() == 0  # never outside top-k / top-p / min-p
    if int((probs > 0).sum()) == 1:
        return 1
    stat, dof = chi_square(counts, probs)
    assert stat < chi_square_limit(dof), (stat, dof)
    return int((probs > 0).sum())


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 200},
    {"temperature": 1.0, "top_k": 30, "min_p": 0.05},
    {"temperature": 1.3, "top_k": 1},
])
def test_top_k_rows_sample_what_the_sort_samples(kwargs):
    support = _assert_follows_the_sort(SamplingParams(**kwargs), _logits(2.0))
    assert support <= kwargs["top_k"]


@pytest.mark.parametrize("spread, temperature, widths", [
    (3.0, 0.8, "the first candidates"),  # peaked: the nucleus is within FIRST_WIDTH
    (1.0, 1.0, "several widths"),  # flat: the candidates grow before the nucleus fits
])
def test_top_p_rows_sample_what_the_sort_samples(spread, temperature, widths):
    support = _assert_follows_the_sort(SamplingParams(temperature=temperature, top_p=0.9),
                                       _logits(spread))
    if widths == "the first candidates":
        assert support < FIRST_WIDTH
    else:
        assert support > WIDTH_GROWTH * FIRST_WIDTH, support


def test_a_nucleus_past_the_widest_candidates_samples_from_the_whole_vocabulary(monkeypatch):
    whole_vocab_rows = []
    real = sampler._whole_vocab_probs

    def whole_vocab_probs(logits, rp):
        whole_vocab_rows.append(len(logits))
        return real(logits, rp)

    monkeypatch.setattr(candidates, "MAX_WIDTH", 2 * FIRST_WIDTH)
    monkeypatch.setattr(sampler, "_whole_vocab_probs", whole_vocab_probs)
    support = _assert_follows_the_sort(SamplingParams(temperature=1.0, top_p=0.95), _logits(1.0),
                                       num_rounds=30)
    assert support > 2 * FIRST_WIDTH and whole_vocab_rows  # the fallback sampled them


def test_each_row_takes_the_width_of_its_own_parameters():
    vocab = 8192
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=50),
              SamplingParams(temperature=1.0, top_k=64, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=65), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5000),
              SamplingParams(temperature=1.0, top_k=vocab)]
    plan = plan_candidates(params, vocab)
    assert [(rows.tolist(), w) for rows, w in plan.top_k_groups] == [([1, 2], 64), ([3], 128)]
    assert plan.top_p_rows.tolist() == [4]
    assert plan.whole_vocab_rows.tolist() == [5, 6, 7]  # greedy row 0 in none
    assert top_k_width(3, 40) == 40  # never past the vocabulary
    assert plan_candidates([SamplingParams(temperature=1.0, min_p=0.1)], vocab) is None


def _seeded_tokens(neighbours: list[SamplingParams], num_steps: int = 10) -> list[int]:
    target = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=77)
    rows = [sampler_row(0, target)] + [sampler_row(i + 1, p) for i, p in enumerate(neighbours)]
    sb = build_sampling_batch(rows, V, CPU)
    tokens = []
    for step in range(num_steps):
        logits = _logits(3.0, seed=step).unsqueeze(0).repeat(len(rows), 1)
        logits[1:] += torch.randn(len(rows) - 1, V)
        tokens.append(int(sample_no_sync(logits, sb)[0][0]))
    return tokens


def test_a_seeded_top_k_row_draws_the_same_tokens_beside_any_widths():
    alone = _seeded_tokens([])
    crowd = [SamplingParams(temperature=1.0, top_k=k) for k in (7, 50, 300, 3000)] + \
        [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0.0),
         SamplingParams(temperature=1.0, top_k=50, seed=5)]
    assert _seeded_tokens(crowd) == alone
    assert _seeded_tokens(crowd[:3]) == alone
