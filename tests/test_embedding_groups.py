"""Embeddings sharing one weight under EmbRace (one sharded table per weight, under every name), and DeltaMemory
overrides named relative to the LightningModule's ``model`` (as docs/guides/memory.md writes them)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.delta import Action, DeltaMemory
from lightning_merak.callbacks.sparse_comm import ShardedEmbedding, ShardedTiedHead, SparseCommunication
from lightning_merak.callbacks.sparse_comm.embrace import shard_embeddings, table_groups
from lightning_merak.callbacks.sparse_comm.embrace_checkpoint import whole_tables_in
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

STEPS, BATCH, SEQ, VOCAB, HIDDEN = 3, 8, 8, 128, 32


class SharedEmbeddings(nn.Module):
    """Two embeddings holding one weight Parameter, both looked up (the second on reversed ids), and a head that
    may be tied to that weight too."""

    def __init__(self, tied_head: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.emb2 = nn.Embedding(VOCAB, HIDDEN)
        self.emb2.weight = self.emb.weight
        self.body = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied_head:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids) + 0.5 * self.emb2(torch.flip(ids, [1]))))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(7))


class _Module(pl.LightningModule):
    def __init__(self, tied_head: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = SharedEmbeddings(tied_head)
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = _loss(self.model, batch[0])
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args: object) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=0.01)


class _RankShare(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        share = BATCH // kwargs["num_replicas"]
        local = _batches()[:, kwargs["rank"] * share:(kwargs["rank"] + 1) * share].reshape(-1, SEQ)
        return DataLoader(TensorDataset(local), batch_size=share, shuffle=False)


def _fit(tied_head: bool, callbacks: list[pl.Callback]) -> _Module:
    module = _Module(tied_head)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks,
    )
    trainer.fit(module, datamodule=_RankShare())
    return module


def embrace_against_ddp(rank: int, world_size: int) -> dict[str, object]:
    """Per model (untied and tied head): the worst relative loss and absolute weight gaps of EmbRace after
    three Adam steps against plain DDP, with EmbRace's weights as its checkpoint saves them (under every name)."""
    out: dict[str, object] = {}
    for tied_head in (False, True):
        dense = _fit(tied_head, [])
        comm = SparseCommunication("embrace", min_table_rows=VOCAB)
        sharded = _fit(tied_head, [comm])
        checkpoint = {"state_dict": sharded.state_dict()}
        sharded.on_save_checkpoint(checkpoint)  # the whole tables go in through the module's hook
        saved = checkpoint["state_dict"]
        expected = dense.state_dict()
        unsharded = _Module(tied_head)
        unsharded.load_state_dict(saved)  # strict: every name of the unsharded model is there
        out[f"tied={tied_head}"] = {
            "loss": max(abs(a - b) / abs(b) for a, b in zip(sharded.losses, dense.losses, strict=True)),
            "weights": max((saved[name] - value).abs().max().item() for name, value in expected.items()),
            "names": sorted(saved) == sorted(expected),
            "one_table": sharded.model.emb is sharded.model.emb2 and isinstance(sharded.model.emb, ShardedEmbedding),
            "reloaded": (unsharded.model.emb2.weight - expected["model.emb2.weight"]).abs().max().item(),
        }
    return out


@pytest.mark.distributed
def test_embrace_trains_embeddings_sharing_a_weight_like_ddp() -> None:
    """Two ranks: EmbRace on two embeddings sharing a weight (with an untied, then a tied head) against plain DDP."""
    results = run_distributed(embrace_against_ddp, 2, timeout_s=120)
    for result in results:
        for model, check in result.items():
            assert check["loss"] <= 1e-5, (model, check)
            assert check["weights"] <= 1e-5, (model, check)
            assert check["one_table"], model
            assert check["names"], model
            assert check["reloaded"] <= 1e-5, (model, check)


def test_tables_are_grouped_by_the_weight_they_hold() -> None:
    """A second embedding given the weight joins the group even when only the first is named; one module under two
    names does too; an unrelated table is its own group."""
    model = SharedEmbeddings()
    model.alias = model.emb
    model.other = nn.Embedding(VOCAB, HIDDEN)
    assert table_groups(model, ["emb", "other"]) == [["emb", "emb2", "alias"], ["other"]]
    assert table_groups(model, ["emb2", "emb"]) == [["emb", "emb2", "alias"]]


def test_one_sharded_table_trains_and_saves_under_every_name(single_rank_group: dist.ProcessGroup) -> None:
    """The two names (and the tied head) read one table: outputs, an SGD step and the saved weights match the
    unsharded model, and the checkpoint loads into it with every name."""
    torch.manual_seed(0)
    reference = SharedEmbeddings(tied_head=True)
    module = nn.Module()
    module.model = copy.deepcopy(reference)
    comm = SparseCommunication("embrace", tables=["model.emb"])
    comm.sharded_tables = shard_embeddings(module, ["model.emb"], single_rank_group)
    model = module.model
    assert model.emb is model.emb2 and isinstance(model.head, ShardedTiedHead) and model.head.table is model.emb
    assert sorted(comm.sharded_tables) == ["model.emb", "model.emb2"]
    assert [name for name, _ in model.named_parameters()] == ["emb.shard", "body.0.weight", "body.0.bias"]
    ids = _batches()[0]
    for candidate in (reference, model):
        optimizer = torch.optim.SGD(candidate.parameters(), lr=0.5)
        _loss(candidate, ids).backward()
        optimizer.step()
    assert (model(ids) - reference(ids)).abs().max().item() <= 1e-6
    checkpoint = {"state_dict": module.state_dict()}
    whole_tables_in(checkpoint["state_dict"], module, comm.distinct_tables)
    saved = checkpoint["state_dict"]
    assert sorted(saved) == sorted(f"model.{name}" for name in reference.state_dict())
    for name in ("emb", "emb2", "head"):
        assert (saved[f"model.{name}.weight"] - reference.emb.weight).abs().max().item() <= 1e-6
    restored = SharedEmbeddings(tied_head=True)
    restored.load_state_dict({name.removeprefix("model."): value for name, value in saved.items()})
    assert (restored.emb2.weight - reference.emb.weight).abs().max().item() <= 1e-6


def test_embeddings_sharing_a_weight_with_different_padding_are_refused_before_any_work() -> None:
    module = nn.Module()
    module.model = SharedEmbeddings()
    module.model.emb2.padding_idx = 0
    with pytest.raises(ValueError, match=r"model\.emb and model\.emb2.*padding_idx.*method='s2'"):
        SparseCommunication("embrace", min_table_rows=VOCAB).check_tables(module)
    SparseCommunication("s2", min_table_rows=VOCAB).check_tables(module)  # S2 reduces the one Parameter


LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2})


def _llama_module() -> CausalLMModule:
    torch.manual_seed(0)
    return CausalLMModule(build_causal_lm(LLAMA, vocab_size=VOCAB))


def test_delta_overrides_named_in_the_model_as_the_guide_writes_them(tmp_path) -> None:
    """docs/guides/memory.md's ``overrides={"model.layers.0": "recompute"}`` on a CausalLMModule around a Llama:
    the block is ``model.model.layers.0`` of the LightningModule, and the plan recomputes it."""
    callback = DeltaMemory(budget="16MiB", warmup_steps=1, plot=False, swap_dir=str(tmp_path),
                           overrides={"model.layers.0": "recompute"})
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(_llama_module(), DataLoader(TensorDataset(tokens), batch_size=2))
    assert callback.plan.actions["model.model.layers.0"] is Action.RECOMPUTE


def test_delta_overrides_named_in_the_model_before_merak3d_builds_its_layout() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Merak3DStrategy(), logger=False)
    callback = DeltaMemory(overrides={"model.layers.1": "swap"})
    callback.setup(trainer, _llama_module(), "fit")
    assert callback._options.overrides == {"model.model.layers.1": Action.SWAP}


def test_delta_overrides_naming_one_block_twice_are_refused() -> None:
    callback = DeltaMemory(overrides={"model.layers.0": "swap", "model.model.layers.0": "recompute"})
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match=r"model\.model\.layers\.0 twice.*'model\.layers\.0'"):
        callback.setup(trainer, _llama_module(), "fit")
