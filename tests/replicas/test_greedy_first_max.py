"""Greedy tokens from the C first-max pass equal torch.argmax's, edge values included;
anything the kernel does not take falls back to torch.argmax."""
from __future__ import annotations

import pytest
import torch

from replicas.sampling import greedy
from replicas.sampling.greedy import SOURCE, greedy_tokens, load_first_max
from tests.native_kernel_support import why_not_built

WHY_NOT_BUILT = why_not_built("first_max", SOURCE)
needs_kernel = pytest.mark.skipif(WHY_NOT_BUILT is not None, reason=f"{WHY_NOT_BUILT}")

NAN, INF = float("nan"), float("inf")


@pytest.fixture
def kernel_loaded():
    fn, why = load_first_max()
    assert fn is not None, why


def _same_as_torch(logits: torch.Tensor) -> None:
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1)), (got, logits.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (64, 8192), (256, 49152 // 8), (5, 49152)])
def test_random_logits(rows, vocab, kernel_loaded):
    _same_as_torch(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)))


@needs_kernel
def test_ties_take_the_first_and_minus_zero_equals_zero(kernel_loaded):
    x = torch.zeros(4, 33)
    x[0, 5] = x[0, 9] = 2.0
    x[1, 0] = -0.0  # every entry is zero: the first
    x[2] = -1.0
    x[2, 30] = 0.0
    x[2, 31] = -0.0
    x[3] = torch.arange(33.0).flip(0)
    _same_as_torch(x)


@needs_kernel
def test_nan_wins_as_in_torch_and_infinities_and_masked_rows_are_exact(kernel_loaded):
    x = torch.randn(6, 100)
    x[0, 40] = NAN
    x[0, 60] = NAN
    x[1, 0] = NAN
    x[2] = -INF  # a fully masked row
    x[3, 10] = x[3, 20] = INF
    x[4, :50] = -INF
    x[5, 99] = NAN
    x[5, 3] = INF
    _same_as_torch(x)


@needs_kernel
def test_a_large_logit_after_many_masked_entries(kernel_loaded):
    x = torch.full((2, 49152), -INF)
    x[0, 49151] = -1e30
    x[1, 12345] = 3.0
    x[1, 40000] = 3.0
    _same_as_torch(x)


@needs_kernel
def test_what_the_kernel_does_not_take_goes_to_torch(monkeypatch, kernel_loaded):
    calls = []
    real = greedy._kernel
    monkeypatch.setattr(greedy, "_kernel", lambda *a: calls.append(a) or real(*a))
    x = torch.randn(8, 64)
    for other in (x.t(), x.to(torch.bfloat16), x[0]):
        assert torch.equal(greedy_tokens(other), other.argmax(dim=-1))
    assert not calls
    greedy_tokens(x)
    assert len(calls) == 1


@needs_kernel
def test_zero_rows(kernel_loaded):
    assert greedy_tokens(torch.empty(0, 10)).shape == (0,)


def test_without_the_kernel_greedy_is_torch_argmax(monkeypatch):
    monkeypatch.setattr(greedy, "_kernel", None)
    x = torch.randn(4, 300)
    x[1, 7] = NAN
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
