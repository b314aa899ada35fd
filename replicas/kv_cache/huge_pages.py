"""Zeroed CPU tensors backed by transparent huge pages where Linux offers them.

The paged KV cache is read a block at a time from scattered places: decode attention
over a large batch walks hundreds of MB in 12 KB pieces, and with 4 KB pages most of
those reads also miss the TLB. Asking for 2 MB pages (madvise MADV_HUGEPAGE, which
the kernel honours when transparent huge pages are `always` or `madvise`) before the
memory is first touched takes most of those misses away. A cache tensor is larger
than glibc's largest mmap threshold (32 MiB) on any real budget, so it is fresh
memory; a smaller one may reuse heap pages already touched, which keep 4 KB pages.
Elsewhere (another OS, THP `never`, a GPU tensor) it is an ordinary zeroed tensor.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

logger = logging.getLogger("stepstream")

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc.madvise


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages over the whole 2 MB pages inside `t`'s memory; True when
    the kernel took the advice. Call before the memory is first written."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return False
    try:
        return _madvise()(first, last - first, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):  # no libc found, or no madvise in it
        return False


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, on huge pages where possible (CPU, Linux)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()
