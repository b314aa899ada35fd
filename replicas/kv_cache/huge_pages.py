"""Ask Linux to back a large CPU tensor with 2 MiB pages, before its first touch.

Why: decode attention reads each sequence's KV blocks from random places in a
cache of gigabytes. With 4 KiB pages nearly every block read misses the TLB and
waits for a page walk; 2 MiB pages cover the cache with a few hundred TLB
entries. Machines whose transparent huge pages are set to `madvise` (a common
default) give them only to memory that asks, which is what this does.

Best effort: on other systems, or when the kernel refuses, the tensor keeps
ordinary pages and works the same.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # linux/mman.h

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether the kernel took the advice for the whole 2 MiB pages inside `tensor`'s
    memory (False: not Linux, not CPU, too small, or refused). Call it before the
    tensor is written: pages already touched stay small."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (start + tensor.untyped_storage().nbytes()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= first:
        return False
    try:
        rc = _libc_madvise()(first, end - first, _MADV_HUGEPAGE)
    except (OSError, AttributeError) as e:
        logger.debug("no madvise here: %s", e)
        return False
    if rc != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True
