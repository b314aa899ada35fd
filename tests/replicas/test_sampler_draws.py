"""Sampling at a temperature draws from the right distribution: the inverse-CDF draw
against its distribution (chi-square over many draws on small vocabularies), tokens
outside top-k / top-p / min-p or of zero probability never drawn, and seeded rows
reproducible whatever batch they run in. Sampler only: no model."""
from __future__ import annotations

import pytest
import torch

from replicas.config import SamplingParams
from replicas.sampling.inverse_cdf import BLOCK, inverse_cdf_draw_no_sync
from replicas.request import Request
from replicas.sampling.sampler import build_sampling_batch, sample_no_sync, sampling_probs
from tests.sampling_support import (CPU, chi_square, chi_square_limit, sampled_counts,
                                    sampler_row, seeded_row_tokens)


def _draw_counts(weights: torch.Tensor, num_draws: int, seed: int) -> torch.Tensor:
    """Counts per index of `num_draws` draws from one (V,) row, made in batches."""
    torch.manual_seed(seed)
    counts = torch.zeros(weights.shape[0], dtype=torch.int64)
    batch = 4096
    rows = weights.unsqueeze(0).expand(batch, -1).contiguous()
    for _ in range(num_draws // batch):
        ids = inverse_cdf_draw_no_sync(rows, torch.rand(batch, dtype=torch.float64))
        counts += torch.bincount(ids, minlength=weights.shape[0])
    return counts


@pytest.mark.parametrize("vocab", [7, BLOCK, 300, 3 * BLOCK])  # one block, padded, several
def test_inverse_cdf_draws_match_the_distribution(vocab):
    g = torch.Generator().manual_seed(vocab)
    weights = torch.rand(vocab, generator=g) ** 3  # unnormalised, uneven
    weights[::5] = 0.0  # masked tokens
    counts = _draw_counts(weights, 4096 * 60, seed=1)
    probs = weights / weights.sum()
    stat, dof = chi_square(counts, probs)
    assert stat < chi_square_limit(dof), (stat, dof)
    assert counts[weights == 0].sum() == 0


def test_a_biased_draw_fails_the_same_check():
    """The check has teeth: an off-by-one draw (the next index) is caught."""
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(64, generator=g)
    counts = _draw_counts(weights, 4096 * 30, seed=2)
    shifted = torch.roll(counts, 1)
    stat, dof = chi_square(shifted, weights / weights.sum())
    assert stat > chi_square_limit(dof)


def test_extreme_uniforms_never_reach_zero_weight_tokens():
    weights = torch.zeros(4, 3 * BLOCK)
    weights[0, 5] = 1.0  # one token alone
    weights[1, [BLOCK - 1, BLOCK]] = 1e-30  # across a block edge, tiny
    weights[2, 2 * BLOCK:] = 1.0  # the whole last block
    weights[3, 0] = 1.0
    weights[3, -1] = 1e-40  # denormal in float32, last index
    below_one = 1.0 - 2.0 ** -53
    for u in (0.0, 1e-300, 0.5, below_one):
        ids = inverse_cdf_draw_no_sync(weights, torch.full((4,), u, dtype=torch.float64))
        for row, i in enumerate(ids.tolist()):
            assert weights[row, i] > 0, (u, row, i)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.05},
])
def test_sampled_frequencies_follow_the_adjusted_distribution(kwargs):
    vocab = 200
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(11)) * 2.0
    counts, sb = sampled_counts(SamplingParams(**kwargs), logits, 2048 * 60)
    probs = sampling_probs(logits.unsqueeze(0).expand(sb.num_rows, -1), sb)[0]
    stat, dof = chi_square(counts, probs)
    assert stat < chi_square_limit(dof), (stat, dof)
    # the support is respected: nothing outside top-k / top-p / min-p
    assert counts[probs == 0].sum() == 0
    if "top_k" in kwargs:
        assert int((counts > 0).sum()) <= kwargs["top_k"]


def test_a_seeded_row_draws_the_same_tokens_in_any_batch():
    alone = seeded_row_tokens(1, seed=1234)
    assert seeded_row_tokens(5, seed=1234) == alone
    assert seeded_row_tokens(33, seed=1234) == alone
    assert seeded_row_tokens(5, seed=99) != alone


def test_greedy_rows_stay_exact_beside_sampled_rows():
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2)) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    rows = [sampler_row(i, p) for i, p in enumerate(params)]
    sampled, _ = sample_no_sync(logits.clone(), build_sampling_batch(rows, vocab, CPU))
    assert sampled[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()
