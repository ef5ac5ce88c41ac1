"""Context parallelism: each sequence is split over ``cp`` ranks and attention gathers what it needs.

Pure (no process group), usable and testable in one process:

* :mod:`~lightning_merak.parallel.context.sharding`: the load-balanced layout (rank ``r`` holds chunks ``r`` and
  ``2 cp - 1 - r`` of ``2 cp``), each rank's global positions, packed-document ids, and the inverse.
* :mod:`~lightning_merak.parallel.context.blockwise`: attention of a query block over one key/value block as
  ``(out, lse)`` on the SDPA kernels, the merge of partials, and a block's share of the gradients.
* :mod:`~lightning_merak.parallel.context.variable`: a degree per sample of a variable-length global batch (long
  samples split, short ones whole on one rank), planned into rounds on a cost model under a per-rank token cap.

Over a process group (the context-parallel group; P2P and all-to-all use its ranks' global ranks):

* :mod:`~lightning_merak.parallel.context.ring`: ring attention, key/value shards passed around the ring.
* :mod:`~lightning_merak.parallel.context.ulysses`: all-to-all attention, heads scattered and sequence gathered.
* :mod:`~lightning_merak.parallel.context.rounds`: this rank's rounds of a per-sample plan, each at its degree.

Both take ``(batch, heads, seq_local, head_dim)`` tensors (the transformers layout) and return this rank's output.
"""

from lightning_merak.parallel.context.blockwise import (
    AttentionKernel,
    BlockPiece,
    BlockVisibility,
    attend_block,
    attend_block_backward,
    classify_block,
    merge_attention,
    plan_blocks,
    select_kernel,
)
from lightning_merak.parallel.context.ring import ring_attention
from lightning_merak.parallel.context.sharding import (
    LoadBalancedLayout,
    check_sequence_divisible,
    document_ids_from_position_ids,
)
from lightning_merak.parallel.context.ulysses import check_heads_divisible, ulysses_attention

__all__ = [
    "AttentionKernel",
    "BlockPiece",
    "BlockVisibility",
    "LoadBalancedLayout",
    "attend_block",
    "attend_block_backward",
    "check_heads_divisible",
    "check_sequence_divisible",
    "classify_block",
    "document_ids_from_position_ids",
    "merge_attention",
    "plan_blocks",
    "ring_attention",
    "select_kernel",
    "ulysses_attention",
]
