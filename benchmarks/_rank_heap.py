"""The heap the timing benchmarks start their ranks with.

glibc trims its heap's top and maps large blocks afresh when they are freed, and how often a step then faults its
tensors' pages back in depends on the layout: a dp2 rank of the replay benchmark faulted ~4000 pages (16 MB) back in
on most steps in its loss alone (8.5 ms against 2.4 without), the pipeline's ranks, on half the samples per call,
hardly (docs/design/replay.md). Predictions of one layout from another cannot foresee that allocator
accident, and GPU tensors live in CUDA's caching allocator instead, so the replay and planner benchmarks start their
ranks with the heap kept: no trimming, and every block under 32 MiB (glibc's largest fixed threshold) in the heap.
"""

KEPT_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
"""glibc's environment for a kept heap (read when a process starts)."""
