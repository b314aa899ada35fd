import os

# NOTE: 2-core machines: one intra-op thread per process keeps parallel helpers
# (Ray replicas, output threads) from thrashing; set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


_ENGINE_FOLDERS = ("replicas", "gpu")  # tests/<folder>/: the engine's tests
# ... but for these, among the longest: the other lane without Ray has the time (its
# tests are shorter), and the two end closer together
_IN_THE_OTHER_LANE = {"test_trained_parity.py", "test_tensor_parallel.py"}


def pytest_itemcollected(item):
    # NOTE: here, before `-m` deselects: `make test` runs the engine's tests without
    # Ray in a lane of their own (tests/run_lanes.py)
    if (item.path.parent.name in _ENGINE_FOLDERS and item.path.parent.parent.name == "tests"
            and item.path.name not in _IN_THE_OTHER_LANE):
        item.add_marker(pytest.mark.engine)


def pytest_collection_modifyitems(config, items):
    # The modules that share one local Ray (and Serve on it) run first, one after
    # another, so it starts once; then the rest; those that start a Ray of their own in
    # this process last (in `make test` the Ray lane's, once its shared Ray is down).
    # A test that slows the machine on purpose goes last in its lane: its bounds hold
    # for the load it makes, and the other lanes beside it at their busiest stretched
    # a first token past them (their load is not its to bound).
    items.sort(key=lambda item: (item.get_closest_marker("shared_ray") is None,
                                 item.get_closest_marker("own_ray") is not None,
                                 item.get_closest_marker("slows_the_machine") is not None))
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own teardown (its module's Serve app is down by then): shut
    the shared local Ray down unless the next test shares it too."""
    result = yield
    if nextitem is None or nextitem.get_closest_marker("shared_ray") is None:
        import cluster_support

        cluster_support.shut_down_shared_ray()
    return result
