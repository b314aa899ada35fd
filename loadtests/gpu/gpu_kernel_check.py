"""Kernel part of the one-shot GPU check: Triton decode accuracy against the torch
backend at real model shapes, and decode bandwidth against the device's memory: its
datasheet peak and a device-to-device copy measured in the same run.

    check_decode_kernel_accuracy() -> list[dict]   # one row per (shape, block, batch)
    measure_decode_bandwidth() -> dict             # KV bytes read / kernel time

Both need CUDA and raise `Skipped` without it; the module imports anywhere (triton
and the backends load inside the functions).
"""
from __future__ import annotations

import torch

from replicas.attention.base import AttentionMetadata

# Datasheet HBM bandwidth by device name (SXM parts); a name not listed reports None.
DATASHEET_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
COPY_BYTES = 2 << 30  # several times any L2: the copy runs from memory
# (name, num_heads, num_kv_heads, head_dim)
MODEL_SHAPES = [("llama3-8b", 32, 8, 128), ("qwen-28/4", 28, 4, 128)]
BLOCK_SIZES = [16, 256]
BATCH_SIZES = [1, 5, 64]
BF16_TOLERANCE = 2e-2  # bf16 inputs, fp32 reference: bf16 rounding of the output dominates


class Skipped(RuntimeError):
    """A check cannot run here; its message is the reason."""


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skipped("skipped: no CUDA")
    return torch.device("cuda")


def build_decode_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype: torch.dtype, device: torch.device | str,
                      seed: int = 0):
    """Random paged cache + decode metadata; seq_len 0 marks a padded row. Block tables are
    a random permutation of the blocks, as wide as the longest sequence needs."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    max_blocks = max(1, max(-(-n // block_size) for n in seq_lens))
    num_blocks = max_blocks * len(seq_lens) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:max_blocks * len(seq_lens)]
    tables = tables.view(len(seq_lens), max_blocks).to(device=device, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(seq_lens),), -1, dtype=torch.int64, device=device),
        num_prefills=0, num_prefill_tokens=0, prefill_query_start_loc=[0], prefill_seq_lens=[],
        prefill_block_tables=None, num_decodes=len(seq_lens),
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        decode_block_tables=tables, max_decode_seq_len=max(seq_lens),
    )
    return q, k_cache, v_cache, meta


def accuracy_seq_lens(batch_size: int, block_size: int, seed: int = 0) -> list[int]:
    """Lengths that cross block edges (and 2 x 256), plus a padded row when batch > 1."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 1200, (batch_size,), generator=gen).tolist()
    lens[0] = 2 * block_size + 1
    if batch_size > 1:
        lens[-1] = 0
    return lens


def check_decode_kernel_accuracy() -> list[dict]:
    """Triton decode (bf16) vs the torch backend (fp32 on the same bf16 values)."""
    device = require_cuda()
    from replicas.attention.torch_backend import TorchAttentionBackend
    from replicas.attention.triton_backend import TritonAttentionBackend

    rows = []
    for shape_name, num_heads, num_kv_heads, head_dim in MODEL_SHAPES:
        for block_size in BLOCK_SIZES:
            for batch_size in BATCH_SIZES:
                seq_lens = accuracy_seq_lens(batch_size, block_size)
                q, k_cache, v_cache, meta = build_decode_case(
                    seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, device)
                scale = head_dim ** -0.5
                out = TritonAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
                expected = TorchAttentionBackend().forward(q.float(), k_cache.float(),
                                                           v_cache.float(), meta, scale)
                is_real = torch.tensor([n > 0 for n in seq_lens], device=device)
                error = (out.float() - expected)[is_real].abs().max().item()
                padded_zero = bool((out[~is_real] == 0).all().item())
                rows.append({
                    "shape": f"{shape_name} {num_heads}/{num_kv_heads}x{head_dim}",
                    "block_size": block_size, "batch_size": batch_size,
                    "max_seq_len": max(seq_lens), "max_abs_error": error,
                    "padded_rows_zero": padded_zero,
                    "ok": error < BF16_TOLERANCE and padded_zero,
                })
    return rows


def _time_ms(fn, num_iters: int) -> float:
    fn()  # warm-up (compile, autotune-free)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / num_iters


def datasheet_bytes_per_s(device_name: str) -> float | None:
    return next((bw for key, bw in DATASHEET_BYTES_PER_S.items() if key in device_name), None)


def measure_copy_bandwidth(device: torch.device, num_iters: int = 10) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy: the
    practical ceiling a memory-bound kernel is held against."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), num_iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / (ms / 1e3)


def measure_decode_bandwidth(num_iters: int = 20) -> dict:
    """One decode-attention layer at Llama-3-8B shape (bf16): KV bytes read per second,
    for the Triton backend and (for scale) the torch backend, as a fraction of the
    device's measured copy bandwidth and of its datasheet peak."""
    device = require_cuda()
    from replicas.attention.torch_backend import TorchAttentionBackend
    from replicas.attention.triton_backend import TritonAttentionBackend

    device_name = torch.cuda.get_device_name(device)
    copy_bytes_per_s = measure_copy_bandwidth(device)
    datasheet = datasheet_bytes_per_s(device_name)
    _, num_heads, num_kv_heads, head_dim = MODEL_SHAPES[0]
    element_bytes = torch.finfo(torch.bfloat16).bits // 8
    cases = []
    for batch_size, seq_len in [(64, 2048), (256, 1024), (1, 32768)]:
        for block_size in BLOCK_SIZES:
            seq_lens = [seq_len] * batch_size
            q, k_cache, v_cache, meta = build_decode_case(
                seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, device)
            kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * element_bytes
            row = {"batch_size": batch_size, "seq_len": seq_len, "block_size": block_size,
                   "kv_bytes": kv_bytes}
            for name, backend in [("triton", TritonAttentionBackend()),
                                  ("torch", TorchAttentionBackend())]:
                ms = _time_ms(lambda b=backend: b.forward(q, k_cache, v_cache, meta,
                                                          head_dim ** -0.5), num_iters)
                row[f"{name}_ms"] = ms
                row[f"{name}_bytes_per_s"] = kv_bytes / (ms / 1e3)
                row[f"{name}_fraction_of_copy"] = row[f"{name}_bytes_per_s"] / copy_bytes_per_s
                if datasheet:
                    row[f"{name}_fraction_of_datasheet"] = row[f"{name}_bytes_per_s"] / datasheet
            cases.append(row)
            del q, k_cache, v_cache, meta
    torch.cuda.empty_cache()
    best = max(cases, key=lambda r: r["triton_bytes_per_s"])
    return {
        "device": device_name,
        "shape": "llama3-8b 32/8x128 bf16, one layer",
        "copy_bytes_per_s": copy_bytes_per_s,
        "datasheet_bytes_per_s": datasheet,
        "best_triton_bytes_per_s": best["triton_bytes_per_s"],
        "best_triton_fraction_of_copy": best["triton_fraction_of_copy"],
        "best_triton_fraction_of_datasheet": best.get("triton_fraction_of_datasheet"),
        "cases": cases,
    }
