"""CUDA graphs for decode steps, and the pipelined host copy of each step's samples.

`DecodeGraphRunner` captures the model's decode forward (logits included; sampling
stays outside) once per batch-size bucket (1, 2, 4, 8, then steps of 16 up to
max_num_seqs), all graphs in one memory pool, over static input buffers. A step of B
sequences copies its inputs into the first B rows, pads the rest of the bucket
(slot -1 writes nothing, seq_len 0 reads nothing), replays, and reads logits[:B].
Inside a multi-step window the inputs then advance in place in the static buffers.

Pure logic (buckets, the padded copy) runs on any device; `EagerStandInGraph`
replaces the CUDA graph in CPU tests (its "replay" runs the function again).

`start_host_copy` enqueues a step's device-to-host copy into pinned memory with an
event, so the host waits for step k only while step k+1 already runs.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from replicas.attention.base import AttentionBackend, AttentionMetadata
from replicas.kv_cache.kv_budget import blocks_per_sequence

logger = logging.getLogger("stepstream")

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16
GRAPH_BACKENDS = ("triton", "flash-attn")  # backends whose decode is graph-safe


# -- buckets ----------------------------------------------------------------------
def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, below max_num_seqs; max_num_seqs itself last."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    steps = range(BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return [b for b in (*SMALL_BUCKETS, *steps) if b < max_num_seqs] + [max_num_seqs]


def choose_bucket(buckets: list[int], num_seqs: int) -> int | None:
    """The smallest bucket that holds num_seqs rows (sorted buckets); None if none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) and num_seqs >= 1 else None


# -- static inputs ------------------------------------------------------------------
@dataclass(slots=True)
class StaticDecodeInputs:
    """The graphs' input buffers, as many rows as the largest bucket."""
    input_ids: torch.Tensor  # (R,) int64
    positions: torch.Tensor  # (R,) int64
    slot_mapping: torch.Tensor  # (R,) int64, -1 on padded rows
    seq_lens: torch.Tensor  # (R,) int32, 0 on padded rows
    block_tables: torch.Tensor  # (R, max_blocks_per_seq) int32

    @classmethod
    def allocate(cls, num_rows: int, max_blocks_per_seq: int,
                 device: torch.device | str) -> "StaticDecodeInputs":
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(zeros(num_rows), zeros(num_rows), zeros(num_rows).fill_(-1),
                   zeros(num_rows, dtype=torch.int32),
                   zeros(num_rows, max_blocks_per_seq, dtype=torch.int32))

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def decode_meta(self, num_rows: int, max_decode_seq_len: int) -> AttentionMetadata:
        """Decode-only metadata over views of the first num_rows rows."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_rows], num_prefills=0, num_prefill_tokens=0,
            prefill_query_start_loc=[0], prefill_seq_lens=[], prefill_block_tables=None,
            num_decodes=num_rows, decode_seq_lens=self.seq_lens[:num_rows],
            decode_block_tables=self.block_tables[:num_rows],
            max_decode_seq_len=max_decode_seq_len, decode_window_cache=None)


def fill_static_decode_inputs_(static: StaticDecodeInputs, bucket: int, input_ids: torch.Tensor,
                               positions: torch.Tensor, slot_mapping: torch.Tensor,
                               seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
    """In place, no sync: the live rows first, then padded rows up to `bucket`.

    Padded rows write nothing (slot -1) and read nothing (seq_len 0); table columns
    past the live width are zeroed so no stale block id outlives its request.
    """
    num_seqs, width = block_tables.shape
    if not num_seqs <= bucket <= static.num_rows:
        raise ValueError(f"{num_seqs} rows do not fit bucket {bucket} of {static.num_rows}")
    if width > static.max_blocks_per_seq:
        raise ValueError(f"block tables of {width} blocks exceed the static {static.max_blocks_per_seq}")
    static.input_ids[:num_seqs].copy_(input_ids)
    static.positions[:num_seqs].copy_(positions)
    static.slot_mapping[:num_seqs].copy_(slot_mapping)
    static.seq_lens[:num_seqs].copy_(seq_lens)
    static.block_tables[:num_seqs, :width].copy_(block_tables)
    static.block_tables[:num_seqs, width:].zero_()
    static.input_ids[num_seqs:bucket].zero_()
    static.positions[num_seqs:bucket].zero_()
    static.slot_mapping[num_seqs:bucket].fill_(-1)
    static.seq_lens[num_seqs:bucket].zero_()
    static.block_tables[num_seqs:bucket].zero_()


# -- graphs -------------------------------------------------------------------------
class GraphLike(Protocol):
    def capture(self, fn: Callable[[], None]) -> None: ...
    def replay(self) -> None: ...


class CudaGraph:
    """One torch.cuda.CUDAGraph captured into a shared memory pool."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None]) -> None:
        # NOTE: thread_local: the output thread may touch CUDA while we capture.
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerStandInGraph:
    """CPU tests: 'capture' keeps the function, 'replay' runs it over the static buffers."""

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def graph_backend_for_bucket(backend: AttentionBackend, bucket: int, num_kv_heads: int,
                             max_seq_len: int) -> AttentionBackend:
    """Triton picks its split count per call from host values; a graph bakes one in,
    so each bucket gets a Triton backend with a fixed `num_kv_splits`."""
    if backend.name != "triton":
        return backend
    from replicas.attention.triton_backend import TritonAttentionBackend
    from replicas.attention.triton_kernels import choose_num_kv_splits
    splits = backend.num_kv_splits or choose_num_kv_splits(bucket, num_kv_heads, max_seq_len,
                                                           backend.tile_tokens)
    return TritonAttentionBackend(tile_tokens=backend.tile_tokens, num_kv_splits=splits,
                                  prefill=backend.prefill)


class DecodeGraphRunner:
    """Decode forward (embedding -> logits) per bucket, captured once, replayed per step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, backend: AttentionBackend,
                 max_num_seqs: int, max_blocks_per_seq: int, block_size: int, vocab_size: int,
                 num_kv_heads: int, device: torch.device | str,
                 make_graph: Callable[[], GraphLike] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.buckets = decode_buckets(max_num_seqs)
        self.max_seq_len = max_blocks_per_seq * block_size
        self.num_kv_heads = num_kv_heads
        self.static = StaticDecodeInputs.allocate(self.buckets[-1], max_blocks_per_seq, device)
        # NOTE: one logits buffer outside the pool, shared by every bucket: per-graph
        # outputs would pin (rows x vocab) floats per bucket in the pool.
        self.logits = torch.zeros(self.buckets[-1], vocab_size, dtype=torch.float32, device=device)
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self._make_graph = make_graph
        self._graphs: dict[int, GraphLike] = {}
        self.num_replays = 0  # steps run through a graph (checks, stats)

    @property
    def max_num_seqs(self) -> int:
        return self.buckets[-1]

    def _bucket_forward(self, bucket: int) -> Callable[[], None]:
        static = self.static
        meta = static.decode_meta(bucket, self.max_seq_len)
        backend = graph_backend_for_bucket(self.backend, bucket, self.num_kv_heads, self.max_seq_len)
        input_ids, positions, out = static.input_ids[:bucket], static.positions[:bucket], self.logits[:bucket]
        model, kv_caches = self.model, self.kv_caches

        def forward() -> None:
            out.copy_(model(input_ids, positions, kv_caches, meta, backend, None))
        return forward

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles every Triton kernel at this shape) and capture each bucket,
        largest first so smaller graphs reuse the pool's memory."""
        is_cuda = self.logits.device.type == "cuda"
        empty = torch.zeros(0, dtype=torch.int64, device=self.logits.device)
        no_tables = torch.zeros(0, 0, dtype=torch.int32, device=self.logits.device)
        for bucket in reversed(self.buckets):
            # every row padded: warm-up and capture write nothing to the KV cache
            fill_static_decode_inputs_(self.static, bucket, empty, empty, empty,
                                       empty.int(), no_tables)
            forward = self._bucket_forward(bucket)
            forward()
            if is_cuda:
                torch.cuda.synchronize()
            graph = self._make_graph()
            graph.capture(forward)
            self._graphs[bucket] = graph
        if is_cuda:
            torch.cuda.synchronize()

    def bucket_for(self, meta: AttentionMetadata) -> int | None:
        """The bucket a decode-only step runs in, or None when it must run eagerly."""
        if meta.num_prefills or not meta.num_decodes:
            return None
        if meta.decode_block_tables.shape[1] > self.static.max_blocks_per_seq:
            return None
        bucket = choose_bucket(self.buckets, meta.num_decodes)
        return bucket if bucket in self._graphs else None

    def load_inputs(self, inputs, bucket: int):
        """StepInputs -> the same StepInputs over views of the static buffers (whose
        in-place advance then feeds the next replay)."""
        meta = inputs.meta
        num_seqs = meta.num_decodes
        fill_static_decode_inputs_(self.static, bucket, inputs.input_ids, inputs.positions,
                                   meta.slot_mapping, meta.decode_seq_lens, meta.decode_block_tables)
        static_meta = self.static.decode_meta(num_seqs, meta.max_decode_seq_len)
        return dataclasses.replace(inputs, input_ids=self.static.input_ids[:num_seqs],
                                   positions=self.static.positions[:num_seqs], meta=static_meta)

    def replay(self, bucket: int, num_seqs: int) -> torch.Tensor:
        """(num_seqs, vocab) float32 logits; a view, valid until the next replay."""
        self._graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[:num_seqs]


def why_no_decode_graphs(config, device: torch.device, backend: AttentionBackend) -> str | None:
    """None when decode steps may run through CUDA graphs, else the reason they may not."""
    if device.type != "cuda":
        return f"device is {device.type}"
    if config.enforce_eager:
        return "enforce_eager is set"
    if backend.name not in GRAPH_BACKENDS:
        return f"attention backend {backend.name!r} is not graph-safe (needs one of {GRAPH_BACKENDS})"
    return None


def build_decode_graphs(config, model: torch.nn.Module, kv_caches: list, backend: AttentionBackend,
                        num_kv_heads: int, vocab_size: int, device: torch.device,
                        max_model_len: int) -> DecodeGraphRunner | None:
    """Captured decode graphs for this engine, or None (logged) where they do not apply."""
    reason = why_no_decode_graphs(config, device, backend)
    if reason is not None:
        logger.info("decode CUDA graphs off: %s", reason)
        return None
    # NOTE: as wide as the longest table: max_model_len plus a window's lookahead.
    max_blocks_per_seq = blocks_per_sequence(max_model_len, config.num_scheduler_steps,
                                             config.block_size)
    start = time.perf_counter()
    graphs = DecodeGraphRunner(model, kv_caches, backend, config.max_num_seqs, max_blocks_per_seq,
                               config.block_size, vocab_size, num_kv_heads, device)
    graphs.capture()
    logger.info("decode CUDA graphs: %d buckets %s captured in %.1f s", len(graphs.buckets),
                graphs.buckets, time.perf_counter() - start)
    return graphs


# -- the pipelined host copy ------------------------------------------------------------
@dataclass(slots=True)
class PendingHostCopy:
    host: torch.Tensor  # pinned on CUDA; valid once `event` has completed
    event: "torch.cuda.Event | None"  # None: the copy is already complete (CPU)


def start_host_copy(packed: torch.Tensor) -> PendingHostCopy:
    """Enqueue packed's copy to host memory without waiting for it (no sync)."""
    if packed.device.type != "cuda":
        return PendingHostCopy(packed.clone(), None)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return PendingHostCopy(host, event)
