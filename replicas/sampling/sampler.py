"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p,
per-request seeds, presence/frequency/repetition penalties, logit_bias, min_tokens,
logprobs.

`SamplingBatch` is built once per scheduling decision (a multi-step window reuses
it, updating its counters on the device), and `sample_no_sync` returns a device
tensor: the caller makes the step's single host sync on it.

Top-k and top-p rows on a CPU sample from their top candidates
(`replicas/sampling/candidates.py`), not a sort of their whole vocabulary; on a GPU the
sort is cheap and the whole batch takes it.

Rows with a temperature draw from their adjusted distribution by inverse CDF on a
CPU (one uniform number per row, `replicas/sampling/inverse_cdf.py`) and by the exponential
race on a GPU (V random numbers per row, which a GPU makes in parallel at the cost
of a memory pass; on a CPU they cost more than the model's lm_head). A seeded row
takes its random numbers from its own generator only, so its tokens do not depend
on the batch it runs in.

`SamplingParams` bounds every value so that no row can produce NaN, Inf or an
integer overflow; what depends on the model (top_k above the vocabulary) is
clamped here. If a batch still fails, `probe_rows` samples each row alone to
find the request at fault (the engine core then fails only that request).

Memory: the expensive paths (penalties, the sort of top-k/top-p, logprobs) work
on chunks of at most `MAX_CHUNK_ELEMENTS` logits (whole rows) at a time, so their
temporaries do not grow with batch x vocabulary. When a batch still cannot get
memory, `SamplingOutOfMemory` says so: a request fault (replicas/step_isolation.py
retries the step in halves and fails only the rows that cannot sample alone),
not an engine fault.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from replicas.sampling.candidates import (CandidatePlan, RowParams, plan_candidates,
                                         top_k_rows_draw, top_p_rows_draw)
from replicas.sampling.inverse_cdf import inverse_cdf_draw_no_sync
from replicas.sampling.greedy import greedy_tokens
from replicas.request import Request

_NEG_INF = float("-inf")

# The most logits (rows x vocabulary) one chunk of the expensive paths works on:
# 16 MiB per float32 temporary. A batch within it is one chunk (no extra copy).
MAX_CHUNK_ELEMENTS = 1 << 22

# Test-only: called with every row of every batch built; raising there is a
# request whose sampling fails inside the batched step (cluster/transport/faults.py installs
# it). None in production: one check per batch.
row_fault_hook: Callable[[Request], None] | None = None


class SamplingOutOfMemory(Exception):
    """A batch could not get memory to sample: the rows' fault, not the engine's."""


def _out_of_memory(error: BaseException, what: str, num_rows: int) -> SamplingOutOfMemory:
    # NOTE: the cause's text stays out of the message: "CUDA out of memory" there
    # would read as a device error (step_isolation.is_engine_fault).
    return SamplingOutOfMemory(f"{what} for {num_rows} rows ran out of memory "
                               f"({type(error).__name__})")


def _row_chunks(num_rows: int, vocab_size: int) -> list[slice]:
    rows_per_chunk = max(1, MAX_CHUNK_ELEMENTS // max(1, vocab_size))
    return [slice(start, min(start + rows_per_chunk, num_rows))
            for start in range(0, num_rows, rows_per_chunk)]


@dataclass(slots=True)
class SamplingBatch:
    num_rows: int
    all_greedy: bool
    any_greedy: bool
    temperatures: torch.Tensor | None  # (B,) with 1.0 on greedy rows
    greedy_rows: torch.Tensor | None  # (B,) bool
    top_k: torch.Tensor | None  # (B,) int64, vocab size where unused
    top_p: torch.Tensor | None  # (B,) float
    min_p: torch.Tensor | None  # (B,) float
    seeded_rows: list[tuple[int, torch.Generator]]
    # penalties: counts of output tokens, and which tokens the prompt holds
    output_counts: torch.Tensor | None  # (B, V) float
    prompt_mask: torch.Tensor | None  # (B, V) bool
    presence: torch.Tensor | None  # (B, 1)
    frequency: torch.Tensor | None  # (B, 1)
    repetition: torch.Tensor | None  # (B, 1)
    # min_tokens: stop tokens are banned while num_outputs < min_tokens
    stop_token_mask: torch.Tensor | None  # (B, V) bool
    num_outputs: torch.Tensor | None  # (B,) int64, advanced each step
    min_tokens: torch.Tensor | None  # (B,) int64
    max_num_logprobs: int  # -1: no row wants logprobs
    # logit_bias of every row as (rows (E,), token ids (E,), biases (E,)): one
    # accumulating index_put per step (into a copy), at every step of a window
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # CPU only: the rows that sample from their top candidates (candidates.py)
    candidates: CandidatePlan | None = None

    @property
    def needs_logprobs(self) -> bool:
        return self.max_num_logprobs >= 0

    @property
    def row_params(self) -> RowParams:
        return RowParams(self.temperatures, self.top_k, self.top_p, self.min_p)


def build_sampling_batch(rows: list[Request], vocab_size: int, device: torch.device) -> SamplingBatch:
    try:
        return _build_sampling_batch(rows, vocab_size, device)
    except (MemoryError, torch.OutOfMemoryError) as e:  # its (B, V) penalty and stop masks
        raise _out_of_memory(e, "the sampling batch", len(rows)) from e


def _build_sampling_batch(rows: list[Request], vocab_size: int,
                          device: torch.device) -> SamplingBatch:
    if row_fault_hook is not None:
        for r in rows:
            row_fault_hook(r)
    params = [r.params for r in rows]
    B = len(rows)
    all_greedy = all(p.is_greedy for p in params)
    temps = greedy = top_k = top_p = min_p = None
    if not all_greedy:
        temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params],
                             dtype=torch.float32, device=device)
        greedy = torch.tensor([p.is_greedy for p in params], device=device)
        if any(p.top_k > 0 for p in params):
            # NOTE: a top_k above the vocabulary is the whole vocabulary.
            top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
                                  for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    seeded = []
    for i, r in enumerate(rows):
        if r.params.seed is not None and not r.params.is_greedy:
            if r.generator is None:
                r.generator = torch.Generator(device=device).manual_seed(r.params.seed)
            seeded.append((i, r.generator))
    counts = prompt_mask = presence = frequency = repetition = None
    if any(p.has_penalties for p in params):
        # NOTE: O(tokens so far) once per decision, only for batches with penalties.
        counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
        prompt_mask = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            if r.params.has_penalties:
                if r.output_token_ids:
                    ids = torch.tensor(r.output_token_ids, device=device)
                    counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
                prompt_mask[i, torch.tensor(r.prompt_token_ids, device=device)] = True
        presence = torch.tensor([[p.presence_penalty] for p in params], device=device)
        frequency = torch.tensor([[p.frequency_penalty] for p in params], device=device)
        repetition = torch.tensor([[p.repetition_penalty] for p in params], device=device)
    stop_mask = num_outputs = min_tokens = None
    if any(p.min_tokens > 0 for p in params):
        stop_mask = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            if r.params.min_tokens and r.stop_token_ids:
                stop_mask[i, torch.tensor(sorted(r.stop_token_ids), device=device)] = True
        num_outputs = torch.tensor([len(r.output_token_ids) for r in rows], device=device)
        min_tokens = torch.tensor([p.min_tokens for p in params], device=device)
    max_lp = max((p.logprobs if p.logprobs is not None else -1 for p in params), default=-1)
    any_greedy = any(p.is_greedy for p in params)
    candidates = plan_candidates(params, vocab_size) \
        if device.type == "cpu" and (top_k is not None or top_p is not None) else None
    return SamplingBatch(B, all_greedy, any_greedy, temps, greedy, top_k, top_p, min_p, seeded, counts,
                         prompt_mask, presence, frequency, repetition, stop_mask, num_outputs,
                         min_tokens, max_lp, _logit_bias(params, device), candidates)


def _logit_bias(params: list, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    triples = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if not triples:
        return None
    rows, token_ids, biases = zip(*triples)
    return (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def _apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    chunks = _row_chunks(*logits.shape)
    if len(chunks) == 1:
        return _penalized(logits, sb, slice(None))
    out = torch.empty_like(logits)  # NOTE: the raw logits stay intact for logprobs
    for rows in chunks:
        out[rows] = _penalized(logits[rows], sb, rows)
    return out


def _penalized(logits: torch.Tensor, sb: SamplingBatch, rows: slice) -> torch.Tensor:
    """(R, V) logits of `rows` of the batch, with their penalties applied."""
    counts = sb.output_counts[rows]
    seen = (counts > 0) | sb.prompt_mask[rows]
    rep = sb.repetition[rows].expand_as(logits)
    logits = torch.where(seen & (logits > 0), logits / rep, logits)
    logits = torch.where(seen & (logits <= 0), logits * rep, logits)
    logits = logits - sb.frequency[rows] * counts
    return logits - sb.presence[rows] * (counts > 0).float()


def _apply_top_k_top_p(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """Tokens outside each row's top-k / top-p set to -inf; in place on `logits`
    (the caller's own temporary) when the batch takes several chunks."""
    chunks = _row_chunks(*logits.shape)
    if len(chunks) == 1:
        return _top_k_top_p(logits, rp, slice(None))
    for rows in chunks:
        logits[rows] = _top_k_top_p(logits[rows], rp, rows)
    return logits


def _top_k_top_p(logits: torch.Tensor, rp: RowParams, rows: slice) -> torch.Tensor:
    """The whole-vocabulary path: a sort of each row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if rp.top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= rp.top_k[rows].unsqueeze(1), _NEG_INF)
    if rp.top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # NOTE: the top token always stays (its mass_before is 0).
        sorted_logits = sorted_logits.masked_fill(mass_before >= rp.top_p[rows].unsqueeze(1),
                                                  _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter_(-1, order, sorted_logits)


def adjusted_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Penalties and logit_bias applied, stop tokens banned while min_tokens is
    not reached. Never in place: the logits it was given stay intact for logprobs
    (for a constrained row, those are already masked by its grammar)."""
    if sb.output_counts is not None:
        logits = _apply_penalties(logits, sb)
    if sb.logit_bias is not None:
        # NOTE: after the penalties, so +100 lifts a token above any penalised logit;
        # greedy rows take their argmax of these logits too.
        logits = logits.index_put(sb.logit_bias[:2], sb.logit_bias[2], accumulate=True)
    if sb.stop_token_mask is not None:
        banned = sb.stop_token_mask & (sb.num_outputs < sb.min_tokens).unsqueeze(1)
        logits = logits.masked_fill(banned, _NEG_INF)
    return logits


def sampling_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """(B, V) adjusted logits -> the distributions the non-greedy rows sample from
    (what the candidates of candidates.py sample from too)."""
    return _whole_vocab_probs(logits, sb.row_params)


def _whole_vocab_probs(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    scaled = logits / rp.temperatures.unsqueeze(1)
    if rp.top_k is not None or rp.top_p is not None:
        scaled = _apply_top_k_top_p(scaled, rp)
    probs = scaled.softmax(dim=-1)
    if rp.min_p is not None:
        threshold = rp.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _uniforms(sb: SamplingBatch, device: torch.device) -> torch.Tensor:
    """(B,) float64 uniforms, a seeded row's from its own generator."""
    uniforms = torch.rand(sb.num_rows, dtype=torch.float64, device=device)
    for row, gen in sb.seeded_rows:
        uniforms[row] = torch.rand((), dtype=torch.float64, generator=gen, device=device)
    return uniforms


def _draw_no_sync(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """One token per row of (B, V) probabilities, without a host sync."""
    if probs.device.type == "cuda":
        # exponential race: argmax(p / q), q ~ Exp(1), samples from p
        q = torch.empty_like(probs).exponential_()
        for row, gen in sb.seeded_rows:
            q[row].exponential_(generator=gen)
        return (probs / q).argmax(dim=-1)
    return inverse_cdf_draw_no_sync(probs, _uniforms(sb, probs.device))


def _index_chunks(rows: torch.Tensor, num_rows: int, vocab_size: int) -> list:
    """`rows` in chunks of the expensive paths' size: slices where `rows` is the
    whole batch (views, no copy), else index tensors."""
    if len(rows) == num_rows:
        return _row_chunks(num_rows, vocab_size)
    return [rows[c] for c in _row_chunks(len(rows), vocab_size)]


def _draw_from_candidates(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """(B, V) adjusted logits -> (B,) ids of the non-greedy rows, a CPU's top-k / top-p
    rows from their candidates (greedy rows' entries are left for the caller)."""
    plan, rp = sb.candidates, sb.row_params
    uniforms = _uniforms(sb, logits.device)
    sampled = torch.zeros(sb.num_rows, dtype=torch.int64, device=logits.device)
    num_rows, vocab = logits.shape

    def rows_of(chunk):
        if isinstance(chunk, slice):
            return logits[chunk], rp.take(torch.arange(num_rows)[chunk]), uniforms[chunk]
        return logits.index_select(0, chunk), rp.take(chunk), uniforms.index_select(0, chunk)

    def whole_vocab_draw(part, sub, u):
        return inverse_cdf_draw_no_sync(_whole_vocab_probs(part, sub), u)

    for rows, width in plan.top_k_groups:
        for chunk in _index_chunks(rows, num_rows, vocab):
            part, sub, u = rows_of(chunk)
            sampled[chunk] = top_k_rows_draw(part, width, sub, u)
    if plan.top_p_rows is not None:
        for chunk in _index_chunks(plan.top_p_rows, num_rows, vocab):
            part, sub, u = rows_of(chunk)
            sampled[chunk] = top_p_rows_draw(part, sub, u, lambda i, part=part, sub=sub, u=u:
                                             whole_vocab_draw(part.index_select(0, i),
                                                              sub.take(i), u.index_select(0, i)))
    if plan.whole_vocab_rows is not None:
        for chunk in _index_chunks(plan.whole_vocab_rows, num_rows, vocab):
            sampled[chunk] = whole_vocab_draw(*rows_of(chunk))
    return sampled


def sample_no_sync(logits: torch.Tensor, sb: SamplingBatch,
                   raw_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) float32 logits -> (sampled ids (B,) int64, packed (B, K) for the host).

    packed is the ids alone, or with logprobs [id, logprob, top ids..., top logprobs...]
    as float32 (ids are exact in float32 below 2**24): one tensor, one host copy.
    Logprobs are the model's own distribution, before every sampling parameter and a
    grammar's mask (as vLLM's default): `raw_logits` are the logits before that mask
    where `logits` carry it (None: `logits` are the model's own), so a logprob is
    always finite, and the top alternatives may hold tokens the grammar forbids.
    Raises SamplingOutOfMemory when the batch cannot get memory.
    """
    # NOTE: a failure after a seeded row drew its numbers (the draw's temporaries,
    # logprobs) must not leave its generator one draw ahead of the retry: its
    # tokens stay those of an undisturbed run. A generator's state is small (16 bytes
    # on CUDA, 5 KB on CPU) and only seeded rows have one.
    states = [(gen, gen.get_state()) for _, gen in sb.seeded_rows] if sb.seeded_rows else None
    try:
        return _sample_no_sync(logits, sb, logits if raw_logits is None else raw_logits)
    except BaseException as e:
        for gen, state in states or ():
            gen.set_state(state)
        if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
            raise _out_of_memory(e, "sampling", sb.num_rows) from e
        raise


def _sample_no_sync(logits: torch.Tensor, sb: SamplingBatch,
                    raw_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = adjusted_logits(logits, sb)
    if sb.all_greedy:
        sampled = greedy_tokens(logits)
    else:
        if sb.candidates is not None:
            sampled = _draw_from_candidates(logits, sb)
        else:
            sampled = _draw_no_sync(sampling_probs(logits, sb), sb)
        if sb.any_greedy:
            sampled = torch.where(sb.greedy_rows, greedy_tokens(logits), sampled)
    if sb.output_counts is not None:
        sb.output_counts.scatter_add_(1, sampled.unsqueeze(1),
                                      torch.ones_like(sampled, dtype=torch.float32).unsqueeze(1))
    if sb.num_outputs is not None:
        sb.num_outputs += 1
    if not sb.needs_logprobs:
        return sampled, sampled
    chunks = _row_chunks(*raw_logits.shape)
    packed = [_packed_logprobs(raw_logits[rows], sampled[rows], sb.max_num_logprobs)
              for rows in chunks]
    return sampled, packed[0] if len(chunks) == 1 else torch.cat(packed)


def _packed_logprobs(logits: torch.Tensor, sampled: torch.Tensor, num_top: int) -> torch.Tensor:
    """(R, V) raw logits, (R,) sampled ids -> (R, 2 + 2 * num_top) packed rows."""
    logprobs = logits.log_softmax(dim=-1)
    parts = [sampled.float().unsqueeze(1), logprobs.gather(1, sampled.unsqueeze(1))]
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        parts += [top_ids.float(), top_lp]
    return torch.cat(parts, dim=1)


def probe_rows(rows: list[Request], vocab_size: int,
               device: torch.device) -> list[tuple[Request, Exception]]:
    """The rows whose sampling fails alone, with their errors: each row's batch is
    built and sampled on zero logits. A seeded row's generator is left as it was
    (its outputs stay those of an undisturbed run)."""
    failed = []
    logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    for r in rows:
        generator = r.generator
        state = generator.get_state() if generator is not None else None
        try:
            _, packed = sample_no_sync(logits.clone(), build_sampling_batch([r], vocab_size, device))
            packed.tolist()  # NOTE: a host sync, so a device error shows here
        except Exception as e:  # noqa: BLE001 - any failure marks the row
            failed.append((r, e))
        finally:
            if generator is None:
                r.generator = None
            else:
                generator.set_state(state)
    return failed
