"""A merak3d MoE run at ``data_parallel="auto"`` (the README's ``moe=prophet`` default) resumes: Lightning restores
the checkpoint before ``setup``, and the experts each rank reads follow the layout adopted when the processes
started, which resolved the ``"auto"`` degree."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

RESUME_AT = 2


def test_expert_placement_reads_the_layout_adopted_at_start() -> None:
    strategy = Merak3DStrategy(data_parallel="auto")
    with pytest.raises(ValueError, match="needs fixed degrees"):  # no layout yet: the arguments leave dp open
        strategy._expert_placement()
    strategy._groups = SimpleNamespace(layout=strategy._arguments.layout(2))  # as setup_environment adopts it
    assert strategy._expert_placement() == (0, (1, 2, 1))
    assert strategy._checkpointer._data_parallel_ranks() == (0, [0, 1])  # the ranks its expert groups are carved from


def auto_resume_run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """dp="auto" on 2 ranks (so dp=2), experts split over both; saved after an epoch of 2 steps, resumed into a model
    initialised otherwise (the epochs as in tests/test_moe_checkpoint.py's merak3d run)."""
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from tests.test_moe_checkpoint import _AdamModule
    from tests.test_moe_lightning import BATCH, OPTIM, STEPS, _batches, _model, _Recorder, local_experts

    config = ProphetMoEConfig(ep_size=2, aux_loss_coef=0.0, dispatch="dropless", placement="none")
    data = _batches(rank)

    def fit(seed: int, first_step: int, last_step: int, epochs: int = 1, ckpt_path: str | None = None) -> tuple:
        module = _AdamModule(config.apply(_model(seed)), OPTIM)
        recorder = _Recorder()
        strategy = Merak3DStrategy(data_parallel="auto", timeout_s=150)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
            callbacks=[recorder, config.build_callbacks()[0]],
        )
        loader = DataLoader(TensorDataset(data[first_step * BATCH:last_step * BATCH]), batch_size=BATCH)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer, recorder.losses, local_experts(strategy)

    path = str(Path(directory) / "auto-moe")
    _, straight, straight_experts = fit(0, 0, STEPS)
    trainer, interrupted, _ = fit(0, 0, RESUME_AT)
    trainer.save_checkpoint(path)
    _, resumed, resumed_experts = fit(1, RESUME_AT, STEPS, epochs=2, ckpt_path=path)
    return {"straight": straight, "interrupted": interrupted, "resumed": resumed,
            "straight_experts": straight_experts, "resumed_experts": resumed_experts}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_merak3d_moe_resumes_at_data_parallel_auto(tmp_path: Path) -> None:
    from tests.test_moe_lightning import STEPS

    results = run_distributed(auto_resume_run, 2, args=(str(tmp_path),), timeout_s=240)
    assert set(results[0]["straight_experts"]) != set(results[1]["straight_experts"]), "ranks hold other experts"
    for rank, result in enumerate(results):
        assert result["interrupted"] == pytest.approx(result["straight"][:RESUME_AT], rel=1e-6)
        assert len(result["resumed"]) == STEPS - RESUME_AT
        assert result["resumed"] == pytest.approx(result["straight"][RESUME_AT:], rel=1e-5), f"rank {rank}"
        assert set(result["resumed_experts"]) == set(result["straight_experts"])
        for key, value in result["straight_experts"].items():
            error = (result["resumed_experts"][key] - value).abs().max().item()
            assert error < 1e-5, f"rank {rank}: expert {key} differs by {error:.3g} after resuming"
