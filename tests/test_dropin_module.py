"""``Trainer(strategy="merak3d")`` as a drop-in swap: an ordinary LightningModule trains as under ``DDPStrategy``.

The modules here hold a transformers Llama under an attribute of their own choosing and implement none of
merak3d's optional members; their losses (and validation loss) under merak3d must equal DDP's over the same
batches, from the same initial state.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.strategies import Merak3DStrategy
from lightning_merak.testing import DistributedRunError, run_distributed

STEPS, BATCH, SEQ, VOCAB = 4, 8, 8, 64
USED = 8
"""Batches draw from the first ``USED`` tokens only, so the loss falls fast and a wrong gradient shows."""


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False))


class PlainLM(pl.LightningModule):
    """A module as users write it: the model under its own name, its loss from ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _llama()

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.net(batch["input_ids"] if isinstance(batch, dict) else batch[0]).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class TupleLM(PlainLM):
    """Batches ``(input_ids, labels)``."""

    def _loss(self, batch: tuple) -> torch.Tensor:
        input_ids, labels = batch
        return self.net(input_ids, labels=labels).loss


class SmoothedLM(PlainLM):
    """A loss of the logits given through the one documented method (``loss_from_outputs``), which merak3d calls
    per micro-batch instead of replaying the step."""

    def loss_from_outputs(self, outputs, batch: dict) -> torch.Tensor:
        logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
        return F.cross_entropy(logits, batch["labels"][:, 1:].reshape(-1), label_smoothing=0.1)

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.loss_from_outputs(self.net(batch["input_ids"]), batch)


class LogitsLM(PlainLM):
    """A loss of the logits computed inline: merak3d reads it by replaying the step per micro-batch."""

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self.net(batch["input_ids"]).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))


class TwiceLM(PlainLM):
    """Calls its network twice in one step: the replay cannot answer both calls with one micro-batch's outputs."""

    def _loss(self, batch: dict) -> torch.Tensor:
        first, second = self.net(batch["input_ids"]).logits, self.net(batch["input_ids"].flip(1)).logits
        return (first.logsumexp(-1) + second.logsumexp(-1)).mean()


class ManualLM(LogitsLM):
    """Optimizes manually: its step cannot be replayed per micro-batch (it would step the optimizer each time)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: dict, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self._loss(batch))
        optimizer.step()


class _Blocks(nn.Module):
    """A network that is not a transformers model: embedding, repeated blocks, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


class OwnNetworkLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = _Blocks()
        self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.backbone(batch)
        return self.criterion(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(F.gelu(self.up(self.norm(hidden))))


class _SequentialNet(nn.Module):
    """A hand-written network whose blocks sit in an ``nn.Sequential`` called as one module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32)
        self.blocks = nn.Sequential(*(_Residual(32) for _ in range(4)))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


class SequentialLM(PlainLM):
    """A hand-written network with an ``nn.Sequential`` trunk; its loss through ``loss_from_outputs``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _SequentialNet()

    def loss_from_outputs(self, outputs: torch.Tensor, batch: dict) -> torch.Tensor:
        return F.cross_entropy(outputs[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.loss_from_outputs(self.net(batch["input_ids"]), batch)

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.net(batch["input_ids"])


class CriterionLM(PlainLM):
    """A hand-written network scored inline by a criterion module, with an accuracy logged beside the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _SequentialNet()
        self.criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        logits = self.net(batch["input_ids"])[:, :-1].reshape(-1, VOCAB)
        targets = batch["labels"][:, 1:].reshape(-1)
        loss = self.criterion(logits, targets)
        self.log_dict({"train_loss": loss, "train_accuracy": (logits.argmax(-1) == targets).float().mean()},
                      sync_dist=True)
        return {"loss": loss}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        logits = self.net(batch["input_ids"])
        loss = self.criterion(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))
        self.log("val_loss", loss, sync_dist=True)

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.net(batch["input_ids"])


MODULES = {"plain": PlainLM, "tuple": TupleLM, "smoothed": SmoothedLM, "logits": LogitsLM, "sequential": SequentialLM,
           "criterion": CriterionLM, "twice": TwiceLM, "manual": ManualLM}


class _Samples(Dataset):
    def __init__(self, tokens: torch.Tensor, as_tuple: bool) -> None:
        self.tokens, self.as_tuple = tokens, as_tuple

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int):
        ids = self.tokens[index]
        return (ids, ids) if self.as_tuple else {"input_ids": ids, "labels": ids}


class _Data(pl.LightningDataModule):
    """Each data-parallel rank gets its slice of every global batch (the same batches for every strategy)."""

    def __init__(self, as_tuple: bool, first_step: int = 0, last_step: int = STEPS) -> None:
        super().__init__()
        self.as_tuple, self.first_step, self.last_step = as_tuple, first_step, last_step

    def _loader(self, seed: int, steps: int, first: int = 0) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        replicas, rank = kwargs["num_replicas"], kwargs["rank"]
        shard = BATCH // replicas
        tokens = torch.randint(USED, (steps, BATCH, SEQ), generator=torch.Generator().manual_seed(seed))[first:]
        local = tokens[:, rank * shard:(rank + 1) * shard].reshape(-1, SEQ)
        return DataLoader(_Samples(local, self.as_tuple), batch_size=shard, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(3, self.last_step, self.first_step)

    def val_dataloader(self) -> DataLoader:
        return self._loader(4, 2)


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if "train_accuracy" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train_accuracy"]))


def _train_rank(rank: int, world_size: int, kind: str, strategy_kwargs: dict | None, initial: str) -> dict:
    """Fit ``MODULES[kind]`` from the state in ``initial`` (DDP when ``strategy_kwargs`` is None), validating at
    the end of the epoch, then predict; the per-step losses, the validation loss and the first predicted logits."""
    module = MODULES[kind]()
    module.load_state_dict(torch.load(initial, weights_only=True))
    strategy = (DDPStrategy(process_group_backend="gloo") if strategy_kwargs is None
                else Merak3DStrategy(**strategy_kwargs, timeout_s=120))
    recorder = _Losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=[recorder])
    data = _Data(as_tuple=kind == "tuple")
    trainer.fit(module, datamodule=data)
    val_loss = float(trainer.callback_metrics["val_loss"])
    logits = trainer.predict(module, dataloaders=data.val_dataloader())[0]
    replica = strategy.distributed_sampler_kwargs["rank"]
    return {"losses": recorder.losses, "val_loss": val_loss, "logits": logits, "replica": replica}


def _resumed_rank(rank: int, world_size: int, layout: dict, initial: str, checkpoint: str, first_half: bool
                 ) -> list[float]:
    """``PlainLM``'s losses over the first half of the batches, saved to ``checkpoint``; or over the second half,
    resumed from it (the checkpoint's epoch done, the next one reads the rest)."""
    module = PlainLM()
    module.load_state_dict(torch.load(initial, weights_only=True))
    recorder = _Losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
        max_epochs=1 if first_half else 2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[recorder])
    half = STEPS // 2
    data = _Data(False, last_step=half) if first_half else _Data(False, first_step=half)
    trainer.fit(module, datamodule=data, ckpt_path=None if first_half else checkpoint)
    if first_half:
        trainer.save_checkpoint(checkpoint)
    return recorder.losses


@functools.lru_cache(maxsize=None)
def _initial_state(directory: str, kind: str) -> str:
    path = Path(directory) / f"{kind}.pt"
    torch.save(MODULES[kind]().state_dict(), path)
    return str(path)


@functools.lru_cache(maxsize=None)
def _ddp(directory: str, kind: str) -> list[dict]:
    return run_distributed(_train_rank, 2, args=(kind, None, _initial_state(directory, kind)), timeout_s=300)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dropin"))


def _predictions(results: list[dict]) -> torch.Tensor:
    """The logits predicted for the first global batch: each data-parallel replica's samples, in order."""
    by_replica = {result["replica"]: result["logits"] for result in results}
    return torch.cat([by_replica[replica] for replica in sorted(by_replica)])


def _assert_same_run(results: list[dict], ddp: list[dict]) -> None:
    """Every rank's losses and validation loss are DDP's, and the batch's predicted logits."""
    torch.testing.assert_close(_predictions(results), _predictions(ddp), rtol=1e-5, atol=1e-5)
    reference = ddp[0]
    for result in results:
        losses = result["losses"][::len(result["losses"]) // STEPS]  # the losses, without the accuracies
        assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1  # it learns
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        assert result["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("kind, layout", [
    ("plain", {"data_parallel": 2}),
    ("plain", {"tensor_parallel": 2}),
    ("plain", {"data_parallel": 2, "data_parallel_sharding": "optimizer"}),
    ("plain", {"data_parallel": 2, "data_parallel_sharding": "full"}),
    ("plain", {"tensor_parallel": 2, "sequence_parallel": True}),
    ("plain", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("tuple", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("smoothed", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("logits", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("criterion", {"pipeline_parallel": 2, "micro_batches": 4}),
    ("plain", {"pipeline_parallel": 2, "tensor_parallel": 2, "micro_batches": 2}),
    ("sequential", {"pipeline_parallel": 2, "micro_batches": 2}),
    ("sequential", {"pipeline_parallel": 4, "micro_batches": 4}),
], ids=["dp2", "tp2", "dp2-zero1", "dp2-fsdp2", "tp2-sequence", "pp2-inferred", "pp2-tuple", "pp2-loss_from_outputs",
        "pp2-replayed-cross-entropy", "pp2-replayed-criterion-and-logs", "pp2-tp2-sharded-logits",
        "pp2-sequential-trunk", "pp4-sequential-trunk"])
def test_a_plain_module_trains_and_validates_as_under_ddp(state_dir: str, kind: str, layout: dict) -> None:
    """Losses, validation loss and predictions; at pp2×tp2 the inferred loss runs on vocabulary-sharded logits."""
    world_size = layout.get("data_parallel", 1) * layout.get("pipeline_parallel", 1) * layout.get("tensor_parallel", 1)
    results = run_distributed(_train_rank, world_size, args=(kind, layout, _initial_state(state_dir, kind)),
                              timeout_s=300)
    _assert_same_run(results, _ddp(state_dir, kind))


@pytest.mark.distributed
def test_a_checkpoint_of_a_plain_module_resumes_in_another_layout(state_dir: str, tmp_path: Path) -> None:
    """Saved at pp=2 under the module's own names, resumed at dp=2: the run goes on as DDP's."""
    initial, checkpoint, half = _initial_state(state_dir, "plain"), str(tmp_path / "pp2.ckpt"), STEPS // 2
    losses = _ddp(state_dir, "plain")[0]["losses"]
    pipelined = {"pipeline_parallel": 2, "micro_batches": 2}
    first = run_distributed(_resumed_rank, 2, args=(pipelined, initial, checkpoint, True), timeout_s=300)
    assert first[0] == pytest.approx(losses[:half], rel=1e-5)
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    assert "model.net.model.layers.1.mlp.up_proj.weight" in saved  # the module's own names, under merak3d's root
    second = run_distributed(_resumed_rank, 2, args=({"data_parallel": 2}, initial, checkpoint, False), timeout_s=300)
    assert second[0] == pytest.approx(losses[half:], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("kind, refusal", [
    ("twice", "training_step calls self.net more than once"),  # found while replaying, on the last stage
    ("manual", "ManualLM optimizes manually"),  # found before the schedule runs
], ids=["network-called-twice", "manual-optimization"])
def test_a_step_the_replay_cannot_answer_is_refused_on_every_rank_with_the_method_to_add(
        state_dir: str, kind: str, refusal: str) -> None:
    """Refused at the first batch, before any update, on every rank (no hang), with the method to add."""
    layout, initial = {"pipeline_parallel": 2, "micro_batches": 2}, _initial_state(state_dir, kind)
    with pytest.raises(DistributedRunError, match=refusal) as refused:
        run_distributed(_train_rank, 2, args=(kind, layout, initial), timeout_s=120)
    assert f"add this method to {MODULES[kind].__name__}" in str(refused.value)
    assert "    def loss_from_outputs(self, outputs, batch):" in str(refused.value)


def test_the_planner_scores_a_replayed_loss_as_the_step_computes_it() -> None:
    """The loss the planner profiles for a step it cannot read statically is the step's own, on the samples."""
    from lightning_merak.strategies.merak3d.network import module_view

    module = CriterionLM()
    batch = {"input_ids": torch.randint(VOCAB, (4, SEQ)), "labels": torch.randint(VOCAB, (4, SEQ))}
    loss_of = module_view(module, None, 1).planning_loss(batch)
    logits = torch.randn(2, SEQ, VOCAB, requires_grad=True)
    expected = module.criterion(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:2, 1:].reshape(-1))
    torch.testing.assert_close(loss_of(logits, 2), expected)
    assert "log" not in vars(module) and "forward" not in vars(module.net)  # the replay put everything back


# Refused before any work -----------------------------------------------------------------------------------------

def test_nothing_is_required_with_or_without_pipeline_stages() -> None:
    """Any attribute name; no member of the contract; a network that is not a transformers model, its loss inline."""
    Merak3DStrategy(data_parallel=2).validate_before_launch(OwnNetworkLM(), 2, batch_size=8)
    Merak3DStrategy(pipeline_parallel=2).validate_before_launch(OwnNetworkLM(), 2, batch_size=8)
    Merak3DStrategy(tensor_parallel=2).validate_before_launch(PlainLM(), 2, batch_size=8)
    Merak3DStrategy(pipeline_parallel=2).validate_before_launch(PlainLM(), 2, batch_size=8)


def test_two_networks_are_refused_naming_them() -> None:
    module = PlainLM()
    module.draft = _llama()
    with pytest.raises(TypeError, match="holds several \\(net, draft\\); hold the one to split as `self.model`"):
        Merak3DStrategy(tensor_parallel=2).validate_before_launch(module, 2, batch_size=8)


def test_a_module_without_a_network_trains_only_without_splits() -> None:
    class NoNetwork(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

    Merak3DStrategy(data_parallel=2).validate_before_launch(NoNetwork(), 2, batch_size=8)
    with pytest.raises(TypeError, match="finds none among NoNetwork's children"):
        Merak3DStrategy(tensor_parallel=2).validate_before_launch(NoNetwork(), 2, batch_size=8)


def test_the_strategy_is_exported_from_the_packages() -> None:
    import lightning_merak
    import lightning_merak.strategies
    from lightning_merak.strategies.merak3d.strategy import Merak3DStrategy as defined

    assert lightning_merak.Merak3DStrategy is lightning_merak.strategies.Merak3DStrategy is defined
