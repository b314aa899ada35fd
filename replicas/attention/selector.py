"""Picks the attention backend at start-up and logs which one and why.

`auto`: flash-attn when it imports, on CUDA, fp16/bf16 and a block size that is a
multiple of 256; else Triton when it imports and the device is CUDA; on CPU with
float32 or bfloat16, the cpu backend when its C kernel builds; else torch.
An explicit name forces that backend or raises ValueError saying why it cannot run.
Backends import lazily, so this module loads on machines with neither flash-attn
nor triton.
"""
from __future__ import annotations

import importlib
import logging
import os

import torch

from replicas.attention.base import AttentionBackend
from replicas.config import ATTENTION_BACKENDS

logger = logging.getLogger("stepstream")

BACKEND_NAMES = ATTENTION_BACKENDS
_ALIASES = {"flash_attn": "flash-attn", "flashattn": "flash-attn", "flash-attention": "flash-attn"}


def select_attention_backend(requested: str, device: torch.device | str, dtype: torch.dtype,
                             block_size: int) -> AttentionBackend:
    device = torch.device(device)
    name = _ALIASES.get(requested.lower(), requested.lower())
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {BACKEND_NAMES}")
    if name == "auto":
        name, reason = _auto_choice(device, dtype, block_size)
    else:
        problem = why_backend_cannot_run(name, device, dtype, block_size)
        if problem is not None:
            raise ValueError(f"attention backend {name!r} cannot run here: {problem}")
        reason = "requested explicitly"
    backend = _build(name)
    logger.info("attention backend: %s (%s; device=%s, dtype=%s, block_size=%d)",
                name, reason, device, dtype, block_size)
    return backend


def why_backend_cannot_run(name: str, device: torch.device, dtype: torch.dtype,
                           block_size: int) -> str | None:
    """None when backend `name` can run with these settings, else the reason it cannot."""
    if name == "torch":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"it runs on CPU only, got {device.type!r}"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"it runs float32 and bfloat16 only, got {dtype}"
        from replicas.attention.native_kernels import load_paged_decode_attention
        return load_paged_decode_attention()[1]
    if name == "triton":
        problem = _import_problem("triton")
        if problem is None and device.type != "cuda" and not _triton_interpreter_on():
            problem = (f"it needs a CUDA device, got {device.type!r} "
                       "(TRITON_INTERPRET=1 runs its kernels on CPU, for tests only)")
        if problem is None and block_size & (block_size - 1):
            problem = f"block_size must be a power of two, got {block_size}"
        return problem
    if name == "flash-attn":
        problem = _import_problem("flash_attn")
        if problem is None and device.type != "cuda":
            problem = f"it needs a CUDA device, got {device.type!r}"
        if problem is None:
            from replicas.attention.flash_attn_backend import check_flash_attn_supports
            try:
                check_flash_attn_supports(dtype, block_size)
            except ValueError as error:
                problem = str(error)
        return problem
    raise ValueError(f"unknown attention backend {name!r}")


def _auto_choice(device: torch.device, dtype: torch.dtype, block_size: int) -> tuple[str, str]:
    skipped = []
    for name in ("flash-attn", "triton"):
        problem = why_backend_cannot_run(name, device, dtype, block_size)
        # NOTE: auto never picks the Triton interpreter; it is for tests only.
        if problem is None and device.type != "cuda":
            problem = f"it needs a CUDA device, got {device.type!r}"
        if problem is None:
            return name, "auto: " + "; ".join(skipped + [f"{name} fits"])
        skipped.append(f"not {name}: {problem}")
    if device.type == "cpu":
        problem = why_backend_cannot_run("cpu", device, dtype, block_size)
        if problem is None:
            return "cpu", "auto: " + "; ".join(skipped + ["cpu fits (float32 or bfloat16, its kernel builds)"])
        skipped.append(f"not cpu: {problem}")
    return "torch", "auto: " + "; ".join(skipped)


def _build(name: str) -> AttentionBackend:
    if name == "flash-attn":
        from replicas.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend()
    if name == "triton":
        from replicas.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name == "cpu":
        from replicas.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend()
    from replicas.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()


def _import_problem(module: str) -> str | None:
    # NOTE: a real import, not find_spec: a flash-attn built for another torch or CUDA
    # is found but fails to load (undefined symbols).
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure means "cannot use it"
        return f"{module} does not import ({type(error).__name__}: {error})"
    return None


def _triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
