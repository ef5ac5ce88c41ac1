"""Hostile values of ``Merak3DStrategy``'s arguments and of the ``optim`` and ``trainer`` groups are refused when
made, each naming its field and bound; the boundary values still pass; a run that ends inside its warm-up says so."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig, Schedule, TrainerConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments

# Merak3DStrategy -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("refused", "message", "accepted"), [
    ({"timeout_s": -5}, "timeout_s=-5 must be a positive number of seconds", {"timeout_s": 0.001}),
    ({"timeout_s": 0}, "timeout_s=0 must be a positive", {"timeout_s": 86_400}),
    ({"timeout_s": math.nan}, "timeout_s=nan must be a positive", {"timeout_s": 1}),
    ({"timeout_s": math.inf}, "timeout_s=inf must be a positive number of seconds, at most", {"timeout_s": 1e9}),
    ({"process_group_backend": "mpi2"}, "'mpi2' is not a torch.distributed backend; choose one of gloo, nccl",
     {"process_group_backend": "GLOO"}),
    ({"process_group_backend": "cpu:nccl"}, "nccl does not serve 'cpu' tensors",
     {"process_group_backend": "cpu:gloo,cuda:gloo"}),
    ({"process_group_backend": ""}, "process_group_backend='' is not a backend name", {"process_group_backend": None}),
    ({"tensor_parallel": True}, "tensor_parallel=True must be a positive integer or 'auto'", {"tensor_parallel": 1}),
    ({"pipeline_parallel": True}, "pipeline_parallel=True must be a positive integer", {"pipeline_parallel": 1}),
    ({"data_parallel": True}, "data_parallel=True must be a positive integer", {"data_parallel": 1}),
    ({"tp_overlap": True}, "tp_overlap=True must be a positive integer", {"tp_overlap": 1}),
    ({"micro_batches": True}, "micro_batches=True must be a positive integer", {"micro_batches": 1}),
    ({"micro_batches": 2.5}, "micro_batches=2.5 must be a positive integer", {"micro_batches": None}),
    ({"virtual_stages": True, "schedule": "gpipe"}, "virtual_stages=True must be a positive integer",
     {"virtual_stages": 1, "schedule": "gpipe"}),
    ({"data_parallel_sharding": "optimizer", "data_parallel_shard_size": True},
     "data_parallel_shard_size=True must be a positive integer",
     {"data_parallel_sharding": "optimizer", "data_parallel_shard_size": 1}),
    ({"memory_limit": -1}, "memory_limit=-1 must be a positive, finite number of bytes per rank", {"memory_limit": 1}),
    ({"memory_limit": 0}, "memory_limit=0 must be a positive", {"memory_limit": 2.5e9}),
    ({"memory_limit": math.nan}, "memory_limit=nan must be a positive", {"memory_limit": None}),
    ({"grad_bucket_mb": math.inf}, "grad_bucket_mb=inf must be a positive, finite number of MB",
     {"grad_bucket_mb": 0.5}),
    ({"grad_bucket_mb": True}, "grad_bucket_mb=True must be a positive", {"grad_bucket_mb": 1}),
    ({"recompute_ratio": True}, "recompute_ratio=True must lie in [0, 1]", {"recompute_ratio": 1.0}),
    ({"micro_batching_cost": (math.nan, 0.0, 0.0)}, "micro_batching_cost=(nan, 0.0, 0.0) must be three finite",
     {"micro_batching_cost": (0.0, 0, 1e-3)}),
])
def test_strategy_refuses_out_of_range_arguments_and_takes_the_boundary(
        refused: dict[str, Any], message: str, accepted: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Merak3DStrategy(**refused)
    Merak3DStrategy(**accepted)


@pytest.mark.skipif(dist.is_backend_available("mpi"), reason="this torch has MPI")
def test_strategy_refuses_a_backend_this_torch_was_built_without() -> None:
    with pytest.raises(ValueError, match=r"process_group_backend='mpi': torch .* was built without mpi"):
        Merak3DArguments(process_group_backend="mpi")
    Merak3DArguments(process_group_backend="gloo")


def test_virtual_stages_message_states_each_schedules_own_minimum() -> None:
    with pytest.raises(ValueError) as one_stage:
        Merak3DArguments(virtual_stages=-1, schedule="1f1b")
    assert "must be a positive integer (schedule='1f1b' runs one stage per rank" in str(one_stage.value)
    assert "at least 2" not in str(one_stage.value)
    with pytest.raises(ValueError, match=re.escape("virtual_stages=1 must be an integer of at least 2 with "
                                                   "schedule='interleaved_1f1b'")):
        Merak3DArguments(virtual_stages=1, schedule="interleaved_1f1b")
    assert Merak3DArguments(virtual_stages=1, schedule="1f1b").stages_per_rank == 1
    assert Merak3DArguments(virtual_stages=2, schedule="interleaved_1f1b").stages_per_rank == 2


# optim --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("refused", "message", "accepted"), [
    ({"name": "sgd", "momentum": -1.0}, "optim.momentum=-1.0 must be in [0, 1)", {"name": "sgd", "momentum": 0.0}),
    ({"name": "muon", "momentum": 1.5}, "optim.momentum=1.5 must be in [0, 1)", {"name": "muon", "momentum": 0.999}),
    ({"name": "sgd", "momentum": 1.0}, "optim.momentum=1.0 must be in [0, 1)", {"name": "sgd", "momentum": 0.95}),
    ({"momentum": math.nan}, "optim.momentum=nan must be in [0, 1)", {"momentum": 0.9}),
    ({"weight_decay": -1.0}, "optim.weight_decay=-1.0 must be a finite number >= 0", {"weight_decay": 0.0}),
    ({"name": "muon", "weight_decay": math.inf}, "optim.weight_decay=inf must be a finite number >= 0",
     {"name": "muon", "weight_decay": 0.1}),
    ({"learning_rate": 0.0}, "optim.learning_rate=0.0 must be a finite number > 0", {"learning_rate": 1e-9}),
    ({"learning_rate": math.nan}, "optim.learning_rate=nan must be a finite number > 0", {"learning_rate": 1.0}),
    ({"warmup_steps": -1}, "optim.warmup_steps=-1 must be an integer >= 0", {"warmup_steps": 0}),
    ({"warmup_steps": True}, "optim.warmup_steps=True must be an integer >= 0", {"warmup_steps": 1}),
    ({"min_lr_ratio": True}, "optim.min_lr_ratio=True must lie in [0, 1]", {"min_lr_ratio": 1.0}),
    ({"total_steps": 0}, "optim.total_steps=0 must be an integer >= 1, or null", {"total_steps": 1}),
    ({"lr_schedule": "cosinus"}, "optim.lr_schedule='cosinus' is not supported; choose one of cosine, linear",
     {"lr_schedule": Schedule.cosine}),
])
def test_optim_refuses_out_of_range_fields_and_takes_the_boundary(
        refused: dict[str, Any], message: str, accepted: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimConfig(**refused)
    OptimConfig(**accepted)


def test_optim_blames_only_the_invalid_field_and_names_each_one() -> None:
    with pytest.raises(ValueError) as refused:
        OptimConfig(learning_rate=-0.1)
    assert str(refused.value) == "optim.learning_rate=-0.1 must be a finite number > 0"
    with pytest.raises(ValueError) as both:
        OptimConfig(learning_rate=-0.1, warmup_steps=-3)
    assert "optim.learning_rate=-0.1 must be" in str(both.value)
    assert "optim.warmup_steps=-3 must be an integer >= 0" in str(both.value)


def test_optim_takes_a_schedule_by_name() -> None:
    assert OptimConfig(lr_schedule="linear").lr_schedule is Schedule.linear  # type: ignore[arg-type]


# trainer ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("refused", "message", "accepted"), [
    ({"max_steps": 0}, "trainer.max_steps=0 must be an integer of at least 1, or -1 for no limit", {"max_steps": 1}),
    ({"max_steps": -2}, "trainer.max_steps=-2 must be an integer of at least 1", {"max_steps": -1, "max_epochs": 1}),
    ({"max_epochs": 0}, "trainer.max_epochs=0 must be an integer of at least 1, or -1", {"max_epochs": 1}),
    ({"gradient_clip_val": -1.0}, "trainer.gradient_clip_val=-1.0 must be a finite number >= 0 (0 or null: no "
     "clipping)", {"gradient_clip_val": 0.0}),
    ({"gradient_clip_val": math.nan}, "trainer.gradient_clip_val=nan must be a finite number >= 0",
     {"gradient_clip_val": None}),
    ({"accumulate_grad_batches": 0}, "trainer.accumulate_grad_batches=0 must be an integer of at least 1",
     {"accumulate_grad_batches": 1}),
    ({"log_every_n_steps": 0}, "trainer.log_every_n_steps=0 must be an integer of at least 1",
     {"log_every_n_steps": 1}),
    ({"val_check_interval": 0}, "trainer.val_check_interval=0 must be an integer of at least 1, or null",
     {"val_check_interval": 1}),
    ({"limit_val_batches": -1}, "trainer.limit_val_batches=-1 must be an integer of at least 0",
     {"limit_val_batches": 0}),
    ({"seed": -1}, "trainer.seed=-1 must be an integer in [0, 4294967295]", {"seed": 0}),
    ({"seed": 2**32}, "trainer.seed=4294967296 must be an integer in [0, 4294967295]", {"seed": 2**32 - 1}),
    ({"kwargs": {"gradient_clip_algorithm": "clip"}}, "trainer.gradient_clip_algorithm='clip' must be one of norm, "
     "value", {"kwargs": {"gradient_clip_algorithm": "value"}}),
])
def test_trainer_refuses_out_of_range_fields_and_takes_the_boundary(
        refused: dict[str, Any], message: str, accepted: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainerConfig(**refused)
    TrainerConfig(**accepted)


# warm-up longer than the run ----------------------------------------------------------------------------------------


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(input_ids))


def _fit(warmup_steps: int, max_steps: int) -> list[warnings.WarningMessage]:
    tokens = torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(0))
    module = CausalLMModule(_TinyLM(), OptimConfig(warmup_steps=warmup_steps))
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    return [warning for warning in caught if "optim.warmup_steps" in str(warning.message)]


def test_warmup_longer_than_the_run_warns_once_and_trains() -> None:
    (warning,) = _fit(warmup_steps=20, max_steps=3)
    assert str(warning.message).startswith("optim.warmup_steps=20 is longer than the run's 3 optimizer steps: the "
                                           "learning rate never reaches optim.learning_rate=0.003 (at most 10% of it)")
    assert _fit(warmup_steps=3, max_steps=3) == []


def test_warmup_longer_than_an_explicit_schedule_length_warns() -> None:
    module = CausalLMModule(_TinyLM(), OptimConfig(warmup_steps=5, total_steps=4, lr_schedule=Schedule.linear))
    with pytest.warns(UserWarning, match=re.escape("optim.warmup_steps=5 is longer than the run's 4 optimizer")):
        module.configure_optimizers()
