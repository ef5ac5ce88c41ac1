"""SparseCommunication under Lightning's DDP (2 gloo ranks) against dense DDP, where it once differed: EmbRace resumes
every rank's columns of Adam's moments; a user's ``sparse=True`` table is reduced before a callback ordered ahead of
it reads the gradients (``TrainingMetrics``' norm); S2 trains a table one rank's batches skip under
``find_unused_parameters=True``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_merak.callbacks import SparseCommunication, TrainingMetrics
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks

VOCAB, AUX, WIDTH, SEQ, BATCH, STEPS, RANKS = 512, 300, 16, 8, 2, 4, 2


class _Model(pl.LightningModule):
    """A token table, a next-token head and, with ``aux``, a second table read by the batches whose first id is
    even."""

    def __init__(self, optimizer: str, sparse: bool = False, aux: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, WIDTH, sparse=sparse)
        self.aux = nn.Embedding(AUX, WIDTH) if aux else None
        self.head = nn.Linear(WIDTH, VOCAB)
        self.optimizer = optimizer
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        hidden = self.tok(ids)
        if self.aux is not None and int(ids[0, 0]) % 2 == 0:
            hidden = hidden + self.aux(ids % AUX)
        loss = nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _LoggedNorms(Logger):
    """The ``train/grad_norm`` a logger receives (``TrainingMetrics`` logs from global rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    @property
    def name(self) -> str:
        return "norms"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "train/grad_norm" in metrics:
            self.norms.append(float(metrics["train/grad_norm"]))


def _batches(rank: int, aux_on_one_rank: bool) -> DataLoader:
    """Rank 0's batches all start with an even id; with ``aux_on_one_rank`` rank 1's all with an odd one (its
    batches never read ``aux``), else at random."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (STEPS * BATCH * RANKS, SEQ), generator=generator)
    if aux_on_one_rank:
        ids[0::2, 0] = 2 * torch.randint(1, 50, (ids.shape[0] // 2,), generator=generator)
        ids[1::2, 0] = ids[0::2, 0] + 1
    data = TensorDataset(ids)
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, RANKS, rank, shuffle=False))


def _fit(rank: int, root: Path, module: _Model, callbacks: list[pl.Callback], max_steps: int = STEPS,
         ckpt_path: Path | None = None, find_unused: bool = False, aux_on_one_rank: bool = False,
         logger: Logger | bool = False, accumulate: int = 1) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=RANKS, max_steps=max_steps, logger=logger, log_every_n_steps=1,
                         accumulate_grad_batches=accumulate,
                         strategy=DDPStrategy(process_group_backend="gloo", find_unused_parameters=find_unused),
                         callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, default_root_dir=root)
    trainer.fit(module, _batches(rank, aux_on_one_rank), ckpt_path=ckpt_path)
    return trainer


def _resumed(rank: int, root: Path, method: str | None) -> dict[str, Any]:
    """Adam for half the steps, a checkpoint, a new run resuming it: the resumed run's losses and final table."""
    def comm() -> list[pl.Callback]:
        return [SparseCommunication(method, min_table_rows=VOCAB, bandwidth_gbit=10.0)] if method else []

    checkpoint = root / f"{method}.ckpt"
    _fit(rank, root, _Model("adam"), comm(), max_steps=STEPS // 2).save_checkpoint(checkpoint)
    module, callbacks = _Model("adam"), comm()
    _fit(rank, root, module, callbacks, ckpt_path=checkpoint)
    table = callbacks[0].distinct_tables[0].full_weight() if method else module.tok.weight.detach()
    return {"losses": module.losses, "tok": table.clone()}


def ddp_runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {f"resumed_{method}": _resumed(rank, Path(root), method) for method in (None, "embrace")}
    for name, comm in (("dense", []), ("s2", [SparseCommunication("s2", min_table_rows=VOCAB, bandwidth_gbit=10.0)])):
        norms = _LoggedNorms()
        _fit(rank, Path(root), _Model("sgd", sparse=True), [TrainingMetrics(), *comm], logger=norms, accumulate=2)
        results[f"metrics_first_{name}"] = norms.norms
    for method in (None, "s2", "auto"):
        module = _Model("sgd", aux=True)
        comm = [SparseCommunication(method, min_table_rows=AUX, bandwidth_gbit=10.0)] if method else []
        _fit(rank, Path(root), module, comm, find_unused=True, aux_on_one_rank=True)
        results[f"unused_{method}"] = {name: value.clone() for name, value in module.state_dict().items()}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(ddp_runs, RANKS, args=(str(tmp_path_factory.mktemp("ddp_runs")),), timeout_s=300)


def test_embrace_resumes_every_ranks_columns_of_the_adam_moments(runs: list[dict[str, Any]]) -> None:
    """The checkpoint once held rank 0's columns of Adam's moments alone, so rank 1 resumed with rank 0's."""
    for result in runs:
        dense, embrace = result["resumed_None"], result["resumed_embrace"]
        assert embrace["losses"] == pytest.approx(dense["losses"], rel=0, abs=1e-6)
        torch.testing.assert_close(embrace["tok"], dense["tok"], rtol=0, atol=1e-6)


def test_a_callback_ahead_of_s2_sees_the_sparse_tables_reduced_gradient(runs: list[dict[str, Any]]) -> None:
    """``TrainingMetrics`` ordered before SparseCommunication logs the norm of dense DDP's averaged gradient, of two
    accumulated batches."""
    logged = runs[0]  # by global rank 0
    assert len(logged["metrics_first_s2"]) == STEPS
    assert logged["metrics_first_s2"] == pytest.approx(logged["metrics_first_dense"], rel=1e-6)


@pytest.mark.parametrize("method", ["s2", "auto"])
def test_s2_trains_a_table_one_rank_skips_under_find_unused_parameters(runs: list[dict[str, Any]],
                                                                       method: str) -> None:
    for result in runs:
        for name, value in result["unused_None"].items():
            torch.testing.assert_close(result[f"unused_{method}"][name], value, rtol=0, atol=1e-6, msg=name)
