"""Users' own LightningModules under merak3d's pipeline and tensor parallelism.

What their hooks read of the network once it is cut into stages (``self.model.blocks`` in ``configure_optimizers``
is this rank's part of it; a loss term over the network's parameters in the replayed ``training_step`` is
refused, since the last stage holds only its own), a hidden state a model hands its blocks as a transposed view,
and torch's fused evaluation kernels of ``nn.TransformerEncoderLayer`` at ``tensor_parallel=2``. Each distributed
run is compared with the same module trained in one process.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_merak import testing
from lightning_merak.parallel.pipeline.stage import RankStages, RemovedModule, build_stage_module
from lightning_merak.parallel.pipeline.trace import trace_model
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.block_splits import keep_off_fused_kernels
from lightning_merak.strategies.merak3d.build import call_model
from lightning_merak.strategies.merak3d.step_replay import StepReplay
from lightning_merak.testing.compare import StepLosses

WIDTH, FEATURES, BATCH, STEPS = 16, 8, 8, 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.lin(hidden))


class _MLPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.out(hidden)


class Regression(pl.LightningModule):
    """A regression module as users write it: the network as ``self.model``, the loss in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _MLPNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class GroupedRegression(Regression):
    """Learning rates per submodule (the trunk's below the head's), one group per submodule, and a scheduler."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD([{"params": self.model.blocks.parameters(), "lr": 0.02},
                                     {"params": self.model.inp.parameters(), "lr": 0.05},
                                     {"params": list(self.model.out.parameters()), "lr": 0.1}], momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}


class HeadOnlyRegression(Regression):
    """Trains the head alone: an optimizer whose parameters all live on the last stage."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.out.parameters(), lr=0.1)


class HeadOnlyGroupRegression(Regression):
    """The head alone as a parameter group (empty on the first stage)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([{"params": self.model.out.parameters()}], lr=0.1)


class PenalizedRegression(Regression):
    """An explicit L2 term over the network's parameters in the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        penalty = sum((param ** 2).sum() for param in self.model.parameters())
        return F.mse_loss(self.model(x), y) + 1e-2 * penalty


class _TransposedBlock(nn.Module):
    """Reads its input transposed, with no residual: its input gradient is a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, FEATURES)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(hidden.transpose(1, 2))).transpose(1, 2)


class _TransposedNet(_MLPNet):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(_TransposedBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).mean((1, 2))


class TransposedRegression(Regression):
    """Rows of ``FEATURES`` vectors of 4, through blocks that read them transposed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _TransposedNet()


class _PatchNet(nn.Module):
    """A conv patch embedding handing ``nn.TransformerEncoder`` a transposed (non-contiguous) view."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 2, 2)
        self.pos = nn.Parameter(torch.randn(1, 16, 32) * 0.02)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.encoder(hidden).mean(1))


class PatchClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _PatchNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        self.log("val_loss", F.cross_entropy(self.model(images), labels))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _samples(module: pl.LightningModule) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    count = BATCH * STEPS
    if isinstance(module, PatchClassifier):
        images = torch.randn(count, 3, 8, 8, generator=generator)
        return list(zip(images, torch.randint(5, (count,), generator=generator)))
    if isinstance(module, TransposedRegression):
        x = torch.randn(count, FEATURES, 4, generator=generator)
        return list(zip(x, x.sum((1, 2)) * 0.1))
    x = torch.randn(count, FEATURES, generator=generator)
    return list(zip(x, x[:, :1] * 2 - x[:, 1:2]))


def _run(module_class: type, strategy: Optional[dict[str, Any]], devices: int = 1, evaluate: bool = False
         ) -> dict[str, Any]:
    """Fit ``module_class`` on the same batches (every rank the whole batch: no data parallelism), then validate and
    predict where ``evaluate``: the losses, the validation loss, the first batch's predictions."""
    module = module_class()
    samples = _samples(module)
    recorder = StepLosses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
        use_distributed_sampler=False,
        **({"strategy": Merak3DStrategy(**strategy, timeout_s=60)} if strategy is not None else {}))
    trainer.fit(module, DataLoader(samples, batch_size=BATCH))
    result: dict[str, Any] = {"losses": recorder.losses}
    if evaluate:
        batches = DataLoader(samples[:BATCH], batch_size=BATCH)
        result["val_loss"] = trainer.validate(module, batches, verbose=False)[0]["val_loss"]
        result["predictions"] = trainer.predict(module, batches)[0]
        result["fast_path"] = torch.backends.mha.get_fastpath_enabled()
    return result


def _rank(rank: int, world_size: int, module_class: type, strategy: dict[str, Any], evaluate: bool) -> dict:
    return _run(module_class, strategy, world_size, evaluate)


PP2 = {"pipeline_parallel": 2, "micro_batches": 2, "partition": "uniform"}


# Without processes ------------------------------------------------------------------------------------------


def test_network_attributes_resolve_to_the_parts_of_this_ranks_stages():
    """Two stages of four on one rank (an interleaved schedule): ``blocks`` is their blocks, one block the stage's
    that holds it, a module held on other ranks one without parameters."""
    model = _MLPNet()
    trace = trace_model(model, torch.randn(2, FEATURES), call_model, profile=False)
    copies = [_MLPNet(), model]
    copies[0].load_state_dict(model.state_dict())
    stages = RankStages([build_stage_module(copy, trace, (0, 2, 3, 4), index, call_model)
                         for copy, index in zip(copies, (0, 2))])
    first, third = stages[0].net, stages[1].net
    assert {id(param) for param in stages.blocks.parameters()} == {
        id(param) for block in (first.blocks[0], third.blocks[2]) for param in block.parameters()}
    assert stages.blocks[2] is third.blocks[2] and stages.blocks[0].lin is first.blocks[0].lin
    assert len(stages.blocks) == 4 and not list(stages.blocks[1].parameters())
    assert stages.inp is first.inp and isinstance(stages.out, RemovedModule) and not list(stages.out.parameters())
    assert [type(block) is _Block for block in stages.blocks] == [True, False, True, False]
    with pytest.raises(AttributeError):
        stages.forward_hidden_size  # noqa: B018 - no module or tensor of the network


def test_a_stage_sends_a_transposed_hidden_state_contiguous():
    model = _PatchNet()
    images = torch.randn(2, 3, 8, 8)
    trace = trace_model(model, images, call_model, profile=False)
    stage = build_stage_module(model, trace, (0, 2), 0, call_model)
    outputs = stage(images)
    assert outputs and all(output.is_contiguous() for output in outputs)


def test_a_replayed_step_reading_the_networks_parameters_is_refused():
    """The replay (the last stage's loss) refuses a loss term over the network's parameters, naming the fix; the
    loss of the outputs alone is replayed as it is."""
    x, y = torch.randn(4, FEATURES), torch.randn(4, 1)
    for module_class, refused in ((PenalizedRegression, True), (Regression, False)):
        module = module_class()
        replay = StepReplay(module, module.model, lambda logits: logits, ((0,), {}), "model")
        logits = module.model(x)
        loss = replay.score(logits, (x, y))
        if refused:
            assert replay.error is not None and "reads the network's parameters" in replay.error
            assert "weight_decay" in replay.error and "pipeline_parallel=1" in replay.error
        else:
            assert replay.error is None and torch.allclose(loss, F.mse_loss(logits, y))


def test_split_blocks_run_torchs_fused_kernels_off_and_other_models_on():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    seen: list[bool] = []
    layer.self_attn.register_forward_pre_hook(lambda *_: seen.append(torch.backends.mha.get_fastpath_enabled()))
    keep_off_fused_kernels(nn.ModuleList([layer]))
    with torch.no_grad():
        layer(torch.randn(2, 4, 32))
        with pytest.raises(AssertionError):  # a width the layer refuses: the switch is still put back
            layer(torch.randn(2, 4, 31))
    assert seen == [False, False] and torch.backends.mha.get_fastpath_enabled()


# Distributed, against one process ---------------------------------------------------------------------------


@pytest.mark.distributed
def test_param_groups_by_submodule_train_at_pp2_as_one_process():
    """``self.model.blocks`` / ``.inp`` / ``.out`` in ``configure_optimizers`` are this rank's parts (a group of
    parameters all on the other stage is empty here), and train with their own rates and schedule as in one
    process."""
    reference = _run(GroupedRegression, None)
    results = testing.run_distributed(_rank, 2, args=(GroupedRegression, PP2, False), timeout_s=120)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_an_optimizer_of_another_stages_parameters_is_refused_on_every_rank_and_a_group_of_them_trains():
    with pytest.raises(testing.DistributedRunError) as refused:
        testing.run_distributed(_rank, 2, args=(HeadOnlyRegression, PP2, False), timeout_s=120)
    assert "all live on other pipeline stages" in str(refused.value) and "parameter group" in str(refused.value)
    reference = _run(HeadOnlyGroupRegression, None)
    results = testing.run_distributed(_rank, 2, args=(HeadOnlyGroupRegression, PP2, False), timeout_s=120)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_a_loss_term_over_the_networks_parameters_is_refused_at_pp2_on_every_rank():
    with pytest.raises(testing.DistributedRunError) as refused:
        testing.run_distributed(_rank, 2, args=(PenalizedRegression, PP2, False), timeout_s=120)
    assert "reads the network's parameters" in str(refused.value)


@pytest.mark.distributed
def test_a_transposed_patch_embedding_trains_at_pp2_as_one_process():
    reference = _run(PatchClassifier, None)
    results = testing.run_distributed(_rank, 2, args=(PatchClassifier, PP2, False), timeout_s=120)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_transposed_input_gradients_train_under_interleaved_zero_bubble_as_one_process():
    """The zero-bubble input backward's gradient of a block reading its input transposed is a transposed view: it
    is received (its metadata) and sent contiguous."""
    reference = _run(TransposedRegression, None)
    strategy = {**PP2, "micro_batches": 4, "schedule": "interleaved_zero_bubble", "virtual_stages": 2}
    results = testing.run_distributed(_rank, 2, args=(TransposedRegression, strategy, False), timeout_s=120)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_transformer_encoder_layers_validate_and_predict_at_tp2_as_one_process():
    """After a fit at tensor_parallel=2, eval-mode validation and prediction (torch's fused kernels off in the split
    blocks only) match one process, and torch's switch is on again afterwards."""
    reference = _run(PatchClassifier, None, evaluate=True)
    results = testing.run_distributed(_rank, 2, args=(PatchClassifier, {"tensor_parallel": 2}, True), timeout_s=120)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["val_loss"], reference["val_loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["predictions"], reference["predictions"], rtol=1e-5, atol=1e-5)
        assert result["fast_path"]
