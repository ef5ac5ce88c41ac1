"""The split of the blocks a pipelined run's partitioner will choose, derived before the run.

merak3d's ``autopipe`` partitioner is deterministic given its costs: rank 0 profiles the model on one micro-batch at
start-up (:func:`~lightning_merak.parallel.pipeline.trace.trace_model`) and refines the split against the 1F1B
schedule of the run's micro-batch count, so the split moves with the micro-batch size and count (on a quiet machine
the replay benchmark's model went to three blocks and one at 2 and 4 micro-batches, two and two at 8). A what-if for
another layout therefore prices the split that profile gives, taken the same way in the driver, rather than the
traced run's or an even one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.parallel.pipeline import partition_autopipe
from lightning_merak.parallel.pipeline.trace import trace_model
from lightning_merak.strategies.merak3d.build import call_model

__all__ = ["expected_stage_blocks", "stage_blocks"]


def stage_blocks(boundaries: Any, blocks: int) -> tuple[int, ...]:
    """Blocks per stage of a merak3d partition's ``boundaries`` (graph nodes: 0 the embedding, 1 to ``blocks``
    the blocks, then the head); () where the run reported none."""
    if not boundaries:
        return ()
    ends = [*boundaries[1:], blocks + 2]
    return tuple(len(range(max(start, 1), min(end, blocks + 1))) for start, end in zip(boundaries, ends))


def expected_stage_blocks(model_config: Any, vocab: int, seq: int, micro_batch_samples: int, stages: int,
                          micro_batches: int, profiles: int = 3) -> tuple[int, ...]:
    """Blocks per stage that ``autopipe`` picks for the model built and seeded as the ranks build it, profiled on
    one thread on a micro-batch of ``micro_batch_samples`` rows, for ``stages`` stages and ``micro_batches``: the
    split most of ``profiles`` profiles give (near a tie between two splits a single profile's timing noise decides,
    as it does in the run)."""
    if micro_batch_samples < 1 or stages < 2 or micro_batches < 1 or profiles < 1:
        raise ValueError(f"a pipeline needs at least 2 stages, 1 micro-batch, 1 sample per micro-batch and 1 profile, "
                         f"got {stages} / {micro_batches} / {micro_batch_samples} / {profiles}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build_causal_lm(model_config, vocab)
        model.config.use_cache = False
        model.train()
        tokens = torch.randint(vocab, (micro_batch_samples, seq), generator=torch.Generator().manual_seed(1))
        traces = [trace_model(model, tokens, call_model, profile=True) for _ in range(profiles)]
    finally:
        torch.set_num_threads(threads)
    splits = [stage_blocks(partition_autopipe(trace.costs, stages, micro_batches).boundaries, len(trace.costs) - 2)
              for trace in traces]
    return Counter(splits).most_common(1)[0][0]
