"""The CPU KV cache asks for 2 MiB pages before its zeros touch it; the advice is
best effort and never changes what the cache holds."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from replicas.kv_cache.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages
from replicas.kv_cache.memory_profile import allocate_kv_caches
from replicas.models.model_config import ModelConfig

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def test_memory_smaller_than_a_huge_page_is_not_advised():
    assert advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 8, dtype=torch.uint8)) is False


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="transparent huge pages are off or absent here")
def test_a_large_tensor_is_advised_on_linux_with_transparent_huge_pages():
    tensor = torch.empty(8 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    assert advise_huge_pages(tensor) is True
    tensor.fill_(3)
    assert int(tensor.sum()) == 3 * tensor.numel()


def test_the_cpu_cache_is_zeros_of_the_asked_shape_and_dtype():
    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "num_key_value_heads": 2})
    caches = allocate_kv_caches(4096, 16, config, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 2
    for k, v in caches:  # 4 MiB each: whole huge pages inside
        assert k.shape == v.shape == (4096, 16, 2, 16) and k.dtype == torch.bfloat16
        assert not k.any() and not v.any()
