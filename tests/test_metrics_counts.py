"""TrainingMetrics counts what a step trained: a global VariableBatch once over all ranks, its real tokens and each
sample's FLOPs at its own length, an attention mask's real tokens; the gradient norm of mixed DTensor and plain
gradients; and no stale gradient norm when a run stops between intervals."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import Precision
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks import TrainingMetrics
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.micro_batching import VariableBatch

LENGTHS = (16, 40, 140, 380, 90, 23, 200, 64)


def _flops_per_token(seq_len: int) -> float:
    return 1000.0 + 3.0 * seq_len


class _Logger:
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append(dict(metrics, step=step))

    def save(self) -> None:
        pass


def _trainer(world: int, replicas: int) -> SimpleNamespace:
    strategy = SimpleNamespace(root_device=torch.device("cpu"), precision_plugin=Precision(),
                               distributed_sampler_kwargs={"num_replicas": replicas, "rank": 0})
    return SimpleNamespace(strategy=strategy, world_size=world, is_global_zero=True, loggers=[_Logger()],
                           global_step=0, log_every_n_steps=1, precision="32-true", gradient_clip_val=None)


def _one_step(monkeypatch: pytest.MonkeyPatch, world: int, replicas: int, module: Any, batch: Any) -> dict[str, float]:
    """Rank 0's log of one step in which every rank counted what rank 0 did (as every rank reads a global batch)."""
    if world > 1:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(dist, "all_gather", lambda rows, local, group=None: [row.copy_(local) for row in rows])
    trainer = _trainer(world, replicas)
    metrics = TrainingMetrics(flops_per_token=_flops_per_token)
    metrics.on_train_start(trainer, module)
    trainer.global_step = 1
    metrics.on_train_batch_end(trainer, module, None, batch, 0)
    [logged] = trainer.loggers[0].logged
    return logged


def _per_step(logged: dict[str, float]) -> tuple[float, float, float]:
    step_s = logged["perf/step_time_s"]
    return (logged["perf/samples_per_s"] * step_s, logged["perf/tokens_per_s"] * step_s,
            logged["perf/model_tflops_per_s"] * 1e12 * step_s)


@pytest.mark.parametrize(("world", "replicas"), [(1, 1), (2, 1), (4, 2)], ids=["single", "pp2", "dp2xpp2"])
def test_a_global_variable_batch_counts_once_with_its_real_lengths(monkeypatch: pytest.MonkeyPatch, world: int,
                                                                   replicas: int):
    generator = torch.Generator().manual_seed(0)
    batch = VariableBatch.of([torch.randint(100, (length,), generator=generator) for length in LENGTHS])
    module = SimpleNamespace(split_batch=lambda batch: CausalLMModule.split_batch(None, batch))  # its probe block
    samples, tokens, flops = _per_step(_one_step(monkeypatch, world, replicas, module, batch))
    assert samples == pytest.approx(len(LENGTHS))
    assert tokens == pytest.approx(sum(LENGTHS))
    assert flops == pytest.approx(sum(length * _flops_per_token(length) for length in LENGTHS))


def test_a_replicas_batch_still_counts_once_per_replica(monkeypatch: pytest.MonkeyPatch):
    batch = torch.zeros(4, 16, dtype=torch.long)
    module = SimpleNamespace(split_batch=lambda batch: (batch, batch))
    samples, tokens, flops = _per_step(_one_step(monkeypatch, 4, 2, module, batch))  # dp2 x pp2: two batches
    assert (samples, tokens) == (pytest.approx(8), pytest.approx(128))
    assert flops == pytest.approx(128 * _flops_per_token(16))


def test_an_attention_masks_padding_is_not_counted(monkeypatch: pytest.MonkeyPatch):
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, length in enumerate((12, 5, 9)):
        mask[row, :length] = 1
    batch = {"input_ids": torch.ones(3, 12, dtype=torch.long), "attention_mask": mask}
    module = SimpleNamespace(split_batch=lambda batch: (batch["input_ids"], batch["input_ids"]))
    samples, tokens, flops = _per_step(_one_step(monkeypatch, 1, 1, module, batch))
    assert (samples, tokens) == (pytest.approx(3), pytest.approx(26))
    assert flops == pytest.approx(sum(length * _flops_per_token(length) for length in (12, 5, 9)))


def test_dtensor_and_plain_gradients_make_one_norm(single_rank_group: Any):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    module = torch.nn.Module()
    module.sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    module.plain = torch.nn.Parameter(torch.zeros(3))
    module.sharded.grad = distribute_tensor(torch.full((4, 2), 2.0), mesh, [Shard(0)])
    module.plain.grad = torch.full((3,), 1.0)
    trainer = _trainer(1, 1)
    metrics = TrainingMetrics(flops_per_token=_flops_per_token)
    metrics.on_train_start(trainer, module)
    metrics.on_before_optimizer_step(trainer, module, None)
    trainer.global_step = 1
    metrics.on_train_batch_end(trainer, module, None, torch.zeros(2, 4, dtype=torch.long), 0)
    [logged] = trainer.loggers[0].logged
    assert logged["train/grad_norm"] == pytest.approx(math.sqrt(8 * 4.0 + 3 * 1.0))


class _StepNorms(pl.Callback):
    """The reference: each optimizer step's gradient norm, by the step it makes."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms[trainer.global_step + 1] = float(torch.nn.utils.get_total_norm(grads))


def test_a_run_stopped_between_intervals_logs_no_earlier_steps_norm(tmp_path: Path):
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1}), vocab_size=32)
    logger, reference = CSVLogger(tmp_path, name="csv"), _StepNorms()
    stop_after_one_epoch = EarlyStopping(monitor="train/loss", check_on_train_epoch_end=True, stopping_threshold=1e3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=5, log_every_n_steps=4, logger=logger,
                         callbacks=[TrainingMetrics(), reference, stop_after_one_epoch], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    data = TensorDataset(torch.randint(32, (6 * 2, 8), generator=torch.Generator().manual_seed(1)))
    trainer.fit(CausalLMModule(model), DataLoader(data, batch_size=2))
    assert trainer.global_step == 6, "the run should stop off-interval, after one epoch of 6 steps"
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("perf/step_time_s")]
    assert [int(row["step"]) for row in rows] == [3, 5]
    norms = {int(row["step"]): float(row["train/grad_norm"]) for row in rows if row.get("train/grad_norm")}
    assert set(norms) == {3}, "the sixth update computed no norm: none may be logged for it"
    assert norms[3] == pytest.approx(reference.norms[4], rel=1e-5)
