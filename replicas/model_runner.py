"""Runs the model for one scheduling decision: one mixed step, or a window of N
decode steps whose inputs advance in place on the device.

The step's only host sync is `_host_sync` (the sampled ids, and logprobs when
asked, in one tensor, handed on as a `StepOutput`); everything else stays on the
device. On CUDA it is
`_host_sync_pending` instead: an async copy into pinned memory, waited for only
after the next step is enqueued; decode steps there replay CUDA graphs
(replicas/cuda_graphs.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from replicas.attention.base import AttentionBackend, AttentionMetadata
from replicas.config import EngineConfig
from replicas.cuda_graphs import PendingHostCopy, build_decode_graphs, start_host_copy
from replicas.kv_cache.kv_budget import GIB, num_kv_blocks
from replicas.kv_cache.host_memory import available_host_bytes
from replicas.kv_cache.memory_profile import allocate_kv_caches, profile_cuda_memory
from replicas.models.bf16_layer_ops import load_bf16_layer_ops
from replicas.sampling.greedy import load_first_max
from replicas.models.llama import cuda_layer_ops
from replicas.models.loader import load_model
from replicas.models.model_config import ModelConfig
from replicas.models.packed_linear import pack_linears
from replicas.quant.summary import weight_bytes, weight_kinds
from replicas.request import Request
from replicas.sampling.sampler import build_sampling_batch, sample_no_sync
from replicas.scheduler import SchedulerOutput
from replicas.step_advance import advance_decode_inputs_
from replicas.sampling.structured_output import GrammarBatch
from replicas.sampling.sampled_step import StepOutput

logger = logging.getLogger("stepstream")

# (step index in the window, rows sampled, the step's sampled tokens on the host)
StepCallback = Callable[[int, list[Request], StepOutput], None]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (num_sampled,) rows of T to sample from
    sampled_rows: list[Request]


def select_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    try:
        from replicas.attention.selector import select_attention_backend
    except ImportError:
        from replicas.attention.torch_backend import TorchAttentionBackend
        if config.attention_backend not in ("auto", "torch"):
            raise ValueError(f"attention_backend {config.attention_backend!r} is not available")
        return TorchAttentionBackend()
    return select_attention_backend(config.attention_backend, device,
                                    getattr(torch, config.dtype), config.block_size)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, max_model_len: int):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.model_config = ModelConfig.from_dir(model_dir)
        # rope tables cover the longest window that may run past max_model_len
        # the KV cache's shape: this rank's heads (all of them with one rank)
        self.local_model_config = self.model_config
        layout = None
        if config.tensor_parallel_size > 1:
            from replicas.tensor_parallel.shard import local_model_config, rank_layout
            # NOTE: a model that cannot split is refused here, before any rank starts
            layout = rank_layout(self.model_config, 0, config.tensor_parallel_size)
            self.local_model_config = local_model_config(self.model_config, layout)
        self.model = load_model(model_dir, config.dtype, self.device,
                                max_model_len + config.num_scheduler_steps + 1,
                                quantization=config.quantization, layout=layout)
        self.weight_kinds = weight_kinds(self.model, config.quantization)
        if layout is not None:
            from replicas.tensor_parallel.rank_zero import RankZeroModel
            self.model = RankZeroModel(self.model, layout, self.model_config.vocab_size, config,
                                       model_dir, max_model_len)
        # NOTE: this rank's weights
        self.weight_bytes = weight_bytes(self._module)
        logger.info("weights: %s, %.0f MB", self.weight_kinds, self.weight_bytes / 1e6)
        if self.device.type == "cpu":
            pack_linears(self._module, batch_size_hint=min(config.max_num_seqs, 256))
            # NOTE: built (or read from the cache) here, not in the first request's step
            load_first_max()
            if config.dtype == "bfloat16":
                load_bf16_layer_ops()
        elif self.device.type == "cuda" and config.dtype in ("bfloat16", "float16"):
            # NOTE: compiled and checked here, before the memory profile and graph capture
            cuda_layer_ops(self.device, getattr(torch, config.dtype))
        self.backend = select_backend(config, self.device)
        logger.info("attention backend: %s", self.backend.name)
        mc = self.local_model_config
        # CUDA: the KV cache gets the memory left after the weights and the largest
        # step (replicas/kv_cache/kv_budget.py); CPU: kv_cache_gib, or a default
        # bounded by the host memory still free.
        device_memory = None
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            device_memory = profile_cuda_memory(self.model, self.backend, config, mc, self.device,
                                                max_model_len)
        host_available = available_host_bytes() if self.device.type == "cpu" else None
        self.num_blocks = num_kv_blocks(config, mc, max_model_len, device_memory, host_available)
        self.kv_caches = allocate_kv_caches(self.num_blocks, self.block_size, mc,
                                            getattr(torch, config.dtype), self.device)
        if config.tensor_parallel_size > 1:
            self.model.start_caches(self.num_blocks)
        kv_gib = sum(k.nbytes + v.nbytes for k, v in self.kv_caches) / GIB
        if device_memory is not None:
            logger.info("KV cache: %d blocks, %.2f GiB (gpu_memory_utilization %g of %.2f GiB, "
                        "%.2f GiB used without it, kv_cache_gib cap %s)", self.num_blocks, kv_gib,
                        config.gpu_memory_utilization, device_memory.total_bytes / GIB,
                        device_memory.peak_used_bytes / GIB, config.kv_cache_gib)
        elif self.device.type == "cpu":
            logger.info("KV cache: %d blocks, %.2f GiB (kv_cache_gib %s; %s GiB of host memory "
                        "available at start-up)", self.num_blocks, kv_gib, config.kv_cache_gib,
                        "unknown" if host_available is None else f"{host_available / GIB:.1f}")
        # CUDA only: decode steps replay captured graphs (None elsewhere), and each
        # step's host copy overlaps the next step (see execute).
        # NOTE: not with several ranks: a graph would replay their collectives unplanned
        self.decode_graphs = (None if config.tensor_parallel_size > 1 else build_decode_graphs(
            config, self.model, self.kv_caches, self.backend, mc.num_kv_heads, mc.vocab_size,
            self.device, max_model_len))
        self.pipelined_host_copy = self.device.type == "cuda"
        # NOTE: CPU, below float32: the lm-head's output widens into this buffer, reused
        # step after step (a step's logits are sampled before the next forward). A fresh
        # float32 tensor of a batch's logits costs its page faults each step, more than
        # the copy itself.
        self._float_logits = (torch.empty(0) if self.device.type == "cpu"
                              and config.dtype != "float32" else None)

    @property
    def _module(self) -> torch.nn.Module:
        """The model's own module (rank 0's shard with several ranks)."""
        return getattr(self.model, "model", self.model)

    def shutdown(self) -> None:
        """Stop the other ranks, where there are any."""
        stop = getattr(self.model, "stop", None)
        if stop is not None:
            stop()

    # -- inputs ---------------------------------------------------------------
    def _block_table_tensor(self, reqs: list[Request]) -> torch.Tensor:
        width = max(len(r.block_ids) for r in reqs)
        rows = [r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        prefill_seq_lens: list[int] = []
        logits_indices: list[int] = []
        rows: list[Request] = []
        for s in sched.prefill_seqs:
            req, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            ids += req.token_ids_slice(start, start + n)
            table = req.block_ids
            for p in range(start, start + n):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            query_start.append(query_start[-1] + n)
            prefill_seq_lens.append(start + n)
            if s.do_sample:
                logits_indices.append(query_start[-1] - 1)
                rows.append(req)
        num_prefill_tokens = len(ids)
        decode_seq_lens = []
        for s in sched.decode_seqs:
            req, p = s.request, s.num_computed_tokens
            ids.append(req.output_token_ids[-1])
            positions.append(p)
            slots.append(req.block_ids[p // bs] * bs + p % bs)
            decode_seq_lens.append(p + 1)
            logits_indices.append(len(ids) - 1)
            rows.append(req)
        dev = self.device
        decode_reqs = [s.request for s in sched.decode_seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_prefills=len(sched.prefill_seqs),
            num_prefill_tokens=num_prefill_tokens,
            prefill_query_start_loc=query_start,
            prefill_seq_lens=prefill_seq_lens,
            prefill_block_tables=(self._block_table_tensor([s.request for s in sched.prefill_seqs])
                                  if sched.prefill_seqs else None),
            num_decodes=len(decode_reqs),
            decode_seq_lens=(torch.tensor(decode_seq_lens, dtype=torch.int32, device=dev)
                             if decode_reqs else None),
            decode_block_tables=self._block_table_tensor(decode_reqs) if decode_reqs else None,
            # NOTE: covers the whole window, so it stays valid as lengths grow
            max_decode_seq_len=max(decode_seq_lens, default=0) + sched.num_steps - 1,
            decode_window_cache={} if sched.num_steps > 1 else None,
        )
        return StepInputs(torch.tensor(ids, dtype=torch.int64, device=dev),
                          torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                          torch.tensor(logits_indices, dtype=torch.int64, device=dev), rows)

    # -- execution ------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, on_step: StepCallback) -> None:
        inputs = self.prepare_inputs(sched)
        sampling = build_sampling_batch(inputs.sampled_rows, self.model_config.vocab_size, self.device)
        if sched.num_steps > 1 and sched.prefill_seqs:
            raise AssertionError("a multi-step window holds decodes only")
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(inputs.meta) if graphs is not None else None
        if bucket is not None:
            inputs = graphs.load_inputs(inputs, bucket)
        grammars = GrammarBatch.from_rows(inputs.sampled_rows, self.model_config.vocab_size,
                                          self.device)
        pending: PendingHostCopy | None = None
        raw_logits = None  # the logits before a grammar's mask, where logprobs need them
        # NOTE: one buffer for the window: each step's logits are sampled before the next forward
        logits_out = self._logits_buffer(len(inputs.logits_indices))
        for step in range(sched.num_steps):
            if bucket is not None:
                logits = graphs.replay(bucket, inputs.meta.num_decodes)
            else:
                logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                    self.backend, inputs.logits_indices, logits_out)
            if grammars is not None:
                # NOTE: constrained rows keep the window: their masks need the previous
                # step's tokens, so that step's host sync moves before this sampling
                # (the host computes the masks while this step's forward runs).
                if pending is not None:
                    on_step(step - 1, inputs.sampled_rows, self._host_sync_pending(pending))
                    pending = None
                # NOTE: logprobs come from the model's logits, before the mask's -inf
                raw_logits = logits.clone() if sampling.needs_logprobs else None
                grammars.mask_logits_(logits)
            sampled, packed = sample_no_sync(logits, sampling, raw_logits)
            if step + 1 < sched.num_steps:
                meta = inputs.meta
                advance_decode_inputs_(inputs.input_ids, inputs.positions, meta.decode_seq_lens,
                                       meta.slot_mapping, sampled, meta.decode_block_tables,
                                       self.block_size)
            if not self.pipelined_host_copy:
                on_step(step, inputs.sampled_rows, self._host_sync(packed))
                continue
            # NOTE: step k is fully enqueued (and its copy started) before the host
            # blocks on step k-1, so the device never waits on output processing.
            copy = start_host_copy(packed)
            if pending is not None:
                on_step(step - 1, inputs.sampled_rows, self._host_sync_pending(pending))
            pending = copy
        if pending is not None:
            on_step(sched.num_steps - 1, inputs.sampled_rows, self._host_sync_pending(pending))

    def _logits_buffer(self, num_rows: int) -> torch.Tensor | None:
        """(num_rows, vocab) float32 over the reused buffer, or None (a fresh tensor)."""
        if self._float_logits is None:
            return None
        vocab = self.model_config.vocab_size
        if self._float_logits.numel() < num_rows * vocab:
            self._float_logits = torch.empty(num_rows * vocab, dtype=torch.float32)
        return self._float_logits[:num_rows * vocab].view(num_rows, vocab)

    @staticmethod
    def _host_sync(packed: torch.Tensor) -> StepOutput:
        """NOTE: the step's one device-to-host sync point."""
        return StepOutput.from_host(packed.tolist())

    @staticmethod
    def _host_sync_pending(pending: PendingHostCopy) -> StepOutput:
        """NOTE: the step's one device-to-host sync point on CUDA: waits for this
        step's copy event only, while later steps keep the device busy."""
        if pending.event is not None:
            pending.event.synchronize()
        return StepOutput.from_host(pending.host.tolist())
