import os

import pytest

from lightning_merak.testing.cores import pin_rank_to_core


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_pin_rank_to_core_restricts_to_one_allowed_core() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    try:
        core = pin_rank_to_core(len(allowed) + 1)
        assert core == allowed[1 % len(allowed)]
        assert os.sched_getaffinity(0) == {core}
    finally:
        _unpin(allowed)


def _unpin(allowed: list[int]) -> None:
    """Give every thread of this process its cores back (pinning took them from all of them)."""
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(task), set(allowed))
        except ProcessLookupError:
            continue


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no per-thread task list on this platform")
def test_pin_rank_to_core_pins_threads_started_before_it() -> None:
    import threading

    allowed = sorted(os.sched_getaffinity(0))
    started, release = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def wait_then_read() -> None:
        started.set()
        release.wait(10)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=wait_then_read)
    thread.start()
    started.wait(10)
    try:
        core = pin_rank_to_core(0)
        release.set()
        thread.join(10)
        assert seen == [{core}]
    finally:
        release.set()
        _unpin(allowed)
