"""The ingress's ITL sampler: every value at a low rate, every k-th at a high one,
spread over the values rather than the first of each second."""
from __future__ import annotations

import pytest

from cluster.metrics import SampledHistogram


class _Recorded:
    def __init__(self):
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


def _feed(sampler: SampledHistogram, rate_per_s: float, seconds: float, start: float = 0.0,
          value=lambda i: float(i)) -> float:
    n = int(rate_per_s * seconds)
    for i in range(n):
        sampler.observe(value(i), start + i / rate_per_s)
    return start + n / rate_per_s


def test_below_the_budget_every_value_is_recorded():
    recorded = _Recorded()
    sampler = SampledHistogram(recorded, max_per_s=200)
    _feed(sampler, rate_per_s=150, seconds=5)
    assert len(recorded.values) == 750 and sampler.every == 1


def test_above_the_budget_about_the_budget_is_recorded_each_second_after_the_first():
    recorded = _Recorded()
    sampler = SampledHistogram(recorded, max_per_s=200)
    end_of_first = _feed(sampler, rate_per_s=3000, seconds=1)
    first = len(recorded.values)
    _feed(sampler, rate_per_s=3000, seconds=4, start=end_of_first)
    assert first == 3000  # the rate is learnt over the first window
    assert sampler.every in (15, 16)
    assert 4 * 200 * 0.9 <= len(recorded.values) - first <= 4 * 200 * 1.1


def test_the_sample_is_spread_over_the_values_not_the_first_of_each_second():
    recorded = _Recorded()
    sampler = SampledHistogram(recorded, max_per_s=100)
    end = _feed(sampler, rate_per_s=1000, seconds=1)
    # values 0..999 in each second: a spread sample has a mean near the middle
    _feed(sampler, rate_per_s=1000, seconds=3, start=end, value=lambda i: float(i % 1000))
    later = recorded.values[1000:]
    assert abs(sum(later) / len(later) - 499.5) < 25
    assert max(later) > 900


def test_the_rate_follows_the_load_down_again():
    recorded = _Recorded()
    sampler = SampledHistogram(recorded, max_per_s=200)
    end = _feed(sampler, rate_per_s=4000, seconds=2)
    assert sampler.every in (20, 21)  # 4,000 or 4,001 values in the first window
    end = _feed(sampler, rate_per_s=50, seconds=2, start=end + 5)  # a quiet gap, then a trickle
    assert sampler.every == 1


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="max_per_s"):
        SampledHistogram(_Recorded(), max_per_s=0)
