"""Sampling memory: the expensive paths (penalties, top-k/top-p, logprobs) work in
row chunks of bounded size, with the same results as the whole batch at once, and
a batch that cannot get memory is a request fault (SamplingOutOfMemory), never an
engine fault. Sampler only: no model."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from replicas.sampling import sampler
from replicas.config import SamplingParams
from replicas.request import Request
from replicas.step_isolation import is_engine_fault

V = 2048
CPU = torch.device("cpu")
EXPENSIVE = dict(temperature=0.8, top_k=50, top_p=0.9, presence_penalty=0.5,
                 frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=3, logprobs=5)


def _rows(num_rows: int, **overrides) -> list[Request]:
    rows = []
    for i in range(num_rows):
        kwargs = {**EXPENSIVE, "seed": i if i % 2 else None, **overrides}
        if i % 5 == 0:
            kwargs["temperature"] = 0.0  # greedy rows beside sampled ones
        req = Request(f"r{i}", [3, 4, 5 + i], SamplingParams(**kwargs), None, frozenset({2}), 100)
        req.output_token_ids = [7, 8 + i % 3]
        rows.append(req)
    return rows


def _sample_steps(num_rows: int, num_steps: int = 3) -> list[list[float]]:
    rows = _rows(num_rows)
    sb = sampler.build_sampling_batch(rows, V, CPU)
    logits = torch.randn(num_steps, num_rows, V, generator=torch.Generator().manual_seed(5)) * 4
    torch.manual_seed(0)  # the unseeded rows' uniforms
    return [sampler.sample_no_sync(logits[step].clone(), sb)[1].tolist()
            for step in range(num_steps)]


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 7])
def test_chunks_sample_what_the_whole_batch_samples(monkeypatch, rows_per_chunk):
    whole = _sample_steps(10)
    monkeypatch.setattr(sampler, "MAX_CHUNK_ELEMENTS", rows_per_chunk * V)
    assert _sample_steps(10) == whole  # ids and logprobs, bit for bit


class _PeakTemporaries(TorchDispatchMode):
    """The most bytes held at once by tensors that ops made inside the mode (the
    inputs and their views are not counted)."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self._inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self._refs: dict[int, list[int]] = {}  # storage -> [tensors alive, bytes]
        self.num_live_bytes = self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self._inputs or key == 0:
                continue
            entry = self._refs.get(key)
            if entry is None:
                entry = self._refs[key] = [0, t.untyped_storage().nbytes()]
                self.num_live_bytes += entry[1]
                self.peak_bytes = max(self.peak_bytes, self.num_live_bytes)
            entry[0] += 1
            weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if not entry[0]:
            self.num_live_bytes -= entry[1]
            del self._refs[key]


def _peak_temporaries(num_rows: int) -> float:
    """Peak temporaries of one step, in (rows x vocabulary) float32 tensors."""
    sb = sampler.build_sampling_batch(_rows(num_rows), V, CPU)
    logits = torch.randn(num_rows, V)
    inputs = [logits] + [v for v in (getattr(sb, f) for f in sb.__slots__)
                         if isinstance(v, torch.Tensor)]
    mode = _PeakTemporaries(inputs)
    with mode:
        sampler.sample_no_sync(logits, sb)
    return mode.peak_bytes / (num_rows * V * 4)


def test_expensive_paths_keep_few_batch_sized_temporaries(monkeypatch):
    monkeypatch.setattr(sampler, "MAX_CHUNK_ELEMENTS", 8 * V)
    # NOTE: penalized logits, their temperature-scaled copy and the probabilities
    # span the batch (the plain path holds 2 of them); the rest is per chunk of 8
    # rows. The whole batch at once held 8.3 here.
    assert _peak_temporaries(128) < 3.3


def test_out_of_memory_in_sampling_is_a_request_fault(monkeypatch):
    rows = _rows(4)

    def no_memory(logits, sampled, num_top):
        raise MemoryError()

    monkeypatch.setattr(sampler, "_packed_logprobs", no_memory)
    sb = sampler.build_sampling_batch(rows, V, CPU)
    generators_before = [gen.get_state() for _, gen in sb.seeded_rows]
    with pytest.raises(sampler.SamplingOutOfMemory) as info:
        sampler.sample_no_sync(torch.randn(4, V), sb)
    assert not is_engine_fault(info.value)
    # the failure came after the draw: the seeded rows may draw again, the same
    assert [gen.get_state().tolist() for _, gen in sb.seeded_rows] == \
        [state.tolist() for state in generators_before]
    # a device's out-of-memory error, too
    monkeypatch.undo()

    def no_device_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    # NOTE: on a CPU, top-k rows sample from their candidates; the sort is the
    # whole-vocabulary path (a GPU's, and a CPU's past MAX_WIDTH).
    monkeypatch.setattr(sampler, "top_k_rows_draw", no_device_memory)
    with pytest.raises(sampler.SamplingOutOfMemory) as info:
        sampler.sample_no_sync(torch.randn(4, V), sampler.build_sampling_batch(rows, V, CPU))
    assert not is_engine_fault(info.value)
    assert is_engine_fault(MemoryError()) and is_engine_fault(info.value.__cause__)
