"""Top-k and top-p on a CPU from each row's top candidates, not a sort of its whole
vocabulary.

Sorting a (rows x vocabulary) batch is the costly part of top-k / top-p sampling on
a CPU: on a 49k vocabulary it costs more than the model's forward. What those rows
sample from is a short prefix of the sorted row, so `torch.topk` of a few dozen to a
few thousand entries finds it for about what an argmax costs:
- a top-k row takes its top `width` logits (`width` its top_k rounded up to a power of
  two, so rows of close top_k share one call), masks ranks past its top_k, and
  applies its top-p and min-p to those candidates, renormalised as the whole-vocabulary
  path renormalises them;
- a top-p row (no top-k) needs its whole-vocabulary normaliser (one logsumexp), then
  takes FIRST_WIDTH candidates, and 4x more while their mass is below its top_p;
  past MAX_WIDTH it is sampled from its whole vocabulary (the caller's sort path).
Every choice is the row's own (its parameters and logits), never the batch's, so a
seeded row draws the same tokens in any batch. The draw is the inverse CDF over the
candidates in rank order (`inverse_cdf.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from replicas.sampling.inverse_cdf import inverse_cdf_draw_no_sync

_NEG_INF = float("-inf")

# A top-p row's first candidates, and the most it takes before the whole vocabulary.
FIRST_WIDTH = 64
MAX_WIDTH = 4096
WIDTH_GROWTH = 4


@dataclass(frozen=True, slots=True)
class CandidatePlan:
    """Which rows of a batch sample from candidates, fixed per scheduling decision.
    Row indices are int64 tensors; greedy rows are in none of them."""
    top_k_groups: tuple[tuple[torch.Tensor, int], ...]  # (rows, candidates per row)
    top_p_rows: torch.Tensor | None  # top-p without top-k
    whole_vocab_rows: torch.Tensor | None  # neither (or top_k past MAX_WIDTH)


def top_k_width(top_k: int, vocab_size: int) -> int:
    return min(vocab_size, max(FIRST_WIDTH, 1 << (top_k - 1).bit_length()))


def plan_candidates(params: list, vocab_size: int) -> CandidatePlan | None:
    """The plan of a batch with top-k or top-p rows; None where no row has them."""
    by_width: dict[int, list[int]] = {}
    top_p_rows, whole_rows = [], []
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        top_k = min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
        if top_k < vocab_size and top_k <= MAX_WIDTH:
            by_width.setdefault(top_k_width(top_k, vocab_size), []).append(i)
        elif top_k == vocab_size and p.top_p < 1.0:
            top_p_rows.append(i)
        else:
            whole_rows.append(i)
    if not by_width and not top_p_rows:
        return None
    rows = lambda ids: torch.tensor(ids, dtype=torch.int64) if ids else None  # noqa: E731
    return CandidatePlan(tuple((rows(ids), w) for w, ids in sorted(by_width.items())),
                         rows(top_p_rows), rows(whole_rows))


@dataclass(frozen=True, slots=True)
class RowParams:
    """The sampling values of some rows, (R,) each; None where no row of the batch
    uses it."""
    temperatures: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None

    def take(self, rows: torch.Tensor) -> RowParams:
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        return RowParams(pick(self.temperatures), pick(self.top_k), pick(self.top_p),
                         pick(self.min_p))


def _nucleus_draw(probs: torch.Tensor, ids: torch.Tensor, rp: RowParams,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """(R, W) probabilities of candidates in rank order (normalised over what their
    top-p is measured against), their token ids -> (R,) drawn token ids."""
    if rp.top_p is not None:
        mass_before = probs.cumsum(dim=-1) - probs
        # NOTE: the top token always stays (its mass_before is 0).
        probs = probs.masked_fill(mass_before >= rp.top_p.unsqueeze(1), 0.0)
    if rp.min_p is not None:
        # NOTE: min_p compares with the top token, whatever the normalisation.
        probs = probs.masked_fill(probs < rp.min_p.unsqueeze(1) * probs[:, :1], 0.0)
    picked = inverse_cdf_draw_no_sync(probs, uniforms)
    return ids.gather(1, picked.unsqueeze(1)).squeeze(1)


def top_k_rows_draw(logits: torch.Tensor, width: int, rp: RowParams,
                    uniforms: torch.Tensor) -> torch.Tensor:
    """(R, V) adjusted logits of top-k rows -> (R,) token ids."""
    values, ids = logits.topk(width, dim=-1)  # NOTE: a temperature keeps the order
    scaled = values / rp.temperatures.unsqueeze(1)
    ranks = torch.arange(width, device=logits.device).unsqueeze(0)
    scaled = scaled.masked_fill(ranks >= rp.top_k.unsqueeze(1), _NEG_INF)
    return _nucleus_draw(scaled.softmax(dim=-1), ids, rp, uniforms)


def top_p_rows_draw(logits: torch.Tensor, rp: RowParams, uniforms: torch.Tensor,
                    whole_vocab_draw: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(R, V) adjusted logits of top-p rows (no top-k) -> (R,) token ids.
    `whole_vocab_draw(rows)` samples the rows (indices into these) whose nucleus is
    wider than MAX_WIDTH."""
    num_rows, vocab = logits.shape
    temps = rp.temperatures.unsqueeze(1)
    log_total = torch.logsumexp(logits / temps, dim=-1, keepdim=True)  # (R, 1)
    sampled = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    pending = None  # None: every row (no copy of the batch)
    width = FIRST_WIDTH
    while True:
        width = min(width, vocab)
        part = logits if pending is None else logits.index_select(0, pending)
        sub = rp if pending is None else rp.take(pending)
        values, ids = part.topk(width, dim=-1)
        total = log_total if pending is None else log_total.index_select(0, pending)
        probs = (values / sub.temperatures.unsqueeze(1) - total).exp()
        enough = probs.sum(dim=-1) >= sub.top_p if width < vocab else \
            torch.ones(len(values), dtype=torch.bool, device=logits.device)
        rows = torch.arange(num_rows, device=logits.device) if pending is None else pending
        done = enough.nonzero().squeeze(1)
        if len(done):
            sampled[rows.index_select(0, done)] = _nucleus_draw(
                probs.index_select(0, done), ids.index_select(0, done), sub.take(done),
                uniforms.index_select(0, rows.index_select(0, done)))
        pending = rows[~enough]
        if not len(pending):
            return sampled
        if width >= MAX_WIDTH:
            sampled[pending] = whole_vocab_draw(pending)
            return sampled
        width *= WIDTH_GROWTH
