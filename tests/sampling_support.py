"""Checks of sampled frequencies against a distribution (Pearson's chi-square),
shared by the sampler's tests."""
from __future__ import annotations

import math

import torch

from replicas.config import SamplingParams
from replicas.request import Request
from replicas.sampling.sampler import SamplingBatch, build_sampling_batch, sample_no_sync

CPU = torch.device("cpu")
# Wilson-Hilferty: the chi-square quantile for `dof` degrees of freedom at the
# normal quantile z (z = 4.27: a false alarm once in 100,000 runs; the draws are
# seeded, so each run is the same anyway).
_Z = 4.27


def chi_square_limit(dof: int) -> float:
    return dof * (1 - 2 / (9 * dof) + _Z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with positive probability, and its dof.
    `probs` may be unnormalised (min_p masks without renormalising)."""
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep].double() / probs.double().sum() * n
    observed = counts[keep].double()
    return float(((observed - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def sampler_row(i: int, params: SamplingParams) -> Request:
    return Request(f"r{i}", [3, 4, 5, 6], params, None, frozenset({1}), 10**6)


def sampled_counts(params: SamplingParams, logits: torch.Tensor, num_draws: int,
                   num_rows: int = 2048, device: torch.device = CPU
                   ) -> tuple[torch.Tensor, SamplingBatch]:
    """Counts per token (on the CPU) of `num_draws` draws from one (V,) row of logits,
    sampled on `device` as batches of `num_rows` copies of that row, and the batch's
    SamplingBatch."""
    rows = [sampler_row(i, params) for i in range(num_rows)]
    sb = build_sampling_batch(rows, logits.shape[0], device)
    batch = logits.to(device).unsqueeze(0).expand(len(rows), -1).contiguous()
    counts = torch.zeros(logits.shape[0], dtype=torch.int64, device=device)
    torch.manual_seed(3)
    for _ in range(num_draws // len(rows)):
        sampled, _ = sample_no_sync(batch.clone(), sb)
        counts += torch.bincount(sampled, minlength=logits.shape[0])
    return counts.cpu(), sb


def seeded_row_tokens(batch_size: int, seed: int, device: torch.device = CPU,
                      num_steps: int = 12) -> list[int]:
    """The tokens a seeded row (row 0) draws over `num_steps` steps among
    `batch_size - 1` other rows, some seeded, some not: a seeded row must draw the same
    tokens whatever batch it runs in."""
    vocab = 1000
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    others = [SamplingParams(temperature=0.8, seed=i if i % 2 else None) for i in range(batch_size - 1)]
    rows = [sampler_row(0, target)] + [sampler_row(i + 1, p) for i, p in enumerate(others)]
    sb = build_sampling_batch(rows, vocab, device)
    logits = torch.randn(num_steps, vocab, generator=torch.Generator().manual_seed(5)).to(device)
    tokens = []
    for step in range(num_steps):
        torch.manual_seed(100 + batch_size)  # unseeded rows differ with the batch
        step_logits = torch.randn(batch_size, vocab, device=device) * 3
        step_logits[0] = logits[step]
        sampled, _ = sample_no_sync(step_logits, sb)
        tokens.append(int(sampled[0]))
    return tokens
