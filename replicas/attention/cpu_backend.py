"""Attention for CPUs: decode reads the paged cache in place through a C kernel
(csrc/paged_decode_attention.c); prefill and cache writes are the torch backend's.

Decode dominates a CPU engine's attention time, and there torch has to copy each
sequence's scattered blocks into a dense padded tensor first. The kernel takes the
block tables instead. Caches of float32 or bfloat16 (with a bfloat16 cache, q and the
output may be bfloat16 too: the kernel widens and narrows them row by row); `selector.py` picks this backend on CPUs where the kernel builds, and
plain torch otherwise.
"""
from __future__ import annotations

import torch

from replicas.attention.base import AttentionMetadata
from replicas.attention.native_kernels import load_decode_input_check, load_paged_decode_attention
from replicas.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self):
        kernel, problem = load_paged_decode_attention("float32")
        if kernel is None:
            raise RuntimeError(problem)
        self._kernels = {torch.float32: kernel,
                         torch.bfloat16: load_paged_decode_attention("bfloat16")[0]}
        self._bf16_io_kernel = load_paged_decode_attention("bfloat16_io")[0]
        self._check_inputs = load_decode_input_check()[0]

    def _decode_into(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        """out[b] = attention of q[b] (heads, head_dim) over its first seq_lens[b] tokens."""
        block_tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
        B, h, d = q.shape
        num_blocks, bs, kvh, dk = k_cache.shape
        # NOTE: the kernel trusts its inputs; these checks (shapes, dtypes, lengths
        # within the table, block ids within the cache) keep a bad call from reading
        # outside the cache. A row's table must hold its blocks: padding is block 0.
        kernel = self._kernels.get(k_cache.dtype)
        if kernel is None or v_cache.dtype != k_cache.dtype or q.dtype != k_cache.dtype:
            raise TypeError("the cpu attention backend runs float32 or bfloat16 caches, with "
                            f"q of the same dtype; got q {q.dtype}, caches {k_cache.dtype}, "
                            f"{v_cache.dtype}")
        if dk != d or kvh < 1 or h < kvh or h % kvh or block_tables.shape[0] != B \
                or seq_lens.shape[0] != B:
            raise ValueError("decode attention got inconsistent shapes")
        if not (out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode attention needs contiguous output and caches")
        bf16_io = q.dtype == out.dtype == torch.bfloat16
        if bf16_io:
            kernel, q = self._bf16_io_kernel, q.contiguous()
            result = out
        else:
            q = q.float().contiguous()  # NOTE: (B, h, d): small beside the cache it reads
            result = out if out.dtype == torch.float32 else torch.empty(out.shape,
                                                                        dtype=torch.float32)
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        width = tables.shape[1]
        # NOTE: length 0 is a padded row (a fixed-size batch): it reads nothing.
        # Only the blocks a row reads must be in the cache (the rest is padding).
        bad = self._check_inputs(tables.data_ptr(), lens.data_ptr(), B, bs, width, num_blocks)
        if bad == 1:
            raise ValueError("a decode sequence length is outside its block table")
        if bad:
            raise ValueError(f"a block id is outside the cache's {num_blocks} blocks")
        rc = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                    lens.data_ptr(), result.data_ptr(), B, h, kvh, d, bs, width, scale,
                    torch.get_num_threads())
        if rc != 0:
            raise MemoryError("decode attention could not allocate its scratch memory")
        if result is not out:
            out.copy_(result)
