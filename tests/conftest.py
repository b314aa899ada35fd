import os

# NOTE: 2-core machines: one intra-op thread per process keeps parallel helpers
# (Ray replicas, output threads) from thrashing; set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
