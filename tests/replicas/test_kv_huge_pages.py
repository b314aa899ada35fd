"""The KV cache's CPU tensors: zeroed, and on transparent huge pages where Linux
offers them (THP `always` or `madvise`)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from replicas.kv_cache import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def _anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_zeros_are_zeros_of_the_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        t = huge_pages.zeros((7, 16, 3, 64), dtype, torch.device("cpu"))
        assert t.shape == (7, 16, 3, 64) and t.dtype == dtype and not t.any()


def test_a_tensor_smaller_than_a_huge_page_is_left_alone():
    assert not huge_pages.advise_huge_pages(torch.empty(1000))


@pytest.mark.skipif(not _thp_offered(), reason="transparent huge pages are not offered here")
def test_a_large_cache_tensor_lands_on_huge_pages():
    before = _anon_huge_kib()
    # NOTE: 64 MiB, past glibc's largest mmap threshold (32 MiB): fresh memory, as a
    # cache of this size is, not a reused piece of the heap already touched
    t = huge_pages.zeros((4096, 16, 4, 64), torch.float32, torch.device("cpu"))
    assert huge_pages.advise_huge_pages(t)
    assert _anon_huge_kib() - before >= 32 * 1024
    assert not t.any()
