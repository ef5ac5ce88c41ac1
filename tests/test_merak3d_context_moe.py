"""A transformers MoE model under merak3d context parallelism (``output_router_logits=True``): experts replicated,
or spread over the context-parallel ranks by ``merak_ep``; the router aux loss over the whole batch's tokens.

Both ranks hold every sample's shard (one batch replica, ``context_parallel=2``); the reference is the unsplit
model with labels over the whole batch, stepped by SGD.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_merak.testing import LayoutTraceRecorder, run_distributed
from lightning_merak.testing.data import ReplicaBatches
from tests.test_merak3d_router_aux import (
    STEPS,
    _batches,
    _model,
    _reference,
    _SGDModule,
    assert_step_gradients_match,
    expert_slices,
)


def _train_rank(rank: int, world_size: int, layout: dict[str, Any],
                expert_modes: tuple[bool, ...] = (False, True)) -> dict[bool, dict[str, Any]]:
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    results = {}
    for expert_parallel in expert_modes:
        recorder = LayoutTraceRecorder()
        callbacks: list[pl.Callback] = [recorder]
        if expert_parallel:  # its expert group: the two context-parallel ranks
            callbacks.append(ExpertParallelCallback(log_every_n_steps=1))
        strategy = Merak3DStrategy(data_parallel=1, context_parallel=2, context_attention="ring", timeout_s=120,
                                   **layout)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks)
        trainer.fit(_SGDModule(_model("mixtral")), datamodule=ReplicaBatches(_batches(), 0, STEPS))
        experts = expert_slices(trainer.lightning_module.model)
        assert bool(experts) == expert_parallel
        results[expert_parallel] = {"losses": recorder.losses, "gradients": recorder.gradients, "experts": experts}
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_context_parallel_trains_a_moe_model_and_its_router_aux_loss_as_one_process() -> None:
    expected = _reference("mixtral", 1, 1)
    for rank, by_mode in enumerate(run_distributed(_train_rank, 2, args=({},), timeout_s=280)):
        for expert_parallel, result in by_mode.items():
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), (rank, expert_parallel)
            assert assert_step_gradients_match(result, expected, rank) == set(expected["gradients"][0])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sub_batches_of_tp_overlap_record_the_routers_of_the_whole_batch_under_context_parallelism() -> None:
    """Each sub-batch's router logits join the whole batch's aux loss (in batch order), and each sub-batch's share
    of the token loss is summed."""
    expected = _reference("mixtral", 1, 1)
    layout = {"tensor_parallel": 2, "tp_overlap": 2}
    for rank, by_mode in enumerate(run_distributed(_train_rank, 4, args=(layout, (False,)), timeout_s=280)):
        result = by_mode[False]
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), rank
        assert assert_step_gradients_match(result, expected, rank) == set(expected["gradients"][0])
