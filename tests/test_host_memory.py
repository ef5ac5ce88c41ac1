"""release_freed_host_memory: glibc takes the setting; a freed large tensor leaves resident memory.
heap_stats: freed-but-kept heap told apart from live allocations."""

import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_merak.distributed.host_memory import heap_stats, release_freed_host_memory


def test_refuses_a_threshold_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="threshold_bytes=0"):
        release_freed_host_memory(0)


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_mid_sized_tensors_leave_resident_memory() -> None:
    """Holes between live 256 KiB tensors stay resident by default and are returned with the setting."""
    script = textwrap.dedent("""
        import sys, torch
        from lightning_merak.distributed.host_memory import release_freed_host_memory
        def rss():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
        if sys.argv[1] == "1":
            assert release_freed_host_memory()
        before = rss()
        tensors = [torch.ones(64 * 1024) for _ in range(2000)]  # 256 KiB each, 500 MiB
        del tensors[::2]
        print(rss() - before)
    """)
    grown = [int(subprocess.run([sys.executable, "-c", script, flag], capture_output=True, text=True,
                                check=True, timeout=120).stdout.split()[-1]) for flag in ("0", "1")]
    assert grown[1] < 0.7 * grown[0], grown


@pytest.mark.skipif(heap_stats() is None, reason="glibc's mallinfo2")
def test_heap_stats_tells_freed_heap_from_live() -> None:
    """Every other 4 KiB tensor freed: the holes between live ones count as free heap, the rest as in use."""
    before = heap_stats()
    tensors = [torch.ones(1024) for _ in range(4000)]  # 4 KiB each: in the heap under any mmap threshold
    filled = heap_stats()
    del tensors[::2]
    after = heap_stats()
    assert before is not None and filled is not None and after is not None
    assert filled.in_use - before.in_use >= 4000 * 4096
    assert after.free - filled.free >= 0.9 * 2000 * 4096
    assert filled.in_use - after.in_use >= 0.9 * 2000 * 4096


def test_after_skip_final_collection_a_collection_leaves_earlier_cycles_alone() -> None:
    """A command freezes its objects when done: a full collection (as at exit) then walks none of them."""
    import gc
    import weakref

    from lightning_merak.distributed.host_memory import skip_final_collection

    class Node:
        pass

    node = Node()
    node.itself = node
    alive = weakref.ref(node)
    try:
        skip_final_collection()
        del node
        gc.collect()
        assert alive() is not None  # frozen: the collection did not visit the cycle
    finally:
        gc.unfreeze()
    gc.collect()
    assert alive() is None  # unfrozen, the same collection finds it
