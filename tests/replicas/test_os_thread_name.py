"""The engine's threads carry names the OS shows (replicas/os_thread_name.py)."""
import sys
import threading

import pytest

from replicas.os_thread_name import ENGINE_OUTPUT_THREAD, ENGINE_STEP_THREAD, name_this_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")
def test_a_thread_named_for_the_os_shows_its_name_and_the_process_keeps_its_own():
    seen = {}

    def run():
        name_this_thread(ENGINE_STEP_THREAD)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen["thread"] = f.read().strip()

    with open("/proc/self/comm") as f:
        process_name = f.read().strip()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["thread"] == ENGINE_STEP_THREAD
    with open("/proc/self/comm") as f:
        assert f.read().strip() == process_name


def test_names_fit_the_kernels_limit_and_a_long_one_is_cut_not_refused():
    assert len(ENGINE_STEP_THREAD.encode()) <= 15 and len(ENGINE_OUTPUT_THREAD.encode()) <= 15
    done = []
    thread = threading.Thread(target=lambda: done.append(name_this_thread("x" * 40)))
    thread.start()
    thread.join()
    assert done == [None]
