"""Buffers a training forward changes (a BatchNorm-like running statistic and a step counter) under merak3d.

They count the training micro-batches only: not the build's traced and timed forwards, nor torch's pipeline metadata
inference (which runs a stage past the first on ``torch.empty`` inputs, on the first step and after each switch from
evaluation back to training). Data-parallel replicas keep them equal as Lightning's DDP does, sending only the
buffers training changes.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.pipelining import Schedule1F1B
from torch.utils.data import DataLoader, DistributedSampler

from lightning_merak.parallel.pipeline.schedules import BufferKeepingStage, EarlyReceiveStage
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from lightning_merak.util.buffers import buffer_snapshot, buffers_kept, changed_buffers

VOCAB, SEQ, HIDDEN, STEPS, BATCH, LR = 32, 8, 16, 3, 4, 0.5


class _StatBlock(nn.Module):
    """A residual block keeping a running mean of its input (used in evaluation, as BatchNorm's) and a counter."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.register_buffer("running", torch.zeros(HIDDEN))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.5).add_(0.5 * hidden.mean((0, 1)))
                self.count.add_(1)
            center = hidden.mean(-1, keepdim=True)
        else:
            center = self.running
        hidden = hidden - center
        return hidden + self.down(F.gelu(self.up(self.norm(hidden))))


class _StatNet(nn.Module):
    """Embedding, two stat blocks, head; constant buffers (position ids, a scale) training leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.register_buffer("position_ids", torch.arange(SEQ).unsqueeze(0), persistent=False)
        self.register_buffer("scale", torch.full((HIDDEN,), 0.5))
        self.blocks = nn.ModuleList(_StatBlock() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids) * self.scale + self.pos(self.position_ids[:, : ids.shape[1]])
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


def _loss(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class _StatModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _StatNet()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return _loss(self.net, batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", _loss(self.net, batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _tokens(samples: int, seed: int) -> torch.Tensor:
    return torch.randint(VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))


def _stats(module: nn.Module) -> dict[str, torch.Tensor]:
    """The blocks' running statistics and counters by ``<block>.<buffer>`` (a pipeline stage holds its blocks)."""
    return {name.split("blocks.")[-1]: tensor.detach().clone() for name, tensor in module.named_buffers()
            if name.endswith(("running", "count"))}


def _train_rank(rank: int, world_size: int, strategy: str, layout: dict) -> dict:
    replicas = layout.get("data_parallel", 1)
    chosen = DDPStrategy(process_group_backend="gloo") if strategy == "ddp" else Merak3DStrategy(**layout, timeout_s=60)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=chosen, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = _StatModule()
    trainer.fit(module, DataLoader(_tokens(STEPS * BATCH, 3), batch_size=BATCH // replicas),
                DataLoader(_tokens(2 * BATCH, 4), batch_size=BATCH // replicas))
    changing = getattr(trainer.strategy, "_replica_buffers", None)
    return {"stats": _stats(module), "val_loss": float(trainer.callback_metrics["val_loss"]),
            "sent": sorted(name for _, name in changing._changing or []) if changing is not None else None,
            "micro_batches": getattr(trainer.strategy, "micro_batches", 1)}


def _one_process(micro_batches: int) -> dict:
    """The same training in one process (the samples in the order Lightning's sampler gives one replica): each step's
    gradient the mean of its micro-batches' (the statistic updated once per micro-batch, as gradient accumulation
    would), then the mean validation loss."""
    net = _StatNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    samples = _tokens(STEPS * BATCH, 3)
    order = list(DistributedSampler(samples, num_replicas=1, rank=0, shuffle=True, seed=0))  # Lightning's, at one
    for batch in samples[order].split(BATCH):
        optimizer.zero_grad()
        for micro in batch.chunk(micro_batches):
            (_loss(net, micro) / micro_batches).backward()
        optimizer.step()
    net.eval()
    with torch.no_grad():
        val_loss = torch.stack([_loss(net, batch) for batch in _tokens(2 * BATCH, 4).split(BATCH)]).mean()
    return {"stats": _stats(net), "val_loss": float(val_loss)}


def _assert_same(result: dict, reference: dict) -> None:
    assert result["stats"].keys() <= reference["stats"].keys()
    for name, tensor in result["stats"].items():
        torch.testing.assert_close(tensor, reference["stats"][name], rtol=0, atol=1e-6, msg=name)
    assert result["val_loss"] == pytest.approx(reference["val_loss"], rel=0, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("layout, micro_batches", [
    ({"pipeline_parallel": 2, "micro_batches": 2, "data_parallel": 1}, 2),
    ({"pipeline_parallel": 2, "micro_batches": 2, "data_parallel": 1, "schedule": "shifted_critical_path"}, 2),
    ({"tensor_parallel": 2, "data_parallel": 1}, 1),
    ({"pipeline_parallel": "auto", "data_parallel": 1}, None),
], ids=["pp2", "pp2-shifted", "tp2", "planned-pp2"])
def test_statistics_count_the_training_micro_batches_only(layout, micro_batches):
    """Not the build's trace and profiling (~15 forwards), the planner's profile (~85), the stages' metadata
    inference (on garbage inputs past the first stage) nor the shifted schedule's recomputed forwards."""
    results = run_distributed(_train_rank, 2, args=("merak3d", layout), timeout_s=120)
    micro_batches = micro_batches or results[0]["micro_batches"]  # the planner's choice
    reference = _one_process(micro_batches)
    for result in results:
        _assert_same(result, reference)
    held = {name for result in results for name in result["stats"]}
    assert held == set(reference["stats"]) and reference["stats"]["0.count"] == STEPS * micro_batches


@pytest.mark.distributed
def test_data_parallel_replicas_keep_the_buffers_ddp_keeps_sending_only_those_training_changes():
    layout = {"data_parallel": 2}
    merak = run_distributed(_train_rank, 2, args=("merak3d", layout), timeout_s=120)
    ddp = run_distributed(_train_rank, 2, args=("ddp", layout), timeout_s=120)
    for result, reference in zip(merak, ddp, strict=True):
        assert result["stats"].keys() == reference["stats"].keys()
        _assert_same(result, reference)
        assert result["sent"] == ["count", "count", "running", "running"]  # not position_ids nor scale


# Single process --------------------------------------------------------------------------------------------


def test_buffers_kept_restores_values_and_tensors_and_leaves_untouched_buffers_alone():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    module.register_buffer("constant", torch.ones(2))
    before = {name: tensor.clone() for name, tensor in module.named_buffers()}
    tensors = dict(module.named_buffers())
    versions = {name: tensor._version for name, tensor in module.named_buffers()}
    with buffers_kept(module):
        module.train()
        module(torch.randn(4, 3))
        module[1].num_batches_tracked = module[1].num_batches_tracked + 5  # a forward may replace a buffer
        module.register_buffer("added", torch.zeros(1))
        assert not torch.equal(module[1].running_mean, before["1.running_mean"])
    for name, tensor in module.named_buffers():
        if name == "added":
            continue
        assert tensor is tensors[name], name
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    assert module.constant._version == versions["constant"]  # not written back: its version says untouched
    assert hasattr(module, "added")


def test_buffers_kept_leaves_a_graph_built_inside_differentiable():
    """torch's metadata inference differentiates the forward it ran after the buffers are back: a buffer the forward
    updated and then used must not read as modified since."""

    class UpdateThenUse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("ema", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(x.detach().mean(0))
            return x * self.ema

    module = UpdateThenUse()
    x = torch.randn(2, 3, requires_grad=True)
    with buffers_kept(module):
        output = module(x)
    output.sum().backward()
    torch.testing.assert_close(module.ema, torch.ones(3))
    assert x.grad is not None


def test_changed_buffers_finds_writes_and_replacements_and_leaves_out_ignored_and_expert_buffers():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("written", torch.zeros(2))
            self.register_buffer("replaced", torch.zeros(2))
            self.register_buffer("constant", torch.zeros(2))
            self.register_buffer("ignored", torch.zeros(2))

    root = Holder()
    root.experts = Holder()
    root.experts.weight = nn.Parameter(torch.ones(2))
    root.experts.weight.allreduce = False  # an expert-parallel module: each rank holds its own experts
    root.norm = nn.BatchNorm1d(2, track_running_stats=True)
    root._ddp_params_and_buffers_to_ignore = ["ignored", "norm.num_batches_tracked"]
    snapshot = buffer_snapshot(root)
    assert sorted(name for _, name in snapshot) == ["constant", "replaced", "running_mean", "running_var", "written"]
    root.written.add_(1)
    root.replaced = torch.ones(2)
    root.ignored.add_(1)
    root.experts.written.add_(1)
    root.norm(torch.randn(4, 2))  # its kernel writes the running statistics without counting a version
    assert sorted(name for _, name in changed_buffers(snapshot)) == ["replaced", "running_mean", "running_var",
                                                                      "written"]


@pytest.mark.parametrize("stage_class", [BufferKeepingStage, EarlyReceiveStage])
def test_pipeline_metadata_inference_leaves_the_stage_buffers_alone(stage_class, single_rank_group):
    """A one-stage pipeline: the statistic counts each micro-batch once, on the first step and after evaluation
    (torch infers the shapes again when the schedule switches back to training)."""
    block = _StatBlock()
    reference = _StatBlock()
    reference.load_state_dict(block.state_dict())
    stage = stage_class(block, 0, 1, torch.device("cpu"), group=single_rank_group)
    schedule = Schedule1F1B(stage, 2, loss_fn=lambda output, target: output.sum(), scale_grads=False)
    inputs = torch.randn(4, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        block.train()
        schedule.step(inputs, target=inputs, losses=[])
        for micro in inputs.chunk(2):
            reference(micro)
        block.eval()
        with torch.no_grad():
            schedule.eval(inputs, target=inputs, losses=[])
    assert int(block.count) == 4
    torch.testing.assert_close(block.running, reference.running, rtol=0, atol=1e-6)
