"""SparseCommunication on a LightningModule that builds its model in ``configure_model``, which Lightning calls
after the callbacks' ``setup``: the tables are replaced once they exist, before the optimizer is created."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.sparse_comm import ShardedEmbedding, ShardedTiedHead, SparseCommunication
from lightning_merak.testing import run_distributed

VOCAB, DIM, SEQ, STEPS = 2048, 16, 12, 4


class _TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights wherever and whenever it is built
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: the head is swapped too

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class _Module(pl.LightningModule):
    """Builds its model in ``__init__`` or, as Lightning recommends for large models, in ``configure_model``."""

    def __init__(self, in_configure_model: bool) -> None:
        super().__init__()
        self.model: _TokenModel | None = None if in_configure_model else _TokenModel()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _TokenModel()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _RecordingDDP(DDPStrategy):
    """Records, instead of wrapping the model and creating its optimizers, what the table was at that moment."""

    def __init__(self, module: _Module) -> None:
        super().__init__()
        self.module = module
        self.tables_at_setup: list[type] = []

    def setup(self, trainer: pl.Trainer) -> None:
        self.tables_at_setup.append(type(self.module.model.embed))


def test_a_model_built_in_configure_model_is_sharded_before_the_strategy_sets_up(single_rank_group) -> None:
    module = _Module(in_configure_model=True)
    strategy = _RecordingDDP(module)
    trainer = SimpleNamespace(strategy=strategy, world_size=2)
    callback = SparseCommunication("embrace", min_table_rows=VOCAB, bandwidth_gbit=1.0)
    callback.setup(trainer, module, "fit")  # Lightning's order: the callbacks' setup, configure_model, strategy setup
    module.configure_model()
    strategy.setup(trainer)
    assert strategy.tables_at_setup == [ShardedEmbedding]
    assert callback.distinct_tables == [module.model.embed] and isinstance(module.model.head, ShardedTiedHead)
    assert "setup" not in vars(strategy)  # the strategy's own method again, for a later fit or test


def test_embrace_refuses_tables_on_the_meta_device_before_any_collective() -> None:
    """merak3d builds a configure_model() model on meta: refused, naming S2, before the build fails on the shard."""
    with torch.device("meta"):
        module = _Module(in_configure_model=False)
    with pytest.raises(ValueError, match=r"cannot shard \['model\.embed'\]: their weights are on the meta device.*"
                                         r"method='s2' \(merak-train: comm=s2, or strategy=ddp\)"):
        SparseCommunication("embrace", min_table_rows=VOCAB).check_tables(module)
    SparseCommunication("s2", min_table_rows=VOCAB).check_tables(module)  # S2 reads the gradients only


def test_distinct_tables_name_a_table_held_under_several_names_once(single_rank_group) -> None:
    shared, other = ShardedEmbedding(torch.zeros(8, 4)), ShardedEmbedding(torch.zeros(8, 4))
    callback = SparseCommunication("embrace")
    callback.sharded_tables = {"emb": shared, "emb2": shared, "other": other}
    assert callback.distinct_tables == [shared, other]


def _fit(in_configure_model: bool) -> dict[str, object]:
    module = _Module(in_configure_model)
    data = TensorDataset(torch.randint(0, VOCAB, (STEPS * 2 * 4, SEQ + 1), generator=torch.Generator().manual_seed(1)))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SparseCommunication("embrace", min_table_rows=VOCAB)],
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    table = module.model.embed
    stepped = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    return {"losses": module.losses, "sharded": isinstance(table, ShardedEmbedding),
            "shard_in_optimizer": isinstance(table, ShardedEmbedding) and id(table.shard) in stepped}


def _both_builds(rank: int, world_size: int) -> dict[str, dict[str, object]]:
    torch.use_deterministic_algorithms(True)
    return {"init": _fit(in_configure_model=False), "configure_model": _fit(in_configure_model=True)}


@pytest.mark.distributed
def test_embrace_shards_a_model_built_in_configure_model_as_one_built_in_init() -> None:
    for runs in run_distributed(_both_builds, 2, timeout_s=180):
        for build in ("init", "configure_model"):
            assert runs[build]["sharded"] and runs[build]["shard_in_optimizer"], build
        assert len(runs["configure_model"]["losses"]) == STEPS
        torch.testing.assert_close(runs["configure_model"]["losses"], runs["init"]["losses"], rtol=1e-6, atol=1e-6)
