"""A DDP checkpoint's expert optimizer state, kept per EP rank, resumes only at the ``ep_size`` that saved it:
merak-train refuses another ``moe.ep_size`` before launch with the fix named, rather than every rank raising in its
restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch import nn

from lightning_merak.checkpoint.compatible import check_resume_expert_parallel
from lightning_merak.checkpoint.expert_optimizer import (
    EXPERT_OPTIMIZER_KEY,
    expert_parallel_size,
    saved_expert_parallel_size,
)
from lightning_merak.cli.config import register_configs
from lightning_merak.cli.train import prepare


class _ExpertLayer(nn.Module):
    """What the MoE plugin's layer declares (``protocols.experts.ExpertParallelLayer``), without DeepSpeed."""

    local_experts_key = "experts."

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.ep_size, self.num_local_experts = ep_size, 4 // ep_size


def _model(*ep_sizes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), *(_ExpertLayer(size) for size in ep_sizes))


def _saved(ep_size: int, optimizer: bool = True) -> dict[str, Any]:
    """A DDP run's checkpoint as MoEPlacementCallback.on_save_checkpoint leaves it (no tensors needed here)."""
    checkpoint: dict[str, Any] = {"state_dict": {}, "global_step": 4,
                                  EXPERT_OPTIMIZER_KEY: {"ep_size": ep_size, "states": [[{}] * ep_size]}}
    if optimizer:
        checkpoint["optimizer_states"] = [{"state": {}, "param_groups": []}]
    return checkpoint


def test_the_sizes_compared() -> None:
    assert expert_parallel_size(_model()) == 1
    assert expert_parallel_size(_model(1, 2, 2)) == 2  # layers keeping every expert on each rank spread none
    assert saved_expert_parallel_size(_saved(2)) == 2
    assert saved_expert_parallel_size(_saved(2, optimizer=False)) is None  # weights only: no optimizer to restore
    assert saved_expert_parallel_size({"optimizer_states": []}) is None


def test_another_ep_size_is_refused_from_the_file(tmp_path: Path) -> None:
    file = tmp_path / "step=4.ckpt"
    torch.save(_saved(2), file)
    check_resume_expert_parallel(file, _model(2, 2))
    with pytest.raises(ValueError, match=r"resume=.*step=4\.ckpt: the checkpoint's expert optimizer state was saved "
                                         r"with moe\.ep_size=2, this run uses moe\.ep_size=1; resume with "
                                         r"moe\.ep_size=2, or start afresh"):
        check_resume_expert_parallel(file, _model(1))
    torch.save(_saved(2, optimizer=False), file)
    check_resume_expert_parallel(file, _model(1))
    directory = tmp_path / "sharded.ckpt"  # merak3d's: experts under their global numbers, no such state
    directory.mkdir()
    check_resume_expert_parallel(directory, _model(1))


def test_merak_train_refuses_another_ep_size_before_launch(tmp_path: Path) -> None:
    file = tmp_path / "ep2.ckpt"
    torch.save(_saved(2), file)
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"output_dir={tmp_path / 'run'}", "model=mixtral_tiny", "strategy=ddp", "moe=prophet", "moe.ep_size=1",
            "moe.placement=none", "model.config.hidden_size=32", "model.config.intermediate_size=64",
            "model.config.num_hidden_layers=1", "data.vocab_size=64", "data.seq_len=16", f"resume={file}"])
    with pytest.raises(ValueError, match=r"saved with moe\.ep_size=2, this run uses moe\.ep_size=1; resume with "
                                         r"moe\.ep_size=2"):
        prepare(OmegaConf.to_object(cfg))
